// copy_async on the CPU device: every direction over spans, containers and buffers, the path taken (one copy for
// pinned memory, staging for pageable), stream order, and each kind of bad input — with the CUDA pointer query
// replaced by a fake so the host/device checks are exercised without a GPU.
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/to_device.hpp>

#include "support.hpp"
#include "transfer/transfer_support.hpp"
#include <gpukit/transfer/staging_impl.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using gpukit_test::gate;
using gpukit_test::recording_copier;

namespace {
const gpukit::device cpu = gpukit::device::cpu();
constexpr std::size_t KiB = 1024;

using engine_type = gpukit::basic_staging_engine<recording_copier>;

gpukit::staging_options small_options() {
  gpukit::staging_options o;
  o.chunk_bytes = 64 * KiB;
  o.min_chunk_bytes = 16 * KiB;
  o.slots = 3;
  o.threads = 2;
  return o;
}

std::vector<std::uint32_t> iota(std::size_t n, std::uint32_t start) {
  std::vector<std::uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

/// Replaces the CUDA pointer query for a scope: pointers inside [begin, end) get `kind` (device memory of `ordinal`
/// for pointer_kind::device), others `elsewhere` (pageable host memory by default; device memory means cuda:0).
class fake_pointer_kinds {
 public:
  fake_pointer_kinds(const void* begin, std::size_t bytes, gpukit::detail::pointer_kind kind, int ordinal = 0,
                     gpukit::detail::pointer_kind elsewhere = gpukit::detail::pointer_kind::pageable) {
    state().begin = static_cast<const char*>(begin);
    state().end = static_cast<const char*>(begin) + bytes;
    state().kind = kind;
    state().ordinal = ordinal;
    state().elsewhere = elsewhere;
    gpukit::detail::pointer_query_override().store(&query);
  }
  fake_pointer_kinds(const fake_pointer_kinds&) = delete;
  fake_pointer_kinds& operator=(const fake_pointer_kinds&) = delete;
  ~fake_pointer_kinds() { gpukit::detail::pointer_query_override().store(nullptr); }
  /// Pointer queries answered so far (by any fake).
  static int queries() { return query_count().load(); }

 private:
  struct region {
    const char* begin = nullptr;
    const char* end = nullptr;
    gpukit::detail::pointer_kind kind{};
    int ordinal = -1;
    gpukit::detail::pointer_kind elsewhere{};
  };
  static region& state() {
    static region r;
    return r;
  }
  static std::atomic<int>& query_count() {
    static std::atomic<int> n{0};
    return n;
  }
  static gpukit::detail::pointer_info query(const void* p) {
    ++query_count();
    const auto* c = static_cast<const char*>(p);
    if (c >= state().begin && c < state().end) {
      return {state().kind, state().kind == gpukit::detail::pointer_kind::device ? state().ordinal : -1};
    }
    return {state().elsewhere, state().elsewhere == gpukit::detail::pointer_kind::device ? 0 : -1};
  }
};

template <class F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const gpukit::invalid_argument_error& e) {
    return e.what();
  }
  return "(no invalid_argument_error)";
}
}  // namespace

TEST_CASE("host to device to host through device buffers on a CPU stream") {
  gpukit::stream s(cpu);
  const auto host = iota(100000, 7);  // several staging chunks
  gpukit::device_buffer<std::uint32_t> a(host.size(), s);
  gpukit::device_buffer<std::uint32_t> b(host.size(), s);
  std::vector<std::uint32_t> back(host.size(), 0);
  gpukit::copy_async(a, host, s);  // pageable → device: staged
  gpukit::copy_async(b, a, s);     // device → device
  gpukit::copy_async(back, b, s);  // device → pageable: staged
  s.synchronize();
  CHECK(back == host);
}

TEST_CASE("located spans, arrays, sub-ranges at unaligned offsets") {
  gpukit::stream s(cpu);
  std::vector<char> device_memory(1000, 'x');
  std::array<char, 10> src{'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j'};
  gpukit::device_span<char> dev(device_memory.data(), device_memory.size(), cpu);
  gpukit::copy_async(dev.subspan(3, 10), src, s);
  char out[7] = {};
  gpukit::copy_async(gpukit::host_span<char>(out), dev.subspan(5, 7), s);
  s.synchronize();
  CHECK(std::string(device_memory.data(), 15) == "xxxabcdefghijxx");
  CHECK(std::string(out, 7) == "cdefghi");
}

TEST_CASE("the CPU default stream: copies are complete when copy_async returns") {
  const auto s = gpukit::stream_view::default_stream(cpu);
  const auto host = iota(5000, 1);
  gpukit::device_buffer<std::uint32_t> d(host.size(), s);
  gpukit::copy_async(d, host, s);
  std::vector<std::uint32_t> back(host.size());
  gpukit::copy_async(back, d, s);
  CHECK(back == host);
}

TEST_CASE("pinned memory takes one copy, pageable memory is staged") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  gpukit::stream s(cpu);
  gpukit::pinned_buffer<std::uint32_t> pinned(50000, cpu);
  for (std::size_t i = 0; i < pinned.size(); ++i) pinned[i] = static_cast<std::uint32_t>(i * 3);
  gpukit::device_buffer<std::uint32_t> d(pinned.size(), s);
  gpukit::copy_async(d, pinned, s, engine);
  auto calls = engine.copier().calls();
  REQUIRE(calls.size() == 1);  // one copy, straight from the pinned buffer
  CHECK(calls[0].src == pinned.data());
  CHECK(calls[0].direction == gpukit::copy_direction::host_to_device);
  CHECK(engine.stats().to_device_calls == 0);

  gpukit::pooled_pinned_buffer<std::uint32_t> out(pinned.size(), pool);
  gpukit::copy_async(out, d, s, engine);
  CHECK(engine.copier().calls().size() == 2);
  CHECK(engine.stats().to_host_calls == 0);

  std::vector<std::uint32_t> pageable(pinned.size());
  engine.copier().clear();
  gpukit::copy_async(pageable, d, s, engine);
  calls = engine.copier().calls();
  CHECK(calls.size() == 4);  // 200000 bytes in 64 KiB chunks through the ring
  CHECK(engine.stats().to_host_calls == 1);
  s.synchronize();
  CHECK(std::equal(out.begin(), out.end(), pinned.begin()));
  CHECK(std::equal(pageable.begin(), pageable.end(), pinned.begin()));
}

TEST_CASE("a pooled pinned buffer may be destroyed right after copy_async: its block waits for the copy") {
  // As PyTorch records its pinned blocks' uses: copy_async records the stream on the buffer's block.
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  gpukit::stream s(cpu);
  gate g;
  gpukit::device_buffer<std::uint32_t> d(4000, s);
  gpukit::device_buffer<std::uint32_t> from_device(4000, s);
  gpukit::copy_async(from_device, iota(4000, 7), s);
  s.synchronize();
  g.hold(s);
  const void* first = nullptr;
  {
    gpukit::pooled_pinned_buffer<std::uint32_t> h(4000, pool);
    const auto values = iota(4000, 11);
    std::copy(values.begin(), values.end(), h.begin());
    first = h.data();
    gpukit::copy_async(d, h, s);  // host to device, from the block
  }
  const void* second = nullptr;
  {
    gpukit::pooled_pinned_buffer<std::uint32_t> out(4000, pool);
    CHECK(static_cast<const void*>(out.data()) != first);  // the first block waits for its copy
    second = out.data();
    gpukit::copy_async(out, from_device, s);  // device to host, into the block
  }
  gpukit::pooled_pinned_buffer<std::uint32_t> next(4000, pool);
  CHECK(static_cast<const void*>(next.data()) != first);
  CHECK(static_cast<const void*>(next.data()) != second);
  std::fill(next.begin(), next.end(), 0u);  // would overwrite a block a queued copy still reads or writes
  g.open();
  s.synchronize();
  std::vector<std::uint32_t> back(4000);
  gpukit::copy_async(back, d, s);
  CHECK(back == iota(4000, 11));
}

TEST_CASE("a pageable copy's source may be freed when copy_async returns, a pinned one must outlive the copy") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  gpukit::device_buffer<std::uint32_t> d(4000, s);
  {
    auto temporary = iota(4000, 11);
    gpukit::copy_async(d, temporary, s);
  }  // freed before the stream ran the copy
  g.open();
  std::vector<std::uint32_t> back(4000);
  gpukit::copy_async(back, d, s);  // into pageable memory: returns with the data
  CHECK(back == iota(4000, 11));
}

TEST_CASE("a copy into pageable memory returns once the data has arrived, after the stream's earlier work") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  const auto data = iota(50000, 3);  // several chunks
  gpukit::device_buffer<std::uint32_t> d(data.size(), s);
  gpukit::copy_async(d, data, s);
  std::vector<std::uint32_t> back(data.size(), 0);
  std::atomic<bool> returned{false};
  std::thread caller([&] {
    gpukit::copy_async(back, d, s);
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(returned.load());  // held with the stream
  g.open();
  caller.join();
  CHECK(back == data);  // no synchronize: the destination is complete when copy_async returns
}

TEST_CASE("stream order: a later copy on the same stream sees an earlier one's result") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  gpukit::device_buffer<std::uint32_t> d(30000, s);
  gpukit::device_buffer<std::uint32_t> e(30000, s);
  gpukit::pinned_buffer<std::uint32_t> back(30000, cpu);  // pinned: this copy too is enqueued behind the gate
  const auto first = iota(30000, 100);
  const auto second = iota(30000, 200);
  gpukit::copy_async(d, first, s);
  gpukit::copy_async(e, d, s);
  gpukit::copy_async(d, second, s);  // overwrites d after e took the first contents
  gpukit::copy_async(back, e, s);
  g.open();
  s.synchronize();
  CHECK(std::equal(back.begin(), back.end(), first.begin()));
  std::vector<std::uint32_t> pageable(30000);
  gpukit::copy_async(pageable, d, s);
  CHECK(pageable == second);
}

TEST_CASE("zero elements are a no-op: nothing is checked or enqueued") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  gpukit::stream s(cpu);
  gpukit::copy_async(gpukit::device_span<int>(nullptr, 0, cpu), gpukit::host_span<const int>(nullptr, 0), s, engine);
  gpukit::copy_async(gpukit::host_span<int>(nullptr, 0), gpukit::device_span<const int>(nullptr, 0, cpu), s, engine);
  // Even with a device span of a CUDA device on a CPU stream: an empty copy touches nothing.
  gpukit::copy_async(gpukit::device_span<int>(nullptr, 0, gpukit::device::cuda(0)), std::vector<int>{}, s, engine);
  CHECK(engine.copier().calls().empty());
  CHECK(engine.stats().rings == 0);
  CHECK(s.ready());
}

TEST_CASE("bad input: size mismatch") {
  gpukit::stream s(cpu);
  std::vector<int> host(10);
  gpukit::device_buffer<int> d(11, s);
  const auto message = invalid_argument_message([&] { gpukit::copy_async(d, host, s); });
  CHECK(message.find("gpukit::copy_async: size mismatch: the destination (memory of cpu, 11 elements of 4 bytes)") ==
        0);
  CHECK(message.find("the source (host memory, 10 elements of 4 bytes)") != std::string::npos);
}

TEST_CASE("bad input: a null pointer with a non-zero size") {
  gpukit::stream s(cpu);
  std::vector<int> host(10);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(gpukit::device_span<int>(nullptr, 10, cpu), host, s);
        }).find("the destination (memory of cpu, 10 elements of 4 bytes) is a null pointer") != std::string::npos);
  gpukit::device_buffer<int> d(10, s);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(d, gpukit::host_span<const int>(nullptr, 10), s);
        }).find("the source (host memory, 10 elements of 4 bytes) is a null pointer") != std::string::npos);
}

TEST_CASE("bad input: overlapping ranges") {
  gpukit::stream s(cpu);
  std::vector<int> memory(100);
  gpukit::device_span<int> dev(memory.data(), 50, cpu);
  gpukit::host_span<const int> host(memory.data() + 49, 50);
  CHECK(invalid_argument_message([&] { gpukit::copy_async(dev, host, s); }).find("ranges overlap") !=
        std::string::npos);
  gpukit::device_span<const int> dev_src(memory.data() + 10, 50, cpu);
  CHECK(invalid_argument_message([&] { gpukit::copy_async(dev, dev_src, s); }).find("ranges overlap") !=
        std::string::npos);
  gpukit::copy_async(dev, gpukit::host_span<const int>(memory.data() + 50, 50), s);  // adjacent: fine
  s.synchronize();
}

TEST_CASE("bad input: device memory of the wrong device, or CPU and CUDA memory mixed") {
  gpukit::stream s(cpu);
  std::vector<int> host(10);
  std::vector<int> other(10);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(gpukit::device_span<int>(other.data(), 10, gpukit::device::cuda(0)), host, s);
        }).find("the destination (memory of cuda:0, 10 elements of 4 bytes) cannot be copied on a stream of cpu") !=
        std::string::npos);
  // A CUDA stream of a known device: the checks run before any CUDA call, so they work without a driver too.
  const gpukit::stream_view cuda0(gpukit::device::cuda(0), nullptr);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(gpukit::device_span<int>(other.data(), 10, gpukit::device::cuda(1)), host, cuda0);
        }).find("belongs to another device than the stream (cuda:0)") != std::string::npos);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(gpukit::device_span<int>(other.data(), 10, cpu), host, cuda0);
        }).find("cannot be copied on a stream of cuda:0") != std::string::npos);
  CHECK(invalid_argument_message([&] {
          gpukit::copy_async(gpukit::device_span<int>(other.data(), 10, gpukit::device::cuda(1)),
                             gpukit::device_span<const int>(host.data(), 10, gpukit::device::cuda(2)), cuda0);
        }).find("neither side of a device-to-device copy (cuda:1, cuda:2) is on the stream's device cuda:0") !=
        std::string::npos);
}

TEST_CASE("bad input: a device pointer where host memory is expected, and the reverse (fake pointer query)") {
  gpukit::stream s(cpu);
  std::vector<int> device_memory(10);
  std::vector<int> host(10);
  {
    fake_pointer_kinds fake(host.data(), host.size() * sizeof(int), gpukit::detail::pointer_kind::device, 0);
    // A CUDA device pointer passed as host memory of a CPU copy.
    CHECK(invalid_argument_message(
              [&] { gpukit::copy_async(gpukit::device_span<int>(device_memory.data(), 10, cpu), host, s); })
              .find("the source (host memory, 10 elements of 4 bytes) is device memory of cuda:0 where host memory "
                    "is expected") != std::string::npos);
    CHECK(invalid_argument_message([&] {
            gpukit::copy_async(host, gpukit::device_span<const int>(device_memory.data(), 10, cpu), s);
          }).find("the destination (host memory, 10 elements of 4 bytes) is device memory of cuda:0") !=
          std::string::npos);
    // ... and as the CPU device's memory.
    CHECK(invalid_argument_message([&] {
            gpukit::copy_async(gpukit::device_span<int>(host.data(), 10, cpu), device_memory, s);
          }).find("is CUDA device memory of cuda:0, not host memory") != std::string::npos);
  }
  const gpukit::stream_view cuda0(gpukit::device::cuda(0), nullptr);
  {
    // Host memory passed as device memory of a CUDA copy.
    fake_pointer_kinds fake(device_memory.data(), 40, gpukit::detail::pointer_kind::pageable);
    CHECK(invalid_argument_message([&] {
            gpukit::copy_async(gpukit::device_span<int>(device_memory.data(), 10, gpukit::device::cuda(0)), host,
                               cuda0);
          }).find("is host memory where device memory is expected") != std::string::npos);
  }
  {
    // Device memory of another device than the span says.
    fake_pointer_kinds fake(device_memory.data(), 40, gpukit::detail::pointer_kind::device, 1);
    CHECK(invalid_argument_message([&] {
            gpukit::copy_async(gpukit::device_span<int>(device_memory.data(), 10, gpukit::device::cuda(0)), host,
                               cuda0);
          }).find("is really memory of cuda:1") != std::string::npos);
  }
}

TEST_CASE("bad input leaves no state: no ring, no slot, nothing enqueued") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  gpukit::stream s(cpu);
  std::vector<int> host(100000);
  std::vector<int> other(100001);
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(other.data(), other.size(), cpu), host, s, engine),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(host.data(), host.size(), cpu), host, s, engine),
                  gpukit::invalid_argument_error);
  CHECK(engine.copier().calls().empty());
  CHECK(engine.stats().rings == 0);
  CHECK(pool.stats().reserved_bytes == 0);
  CHECK(s.ready());
}

TEST_CASE("a pinned source on a CUDA stream, as the pointer query reports it, takes the one-copy path") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  engine.copier().shared->perform = false;  // no GPU here: log the device copy instead of calling CUDA
  std::vector<int> host(100000);
  std::vector<int> device_memory(100000);
  fake_pointer_kinds fake(host.data(), host.size() * sizeof(int), gpukit::detail::pointer_kind::pinned, -1,
                          gpukit::detail::pointer_kind::device);
  const gpukit::stream_view cuda0(gpukit::device::cuda(0), nullptr);
  gpukit::copy_async(gpukit::device_span<int>(device_memory.data(), device_memory.size(), gpukit::device::cuda(0)),
                     host, cuda0, engine);
  const auto calls = engine.copier().calls();
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].src == host.data());
  CHECK(calls[0].bytes == host.size() * sizeof(int));
}

TEST_CASE("without a driver, a copy on a CUDA stream fails with no_device_error and leaks nothing") {
  if (gpukit::device_count() != 0) {
    MESSAGE("a CUDA device is usable: this case is about machines without one");
    return;
  }
  gpukit::pinned_buffer<int> host(100, cpu);
  std::vector<int> pageable(100);
  std::vector<int> device_memory(100);
  const gpukit::stream_view cuda0(gpukit::device::cuda(0), nullptr);
  gpukit::device_span<int> dev(device_memory.data(), 100, gpukit::device::cuda(0));
  CHECK_THROWS_AS(gpukit::copy_async(dev, host, cuda0), gpukit::no_device_error);
  CHECK_THROWS_AS(gpukit::copy_async(dev, pageable, cuda0), gpukit::no_device_error);
  CHECK_THROWS_AS(gpukit::copy_async(pageable, dev, cuda0), gpukit::no_device_error);
  CHECK(gpukit::default_pinned_pool(gpukit::device::cuda(0)).stats().reserved_bytes == 0);
}

TEST_CASE("to_device and to_host: a buffer holding a copy, and a vector once the copy has completed") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  auto buffer = gpukit::to_device(iota(70000, 5), s);  // a temporary: read before to_device returns
  CHECK(buffer.size() == 70000);
  CHECK(buffer.device() == cpu);
  std::vector<std::uint32_t> source = iota(10, 1);
  auto small = gpukit::to_device(gpukit::span<const std::uint32_t>(source), s);
  gpukit::pinned_buffer<std::uint32_t> pinned(3, cpu);
  pinned[0] = 4;
  pinned[1] = 5;
  pinned[2] = 6;
  auto from_pinned = gpukit::to_device(gpukit::pinned_span<const std::uint32_t>(pinned), s);
  g.open();
  CHECK(gpukit::to_host(buffer) == iota(70000, 5));  // waits for the copies
  CHECK(gpukit::to_host(small, s) == source);
  CHECK(gpukit::to_host(gpukit::device_span<const std::uint32_t>(from_pinned.data(), 3, cpu), s) ==
        std::vector<std::uint32_t>{4, 5, 6});
  CHECK(gpukit::to_host(gpukit::to_device(std::vector<std::uint32_t>{}, s)).empty());
}

TEST_CASE("to_device of a std::array, a pinned_buffer and a temporary pooled_pinned_buffer") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  const std::array<std::uint32_t, 3> array{7, 8, 9};
  auto from_array = gpukit::to_device(array, s);
  gpukit::pinned_buffer<std::uint32_t> pinned(2, cpu);
  pinned[0] = 1;
  pinned[1] = 2;
  auto from_pinned = gpukit::to_device(pinned, s);
  const void* pooled_block = nullptr;
  auto make_pooled = [&] {
    gpukit::pooled_pinned_buffer<std::uint32_t> h(4000, pool);
    const auto values = iota(4000, 3);
    std::copy(values.begin(), values.end(), h.begin());
    pooled_block = h.data();
    return h;
  };
  auto from_pooled = gpukit::to_device(make_pooled(), s);  // the temporary is gone before the copy runs
  gpukit::pooled_pinned_buffer<std::uint32_t> next(4000, pool);
  CHECK(static_cast<const void*>(next.data()) != pooled_block);  // the block waits for the copy
  std::fill(next.begin(), next.end(), 0u);
  auto from_current = gpukit::to_device(array, cpu);  // on the current stream (the CPU's default)
  std::atomic<bool> returned{false};
  std::optional<gpukit::device_buffer<std::uint32_t>> from_temporary;
  std::thread caller([&] {
    gpukit::pinned_buffer<std::uint32_t> temporary(3, cpu);
    std::fill(temporary.begin(), temporary.end(), 5u);
    from_temporary.emplace(gpukit::to_device(std::move(temporary), s));  // freed when to_device returns
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(returned);  // waits for its copy (the gate holds it)
  g.open();
  caller.join();
  CHECK(gpukit::to_host(*from_temporary) == std::vector<std::uint32_t>{5, 5, 5});
  CHECK(gpukit::to_host(from_array) == std::vector<std::uint32_t>{7, 8, 9});
  CHECK(gpukit::to_host(from_pinned) == std::vector<std::uint32_t>{1, 2});
  CHECK(gpukit::to_host(from_pooled) == iota(4000, 3));
  CHECK(gpukit::to_host(from_current) == std::vector<std::uint32_t>{7, 8, 9});
  CHECK(from_array.stream() == gpukit::stream_view(s));
}

TEST_CASE("bad input: an element count whose byte size overflows size_t") {
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  gpukit::stream s(cpu);
  std::vector<std::uint32_t> source(4, 7);
  std::vector<std::uint32_t> destination(4, 0);
  // 2^62 + 1 elements of 4 bytes: 2^64 + 4 bytes, which wraps to 4 in size_t.
  const std::size_t count = (std::size_t{1} << 62) + 1;
  const std::string message = invalid_argument_message([&] {
    gpukit::copy_async(gpukit::device_span<std::uint32_t>(destination.data(), count, cpu),
                       gpukit::host_span<const std::uint32_t>(source.data(), count), s, engine);
  });
  CHECK(message.find("gpukit::copy_async: " + std::to_string(count) + " elements of 4 bytes") == 0);
  CHECK(message.find("overflows") != std::string::npos);
  s.synchronize();
  CHECK(engine.copier().calls().empty());
  CHECK(destination == std::vector<std::uint32_t>(4, 0));
  // The located spans' byte sizes saturate instead of wrapping to 4.
  CHECK(gpukit::host_span<std::uint32_t>(nullptr, count).size_bytes() == SIZE_MAX);
  CHECK(gpukit::pinned_span<std::uint32_t>(nullptr, count).size_bytes() == SIZE_MAX);
  CHECK(gpukit::device_span<std::uint32_t>(nullptr, count, cpu).size_bytes() == SIZE_MAX);
  CHECK(gpukit::device_span<std::uint32_t>(nullptr, 3, cpu).size_bytes() == 12);
}

TEST_CASE("bad input: a range that runs past the end of the address space") {
  gpukit::stream s(cpu);
  std::vector<std::uint32_t> source(4, 7);
  std::vector<std::uint32_t> destination(4, 0);
  // (2^64 - 4) bytes: representable, but no range of that size fits above a real address.
  const std::size_t count = (std::size_t{1} << 62) - 1;
  const std::string message = invalid_argument_message([&] {
    gpukit::copy_async(gpukit::device_span<std::uint32_t>(destination.data(), count, cpu),
                       gpukit::pinned_span<const std::uint32_t>(source.data(), count), s);
  });
  CHECK(message.find("runs past the end of the address space") != std::string::npos);
  s.synchronize();
  CHECK(destination == std::vector<std::uint32_t>(4, 0));
}

TEST_CASE("without a stream, copy_async uses the calling thread's current stream of the device side") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  gpukit::device_buffer<std::uint32_t> d(5000, s);
  gpukit::device_buffer<std::uint32_t> e(5000, s);
  std::memset(d.data(), 0, d.size() * sizeof(std::uint32_t));  // CPU device memory is host memory
  gpukit::pinned_buffer<std::uint32_t> source(5000, cpu);
  const auto data = iota(5000, 7);
  std::copy(data.begin(), data.end(), source.begin());
  {
    gpukit::stream_guard guard(s);
    gpukit::copy_async(d, source);  // pinned: one copy, enqueued on s behind the gate
    gpukit::copy_async(e, d);       // device to device, same device: on s too
  }
  // Had either copy gone to the default stream, it would be done once that stream is.
  gpukit::current_stream(cpu).synchronize();
  CHECK(d.data()[4999] == 0);
  g.open();
  {
    gpukit::stream_guard guard(s);
    std::vector<std::uint32_t> back(5000);
    gpukit::copy_async(back, e);  // into pageable memory: waits for s, then returns with the data
    CHECK(back == data);
  }
  // Without a guard: the default stream.
  std::vector<std::uint32_t> again(5000);
  gpukit::copy_async(again, d);
  CHECK(again == data);
}

TEST_CASE("bad input without a stream: size mismatch and zero elements, as with one") {
  gpukit::device_buffer<std::uint32_t> d(10, cpu);
  std::vector<std::uint32_t> host(9);
  CHECK_THROWS_WITH_AS(gpukit::copy_async(d, host), doctest::Contains("size mismatch"), gpukit::invalid_argument_error);
  std::vector<std::uint32_t> none;
  gpukit::copy_async(gpukit::device_span<std::uint32_t>(d).subspan(0, 0), none);  // no-op
}

TEST_CASE("copies ask CUDA where memory is only when the type does not say: spans and host containers") {
  gpukit::stream s(cpu);
  gpukit::device_buffer<int> d(10, s);
  gpukit::pinned_buffer<int> pinned(10, cpu);
  std::vector<int> host(10, 3);
  fake_pointer_kinds fake(nullptr, 0, gpukit::detail::pointer_kind::pageable);  // every pointer pageable
  const int before = fake_pointer_kinds::queries();
  gpukit::copy_async(d, pinned, s);  // gpukit allocated both: no query, one DMA
  gpukit::copy_async(pinned, d, s);
  CHECK(fake_pointer_kinds::queries() == before);
  gpukit::copy_async(d, host, s);  // the vector is asked about (it may be registered)
  CHECK(fake_pointer_kinds::queries() == before + 1);
  gpukit::copy_async(gpukit::pinned_span<int>(pinned.data(), pinned.size()), gpukit::device_span<const int>(d), s);
  CHECK(fake_pointer_kinds::queries() == before + 3);  // spans are only a pointer and a claim: both asked
  s.synchronize();
  CHECK(std::equal(pinned.begin(), pinned.end(), host.begin()));
}

TEST_CASE("a temporary pinned buffer: copy_async waits for its copy, which reads or writes it after the call") {
  // Freed at the end of the caller's expression, while the stream has yet to run the copy: waited for, as to_device
  // does. An lvalue stays the caller's to keep alive.
  auto pool = gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu));
  engine_type engine(pool, small_options());
  gpukit::stream s(cpu);
  gpukit::device_buffer<std::uint32_t> d(4000, s);
  auto make = [] {
    gpukit::pinned_buffer<std::uint32_t> b(4000, cpu);
    const auto values = iota(4000, 21);
    std::copy(values.begin(), values.end(), b.begin());
    return b;
  };
  {
    gate g;
    g.hold(s);
    CHECK(g.opened_to_return([&] { gpukit::copy_async(d, make(), s); }, std::chrono::seconds(1)));
    g.open();  // (without the wait: let the copy go)
    CHECK(gpukit::to_host(d, s) == iota(4000, 21));
  }
  {
    gate g;
    g.hold(s);
    CHECK(g.opened_to_return([&] { gpukit::copy_async(gpukit::pinned_buffer<std::uint32_t>(4000, cpu), d, s); },
                             std::chrono::seconds(1)));
  }
  {
    gate g;
    g.hold(s);
    CHECK(g.opened_to_return([&] { gpukit::copy_async(d, make(), s, engine); }, std::chrono::seconds(1)));
    g.open();
    CHECK(engine.copier().calls().size() == 1);  // one copy, from the temporary
    CHECK(gpukit::to_host(d, s) == iota(4000, 21));
  }
  gpukit::pinned_buffer<std::uint32_t> kept = make();
  gate g;
  g.hold(s);
  CHECK_FALSE(g.opened_to_return([&] { gpukit::copy_async(d, kept, s); }, std::chrono::seconds(5)));
  CHECK_FALSE(g.opened_to_return([&] { gpukit::copy_async(d, iota(4000, 21), s); }, std::chrono::seconds(5)));
  g.open();
  CHECK(gpukit::to_host(d, s) == iota(4000, 21));
}

TEST_CASE("bad input through to_device and to_host: the error names the call made") {
  gpukit::stream s(cpu);
  std::vector<int> device_memory(10);
  std::vector<int> host(10);
  fake_pointer_kinds fake(device_memory.data(), 40, gpukit::detail::pointer_kind::device, 0);
  const std::string to_device = invalid_argument_message(
      [&] { (void)gpukit::to_device(gpukit::host_span<const int>(device_memory.data(), 10), s); });
  CHECK(to_device.rfind("gpukit::to_device: the source (host memory, 10 elements of 4 bytes) is device memory", 0) ==
        0);
  const std::string to_host = invalid_argument_message(
      [&] { (void)gpukit::to_host(gpukit::device_span<int>(device_memory.data(), 10, cpu), s); });
  CHECK(to_host.rfind("gpukit::to_host: the source (memory of cpu, 10 elements of 4 bytes) is CUDA device memory", 0) ==
        0);
  const std::string copy = invalid_argument_message(
      [&] { gpukit::copy_async(host, gpukit::device_span<int>(device_memory.data(), 10, cpu), s); });
  CHECK(copy.rfind("gpukit::copy_async: ", 0) == 0);
}

namespace {
struct copy_base {
  int a;
};
struct copy_derived : copy_base {
  int b;
};
/// A duck-typed device buffer of copy_derived.
struct derived_buffer {
  copy_derived* data() { return nullptr; }
  std::size_t size() { return 0; }
  gpukit::device device() { return gpukit::device::cpu(); }
  gpukit::stream_view stream() { return gpukit::stream_view::default_stream(gpukit::device::cpu()); }
};
}  // namespace

TEST_CASE("device_span of a base class refuses a buffer of a derived class, as std::span does") {
  CHECK_FALSE(std::is_constructible<gpukit::device_span<copy_base>, derived_buffer&>::value);
  CHECK(std::is_constructible<gpukit::device_span<const copy_derived>, derived_buffer&>::value);
  CHECK(std::is_constructible<gpukit::device_span<const int>, gpukit::device_buffer<int>&>::value);
}
