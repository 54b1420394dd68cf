// The staging engine on the simulated runtime, where what a GPU leaves to chance is fixed: a destroyed stream's
// handle is handed to the next stream created (LIFO), and the host functions of all streams of a device run one at a
// time on one thread. Staged copies must not mistake a new stream for a dead one, must not keep rings of dead
// streams, and must not depend on host functions (which another stream's host function can hold back). Also: a CUDA
// failure partway through a staged copy names the chunk and what may still land; copies on the legacy default stream
// are refused while another thread captures a blocking stream; and (here for its fault injection) resource_upstream
// keeps a failed wait's error when the cleanup free fails too.
#include <gpukit/memory/memory_resource.hpp>  // first: it sets up CCCL's concepts (see its file comment)
#include <gpukit/memory/resource_upstream.hpp>

#include <gpukit/gpukit.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/pmr.hpp>

#include "cudasim.hpp"
#include "call_during_capture.hpp"
#include "support.hpp"
#include "failing_heap.hpp"  // replaces operator new here: tests of host out-of-memory paths

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
constexpr std::size_t MiB = 1024 * 1024;

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131u + seed * 17u + (i >> 11)) & 0xFFu);
  return v;
}

/// Device memory of cuda:0 for a test (freed with cudaFree, which waits for the device's work).
struct device_memory {
  explicit device_memory(std::size_t bytes) { REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess); }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  ~device_memory() { (void)cudaFree(p); }
  void* p = nullptr;
};

/// Makes a deadlock fail instead of hanging CI: unless finish() is called within `limit`, opens the gate (should a
/// call wait for the held stream) and, if finish() still does not come within `limit` more, ends the process.
class watchdog {
 public:
  watchdog(gpukit_test::gate& g, std::chrono::seconds limit) : thread_([this, &g, limit] { watch(g, limit); }) {}
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  ~watchdog() {
    finish();
    thread_.join();
  }
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = true;
    }
    cv_.notify_all();
  }
  /// Whether the watchdog had to open the gate (a call waited for the held stream).
  bool opened_gate() {
    std::lock_guard<std::mutex> lock(mutex_);
    return opened_gate_;
  }

 private:
  void watch(gpukit_test::gate& g, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (cv_.wait_for(lock, limit, [&] { return finished_; })) return;
    opened_gate_ = true;
    lock.unlock();
    g.open();
    lock.lock();
    if (cv_.wait_for(lock, limit, [&] { return finished_; })) return;
    std::fprintf(stderr,
                 "FAILED: deadlock: the handed-over transfer has not landed long after the stream was let go "
                 "(the staging background thread waits for the host function that waits for it)\n");
    std::fflush(stderr);
    std::_Exit(1);
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool finished_ = false;
  bool opened_gate_ = false;
  std::thread thread_;
};

gpukit::staging_options small_options() {
  gpukit::staging_options o;
  o.chunk_bytes = 1 * MiB;
  o.min_chunk_bytes = 256 * 1024;
  o.slots = 4;
  return o;
}

/// An engine with small slots and a short patience over a pool that caches nothing (a cap of 0: a freed block goes to
/// cudaFreeHost at once), for what the engine must not wait for while its stream is held.
struct engine_over_uncached_pool {
  engine_over_uncached_pool() { pool.set_max_cached_bytes(0); }
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine{pool, [] {
                                  auto o = small_options();
                                  o.patience = 10ms;
                                  return o;
                                }()};
};
}  // namespace

TEST_CASE("sim staging: a new stream that gets a destroyed stream's handle gets its own ring, not the dead one's") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.patience = 2s;  // a new stream waiting for the dead stream's slots would wait this long
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(4 * MiB, 1);  // fills a ring
  device_memory for_a(host.size());
  device_memory for_b(host.size());
  gpukit_test::gate g;
  auto a = std::make_unique<gpukit::stream>(d);
  const cudaStream_t handle = a->cuda_handle();
  g.hold(*a);
  engine.to_device(for_a.p, host.data(), host.size(), *a);  // a's slots stay busy behind the gate
  a.reset();                                                // destroyed with its work pending
  gpukit::stream b(d);
  REQUIRE(b.cuda_handle() == handle);  // CUDA may hand out the handle again at once; the simulator always does
  const auto start = std::chrono::steady_clock::now();
  engine.to_device(for_b.p, host.data(), host.size(), b);
  b.synchronize();
  CHECK(std::chrono::steady_clock::now() - start < 1s);
  const auto st = engine.stats();
  CHECK(st.slot_waits == 0);  // b never waited for a's slots
  CHECK(st.overflows == 0);
  CHECK(st.rings == 2);
  g.open();
  cudasim::drain_all();
  std::vector<unsigned char> back(host.size());
  engine.to_host(back.data(), for_a.p, back.size(), b);
  CHECK(back == host);
}

TEST_CASE("sim staging: rings of destroyed streams do not accumulate beyond max_rings") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.max_rings = 2;
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(2 * MiB, 2);
  device_memory dev(host.size());
  for (int i = 0; i < 10; ++i) {
    gpukit::stream s(d);  // each one the same handle as the one before, and a new stream
    engine.to_device(dev.p, host.data(), host.size(), s);
    s.synchronize();
  }
  const auto st = engine.stats();
  CHECK(st.rings_created == 10);  // one ring per stream, never one stream's ring for another
  CHECK(st.rings <= 2);
  CHECK(st.rings_released >= 8);
  CHECK(pool.stats().allocated_bytes <= 2 * 4 * MiB);
}

TEST_CASE("sim staging: copies into pageable memory launch no host function") {
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  const auto host = pattern(20 * MiB + 3, 3);
  device_memory dev(host.size());
  gpukit::copy_async(gpukit::device_span<unsigned char>(static_cast<unsigned char*>(dev.p), host.size(), d), host, s);
  std::vector<unsigned char> back(host.size(), 0);
  const std::size_t before = cudasim::calls("cudaLaunchHostFunc");
  gpukit::copy_async(back, gpukit::device_span<const unsigned char>(static_cast<unsigned char*>(dev.p), host.size(), d),
                     s);
  CHECK(cudasim::calls("cudaLaunchHostFunc") == before);
  CHECK(back == host);  // complete when copy_async returned
}

TEST_CASE("sim staging: the per-thread default stream of each thread has its own ring") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, small_options());
  const auto host = pattern(3 * MiB, 4);
  device_memory dev(host.size());
  {
    gpukit::device_guard guard(d);
    engine.to_device(dev.p, host.data(), host.size(), gpukit::stream_view(d, cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess);
  }
  bool same = false;
  std::thread other([&] {
    gpukit::device_guard guard(d);
    std::vector<unsigned char> back(host.size());
    engine.to_host(back.data(), dev.p, back.size(), gpukit::stream_view(d, cudaStreamPerThread));
    same = back == host;
  });
  other.join();
  CHECK(same);
  CHECK(engine.stats().rings_created == 2);
}

TEST_CASE("sim staging: the rest of a transfer staged in the background on cuda:1 touches no other device") {
  cudasim::allow_contexts_only_on({1});
  const auto d = gpukit::device::cuda(1);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.patience = 10ms;
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(12 * MiB + 5, 5);
  void* dev = nullptr;
  std::vector<unsigned char> back(host.size(), 0);
  {
    gpukit::device_guard guard(d);
    REQUIRE(cudaMalloc(&dev, host.size()) == cudaSuccess);
  }
  {
    gpukit::stream s(d);
    gpukit_test::gate g;
    g.hold(s);
    engine.to_device(dev, host.data(), host.size(), s);  // the ring's 4 MiB, then the rest in the background
    CHECK(engine.stats().overflows == 1);
    CHECK(pool.stats().allocated_bytes_peak <= engine.max_pinned_bytes_per_stream());
    g.open();
    engine.to_host(back.data(), dev, back.size(), s);
  }
  CHECK(back == host);
  CHECK(engine.release_idle() == 1);
  CHECK(cudasim::context_creations(0) == 0);
  {
    gpukit::device_guard guard(d);
    CHECK(cudaFree(dev) == cudaSuccess);
  }
  cudasim::allow_contexts_only_on({});
}

TEST_CASE("sim staging: slots grown while the stream is held leave the pool over its cap instead of cudaFreeHost") {
  // A grown slot's old block goes back to the pool; over max_cached_bytes the pool would release cached blocks with
  // cudaFreeHost, which waits for all the device's work: the held stream's too, whose gate opens only after to_device
  // returns. The cap waits for the pool's next call outside the engine.
  const auto d = gpukit::device::cuda(0);
  engine_over_uncached_pool fixture;
  auto& pool = fixture.pool;
  auto& engine = fixture.engine;
  const auto small = pattern(1 * MiB, 8);       // 256 KiB slots
  const auto large = pattern(12 * MiB + 9, 9);  // 1 MiB chunks: each idle slot grows
  device_memory for_small(small.size());
  device_memory for_large(large.size());
  gpukit::stream s(d);
  engine.to_device(for_small.p, small.data(), small.size(), s);
  s.synchronize();  // every slot idle
  gpukit_test::gate g;
  watchdog dog(g, 10s);  // a regression fails instead of hanging
  g.hold(s);
  const std::size_t frees = cudasim::calls("cudaFreeHost");
  engine.to_device(for_large.p, large.data(), large.size(), s);
  CHECK(cudasim::calls("cudaFreeHost") == frees);
  const gpukit::pinned_pool_stats over = pool.stats();
  CHECK(over.reserved_bytes > over.allocated_bytes);  // the old blocks, cached over the cap of 0
  g.open();
  s.synchronize();
  dog.finish();
  CHECK_FALSE(dog.opened_gate());  // to_device returned while the stream was held
  void* p = pool.allocate(4096);
  pool.deallocate(p);  // outside the engine: the cap applies
  const gpukit::pinned_pool_stats after = pool.stats();
  CHECK(after.reserved_bytes - after.allocated_bytes - after.pending_bytes <= pool.options().max_cached_bytes);
  CHECK(cudasim::calls("cudaFreeHost") > frees);
  std::vector<unsigned char> back(large.size(), 0);
  engine.to_host(back.data(), for_large.p, back.size(), s);
  CHECK(back == large);
}

TEST_CASE("sim staging: the background thread makes no pinned-pool call, so it never waits for its own host function") {
  // The host function H that holds the stream's later work waits for the background thread. cudaFreeHost (and so any
  // pinned-pool call, which may release cached blocks) waits for the device's work, H included: were the background
  // thread to grow its slots through the pool, it would wait for H, which waits for it. A cap of 0 makes every freed
  // block go back to cudaFreeHost at once.
  const auto d = gpukit::device::cuda(0);
  engine_over_uncached_pool fixture;
  auto& pool = fixture.pool;
  auto& engine = fixture.engine;
  const auto small = pattern(1 * MiB, 6);       // 4 chunks of 256 KiB: fills the ring with 256 KiB slots
  const auto large = pattern(12 * MiB + 7, 7);  // 1 MiB chunks: past the patience, staged in the background
  device_memory for_small(small.size());
  device_memory for_large(large.size());
  gpukit::stream s(d);
  gpukit_test::gate g;

  watchdog dog(g, 10s);  // a regression fails instead of hanging
  g.hold(s);
  engine.to_device(for_small.p, small.data(), small.size(), s);
  engine.to_device(for_large.p, large.data(), large.size(), s);  // slot 0 held by the gate: all of it handed over
  {
    const auto st = engine.stats();
    CHECK(st.overflows == 1);
    CHECK(st.overflow_bytes == large.size());
  }
  g.open();
  s.synchronize();  // the copies, then H
  dog.finish();
  CHECK_FALSE(dog.opened_gate());  // to_device returned while the stream was held
  CHECK(engine.stats().background_failures == 0);
  CHECK(pool.stats().allocated_bytes_peak <= engine.max_pinned_bytes_per_stream());
  std::vector<unsigned char> back_small(small.size(), 0);
  std::vector<unsigned char> back_large(large.size(), 0);
  engine.to_host(back_small.data(), for_small.p, back_small.size(), s);
  engine.to_host(back_large.data(), for_large.p, back_large.size(), s);
  CHECK(back_small == small);
  CHECK(back_large == large);
}

TEST_CASE("sim staging: a transfer queued behind a busy background thread is staged at the size the slots have") {
  // The second hand-over finds the background thread owning the slots (256 KiB) while its transfer wants 1 MiB
  // chunks: neither the caller (whose lane it is not) nor the background thread (which would wait for its own host
  // functions) may grow them, so the rest goes through them at their size.
  const auto d = gpukit::device::cuda(0);
  engine_over_uncached_pool fixture;
  auto& pool = fixture.pool;
  auto& engine = fixture.engine;
  const auto first = pattern(1 * MiB, 8);        // 256 KiB chunks: the ring's slots
  const auto second = pattern(1 * MiB, 9);       // 256 KiB chunks too: past the patience, handed over
  const auto third = pattern(12 * MiB + 3, 10);  // 1 MiB chunks, queued behind the background thread
  device_memory dev_first(first.size());
  device_memory dev_second(second.size());
  device_memory dev_third(third.size());
  gpukit::stream s(d);
  gpukit_test::gate g;
  watchdog dog(g, 10s);
  g.hold(s);
  engine.to_device(dev_first.p, first.data(), first.size(), s);
  engine.to_device(dev_second.p, second.data(), second.size(), s);
  engine.to_device(dev_third.p, third.data(), third.size(), s);
  CHECK(engine.stats().overflows == 2);
  g.open();
  s.synchronize();
  dog.finish();
  CHECK_FALSE(dog.opened_gate());
  CHECK(engine.stats().background_failures == 0);
  CHECK(pool.stats().allocated_bytes_peak <= 4 * 256 * 1024);  // the background thread never grew a slot
  for (const auto* t : {&first, &second, &third}) {
    const void* src = t == &first ? dev_first.p : t == &second ? dev_second.p : dev_third.p;
    std::vector<unsigned char> back(t->size(), 0);
    engine.to_host(back.data(), src, back.size(), s);
    CHECK(back == *t);
  }
}

TEST_CASE("sim staging: to_device of a temporary pinned vector waits for the copy before the storage goes back") {
  // The DMA reads page-locked storage after to_device returns, and the temporary's block goes back to the pinned pool
  // at the end of the caller's expression, where the next pinned allocation gets it: the copy must be done first.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pmr_resource pinned(d);
  const auto values = pattern(4096, 5);
  gpukit::stream s(d);
  gpukit_test::gate g;
  g.hold(s);  // the copy waits behind the gate
  std::optional<gpukit::device_buffer<unsigned char>> copied;
  std::atomic<bool> returned{false};
  const std::size_t waits = cudasim::calls("cudaStreamSynchronize");
  std::thread caller([&] {
    copied.emplace(gpukit::to_device(std::pmr::vector<unsigned char>(values.begin(), values.end(), &pinned), s));
    returned = true;
  });
  while (!returned && cudasim::calls("cudaStreamSynchronize") == waits) std::this_thread::yield();
  CHECK_FALSE(returned);  // to_device waits for the copy (the gate holds it)
  {
    std::pmr::vector<unsigned char> next(values.size(), 0, &pinned);  // the temporary's block, were it freed already
    g.open();
    caller.join();
  }
  REQUIRE(copied.has_value());
  CHECK(gpukit::to_host(*copied, s) == values);

  // A lvalue stays the caller's to keep alive: no wait.
  std::pmr::vector<unsigned char> kept(values.begin(), values.end(), &pinned);
  const std::size_t before = cudasim::calls("cudaStreamSynchronize");
  auto from_lvalue = gpukit::to_device(kept, s);
  CHECK(cudasim::calls("cudaStreamSynchronize") == before);
  CHECK(gpukit::to_host(from_lvalue, s) == values);
}

TEST_CASE("sim staging: a slot that cannot grow while the stream is held fails at once instead of emptying the cache") {
  // Out of host memory, a pinned pool empties its cache and retries: cudaFreeHost waits for all the device's work,
  // the held stream's too, whose gate opens only after to_device returns. Inside a transfer the pool throws instead.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.patience = 10ms;
  gpukit::staging_engine engine(pool, options);
  const auto small = pattern(1 * MiB, 10);       // 256 KiB slots
  const auto large = pattern(12 * MiB + 5, 11);  // 1 MiB chunks: the first idle slot grows
  device_memory for_small(small.size());
  device_memory for_large(large.size());
  gpukit::stream s(d);
  engine.to_device(for_small.p, small.data(), small.size(), s);
  s.synchronize();                          // every slot idle
  pool.deallocate(pool.allocate(4 * MiB));  // a cached block, which emptying the cache would free
  gpukit_test::gate g;
  watchdog dog(g, 10s);  // a regression fails instead of hanging
  g.hold(s);
  const std::size_t frees = cudasim::calls("cudaFreeHost");
  cudasim::fail_call("cudaHostAlloc", 1, cudaErrorMemoryAllocation);
  try {
    engine.to_device(for_large.p, large.data(), large.size(), s);
    FAIL("no exception");
  } catch (const gpukit::out_of_memory_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("was not emptied: this call is part of a staging transfer") != std::string::npos);
    CHECK(what.find("upstream: ") != std::string::npos);
  }
  CHECK(cudasim::calls("cudaFreeHost") == frees);
  CHECK(pool.stats().oom_retries == 0);
  g.open();
  s.synchronize();
  dog.finish();
  CHECK_FALSE(dog.opened_gate());  // to_device returned while the stream was held
  // Usable afterwards; outside a transfer the pool empties its cache and retries as before.
  engine.to_device(for_large.p, large.data(), large.size(), s);
  std::vector<unsigned char> back(large.size(), 0);
  engine.to_host(back.data(), for_large.p, back.size(), s);
  CHECK(back == large);
  cudasim::fail_call("cudaHostAlloc", 1, cudaErrorMemoryAllocation);
  void* p = pool.allocate(8 * MiB);
  CHECK(p != nullptr);
  CHECK(pool.stats().oom_retries == 1);
  pool.deallocate(p);
  CHECK(cudasim::violations().empty());
}

namespace {
thread_local bool fail_after_pinning = false;  // set just before cudaHostAlloc, on the calling thread
bool fails_after_pinning() {  // the first allocation after cudaHostAlloc (the old code's map entry) fails
  if (!fail_after_pinning || cudasim::inside_call()) return false;
  fail_after_pinning = false;
  return true;
}
}  // namespace

TEST_CASE("sim pinned pool: inside a transfer a block is never unpinned for want of host memory after cudaHostAlloc") {
  // The staging engine defers the pool's releases while it copies: cudaFreeHost waits for all the device's work,
  // which may wait for this thread. allocate's bookkeeping must come before pinning, so nothing fails after it.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::stream s(d);
  gpukit_test::gate g;
  g.hold(s);  // work that waits for this thread
  const std::size_t frees = cudasim::calls("cudaFreeHost");
  void* p = nullptr;
  bool threw = false;
  const bool opened = g.opened_to_return(
      [&] {
        const gpukit::detail::defer_pinned_cap inside_transfer;  // what to_device and to_host set
        cudasim::before_call("cudaHostAlloc", 1, [] { fail_after_pinning = true; });
        gpukit_test::heap_fails.store(&fails_after_pinning);
        try {
          p = pool.allocate(MiB);
        } catch (const std::bad_alloc&) {
          threw = true;
        }
        const bool armed = fail_after_pinning;  // still armed: nothing allocated after pinning
        fail_after_pinning = false;
        gpukit_test::heap_fails.store(nullptr);
        CHECK(armed);
      },
      3s);
  CHECK_FALSE(opened);  // it did not wait for the held stream
  CHECK_FALSE(threw);
  CHECK(cudasim::calls("cudaFreeHost") == frees);
  const gpukit::pinned_pool_stats st = pool.stats();
  CHECK(st.upstream_allocations == 1);
  CHECK(st.upstream_frees == 0);
  CHECK(st.reserved_bytes == MiB);
  CHECK(st.allocated_bytes == MiB);
  const gpukit::host_allocator_stats h = pool.memory_stats();
  CHECK(h.host_alloc_time.count == 1);
  CHECK(h.num_host_alloc == 1);
  g.open();
  s.synchronize();
  if (p != nullptr) pool.deallocate(p);
}

TEST_CASE("sim pinned pool: default_pinned_pool refuses an invisible ordinal before the process-wide pool exists") {
  // Created with the first ordinal asked for (its context when none exists yet): a bad one would break every later
  // request, valid ones too.
  REQUIRE(gpukit::device_count() == 2);
  std::string what = "no error";
  try {
    gpukit::pooled_pinned_buffer<float> bad(16, gpukit::device::cuda(5));
  } catch (const gpukit::invalid_argument_error& e) {
    what = e.what();
  } catch (const std::exception& e) {
    what = std::string("other exception: ") + e.what();
  }
  INFO(what);
  CHECK(what.find("gpukit::default_pinned_pool: cuda:5 is not visible (2 CUDA devices)") != std::string::npos);
  std::string later = "no error";
  try {
    gpukit::pooled_pinned_buffer<float> good(16, gpukit::device::cuda(0));
    CHECK(good.page_locked());
  } catch (const std::exception& e) {
    later = e.what();
  }
  CHECK(later == "no error");
}

TEST_CASE("sim pinned pool: default_pinned_pool refuses an invisible ordinal after the process-wide pool exists too") {
  // Checked only when the pool was made: later, a pooled buffer for cuda:5 was handed out, and host_memory_stats of
  // cuda:7 gave the pool's figures (helper-175).
  REQUIRE(gpukit::device_count() == 2);
  gpukit::pooled_pinned_buffer<float> good(16, gpukit::device::cuda(0));  // the pool exists now
  CHECK_THROWS_WITH_AS(gpukit::pooled_pinned_buffer<float>(16, gpukit::device::cuda(5)),
                       doctest::Contains("gpukit::default_pinned_pool: cuda:5 is not visible (2 CUDA devices)"),
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS((void)gpukit::host_memory_stats(gpukit::device::cuda(7)),
                       doctest::Contains("cuda:7 is not visible"), gpukit::invalid_argument_error);
  CHECK(&gpukit::default_pinned_pool(gpukit::device::cuda(1)) == &gpukit::default_pinned_pool(gpukit::device::cuda(0)));
}

TEST_CASE("sim pinned memory: registering a range twice names the flags and says the range is already page-locked") {
  std::vector<unsigned char> pageable(8192);
  gpukit::host_registration first(pageable.data(), pageable.size(), gpukit::device::cuda(0));
  std::string what;
  try {
    gpukit::host_registration again(pageable.data(), 4096, gpukit::device::cuda(0));
  } catch (const gpukit::cuda_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(what.find("cudaHostRegister(4096 bytes, cudaHostRegisterPortable; ") != std::string::npos);
  CHECK(what.find("already page-locked by another registration or pinned allocation") != std::string::npos);
}

TEST_CASE("sim staging: another thread's per-thread default stream is refused before anything is enqueued") {
  // cudaStreamPerThread names the calling thread's own stream: a copy enqueued with another thread's view would run
  // on this thread's stream, unordered with the work it was meant to follow.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, small_options());
  const auto data = pattern(64 * 1024, 12);
  device_memory dst(data.size());
  device_memory src(data.size());
  gpukit::stream_view theirs;
  std::thread([&] { theirs = gpukit::stream_view(d, cudaStreamPerThread).resolved(); }).join();
  REQUIRE(theirs.is_other_threads_stream());
  const std::size_t copies = cudasim::calls("cudaMemcpyAsync") + cudasim::calls("cudaMemcpyAsync_ptsz");
  const std::size_t peer_copies = cudasim::calls("cudaMemcpyPeerAsync") + cudasim::calls("cudaMemcpyPeerAsync_ptsz");
  std::vector<unsigned char> back(data.size(), 0);
  const auto refused = doctest::Contains("per-thread default stream of another thread");
  CHECK_THROWS_WITH_AS(engine.to_device(dst.p, data.data(), data.size(), theirs), refused,
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(engine.to_host(back.data(), dst.p, back.size(), theirs), refused,
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(gpukit::copy_peer_async(dst.p, d, src.p, d, data.size(), theirs), refused,
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(
      gpukit::device_copier{}(dst.p, data.data(), data.size(), gpukit::copy_direction::host_to_device, theirs), refused,
      gpukit::invalid_argument_error);
  CHECK(cudasim::calls("cudaMemcpyAsync") + cudasim::calls("cudaMemcpyAsync_ptsz") == copies);
  CHECK(cudasim::calls("cudaMemcpyPeerAsync") + cudasim::calls("cudaMemcpyPeerAsync_ptsz") == peer_copies);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "sim staging: release_idle gives blocks back outside the engine's lock, so transfers on other streams go on") {
  // Over the pool's cap the blocks of a retired ring go to cudaFreeHost, which waits for all the device's work, here
  // a stream held until after a transfer on another stream: that transfer must not wait for the engine's lock.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  pool.set_max_cached_bytes(0);
  gpukit::staging_options o;
  o.chunk_bytes = 1 * MiB;
  o.min_chunk_bytes = 256 * 1024;
  o.patience = 10ms;
  gpukit::staging_engine engine(pool, o);
  const auto host = pattern(1 * MiB, 7);
  device_memory dm(host.size());
  gpukit::stream held(d);
  gpukit::stream idle(d);
  gpukit::stream other(d);
  gpukit_test::gate g;
  engine.to_device(dm.p, host.data(), host.size(), idle);
  idle.synchronize();  // its ring is idle: release_idle retires it
  g.hold(held);
  std::atomic<bool> freeing{false};
  std::atomic<bool> released{false};
  cudasim::before_call("cudaFreeHost", 1, [&] { freeing = true; });
  std::size_t rings_released = 0;
  std::thread releaser([&] {
    rings_released = engine.release_idle();  // cudaFreeHost waits for `held`
    released = true;
  });
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!freeing && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  REQUIRE(freeing.load());
  const bool opened = g.opened_to_return(
      [&] {
        engine.to_device(dm.p, host.data(), host.size(), other);
        other.synchronize();
      },
      std::chrono::seconds(3));
  CHECK_FALSE(opened);  // else the transfer waited for release_idle's cudaFreeHost, behind `held`
  CHECK_FALSE(released.load());
  g.open();
  releaser.join();
  CHECK(rings_released == 1);
  held.synchronize();
  CHECK(cudasim::violations().empty());
}

namespace {
/// Runs `call` on another thread while `g` holds its stream, then `meanwhile` here, then opens the gate. True when
/// the call returned before the gate opened, i.e. did not wait for the held copy (a wait: cudaStreamSynchronize, or
/// cudaEventSynchronize for the legacy default stream).
template <class Call, class Meanwhile>
bool returned_while_held(gpukit_test::gate& g, Call call, Meanwhile meanwhile) {
  std::atomic<bool> returned{false};
  const auto waits = [] { return cudasim::calls("cudaStreamSynchronize") + cudasim::calls("cudaEventSynchronize"); };
  const std::size_t before = waits();
  std::thread caller([&] {
    call();
    returned = true;
  });
  while (!returned && waits() == before) std::this_thread::yield();
  const bool early = returned;
  meanwhile();
  g.open();
  caller.join();
  return early;
}
}  // namespace

TEST_CASE("sim staging: copy_async of a temporary page-locked vector waits for the copy before the storage goes back") {
  // As to_device: one DMA reads (or writes) the temporary's storage when the stream gets to it, and the storage goes
  // back to the pinned pool at the end of the caller's expression, where the next pinned allocation gets it.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pmr_resource pinned(d);
  const auto values = pattern(4096, 5);
  gpukit::stream s(d);
  gpukit::device_buffer<unsigned char> dst(values.size(), s);
  {
    gpukit_test::gate g;
    g.hold(s);
    const bool early = returned_while_held(
        g, [&] { gpukit::copy_async(dst, std::pmr::vector<unsigned char>(values.begin(), values.end(), &pinned), s); },
        [&] { std::pmr::vector<unsigned char> next(values.size(), 0xEE, &pinned); });  // the block, were it freed
    CHECK_FALSE(early);
    CHECK(gpukit::to_host(dst, s) == values);
  }
  {  // a temporary destination: the DMA must not write into the next allocation
    gpukit_test::gate g;
    g.hold(s);
    std::optional<std::pmr::vector<unsigned char>> next;
    const bool early = returned_while_held(
        g, [&] { gpukit::copy_async(std::pmr::vector<unsigned char>(values.size(), 0, &pinned), dst, s); },
        [&] { next.emplace(values.size(), 0xEE, &pinned); });
    CHECK_FALSE(early);
    s.synchronize();
    CHECK(std::count(next->begin(), next->end(), 0xEE) == static_cast<std::ptrdiff_t>(values.size()));
  }
  {  // on the current stream (copy_async without one), as a temporary std::vector with a pinned allocator would
    gpukit::device_buffer<unsigned char> on_default(values.size(), d);
    const gpukit::stream_view legacy = gpukit::current_stream(d);
    gpukit_test::gate g;
    g.hold(legacy);
    const bool early = returned_while_held(
        g,
        [&] { gpukit::copy_async(on_default, std::pmr::vector<unsigned char>(values.begin(), values.end(), &pinned)); },
        [&] { std::pmr::vector<unsigned char> next(values.size(), 0xEE, &pinned); });
    CHECK_FALSE(early);
    CHECK(gpukit::to_host(on_default, legacy) == values);
  }
  // An lvalue stays the caller's to keep alive, and pageable storage is read before copy_async returns: no wait.
  std::pmr::vector<unsigned char> kept(values.begin(), values.end(), &pinned);
  const std::size_t before = cudasim::calls("cudaStreamSynchronize");
  gpukit::copy_async(dst, kept, s);
  gpukit::copy_async(dst, std::vector<unsigned char>(values), s);
  CHECK(cudasim::calls("cudaStreamSynchronize") == before);
  CHECK(gpukit::to_host(dst, s) == values);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim staging: copy_async of a temporary pooled pinned buffer on a raw stream handle waits for the copy") {
  // The block is kept from the pool for the copy only on streams it can record (gpukit's and the default streams):
  // on a raw handle, which may be destroyed and reused first, the copy is waited for instead.
  const auto d = gpukit::device::cuda(0);
  const auto values = pattern(4096, 9);
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
  const gpukit::stream_view s(d, raw);
  gpukit::device_buffer<unsigned char> dst(values.size(), d);
  auto make = [&] {
    gpukit::pooled_pinned_buffer<unsigned char> b(values.size(), gpukit::default_pinned_pool(d));
    std::memcpy(b.data(), values.data(), values.size());
    return b;
  };
  auto next = [&] {
    gpukit::pooled_pinned_buffer<unsigned char> b(values.size(), gpukit::default_pinned_pool(d));
    std::memset(b.data(), 0xEE, values.size());  // the block, were it back in the pool
  };
  {
    gpukit_test::gate g;
    g.hold(s);
    CHECK_FALSE(returned_while_held(
        g, [&] { gpukit::copy_async(dst, make(), s); }, next));
    CHECK(gpukit::to_host(dst, s) == values);
  }
  {  // with an engine of one's own
    gpukit::staging_engine engine(gpukit::default_pinned_pool(d));
    gpukit_test::gate g;
    g.hold(s);
    CHECK_FALSE(returned_while_held(
        g, [&] { gpukit::copy_async(dst, make(), s, engine); }, next));
    CHECK(gpukit::to_host(dst, s) == values);
  }
  // On a gpukit stream the block is kept for the copy instead: no wait.
  gpukit::stream own(d);
  gpukit_test::gate g;
  g.hold(own);
  const std::size_t before = cudasim::calls("cudaStreamSynchronize");
  gpukit::copy_async(dst, make(), own);
  next();
  CHECK(cudasim::calls("cudaStreamSynchronize") == before);
  g.open();
  CHECK(gpukit::to_host(dst, own) == values);
  CHECK(cudaStreamDestroy(raw) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim staging: a temporary page-locked source on a captured stream is refused before anything is enqueued") {
  // The graph's copy would read the storage at each launch, long after the temporary went; waiting is no option in
  // a capture.
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pmr_resource pinned(d);
  const auto values = pattern(4096, 3);
  gpukit::stream s(d);
  gpukit::device_buffer<unsigned char> dst(values.size(), s);
  gpukit::pinned_buffer<unsigned char> kept(values.size(), d);
  s.synchronize();
  const std::size_t copies = cudasim::calls("cudaMemcpyAsync");
  REQUIRE(cudaStreamBeginCapture(s.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  std::string what;
  try {
    gpukit::copy_async(dst, std::pmr::vector<unsigned char>(values.begin(), values.end(), &pinned), s);
  } catch (const gpukit::invalid_argument_error& e) {
    what = e.what();
  }
  const std::size_t refused_copies = cudasim::calls("cudaMemcpyAsync");
  gpukit::copy_async(dst, kept, s);  // memory the caller keeps: a copy node, as before
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(s.cuda_handle(), &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  INFO(what);
  CHECK(what.find("gpukit::copy_async") != std::string::npos);
  CHECK(what.find("temporary") != std::string::npos);
  CHECK(refused_copies == copies);
  CHECK(cudasim::calls("cudaMemcpyAsync") == copies + 1);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim staging: host memory that is page-locked only at its start is staged, not read by a later DMA") {
  // CUDA classifies a pointer, not a range: a span starting inside a host registration and running past its end is
  // pinned at its first byte and pageable at its last. One DMA would read the pageable tail when the stream gets to it.
  const auto d = gpukit::device::cuda(0);
  const auto values = pattern(8192, 4);
  std::vector<unsigned char> host(values);
  gpukit::host_registration registered(host.data(), 4096, d);  // the first half
  REQUIRE(gpukit::detail::query_pointer(host.data() + 2048).kind == gpukit::detail::pointer_kind::pinned);
  REQUIRE(gpukit::detail::query_pointer(host.data() + 6143).kind == gpukit::detail::pointer_kind::pageable);
  gpukit::stream s(d);
  gpukit::device_buffer<unsigned char> dst(4096, s);
  gpukit::staging_engine& engine = gpukit::default_staging_engine(d);
  const auto staged_before = engine.stats().to_device_calls;
  {
    gpukit_test::gate g;
    g.hold(s);
    gpukit::copy_async(dst, gpukit::host_span<const unsigned char>(host.data() + 2048, 4096), s);
    std::fill(host.begin() + 4096, host.end(), 0xEE);  // pageable: reusable once copy_async returned
    g.open();
  }
  const std::vector<unsigned char> expected(values.begin() + 2048, values.begin() + 6144);
  CHECK(gpukit::to_host(dst, s) == expected);
  CHECK(engine.stats().to_device_calls == staged_before + 1);
  // A pinned_span is a promise CUDA can check here: its pageable tail makes it staged too.
  std::copy(values.begin(), values.end(), host.begin());
  gpukit::copy_async(dst, gpukit::pinned_span<const unsigned char>(host.data() + 2048, 4096), s);
  CHECK(engine.stats().to_device_calls == staged_before + 2);
  // Into such memory: staged, so the data is there when copy_async returns.
  const auto fetched_before = engine.stats().to_host_calls;
  std::fill(host.begin(), host.end(), 0);
  gpukit::copy_async(gpukit::host_span<unsigned char>(host.data() + 2048, 4096), dst, s);
  CHECK(engine.stats().to_host_calls == fetched_before + 1);
  CHECK(std::equal(expected.begin(), expected.end(), host.begin() + 2048));
  // Wholly inside the registration: one DMA, as before.
  gpukit::copy_async(dst, gpukit::host_span<const unsigned char>(host.data(), 4096), s);
  CHECK(engine.stats().to_device_calls == staged_before + 2);
  s.synchronize();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim staging: errors of to_device and to_host name the call made") {
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::device_buffer<float> x(1000, s);
  const auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const gpukit::invalid_argument_error& e) {
      return e.what();
    }
    return "(no invalid_argument_error)";
  };
  const std::string to_device = message([&] { (void)gpukit::to_device(gpukit::host_span<float>(x.data(), 1000), s); });
  CHECK(to_device.rfind("gpukit::to_device: ", 0) == 0);
  CHECK(to_device.find("where host memory is expected") != std::string::npos);
  std::vector<float> host(1000);
  const std::string to_host =
      message([&] { (void)gpukit::to_host(gpukit::device_span<float>(host.data(), 1000, d), s); });
  CHECK(to_host.rfind("gpukit::to_host: ", 0) == 0);
  CHECK(to_host.find("where device memory is expected") != std::string::npos);
  gpukit::device_buffer<float> y(1000, s);
  const std::string copy = message([&] { gpukit::copy_async(gpukit::host_span<float>(x.data(), 1000), y, s); });
  CHECK(copy.rfind("gpukit::copy_async: ", 0) == 0);
  CHECK(copy.find("where host memory is expected") != std::string::npos);
  s.synchronize();
}

TEST_CASE("sim staging: a CUDA failure partway through a staged copy names the call, the chunk and what may land") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_options o;
  o.chunk_bytes = MiB;
  o.min_chunk_bytes = MiB / 4;
  o.slots = 4;
  o.download_slots = 2;
  gpukit::staging_engine engine(pool, o);
  gpukit::stream s(gpukit::device::cuda(0));
  REQUIRE(engine.chunk_for(6 * MiB) == MiB);
  device_memory d(6 * MiB);
  const auto source = pattern(6 * MiB, 1);
  // The third chunk's DMA fails (cudaErrorInvalidValue: invalid_argument_error, as the bare failure is).
  cudasim::fail_call("cudaMemcpyAsync", 3, cudaErrorInvalidValue);
  std::string up;
  try {
    engine.to_device(d.p, source.data(), source.size(), s);
    FAIL("to_device did not throw");
  } catch (const gpukit::invalid_argument_error& e) {
    up = e.what();
    CHECK(e.cuda_result() == cudaErrorInvalidValue);
    CHECK(e.device() == 0);
    CHECK(e.call().find("cudaMemcpyAsync") != std::string_view::npos);
  }
  INFO(up);
  CHECK(up.rfind("gpukit::staging_engine::to_device: the chunk of 1.00 MiB (1048576 bytes) at byte offset 2097152 of a "
                 "6.00 MiB (6291456 bytes) transfer to cuda:0 failed: cudaMemcpyAsync(1048576 bytes) failed on cuda:0",
                 0) == 0);
  CHECK(up.find("; its first 2097152 bytes were enqueued before and may still be written to the destination") !=
        std::string::npos);
  cudasim::clear_faults();
  s.synchronize();
  // Device to host: chunks 0 and 1 copied out, then the DMA of chunk 3 fails (cudaErrorUnknown: cuda_error).
  engine.to_device(d.p, source.data(), source.size(), s);
  std::vector<unsigned char> back(source.size(), 0);
  cudasim::fail_call("cudaMemcpyAsync", 4, cudaErrorUnknown);
  std::string down;
  try {
    engine.to_host(back.data(), d.p, back.size(), s);
    FAIL("to_host did not throw");
  } catch (const gpukit::cuda_error& e) {
    down = e.what();
    CHECK(e.cuda_result() == cudaErrorUnknown);
    CHECK(e.code() == gpukit::errc::cuda);
  }
  INFO(down);
  CHECK(down.rfind("gpukit::staging_engine::to_host: the chunk of 1.00 MiB (1048576 bytes) at byte offset 3145728 of a "
                   "6.00 MiB (6291456 bytes) transfer from cuda:0 failed: cudaMemcpyAsync(1048576 bytes) failed",
                   0) == 0);
  CHECK(down.find("; the first 2097152 bytes of the destination were written; nothing more will be") !=
        std::string::npos);
  CHECK(std::equal(back.begin(), back.begin() + 2 * MiB, source.begin()));
  cudasim::clear_faults();
  (void)cudasim::take_violations();
  // The rings work afterwards.
  std::fill(back.begin(), back.end(), 0);
  engine.to_host(back.data(), d.p, back.size(), s);
  CHECK(back == source);
  s.synchronize();
}

namespace {
bool simulated_call() { return cudasim::inside_call(); }  // the real runtime does not allocate with operator new
}  // namespace

TEST_CASE("sim staging: host memory running out partway through a staged copy names the chunk and what may land") {
  // A std::bad_alloc stays a std::bad_alloc (what callers catch), but says which chunk of which transfer failed and
  // what of it may still land, as a CUDA failure does.
  gpukit::staging_options o;
  o.chunk_bytes = MiB;
  o.min_chunk_bytes = MiB / 4;
  o.slots = 4;
  o.download_slots = 2;
  o.threads = 1;  // one copy thread: every allocation of a transfer is the caller's
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  device_memory dev(6 * MiB);
  const auto source = pattern(6 * MiB, 3);
  std::vector<unsigned char> back(source.size());
  const auto each_failure = [&](bool upload) {
    std::vector<std::string> messages;
    for (long n = 1;; ++n) {
      gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
      gpukit::staging_engine engine(pool, o);
      if (!upload) engine.to_device(dev.p, source.data(), source.size(), s);
      gpukit_test::heap_run run(n, simulated_call);
      run.armed([&] {
        try {
          if (upload) {
            engine.to_device(dev.p, source.data(), source.size(), s);
          } else {
            engine.to_host(back.data(), dev.p, back.size(), s);
          }
        } catch (const std::bad_alloc& e) {
          messages.emplace_back(e.what());  // past the failure: the heap works again
          throw;
        }
      });
      CHECK(run.unexpected() == "");
      s.synchronize();
      if (run.seen() < n) break;
    }
    return messages;
  };
  const std::string up_head = "gpukit::staging_engine::to_device: the chunk of ";
  // What failed: a chunk, the rest handed to the background thread, or the stream's slots before anything was enqueued.
  const auto starts_as_staging_failure = [](const std::string& m, const char* operation) {
    const std::string head = std::string("gpukit::staging_engine::") + operation + ": ";
    return m.rfind(head + "the chunk of ", 0) == 0 || m.rfind(head + "the rest, ", 0) == 0 ||
           m.rfind(head + "setting up the stream's staging slots for a 6.00 MiB ", 0) == 0;
  };
  const std::vector<std::string> up = each_failure(true);
  REQUIRE_FALSE(up.empty());
  bool later_chunk = false;
  for (const std::string& m : up) {
    INFO(m);
    CHECK(starts_as_staging_failure(m, "to_device"));
    CHECK(m.find(" a 6.00 MiB (6291456 bytes) transfer to cuda:0 failed: out of host memory (std::bad_alloc); ") !=
          std::string::npos);
    later_chunk = later_chunk || (m.rfind(up_head, 0) == 0 && m.find("at byte offset 0 ") == std::string::npos);
  }
  // The stream's first transfer makes its slots: a failure there is said as such, nothing enqueued.
  CHECK(std::any_of(up.begin(), up.end(), [](const std::string& m) {
    return m.find("setting up the stream's staging slots for a 6.00 MiB (6291456 bytes) transfer to cuda:0 failed") !=
               std::string::npos &&
           m.find("; nothing of this transfer was enqueued") != std::string::npos;
  }));
  // A chunk past the first: the chunks before it were enqueued and may still land.
  CHECK(later_chunk);
  CHECK(std::any_of(up.begin(), up.end(), [&](const std::string& m) {
    return m.rfind(up_head + "1.00 MiB (1048576 bytes) at byte offset 2097152 of a ", 0) == 0 &&
           m.find(
               "; its first 2097152 bytes were enqueued before and may still be written to the destination, in "
               "stream order") != std::string::npos;
  }));
  const std::vector<std::string> down = each_failure(false);
  REQUIRE_FALSE(down.empty());
  for (const std::string& m : down) {
    INFO(m);
    CHECK(starts_as_staging_failure(m, "to_host"));
    CHECK(m.find(" transfer from cuda:0 failed: out of host memory (std::bad_alloc); the first ") != std::string::npos);
    CHECK(m.find(" bytes of the destination were written; nothing more will be") != std::string::npos);
  }
  MESSAGE("staged copies out of host memory: " << up.size() << " to_device and " << down.size()
                                               << " to_host calls threw std::bad_alloc");
  CHECK(cudasim::violations().empty());
}

namespace {
gpukit::stream blocking_stream(gpukit::device d) {
  gpukit::stream_options options;
  options.non_blocking = false;
  return gpukit::stream(d, options);
}
}  // namespace

TEST_CASE(
    "sim staging: copies on the legacy default stream are refused while another thread captures a blocking stream") {
  // CUDA never captures the legacy stream (capture_status says none), but work on it joins a capture of any blocking
  // stream of its device and invalidates it (906, then 901 at the end). A copy there must be refused instead, under the
  // guard event::record and stream_view::synchronize take on that stream.
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(d);
  gpukit::stream blocking = blocking_stream(d);
  device_memory memory(MiB);
  gpukit::device_span<unsigned char> dst(static_cast<unsigned char*>(memory.p), MiB, d);
  const std::vector<unsigned char> pageable(MiB, 7);
  gpukit::pinned_buffer<unsigned char> pinned(MiB, d);
  const auto copy_during_capture = [&](auto&& source) {
    const gpukit_test::call_in_capture seen =
        gpukit_test::call_during_capture(blocking, [&] { gpukit::copy_async(dst, source, legacy); });
    CHECK(seen.returned);
    INFO("refusal: " << seen.refusal);
    CHECK(seen.capture_error.empty());  // the capture was not invalidated
    CHECK(seen.refusal.find("a gpukit capture of a blocking stream of cuda:0 is underway") != std::string::npos);
    CHECK(seen.refusal.find("cudaMemcpyAsync on the legacy default stream") != std::string::npos);
    CHECK(cudasim::take_violations().empty());
  };
  SUBCASE("staged (pageable source)") { copy_during_capture(pageable); }
  SUBCASE("one DMA (pinned source)") { copy_during_capture(pinned); }
  // After the capture the legacy stream copies again.
  gpukit::copy_async(dst, pageable, legacy);
  legacy.synchronize();
  std::vector<unsigned char> back(MiB, 0);
  REQUIRE(cudaMemcpy(back.data(), memory.p, MiB, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(back == pageable);
}

// A named namespace: the hidden friend get_property of a class in an unnamed one has internal linkage, and clang
// reports it unused (-Wunused-function), though CCCL's property query finds it.
namespace staging_test_resources {
/// A stream-ordered cuda::mr resource (both of CCCL's shapes) over cudaMallocAsync whose stream-ordered free refuses
/// (throws), keeping the pointer for the test to free.
struct refusing_free_resource {
  std::shared_ptr<std::vector<void*>> refused = std::make_shared<std::vector<void*>>();
  void* allocate_on(cudaStream_t s, std::size_t bytes) {
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, s) != cudaSuccess) throw std::bad_alloc();
    return p;
  }
  void refuse(void* p) {
    refused->push_back(p);
    throw std::runtime_error("refusing_free_resource: free refused");
  }
  void* allocate_sync(std::size_t bytes, std::size_t) { return allocate_on(nullptr, bytes); }
  void deallocate_sync(void* p, std::size_t, std::size_t) noexcept { (void)cudaFree(p); }
#if CCCL_VERSION >= 3001000
  void* allocate(::cuda::stream_ref s, std::size_t bytes, std::size_t) { return allocate_on(s.get(), bytes); }
  void deallocate(::cuda::stream_ref, void* p, std::size_t, std::size_t) { refuse(p); }
#else
  void* allocate(std::size_t bytes, std::size_t alignment) { return allocate_sync(bytes, alignment); }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept { deallocate_sync(p, bytes, alignment); }
  void* allocate_async(std::size_t bytes, std::size_t, ::cuda::stream_ref s) { return allocate_on(s.get(), bytes); }
  void deallocate_async(void* p, std::size_t, std::size_t, ::cuda::stream_ref) { refuse(p); }
#endif
  bool operator==(const refusing_free_resource& other) const noexcept { return refused == other.refused; }
  bool operator!=(const refusing_free_resource& other) const noexcept { return refused != other.refused; }
  friend void get_property(const refusing_free_resource&, ::cuda::mr::device_accessible) noexcept {}
};
}  // namespace staging_test_resources
using staging_test_resources::refusing_free_resource;
static_assert(gpukit::resource_upstream<refusing_free_resource>::stream_ordered, "stream-ordered");

TEST_CASE("resource_upstream: a failed wait for an allocation is thrown even when giving the segment back fails too") {
  // The wait for a stream-ordered allocation fails; the segment's free in the handler throws as well. That second
  // exception must not replace the first (the caller would see the resource's complaint, not CUDA's failure).
  const gpukit::device d = gpukit::device::cuda(0);
  refusing_free_resource resource;
  gpukit::resource_upstream<refusing_free_resource> upstream(resource, d);
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cudaStreamSynchronize", 1, cudaErrorUnknown);
  std::string thrown;
  bool gpukit_error = false;
  cudaError_t result = cudaSuccess;
  try {
    (void)upstream.allocate(MiB);
    FAIL("allocate did not throw");
  } catch (const gpukit::error& e) {
    gpukit_error = true;
    result = e.cuda_result();
    thrown = e.what();
  } catch (const std::exception& e) {
    thrown = e.what();
  }
  cudasim::clear_faults();
  INFO(thrown);
  CHECK(gpukit_error);
  CHECK(result == cudaErrorUnknown);
  CHECK(thrown.find("cudaStreamSynchronize (upstream allocations)") != std::string::npos);
  CHECK(warnings.contains("could not be given back to its resource either (refusing_free_resource: free refused)"));
  REQUIRE(resource.refused->size() == 1);
  REQUIRE(cudaFree(resource.refused->front()) == cudaSuccess);  // the test's: the resource kept it
  (void)cudasim::take_violations();
}

// A staged copy that fails part-way (reviewer 178): what it enqueued still runs, so what it uses stays alive; what
// it did is counted; the message names what failed.
namespace {
/// A user's device buffer (data, size, device, stream: gpukit's duck type) freed in its own stream's order, as
/// device_buffer is: cudaMallocAsync / cudaFreeAsync on stream `s`.
struct own_stream_device_buffer {
  own_stream_device_buffer(std::size_t n, gpukit::stream_view s) : bytes(n), owner(s) {
    REQUIRE(cudaMallocAsync(reinterpret_cast<void**>(&p), n, s.native_handle()) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s.native_handle()) == cudaSuccess);
  }
  own_stream_device_buffer(own_stream_device_buffer&& o) noexcept : p(o.p), bytes(o.bytes), owner(o.owner) {
    o.p = nullptr;
  }
  own_stream_device_buffer(const own_stream_device_buffer&) = delete;
  own_stream_device_buffer& operator=(const own_stream_device_buffer&) = delete;
  own_stream_device_buffer& operator=(own_stream_device_buffer&&) = delete;
  ~own_stream_device_buffer() {
    if (p != nullptr) (void)cudaFreeAsync(p, owner.native_handle());  // in the order of its own stream
  }
  unsigned char* data() const { return p; }
  std::size_t size() const { return bytes; }
  gpukit::device device() const { return gpukit::device::cuda(0); }
  gpukit::stream_view stream() const { return owner; }

  unsigned char* p = nullptr;
  std::size_t bytes;
  gpukit::stream_view owner;
};

gpukit::staging_options four_chunks() {
  gpukit::staging_options o;
  o.chunk_bytes = MiB;
  o.min_chunk_bytes = MiB / 4;
  o.slots = 4;
  o.download_slots = 2;
  return o;
}

std::size_t illegal_address_violations() {
  std::size_t n = 0;
  for (const auto& v : cudasim::take_violations()) {
    MESSAGE("violation: " << v.call << " -> " << static_cast<int>(v.error) << ": " << v.message);
    if (v.error == cudaErrorIllegalAddress) ++n;
  }
  return n;
}
}  // namespace

// When a staged copy throws part-way, the chunks already enqueued on `s` still read or write a temporary device
// buffer of another stream, which is freed in that stream's order at the end of the caller's expression: it is kept
// for them (record_stream, or a wait).
TEST_CASE("sim staging: a staged copy_async that fails part-way keeps a temporary device destination for its chunks") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, four_chunks());
  gpukit::stream s(gpukit::device::cuda(0));
  gpukit::stream owner(gpukit::device::cuda(0));  // the buffer's own stream, not the copy's
  const auto source = pattern(4 * MiB, 1);
  REQUIRE(engine.chunk_for(source.size()) == MiB);
  gpukit_test::gate g;
  g.hold(s);  // the copy's chunks wait behind the gate
  // Once the third DMA fails, a wait for `s` (a buffer without record_stream is kept by waiting for the copy's chunks)
  // opens the gate; without that wait the gate opens only after the buffer's free.
  cudasim::before_call("cudaMemcpyAsync", 3,
                       [&] { cudasim::before_call("cudaStreamSynchronize", 1, [&] { g.open(); }); });
  cudasim::fail_call("cudaMemcpyAsync", 3, cudaErrorInvalidValue);  // the third chunk's DMA fails
  bool threw = false;
  try {
    gpukit::copy_async(own_stream_device_buffer(source.size(), owner), source, s.view(), engine);
  } catch (const gpukit::error& e) {
    threw = true;
    MESSAGE(std::string(e.what()));  // "its first 2097152 bytes were enqueued before and may still be written"
  }
  REQUIRE(threw);
  cudasim::clear_faults();
  owner.synchronize();  // the buffer's free has run
  g.open();             // unless the copy waited: the two chunks enqueued before the failure would write freed memory
  try {
    s.synchronize();
  } catch (const std::exception& e) {
    MESSAGE("s.synchronize: " << std::string(e.what()));
  }
  const std::size_t violations = illegal_address_violations();
  cudasim::clear_faults();
  CHECK(violations == 0);
}

TEST_CASE(
    "sim staging: a staged copy_async into pageable memory that fails part-way keeps a temporary device source "
    "for the DMA still in flight") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, four_chunks());
  gpukit::stream s(gpukit::device::cuda(0));
  gpukit::stream owner(gpukit::device::cuda(0));
  std::vector<unsigned char> back(4 * MiB, 0);
  gpukit_test::gate g;
  // Chunk 0's DMA runs; chunk 1's is held behind the gate; chunk 2's fails to enqueue, so to_host throws while chunk
  // 1's DMA still has to read the source.
  cudasim::before_call("cudaMemcpyAsync", 2, [&] { g.hold(s); });
  // Once the third DMA fails, a wait for `s` (a buffer without record_stream is kept by waiting for the copy's chunks)
  // opens the gate; without that wait the gate opens only after the buffer's free.
  cudasim::before_call("cudaMemcpyAsync", 3,
                       [&] { cudasim::before_call("cudaStreamSynchronize", 1, [&] { g.open(); }); });
  cudasim::fail_call("cudaMemcpyAsync", 3, cudaErrorInvalidValue);
  bool threw = false;
  try {
    gpukit::copy_async(back, own_stream_device_buffer(back.size(), owner), s.view(), engine);
  } catch (const gpukit::error& e) {
    threw = true;
    MESSAGE(std::string(e.what()));
  }
  REQUIRE(threw);
  cudasim::clear_faults();
  owner.synchronize();  // the source's free has run
  g.open();
  try {
    s.synchronize();
  } catch (const std::exception& e) {
    MESSAGE("s.synchronize: " << std::string(e.what()));
  }
  const std::size_t violations = illegal_address_violations();
  cudasim::clear_faults();
  CHECK(violations == 0);
}

// The same with gpukit's own device_buffer (caching allocator): were its block back in its stream's cache under the
// enqueued chunks, the next buffer of that stream would get it, and the late chunks would overwrite its data.
TEST_CASE(
    "sim staging: the late chunks of a staged copy_async that failed part-way do not overwrite the next buffer of the "
    "temporary destination's stream") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, four_chunks());
  gpukit::stream s(gpukit::device::cuda(0));
  gpukit::stream owner(gpukit::device::cuda(0));
  const auto old_data = pattern(4 * MiB, 1);
  const auto new_data = pattern(4 * MiB, 7);
  REQUIRE(old_data != new_data);
  gpukit_test::gate g;
  g.hold(s);
  cudasim::fail_call("cudaMemcpyAsync", 3, cudaErrorInvalidValue);
  CHECK_THROWS(gpukit::copy_async(gpukit::device_buffer<unsigned char>(old_data.size(), owner.view()), old_data,
                                  s.view(), engine));
  cudasim::clear_faults();
  (void)cudasim::take_violations();  // the injected failure
  // Another buffer of the owner's stream, written and complete before the held stream goes on.
  gpukit::device_buffer<unsigned char> next(new_data.size(), owner.view());
  gpukit::copy_async(next, new_data, owner.view());
  owner.synchronize();
  g.open();
  s.synchronize();
  const std::vector<unsigned char> seen = gpukit::to_host(next, owner.view());
  CHECK(seen == new_data);
  std::size_t overwritten = 0;
  for (std::size_t i = 0; i < seen.size(); ++i) overwritten += seen[i] == new_data[i] ? 0 : 1;
  MESSAGE(overwritten << " bytes of the next buffer were overwritten by the failed copy's late chunks");
}

TEST_CASE("sim staging: the statistics count the chunks of a transfer that failed part-way") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, four_chunks());
  gpukit::stream s(gpukit::device::cuda(0));
  void* d = nullptr;
  REQUIRE(cudaMalloc(&d, 4 * MiB) == cudaSuccess);
  const auto source = pattern(4 * MiB, 2);
  cudasim::fail_call("cudaMemcpyAsync", 3, cudaErrorInvalidValue);
  CHECK_THROWS_AS(engine.to_device(d, source.data(), source.size(), s), gpukit::invalid_argument_error);
  cudasim::clear_faults();
  (void)cudasim::take_violations();
  s.synchronize();
  const gpukit::staging_stats st = engine.stats();
  CHECK(st.chunks == 2);  // two chunks were copied into slots and their DMAs enqueued
  CHECK(st.host_copy_time.count() > 0);
  (void)cudaFree(d);
}

// A failure while handing the rest of a transfer to the background thread names the rest, as staging_bad_alloc does.
TEST_CASE("sim staging: a failed hand-over of the rest of a transfer is called the rest, not a chunk") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_options o = four_chunks();
  o.patience = 10ms;
  gpukit::staging_engine engine(pool, o);
  gpukit::stream s(gpukit::device::cuda(0));
  void* d = nullptr;
  REQUIRE(cudaMalloc(&d, 6 * MiB) == cudaSuccess);
  const auto source = pattern(6 * MiB, 3);
  REQUIRE(engine.chunk_for(source.size()) == MiB);
  gpukit_test::gate g;
  g.hold(s);  // the four slots stay busy: the last 2 MiB are handed over
  cudasim::fail_call("cudaLaunchHostFunc", 1, cudaErrorUnknown);
  std::string what;
  try {
    engine.to_device(d, source.data(), source.size(), s);
  } catch (const gpukit::error& e) {
    what = e.what();
  }
  cudasim::clear_faults();
  (void)cudasim::take_violations();
  g.open();
  s.synchronize();
  INFO(what);
  REQUIRE_FALSE(what.empty());
  CHECK(what.find("the chunk of 2.00 MiB") == std::string::npos);  // chunks are 1 MiB; 2 MiB is the rest
  CHECK(what.find("the rest") != std::string::npos);
  (void)cudaFree(d);
}

// Across devices on the current streams: the copy is enqueued on the source device's stream, and the destination's
// stream waits for it. When that last wait fails, a temporary destination freed in another stream's order is kept
// for the copy (its block would serve that stream's next buffer under the copy).
TEST_CASE("sim staging: a copy across devices whose last wait fails keeps a temporary destination for the copy") {
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  const gpukit::device cuda1 = gpukit::device::cuda(1);
  gpukit::stream owner(cuda1);  // the destination's own stream: not the current stream of cuda:1
  const auto old_data = pattern(MiB, 4);
  const auto new_data = pattern(MiB, 8);
  REQUIRE(old_data != new_data);
  gpukit::device_buffer<unsigned char> source(old_data.size(), cuda0);
  gpukit::copy_async(source, old_data);
  gpukit::stream_view::default_stream(cuda0).synchronize();
  gpukit_test::gate g;
  g.hold(gpukit::stream_view::default_stream(cuda0));  // the copy waits behind the gate on cuda:0's current stream
  cudasim::fail_call("cudaStreamWaitEvent", 2, cudaErrorInvalidValue);  // cuda:1's wait for the copy
  CHECK_THROWS(gpukit::copy_async(gpukit::device_buffer<unsigned char>(old_data.size(), owner.view()), source));
  cudasim::clear_faults();
  (void)cudasim::take_violations();  // the injected failure
  gpukit::device_buffer<unsigned char> next(new_data.size(), owner.view());
  gpukit::copy_async(next, new_data, owner.view());
  owner.synchronize();
  g.open();
  gpukit::stream_view::default_stream(cuda0).synchronize();
  CHECK(gpukit::to_host(next, owner.view()) == new_data);
}

// Reviewer 180: the pinned adaptors' over-aligned addresses and resource_upstream's frees.
TEST_CASE("sim staging: pool().record_stream orders the reuse of an over-aligned pinned_pmr_resource allocation") {
  // pmr.hpp: a freed block is served again after the events of the streams recorded for it (pool().record_stream).
  // An over-aligned address lies inside its block, found through the over-aligned address table.
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::pinned_pmr_resource pinned(d);
  gpukit::stream s(d);
  std::size_t alignment = std::size_t{1} << 16;
  void* p = nullptr;
  for (; alignment <= (std::size_t{1} << 22); alignment <<= 1) {  // one whose block does not start at the address
    p = pinned.allocate(4096, alignment);
    if (gpukit::detail::over_aligned_addresses().block_of(p) != p) break;
    pinned.deallocate(p, 4096, alignment);
    p = nullptr;
  }
  REQUIRE(p != nullptr);
  device_memory dev(4096);
  gpukit_test::gate g;
  g.hold(s);
  REQUIRE(cudaMemcpyAsync(p, dev.p, 4096, cudaMemcpyDeviceToHost, s.cuda_handle()) == cudaSuccess);
  CHECK_NOTHROW(pinned.pool().record_stream(p, s));
  pinned.deallocate(p, 4096, alignment);
  void* again = pinned.allocate(4096, alignment);  // the copy into p has not run: its block is not served again
  CHECK(gpukit::detail::over_aligned_addresses().block_of(again) !=
        gpukit::detail::over_aligned_addresses().block_of(p));
  g.open();
  s.synchronize();
  pinned.deallocate(again, 4096, alignment);
}

TEST_CASE("resource_upstream: a segment given back while host memory runs out is returned to its resource") {
  // deallocate is noexcept and lists the segment with those held back during a capture: with no room for the list,
  // the segment is given back alone (before, std::bad_alloc escaped it: std::terminate).
  const gpukit::device d = gpukit::device::cuda(0);
  refusing_free_resource resource;
  gpukit::resource_upstream<refusing_free_resource> upstream(resource, d);
  for (long n = 1;; ++n) {
    void* p = upstream.allocate(MiB);
    const std::size_t frees = cudasim::calls("cudaFree");
    gpukit_test::heap_run run(n, simulated_call);
    CHECK(run.armed([&] { upstream.deallocate(p, MiB); }));
    CHECK(cudasim::calls("cudaFree") == frees + 1);  // returned to the resource (its synchronous free)
    if (run.seen() < n) break;
  }
  CHECK(resource.refused->empty());
}

TEST_CASE("resource_upstream: a free the resource refuses keeps the program's pending CUDA error") {
  // deallocate_after forgets only what its own call left: an error the program has not read yet stays.
  const gpukit::device d = gpukit::device::cuda(0);
  refusing_free_resource resource;
  gpukit::resource_upstream<refusing_free_resource> upstream(resource, d);
  void* p = upstream.allocate(MiB);
  int count = 0;
  REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
  REQUIRE(cudaSetDevice(count + 5) == cudaErrorInvalidDevice);  // the program's own, not read yet
  CHECK_FALSE(upstream.deallocate_after(p, MiB, {}));           // the resource refuses the free
  CHECK(cudaPeekAtLastError() == cudaErrorInvalidDevice);
  (void)cudaGetLastError();
  REQUIRE(resource.refused->size() == 1);
  REQUIRE(cudaFree(resource.refused->front()) == cudaSuccess);  // the test's: the resource kept it
  (void)cudasim::take_violations();
}

// Reviewer 181: a copy refused before anything was enqueued (the legacy stream while a blocking stream is captured)
// throws at once; keeping its temporary device buffer must not wait for the capture (for ever, if it is the
// caller's own). Each capture is ended by a watchdog after 5 s at the latest, so that a regression fails, not hangs.
TEST_CASE("sim staging: a refused copy_async with a temporary device buffer throws during this thread's raw capture") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream owner(d);
  own_stream_device_buffer buffer(MiB, owner.view());
  gpukit::stream captured(d, gpukit::stream_options{false, 0});  // blocking
  std::vector<unsigned char> back(MiB, 0);
  REQUIRE(cudaStreamBeginCapture(captured.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  std::mutex m;
  std::condition_variable cv;
  bool returned = false;
  bool ended_by_watchdog = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(m);
    if (cv.wait_for(lock, std::chrono::seconds(5), [&] { return returned; })) return;
    ended_by_watchdog = true;
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(captured.cuda_handle(), &graph);  // relaxed: another thread may end it
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  });
  CHECK_THROWS_AS(gpukit::copy_async(back, std::move(buffer), gpukit::stream_view::default_stream(d)),
                  gpukit::invalid_argument_error);
  {
    std::lock_guard<std::mutex> lock(m);
    returned = true;
  }
  cv.notify_all();
  watchdog.join();
  CHECK_FALSE(ended_by_watchdog);
  if (!ended_by_watchdog) {
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(captured.cuda_handle(), &graph) == cudaSuccess);
    (void)cudaGraphDestroy(graph);
  }
  owner.synchronize();
  (void)cudasim::take_violations();
}

TEST_CASE(
    "sim staging: a refused copy_async with a temporary device buffer does not wait for another thread's capture") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream owner(d);
  own_stream_device_buffer buffer(MiB, owner.view());
  gpukit::stream captured(d, gpukit::stream_options{false, 0});  // blocking
  std::vector<unsigned char> back(MiB, 0);
  std::mutex m;
  std::condition_variable cv;
  bool begun = false;
  bool released = false;
  bool ended_by_watchdog = false;
  std::thread capturer([&] {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(captured.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
    std::unique_lock<std::mutex> lock(m);
    begun = true;
    cv.notify_all();
    ended_by_watchdog = !cv.wait_for(lock, std::chrono::seconds(5), [&] { return released; });
    lock.unlock();
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(captured.cuda_handle(), &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return begun; });
  }
  CHECK_THROWS_AS(gpukit::copy_async(back, std::move(buffer), gpukit::stream_view::default_stream(d)),
                  gpukit::invalid_argument_error);
  {
    std::lock_guard<std::mutex> lock(m);
    released = true;  // the capture was still underway when copy_async returned, unless the watchdog ended it
  }
  cv.notify_all();
  capturer.join();
  CHECK_FALSE(ended_by_watchdog);
  owner.synchronize();
  (void)cudasim::take_violations();
}
