// Host memory running out inside gpukit's CUDA-side engines (graph_pool, async_allocator, the staging engine), on the
// simulator: this executable replaces operator new so that the N-th allocation of a call under test throws
// std::bad_alloc, for every N. A call that fails must change nothing (an allocation is not made, a free leaves the
// block allocated, to be freed again), and the engine must stay whole: every byte accounted for, free blocks merged
// again once everything is freed.
#include <gpukit/device/peer_access.hpp>
#include <gpukit/gpukit.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/async_allocator.hpp>
#include <gpukit/memory/graph_pool.hpp>

#include "cudasim.hpp"
#include "failing_heap.hpp"
#include "support.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

using gpukit_test::heap_run;

/// The simulator's own allocations are not counted: the real runtime does not allocate with operator new, nor throw.
bool simulated_call() { return cudasim::inside_call(); }

/// "" when the pool's blocks tile each chunk, its allocated blocks are exactly `live` and its statistics agree.
std::string pool_problem(const gpukit::graph_pool& pool, const std::vector<void*>& live) {
  const gpukit::allocator_snapshot snap = pool.snapshot();
  std::size_t allocated = 0;
  std::size_t allocated_blocks = 0;
  for (const gpukit::segment_info& seg : snap.segments) {
    std::uintptr_t at = seg.address;
    for (const gpukit::block_info& b : seg.blocks) {
      if (b.address != at) return "the blocks of a chunk leave a gap or overlap at " + std::to_string(at - seg.address);
      at += b.size;
      if (b.state == gpukit::block_state::allocated) {
        allocated += b.size;
        ++allocated_blocks;
        bool held = false;
        for (void* p : live) held = held || reinterpret_cast<std::uintptr_t>(p) == b.address;
        if (!held) return "an allocated block nobody holds";
      }
    }
    if (at != seg.address + seg.size) return "the blocks of a chunk do not cover it";
  }
  if (allocated_blocks != live.size()) return "an allocation held is not an allocated block";
  if (allocated != pool.memory_allocated()) return "memory_allocated() differs from the allocated blocks";
  return "";
}

void forget(std::vector<void*>& live, void* p) {
  for (auto it = live.begin(); it != live.end(); ++it) {
    if (*it == p) {
      live.erase(it);
      return;
    }
  }
}

}  // namespace

TEST_CASE("heap faults: a graph pool whose host allocation fails at its N-th, for every N, changes nothing") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  long runs = 0;
  int failures = 0;
  // A free (on its stream, or without one: on the allocation's) whose event after that stream's work cannot be kept
  // waits for the stream on the host instead, and says so: a fault handled, no call fails. Counted without the heap.
  int host_waits = 0;
  const gpukit::warning_handler previous = gpukit::set_warning_handler([&host_waits](std::string_view message) {
    if (message.find("waiting for it on the host") != std::string_view::npos) ++host_waits;
  });
  for (long n = 1;; ++n) {
    auto pool = gpukit::graph_pool::create(d, MiB);
    heap_run run(n, simulated_call);
    std::vector<void*>& live = run.held();
    std::string problem;
    const auto check = [&](const char* after) {
      const std::string p = pool_problem(*pool, live);
      if (problem.empty() && !p.empty()) problem = std::string("after ") + after + ": " + p;
    };
    const auto allocate = [&](std::size_t bytes) {
      void* p = nullptr;
      if (run.armed([&] { p = pool->allocate(bytes, s); })) live.push_back(p);
      check("allocate");
      return p;
    };
    const auto release = [&](void* p) {
      if (p == nullptr) return;
      if (run.armed([&] { pool->deallocate(p); })) forget(live, p);  // a failed free leaves it allocated
      check("deallocate");
    };
    // Outside a capture: holes, a split, merges on both sides.
    void* a = allocate(1000);
    void* b = allocate(5000);
    void* c = allocate(300);
    void* e = allocate(70000);
    release(b);
    void* f = allocate(2000);  // from b's hole: the rest stays free
    release(a);
    release(c);
    release(f);
    void* g = allocate(9000);
    release(e);
    // In a capture: blocks kept for the capturing stream, merged again for any stream once it ends.
    void* output = nullptr;
    gpukit::graph graph = gpukit::capture(
        s,
        [&] {
          void* x = allocate(4096);
          void* y = allocate(512);
          release(x);
          output = allocate(4096);
          release(y);
        },
        pool);
    check("the capture");
    release(g);
    release(output);
    // Whatever failed is freed now, with nothing armed: the reserve is whole again.
    while (!live.empty()) {
      pool->deallocate(live.back());
      live.pop_back();
    }
    check("freeing everything");
    const gpukit::allocator_snapshot snap = pool->snapshot();
    REQUIRE(snap.segments.size() == 1);
    INFO("fault at host allocation " << n);
    CHECK(problem == "");
    CHECK(run.unexpected() == "");
    // All free again (the blocks a capture used kept apart from the rest, for direct allocations), and one
    // capture can take it all: merged again.
    CHECK(pool->free_space().free_bytes == MiB);
    CHECK(pool->memory_allocated() == 0);
    void* whole = nullptr;
    gpukit::graph taking_all = gpukit::capture(
        s, [&] { whole = pool->allocate(MiB, s); }, pool);  // a capture takes the whole reserve in one block
    pool->deallocate(whole);
    failures += run.failures();
    if (run.seen() < n) break;  // fewer allocations than n: every one has failed once
    ++runs;
  }
  gpukit::set_warning_handler(previous);
  MESSAGE("graph pool: " << runs << " runs, " << failures << " calls failed with std::bad_alloc, " << host_waits
                         << " frees waited on the host");
  CHECK(runs > 5);
  CHECK(failures + host_waits >= runs);
}

TEST_CASE("heap faults: an async_allocator whose host allocation fails at its N-th, for every N, loses nothing") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::stream other(d);
  cudaMemPool_t pool = nullptr;
  GPUKIT_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, 0));
  const auto pool_used = [pool] {
    cuuint64_t used = 0;
    GPUKIT_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    return static_cast<std::size_t>(used);
  };
  const std::size_t used_before = pool_used();
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    std::size_t live_bytes = 0;
    std::string problem;
    heap_run run(n, simulated_call);
    {
      gpukit::async_allocator a(d);
      std::vector<void*>& live = run.held();
      std::vector<std::size_t> sizes;
      sizes.reserve(64);
      const auto check = [&](const char* after) {
        if (problem.empty() && a.memory_allocated() != live_bytes) {
          problem = std::string("after ") + after + ": memory_allocated() differs from the allocations held";
        }
        for (void* p : live) {
          if (problem.empty() && !a.owns(p)) problem = std::string("after ") + after + ": an allocation held is lost";
        }
      };
      const auto allocate = [&](std::size_t bytes) {
        void* p = nullptr;
        if (run.armed([&] { p = a.allocate(bytes, s); })) {
          live.push_back(p);
          sizes.push_back(bytes);
          live_bytes += bytes;
        }
        check("allocate");
        return p;
      };
      const auto release = [&](void* p, const gpukit::stream* on) {
        if (p == nullptr) return;
        const bool done = run.armed([&] {
          if (on != nullptr) {
            a.deallocate(p, *on);
          } else {
            a.deallocate(p);
          }
        });
        if (done) {  // a failed free leaves it allocated
          for (std::size_t i = 0; i < live.size(); ++i) {
            if (live[i] != p) continue;
            live_bytes -= sizes[i];
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
            sizes.erase(sizes.begin() + static_cast<std::ptrdiff_t>(i));
            break;
          }
        }
        check("deallocate");
      };
      void* x = allocate(1000);
      void* y = allocate(5000);
      void* z = allocate(70000);
      if (y != nullptr) run.armed([&] { a.record_stream(y, other); });
      check("record_stream");
      release(x, &other);   // after the allocation stream's work too
      release(y, nullptr);  // after other's work
      void* w = allocate(3000);
      release(z, &s);
      release(w, nullptr);
      // Whatever failed is freed now, with nothing armed.
      while (!live.empty()) {
        a.deallocate(live.back());
        live_bytes -= sizes.back();
        live.pop_back();
        sizes.pop_back();
      }
      check("freeing everything");
      s.synchronize();
      other.synchronize();
    }
    INFO("fault at host allocation " << n);
    CHECK(problem == "");
    CHECK(run.unexpected() == "");
    CHECK(pool_used() == used_before);  // every cudaMallocAsync was freed
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("async_allocator: " << runs << " runs, " << failures << " calls failed with std::bad_alloc");
  CHECK(runs > 5);
  CHECK(failures >= runs);
}

TEST_CASE(
    "heap faults: a graph launch whose host allocation N fails, for every N, still orders the work of a stream "
    "captured when it freed a pool block") {
  // The launch records that stream's event then; with no room to keep it, the launch's stream waits for it at once
  // instead of letting the graph overwrite the block under the stream's pending copy.
  const gpukit::device d = gpukit::device::cuda(0);
  auto& allocator = gpukit::default_allocator(d);
  gpukit::stream s(d);
  gpukit::stream consumer(d);
  constexpr std::size_t count = 256;
  constexpr std::size_t bytes = count * sizeof(int);
  gpukit::device_buffer<int> seen(count, s);
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    INFO("fault at host allocation " << n);
    gpukit_test::captured_warnings warnings;
    auto pool = gpukit::graph_pool::create(d, MiB);
    // A graph whose output (allocated in the capture, not freed there) is filled with `byte`.
    const auto producer = [&](void*& out, int byte) {
      return gpukit::capture(
          s,
          [&] {
            out = allocator.allocate(bytes, s);
            REQUIRE(cudaMemsetAsync(out, byte, bytes, s.cuda_handle()) == cudaSuccess);
          },
          pool);
    };
    void* out = nullptr;
    gpukit::graph first = producer(out, 2);
    first.launch(s);
    REQUIRE(cudaMemsetAsync(seen.data(), 0, bytes, s.cuda_handle()) == cudaSuccess);
    s.synchronize();
    gpukit_test::gate held;
    held.hold(consumer);  // the consumer's copy of the first graph's output waits
    REQUIRE(cudaMemcpyAsync(seen.data(), out, bytes, cudaMemcpyDeviceToDevice, consumer.cuda_handle()) == cudaSuccess);
    allocator.record_stream(out, consumer);
    REQUIRE(cudaStreamBeginCapture(consumer.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    allocator.deallocate(out);  // `consumer` cannot take an event now: recorded at the next launch
    cudaGraph_t unused = nullptr;
    REQUIRE(cudaStreamEndCapture(consumer.cuda_handle(), &unused) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(unused) == cudaSuccess);
    void* reused = nullptr;
    gpukit::graph second = producer(reused, 3);
    REQUIRE(reused == out);
    heap_run run(n, simulated_call);
    // The launch orders the held copy on the device, never on the host (a watchdog turns a host wait into a failure).
    CHECK_FALSE(held.opened_to_return(
        [&] {
          if (!run.armed([&] { second.launch(s); })) second.launch(s);  // a failed launch changed nothing: again
        },
        std::chrono::seconds(20)));
    held.open();
    s.synchronize();
    consumer.synchronize();
    std::vector<int> host(count);
    REQUIRE(cudaMemcpy(host.data(), seen.data(), bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(host == std::vector<int>(count, 0x02020202));  // the first graph's data, not the second's
    CHECK_FALSE(warnings.contains("may be reused before"));
    CHECK(run.unexpected() == "");
    allocator.deallocate(reused, s);
    s.synchronize();
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("graph launch after a captured free: " << runs << " runs, " << failures << " launches threw std::bad_alloc");
  CHECK(runs >= 1);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "heap faults: a staging block orphaned by a failed background record, which the pool refuses with no host memory "
    "left, stays with the engine until the pool takes it") {
  // The background thread cannot give a slot's block back to the pool (it makes no pool call): when the slot's event
  // cannot be recorded, the block waits in the ring for a caller. A caller with no host memory left cannot give it
  // back either; dropping it then would leave it allocated in the pool, held by nobody.
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_options options;
  options.chunk_bytes = 256 * 1024;
  options.min_chunk_bytes = 64 * 1024;
  options.slots = 2;
  options.patience = std::chrono::milliseconds(10);
  gpukit::staging_engine engine(pool, options);
  std::vector<unsigned char> small(512 * 1024);  // two chunks: one per slot
  std::vector<unsigned char> large(2 * MiB);     // past the patience behind the held stream: the background stages it
  for (std::size_t i = 0; i < large.size(); ++i) large[i] = static_cast<unsigned char>(i * 7 + 1);
  void* device_side = nullptr;
  REQUIRE(cudaMalloc(&device_side, large.size()) == cudaSuccess);
  gpukit::stream s(d);
  gpukit_test::captured_warnings warnings;
  {
    gpukit_test::gate held;
    held.hold(s);
    engine.to_device(device_side, small.data(), small.size(), s);
    engine.to_device(device_side, large.data(), large.size(), s);  // handed over whole
    REQUIRE(engine.stats().overflows == 1);
    // The next record is the background thread's, of the first slot it fills (it waits for the gate first).
    cudasim::fail_call("cudaEventRecord", 1, cudaErrorInvalidValue);
    held.open();
    s.synchronize();
  }
  CHECK(engine.stats().background_failures == 1);
  CHECK(warnings.contains("the destination is incomplete"));
  REQUIRE(pool.stats().active_blocks == 2);  // the other slot's block and the orphan

  {
    heap_run no_memory(1, simulated_call, 1 << 20);  // every host allocation of gpukit fails inside armed()
    CHECK_FALSE(no_memory.armed([&] { engine.to_device(device_side, small.data(), small.size(), s); }));
    CHECK(no_memory.unexpected() == "");
  }
  CHECK(pool.stats().active_blocks == 2);  // refused, kept: none dropped
  {
    // A new run (a burst ends with its armed() call); the list of released rings gets its room (the first
    // allocation), the pool none: the ring is not released while it holds a block the pool refused.
    heap_run no_memory(2, simulated_call, 1 << 20);
    std::size_t released = 99;
    CHECK(no_memory.armed([&] { released = engine.release_idle(); }));
    CHECK(released == 0);
    CHECK(no_memory.failures() == 0);
    CHECK(no_memory.seen() >= 2);  // the pool was asked
    CHECK(no_memory.unexpected() == "");
  }
  CHECK(pool.stats().active_blocks == 2);

  // With memory again the orphan goes back and the slot gets a new block: the engine works as before.
  std::vector<unsigned char> back(large.size());
  engine.to_device(device_side, large.data(), large.size(), s);
  engine.to_host(back.data(), device_side, back.size(), s);
  s.synchronize();
  CHECK(back == large);
  CHECK(engine.release_idle() == 1);
  CHECK(pool.stats().active_blocks == 0);
  CHECK(pool.stats().lost_blocks == 0);
  CHECK(cudaFree(device_side) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: a pinned pool allocation short of host memory fails before it pins, for every N") {
  // cudaFreeHost waits for all the device's work, which inside a staging transfer may wait for this thread: the
  // pool's bookkeeping is made before cudaHostAlloc, so a failure never has a block to unpin. (Before, a block the
  // pool had no room to keep was unpinned, outside the lock: another thread read the statistics from inside that
  // cudaFreeHost, which deadlocked when the lock was held; the probe stays for any unpinning that comes back.)
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  long runs = 0;
  int failures = 0;
  int unpinned_on_failure = 0;
  for (long n = 1;; ++n) {
    INFO("fault at host allocation " << n);
    const std::size_t frees_before = cudasim::calls("cudaFreeHost");
    std::size_t reserved_seen = 1;
    bool answered_while_unpinning = true;
    gpukit_test::bounded_calls probe;  // with the lock held, its call waited until allocate() returned
    cudasim::before_call("cudaFreeHost", 1, [&] {
      answered_while_unpinning = probe.returned_within([&] { reserved_seen = pool.stats().reserved_bytes; });
    });
    void* p = nullptr;
    heap_run run(n, simulated_call);
    const bool done = run.armed([&] { p = pool.allocate(3000); });
    cudasim::clear_faults();  // the action, if no cudaFreeHost ran
    CHECK(run.unexpected() == "");
    if (done) {
      CHECK(cudasim::calls("cudaFreeHost") == frees_before);
      pool.deallocate(p);
      pool.empty_cache();
    } else if (cudasim::calls("cudaFreeHost") != frees_before) {
      ++unpinned_on_failure;
      CHECK(answered_while_unpinning);
      CHECK(reserved_seen == 0);  // read while it was being unpinned: never counted as reserved
    }
    CHECK(pool.stats().reserved_bytes == 0);
    CHECK(pool.stats().active_blocks == 0);
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("pinned_pool allocate: " << runs << " runs, " << failures << " failed with std::bad_alloc, "
                                   << unpinned_on_failure << " unpinned its block");
  CHECK(failures >= 1);
  CHECK(unpinned_on_failure == 0);
  CHECK(pool.stats().upstream_frees == pool.stats().upstream_allocations);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: the stream table, first needed by a lookup that must not throw, is made without allocating") {
  // find_created_stream and forget_created_stream are noexcept and may be the process's first use of the table (a
  // raw handle named before gpukit made any stream of its own). Were the table allocated there, a host allocation
  // failing at that moment would end the program (std::terminate) instead of being an answer.
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreate(&raw) == cudaSuccess);  // made by the user, so gpukit's table has not been needed yet
  bool known = true;
  {
    heap_run run(1, simulated_call);  // the first allocation of the lookups would fail
    CHECK(run.armed([&] {
      known = gpukit::detail::cuda_backend::find_created_stream(raw).has_value();
      gpukit::detail::cuda_backend::forget_created_stream(raw);
    }));
    CHECK(run.seen() == 0);
    CHECK(run.unexpected() == "");
  }
  CHECK_FALSE(known);
  cudaStream_t made = nullptr;
  {  // and the table works: a stream gpukit makes is found, then forgotten when it goes
    gpukit::stream s(gpukit::device::cuda(0));
    made = s.view().cuda_handle();
    CHECK(gpukit::detail::cuda_backend::find_created_stream(made).has_value());
  }
  CHECK_FALSE(gpukit::detail::cuda_backend::find_created_stream(made).has_value());
  REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: an exclusive acquire at capacity while a stream given back stays captured allocates nothing") {
  // The stream waits in the pool until its capture ends; each acquire asks again, under the pool's lock, where an
  // allocation would fail every acquire while host memory is short (and cost a heap call each time).
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream_pool pool(d, 1, {}, 1);
  cudaStream_t leased = nullptr;
  {
    gpukit::stream_pool::lease lease = pool.acquire_exclusive();
    leased = lease.view().cuda_handle();
    REQUIRE(cudaStreamBeginCapture(leased, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  }
  bool leased_again = true;
  {
    heap_run run(1, simulated_call);  // the first allocation fails
    CHECK(run.armed([&] { leased_again = pool.try_acquire_exclusive().has_value(); }));
    CHECK(run.seen() == 0);
    CHECK(run.unexpected() == "");
  }
  CHECK_FALSE(leased_again);  // still captured: not leased
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(leased, &graph) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(pool.acquire_exclusive().view().cuda_handle() == leased);  // recycled once its capture ended
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: a peer_access whose hold cannot be recorded leaves peer access disabled") {
  // Access enabled but not recorded would never be disabled: a later hold would find it enabled "outside gpukit" and
  // leave it enabled after its release.
  const gpukit::device d0 = gpukit::device::cuda(0);
  const gpukit::device d1 = gpukit::device::cuda(1);
  { gpukit::peer_access warm_up(d0, d1); }  // the first use's one-time allocations, outside the run
  {
    heap_run run(1, simulated_call);  // the first allocation fails: the registry's record of the pair
    CHECK_FALSE(run.armed([&] { gpukit::peer_access access(d0, d1); }));
    CHECK(run.unexpected() == "");
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);  // it was left disabled
  CHECK(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
  {
    gpukit_test::captured_warnings warnings;
    {
      gpukit::peer_access access(d0, d1);  // enabled by gpukit again (no record of the failed hold left)...
      CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
      (void)cudaGetLastError();
    }  // ...and disabled by its release
    CHECK(warnings.messages().empty());
  }
  CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
  CHECK(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: a stream's release() short of host memory changes nothing, for every N") {
  // The record kept for the views made before the release is the step that may fail (found by review: the record was
  // moved out first, and lost with the failure: the views dangled, the current stream read as destroyed).
  const gpukit::device d = gpukit::device::cuda(0);
  int failures = 0;
  for (long n = 1;; ++n) {
    auto s = std::make_unique<gpukit::stream>(d);
    const gpukit::stream_view before = s->view();
    const std::weak_ptr<const gpukit::detail::stream_life> record = before.lifetime();
    gpukit::stream_guard current(*s);
    cudaStream_t handle = nullptr;
    bool released = false;
    long seen = 0;
    {
      heap_run run(n, simulated_call);
      released = run.armed([&] { handle = s->release(); });
      CHECK(run.unexpected().empty());
      seen = run.seen();
    }
    if (released) {
      CHECK_FALSE(record.expired());
      CHECK(gpukit::current_stream(d).native_handle() == handle);
      CHECK(cudaStreamDestroy(handle) == cudaSuccess);
      if (seen < n) break;  // no allocation left to fail
      continue;
    }
    ++failures;
    INFO("host allocation " << n << " failed");
    CHECK(s->valid());
    CHECK(s->owns_handle());
    CHECK_FALSE(record.expired());
    CHECK(s->view().lifetime().get() == record.lock().get());
    CHECK(gpukit::current_stream(d).native_handle() == s->cuda_handle());
  }
  CHECK(failures > 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("heap faults: a lease that outlives its pool leaves its captured stream undestroyed, short of memory too") {
  // The pool gives up the handle of a stream still being captured (destroying it would break the capture); found by
  // review: release() may now fail for want of host memory, and the pool then destroyed the stream.
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit_test::captured_warnings warnings;
  for (long n = 1; n <= 3; ++n) {
    INFO("host allocation " << n << " fails");
    auto pool = std::make_unique<gpukit::stream_pool>(d, 1);
    std::optional<gpukit::stream_pool::lease> lease(pool->acquire_exclusive());
    const cudaStream_t handle = lease->view().native_handle();
    REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    pool.reset();  // a lease is still out
    {
      heap_run run(n, simulated_call);
      (void)run.armed([&] { lease.reset(); });
    }
    lease.reset();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    CHECK(cudaStreamIsCapturing(handle, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
    if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  }
  CHECK(warnings.contains("left undestroyed"));
  CHECK(cudasim::violations().empty());
}
