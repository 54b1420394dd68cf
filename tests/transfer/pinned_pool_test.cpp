// The caching pinned allocator: size classes and their waste, cache reuse, stream-ordered reuse (a block waits for
// the events recorded at free, proven with a gate holding a CPU stream back), statistics, the cap, empty_cache,
// out-of-memory retries, misuse, and concurrency.
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>

#include "support.hpp"
#include "transfer/transfer_support.hpp"
#include <gpukit/memory/pinned_pool_impl.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using gpukit_test::gate;

namespace {
const gpukit::device cpu = gpukit::device::cpu();
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * 1024;

using test_pool = gpukit::basic_pinned_pool<gpukit_test::limited_upstream>;

gpukit::pinned_pool make_cpu_pool(gpukit::pinned_pool_options options = {}) {
  return gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu), options);
}
}  // namespace

TEST_CASE("size classes: powers of two up to 4 KiB, then 8 per doubling") {
  using gpukit::pinned_size_class;
  CHECK(pinned_size_class(0) == 0);
  CHECK(pinned_size_class(1) == 512);
  CHECK(pinned_size_class(512) == 512);
  CHECK(pinned_size_class(513) == 1024);
  CHECK(pinned_size_class(3000) == 4096);
  CHECK(pinned_size_class(4096) == 4096);
  CHECK(pinned_size_class(4097) == 4096 + 512);
  CHECK(pinned_size_class(8 * KiB) == 8 * KiB);
  CHECK(pinned_size_class(8 * KiB + 1) == 9 * KiB);
  CHECK(pinned_size_class(128 * MiB) == 128 * MiB);
  CHECK(pinned_size_class(128 * MiB + 1) == 144 * MiB);
  // PyTorch's example (pytorch#150517): 129.5 MiB is rounded to 256 MiB by power-of-two classes.
  const std::size_t request = 129 * MiB + MiB / 2;
  CHECK(pinned_size_class(request) == 144 * MiB);
  CHECK(pinned_size_class(request, 1) == 256 * MiB);
  CHECK(pinned_size_class(request, 16) == 136 * MiB);
  CHECK(pinned_size_class(std::numeric_limits<std::size_t>::max()) == std::numeric_limits<std::size_t>::max());
}

TEST_CASE("size classes: never below the request, monotonic, waste below 1/8 above 4 KiB") {
  std::mt19937_64 rng(42);
  std::size_t previous_request = 0;
  std::size_t previous_class = 0;
  for (std::size_t bytes = 1; bytes < (std::size_t{1} << 40); bytes += 1 + bytes / 7 + rng() % (1 + bytes / 3)) {
    const std::size_t c = gpukit::pinned_size_class(bytes);
    CHECK(c >= bytes);
    if (bytes > previous_request) CHECK(c >= previous_class);
    if (bytes > 4096) CHECK(static_cast<double>(c - bytes) < static_cast<double>(c) / 8.0);
    previous_request = bytes;
    previous_class = c;
  }
}

TEST_CASE("size classes: measured waste over log-uniform requests, 8 per doubling vs power-of-two") {
  // Requests from 64 KiB to 1 GiB, log-uniform (typical pinned staging and batch buffers).
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> exponent(16.0, 30.0);
  double requested = 0;
  double fine = 0;
  double fine16 = 0;
  double pow2 = 0;
  double worst_fine = 0;
  for (int i = 0; i < 100000; ++i) {
    const auto bytes = static_cast<std::size_t>(std::pow(2.0, exponent(rng)));
    requested += static_cast<double>(bytes);
    const auto c8 = static_cast<double>(gpukit::pinned_size_class(bytes, 8));
    fine += c8;
    fine16 += static_cast<double>(gpukit::pinned_size_class(bytes, 16));
    pow2 += static_cast<double>(gpukit::pinned_size_class(bytes, 1));
    worst_fine = std::max(worst_fine, c8 / static_cast<double>(bytes) - 1.0);
  }
  const double fine_waste = fine / requested - 1.0;
  const double fine16_waste = fine16 / requested - 1.0;
  const double pow2_waste = pow2 / requested - 1.0;
  MESSAGE("reserved beyond requested: 8 classes/doubling "
          << fine_waste * 100 << "% (worst request " << worst_fine * 100 << "%), 16 classes " << fine16_waste * 100
          << "%, power of two " << pow2_waste * 100 << "%");
  CHECK(fine_waste < 0.07);
  CHECK(worst_fine < 0.125);
  CHECK(pow2_waste > 0.30);
}

TEST_CASE("a freed block is served again from the cache, without pinning") {
  auto pool = make_cpu_pool();
  void* a = pool.allocate(100 * KiB);
  REQUIRE(a != nullptr);
  std::memset(a, 1, 100 * KiB);
  CHECK(pool.block_size(a) == gpukit::pinned_size_class(100 * KiB));
  pool.deallocate(a);
  void* b = pool.allocate(100 * KiB - 100);  // same class
  CHECK(b == a);
  void* c = pool.allocate(300 * KiB);  // another class: a new block
  CHECK(c != a);
  auto s = pool.stats();
  CHECK(s.allocations == 3);
  CHECK(s.cache_hits == 1);
  CHECK(s.upstream_allocations == 2);
  pool.deallocate(b);
  pool.deallocate(c);
  CHECK(pool.allocate(0) == nullptr);
  pool.deallocate(nullptr);
}

TEST_CASE("a block used on a stream is reused only after the event recorded at free completes") {
  auto pool = make_cpu_pool();
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);  // the stream cannot pass this point until the gate opens
  void* p = pool.allocate(64 * KiB);
  std::memset(p, 7, 64 * KiB);
  std::atomic<int> seen{-1};
  s.enqueue_host([&seen, p] { seen = static_cast<unsigned char*>(p)[100]; });  // a "copy" reading the block
  pool.deallocate(p, s);  // event recorded now, behind the gate and the read
  auto st = pool.stats();
  CHECK(st.pending_blocks == 1);
  CHECK(st.events_recorded == 1);
  void* q = pool.allocate(64 * KiB);
  CHECK(q != p);  // p is still in use by the stream
  std::memset(q, 9, 64 * KiB);
  g.open();
  s.synchronize();
  CHECK(seen.load() == 7);  // the read saw the data, not q's writes
  void* r = pool.allocate(64 * KiB);
  CHECK(r == p);  // now it is reused
  st = pool.stats();
  CHECK(st.pending_blocks == 0);
  CHECK(st.upstream_allocations == 2);
  pool.deallocate(q);
  pool.deallocate(r);
}

TEST_CASE("a block recorded on two streams waits for both") {
  auto pool = make_cpu_pool();
  gpukit::stream a(cpu);
  gpukit::stream b(cpu);
  gate ga;
  gate gb;
  ga.hold(a);
  gb.hold(b);
  void* p = pool.allocate(8 * KiB);
  pool.record_stream(p, a);
  pool.record_stream(p, b);
  pool.record_stream(p, a);  // recorded once per stream
  pool.deallocate(p);
  CHECK(pool.stats().events_recorded == 2);
  ga.open();
  a.synchronize();
  void* q = pool.allocate(8 * KiB);
  CHECK(q != p);  // b has not passed its event
  gb.open();
  b.synchronize();
  void* r = pool.allocate(8 * KiB);
  CHECK(r == p);
  pool.deallocate(q);
  pool.deallocate(r);
}

TEST_CASE("the CPU default stream is synchronous: a block freed on it is free at once") {
  auto pool = make_cpu_pool();
  void* p = pool.allocate(8 * KiB);
  pool.deallocate(p, gpukit::stream_view::default_stream(cpu));
  CHECK(pool.allocate(8 * KiB) == p);
  pool.deallocate(p);
}

TEST_CASE("statistics: allocated, requested, reserved, cached, peaks and reset") {
  auto pool = make_cpu_pool();
  void* a = pool.allocate(100 * KiB);
  void* b = pool.allocate(1 * MiB);
  auto s = pool.stats();
  const std::size_t ca = gpukit::pinned_size_class(100 * KiB);
  CHECK(s.allocated_bytes == ca + MiB);
  CHECK(s.requested_bytes == 100 * KiB + MiB);
  CHECK(s.reserved_bytes == ca + MiB);
  CHECK(s.cached_bytes == 0);
  CHECK(s.active_blocks == 2);
  pool.deallocate(b);
  s = pool.stats();
  CHECK(s.allocated_bytes == ca);
  CHECK(s.allocated_bytes_peak == ca + MiB);
  CHECK(s.reserved_bytes == ca + MiB);
  CHECK(s.cached_bytes == MiB);
  CHECK(s.free_blocks == 1);
  pool.reset_peak_stats();
  CHECK(pool.stats().allocated_bytes_peak == ca);
  CHECK(pool.empty_cache() == MiB);
  s = pool.stats();
  CHECK(s.reserved_bytes == ca);
  CHECK(s.reserved_bytes_peak == ca + MiB);
  CHECK(s.upstream_frees == 1);
  pool.deallocate(a);
}

TEST_CASE("time spent pinning is measured") {
  gpukit_test::limited_upstream up;
  up.shared->delay = 2ms;
  test_pool pool(up);
  void* p = pool.allocate(4 * KiB);
  const auto pinned = pool.stats().pinning_time;
  CHECK(pinned >= 2ms);
  pool.deallocate(p);
  void* q = pool.allocate(4 * KiB);  // a cache hit costs no pinning
  CHECK(pool.stats().pinning_time == pinned);
  void* r = pool.allocate(8 * KiB);  // a miss does
  CHECK(pool.stats().pinning_time >= pinned + 2ms);
  pool.deallocate(q);
  pool.deallocate(r);
}

TEST_CASE("statistics in the caching allocator's vocabulary: counts, bytes, totals, call times, peaks and resets") {
  gpukit_test::limited_upstream up;
  up.shared->delay = 1ms;
  test_pool pool(up);
  const auto ca = static_cast<std::int64_t>(gpukit::pinned_size_class(100 * KiB));
  const auto mib = static_cast<std::int64_t>(MiB);
  void* a = pool.allocate(100 * KiB);
  void* b = pool.allocate(1 * MiB);
  auto h = pool.memory_stats();
  CHECK(h.allocation.current == 2);
  CHECK(h.allocation.allocated == 2);
  CHECK(h.allocated_bytes.current == ca + mib);
  CHECK(h.segment.current == 2);
  CHECK(h.reserved_bytes.current == ca + mib);
  CHECK(h.num_host_alloc == 2);
  CHECK(h.host_alloc_time.count == 2);
  CHECK(h.host_alloc_time.min >= 1ms);
  CHECK(h.host_alloc_time.max >= h.host_alloc_time.min);
  CHECK(h.host_alloc_time.total >= h.host_alloc_time.min + h.host_alloc_time.max);
  CHECK(h.host_alloc_time.average() == h.host_alloc_time.total / 2);

  pool.deallocate(b);
  void* c = pool.allocate(1 * MiB);  // a cache hit: an allocation, no segment
  pool.deallocate(c);
  h = pool.memory_stats();
  CHECK(h.allocation.current == 1);
  CHECK(h.allocation.peak == 2);
  CHECK(h.allocation.allocated == 3);
  CHECK(h.allocation.freed == 2);
  CHECK(h.allocated_bytes.current == ca);
  CHECK(h.allocated_bytes.peak == ca + mib);
  CHECK(h.allocated_bytes.freed == 2 * mib);
  CHECK(h.segment.allocated == 2);
  CHECK(h.num_host_alloc == 2);
  CHECK(h.num_host_free == 0);
  const auto s = pool.stats();  // the two vocabularies agree
  CHECK(h.allocated_bytes.current == static_cast<std::int64_t>(s.allocated_bytes));
  CHECK(h.allocated_bytes.peak == static_cast<std::int64_t>(s.allocated_bytes_peak));
  CHECK(h.reserved_bytes.current == static_cast<std::int64_t>(s.reserved_bytes));
  CHECK(h.allocation.current == static_cast<std::int64_t>(s.active_blocks));
  CHECK(h.allocation.allocated == static_cast<std::int64_t>(s.allocations));
  CHECK(h.host_alloc_time.total == s.pinning_time);

  pool.reset_peak_stats();
  h = pool.memory_stats();
  CHECK(h.allocation.peak == 1);
  CHECK(h.allocated_bytes.peak == ca);
  CHECK(h.reserved_bytes.peak == ca + mib);  // the block is still cached
  CHECK(h.host_alloc_time.max == 0ns);       // the shortest and longest calls go with the peaks, as in PyTorch
  CHECK(h.host_alloc_time.min == 0ns);
  CHECK(h.host_alloc_time.count == 2);  // the count and total stay
  CHECK(pool.empty_cache() == MiB);
  h = pool.memory_stats();
  CHECK(h.segment.current == 1);
  CHECK(h.segment.freed == 1);
  CHECK(h.reserved_bytes.current == ca);
  CHECK(h.reserved_bytes.peak == ca + mib);
  CHECK(h.reserved_bytes.freed == mib);
  CHECK(h.num_host_free == 1);
  CHECK(h.host_free_time.count == 1);
  CHECK(h.host_free_time.total == pool.stats().unpinning_time);

  pool.reset_accumulated_stats();
  h = pool.memory_stats();
  CHECK(h.allocation.current == 1);  // current values and peaks stay
  CHECK(h.allocation.peak == 1);
  CHECK(h.reserved_bytes.current == ca);
  for (const gpukit::stat* st : {&h.allocation, &h.segment, &h.allocated_bytes, &h.reserved_bytes}) {
    CHECK(st->allocated == 0);
    CHECK(st->freed == 0);
  }
  CHECK(h.num_host_alloc == 0);
  CHECK(h.num_host_free == 0);
  CHECK(h.host_alloc_time.count == 0);
  CHECK(h.host_alloc_time.total == 0ns);
  CHECK(h.host_alloc_time.average() == 0ns);
  CHECK(h.host_free_time.max > 0ns);  // until reset_peak_stats
  pool.reset_peak_stats();
  CHECK(pool.memory_stats().host_free_time.max == 0ns);
  CHECK(pool.stats().allocations == 3);  // stats() still counts from the pool's creation
  pool.deallocate(a);
  h = pool.memory_stats();
  CHECK(h.allocation.current == 0);
  CHECK(h.allocation.freed == 1);
}

TEST_CASE("statistics in the caching allocator's vocabulary: a block waiting for its stream is still allocated") {
  auto pool = make_cpu_pool();
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  void* p = pool.allocate(64 * KiB);
  pool.deallocate(p, s);  // pending until the gate opens
  auto h = pool.memory_stats();
  CHECK(h.allocation.current == 1);
  CHECK(h.allocated_bytes.current == static_cast<std::int64_t>(64 * KiB));
  CHECK(pool.stats().allocated_bytes == 0);  // stats() counts it pending
  CHECK(pool.stats().pending_bytes == 64 * KiB);
  g.open();
  s.synchronize();
  h = pool.memory_stats();  // promotes it
  CHECK(h.allocation.current == 0);
  CHECK(h.allocation.freed == 1);
  CHECK(h.allocated_bytes.current == 0);
  CHECK(h.allocated_bytes.peak == static_cast<std::int64_t>(64 * KiB));
}

TEST_CASE("statistics as torch.cuda.host_memory_stats() gives them: the same keys, times in microseconds") {
  gpukit_test::limited_upstream up;
  up.shared->delay = 2ms;
  test_pool pool(up);
  pool.deallocate(pool.allocate(4 * KiB));
  (void)pool.empty_cache();
  const auto flat = gpukit::flat_host_memory_stats(pool.memory_stats());
  std::set<std::string> keys;
  for (const auto& entry : flat) keys.insert(entry.first);
  std::set<std::string> pytorch{"num_host_alloc", "num_host_free"};
  for (const char* name : {"allocation", "segment", "allocated_bytes", "reserved_bytes"}) {
    for (const char* metric : {"current", "peak", "allocated", "freed"})
      pytorch.insert(std::string(name) + "." + metric);
  }
  for (const char* name : {"host_alloc_time", "host_free_time"}) {
    for (const char* metric : {"total", "max", "min", "count", "avg"}) pytorch.insert(std::string(name) + "." + metric);
  }
  CHECK(keys == pytorch);
  CHECK(flat.at("allocation.allocated") == 1);
  CHECK(flat.at("allocated_bytes.peak") == 4096);
  CHECK(flat.at("segment.freed") == 1);
  CHECK(flat.at("reserved_bytes.current") == 0);
  CHECK(flat.at("num_host_alloc") == 1);
  CHECK(flat.at("num_host_free") == 1);
  CHECK(flat.at("host_alloc_time.count") == 1);
  CHECK(flat.at("host_alloc_time.total") >= 2000);  // 2 ms, in microseconds
  CHECK(flat.at("host_alloc_time.min") == flat.at("host_alloc_time.total"));
  CHECK(flat.at("host_alloc_time.avg") == flat.at("host_alloc_time.total"));
  CHECK(flat.at("host_free_time.count") == 1);
}

TEST_CASE("statistics of the default pools: host_memory_stats and its resets") {
  const auto before = gpukit::host_memory_stats(cpu);
  void* p = gpukit::default_pinned_pool(cpu).allocate(3 * MiB);
  auto h = gpukit::host_memory_stats(cpu);
  CHECK(h.allocation.current == before.allocation.current + 1);
  CHECK(h.allocated_bytes.current == before.allocated_bytes.current + static_cast<std::int64_t>(3 * MiB));
  CHECK(gpukit::host_memory_stats_map(cpu).at("allocated_bytes.current") == h.allocated_bytes.current);
  gpukit::default_pinned_pool(cpu).deallocate(p);
  gpukit::reset_peak_host_memory_stats(cpu);
  gpukit::reset_accumulated_host_memory_stats(cpu);
  h = gpukit::host_memory_stats(cpu);
  CHECK(h.allocation.current == before.allocation.current);
  CHECK(h.allocated_bytes.peak == h.allocated_bytes.current);
  CHECK(h.allocation.allocated == 0);
  CHECK(h.num_host_alloc == 0);
}

TEST_CASE("after warm-up the hot path never pins") {
  auto pool = make_cpu_pool();
  gpukit::stream s(cpu);
  const std::size_t sizes[] = {4 * KiB, 100 * KiB, 3 * MiB, 1 * MiB + 5};
  for (int round = 0; round < 3; ++round) {  // warm-up: one block per class
    for (std::size_t n : sizes) pool.deallocate(pool.allocate(n), s);
    s.synchronize();
  }
  const auto warmed = pool.stats().upstream_allocations;
  for (int i = 0; i < 1000; ++i) {
    void* p = pool.allocate(sizes[i % 4]);
    pool.deallocate(p, s);
    if (i % 4 == 3) s.synchronize();
  }
  const auto s2 = pool.stats();
  CHECK(s2.upstream_allocations == warmed);
  CHECK(s2.cache_hits >= 1000);
}

TEST_CASE("the cap releases the oldest free blocks, pending blocks are capped once they complete") {
  gpukit::pinned_pool_options options;
  options.max_cached_bytes = 2 * MiB;
  auto pool = make_cpu_pool(options);
  void* a = pool.allocate(MiB);
  void* b = pool.allocate(MiB);
  void* c = pool.allocate(MiB);
  pool.deallocate(a);  // oldest
  pool.deallocate(b);
  CHECK(pool.stats().cached_bytes == 2 * MiB);
  pool.deallocate(c);  // 3 MiB cached > 2 MiB: `a` goes
  auto s = pool.stats();
  CHECK(s.cached_bytes == 2 * MiB);
  CHECK(s.cap_releases == 1);
  CHECK(s.reserved_bytes == 2 * MiB);
  void* x = pool.allocate(MiB);
  void* y = pool.allocate(MiB);
  CHECK(std::set<void*>{x, y} == std::set<void*>{b, c});  // `a` was released, b and c kept

  gpukit::stream st(cpu);
  gate g;
  g.hold(st);
  void* d = pool.allocate(MiB);
  pool.deallocate(x);
  pool.deallocate(y);
  pool.deallocate(d, st);  // pending: cached, but not capped (its stream still uses it), so both free blocks stay
  s = pool.stats();
  CHECK(s.pending_blocks == 1);
  CHECK(s.free_blocks == 2);
  CHECK(s.cached_bytes == 3 * MiB);
  CHECK(s.cap_releases == 1);
  void* kept = pool.allocate(MiB);
  CHECK((kept == x || kept == y));
  pool.deallocate(kept);
  pool.set_max_cached_bytes(MiB);  // the oldest free block goes; the pending one must stay
  s = pool.stats();
  CHECK(s.free_blocks == 1);
  CHECK(s.pending_blocks == 1);
  CHECK(s.cached_bytes == 2 * MiB);
  CHECK(s.cap_releases == 2);
  pool.set_max_cached_bytes(0);
  CHECK(pool.stats().reserved_bytes == MiB);  // still pending: releasing it now would free memory in use
  g.open();
  st.synchronize();
  s = pool.stats();  // the pending block completes and the cap applies to it
  CHECK(s.pending_blocks == 0);
  CHECK(s.cached_bytes == 0);
  CHECK(s.reserved_bytes == 0);
  CHECK(s.upstream_frees == s.upstream_allocations);  // every block went back to the upstream: none dropped
}

TEST_CASE("empty_cache releases free blocks and leaves pending ones until their streams pass") {
  auto pool = make_cpu_pool();
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  void* a = pool.allocate(MiB);
  void* b = pool.allocate(MiB);
  pool.deallocate(a);
  pool.deallocate(b, s);
  CHECK(pool.empty_cache() == MiB);
  CHECK(pool.stats().reserved_bytes == MiB);
  g.open();
  s.synchronize();
  CHECK(pool.empty_cache() == MiB);
  CHECK(pool.stats().reserved_bytes == 0);
}

TEST_CASE("out of memory: the cache is emptied and the request retried, then out_of_memory_error") {
  gpukit_test::limited_upstream up;
  up.shared->capacity = 4 * MiB;
  test_pool pool(up);
  void* a = pool.allocate(2 * MiB);
  void* b = pool.allocate(MiB);
  pool.deallocate(a);                // cached: 2 MiB free, 1 MiB in use
  void* c = pool.allocate(3 * MiB);  // does not fit beside the cache: retried after emptying it
  CHECK(c != nullptr);
  auto s = pool.stats();
  CHECK(s.oom_retries == 1);
  CHECK(s.reserved_bytes == 4 * MiB);
  try {
    (void)pool.allocate(2 * MiB);
    FAIL("allocation beyond the capacity succeeded");
  } catch (const gpukit::out_of_memory_error& e) {
    const std::string what = e.what();
    CHECK(what.find("cannot allocate 2.00 MiB") != std::string::npos);
    CHECK(what.find("even after emptying the cache") != std::string::npos);
  }
  CHECK(pool.stats().allocated_bytes == 4 * MiB);  // nothing leaked by the failed requests
  pool.deallocate(b);
  pool.deallocate(c);
}

TEST_CASE("one upstream contract: a caching allocator's upstream (nullptr when out of memory) backs a pinned pool") {
  gpukit::basic_pinned_pool<gpukit::host_upstream> pool(gpukit::host_upstream(4 * MiB));
  CHECK_FALSE(pool.page_locked());  // the upstream does not say: not page-locked
  void* a = pool.allocate(2 * MiB);
  pool.deallocate(pool.allocate(1 * MiB));  // cached
  void* c = pool.allocate(2 * MiB);         // 2 + 1 + 2 > 4: nullptr, the cache is emptied, the retry fits
  CHECK(pool.stats().oom_retries == 1);
  CHECK(pool.stats().reserved_bytes == 4 * MiB);
  std::string message;
  try {
    (void)pool.allocate(1 * MiB);
  } catch (const gpukit::out_of_memory_error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("gpukit::pinned_pool: cannot allocate") != std::string::npos);
  CHECK(message.find("allocate returned nullptr") != std::string::npos);
  const auto h = pool.memory_stats();
  CHECK(h.num_host_alloc == 3);  // refusals are not allocations
  CHECK(h.num_host_free == 1);
  pool.deallocate(a);
  pool.deallocate(c);
  CHECK(pool.empty_cache() == 4 * MiB);
  CHECK(pool.stats().reserved_bytes == 0);
}

TEST_CASE("misuse: foreign pointers and double frees are invalid_argument_error") {
  auto pool = make_cpu_pool();
  int local = 0;
  const auto address = [](const void* p) {  // as the errors print it
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    return std::string(text);
  };
  const std::string foreign = "pinned_pool::deallocate(" + address(&local) + "): not the start of a block";
  CHECK_THROWS_WITH_AS(pool.deallocate(&local), doctest::Contains(foreign.c_str()), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(pool.record_stream(&local, gpukit::stream_view::default_stream(cpu)), gpukit::invalid_argument_error);
  void* p = pool.allocate(KiB);
  CHECK_THROWS_WITH_AS(pool.deallocate(static_cast<char*>(p) + 16), doctest::Contains("interior pointer"),
                       gpukit::invalid_argument_error);
  const std::size_t block = pool.block_size(p);
  pool.deallocate(p);
  try {
    pool.deallocate(p);
    FAIL("double free accepted");
  } catch (const gpukit::invalid_argument_error& e) {
    // The pointer and its block's size, to find the culprit by.
    const std::string expected = "deallocate(" + address(p) + "): its block of " + gpukit::detail::format_bytes(block) +
                                 " was already deallocated";
    CHECK(std::string(e.what()).find(expected) != std::string::npos);
    CHECK(std::string(e.what()).find("double free") != std::string::npos);
  }
  CHECK_THROWS_AS(gpukit::pinned_pool(gpukit::pinned_upstream(), gpukit::pinned_pool_options{SIZE_MAX, 3}),
                  gpukit::invalid_argument_error);
  CHECK(pool.stats().free_blocks == 1);  // the failed calls changed nothing
}

TEST_CASE("destroying a pool with blocks still allocated warns and does not free them") {
  gpukit_test::captured_warnings warnings;
  {
    gpukit::basic_pinned_pool<gpukit_test::fake_address_upstream> pool;
    (void)pool.allocate(3 * KiB);
  }
  CHECK(warnings.contains("destroyed with 1 block(s)"));
}

TEST_CASE("pooled_pinned_buffer returns its block stream-ordered") {
  auto pool = make_cpu_pool();
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);
  const void* first = nullptr;
  {
    gpukit::pooled_pinned_buffer<float> b(1000, pool);
    CHECK(b.size() == 1000);
    CHECK_FALSE(b.page_locked());
    first = b.data();
    b.record_stream(s);
    gpukit::pooled_pinned_buffer<float> moved(std::move(b));
    CHECK(moved.data() == first);
    CHECK(b.data() == nullptr);  // NOLINT(bugprone-use-after-move)
  }
  gpukit::pooled_pinned_buffer<float> other(1000, pool);
  CHECK(static_cast<const void*>(other.data()) != first);
  g.open();
  s.synchronize();
  gpukit::pooled_pinned_buffer<float> again(1000, pool);
  CHECK(static_cast<const void*>(again.data()) == first);
}

TEST_CASE("the default pools: one per device kind, created on first use") {
  gpukit::pinned_pool& a = gpukit::default_pinned_pool(cpu);
  CHECK(&a == &gpukit::default_pinned_pool(cpu));
  CHECK_FALSE(a.page_locked());
  gpukit::pinned_pool& g0 = gpukit::default_pinned_pool(gpukit::device::cuda(0));
  CHECK(&g0 == &gpukit::default_pinned_pool(gpukit::device::cuda(3)));  // portable memory: one for all GPUs
  CHECK(&g0 != &a);
  CHECK(g0.page_locked());
  gpukit::pooled_pinned_buffer<int> b(10, cpu);
  CHECK(b.pool() == &a);
}

TEST_CASE("concurrency: no block is handed out while a stream may still read it") {
  auto pool = make_cpu_pool();
  constexpr int threads = 4;
  constexpr int iterations = 400;
  std::atomic<int> corrupted{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      gpukit::stream s(cpu);
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < iterations; ++i) {
        const std::size_t bytes = (1 + rng() % 8) * 4 * KiB;
        auto* p = static_cast<unsigned char*>(pool.allocate(bytes));
        const auto tag = static_cast<unsigned char>(t * 50 + i % 50);
        std::memset(p, tag, bytes);
        // A "copy" on the stream that reads the block later, after a little delay.
        s.enqueue_host([p, bytes, tag, &corrupted] {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
          for (std::size_t k = 0; k < bytes; k += 512) {
            if (p[k] != tag) {
              ++corrupted;
              return;
            }
          }
        });
        pool.deallocate(p, s);
      }
      s.synchronize();
    });
  }
  for (auto& w : workers) w.join();
  CHECK(corrupted.load() == 0);
  const auto s = pool.stats();
  CHECK(s.allocated_bytes == 0);
  CHECK(s.active_blocks == 0);
  CHECK(s.allocations == static_cast<std::uint64_t>(threads * iterations));
}

TEST_CASE("every block goes back to the upstream: through the cap, empty_cache, stats and destruction") {
  gpukit_test::limited_upstream up;
  {
    gpukit::pinned_pool_options options;
    options.max_cached_bytes = 3 * MiB;
    test_pool pool(up, options);
    gpukit::stream s(cpu);
    std::mt19937 rng(3);
    for (int round = 0; round < 20; ++round) {
      gate g;
      g.hold(s);
      std::vector<void*> blocks;
      for (int i = 0; i < 6; ++i) blocks.push_back(pool.allocate((1 + rng() % 4) * 256 * KiB));
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (i % 2 == 0) {
          pool.deallocate(blocks[i], s);  // pending until the gate opens
        } else {
          pool.deallocate(blocks[i]);
        }
      }
      g.open();
      s.synchronize();
      if (round % 3 == 0) (void)pool.stats();  // promotes pending blocks (and trims them to the cap)
      if (round % 5 == 0) (void)pool.empty_cache();
      const auto st = pool.stats();
      CHECK(st.cached_bytes <= 3 * MiB);
      CHECK(up.shared->outstanding.load() == st.reserved_bytes);  // the pool's books match the upstream's
      const auto h = pool.memory_stats();
      CHECK(h.reserved_bytes.current == static_cast<std::int64_t>(st.reserved_bytes));
      CHECK(h.segment.current == up.shared->allocations.load() - up.shared->frees.load());
      CHECK(h.num_host_alloc == up.shared->allocations.load());
      CHECK(h.num_host_free == up.shared->frees.load());
      CHECK(h.segment.allocated - h.segment.freed == h.segment.current);
      CHECK(h.reserved_bytes.allocated - h.reserved_bytes.freed == h.reserved_bytes.current);
      // A freed block waiting for its stream is still allocated there, as in PyTorch.
      CHECK(h.allocated_bytes.current == static_cast<std::int64_t>(st.allocated_bytes + st.pending_bytes));
      CHECK(h.allocation.current == static_cast<std::int64_t>(st.active_blocks + st.pending_blocks));
    }
  }
  CHECK(up.shared->outstanding.load() == 0);
  CHECK(up.shared->allocations.load() == up.shared->frees.load());
}

namespace {
// An event layer under the test's control: markers are numbers, complete once the test says so; a query of one
// chosen marker throws once (a failing cudaEventQuery).
struct scripted_sync {
  struct state {
    std::set<int> completed;
    int next = 0;
    int fail_query_of = -1;
  };
  std::shared_ptr<state> shared = std::make_shared<state>();

  using marker = int;
  marker record(gpukit::stream_view) { return shared->next++; }
  bool ready(const marker& m) {
    if (m == shared->fail_query_of) {
      shared->fail_query_of = -1;
      throw gpukit::cuda_error("scripted_sync: injected query failure", cudaErrorLaunchFailure, "cudaEventQuery");
    }
    return shared->completed.count(m) != 0;
  }
  void wait(const marker& m) { shared->completed.insert(m); }
  void recycle(marker&&) noexcept {}
};
using scripted_pool = gpukit::basic_pinned_pool<gpukit_test::limited_upstream, scripted_sync>;
}  // namespace

TEST_CASE("issue 12 defect 1: empty_cache after a promotion above the cap releases the block once") {
  gpukit_test::limited_upstream up;
  gpukit::pinned_pool_options options;
  options.max_cached_bytes = MiB;
  {
    test_pool pool(up, options);
    gpukit::stream s(cpu);
    gate g;
    g.hold(s);
    void* p = pool.allocate(4 * MiB);
    pool.record_stream(p, s);
    pool.deallocate(p);  // pending: above the cap, but nothing can be released yet
    g.open();
    s.synchronize();
    CHECK(pool.empty_cache() == 4 * MiB);  // promoted (and released by the cap) inside this call
    auto st = pool.stats();
    CHECK(st.reserved_bytes == 0);
    CHECK(st.cached_bytes == 0);
    CHECK(st.cap_releases == 1);
    CHECK(st.upstream_frees == 1);
    CHECK(up.shared->frees.load() == 1);
    CHECK(up.shared->outstanding.load() == 0);
    // Caching still works: a block below the cap is kept and served again.
    void* q = pool.allocate(512 * KiB);
    pool.deallocate(q);
    CHECK(pool.stats().free_blocks == 1);
    void* r = pool.allocate(512 * KiB);
    CHECK(r == q);
    st = pool.stats();
    CHECK(st.cache_hits == 1);
    CHECK(st.reserved_bytes == 512 * KiB);
    pool.deallocate(r);
  }
  CHECK(up.shared->allocations.load() == up.shared->frees.load());
}

TEST_CASE("issue 12 defect 3: an event query that throws leaves the pending list and its counters intact") {
  gpukit_test::limited_upstream up;
  scripted_sync sync;
  const std::size_t size = gpukit::pinned_size_class(64 * KiB);
  {
    scripted_pool pool(up, {}, sync);
    const auto stream = gpukit::stream_view::default_stream(cpu);
    std::set<void*> blocks;
    for (int i = 0; i < 3; ++i) blocks.insert(pool.allocate(64 * KiB));
    for (void* p : blocks) pool.deallocate(p, stream);  // markers 0, 1, 2
    CHECK(pool.stats().pending_blocks == 3);
    sync.shared->completed = {0, 1};
    sync.shared->fail_query_of = 2;  // the first two are promoted, then the third's query throws
    CHECK_THROWS_AS((void)pool.allocate(64 * KiB), gpukit::cuda_error);
    auto st = pool.stats();  // marker 2 is still incomplete: its block stays pending
    CHECK(st.pending_blocks == 1);
    CHECK(st.pending_bytes == size);
    CHECK(st.free_blocks == 2);
    CHECK(st.cached_bytes == 3 * size);
    CHECK(st.allocated_bytes == 0);
    sync.shared->completed.insert(2);
    std::set<void*> served;
    for (int i = 0; i < 3; ++i) served.insert(pool.allocate(64 * KiB));
    CHECK(served == blocks);  // each block once: none handed out twice
    void* fresh = pool.allocate(64 * KiB);
    CHECK(blocks.count(fresh) == 0);
    st = pool.stats();
    CHECK(st.pending_bytes == 0);
    CHECK(st.pending_blocks == 0);
    CHECK(st.free_blocks == 0);
    CHECK(st.active_blocks == 4);
    CHECK(st.reserved_bytes == 4 * size);
    CHECK(up.shared->outstanding.load() == 4 * size);
    for (void* p : served) pool.deallocate(p);
    pool.deallocate(fresh);
  }
  CHECK(up.shared->allocations.load() == up.shared->frees.load());
}

TEST_CASE("issue 12 defect 3: set_max_cached_bytes applies the new cap even when an event query throws") {
  gpukit_test::limited_upstream up;
  scripted_sync sync;
  const std::size_t size = gpukit::pinned_size_class(MiB);
  {
    scripted_pool pool(up, {}, sync);
    void* a = pool.allocate(MiB);
    void* b = pool.allocate(MiB);
    pool.deallocate(a);                                            // free
    pool.deallocate(b, gpukit::stream_view::default_stream(cpu));  // pending on marker 0
    sync.shared->fail_query_of = 0;
    CHECK_THROWS_AS(pool.set_max_cached_bytes(0), gpukit::cuda_error);
    CHECK(pool.options().max_cached_bytes == 0);
    auto st = pool.stats();
    CHECK(st.free_blocks == 0);  // the free block went: the cap is in force
    CHECK(st.pending_blocks == 1);
    CHECK(st.reserved_bytes == size);
    CHECK(up.shared->outstanding.load() == size);
    sync.shared->completed.insert(0);
    st = pool.stats();  // promoted, and released by the cap
    CHECK(st.pending_blocks == 0);
    CHECK(st.reserved_bytes == 0);
    CHECK(st.upstream_frees == 2);
  }
  CHECK(up.shared->outstanding.load() == 0);
  CHECK(up.shared->allocations.load() == up.shared->frees.load());
}
