// GPU tests of pinned memory and transfers: run on a machine with a CUDA device, reported as Skipped elsewhere.
#include <gpukit/gpukit.hpp>

#include "support.hpp"
#include "transfer/transfer_support.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
constexpr std::size_t MiB = 1024 * 1024;

std::vector<std::uint32_t> iota(std::size_t n, std::uint32_t start) {
  std::vector<std::uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

double gb_per_s(std::size_t bytes, std::chrono::steady_clock::duration d) {
  return static_cast<double>(bytes) / std::chrono::duration<double>(d).count() / 1e9;
}
}  // namespace

TEST_CASE("gpu: pinned buffers, mapped memory and registrations are page-locked, and the pointer query says so") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_buffer<float> b(1000, d);
  CHECK(b.page_locked());
  CHECK(gpukit::detail::query_pointer(b.data()).kind == gpukit::detail::pointer_kind::pinned);
  // Under unified addressing every page-locked allocation is mapped, at its host address; without it only mapped ones.
  if (gpukit::properties(d).unified_addressing) {
    CHECK(b.device_pointer() == b.data());
  } else {
    CHECK_THROWS_AS((void)b.device_pointer(), gpukit::invalid_argument_error);
  }
  gpukit::pinned_flags mapped;
  mapped.mapped = true;
  gpukit::pinned_buffer<float> m(1000, d, mapped);
  CHECK(m.device_pointer() != nullptr);
  std::vector<char> pageable(1 << 20);
  CHECK(gpukit::detail::query_pointer(pageable.data()).kind == gpukit::detail::pointer_kind::pageable);
  {
    gpukit::host_registration r(pageable.data(), pageable.size(), d);
    CHECK(r.registered());
    CHECK(gpukit::detail::query_pointer(pageable.data()).kind == gpukit::detail::pointer_kind::pinned);
  }
  CHECK(gpukit::detail::query_pointer(pageable.data()).kind == gpukit::detail::pointer_kind::pageable);
  gpukit::stream s(d);
  gpukit::device_buffer<float> dev(10, s);
  const auto info = gpukit::detail::query_pointer(dev.data());
  CHECK(info.kind == gpukit::detail::pointer_kind::device);
  CHECK(info.device == 0);
}

TEST_CASE("gpu: round trips of every size, pageable and pinned, at unaligned offsets") {
  GPUKIT_REQUIRE_GPU();
  gpukit::stream s(gpukit::device::cuda(0));
  const std::size_t chunk = gpukit::default_staging_engine(gpukit::device::cuda(0)).options().chunk_bytes / 4;
  for (std::size_t n : {std::size_t{1}, chunk - 1, chunk, chunk + 1, 10 * chunk + 3}) {
    CAPTURE(n);
    const auto host = iota(n + 1, static_cast<std::uint32_t>(n));
    gpukit::device_buffer<std::uint32_t> a(n + 1, s);
    gpukit::device_buffer<std::uint32_t> b(n + 1, s);
    gpukit::device_span<std::uint32_t> da(a);
    gpukit::copy_async(da.subspan(1, n), gpukit::host_span<const std::uint32_t>(host).subspan(1, n), s);
    gpukit::copy_async(gpukit::device_span<std::uint32_t>(b).subspan(0, n), da.subspan(1, n), s);
    std::vector<std::uint32_t> back(n);
    gpukit::copy_async(back, gpukit::device_span<std::uint32_t>(b).subspan(0, n), s);
    gpukit::pinned_buffer<std::uint32_t> pinned(n, gpukit::device::cuda(0));
    gpukit::copy_async(pinned, gpukit::device_span<std::uint32_t>(b).subspan(0, n), s);
    s.synchronize();
    CHECK(std::equal(back.begin(), back.end(), host.begin() + 1));
    CHECK(std::equal(pinned.begin(), pinned.end(), host.begin() + 1));
  }
}

TEST_CASE("gpu: real device and host pointers in the wrong place are rejected") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<int> dev(100, s);
  std::vector<int> host(100);
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(host.data(), 100, d), host, s),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::copy_async(dev, gpukit::host_span<const int>(dev.data(), 100), s),
                  gpukit::invalid_argument_error);
  gpukit::stream cpu_stream(gpukit::device::cpu());
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(host.data(), 100, gpukit::device::cpu()),
                                     gpukit::host_span<const int>(dev.data(), 100), cpu_stream),
                  gpukit::invalid_argument_error);
}

TEST_CASE("gpu: a pageable transfer larger than the ring on a stream held by a host function does not deadlock") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit_test::gate g;
  g.hold(s);
  const auto host = iota(64 * MiB / 4, 3);  // 8 chunks of 8 MiB, 4 slots
  gpukit::device_buffer<std::uint32_t> dev(host.size(), s);
  gpukit::copy_async(dev, host, s);  // returns after the patience; a gpukit thread stages the rest
  g.open();
  CHECK(gpukit::to_host(dev, s) == host);
}

TEST_CASE("gpu: staged copies on one stream complete while a host function holds another stream of the device") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream a(d);
  gpukit::stream b(d);
  // A user's host function that waits for the test: CUDA may run the host functions of all streams of a device one
  // at a time (the simulator does), so nothing of b's staged copies may depend on a host function running.
  gpukit_test::gate g;
  g.hold(a);
  const auto host = iota(24 * MiB / 4, 9);  // several chunks each way
  gpukit::device_buffer<std::uint32_t> dev(host.size(), b);
  std::vector<std::uint32_t> back(host.size(), 0);
  std::atomic<int> phase{0};
  std::thread user([&] {
    gpukit::copy_async(dev, host, b);  // pageable -> device
    b.synchronize();
    phase = 1;
    gpukit::copy_async(back, dev, b);  // device -> pageable
    b.synchronize();
    phase = 2;
  });
  for (int i = 0; i < 1000 && phase.load() < 2; ++i) std::this_thread::sleep_for(10ms);
  const int reached = phase.load();
  CHECK_MESSAGE(reached == 2, "phase " << reached
                                       << ": 0 = the host-to-device copy, 1 = the device-to-host copy "
                                          "did not complete while another stream's host function ran");
  g.open();
  user.join();
  CHECK(back == host);
}

TEST_CASE("gpu: staging pins no more than its ring while 320 MiB of pageable copies wait behind a held stream") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool);  // 4 + 2 slots of 8 MiB
  const std::size_t bound = engine.max_pinned_bytes_per_stream();
  CHECK(bound == 48 * MiB);
  gpukit::stream s(d);
  gpukit_test::gate g;
  g.hold(s);  // opened only after the copies returned: they must neither wait for it nor pin what they carry
  const auto first = iota(256 * MiB / 4, 1);
  const auto second = iota(64 * MiB / 4, 2);
  gpukit::device_buffer<std::uint32_t> a(first.size(), s);
  gpukit::device_buffer<std::uint32_t> b(second.size(), s);
  gpukit::copy_async(a, first, s, engine);
  gpukit::copy_async(b, second, s, engine);  // queued behind the first's rest
  CHECK(pool.stats().reserved_bytes_peak <= bound);
  g.open();
  std::vector<std::uint32_t> back(first.size());
  gpukit::copy_async(back, a, s, engine);
  CHECK(back == first);
  back.resize(second.size());
  gpukit::copy_async(back, b, s, engine);
  CHECK(back == second);
  const auto ps = pool.stats();
  CHECK(ps.reserved_bytes_peak <= bound);
  CHECK(ps.allocated_bytes_peak <= bound);
}

TEST_CASE("gpu: the pinned pool pins once, then serves from the cache after the stream's events") {
  GPUKIT_REQUIRE_GPU();
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  CHECK(pool.page_locked());
  gpukit::stream s(gpukit::device::cuda(0));
  for (int i = 0; i < 10; ++i) {
    void* p = pool.allocate(4 * MiB);
    pool.deallocate(p, s);
    s.synchronize();
  }
  const auto st = pool.stats();
  CHECK(st.upstream_allocations == 1);
  CHECK(st.cache_hits == 9);
  CHECK(st.pinning_time.count() > 0);
}

// Rates are printed, not asserted (no timed tests): bench_transfer and examples/bandwidth_test hold the targets.
TEST_CASE("gpu: large uploads, pinned and staged from pageable memory, arrive intact, and their rates are printed") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  // 256 MiB: many times the upload ring (4 slots of 8 MiB), and long enough for a rate. The sanitizers instrument
  // each byte filled and compared (minutes for 256 MiB); there, 40 MiB still reuses a slot within one copy.
  const std::size_t bytes = gpukit_test::sanitized_build ? 40 * MiB : 256 * MiB;
  gpukit::device_buffer<char> dev(bytes, s);
  gpukit::pinned_buffer<char> pinned(bytes, d);
  std::vector<char> pageable(bytes);
  for (std::size_t i = 0; i < bytes; ++i) pageable[i] = static_cast<char>(i * 131 + (i >> 20));
  for (std::size_t i = 0; i < bytes; ++i) pinned.data()[i] = static_cast<char>(~pageable[i]);  // tells them apart
  std::vector<char> back(bytes);
  auto time = [&](const char* source, auto&& copy) {
    copy();  // warm-up (ring slots, pool blocks)
    s.synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i) copy();
    s.synchronize();
    const double rate = gb_per_s(3 * bytes, std::chrono::steady_clock::now() - start);
    std::fill(back.begin(), back.end(), 0);
    gpukit::copy_async(back, dev, s);
    s.synchronize();
    CHECK(std::memcmp(back.data(), source, bytes) == 0);
    return rate;
  };
  const double pinned_rate = time(pinned.data(), [&] { gpukit::copy_async(dev, pinned, s); });
  const double pageable_rate = time(pageable.data(), [&] { gpukit::copy_async(dev, pageable, s); });
  MESSAGE("H2D pinned " << pinned_rate << " GB/s, pageable staged " << pageable_rate << " GB/s");
}

TEST_CASE("gpu: the prefetcher feeds a CUDA stream") {
  GPUKIT_REQUIRE_GPU();
  gpukit::stream s(gpukit::device::cuda(0));
  gpukit::prefetcher<std::uint32_t> loader(s, 1 << 20, [](std::size_t i, gpukit::span<std::uint32_t> out) {
    if (i == 8) return std::size_t{0};
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = static_cast<std::uint32_t>(i + k);
    return out.size();
  });
  std::size_t n = 0;
  while (auto batch = loader.next()) {
    std::vector<std::uint32_t> back = gpukit::to_host(batch->data(), s);
    CHECK(back[0] == batch->index());
    CHECK(back.back() == batch->index() + back.size() - 1);
    ++n;
  }
  CHECK(n == 8);
}

TEST_CASE("gpu: a bounded prefetcher with 2 producer threads: batches in order, intact, within its pinned budget") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  constexpr std::size_t batches = 32;
  gpukit::prefetch_options options;
  options.producer_threads = 2;
  gpukit::prefetcher<std::uint32_t> loader(
      s, 1 << 18,
      [](std::size_t i, gpukit::span<std::uint32_t> out) {
        if (i == batches) return std::size_t{0};
        const std::size_t n = out.size() - i;
        for (std::size_t k = 0; k < n; ++k) out[k] = static_cast<std::uint32_t>(i * 1000003 + k);
        return n;
      },
      options);
  gpukit::pinned_buffer<std::uint32_t> probe(2 * batches, d);  // each batch's first and last element, copied back
  std::size_t n = 0;
  while (auto batch = loader.next()) {
    CHECK(batch->index() == n);
    gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * n, 1), batch->data().first(1), s);
    gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * n + 1, 1), batch->data().last(1), s);
    ++n;
  }
  s.synchronize();
  REQUIRE(n == batches);
  for (std::size_t i = 0; i < batches; ++i) {
    const std::size_t count = (std::size_t{1} << 18) - i;
    CHECK(probe.data()[2 * i] == static_cast<std::uint32_t>(i * 1000003));
    CHECK(probe.data()[2 * i + 1] == static_cast<std::uint32_t>(i * 1000003 + count - 1));
  }
  gpukit::prefetch_stats stats = loader.stats();
  MESSAGE("prefetcher: " << stats.to_string());
  CHECK(stats.pinned_buffers <= 4);  // prefetch_factor 2 × 2 threads
  // The other producer thread may still be producing an index past the end when next() reports it (a callback may
  // run beyond the end with several threads); once it sees the end its buffer is free. Bounded wait, not a timing.
  for (int i = 0; i < 10000 && stats.batches_in_flight != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stats = loader.stats();
  }
  CHECK(stats.batches_in_flight == 0);
}

TEST_CASE("gpu: copy_async without a stream: the current streams, and across two devices both are ordered") {
  GPUKIT_REQUIRE_GPU();
  const auto d0 = gpukit::device::cuda(0);
  gpukit::stream s0(d0);
  const auto host = iota(MiB, 5);
  gpukit::device_buffer<std::uint32_t> a(host.size(), s0);
  {
    gpukit::stream_guard guard(s0);
    gpukit::copy_async(a, host);  // host to device on s0
    std::vector<std::uint32_t> back(host.size());
    gpukit::copy_async(back, a);  // device to pageable host: waits for s0
    CHECK(back == host);
  }
  if (gpukit::device_count() < 2) {
    MESSAGE("one CUDA device: the cross-device part needs two");
    s0.synchronize();
    return;
  }
  const auto d1 = gpukit::device::cuda(1);
  gpukit::stream s1(d1);
  gpukit::device_buffer<std::uint32_t> b(host.size(), s1);
  gpukit_test::gate g;
  g.hold(s1);  // the destination device's current stream is busy, and its next work overwrites b
  gpukit::pinned_buffer<std::uint32_t> zeros(host.size(), d1);
  std::fill(zeros.begin(), zeros.end(), 0u);
  gpukit::copy_async(b, zeros, s1);  // pinned: enqueued behind the gate
  {
    gpukit::stream_guard guard0(s0);
    gpukit::stream_guard guard1(s1);
    gpukit::copy_async(b, a);  // on s0 (the source's), after s1's earlier work: after the zeros
  }
  // The copy must wait for the gate: s0 stays busy (had it not waited, it would finish here, and the zeros would
  // then overwrite its result). Polling bounds the wait; no outcome depends on timing.
  for (int i = 0; i < 100 && !s0.ready(); ++i) std::this_thread::sleep_for(2ms);
  CHECK_FALSE(s0.ready());
  g.open();
  std::vector<std::uint32_t> back(host.size());
  gpukit::copy_async(back, b, s1);  // on s1, which waits for the copy
  CHECK(back == host);
  s0.synchronize();
}
