// The misuse catalogue (issue 12): every way a user can hold gpukit wrong that an adversarial pass tried, each with
// its documented outcome. One doctest case per misuse, and ctest runs each in its own process, so a crash, an abort
// or a hang (ctest's timeout) in one is detected and named. The outcomes, in README.md's Reliability section:
//   throws <type>   the call throws that gpukit exception (or std::bad_alloc / std::length_error where noted) and
//                   leaves the object as it was;
//   warns           a destructor or host function cannot throw, so gpukit::warn reports it and nothing leaks;
//   defined         the call is accepted with the documented meaning (e.g. a limit below usage).
// Everything runs on the CPU device: the checks live above the backend, and the CUDA-specific misuses (capture,
// destroyed handles, foreign contexts) are in tests/cudasim.
#include "support.hpp"

#include <gpukit/gpukit.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using gpukit::device;
using gpukit::stream_view;

using gpukit_test::captured_warnings;

/// The message of the gpukit exception `f` throws, failing the case when it throws none or another type.
template <class Exception, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw another type: " << e.what());
    return {};
  }
  FAIL("threw nothing");
  return {};
}

stream_view cpu_default() { return stream_view::default_stream(device::cpu()); }

}  // namespace

// --- devices and strings -------------------------------------------------------------------------------------

TEST_CASE("misuse 01: device::cuda with a negative ordinal throws invalid_argument_error") {
  CHECK_THROWS_AS(device::cuda(-1), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 02: device::parse of malformed strings throws invalid_argument_error naming the text") {
  for (const char* text : {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1x", "cuda:99999999999", "cpu:0", "CUDA :1",
                           "cuda::1", "cuda:+1", "cuda: 1 2"}) {
    CAPTURE(text);
    const std::string m = message_of<gpukit::invalid_argument_error>([&] { (void)device::parse(text); });
    if (*text != '\0') CHECK(m.find(text) != std::string::npos);
  }
}

TEST_CASE("misuse 03: device::parse ignores surrounding whitespace, as documented") {
  CHECK(device::parse(" cuda:1\n") == device::cuda(1));
  CHECK(device::parse("\tcpu ") == device::cpu());
}

TEST_CASE("misuse 04: a malformed or unusable GPUKIT_DEVICE throws invalid_argument_error naming the variable") {
  for (const char* value : {"cuda:x", "gpu", "cuda:-2", "cuda:99999999999"}) {
    CAPTURE(value);
    gpukit_test::scoped_env env("GPUKIT_DEVICE", std::string(value));
    std::string m;
    try {
      (void)gpukit::select_device();
      FAIL("accepted");
    } catch (const gpukit::error& e) {
      m = e.what();
    }
    CHECK(m.find("GPUKIT_DEVICE") != std::string::npos);
  }
}

TEST_CASE("misuse 05: a malformed LOCAL_RANK is an error naming the variable, with or without a GPU") {
  gpukit_test::scoped_env no_device("GPUKIT_DEVICE", std::nullopt);
  for (const char* value : {"-1", "abc", "1.5", "99999999999999999999999"}) {
    CAPTURE(value);
    gpukit_test::scoped_env env("LOCAL_RANK", std::string(value));
    std::string m;
    try {
      (void)gpukit::select_device();
      FAIL("accepted");
    } catch (const gpukit::invalid_argument_error& e) {
      m = e.what();
    }
    CHECK(m.find("LOCAL_RANK") != std::string::npos);
  }
}

TEST_CASE("misuse 06: a NaN, negative or above-one memory fraction throws invalid_argument_error") {
  gpukit::caching_allocator a(device::cpu());
  for (double f : {std::nan(""), -0.5, 0.0, 1.5, std::numeric_limits<double>::infinity()}) {
    CAPTURE(f);
    CHECK_THROWS_AS(a.set_memory_fraction(f), gpukit::invalid_argument_error);
  }
  CHECK(a.stats().reserved_limit == std::numeric_limits<std::size_t>::max());
}

// --- allocator ----------------------------------------------------------------------------------------------

TEST_CASE("misuse 07: a size that overflows when rounded throws invalid_argument_error, a huge one out of memory") {
  gpukit::caching_allocator a(device::cpu());
  CHECK_THROWS_AS((void)a.allocate(std::numeric_limits<std::size_t>::max(), cpu_default()),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS((void)a.allocate(std::numeric_limits<std::size_t>::max() / 4, cpu_default()),
                  gpukit::out_of_memory_error);
  CHECK(a.memory_allocated() == 0);
  void* p = a.allocate(4096, cpu_default());  // still usable
  a.deallocate(p);
}

TEST_CASE("misuse 08: a device_buffer whose count times sizeof(T) overflows throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  CHECK_THROWS_AS(gpukit::device_buffer<std::uint64_t>(std::numeric_limits<std::size_t>::max() / 4, s),
                  gpukit::invalid_argument_error);
}

TEST_CASE("misuse 09: a double free throws invalid_argument_error and changes nothing") {
  gpukit::caching_allocator a(device::cpu());
  void* p = a.allocate(1000, cpu_default());
  void* q = a.allocate(1000, cpu_default());
  a.deallocate(p);
  const auto before = a.stats();
  CHECK_THROWS_AS(a.deallocate(p), gpukit::invalid_argument_error);
  CHECK(a.stats().allocated_bytes.all().current == before.allocated_bytes.all().current);
  a.deallocate(q);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("misuse 10: freeing a foreign pointer throws invalid_argument_error") {
  gpukit::caching_allocator a(device::cpu());
  int local = 0;
  auto heap = std::make_unique<char[]>(64);
  CHECK_THROWS_AS(a.deallocate(&local), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(a.deallocate(heap.get()), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(a.record_stream(&local, cpu_default()), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 11: freeing a pointer of another allocator throws invalid_argument_error in both") {
  gpukit::caching_allocator a(device::cpu());
  gpukit::caching_allocator b(device::cpu());
  void* p = a.allocate(4096, cpu_default());
  CHECK_THROWS_AS(b.deallocate(p), gpukit::invalid_argument_error);
  a.deallocate(p);
}

TEST_CASE("misuse 12: freeing an interior pointer throws invalid_argument_error naming the allocation") {
  gpukit::caching_allocator a(device::cpu());
  char* p = static_cast<char*>(a.allocate(4096, cpu_default()));
  const std::string m = message_of<gpukit::invalid_argument_error>([&] { a.deallocate(p + 512); });
  CHECK(m.find("512 bytes into a block of 4096 bytes") != std::string::npos);
  a.deallocate(p);
}

TEST_CASE("misuse 13: a stream of another device in deallocate or record_stream throws invalid_argument_error") {
  gpukit::caching_allocator a(device::cpu());
  void* p = a.allocate(4096, cpu_default());
  // The legacy default stream of cuda:0 shares no queue with the CPU's default stream (defect 4).
  const stream_view other = stream_view::default_stream(device::cuda(0));
  CHECK_THROWS_AS(a.deallocate(p, other), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(a.record_stream(p, other), gpukit::invalid_argument_error);
  CHECK(a.memory_allocated() > 0);  // still allocated
  a.deallocate(p);
}

TEST_CASE("misuse 14: a reserved limit below usage is defined: nothing is freed, the next segment is refused") {
  gpukit::caching_allocator a(device::cpu());
  void* p = a.allocate(8u << 20, cpu_default());
  const std::size_t reserved = a.memory_reserved();
  a.set_reserved_limit(1u << 20);
  CHECK(a.stats().reserved_limit == (1u << 20));
  CHECK(a.memory_reserved() == reserved);  // the live allocation's segment stays
  CHECK_THROWS_AS((void)a.allocate(reserved, cpu_default()), gpukit::out_of_memory_error);  // needs a new segment
  a.deallocate(p);
  a.set_reserved_limit(std::numeric_limits<std::size_t>::max());
  void* q = a.allocate(reserved, cpu_default());
  a.deallocate(q);
}

TEST_CASE("misuse 15: a moved-from device_buffer is empty: its members are defined and freeing it does nothing") {
  gpukit::stream s(device::cpu());
  gpukit::device_buffer<int> a(16, s);
  gpukit::device_buffer<int> b(std::move(a));
  CHECK(b.size() == 16);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty, like a default-constructed one
  CHECK(a.size() == 0);
  a.record_stream(s);  // nothing to record
  a.reset();
  CHECK(gpukit::memory_allocated(device::cpu()) == 512);  // b, rounded to 512 bytes, is still allocated
}

TEST_CASE("misuse 16: a device_buffer outliving its allocator's stream is reported by warn, nothing leaks") {
  captured_warnings warnings;
  gpukit::caching_allocator a(device::cpu());
  void* p = nullptr;
  {
    gpukit::stream s(device::cpu());
    p = a.allocate(4096, s);
  }
  a.deallocate(p);
  CHECK(warnings.contains("destroyed"));
  CHECK(a.memory_allocated() == 0);
}

// --- streams, events, pools ---------------------------------------------------------------------------------

TEST_CASE("misuse 17: using a moved-from stream or event throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  gpukit::stream t(std::move(s));
  CHECK_THROWS_AS(s.synchronize(), gpukit::invalid_argument_error);  // NOLINT(bugprone-use-after-move)
  gpukit::event e(device::cpu());
  gpukit::event f(std::move(e));
  CHECK_THROWS_AS(e.record(t), gpukit::invalid_argument_error);  // NOLINT(bugprone-use-after-move)
  f.record(t);
  f.synchronize();
}

TEST_CASE("misuse 18: recording an event on a stream of another device throws invalid_argument_error") {
  gpukit::event e(device::cpu());
  CHECK_THROWS_AS(e.record(stream_view::default_stream(device::cuda(0))), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 19: a host function that throws is reported by warn and the stream keeps working") {
  captured_warnings warnings;
  gpukit::stream s(device::cpu());
  std::atomic<int> after{0};
  s.enqueue_host([] { throw std::runtime_error("boom from a host function"); });
  s.enqueue_host([&] { after = 1; });
  s.synchronize();
  CHECK(after == 1);
  CHECK(warnings.contains("boom from a host function"));
}

TEST_CASE("misuse 20: an empty host function throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  CHECK_THROWS_AS(s.enqueue_host(std::function<void()>{}), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 21: a stream pool of size zero throws invalid_argument_error") {
  CHECK_THROWS_AS(gpukit::stream_pool(device::cpu(), 0), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 22: exclusive leases beyond capacity throw invalid_argument_error naming the capacity") {
  gpukit::stream_pool pool(device::cpu(), 2, {}, 1);
  auto lease = pool.acquire_exclusive();
  const std::string m = message_of<gpukit::invalid_argument_error>([&] { (void)pool.acquire_exclusive(); });
  CHECK(m.find('1') != std::string::npos);
  CHECK_FALSE(pool.try_acquire_exclusive().has_value());
}

TEST_CASE("misuse 23: destroying a stream with pending work waits for it (CPU), nothing is lost") {
  std::atomic<int> ran{0};
  {
    gpukit::stream s(device::cpu());
    for (int i = 0; i < 100; ++i) s.enqueue_host([&] { ++ran; });
  }
  CHECK(ran == 100);
}

TEST_CASE("misuse 24: deep recursion of host functions on the CPU default stream does not overflow the stack") {
  const stream_view s = cpu_default();
  std::atomic<int> depth{0};
  std::function<void()> step = [&] {
    if (++depth < 200000) s.enqueue_host(step);
  };
  s.enqueue_host(step);
  s.synchronize();
  CHECK(depth == 200000);
}

// --- pinned memory ----------------------------------------------------------------------------------------------

TEST_CASE("misuse 25: pinned pool double, foreign and interior frees throw invalid_argument_error") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(device::kind::cpu)};
  char* p = static_cast<char*>(pool.allocate(4096));
  CHECK_THROWS_AS(pool.deallocate(p + 64), gpukit::invalid_argument_error);
  int local = 0;
  CHECK_THROWS_AS(pool.deallocate(&local), gpukit::invalid_argument_error);
  pool.deallocate(p);
  CHECK_THROWS_AS(pool.deallocate(p), gpukit::invalid_argument_error);
  CHECK(pool.stats().allocated_bytes == 0);
}

TEST_CASE("misuse 26: a pinned pool size that overflows throws, a huge one is out of memory") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(device::kind::cpu)};
  CHECK_THROWS_AS((void)pool.allocate(std::numeric_limits<std::size_t>::max()), gpukit::error);
  CHECK(pool.stats().allocated_bytes == 0);
  void* p = pool.allocate(100);
  pool.deallocate(p);
}

TEST_CASE("misuse 27: a pinned_buffer whose count times sizeof(T) overflows throws invalid_argument_error") {
  CHECK_THROWS_AS(gpukit::pinned_buffer<std::uint64_t>(std::numeric_limits<std::size_t>::max() / 4, device::cpu()),
                  gpukit::invalid_argument_error);
}

// --- transfers -------------------------------------------------------------------------------------------------

TEST_CASE("misuse 28: copy_async with different element counts throws invalid_argument_error, nothing enqueued") {
  gpukit::stream s(device::cpu());
  std::vector<int> host(10, 1);
  gpukit::device_buffer<int> dev(11, s);
  CHECK_THROWS_AS(gpukit::copy_async(dev, host, s), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 29: copy_async with a null pointer and a non-zero size throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  gpukit::device_buffer<int> dev(4, s);
  CHECK_THROWS_AS(gpukit::copy_async(dev, gpukit::host_span<int>(nullptr, 4), s), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 30: copy_async whose byte count overflows throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  std::uint32_t word = 0;
  const std::size_t count = (std::size_t{1} << 62) + 1;  // count * 4 wraps to 4
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<std::uint32_t>(&word, count, device::cpu()),
                                     gpukit::host_span<std::uint32_t>(&word, count), s),
                  gpukit::invalid_argument_error);
}

TEST_CASE("misuse 31: copy_async between overlapping ranges throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  gpukit::device_buffer<int> dev(16, s);
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(dev.data(), 8, device::cpu()),
                                     gpukit::device_span<int>(dev.data() + 4, 8, device::cpu()), s),
                  gpukit::invalid_argument_error);
}

TEST_CASE("misuse 32: copy_async with memory of another device than the stream's throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  std::vector<int> host(4, 1);
  int fake = 0;
  CHECK_THROWS_AS(gpukit::copy_async(gpukit::device_span<int>(&fake, 1, device::cuda(0)),
                                     gpukit::host_span<int>(host.data(), 1), s),
                  gpukit::invalid_argument_error);
}

TEST_CASE("misuse 33: a prefetcher producer that throws surfaces from next() after earlier batches") {
  gpukit::stream s(device::cpu());
  gpukit::prefetcher<int> loader(s, 4, [](std::size_t i, gpukit::span<int> out) -> std::size_t {
    if (i == 2) throw std::runtime_error("producer failed at 2");
    out[0] = static_cast<int>(i);
    return 1;
  });
  CHECK(loader.next().has_value());
  CHECK(loader.next().has_value());
  const std::string m = message_of<std::runtime_error>([&] { (void)loader.next(); });
  CHECK(m.find("producer failed at 2") != std::string::npos);
}

TEST_CASE("misuse 34: a prefetcher producer that writes more than the batch holds is an invalid_argument_error") {
  gpukit::stream s(device::cpu());
  gpukit::prefetcher<int> loader(s, 4, [](std::size_t, gpukit::span<int> out) { return out.size() + 1; });
  CHECK_THROWS_AS((void)loader.next(), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 35: a prefetcher producer that calls next() is an error, not a deadlock") {
  gpukit::stream s(device::cpu());
  std::promise<gpukit::prefetcher<int>*> self;
  std::shared_future<gpukit::prefetcher<int>*> loader_of = self.get_future().share();
  gpukit::prefetcher<int> loader(s, 4, [&](std::size_t, gpukit::span<int>) -> std::size_t {
    (void)loader_of.get()->next();  // the producer runs on the prefetcher's thread
    return 1;
  });
  self.set_value(&loader);
  CHECK_THROWS_AS((void)loader.next(), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 36: holding more prefetched batches than the depth throws instead of deadlocking") {
  gpukit::stream s(device::cpu());
  gpukit::prefetcher<int> loader(s, 4, [](std::size_t, gpukit::span<int> out) {
    out[0] = 1;
    return std::size_t{1};
  });
  auto a = loader.next();
  auto b = loader.next();
  CHECK_THROWS_AS((void)loader.next(), gpukit::invalid_argument_error);
}

// --- diagnostics ---------------------------------------------------------------------------------------------------

TEST_CASE("misuse 37: a warning handler that warns again or replaces itself neither deadlocks nor recurses") {
  std::atomic<int> calls{0};
  gpukit::set_warning_handler([&](std::string_view) {
    if (++calls == 1) {
      gpukit::warn("from inside the handler");
      gpukit::set_warning_handler(nullptr);
    }
  });
  gpukit::warn("first");
  gpukit::set_warning_handler(nullptr);
  CHECK(calls >= 1);
}

// --- lifetimes, limits and odd arguments --------------------------------------------------------------------------

TEST_CASE("misuse 38: an allocator destroyed with live allocations warns with the count and releases the memory") {
  captured_warnings warnings;
  {
    gpukit::caching_allocator a(device::cpu());
    (void)a.allocate(3000, cpu_default());
    (void)a.allocate(5000, cpu_default());
  }  // LeakSanitizer (ASan configuration) fails the case if the memory were not released
  CHECK(warnings.contains("destroyed with 2 live allocation(s)"));
}

TEST_CASE("misuse 39: trim above reserved and empty_cache with live allocations are defined and keep live memory") {
  gpukit::caching_allocator a(device::cpu());
  void* p = a.allocate(1u << 20, cpu_default());
  const std::size_t reserved = a.memory_reserved();
  CHECK(a.trim(reserved * 4) == reserved);  // returns what stays reserved: nothing was released
  a.empty_cache();
  CHECK(a.memory_allocated() == (1u << 20));
  CHECK(a.memory_reserved() > 0);
  a.deallocate(p);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("misuse 40: pinned pool record_stream of a foreign pointer throws, a zero cache cap is defined") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(device::kind::cpu)};
  int local = 0;
  CHECK_THROWS_AS(pool.record_stream(&local, cpu_default()), gpukit::invalid_argument_error);
  pool.set_max_cached_bytes(0);  // caching off: every free goes back to the upstream
  void* p = pool.allocate(4096);
  pool.deallocate(p);
  CHECK(pool.stats().reserved_bytes == 0);
}

TEST_CASE("misuse 41: elapsed_time of events without timing or never recorded throws invalid_argument_error") {
  gpukit::stream s(device::cpu());
  gpukit::event plain_a(device::cpu()), plain_b(device::cpu());
  plain_a.record(s);
  plain_b.record(s);
  CHECK_THROWS_AS(gpukit::elapsed_time(plain_a, plain_b), gpukit::invalid_argument_error);
  gpukit::event_options timing;
  timing.timing = true;
  gpukit::event a(device::cpu(), timing), b(device::cpu(), timing);
  a.record(s);
  CHECK_THROWS_AS(gpukit::elapsed_time(a, b), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 42: a CUDA ordinal that is not there is a clear gpukit::error, never a crash") {
  const int n = gpukit::device_count();
  const device missing = device::cuda(n + 3);
  try {
    gpukit::stream s(missing);
    FAIL("a stream was created on " << missing.to_string());
  } catch (const gpukit::no_device_error& e) {
    CHECK(n == 0);  // no driver or no GPU: that is what the error says
    CHECK(std::string(e.what()).find("driver") != std::string::npos);
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(n > 0);  // GPUs present: the ordinal is not visible
    CHECK(std::string(e.what()).find(std::to_string(n + 3)) != std::string::npos);
  }
}

TEST_CASE("misuse 43: waiting for an event that was never recorded is defined as CUDA defines it: no wait") {
  gpukit::stream s(device::cpu());
  gpukit::event never(device::cpu());
  CHECK(never.ready());
  never.wait(s);
  std::atomic<int> ran{0};
  s.enqueue_host([&] { ran = 1; });
  s.synchronize();
  CHECK(ran == 1);
}

TEST_CASE("misuse 44: prefetcher options out of range throw invalid_argument_error at construction") {
  gpukit::stream s(device::cpu());
  auto produce = [](std::size_t, gpukit::span<int>) { return std::size_t{0}; };
  gpukit::prefetch_options shallow;
  shallow.depth = 1;
  CHECK_THROWS_AS(gpukit::prefetcher<int>(s, 4, produce, shallow), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<int>(s, 0, produce), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<int>(s, 4, gpukit::prefetcher<int>::producer{}), gpukit::invalid_argument_error);
}

TEST_CASE("misuse 45: a zero-size copy is a no-op even with null pointers") {
  gpukit::stream s(device::cpu());
  gpukit::copy_async(gpukit::device_span<int>(nullptr, 0, device::cpu()), gpukit::host_span<int>(nullptr, 0), s);
  s.synchronize();
}

TEST_CASE("misuse 46: a device_buffer on a stream of another device than its allocator throws invalid_argument_error") {
  gpukit::caching_allocator a(device::cpu());
  CHECK_THROWS_AS(gpukit::device_buffer<int>(16, stream_view::default_stream(device::cuda(0)), a),
                  gpukit::invalid_argument_error);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("misuse 47: a host registration of a span whose byte size overflows throws invalid_argument_error") {
  std::uint64_t word = 0;
  const gpukit::span<std::uint64_t> huge(&word, std::numeric_limits<std::size_t>::max() / 4);
  CHECK(huge.size_bytes() == std::numeric_limits<std::size_t>::max());  // saturates instead of wrapping
  CHECK_THROWS_AS(gpukit::host_registration(huge, device::cpu()), gpukit::invalid_argument_error);
}
