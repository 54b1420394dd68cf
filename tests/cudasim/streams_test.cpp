// Stream identity, lifetime and special streams in gpukit's CUDA layer, on the simulator (which reuses a destroyed
// stream's handle at the next cudaStreamCreate, gives each host thread its own cudaStreamPerThread, and keeps the
// per-thread last error as CUDA does).
#include "cudasim.hpp"
#include "handle_reuse.hpp"
#include "support.hpp"

#include <gpukit/memory/async_allocator.hpp>
#include <gpukit/memory/async_pool_upstream.hpp>
#include <gpukit/memory/resource_upstream.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/history_export.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>
#include <gpukit/stream/stream_ref.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/to_device.hpp>
#include <gpukit/warning.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using gpukit_test::captured_warnings;
using gpukit_test::gate;

namespace {

const gpukit::device cuda0 = gpukit::device::cuda(0);
const gpukit::device cuda1 = gpukit::device::cuda(1);
constexpr std::size_t block_bytes = 4096;

cudaStream_t create_raw_stream(gpukit::device d) {
  gpukit::device_guard guard(d);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  return s;
}

void destroy_raw_stream(cudaStream_t s) { REQUIRE(cudaStreamDestroy(s) == cudaSuccess); }

bool stream_idle(cudaStream_t s) { return cudaStreamQuery(s) == cudaSuccess; }

/// Opens a gate when the test case ends, however it ends, and waits for the work it held: a failed check must not
/// leave work blocked (an allocator's cudaFree at teardown would wait for it forever). Declare the gate before the
/// streams and allocators, and this after them.
class open_at_exit {
 public:
  explicit open_at_exit(std::initializer_list<gate*> gates) : gates_(gates) {}
  open_at_exit(const open_at_exit&) = delete;
  open_at_exit& operator=(const open_at_exit&) = delete;
  ~open_at_exit() {
    for (gate* g : gates_) g->open();
    cudasim::drain_all();
  }

 private:
  std::vector<gate*> gates_;
};

/// Before the `nth` next call of `function`, another thread destroys `doomed` (its handle is not reused); the call
/// goes on once that is done, or after 200 ms if the destruction is held off (a stream kept alive: a
/// stream_life::keep_alive). Joins that thread when it ends.
class destroyed_by_another_thread {
 public:
  destroyed_by_another_thread(const std::string& function, int nth, std::unique_ptr<gpukit::stream>& doomed) {
    cudasim::before_call(function, nth, [this, &doomed] {
      destroyer_ = std::thread([this, &doomed] {
        doomed.reset();
        destroyed_ = true;
      });
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      while (!destroyed_ && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      destroyed_during_call_ = destroyed_.load();
      ran_ = true;
    });
  }
  destroyed_by_another_thread(const destroyed_by_another_thread&) = delete;
  destroyed_by_another_thread& operator=(const destroyed_by_another_thread&) = delete;
  ~destroyed_by_another_thread() { join(); }

  void join() {
    if (destroyer_.joinable()) destroyer_.join();
  }
  bool ran() const { return ran_; }
  /// Whether the stream was destroyed before the call was made.
  bool destroyed_during_call() const { return destroyed_during_call_; }

 private:
  std::thread destroyer_;
  std::atomic<bool> destroyed_{false};
  bool destroyed_during_call_ = false;
  bool ran_ = false;
};

/// Options that never release cached segments on the allocation path: cudaFree waits for the device's work, and the
/// tests hold that work back with a gate.
gpukit::allocator_options keep_segments() {
  gpukit::allocator_options o;
  o.release_before_grow = false;
  return o;
}

}  // namespace

// --- (1) stream identity: a destroyed stream's handle is given to the next stream ---

TEST_CASE("streams: a new raw stream that receives a destroyed stream's handle does not get the blocks its work uses") {
  gate g;
  gpukit::caching_allocator a(cuda0, keep_segments());
  const cudaStream_t first = create_raw_stream(cuda0);
  const gpukit::stream_view A(cuda0, first);
  open_at_exit release{&g};
  g.hold(A);  // A's work (which could still read p) waits for the gate
  void* p = a.allocate(block_bytes, A);
  a.deallocate(p);  // in A's order: reusable on A at once, on no other stream
  destroy_raw_stream(first);
  const cudaStream_t second = create_raw_stream(cuda0);
  REQUIRE(second == first);  // the handle is reused
  const gpukit::stream_view B(cuda0, second);
  void* q = a.allocate(block_bytes, B);
  CHECK(q != p);
  g.open();
  cudasim::drain_all();
  a.deallocate(q);
  destroy_raw_stream(second);
}

TEST_CASE("streams: a block recorded on a stream destroyed and its handle reused during its free waits for its work") {
  // Another thread destroys the recorded stream between the allocator's look at it and its event record, and a new
  // stream gets the handle (LIFO here): the record then orders only the new stream's work. The block waits for the
  // old stream's final event instead.
  gate g;
  gpukit::caching_allocator a(cuda0, keep_segments());
  open_at_exit release{&g};
  gpukit::stream s(cuda0);
  gpukit::stream other(cuda0);
  auto user = std::make_unique<gpukit::stream>(cuda0);
  void* p = a.allocate(block_bytes, s);
  a.record_stream(p, *user);
  g.hold(*user);  // its work, which could still read p
  gpukit_test::handle_reuse_at reuse("cudaEventRecord", 1, user);
  a.deallocate(p);
  (void)reuse.successor();  // the record went to the new stream
  void* q = a.allocate(block_bytes, other);
  CHECK(q != p);  // not while the old stream's work may still read it
  void* r = a.allocate(block_bytes, s);
  CHECK(r != p);  // nor on its own stream
  g.open();
  cudasim::drain_all();
  a.deallocate(q);
  a.deallocate(r);
  void* first = a.allocate(block_bytes, s);
  void* second = a.allocate(block_bytes, s);
  CHECK((first == p || second == p));  // reusable once that work has run
  a.deallocate(first);
  a.deallocate(second);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a gpukit stream with a destroyed stream's handle does not get its blocks before its work is done") {
  gate g;
  gpukit::caching_allocator a(cuda0, keep_segments());
  open_at_exit release{&g};
  void* p = nullptr;
  cudaStream_t old_handle = nullptr;
  {
    gpukit::stream A(cuda0);
    old_handle = A.cuda_handle();
    g.hold(A);
    p = a.allocate(block_bytes, A);
    a.deallocate(p);
  }
  gpukit::stream B(cuda0);
  REQUIRE(B.cuda_handle() == old_handle);
  void* q = a.allocate(block_bytes, B);
  CHECK(q != p);
  CHECK(stream_idle(B.cuda_handle()));  // nor was B made to wait for A's work
  g.open();
  cudasim::drain_all();
  // A's work is done: what A cached is free for any stream now (B still prefers its own cache).
  gpukit::stream C(cuda0);
  void* r = a.allocate(block_bytes, C);
  CHECK(r == p);
  a.deallocate(r);
  a.deallocate(q);
}

TEST_CASE("streams: creating and destroying thousands of streams keeps the allocator's stream count bounded") {
  // Bounded memory too, without freeing to the device in a steady state: a destroyed gpukit::stream's cache goes to
  // any stream once its last work is done (no upstream call); a raw handle's destruction is invisible, so the cache
  // of a stream that allocated nothing while 64 others were registered is released before the footprint grows.
  gpukit::caching_allocator a(cuda0);
  const std::size_t segment = a.engine().segment_size_for(block_bytes);
  for (int i = 0; i < 3000; ++i) {
    gpukit::stream s(cuda0);
    a.deallocate(a.allocate(block_bytes, s));
    if (i % 50 == 49) cudasim::drain_all();  // final events complete in the simulator's time: bound the backlog
  }
  CHECK(a.engine().stream_count() <= 128);
  CHECK(a.memory_reserved() <= 64 * segment);  // at most the dead streams whose final event has not completed
  CHECK(a.stats().num_device_free == 0);
  for (int i = 0; i < 3000; ++i) {
    const cudaStream_t raw = create_raw_stream(cuda0);
    a.deallocate(a.allocate(block_bytes, gpukit::stream_view(cuda0, raw)));
    destroy_raw_stream(raw);
  }
  CHECK(a.engine().stream_count() <= 128);
  CHECK(a.memory_reserved() <= 128 * segment);  // at most two sweep periods of abandoned streams' cache
  CHECK(a.stats().num_device_free == a.stats().num_device_free_unforced);
  CHECK(a.stats().num_device_free > 0);
}

TEST_CASE("streams: stream identity costs no CUDA call per allocation for gpukit streams and default streams") {
  gpukit::caching_allocator a(cuda0);
  gpukit::stream s(cuda0);
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(cuda0);
  void* keep_s = a.allocate(block_bytes, s);  // registration and the first lookups; keeps the segments cached
  void* keep_legacy = a.allocate(block_bytes, legacy);
  const std::size_t ids = cudasim::calls("cudaStreamGetId");
  const std::size_t devices = cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cudaGetDevice");
  for (int i = 0; i < 1000; ++i) {
    a.deallocate(a.allocate(block_bytes, s));
    a.deallocate(a.allocate(block_bytes, legacy));
  }
  CHECK(cudasim::calls("cudaStreamGetId") == ids);
  CHECK(cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cudaGetDevice") == devices);
  // The raw handle of a gpukit::stream is found in gpukit's table of live streams: no CUDA call either.
  a.deallocate(a.allocate(block_bytes, gpukit::stream_view(cuda0, s.cuda_handle())));
  CHECK(cudasim::calls("cudaStreamGetId") == ids);
  // Another raw handle is looked up on each call (cudaStreamGetId): a gpukit::stream avoids that.
  const cudaStream_t foreign = create_raw_stream(cuda0);
  a.deallocate(a.allocate(block_bytes, gpukit::stream_view(cuda0, foreign)));  // first seen: registered
  const std::size_t foreign_ids = cudasim::calls("cudaStreamGetId");
  a.deallocate(a.allocate(block_bytes, gpukit::stream_view(cuda0, foreign)));
  CHECK(cudasim::calls("cudaStreamGetId") == foreign_ids + 1);
  a.deallocate(keep_s);
  a.deallocate(keep_legacy);
  CHECK(cudaStreamDestroy(foreign) == cudaSuccess);
}

// --- (11) a buffer that outlives its stream ---

TEST_CASE("streams: freeing a buffer whose stream was destroyed warns, and the memory waits for that stream's work") {
  for (bool cross_stream_reuse : {false, true}) {
    CAPTURE(cross_stream_reuse);
    gpukit::allocator_options o = keep_segments();
    o.cross_stream_reuse = cross_stream_reuse;
    gate g;
    gpukit::caching_allocator a(cuda0, o);
    gpukit::device_buffer<char> buffer;
    open_at_exit release{&g};
    cudaStream_t old_handle = nullptr;
    {
      gpukit::stream A(cuda0);
      old_handle = A.cuda_handle();
      g.hold(A);
      buffer = gpukit::device_buffer<char>(block_bytes, A, a);
    }  // A is destroyed while `buffer` is live: a bug in the program, which gpukit must not make worse
    void* const p = buffer.data();
    gpukit::stream B(cuda0);
    REQUIRE(B.cuda_handle() == old_handle);
    {
      captured_warnings warnings;
      buffer.reset();
      CHECK(warnings.contains("was destroyed"));
      char text[32];
      std::snprintf(text, sizeof text, "%p", p);
      CHECK(warnings.contains(text));
      CHECK(warnings.contains("4096 bytes"));
    }
    void* q = a.allocate(block_bytes, B);
    CHECK(q != p);
    CHECK(stream_idle(B.cuda_handle()));  // and B was not made to wait for A's held-back work
    g.open();
    cudasim::drain_all();
    gpukit::stream C(cuda0);
    void* r = a.allocate(block_bytes, C);
    CHECK(r == p);
    a.deallocate(r);
    a.deallocate(q);
  }
}

// --- (9) record_stream with a stream of another device ---

TEST_CASE("streams: record_stream with a stream of another device holds the block until that stream's work is done") {
  gate g;
  gate g2;
  gpukit::caching_allocator a(cuda0, keep_segments());
  gpukit::stream owner(cuda0);
  gpukit::stream peer(cuda1);
  open_at_exit release{&g, &g2};
  void* p = a.allocate(block_bytes, owner);
  g.hold(peer);  // a peer copy reading p would run on `peer` after the gate
  a.record_stream(p, peer);
  a.deallocate(p);
  void* q = a.allocate(block_bytes, owner);
  CHECK(q != p);
  g.open();
  peer.synchronize();
  void* r = a.allocate(block_bytes, owner);
  CHECK(r == p);
  // deallocate(p, stream) of another device works the same way.
  g2.hold(peer);
  a.deallocate(r, peer);
  void* s = a.allocate(block_bytes, owner);
  CHECK(s != p);
  g2.open();
  peer.synchronize();
  void* t = a.allocate(block_bytes, owner);
  CHECK(t == p);
  for (void* x : {q, s, t}) a.deallocate(x);
}

// --- (5) per-thread default streams and the special handles ---

TEST_CASE("streams: cudaStreamPerThread is a different stream in each thread, for the allocator too") {
  gate g;
  gpukit::caching_allocator a(cuda0, keep_segments());
  const gpukit::stream_view per_thread(cudaStreamPerThread);
  open_at_exit release{&g};
  void* keep = nullptr;
  void* p = nullptr;
  std::thread([&] {
    g.hold(per_thread);  // this thread's per-thread stream
    keep = a.allocate(block_bytes, per_thread);
    p = a.allocate(block_bytes, per_thread);
    a.deallocate(p);
  }).join();
  void* q = nullptr;
  std::thread([&] { q = a.allocate(block_bytes, per_thread); }).join();
  CHECK(q != p);
  g.open();
  cudasim::drain_all();
  a.deallocate(q);
  a.deallocate(keep);
}

TEST_CASE("streams: a per-thread stream's block freed on another thread is fenced after the first thread's work") {
  gpukit::allocator_options o = keep_segments();
  o.cross_stream_reuse = true;  // frees record a fence on the block's stream
  gate g;
  gpukit::caching_allocator a(cuda0, o);
  const gpukit::stream_view per_thread(cudaStreamPerThread);
  open_at_exit release{&g};
  void* keep = nullptr;
  void* p = nullptr;
  std::thread([&] {
    keep = a.allocate(block_bytes, per_thread);
    p = a.allocate(block_bytes, per_thread);
    g.hold(per_thread);  // work of that thread that still uses p
  }).join();
  a.deallocate(p);  // on this thread: its cudaStreamPerThread is another stream
  REQUIRE(cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess);  // this thread's own work is done
  gpukit::stream other(cuda0);
  void* q = a.allocate(block_bytes, other);
  REQUIRE(q == p);  // taken across streams: `other` must wait for the first thread's work
  CHECK_FALSE(stream_idle(other.cuda_handle()));
  g.open();
  cudasim::drain_all();
  CHECK(stream_idle(other.cuda_handle()));
  a.deallocate(q);
  a.deallocate(keep);
}

TEST_CASE(
    "streams: a fenced block whose stream is destroyed and its handle reused during the free waits for its work") {
  // Another thread destroys the block's stream between the allocator's look at it and the fence's record, and a new
  // stream gets the handle (LIFO here): the fence then covers only the new stream's work. The stream counts as
  // destroyed from then on, so no other stream takes its blocks before its last work is done. (Here the next
  // allocation would notice the destruction anyway, through the expiration count; the free's own check covers an
  // allocator that read the count before it changed, which no hook can arrange.)
  gpukit::allocator_options o = keep_segments();
  o.cross_stream_reuse = true;  // frees record a fence on the block's stream
  gate g;
  gpukit::caching_allocator a(cuda0, o);
  open_at_exit release{&g};
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  void* p = a.allocate(block_bytes, *owner);
  g.hold(*owner);  // its work, which still uses p
  gpukit_test::handle_reuse_at reuse("cudaEventRecord", 1, owner);
  a.deallocate(p);
  (void)reuse.successor();  // the fence went to the new stream
  gpukit::stream other(cuda0);
  void* q = a.allocate(block_bytes, other);
  CHECK(q != p);
  g.open();
  cudasim::drain_all();
  a.deallocate(q);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a fenced block taken for another thread's per-thread stream is waited for through the legacy one") {
  // cudaStreamPerThread names the calling thread's own stream: the wait for the old stream's work cannot name the
  // other thread's stream from here, so it goes to the legacy default stream, whose work that (blocking) stream's
  // later work waits for.
  gpukit::allocator_options o = keep_segments();
  o.cross_stream_reuse = true;  // frees record a fence on the block's stream
  gate g;
  gpukit::caching_allocator a(cuda0, o);
  gpukit::stream s(cuda0);
  open_at_exit release{&g};  // before the allocator's destruction waits for the device
  void* keep = a.allocate(block_bytes, s);
  void* p = a.allocate(block_bytes, s);
  g.hold(s);  // work on s that still uses p
  a.deallocate(p);
  std::atomic<bool> resolved{false}, go{false}, recorded{false}, done{false};
  gpukit::stream_view theirs;
  std::optional<gpukit::event> after;
  std::thread other([&] {
    theirs = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved();
    resolved = true;
    while (!go && !done) std::this_thread::yield();
    if (go) {
      after.emplace(cuda0);
      after->record(theirs);  // that thread's work enqueued after the allocation
      recorded = true;
    }
    while (!done) std::this_thread::yield();  // its per-thread stream lives as long as the thread
  });
  struct finish {  // the thread ends whatever happens here
    std::atomic<bool>& done;
    std::thread& thread;
    ~finish() {
      done = true;
      thread.join();
    }
  } at_end{done, other};
  while (!resolved) std::this_thread::yield();
  void* q = a.allocate(block_bytes, theirs);  // from this thread
  REQUIRE(q == p);                            // taken across streams
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudaStreamQuery(cudaStreamLegacy) == cudaErrorNotReady);  // the legacy stream waits for s's work
  go = true;
  while (!recorded) std::this_thread::yield();
  CHECK_FALSE(after->ready());  // and so does that thread's later work
  g.open();
  cudasim::drain_all();
  CHECK(after->ready());
  a.deallocate(q);
  a.deallocate(keep);
}

TEST_CASE("streams: cudaStreamPerThread and cudaStreamLegacy of a device are used with that device current") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  for (cudaStream_t special : {cudaStreamPerThread, cudaStreamLegacy}) {
    CAPTURE(special == cudaStreamPerThread);
    const gpukit::stream_view on1(cuda1, special);
    gate g;
    open_at_exit release{&g};
    g.hold(on1);
    CHECK_FALSE(on1.ready());
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    CHECK(cudaStreamQuery(special) == cudaErrorNotReady);  // the work went to cuda:1's stream
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    CHECK(cudaStreamQuery(special) == cudaSuccess);  // not to cuda:0's
    gpukit::event e(cuda1);
    e.record(on1);
    CHECK_FALSE(e.ready());
    g.open();
    on1.synchronize();
    CHECK(e.ready());
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    CHECK(current == 0);  // restored
  }
}

TEST_CASE("streams: cudaStreamLegacy is the legacy default stream, cudaStreamPerThread is not") {
  const gpukit::stream_view legacy(cudaStreamLegacy);
  const gpukit::stream_view per_thread(cudaStreamPerThread);
  CHECK(legacy.is_default());
  CHECK(legacy == gpukit::stream_view());
  CHECK(gpukit::stream_view(cuda1, cudaStreamLegacy) == gpukit::stream_view::default_stream(cuda1));
  CHECK(per_thread.is_per_thread());
  CHECK_FALSE(legacy.is_per_thread());
  CHECK(per_thread != legacy);
  CHECK(legacy.device() == gpukit::current_device());
}

// --- (1, pinned pool) identity of recorded streams ---

TEST_CASE("streams: the pinned pool waits for a destroyed recorded stream's work and tells streams apart by id") {
  gate g;
  gate g2;
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::stream B(cuda0);
  open_at_exit release{&g, &g2};
  // A recorded stream destroyed before the free (its handle not reused): no event can be recorded on it.
  void* p = pool.allocate(block_bytes);
  {
    gpukit::stream A(cuda0);
    g.hold(A);  // a copy on A that reads p waits for the gate
    pool.record_stream(p, A);
  }  // A is destroyed: its queued work still runs (cudaStreamDestroy semantics)
  pool.record_stream(p, B);
  pool.deallocate(p);
  CHECK(pool.stats().events_recorded == 1);  // on B
  B.synchronize();
  void* q = pool.allocate(block_bytes);
  CHECK(q != p);  // p waits for A's work
  g.open();
  cudasim::drain_all();
  void* r = pool.allocate(block_bytes);
  CHECK(r == p);
  pool.deallocate(q);
  // The same, when the next stream created receives the destroyed stream's handle: it is another stream.
  cudaStream_t old_handle = nullptr;
  {
    gpukit::stream A(cuda0);
    old_handle = A.cuda_handle();
    g2.hold(A);
    pool.record_stream(r, A);
  }
  gpukit::stream C(cuda0);
  REQUIRE(C.cuda_handle() == old_handle);
  pool.record_stream(r, C);
  pool.deallocate(r);
  CHECK(pool.stats().events_recorded == 2);  // on C; none on the destroyed A
  C.synchronize();
  void* s = pool.allocate(block_bytes);
  CHECK(s != r);  // r waits for A's work, not only for C's
  g2.open();
  cudasim::drain_all();
  void* t = pool.allocate(block_bytes);
  CHECK(t == r);
  pool.deallocate(s);
  pool.deallocate(t);
  pool.empty_cache();
}

TEST_CASE("streams: the pinned pool fences a block recorded on a per-thread stream after that thread's work") {
  gate g;
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  open_at_exit release{&g};
  const gpukit::stream_view per_thread(cuda0, cudaStreamPerThread);
  void* p = pool.allocate(block_bytes);
  g.hold(per_thread);  // a copy on this thread's per-thread stream that reads p waits for the gate
  pool.record_stream(p, per_thread);
  std::thread([&] { pool.deallocate(p); }).join();  // that thread's cudaStreamPerThread is another stream
  CHECK(pool.stats().pending_blocks == 1);          // still used by this thread's per-thread stream
  g.open();
  cudasim::drain_all();
  CHECK(pool.stats().pending_blocks == 0);
  pool.empty_cache();
}

TEST_CASE("streams: wrap refuses to own any default stream, and an owned wrapped stream is tracked") {
  for (cudaStream_t special : {static_cast<cudaStream_t>(nullptr), cudaStreamLegacy, cudaStreamPerThread}) {
    CHECK_THROWS_AS(gpukit::stream::wrap(special, cuda0, true), gpukit::invalid_argument_error);
    CHECK_NOTHROW(gpukit::stream::wrap(special, cuda0, false));
  }
  std::shared_ptr<const gpukit::detail::stream_life> life;
  {
    gpukit::stream owned = gpukit::stream::wrap(create_raw_stream(cuda0), cuda0, true);
    life = owned.view().lifetime();
    REQUIRE(life.get() != nullptr);
    unsigned long long id = 0;
    REQUIRE(cudaStreamGetId(owned.cuda_handle(), &id) == cudaSuccess);
    CHECK(owned.view().id() == id);
    CHECK_FALSE(life->expired());
  }
  CHECK(life->expired());
  cudaStream_t raw = create_raw_stream(cuda0);
  CHECK(gpukit::stream::wrap(raw, cuda0, false).view().lifetime().get() == nullptr);  // borrowed: lives on elsewhere
  destroy_raw_stream(raw);
}

TEST_CASE("streams: creating streams asks the device's priority range once") {
  gpukit::stream first(cuda1);
  const std::size_t before = cudasim::calls("cudaDeviceGetStreamPriorityRange");
  for (int i = 0; i < 3; ++i) {
    gpukit::stream s(cuda1, {true, -1000});
    CHECK(s.priority() == gpukit::stream_priority_range(cuda1).greatest);
  }
  CHECK(cudasim::calls("cudaDeviceGetStreamPriorityRange") == before);
}

TEST_CASE("streams: async_allocator frees after the work of recorded streams, waiting on the device") {
  gate g;
  open_at_exit at_exit{&g};
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  gpukit::stream other(cuda0);
  void* p = a.allocate(block_bytes, s);
  const std::size_t held = a.memory_reserved();
  CHECK(held >= block_bytes);
  g.hold(other);  // work on `other` that could still read p waits for the gate
  a.record_stream(p, other);
  a.deallocate(p);  // cudaFreeAsync on s, which first waits for other's work: not the host
  CHECK(a.memory_allocated() == 0);
  CHECK(a.memory_reserved() == held);  // the pool still holds it: the free has not run
  CHECK_FALSE(stream_idle(s.cuda_handle()));
  g.open();
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);  // freed (the pool keeps the memory: gpukit raised its threshold)
  CHECK(a.max_memory_reserved() == held);
}

TEST_CASE("streams: async_allocator lists a stream recorded many times once, and never the allocation's own") {
  // A long-lived buffer recorded on each use: its free waits for each stream once, not once per record_stream.
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  gpukit::stream other(cuda0);
  void* p = a.allocate(block_bytes, s);
  for (int i = 0; i < 100; ++i) {
    a.record_stream(p, other);
    a.record_stream(p, s);
  }
  const std::size_t records = cudasim::calls("cudaEventRecord");
  const std::size_t waits = cudasim::calls("cudaStreamWaitEvent");
  a.deallocate(p);  // on s, after other's work
  CHECK(cudasim::calls("cudaEventRecord") == records + 1);
  CHECK(cudasim::calls("cudaStreamWaitEvent") == waits + 1);
  // Freed on another stream: after the allocation stream's work, once.
  void* q = a.allocate(block_bytes, s);
  for (int i = 0; i < 100; ++i) a.record_stream(q, s);
  const std::size_t records_q = cudasim::calls("cudaEventRecord");
  a.deallocate(q, other);
  CHECK(cudasim::calls("cudaEventRecord") == records_q + 1);
  cudasim::drain_all();
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("streams: async_allocator frees per-thread stream memory from another thread after that stream's work") {
  // cudaStreamPerThread names the calling thread's own stream: freed from another thread, memory allocated on this
  // thread's per-thread stream must wait for this thread's work, not for the freeing thread's stream.
  gate g;
  open_at_exit at_exit{&g};
  gpukit::async_allocator a(cuda0);
  const gpukit::stream_view per_thread(cuda0, cudaStreamPerThread);
  void* p = a.allocate(block_bytes, per_thread);
  void* q =
      a.allocate(block_bytes, gpukit::stream_view::default_stream(cuda0));  // recorded below for this thread's stream
  const std::size_t held = a.memory_reserved();
  a.record_stream(q, per_thread);
  g.hold(per_thread);  // work of this thread's per-thread stream that could still read p and q
  std::thread([&] {
    a.deallocate(p);  // on the allocating thread's stream (the legacy stream stands in for it here)
    a.deallocate(q);  // after the recorded per-thread stream's work
  }).join();
  CHECK(a.memory_allocated() == 0);
  CHECK(a.memory_reserved() == held);  // neither free has run: both wait for the held work
  g.open();
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
}

TEST_CASE("streams: async_allocator frees a destroyed stream's memory after its work, not on its handle's new owner") {
  // cudaStreamDestroy returns with the work pending, and the handle goes to the next stream created: a free on the
  // kept handle would wait for the new stream's unrelated work, or, once that is idle, run before the old work.
  gate old_work, new_work;
  open_at_exit at_exit{&old_work, &new_work};
  gpukit::async_allocator a(cuda0);
  void* p = nullptr;
  void* q = nullptr;
  cudaStream_t old_handle = nullptr;
  gpukit::stream s(cuda0);
  {
    gpukit::stream A(cuda0);
    old_handle = A.cuda_handle();
    old_work.hold(A);                // A's work, which could still read p and q
    p = a.allocate(block_bytes, A);  // freed below on its allocation stream, which is gone by then
    q = a.allocate(block_bytes, s);
    a.record_stream(q, A);  // and used by it
  }
  const std::size_t held = a.memory_reserved();
  gpukit::stream B(cuda0);
  REQUIRE(B.cuda_handle() == old_handle);  // the handle is reused
  new_work.hold(B);
  a.deallocate(p);
  a.deallocate(q);
  CHECK(a.memory_allocated() == 0);
  CHECK(a.memory_reserved() == held);  // A's work is held: neither free has run
  old_work.open();
  // Both frees run after A's work without B's: waiting for them must not need B's gate opened.
  CHECK_FALSE(new_work.opened_to_return([&] {
    gpukit::detail::synchronize_upstream_stream(cuda0, gpukit::detail::upstream_stream_use::releases);
    CHECK(cudaStreamSynchronize(s.cuda_handle()) == cudaSuccess);
    CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  }));
  new_work.open();
}

TEST_CASE("streams: async_allocator keeps a recorded stream from destruction while its free uses the handle") {
  // Another thread destroys the recorded stream while the free asks whether it is captured or records its event
  // there: on a destroyed handle (undefined in CUDA, perhaps a new stream's; the simulator reports the use) the record
  // would order nothing. The destruction waits until the free is done with the handle instead.
  struct point {
    const char* call;
    int nth;
    bool ordering_fails;
  };
  point at{"cudaEventRecord", 1, false};
  SUBCASE("its event record") {}
  SUBCASE("the question whether it is captured") { at = {"cudaStreamIsCapturing", 1, false}; }
  SUBCASE("that question after the ordering failed") {
    // Before the free, the recorded stream (1), then s (2), whether either is captured; after the failure, s (3),
    // then the recorded stream (4); then the host waits for it.
    at = {"cudaStreamIsCapturing", 4, true};
  }
  CAPTURE(at.call);
  gate old_work;
  open_at_exit at_exit{&old_work};
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  auto user = std::make_unique<gpukit::stream>(cuda0);
  void* p = a.allocate(block_bytes, s);
  a.record_stream(p, *user);
  if (!at.ordering_fails) old_work.hold(*user);  // its work, which could still read p (a host wait would not end)
  if (at.ordering_fails) cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);
  destroyed_by_another_thread destroyer(at.call, at.nth, user);
  a.deallocate(p);
  CHECK(destroyer.ran());
  CHECK_FALSE(destroyer.destroyed_during_call());  // held off until the free was done with the handle
  destroyer.join();
  CHECK(a.memory_allocated() == 0);
  if (!at.ordering_fails) {
    CHECK_FALSE(stream_idle(s.cuda_handle()));  // the free waits for the recorded stream's held work
    old_work.open();
  }
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  CHECK(cudasim::violations().empty());
  cudasim::clear_faults();
}

TEST_CASE("streams: async_allocator frees a destroyed stream's memory outside this thread's capture") {
  // The allocation stream destroyed, the free is made on the device's release stream after its final event: on this
  // thread's per-thread stream, being captured, cudaFreeAsync would join the capture and be refused (memory
  // allocated outside it), and an unrelated free would fail.
  gate old_work;
  open_at_exit at_exit{&old_work};
  gpukit::async_allocator a(cuda0);
  void* p = nullptr;
  {
    gpukit::stream A(cuda0);
    old_work.hold(A);  // its work, which could still read p
    p = a.allocate(block_bytes, A);
  }
  gpukit::device_guard guard(cuda0);
  REQUIRE(cudaStreamBeginCapture(cudaStreamPerThread, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK_NOTHROW(a.deallocate(p));
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(cudaStreamPerThread, &graph) == cudaSuccess);  // intact
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK_FALSE(a.owns(p));
  CHECK(a.memory_allocated() == 0);
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) >= block_bytes);  // not freed while A's work is held
  old_work.open();
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: async_allocator drops the record of memory freed behind its back when the pool hands it out") {
  // cudaFreeAsync of an allocator's pointer by someone else: the pool may give the address to the next request, and
  // the new allocation, not the stale record, is what the allocator must hold and count.
  cudasim::reuse_pool_addresses(true);
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  captured_warnings warnings;
  void* p = a.allocate(block_bytes, s);
  REQUIRE(cudaFreeAsync(p, s.cuda_handle()) == cudaSuccess);
  s.synchronize();
  void* q = a.allocate(block_bytes, s);
  REQUIRE(q == p);  // the pool reuses the address
  CHECK(warnings.contains("freed without this allocator"));
  CHECK(a.memory_allocated() == block_bytes);  // the stale record's bytes are no longer counted
  CHECK(a.stats().allocation.all().current == 1);
  a.deallocate(q);
  CHECK(a.memory_allocated() == 0);
  CHECK_FALSE(a.owns(q));
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  CHECK(cudasim::violations().empty());
  cudasim::reuse_pool_addresses(false);
}

TEST_CASE("streams: async_allocator frees on the release stream when its stream is destroyed after the free's look") {
  // Another thread destroys the allocation stream after the free saw it alive, and a new stream gets the handle (LIFO
  // here): a free enqueued on the handle would follow only the new stream's work. Under the stream's lock the free
  // sees the destruction, and the device's release stream frees after the old stream's final event instead.
  gate old_work;
  open_at_exit at_exit{&old_work};
  gpukit::async_allocator a(cuda0);
  auto s = std::make_unique<gpukit::stream>(cuda0);
  // The cudaGetDevice calls of a free: the last is its device guard, before it takes the stream's lock.
  std::size_t lookups = 0;
  for (int warm_up = 0; warm_up < 2; ++warm_up) {
    void* warm = a.allocate(block_bytes, *s);
    const std::size_t before = cudasim::calls("cudaGetDevice");
    a.deallocate(warm);
    lookups = cudasim::calls("cudaGetDevice") - before;
  }
  REQUIRE(lookups >= 1);
  cudasim::drain_all();
  void* p = a.allocate(block_bytes, *s);
  old_work.hold(*s);  // its work, which could still read p
  gpukit_test::handle_reuse_at reuse("cudaGetDevice", static_cast<int>(lookups), s);
  a.deallocate(p);
  gpukit::stream& successor = reuse.successor();
  CHECK(a.memory_allocated() == 0);
  CHECK(cudaStreamSynchronize(successor.cuda_handle()) == cudaSuccess);  // the new stream got nothing to wait for
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) >= block_bytes);           // not freed while the old work is held
  old_work.open();
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: async_allocator waits on the host for a destroyed stream whose final event it cannot wait for") {
  gate old_work;
  open_at_exit at_exit{&old_work};
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  void* p = a.allocate(block_bytes, s);
  {
    gpukit::stream A(cuda0);
    a.record_stream(p, A);
    old_work.hold(A);
  }
  const std::size_t event_waits = cudasim::calls("cudaEventSynchronize");
  const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
  cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);
  std::atomic<bool> returned{false};
  std::thread freeing([&] {
    a.deallocate(p);
    returned = true;
  });
  while (!returned && cudasim::calls("cudaEventSynchronize") == event_waits &&
         cudasim::calls("cudaDeviceSynchronize") == device_waits) {
    std::this_thread::yield();
  }
  CHECK(cudasim::calls("cudaEventSynchronize") == event_waits + 1);  // the free waits on the host for A's work
  CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);    // and only for A's
  old_work.open();
  freeing.join();
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
}

TEST_CASE("streams: async_allocator frees even when the ordering after a recorded stream cannot be enqueued") {
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  gpukit::stream other(cuda0);
  void* p = a.allocate(block_bytes, s);
  a.record_stream(p, other);
  const std::size_t host_waits = cudasim::calls("cudaStreamSynchronize");
  cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);
  a.deallocate(p);  // the device-side wait fails: the host waits for `other` instead, then frees on s
  CHECK(cudasim::calls("cudaStreamSynchronize") == host_waits + 1);
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);  // freed, not leaked
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE(
    "streams: async_allocator waits for the device when neither the ordering nor the host's wait for a stream works") {
  // The last resort of a free ordered after a recorded stream: the device-side wait fails, then so does the host's
  // wait for that stream (cudaStreamSynchronize; for the legacy stream, stream_view::synchronize's event, which
  // throws): the host waits for the whole device, and the memory is freed, not leaked.
  for (const bool legacy : {false, true}) {
    CAPTURE(legacy);
    gpukit::async_allocator a(cuda0);
    gpukit::stream s(cuda0);
    gpukit::stream other(cuda0);
    void* p = a.allocate(block_bytes, s);
    a.record_stream(p, legacy ? gpukit::stream_view(cuda0, cudaStreamLegacy) : other.view());
    const char* host_wait = legacy ? "cudaEventSynchronize" : "cudaStreamSynchronize";
    const std::size_t host_waits = cudasim::calls(host_wait);
    const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
    const std::size_t frees = cudasim::calls("cudaFreeAsync");
    cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);
    cudasim::fail_call(host_wait, 1, cudaErrorUnknown);
    captured_warnings warnings;
    CHECK_NOTHROW(a.deallocate(p));
    CHECK(cudasim::calls(host_wait) == host_waits + 1);
    CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits + 1);
    CHECK(cudasim::calls("cudaFreeAsync") == frees + 1);  // then freed on its stream
    CHECK(a.memory_allocated() == 0);
    cudasim::drain_all();
    CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
    CHECK(cudaGetLastError() == cudaSuccess);  // the failures were cleared
    CHECK(warnings.messages().empty());
    CHECK(cudasim::violations().empty());
    cudasim::clear_faults();  // if a check above failed before both fired, the next tests must not meet them
  }
}

TEST_CASE("streams: async_allocator frees after the device's work when cudaFreeAsync on the stream fails") {
  gpukit::async_allocator a(cuda0);
  gpukit::stream s(cuda0);
  void* p = a.allocate(block_bytes, s);
  captured_warnings warnings;
  cudasim::fail_call("cudaFreeAsync", 1, cudaErrorInvalidValue);
  a.deallocate(p);
  CHECK(warnings.contains("freeing it after the device's work instead"));
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
}

// The memory goes back to the pool, so its over-aligned addresses go from the table: a block that later starts at one
// is not taken for the old allocation.
TEST_CASE("streams: an async_allocator destroyed with over-aligned allocations live forgets their addresses") {
  captured_warnings warnings;
  gpukit::stream s(cuda0);
  void* p = nullptr;
  {
    gpukit::async_allocator a(cuda0);
    for (int tries = 0; tries < 8 && p == nullptr; ++tries) {  // an address the alignment shifts off its block
      void* q = a.allocate(1000, std::size_t{1} << 16, s);
      if (gpukit::detail::over_aligned_addresses().block_of(q) != q) p = q;
    }
    REQUIRE(p != nullptr);
  }
  CHECK(warnings.contains("live allocation(s)"));
  CHECK(gpukit::detail::over_aligned_addresses().block_of(p) == p);
  s.synchronize();
}

TEST_CASE("streams: an async_allocator destroyed with live allocations frees them without their (gone) streams") {
  { gpukit::stream warm(cuda0); }  // the context exists before memory is counted
  REQUIRE(cudaMemPoolTrimTo(gpukit_test::default_pool(cuda0), 0) == cudaSuccess);  // what earlier tests left kept
  const std::size_t used = cudasim::device_memory_used(0);
  captured_warnings warnings;
  {
    gpukit::async_allocator a(cuda0);
    {
      gpukit::stream s(cuda0);
      gpukit::stream other(cuda0);
      void* p = a.allocate(block_bytes, s);
      a.record_stream(p, other);
    }  // both streams destroyed: their handles may be reused, so the allocator must not use them
    gpukit::stream reuse(cuda0);  // likely to get one of the old handles back
  }
  CHECK(warnings.contains("destroyed with 1 live allocation(s)"));
  // The free was made on the legacy stream: only once the host has seen it complete may a trim give it back.
  REQUIRE(cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess);
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  REQUIRE(cudaMemPoolTrimTo(gpukit_test::default_pool(cuda0), 0) == cudaSuccess);
  CHECK(cudasim::device_memory_used(0) == used);  // and the pool gives it back when trimmed
}

TEST_CASE("streams: the caching allocator over async_pool_upstream never calls cudaMalloc or cudaFree") {
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  gpukit::stream s(cuda0);
  const std::size_t mallocs = cudasim::calls("cudaMalloc");
  const std::size_t frees = cudasim::calls("cudaFree");
  const std::size_t pool_mallocs = cudasim::calls("cudaMallocFromPoolAsync");
  const std::size_t pool_frees = cudasim::calls("cudaFreeAsync");
  void* p = a.allocate(block_bytes, s);
  void* big = a.allocate(std::size_t{64} << 20, s);
  CHECK(cudasim::calls("cudaMallocFromPoolAsync") == pool_mallocs + 2);  // a small and a large segment
  gpukit::async_allocator pool_view(cuda0);                              // reads the same default pool
  CHECK(pool_view.memory_reserved() == a.memory_reserved());
  a.deallocate(p);
  a.deallocate(big);
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  a.empty_cache();
  CHECK(cudasim::calls("cudaFreeAsync") == pool_frees + 2);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);  // in stream order: no wait for the device
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);  // back in the pool, which keeps it
  CHECK(cudasim::calls("cudaMalloc") == mallocs);
  CHECK(cudasim::calls("cudaFree") == frees);
}

TEST_CASE(
    "streams: async_pool_upstream gets segments back in stream order: empty_cache waits for nothing, and each free "
    "runs after the work its stream had queued") {
  gate g;
  {
    gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
    gpukit::stream busy(cuda0);
    gpukit::stream idle(cuda0);
    open_at_exit at_exit({&g});
    auto* p = static_cast<unsigned char*>(a.allocate(block_bytes, busy));
    void* q = a.allocate(block_bytes, idle);
    std::size_t idle_segment = 0;
    for (const auto& seg : a.snapshot().segments) {
      for (const auto& b : seg.blocks) {
        if (b.address == reinterpret_cast<std::uintptr_t>(q)) idle_segment = seg.size;
      }
    }
    REQUIRE(idle_segment > 0);
    REQUIRE(a.snapshot().segments.size() == 2);  // one per stream
    g.hold(busy);                                // work queued before the free, which still uses p once the gate opens
    busy.enqueue_host([p] { std::memset(p, 0x5a, block_bytes); });
    a.deallocate(p);
    a.deallocate(q);
    const std::size_t used = cudasim::device_memory_used(0);
    const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
    const std::size_t frees = cudasim::calls("cudaFreeAsync");
    CHECK_FALSE(g.opened_to_return([&] { a.empty_cache(); }));  // a device-wide wait would wait for the gate
    CHECK(a.memory_reserved() == 0);
    CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
    CHECK(cudasim::calls("cudaFreeAsync") == frees + 2);
    CHECK(cudasim::device_memory_used(0) + idle_segment >= used);  // the busy stream's segment is not freed yet
    g.open();
    busy.synchronize();  // the host function wrote p: the segment was still the allocator's
    cudasim::drain_all();
    gpukit::async_allocator pool_view(cuda0);
    CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);
  }
}

TEST_CASE(
    "streams: async_pool_upstream falls back to a device-wide wait when a release in stream order is not possible") {
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  gpukit::stream s(cuda0);
  const auto release_with = [&](const char* failing, cudaError_t error) {
    a.deallocate(a.allocate(block_bytes, s));
    const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
    cudasim::fail_call(failing, 1, error);
    a.empty_cache();
    CAPTURE(failing);
    CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs + 1);  // the waiting way
    CHECK(a.memory_reserved() == 0);
    cudasim::drain_all();
    CHECK(gpukit_test::pool_bytes_in_use(cuda0) == 0);  // and the segment did go back
  };
  release_with("cudaEventRecord", cudaErrorUnknown);      // no event on the stream
  release_with("cudaStreamWaitEvent", cudaErrorUnknown);  // the release stream cannot wait for it
  release_with("cudaFreeAsync", cudaErrorInvalidValue);   // the free in stream order is refused
  cudasim::clear_faults();

  // A destroyed stream whose work has completed needs no event: its segment goes back in stream order at once.
  void* live = a.allocate(block_bytes, s);
  {
    gpukit::stream gone(cuda0);
    a.deallocate(a.allocate(block_bytes, gone));
    gone.synchronize();
  }
  a.deallocate(a.allocate(block_bytes, s));  // from s's own segment; the allocator notices the destruction
  const std::size_t records = cudasim::calls("cudaEventRecord");
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  const std::size_t frees = cudasim::calls("cudaFreeAsync");
  a.trim(a.memory_allocated());  // only the destroyed stream's segment is free
  CHECK(cudasim::calls("cudaFreeAsync") == frees + 1);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
  CHECK(cudasim::calls("cudaEventRecord") == records);
  a.deallocate(live);

  // Out of memory: the segments given back in stream order are waited for before the pool is trimmed and asked again.
  a.deallocate(a.allocate(block_bytes, s));
  a.empty_cache();
  const std::size_t stream_syncs = cudasim::calls("cudaStreamSynchronize");
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorMemoryAllocation);
  void* retried = a.allocate(block_bytes, s);
  CHECK(retried != nullptr);
  // The allocation stream before trimming, the release stream, and the allocation stream once it succeeds.
  CHECK(cudasim::calls("cudaStreamSynchronize") == stream_syncs + 3);
  a.deallocate(retried);
}

TEST_CASE(
    "streams: async_pool_upstream waits for the device instead of recording on a raw handle, which may be another "
    "stream's by now") {
  gate g;
  std::atomic<bool> released{false};
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  const cudaStream_t first = create_raw_stream(cuda0);
  open_at_exit at_exit({&g});
  g.hold(gpukit::stream_view(cuda0, first));
  void* p = a.allocate(block_bytes, gpukit::stream_view(cuda0, first));
  REQUIRE(cudaMemsetAsync(p, 0x5a, block_bytes, first) == cudaSuccess);  // uses p once the gate opens
  a.deallocate(p);
  destroy_raw_stream(first);  // the allocator cannot see this
  const cudaStream_t second = create_raw_stream(cuda0);
  REQUIRE(second == first);  // an event on this handle would be on an idle stream
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  const std::size_t records = cudasim::calls("cudaEventRecord");
  std::thread opener([&] {  // the device-wide wait needs the gate open: open it once the release waits
    while (cudasim::calls("cudaDeviceSynchronize") == syncs && !released.load()) std::this_thread::yield();
    g.open();
  });
  a.empty_cache();
  released = true;
  opener.join();
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs + 1);
  CHECK(cudasim::calls("cudaEventRecord") == records);
  cudasim::drain_all();
  CHECK(cudasim::take_violations().empty());  // the memset ran before the segment was freed
  destroy_raw_stream(second);
}

TEST_CASE("streams: releasing a default stream's segment in stream order does not invalidate a capture underway") {
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  std::thread t([&] {  // another thread's per-thread default stream is reached only through the legacy stream
    const gpukit::stream_view mine(cuda0, cudaStreamPerThread);
    a.deallocate(a.allocate(block_bytes, mine));
    mine.synchronize();
  });
  t.join();
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(cuda0);
  a.deallocate(a.allocate(std::size_t{8} << 20, legacy));
  cudasim::drain_all();
  gpukit::stream blocking(cuda0, gpukit::stream_options{false, 0});
  REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  a.empty_cache();  // no work on the legacy stream: it would invalidate the capture (cudaErrorStreamCaptureImplicit)
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  CHECK(cudasim::take_violations().empty());
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("streams: a segment whose device-wide wait a raw capture refused is held back, not lost") {
  // A raw capture of a non-blocking stream is out of gpukit's sight: the release's cudaDeviceSynchronize is refused
  // (and invalidates it, in any mode). The segment is held back and given back after the capture, not leaked.
  const std::size_t base = gpukit_test::pool_bytes_in_use(cuda0);
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  cudaStream_t raw = nullptr;  // a raw handle: its segment goes back after a device-wide wait
  REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
  a.deallocate(a.allocate(std::size_t{8} << 20, gpukit::stream_view(cuda0, raw)));
  cudasim::drain_all();
  const std::size_t in_use = gpukit_test::pool_bytes_in_use(cuda0);
  REQUIRE(in_use >= base + (std::size_t{8} << 20));
  gpukit::stream captured(cuda0);
  REQUIRE(cudaStreamBeginCapture(captured.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  gpukit_test::captured_warnings warnings;
  std::thread([&] { a.empty_cache(); }).join();
  CHECK(warnings.contains("cudaDeviceSynchronize (before returning a segment to the pool)"));
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(captured.cuda_handle(), &graph) == cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  CHECK(cudasim::take_violations().size() == 1);           // the refused wait
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == in_use);  // held back
  a.empty_cache();  // the capture has ended: the held segment goes back, though the cache holds nothing
  cudasim::drain_all();
  CHECK(gpukit_test::pool_bytes_in_use(cuda0) == base);
  REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE(
    "streams: a gpukit stream destroyed while the allocator grows, its handle reused: its segment waits for its "
    "work") {
  gate g;
  std::atomic<bool> done{false};
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0, keep_segments());
  gpukit::stream other(cuda0);
  std::optional<gpukit::stream> doomed(std::in_place, cuda0);
  std::optional<gpukit::stream> fresh;
  open_at_exit at_exit({&g});
  g.hold(*doomed);
  void* p = a.allocate(block_bytes, *doomed);
  const cudaStream_t old_handle = doomed->cuda_handle();
  REQUIRE(cudaMemsetAsync(p, 0x5a, block_bytes, old_handle) == cudaSuccess);  // uses p once the gate opens
  a.deallocate(p);
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  // As another thread would, while this allocation is in the upstream (the allocator's lock released): the stream
  // is destroyed and a new one gets its handle; then the pool refuses twice, and the cache is released.
  cudasim::before_call("cudaMallocFromPoolAsync", 1, [&] {
    doomed.reset();
    fresh.emplace(cuda0);
  });
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorMemoryAllocation);
  cudasim::fail_call("cudaMallocFromPoolAsync", 2, cudaErrorMemoryAllocation);
  std::thread opener([&] {  // the device-wide wait needs the gate open: open it once the release waits
    while (cudasim::calls("cudaDeviceSynchronize") == syncs && !done.load()) std::this_thread::yield();
    g.open();
  });
  void* q = a.allocate(block_bytes, other);
  done = true;
  opener.join();
  REQUIRE(fresh.has_value());
  CHECK(fresh->cuda_handle() == old_handle);
  CHECK(cudasim::calls("cudaDeviceSynchronize") > syncs);  // the destroyed stream's segment waited for the device
  cudasim::drain_all();
  CHECK(cudasim::take_violations().empty());  // the memset ran before the segment was freed
  cudasim::clear_faults();
  a.deallocate(q);
}

TEST_CASE("streams: async_pool_upstream out of memory is retried after the cache is released, other failures throw") {
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
  gpukit::stream s(cuda0);
  void* first = a.allocate(std::size_t{4} << 20, s);
  a.deallocate(first);  // cached
  const std::size_t trims = cudasim::calls("cudaMemPoolTrimTo");
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorMemoryAllocation);
  void* p = a.allocate(std::size_t{32} << 20, s);  // refused once: the upstream trims the pool and tries again
  CHECK(p != nullptr);
  CHECK(cudasim::calls("cudaMemPoolTrimTo") == trims + 1);
  CHECK(a.stats().num_alloc_retries == 0);
  a.deallocate(p);
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorMemoryAllocation);
  cudasim::fail_call("cudaMallocFromPoolAsync", 2, cudaErrorMemoryAllocation);
  p = a.allocate(std::size_t{64} << 20, s);  // refused twice: the cache goes back to the pool, then it succeeds
  CHECK(p != nullptr);
  CHECK(a.stats().num_alloc_retries == 1);
  a.deallocate(p);
  a.empty_cache();
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorInvalidValue);
  try {
    (void)a.allocate(std::size_t{4} << 20, s);
    FAIL("an invalid-value failure of cudaMallocFromPoolAsync was not thrown");
  } catch (const gpukit::error& e) {
    CHECK(std::string(e.what()).find("cudaMallocFromPoolAsync") != std::string::npos);
  }
  void* again = a.allocate(std::size_t{4} << 20, s);  // usable afterwards
  CHECK(again != nullptr);
  a.deallocate(again);
  CHECK_THROWS_AS(gpukit::async_pool_upstream{gpukit::device::cpu()}, gpukit::invalid_argument_error);
}

TEST_CASE(
    "streams: async_pool_upstream reports a segment it cannot return, and a stream it cannot destroy, as warnings") {
  captured_warnings warnings;
  {
    gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(cuda0);
    const gpukit::stream_view s = gpukit::stream_view::default_stream(cuda0);
    a.deallocate(a.allocate(block_bytes, s));
    // The legacy default stream is not recorded on (the release waits for the device), and that wait fails.
    cudasim::fail_call("cudaDeviceSynchronize", 1, cudaErrorUnknown);
    a.empty_cache();  // the device's work cannot be waited for: the segment is not handed back, and that is said
    CHECK(warnings.contains("cudaDeviceSynchronize (before returning a segment to the pool) failed"));
    CHECK(a.memory_reserved() == 0);
    a.deallocate(a.allocate(block_bytes, s));
    cudasim::fail_call("cudaFreeAsync", 1, cudaErrorInvalidValue);
    a.empty_cache();
    CHECK(warnings.contains("cudaFreeAsync (returning a segment to the pool) failed"));
    a.deallocate(a.allocate(block_bytes, s));  // still usable
    cudasim::fail_call("cudaStreamDestroy", 1, cudaErrorInvalidResourceHandle);
  }  // the allocator returns its cache, then the upstream's destructor destroys its private stream: refused
  CHECK(warnings.contains("cudaStreamDestroy (async_pool_upstream) failed"));
  cudasim::clear_faults();
}

TEST_CASE("streams: resource_upstream keeps a segment it cannot wait for the device to be done with, and says so") {
  captured_warnings warnings;
  gpukit::caching_allocator inner(cuda0);
  const cudaStream_t raw = create_raw_stream(cuda0);
  {
    gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> outer(
        cuda0, {}, gpukit::device_memory_resource(inner), cuda0);
    const gpukit::stream_view s(cuda0, raw);  // a raw handle: its segments go back after a wait for the device
    outer.deallocate(outer.allocate(block_bytes, s));
    const std::size_t held = inner.memory_allocated();
    CHECK(held != 0);
    cudasim::fail_call("cudaDeviceSynchronize", 1, cudaErrorUnknown);
    outer.empty_cache();  // not handed back to the inner allocator while the device may still use it
    CHECK(warnings.contains("cudaDeviceSynchronize (before returning a segment to a cuda::mr resource) failed"));
    CHECK(warnings.contains("cuda:0"));
    CHECK(inner.memory_allocated() == held);
    CHECK(outer.memory_reserved() == 0);
    outer.deallocate(outer.allocate(block_bytes, s));  // still usable; this segment goes back
    outer.empty_cache();
    CHECK(inner.memory_allocated() == held);
  }
  for (const auto& segment : inner.snapshot().segments) {  // the kept segment is intact: the test gives it back
    for (const auto& block : segment.blocks) {
      if (block.state == gpukit::block_state::allocated) inner.deallocate(reinterpret_cast<void*>(block.address));
    }
  }
  CHECK(inner.memory_allocated() == 0);
  destroy_raw_stream(raw);
  cudasim::clear_faults();
}

namespace {
/// A stream-ordered cuda::mr resource over cudaMalloc that refuses (std::bad_alloc) more than `capacity` bytes out,
/// where a free in a stream's order gives the bytes back only when the stream gets to it (a host function): memory
/// given back in stream order is the resource's again once the stream's work is done, not before. The memory itself
/// is freed later, on the host (a host function may not call CUDA).
class queued_free_resource : public gpukit::detail::cccl_3_0_names<queued_free_resource, 256> {
 public:
  using cccl_3_0_names::allocate;
  using cccl_3_0_names::deallocate;

  struct state {
    explicit state(std::size_t bytes) : capacity(bytes) {}
    ~state() { free_returned(); }
    std::size_t bytes_out() {
      std::lock_guard<std::mutex> lock(mutex);
      return out;
    }
    std::size_t allocations_on_streams() {
      std::lock_guard<std::mutex> lock(mutex);
      return stream_allocations;
    }
    void free_returned() {
      std::lock_guard<std::mutex> lock(mutex);
      for (void* p : returned) (void)cudaFree(p);
      returned.clear();
    }
    std::mutex mutex;
    std::size_t capacity;
    std::size_t out = 0;  // bytes allocated and not yet given back
    std::size_t stream_allocations = 0;
    std::vector<void*> returned;  // given back, to be freed on the host
    cudaStream_t last_stream = nullptr;
    std::vector<int> malloc_devices;  // the current device at each cudaMalloc
  };

  explicit queued_free_resource(std::shared_ptr<state> s) : state_(std::move(s)) {}

  void* allocate_sync(std::size_t bytes, std::size_t /*alignment*/) { return take(bytes); }
  void deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept { give(state_.get(), p, bytes); }
  void* allocate(::cuda::stream_ref stream, std::size_t bytes, std::size_t /*alignment*/) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      ++state_->stream_allocations;
      state_->last_stream = stream.get();
    }
    return take(bytes);
  }
  void deallocate(::cuda::stream_ref stream, void* p, std::size_t bytes, std::size_t /*alignment*/) {
    struct job {
      state* st;
      void* p;
      std::size_t bytes;
    };
    auto* j = new job{state_.get(), p, bytes};
    if (cudaLaunchHostFunc(
            stream.get(),
            [](void* arg) {
              std::unique_ptr<job> done(static_cast<job*>(arg));
              give(done->st, done->p, done->bytes);
            },
            j) != cudaSuccess) {
      delete j;
      throw std::runtime_error("queued_free_resource: cudaLaunchHostFunc failed");
    }
  }
  bool operator==(const queued_free_resource& other) const noexcept { return state_ == other.state_; }
  bool operator!=(const queued_free_resource& other) const noexcept { return state_ != other.state_; }

 private:
  void* take(std::size_t bytes) {
    state_->free_returned();
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->out + bytes > state_->capacity) throw std::bad_alloc();
    void* p = nullptr;
    int current = -1;
    REQUIRE(cudaGetDevice(&current) == cudaSuccess);
    REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess);
    state_->malloc_devices.push_back(current);
    state_->out += bytes;
    return p;
  }
  static void give(state* st, void* p, std::size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(st->mutex);
    st->out -= bytes;
    st->returned.push_back(p);
  }

  std::shared_ptr<state> state_;
};
static_assert(gpukit::resource_upstream<queued_free_resource>::stream_ordered, "a stream-ordered resource");
using queued_upstream = gpukit::resource_upstream<queued_free_resource>;
static_assert(gpukit::detail::has_ordered_release<queued_upstream, gpukit::event>::value, "it frees in stream order");
}  // namespace

TEST_CASE(
    "streams: resource_upstream over a stream-ordered resource: segments come ready from the allocation stream and go "
    "back in stream order, empty_cache waits for nothing") {
  gate g;
  gpukit::async_allocator pool(cuda0);  // cudaMallocAsync: the simulator checks every use against the free's order
  {
    gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> a(
        cuda0, {}, gpukit::device_memory_resource(pool), cuda0);
    gpukit::stream busy(cuda0);
    open_at_exit at_exit({&g});
    const std::size_t syncs_before_growth = cudasim::calls("cudaStreamSynchronize");
    auto* p = static_cast<unsigned char*>(a.allocate(block_bytes, busy));
    // Allocated on gpukit's allocation stream and waited for there, not on the current (default) stream.
    CHECK(cudasim::calls("cudaStreamSynchronize") == syncs_before_growth + 1);
    CHECK(pool.memory_allocated() == a.memory_reserved());
    g.hold(busy);  // work queued before the free, which still uses p once the gate opens
    busy.enqueue_host([p] { std::memset(p, 0x5a, block_bytes); });
    a.deallocate(p);
    const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
    const std::size_t used = cudasim::device_memory_used(0);
    CHECK_FALSE(g.opened_to_return([&] { a.empty_cache(); }));  // a device-wide wait would wait for the gate
    CHECK(a.memory_reserved() == 0);
    CHECK(pool.memory_allocated() == 0);  // handed back to the resource, in stream order
    CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
    CHECK(cudasim::device_memory_used(0) == used);  // the free waits behind the gate
    g.open();
    busy.synchronize();  // the host function wrote p: the segment was still allocated
    cudasim::drain_all();
    pool.empty_cache();
    cudasim::drain_all();
    CHECK(cudasim::device_memory_used(0) < used);
  }
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("streams: resource_upstream falls back to a device-wide wait when a release in stream order is refused") {
  gpukit::async_allocator pool(cuda0);
  gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> a(
      cuda0, {}, gpukit::device_memory_resource(pool), cuda0);
  gpukit::stream s(cuda0);
  for (const char* failing : {"cudaEventRecord", "cudaStreamWaitEvent"}) {
    CAPTURE(failing);
    a.deallocate(a.allocate(block_bytes, s));
    const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
    cudasim::fail_call(failing, 1, cudaErrorUnknown);
    a.empty_cache();
    CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs + 1);  // the waiting way
    CHECK(a.memory_reserved() == 0);
    CHECK(pool.memory_allocated() == 0);  // and the segment did go back
  }
  cudasim::clear_faults();

  // A resource refusal at growth is out of memory for the caching allocator; the allocation stream is only waited for
  // when the resource served the request.
  pool.set_reserved_limit(block_bytes);
  CHECK_THROWS_AS((void)a.allocate(block_bytes, s), gpukit::out_of_memory_error);
  CHECK(a.memory_reserved() == 0);
  pool.set_reserved_limit(gpukit::allocator_options::unlimited);
  a.deallocate(a.allocate(block_bytes, s));  // usable afterwards
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE(
    "streams: resource_upstream makes its device current: growth and direct use on fresh threads stay on cuda:1") {
  cudasim::allow_contexts_only_on({1});
  const int contexts_on_0 = cudasim::context_creations(0);  // an earlier test of this process may have made it
  auto st = std::make_shared<queued_free_resource::state>(std::size_t{64} << 20);
  {
    gpukit::caching_device_allocator<queued_upstream> a(cuda1, {}, queued_free_resource(st), cuda1);
    gpukit::stream s(cuda1);
    a.deallocate(a.allocate(block_bytes, s));  // the resource calls cudaMalloc with whatever device is current
    a.empty_cache();                           // in stream order: the next growth may wait for the releases
    std::thread([&] { a.deallocate(a.allocate(std::size_t{4} << 20, s)); }).join();
    s.synchronize();
    cudasim::drain_all();
  }
  {
    queued_upstream upstream(queued_free_resource(st), cuda1);  // used directly: no gpukit call chose the device before
    std::thread([&] {
      void* p = upstream.allocate(block_bytes);
      CHECK(p != nullptr);
      upstream.deallocate(p, block_bytes);
    }).join();
  }
  {
    gpukit::device_guard guard(cuda1);
    st->free_returned();
  }
  CHECK(cudasim::context_creations(0) == contexts_on_0);
  CHECK(st->malloc_devices.size() == 3);                       // the first segment, the 4 MiB one, and the direct use
  for (int current : st->malloc_devices) CHECK(current == 1);  // cudaMalloc ran on cuda:1 every time
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE(
    "streams: resource_upstream out of memory waits for the segments given back in stream order before it gives up") {
  gate g;
  auto st = std::make_shared<queued_free_resource::state>(std::size_t{2} << 20);  // one 2 MiB segment at a time
  gpukit::caching_device_allocator<queued_upstream> a(cuda0, {}, queued_free_resource(st), cuda0);
  gpukit::stream busy(cuda0);
  gpukit::stream other(cuda0);
  open_at_exit at_exit({&g});
  a.deallocate(a.allocate(block_bytes, busy));
  CHECK(st->allocations_on_streams() == 1);
  CHECK(st->last_stream != busy.cuda_handle());  // gpukit's allocation stream
  CHECK(st->last_stream != nullptr);
  g.hold(busy);
  busy.enqueue_host([] {});
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  // The free waits behind the gate (the resource has no room yet); a device-wide wait would wait for the gate.
  REQUIRE_FALSE(g.opened_to_return([&] { a.empty_cache(); }));
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
  CHECK(a.memory_reserved() == 0);
  REQUIRE(st->bytes_out() == std::size_t{2} << 20);
  const std::size_t stream_syncs = cudasim::calls("cudaStreamSynchronize");
  std::atomic<bool> done{false};
  std::thread opener([&] {  // the wait for the releases needs the gate open: open it once the upstream waits
    while (cudasim::calls("cudaStreamSynchronize") == stream_syncs && !done.load()) std::this_thread::yield();
    g.open();
  });
  void* q = nullptr;
  try {
    q = a.allocate(block_bytes, other);  // refused once, served after the release stream was waited for
  } catch (const gpukit::out_of_memory_error& e) {
    MESSAGE(e.what());
  }
  done = true;
  opener.join();
  CHECK(q != nullptr);
  CHECK(a.stats().num_ooms == 0);
  CHECK(st->allocations_on_streams() == 3);  // asked, refused, asked again once the releases were done
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
  a.deallocate(q);
  a.empty_cache();
  cudasim::drain_all();
  CHECK(st->bytes_out() == 0);
}

namespace {
/// Allocates a segment of `a` for a raw stream handle (no event orders its release after its work, so it goes back
/// through the upstream's device-wide wait) and gives it back, on another thread during a global gpukit capture of a
/// stream of the device. The failure's message, if any.
template <class Allocator>
std::string release_unordered_segment_during_a_capture(Allocator& a, cudaStream_t raw) {
  gpukit::stream s(cuda0);
  std::string failure;
  gpukit::graph g = gpukit::capture(
      s,
      [&] {
        std::thread([&] {
          try {
            a.deallocate(a.allocate(block_bytes, gpukit::stream_view(cuda0, raw)));
            a.empty_cache();
          } catch (const std::exception& e) {
            failure = e.what();
          }
        }).join();
      },
      nullptr, gpukit::capture_mode::global);
  g.launch(s);  // the capture is intact
  s.synchronize();
  return failure;
}
}  // namespace

TEST_CASE(
    "streams: resource_upstream holds back a segment it cannot order by events while a gpukit capture runs, and gives "
    "it back with the next one after") {
  // Its fallback waits for the whole device (cudaDeviceSynchronize), which a capture refuses in relaxed mode too, and
  // which invalidates it.
  gpukit::caching_allocator inner(cuda0);
  const cudaStream_t raw = create_raw_stream(cuda0);
  {
    gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> outer(
        cuda0, {}, gpukit::device_memory_resource(inner), cuda0);
    const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
    CHECK(release_unordered_segment_during_a_capture(outer, raw) == "");
    CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
    CHECK(outer.memory_reserved() == 0);
    const std::size_t held = inner.memory_allocated();
    CHECK(held > 0);  // held back, not lost
    // The next segment given back, outside a capture, takes the held one with it.
    outer.deallocate(outer.allocate(block_bytes, gpukit::stream_view(cuda0, raw)));
    outer.empty_cache();
    CHECK(inner.memory_allocated() == 0);
    // Held at destruction: given back then.
    CHECK(release_unordered_segment_during_a_capture(outer, raw) == "");
    CHECK(inner.memory_allocated() == held);
  }
  CHECK(inner.memory_allocated() == 0);
  CHECK(cudasim::violations().empty());
  destroy_raw_stream(raw);
}

TEST_CASE(
    "streams: resource_upstream out of memory gives back the segments it held back during a capture and asks again") {
  auto st = std::make_shared<queued_free_resource::state>(std::size_t{2} << 20);  // one 2 MiB segment at a time
  const cudaStream_t raw = create_raw_stream(cuda0);
  {
    gpukit::caching_device_allocator<queued_upstream> a(cuda0, {}, queued_free_resource(st), cuda0);
    CHECK(release_unordered_segment_during_a_capture(a, raw) == "");
    CHECK(a.memory_reserved() == 0);
    REQUIRE(st->bytes_out() == std::size_t{2} << 20);  // held back: the resource has no room
    void* q = nullptr;
    try {
      q = a.allocate(block_bytes, gpukit::stream_view(cuda0, raw));
    } catch (const gpukit::out_of_memory_error& e) {
      MESSAGE(e.what());
    }
    CHECK(q != nullptr);
    CHECK(a.stats().num_ooms == 0);
    CHECK(st->bytes_out() == std::size_t{2} << 20);  // the new segment alone
    a.deallocate(q);
  }
  CHECK(st->bytes_out() == 0);
  destroy_raw_stream(raw);
}

TEST_CASE(
    "streams: async_allocator allocates for another thread's per-thread stream on the legacy stream, not on this "
    "thread's") {
  // cudaStreamPerThread names the calling thread's stream. Allocated there, the request could take memory whose free
  // is still pending on this thread's per-thread stream, with the other thread's stream not ordered after that work.
  gate g;
  gpukit::async_allocator pool(cuda0);
  gpukit::stream_view theirs;
  std::thread([&] { theirs = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved(); }).join();
  const gpukit::stream_view mine = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved();
  open_at_exit at_exit({&g});
  const std::size_t by_pool = cudasim::calls("cudaMallocFromPoolAsync");
  const std::size_t by_device = cudasim::calls("cudaMallocAsync");
  void* p = pool.allocate(4096, mine);
  g.hold(mine);
  pool.deallocate(p);  // pending on this thread's per-thread stream, behind the gate
  const std::size_t used = cudasim::device_memory_used(0);
  void* q = pool.allocate(4096, theirs);
  // New memory: the pool reuses a pending free only on the stream it is pending on (the simulator's pool, as CUDA's
  // without event dependencies), and the request was made on the legacy stream, not on this thread's per-thread one.
  CHECK(cudasim::device_memory_used(0) == used + 4096);
  // From the allocator's pool by name, not the device's current pool (which another library may have set).
  CHECK(cudasim::calls("cudaMallocFromPoolAsync") == by_pool + 2);
  CHECK(cudasim::calls("cudaMallocAsync") == by_device);
  g.open();
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  pool.deallocate(q);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(pool.memory_allocated() == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "streams: another thread's per-thread default stream cannot be synchronized, queried, recorded or waited on from "
    "this one, and nothing is enqueued") {
  // cudaStreamPerThread names the calling thread's own stream: the call would act on this thread's stream instead.
  gpukit::stream_view theirs;
  std::thread([&] { theirs = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved(); }).join();
  CHECK(theirs.is_other_threads_stream());
  const gpukit::stream_view mine = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved();
  CHECK_FALSE(mine.is_other_threads_stream());
  CHECK_FALSE(gpukit::stream_view(cuda0, cudaStreamPerThread).is_other_threads_stream());
  gpukit::event e(cuda0);
  const std::size_t records = cudasim::calls("cudaEventRecord");
  const std::size_t waits = cudasim::calls("cudaStreamWaitEvent");
  const std::size_t host_functions = cudasim::calls("cudaLaunchHostFunc");
  const std::size_t syncs = cudasim::calls("cudaStreamSynchronize");
  auto refused = [](auto call) {
    try {
      call();
    } catch (const gpukit::invalid_argument_error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  for (const std::string& message : {refused([&] { theirs.synchronize(); }), refused([&] { (void)theirs.ready(); }),
                                     refused([&] { theirs.enqueue_host([] {}); }), refused([&] { e.record(theirs); }),
                                     refused([&] { e.wait(theirs); })}) {
    INFO(message);
    CHECK(message.find("the per-thread default stream of another thread") != std::string::npos);
  }
  CHECK(cudasim::calls("cudaEventRecord") == records);
  CHECK(cudasim::calls("cudaStreamWaitEvent") == waits);
  CHECK(cudasim::calls("cudaLaunchHostFunc") == host_functions);
  CHECK(cudasim::calls("cudaStreamSynchronize") == syncs);
  // This thread's own, resolved or not, works.
  e.record(mine);
  e.wait(mine);
  mine.enqueue_host([] {});
  mine.synchronize();
  CHECK(mine.ready());
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: copy_async does not record a raw stream handle on a pooled pinned buffer's block") {
  // A raw handle may be destroyed (and its handle reused) before the buffer goes: the caller orders the buffer's
  // release itself there, as before. A gpukit stream is recorded.
  captured_warnings warnings;
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::stream s(cuda0);
  gpukit::device_buffer<int> d(1000, s);
  const cudaStream_t raw = create_raw_stream(cuda0);
  const void* first = nullptr;
  {
    gpukit::pooled_pinned_buffer<int> h(1000, pool);
    std::fill(h.begin(), h.end(), 5);
    first = h.data();
    gpukit::copy_async(d, h, gpukit::stream_view(cuda0, raw));
    REQUIRE(cudaStreamSynchronize(raw) == cudaSuccess);
    destroy_raw_stream(raw);  // before the buffer goes
  }
  CHECK(warnings.messages().empty());
  gpukit::pooled_pinned_buffer<int> again(1000, pool);
  CHECK(static_cast<const void*>(again.data()) == first);  // free at once: nothing recorded on the dead handle
  gpukit::copy_async(again, d, s);                         // a gpukit stream: recorded
  s.synchronize();
  CHECK(again[999] == 5);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: to_device of a temporary pooled pinned buffer waits for its copy only on a raw stream handle") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto filled = [&pool](int value) {
    gpukit::pooled_pinned_buffer<int> h(1000, pool);
    std::fill(h.begin(), h.end(), value);
    return h;
  };
  gpukit::stream s(cuda0);
  const cudaStream_t raw = create_raw_stream(cuda0);
  const std::size_t waits = cudasim::calls("cudaStreamSynchronize");
  auto on_gpukit_stream = gpukit::to_device(filled(3), s);  // the block is recorded on s: no wait
  CHECK(cudasim::calls("cudaStreamSynchronize") == waits);
  {
    auto on_raw = gpukit::to_device(filled(4), gpukit::stream_view(cuda0, raw));  // nothing recorded: waited for
    CHECK(cudasim::calls("cudaStreamSynchronize") == waits + 1);
    CHECK(gpukit::to_host(on_raw, s) == std::vector<int>(1000, 4));
  }  // freed on `raw`, before it goes
  CHECK(gpukit::to_host(on_gpukit_stream, s) == std::vector<int>(1000, 3));
  destroy_raw_stream(raw);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: elapsed_time of a CUDA event never recorded is invalid_argument_error, as on the CPU") {
  gpukit::stream s(cuda0);
  gpukit::event_options timed;
  timed.timing = true;
  gpukit::event a(cuda0, timed);
  gpukit::event b(cuda0, timed);
  a.record(s);
  try {
    (void)gpukit::elapsed_time(a, b);
    FAIL("no exception");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("an event was never recorded, or its handle is no longer valid") !=
          std::string::npos);
    CHECK(e.cuda_result() == cudaErrorInvalidResourceHandle);  // the CUDA result and device, for handlers
    CHECK(e.device() == 0);
  }
  b.record(s);
  CHECK(gpukit::elapsed_time(a, b).count() >= 0.0);
  CHECK(cudaGetLastError() == cudaSuccess);  // the refusal is not left as the thread's last error
}

TEST_CASE("streams: a caching allocator's reserved limit lowered during a segment's cudaMalloc is kept") {
  // Another thread (made deterministic) lowers the limit while the upstream call runs without the lock: the new
  // segment, over the limit now, goes back rather than being kept for good.
  gpukit::caching_allocator a(cuda0);
  gpukit::stream s(cuda0);
  constexpr std::size_t MiB = std::size_t{1} << 20;
  cudasim::before_call("cudaMalloc", 1, [&] { a.set_reserved_limit(64 * MiB); });
  const std::size_t frees = cudasim::calls("cudaFree");
  CHECK_THROWS_AS((void)a.allocate(200 * MiB, s), gpukit::out_of_memory_error);
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::calls("cudaFree") == frees + 1);  // the segment that came too late
  void* p = a.allocate(32 * MiB, s);               // within the limit
  CHECK(a.memory_reserved() <= 64 * MiB);
  a.deallocate(p, s);
  a.empty_cache();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: async_allocator's limit holds for a request made while another is being allocated") {
  // The first request's bytes count against the limit from its check on: a second one made before the first has its
  // memory (another thread, made deterministic) sees them.
  gpukit::async_allocator pool(cuda0);
  gpukit::stream s(cuda0);
  constexpr std::size_t limit = 1 << 20;
  pool.set_reserved_limit(limit);
  bool refused = false;
  void* q = nullptr;
  cudasim::before_call("cudaMallocFromPoolAsync", 1, [&] {
    try {
      q = pool.allocate(limit, s);
    } catch (const gpukit::out_of_memory_error& e) {
      refused = std::string(e.what()).find("being allocated by other requests") != std::string::npos;
    }
  });
  void* p = pool.allocate(limit, s);
  CHECK(refused);
  CHECK(q == nullptr);
  CHECK(pool.memory_allocated() == limit);
  pool.deallocate(p);
  // A request that fails gives its bytes back: the limit is whole again.
  cudasim::fail_call("cudaMallocFromPoolAsync", 1, cudaErrorInvalidValue);
  CHECK_THROWS_AS((void)pool.allocate(limit, s), gpukit::error);
  pool.deallocate(pool.allocate(limit, s));
  s.synchronize();
  CHECK(pool.memory_allocated() == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: async_allocator reads its pool without its lock, so a warning handler may ask for statistics") {
  // The pool's attributes are read under a device guard, whose restoring cudaSetDevice may fail and warn: a handler
  // that asks the allocator for its statistics then must not find the allocator's lock held (it would wait for ever).
  gpukit::async_allocator pool(cuda0);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  REQUIRE(cudaFree(nullptr) == cudaSuccess);  // a context on cuda:1: the guard restores it
  int warnings = 0;
  std::size_t limit_seen = 0;
  const gpukit::warning_handler previous = gpukit::set_warning_handler([&](std::string_view) {
    ++warnings;
    limit_seen = pool.stats().reserved_limit;
    (void)pool.snapshot();
  });
  cudasim::fail_call("cudaSetDevice", 2, cudaErrorInvalidValue);  // the first guard's restoring call
  const gpukit::allocator_stats stats = pool.stats();
  (void)gpukit::set_warning_handler(previous);
  CHECK(warnings == 1);
  CHECK(limit_seen == stats.reserved_limit);
  cudasim::clear_faults();
  CHECK(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: an exclusive stream given back inside a capture is leased again only once the capture ends") {
  // CUDA keeps a stream forked into a capture in it until the capture ends, joined back or not: a lease ending inside
  // the capture's work must not hand it on (the next holder's work would go into the graph), nor end its capture.
  gpukit::stream_pool pool(cuda0, 1, {}, 1);
  gpukit::stream origin(cuda0);
  captured_warnings warnings;
  void* memory = nullptr;
  REQUIRE(cudaMalloc(&memory, 64) == cudaSuccess);
  cudaStream_t leased = nullptr;
  SUBCASE("forked into gpukit::capture's work and joined back") {
    cudaEvent_t fork = nullptr;
    cudaEvent_t join = nullptr;
    REQUIRE(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess);
    gpukit::graph g = gpukit::capture(origin, [&] {
      {
        gpukit::stream_pool::lease side = pool.acquire_exclusive();
        leased = side.view().cuda_handle();
        GPUKIT_CUDA_TRY(cudaEventRecord(fork, origin.cuda_handle()));
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(leased, fork, 0));
        GPUKIT_CUDA_TRY(cudaMemsetAsync(memory, 3, 64, leased));
        GPUKIT_CUDA_TRY(cudaEventRecord(join, leased));
        GPUKIT_CUDA_TRY(cudaStreamWaitEvent(origin.cuda_handle(), join, 0));
      }  // given back inside the capture
      CHECK(pool.exclusive_in_use() == 0);
      CHECK_FALSE(pool.try_acquire_exclusive().has_value());  // still in the capture: not leased again
    });
    g.launch(origin);  // the capture ended intact
    origin.synchronize();
    unsigned char first = 0;
    REQUIRE(cudaMemcpy(&first, memory, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(first == 3);
    REQUIRE(cudaEventDestroy(fork) == cudaSuccess);
    REQUIRE(cudaEventDestroy(join) == cudaSuccess);
  }
  SUBCASE("a capture begun on the leased stream and ended after the lease") {
    {
      gpukit::stream_pool::lease lease = pool.acquire_exclusive();
      leased = lease.view().cuda_handle();
      REQUIRE(cudaStreamBeginCapture(leased, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    }
    CHECK_FALSE(pool.try_acquire_exclusive().has_value());
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamEndCapture(leased, &graph) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  }
  {
    gpukit::stream_pool::lease next = pool.acquire_exclusive();  // the capture has ended: recycled
    CHECK(next.view().cuda_handle() == leased);
    CHECK(gpukit::detail::capture_status(next.view()) == cudaStreamCaptureStatusNone);
    next.view().synchronize();
  }
  CHECK(pool.exclusive_available() == 1);
  CHECK(warnings.messages().empty());
  REQUIRE(cudaFree(memory) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "streams: an exclusive stream parked in a capture whose state cannot be read later is destroyed, not leased") {
  // Given back inside a capture, it waits in the pool; the next acquire asks again, and when that fails destroys it
  // (with a warning) rather than lease a stream that may still be in the capture. Its slot is free again.
  gpukit::stream_pool pool(cuda0, 1, {}, 1);
  captured_warnings warnings;
  cudaStream_t leased = nullptr;
  {
    gpukit::stream_pool::lease lease = pool.acquire_exclusive();
    leased = lease.view().cuda_handle();
    REQUIRE(cudaStreamBeginCapture(leased, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  }
  CHECK(pool.exclusive_available() == 0);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(leased, &graph) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(warnings.messages().empty());
  cudasim::fail_call("cudaStreamIsCapturing", 1, cudaErrorUnknown);  // the acquire's question about the parked one
  gpukit::stream_pool::lease next = pool.acquire_exclusive();        // a new stream, in the freed slot
  CHECK(warnings.contains("could not be asked whether they are being captured"));
  CHECK(pool.exclusive_in_use() == 1);
  CHECK(gpukit::detail::capture_status(next.view()) == cudaStreamCaptureStatusNone);
  CHECK_FALSE(pool.try_acquire_exclusive().has_value());  // the capacity is one: the destroyed stream left no lease
  cudasim::clear_faults();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: an exclusive stream whose capture state cannot be read when given back is destroyed, not leased") {
  gpukit::stream_pool pool(cuda0, 1, {}, 1);
  captured_warnings warnings;
  {
    gpukit::stream_pool::lease lease = pool.acquire_exclusive();
    cudasim::fail_call("cudaStreamIsCapturing", 1, cudaErrorUnknown);
  }
  CHECK(warnings.contains("could not be asked whether they are being captured"));
  CHECK(pool.exclusive_in_use() == 0);
  CHECK(pool.exclusive_available() == 0);  // destroyed: its slot is free again
  gpukit::stream_pool::lease next = pool.acquire_exclusive();
  CHECK(gpukit::detail::capture_status(next.view()) == cudaStreamCaptureStatusNone);
  cudasim::clear_faults();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a stream destroyed during its capture records no final event in the capture") {
  // Its final event would be a captured event, which no query ever sees complete: the memory it used would wait for
  // good. Without one, a wait for its work is a device synchronize.
  auto s = std::make_unique<gpukit::stream>(cuda0);
  const auto life = s->view().lifetime();  // remembered, as an allocator remembers it
  REQUIRE(cudaStreamBeginCapture(s->cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  captured_warnings warnings;
  s.reset();
  CHECK(life->expired());
  CHECK(life->final_event() == nullptr);  // none recorded in the capture
  CHECK_FALSE(life->finished());          // unknown: waited for by a device synchronize once the capture is gone
  CHECK(warnings.messages().empty());
}

TEST_CASE("streams: a pinned block whose stream left no final event is released by empty_cache") {
  // No query can tell when the stream's work is done (its final event's record failed here; a stream destroyed while
  // captured has none either): the block would stay pending for good. empty_cache synchronizes the device for it
  // (not during a gpukit capture) and releases it.
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto s = std::make_unique<gpukit::stream>(cuda0);
  const auto life = s->view().lifetime();
  void* p = pool.allocate(block_bytes);
  pool.record_stream(p, *s);
  {
    captured_warnings warnings;
    cudasim::fail_call("cudaEventRecord", 1, cudaErrorInvalidResourceHandle);
    s.reset();
    REQUIRE(warnings.contains("final event"));
  }
  REQUIRE(life->final_event() == nullptr);
  pool.deallocate(p);
  CHECK(pool.stats().pending_blocks == 1);
  CHECK_FALSE(life->finished());
  const std::size_t syncs = cudasim::calls("cudaDeviceSynchronize");
  SUBCASE("during a gpukit capture the block waits") {
    gpukit::stream c(cuda0);
    std::size_t released = 0;
    gpukit::graph g = gpukit::capture(c, [&] { released = pool.empty_cache(); });
    CHECK(released == 0);
    CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs);
    CHECK(pool.stats().pending_blocks == 1);
  }
  CHECK(pool.empty_cache() >= block_bytes);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == syncs + 1);
  CHECK(life->finished());  // known once the device was synchronized after the destruction
  CHECK(pool.stats().pending_blocks == 0);
  CHECK(pool.stats().reserved_bytes == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a failed capture-state query names the stream and its device") {
  gpukit::stream s(cuda0);
  cudasim::fail_call("cudaStreamIsCapturing", 1, cudaErrorUnknown);
  try {
    (void)gpukit::detail::capture_status(s.view());
    FAIL("no exception");
  } catch (const gpukit::cuda_error& e) {
    const std::string what = e.what();
    CHECK(e.device() == 0);
    CHECK(what.find(gpukit::detail::describe_stream(s.cuda_handle(), cuda0)) != std::string::npos);
    CHECK(what.find("cudaStreamIsCapturing(") == 0);
  }
  // A raw handle's device is not asked for (that lookup would likely fail too, hiding this error).
  const std::size_t lookups = cudasim::calls("cudaStreamGetDevice");
  cudasim::fail_call("cudaStreamIsCapturing", 1, cudaErrorUnknown);
  try {
    (void)gpukit::detail::capture_status(gpukit::stream_view(s.cuda_handle()));
    FAIL("no exception");
  } catch (const gpukit::cuda_error& e) {
    const std::string unknown_device = gpukit::detail::describe_stream(s.cuda_handle(), std::nullopt);
    CHECK(std::string(e.what()).find("cudaStreamIsCapturing(" + unknown_device + ")") == 0);
    CHECK(unknown_device.find(" of ") == std::string::npos);
    CHECK(e.cuda_result() == cudaErrorUnknown);
  }
  CHECK(cudasim::calls("cudaStreamGetDevice") == lookups);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: another thread's per-thread stream cannot be made current, and a timer on one times its own") {
  // cudaStreamPerThread names the calling thread's own stream: a view resolved on another thread cannot be named here.
  gpukit::stream_view theirs;
  std::thread([&] { theirs = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved(); }).join();
  REQUIRE(theirs.is_other_threads_stream());
  gpukit::stream s(cuda0);
  gpukit::set_current_stream(s);
  CHECK_THROWS_AS(gpukit::set_current_stream(theirs), gpukit::invalid_argument_error);
  CHECK_THROWS_AS((void)gpukit::stream_guard(theirs), gpukit::invalid_argument_error);
  CHECK(gpukit::current_stream(cuda0).native_handle() == s.cuda_handle());  // unchanged
  gpukit::set_current_stream(gpukit::stream_view::default_stream(cuda0));
  // A timer made on this thread's per-thread stream keeps that stream: stopped on another thread, it is refused
  // rather than timing that thread's own stream.
  gpukit::stream_timer timer(gpukit::stream_view(cuda0, cudaStreamPerThread));
  std::string refusal;
  std::thread([&] {
    try {
      timer.stop();
    } catch (const gpukit::invalid_argument_error& e) {
      refusal = e.what();
    }
  }).join();
  CHECK(refusal.rfind("gpukit::stream_timer::stop", 0) == 0);  // refused as another thread's stream, asking nothing
  CHECK(timer.elapsed().count() >= 0.0);                       // stopped here instead
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: history_json writes an id of gpukit's (the legacy stream named during a capture) below 2^53") {
  // gpukit's own ids carry bit 62 (own_stream_id_bit): written as they are, JSON readers that take numbers as doubles
  // read 2^62 + 1 and 2^62 + 2 as one stream (helper-184). Bit 62 moves to bit 52, above any cudaStreamGetId.
  static_assert(gpukit::detail::cuda_backend::own_stream_id_bit == std::uint64_t{1} << 62, "json_stream's bit");
  gpukit::stream blocking(cuda0, gpukit::stream_options{false, 0});
  const gpukit::device_guard current(cuda0);
  REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const unsigned long long during = gpukit::stream_view::default_stream(cuda0).id();  // gpukit's, for the process
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  REQUIRE((during & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
  gpukit::caching_allocator a(cuda0);
  auto history = std::make_shared<gpukit::memory_history>();
  a.set_memory_history(history);
  void* p = a.allocate(4096, gpukit::stream_view::default_stream(cuda0));
  const std::string json = gpukit::history_json(*history);
  a.deallocate(p);
  const std::uint64_t written = (during & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
  CHECK(json.find("\"stream\":" + std::to_string(written) + ",") != std::string::npos);
  CHECK(json.find(std::to_string(during)) == std::string::npos);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a gpukit::stream made current through its raw handle is refused once destroyed") {
  // The view made from the handle carries no record; the owner's is found by the handle, so current_stream notices
  // the destruction rather than handing out the handle, which CUDA gives the next stream created.
  std::optional<gpukit::stream> s(std::in_place, cuda0);
  const cudaStream_t handle = s->cuda_handle();
  gpukit::set_current_stream(gpukit::stream_view(cuda0, handle));
  CHECK(gpukit::current_stream(cuda0).native_handle() == handle);
  s.reset();
  const gpukit::stream next(cuda0);
  REQUIRE(next.cuda_handle() == handle);  // the simulator reuses the handle at once, as the driver may
  CHECK_THROWS_WITH_AS((void)gpukit::current_stream(cuda0), doctest::Contains("destroyed while current"),
                       gpukit::invalid_argument_error);
  // Released: the stream lives on with its caller, and stays current.
  gpukit::stream owned(cuda0);
  const cudaStream_t released_handle = owned.cuda_handle();
  gpukit::set_current_stream(released_handle);
  const cudaStream_t given = owned.release();
  CHECK(gpukit::current_stream(cuda0).native_handle() == given);
  // Wrapped with ownership again, then destroyed: refused.
  std::optional<gpukit::stream> wrapped(gpukit::stream::wrap(given, cuda0, true));
  CHECK(gpukit::current_stream(cuda0).native_handle() == released_handle);
  wrapped.reset();
  CHECK_THROWS_AS((void)gpukit::current_stream(cuda0), gpukit::invalid_argument_error);
  // A borrowed handle (no gpukit::stream owns it) is kept as it is, as before.
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreate(&raw) == cudaSuccess);
  gpukit::set_current_stream(gpukit::stream_view(cuda0, raw));
  CHECK(gpukit::current_stream(cuda0).native_handle() == raw);
  gpukit::set_current_stream(gpukit::stream_view::default_stream(cuda0));
  CHECK(cudaStreamDestroy(raw) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a default stream made current without its device stays that device's when another is current") {
  cudasim::allow_contexts_only_on({0, 1});
  for (cudaStream_t special : {cudaStreamLegacy, cudaStreamPerThread}) {
    CAPTURE(special == cudaStreamPerThread);
    {
      const gpukit::device_guard on1(cuda1);
      gpukit::set_current_stream(gpukit::stream_view(special));  // no device, as from a cuda::stream_ref
    }
    {
      const gpukit::device_guard on0(cuda0);
      const gpukit::stream_view s = gpukit::current_stream(cuda1);
      CHECK(s.device() == cuda1);
      CHECK(s.is_per_thread() == (special == cudaStreamPerThread));
      const gpukit::device_buffer<float> b(16, cuda1);  // on the current stream of cuda:1
      CHECK(b.device() == cuda1);
    }
    {
      const gpukit::device_guard on1(cuda1);
      const gpukit::stream_guard current{gpukit::stream_view(special)};
      const gpukit::device_guard on0(cuda0);  // code inside the guard's scope switches devices
      CHECK(gpukit::current_stream(cuda1).device() == cuda1);
      CHECK(gpukit::current_stream(cuda0).device() == cuda0);
    }
    CHECK(gpukit::current_stream(cuda1).device() == cuda1);  // restored as stored
    gpukit::set_current_stream(gpukit::stream_view::default_stream(cuda1));
  }
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: elapsed_time and destroying events and streams on a thread with no context enter their device") {
  // With no context current, the runtime would run these calls in a new context of cuda:0 (the simulator creates
  // none for them: tests/cudasim/README.md), so the test looks at the thread's context at each call.
  cudasim::allow_contexts_only_on({1});
  auto s = std::make_unique<gpukit::stream>(cuda1);
  gpukit::event_options timed;
  timed.timing = true;
  auto a = std::make_unique<gpukit::event>(cuda1, timed);
  auto b = std::make_unique<gpukit::event>(cuda1, timed);
  a->record(*s);
  b->record(*s);
  s->synchronize();
  struct seen {
    int context_state = -2;  // not called
    int device = -1;
  };
  seen elapsed, event_destroyed, stream_destroyed;
  const auto look = [](seen& at) {
    return [&at] {
      at.context_state = gpukit::detail::thread_context_state();
      if (cudaGetDevice(&at.device) != cudaSuccess) at.device = -1;
    };
  };
  int context_at_start = -2;
  std::thread([&] {  // a fresh thread: no context current
    context_at_start = gpukit::detail::thread_context_state();
    cudasim::before_call("cudaEventElapsedTime", 1, look(elapsed));
    cudasim::before_call("cudaEventDestroy", 1, look(event_destroyed));
    cudasim::before_call("cudaStreamDestroy", 1, look(stream_destroyed));
    (void)gpukit::elapsed_time(*a, *b);
    a.reset();
    b.reset();
    s.reset();
  })
      .join();
  CHECK(context_at_start == 0);
  for (const seen* at : {&elapsed, &event_destroyed, &stream_destroyed}) {
    CHECK(at->context_state == 1);
    CHECK(at->device == 1);
  }
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: event errors name the event's flags, and a cross-device wait both devices") {
  cudasim::fail_call("cudaEventCreateWithFlags", 1, cudaErrorInvalidValue);
  try {
    gpukit::event e(cuda0);
    FAIL("no exception");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("cudaEventCreateWithFlags(cudaEventDisableTiming)") != std::string::npos);
  }
  gpukit::stream s0(cuda0);
  gpukit::stream s1(cuda1);
  gpukit::event done(cuda0);
  done.record(s0);
  cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorInvalidValue);
  try {
    done.wait(s1);
    FAIL("no exception");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("cudaStreamWaitEvent (a stream of cuda:1, an event of cuda:0)") !=
          std::string::npos);
  }
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a view naming a gpukit::stream's handle with another device is refused at once, naming both") {
  gpukit::stream s1(cuda1);
  gpukit::stream owned0 = gpukit::stream::wrap(create_raw_stream(cuda0), cuda0, true);  // known to gpukit as well
  gpukit::event e0(cuda0);
  const std::size_t records = cudasim::calls("cudaEventRecord");
  try {
    const gpukit::stream_view wrong(cuda0, s1.cuda_handle());
    e0.record(wrong);  // unchecked, CUDA refuses the record here, far from the cause
    FAIL("no exception");
  } catch (const std::exception& ex) {
    const std::string what = ex.what();
    CHECK(dynamic_cast<const gpukit::invalid_argument_error*>(&ex) != nullptr);
    CHECK(what.find("gpukit::stream_view: ") != std::string::npos);
    CHECK(what.find("belongs to cuda:1") != std::string::npos);
    CHECK(what.find("not to cuda:0 as given") != std::string::npos);
  }
  CHECK(cudasim::calls("cudaEventRecord") == records);  // refused before any record
  CHECK_THROWS_WITH_AS(gpukit::stream_view(cuda1, owned0.cuda_handle()), doctest::Contains("belongs to cuda:0"),
                       gpukit::invalid_argument_error);
  // Named with its own device: accepted, and the check asked CUDA nothing.
  const std::size_t lookups = cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cudaGetDevice");
  const gpukit::stream_view right(cuda1, s1.cuda_handle());
  CHECK(cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cudaGetDevice") == lookups);
  CHECK(right == s1.view());
  gpukit::event e1(cuda1);
  e1.record(right);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: ipc_handle of a moved-from event names ipc_handle, whatever the event's options") {
  gpukit::event shared(cuda0, {false, false, true});
  gpukit::event shared_taker = std::move(shared);
  CHECK_THROWS_WITH_AS((void)shared.ipc_handle(), "gpukit::event::ipc_handle: use of a moved-from event",  // NOLINT
                       gpukit::invalid_argument_error);
  gpukit::event plain(cuda0);
  gpukit::event plain_taker = std::move(plain);
  CHECK_THROWS_WITH_AS((void)plain.ipc_handle(), "gpukit::event::ipc_handle: use of a moved-from event",  // NOLINT
                       gpukit::invalid_argument_error);
  CHECK_NOTHROW((void)shared_taker.ipc_handle());
  CHECK_THROWS_WITH_AS((void)plain_taker.ipc_handle(), doctest::Contains("interprocess = true"),
                       gpukit::invalid_argument_error);
}

TEST_CASE("streams: a stream pool destroyed while a stream given back to it is captured leaves that capture intact") {
  captured_warnings warnings;
  cudaStream_t handle = nullptr;
  {
    gpukit::stream_pool pool(cuda0, 1, {}, 1);
    gpukit::stream_pool::lease lease = pool.acquire_exclusive();
    handle = lease.view().cuda_handle();
    REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    {
      gpukit::stream_pool::lease ended = std::move(lease);
    }  // given back while captured: kept from the next lease until the capture ends
    CHECK(pool.exclusive_in_use() == 0);
  }  // the pool goes first
  CHECK(warnings.contains("still being captured: left undestroyed"));
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);  // the capture was not broken
  CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);  // the handle was left to the program
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a default stream becomes a cuda::stream_ref only where its handle names it") {
  // A stream_ref holds only the handle, and a default stream's handle names the current device's stream of the
  // calling thread: cuda:1's default stream, converted while cuda:0 is current, would have been cuda:0's.
  const gpukit::stream_view theirs_default = gpukit::stream_view::default_stream(cuda1);
  const gpukit::device_guard on_cuda0(cuda0);
  try {
    const ::cuda::stream_ref ref = theirs_default;
    (void)ref;
    FAIL("converted");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("the default stream of cuda:1 while cuda:0 is current") != std::string::npos);
  }
  CHECK_THROWS_AS((void)gpukit::to_stream_ref(theirs_default), gpukit::invalid_argument_error);
  {
    const gpukit::device_guard on_cuda1(cuda1);
    const ::cuda::stream_ref ref = theirs_default;
    CHECK(ref.get() == theirs_default.cuda_handle());
  }
  // Another thread's per-thread stream, resolved there, is refused too; created streams convert anywhere.
  gpukit::stream_view other_thread;
  std::thread([&] { other_thread = gpukit::stream_view(cuda0, cudaStreamPerThread).resolved(); }).join();
  CHECK_THROWS_AS((void)gpukit::to_stream_ref(other_thread), gpukit::invalid_argument_error);
  gpukit::stream created(cuda1);
  const ::cuda::stream_ref ref = created;
  CHECK(ref.get() == created.cuda_handle());
  CHECK(gpukit::to_stream_ref(created.view()).get() == created.cuda_handle());
}

// CUDA refuses cudaStreamGetDevice, cudaStreamGetId and cudaStreamGetFlags of a stream being captured, and invalidates
// the capture (measured on an H200; the simulator refuses them too): a raw handle named during a capture (a
// cuda::stream_ref given to a memory resource) must be looked up without them.
TEST_CASE("streams: a raw handle of a gpukit::stream is named during its capture without asking CUDA") {
  gpukit::stream s(cuda1);  // not the current device: its device must not come from cudaGetDevice
  const cudaStream_t handle = s.cuda_handle();
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const std::size_t asked =
      cudasim::calls("cudaStreamGetId") + cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cudaStreamGetFlags");
  const gpukit::stream_view raw(handle);
  CHECK(raw.device() == cuda1);
  CHECK(raw.id() == s.view().id());
  CHECK(raw == s.view());
  CHECK(raw.resolved().id() == s.view().id());
  CHECK(cudasim::calls("cudaStreamGetId") + cudasim::calls("cudaStreamGetDevice") +
            cudasim::calls("cudaStreamGetFlags") ==
        asked);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);  // intact
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a stream gpukit did not create gets an id of gpukit's while captured, and its own outside") {
  const cudaStream_t handle = create_raw_stream(cuda1);
  unsigned long long cuda_id = 0;
  REQUIRE(cudaStreamGetId(handle, &cuda_id) == cudaSuccess);
  CHECK(gpukit::stream_view(handle).id() == cuda_id);
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeGlobal) == cudaSuccess);
  const gpukit::stream_view raw(handle);
  CHECK(raw.device() == cuda1);  // from the driver (cuStreamGetCtx, cuCtxGetDevice)
  const unsigned long long captured_id = raw.id();
  CHECK(captured_id != cuda_id);
  CHECK((captured_id & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
  CHECK(captured_id == gpukit::stream_view(handle).id());  // the same for the whole capture
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(gpukit::stream_view(handle).id() == cuda_id);
  // A later capture of the same handle (which a new stream may have by then) gets another id.
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeGlobal) == cudaSuccess);
  const unsigned long long next_capture_id = gpukit::stream_view(handle).id();
  CHECK(next_capture_id != captured_id);
  CHECK(next_capture_id != cuda_id);
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "streams: without the driver's answer, a raw stream's device is asked of the runtime, never during its capture") {
  const cudaStream_t handle = create_raw_stream(cuda1);
  const gpukit::device_guard current(cuda0);
  cudasim::fail_call("cuStreamGetCtx", 1, cudaErrorUnknown);
  CHECK(gpukit::stream_view(handle).device() == cuda1);  // from cudaStreamGetDevice
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  cudasim::fail_call("cuStreamGetCtx", 1, cudaErrorUnknown);
  try {
    (void)gpukit::stream_view(handle).device();
    FAIL("no error");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("being captured") != std::string::npos);
  }
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);  // intact: cudaStreamGetDevice was not asked
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  cudasim::clear_faults();
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a released stream leaves gpukit's table of live streams, so its handle's next stream is its own") {
  gpukit::stream s(cuda0);
  const unsigned long long old_id = s.view().id();
  const cudaStream_t handle = s.release();
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  const cudaStream_t reused = create_raw_stream(cuda0);
  REQUIRE(reused == handle);
  CHECK(gpukit::stream_view(reused).id() != old_id);
  CHECK(cudaStreamDestroy(reused) == cudaSuccess);
}

TEST_CASE("streams: views and the current stream made before release() outlive the released stream object") {
  // Found by review: the views pointed at the object's record, freed with it (ASan: heap-use-after-free).
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  const gpukit::stream_view before = owner->view();
  const unsigned long long id = before.id();
  const std::weak_ptr<const gpukit::detail::stream_life> record = before.lifetime();
  gpukit::stream_guard current(*owner);
  const cudaStream_t handle = owner->release();
  owner.reset();
  REQUIRE_FALSE(record.expired());  // kept by handle while the stream lives
  CHECK_FALSE(before.destroyed());
  CHECK(before.id() == id);
  before.synchronize();
  CHECK(gpukit::current_stream(cuda0).native_handle() == handle);

  // Wrapped with ownership again: the same record, so the old views see this owner's destruction.
  auto again = std::make_unique<gpukit::stream>(gpukit::stream::wrap(handle, cuda0, true));
  CHECK(again->view().lifetime().get() == record.lock().get());
  const std::shared_ptr<const gpukit::detail::stream_life> held = record.lock();
  again.reset();
  CHECK(held->expired());
  CHECK(before.destroyed());
  CHECK_THROWS_AS((void)gpukit::current_stream(cuda0), gpukit::invalid_argument_error);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a released stream wrapped again while captured keeps its record for the views made before") {
  // While captured, the stream's id is not asked (gpukit gives it one of its own), so its record cannot be matched:
  // it stays until the new owner destroys the stream (found by review: it was dropped as another stream's, and the
  // views read freed memory).
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  const gpukit::stream_view before = owner->view();
  const std::weak_ptr<const gpukit::detail::stream_life> record = before.lifetime();
  gpukit::stream_guard current(*owner);
  const cudaStream_t handle = owner->release();
  owner.reset();
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  auto again = std::make_unique<gpukit::stream>(gpukit::stream::wrap(handle, cuda0, true));
  CHECK_FALSE(record.expired());
  CHECK_FALSE(before.destroyed());
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(gpukit::current_stream(cuda0).native_handle() == handle);
  again.reset();  // destroys the stream, and with it the record
  CHECK(record.expired());
  CHECK_THROWS_AS((void)gpukit::current_stream(cuda0), gpukit::invalid_argument_error);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: records of one released stream, with ids from before and during a capture, all stay") {
  // An id given while the stream is captured is gpukit's and compares with no other (found by review: a release during
  // the capture dropped the earlier release's record, and a wrap after it the record released during the capture,
  // while the stream lived).
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  const gpukit::stream_view first = owner->view();
  const std::weak_ptr<const gpukit::detail::stream_life> first_record = first.lifetime();
  const cudaStream_t handle = owner->release();
  owner.reset();
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  auto during = std::make_unique<gpukit::stream>(gpukit::stream::wrap(handle, cuda0, true));
  const std::weak_ptr<const gpukit::detail::stream_life> second_record = during->view().lifetime();
  REQUIRE(during->release() == handle);
  during.reset();
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK_FALSE(first_record.expired());
  CHECK_FALSE(second_record.expired());
  {
    gpukit::stream after = gpukit::stream::wrap(handle, cuda0, true);  // takes the first record back
    CHECK(after.view().lifetime().get() == first_record.lock().get());
    CHECK_FALSE(second_record.expired());
  }  // destroys the stream: every record of the handle goes
  CHECK(first_record.expired());
  CHECK(second_record.expired());
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: the holders of a released stream's record learn of its destruction by a later owner") {
  // An owner that cannot take the record back (it wrapped the stream while captured) destroys the stream: the record
  // is dropped and marked destroyed, so an allocator holding it, or a current stream, learns it (found by review: they
  // went on naming the handle, soon another stream's).
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  const std::shared_ptr<const gpukit::detail::stream_life> held = owner->view().lifetime();  // as an allocator does
  gpukit::stream_guard current(*owner);
  const cudaStream_t handle = owner->release();
  owner.reset();
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  auto again = std::make_unique<gpukit::stream>(gpukit::stream::wrap(handle, cuda0, true));
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK_FALSE(held->expired());
  const std::uint64_t expirations = gpukit::detail::stream_expirations().load();
  again.reset();
  CHECK(held->expired());
  CHECK(gpukit::detail::stream_expirations().load() > expirations);
  CHECK_THROWS_AS((void)gpukit::current_stream(cuda0), gpukit::invalid_argument_error);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a released stream's record is dropped when its handle goes to a new stream") {
  auto owner = std::make_unique<gpukit::stream>(cuda0);
  const std::weak_ptr<const gpukit::detail::stream_life> record = owner->view().lifetime();
  const cudaStream_t handle = owner->release();
  owner.reset();
  REQUIRE_FALSE(record.expired());
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  gpukit::stream reused(cuda0);  // the simulator hands the handle out again
  REQUIRE(reused.cuda_handle() == handle);
  CHECK(record.expired());
  CHECK(reused.view().lifetime().get() != nullptr);

  // A released stream destroyed outside gpukit, its handle then wrapped (another stream): a new record.
  const unsigned long long reused_id = reused.view().id();
  const std::weak_ptr<const gpukit::detail::stream_life> second = reused.view().lifetime();
  const cudaStream_t again = reused.release();
  CHECK(cudaStreamDestroy(again) == cudaSuccess);
  const cudaStream_t raw = create_raw_stream(cuda0);
  REQUIRE(raw == again);
  REQUIRE_FALSE(second.expired());
  gpukit::stream adopted = gpukit::stream::wrap(raw, cuda0, true);
  CHECK(second.expired());
  CHECK(adopted.view().id() != reused_id);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a handle of a destroyed gpukit::stream is looked up anew, not in the table of live streams") {
  auto doomed = std::make_unique<gpukit::stream>(cuda0);
  const cudaStream_t handle = doomed->cuda_handle();
  const unsigned long long old_id = doomed->view().id();
  doomed.reset();
  const cudaStream_t reused = create_raw_stream(cuda0);  // the simulator hands the handle out again
  REQUIRE(reused == handle);
  unsigned long long new_id = 0;
  REQUIRE(cudaStreamGetId(reused, &new_id) == cudaSuccess);
  CHECK(new_id != old_id);
  CHECK(gpukit::stream_view(reused).id() == new_id);
  CHECK(cudaStreamDestroy(reused) == cudaSuccess);
}

TEST_CASE("streams: the per-thread default stream named first during its capture keeps one id on its thread") {
  std::thread([] {
    const gpukit::device_guard current(cuda0);
    REQUIRE(cudaStreamBeginCapture(cudaStreamPerThread, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    const unsigned long long during = gpukit::stream_view(cudaStreamPerThread).id();  // no cudaStreamGetId
    CHECK((during & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
    CHECK_FALSE(gpukit::stream_view(cudaStreamPerThread).resolved().is_other_threads_stream());
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(cudaStreamPerThread, &graph) == cudaSuccess);
    if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
    CHECK(gpukit::stream_view(cudaStreamPerThread).id() == during);  // kept for this thread and device
    CHECK(cudasim::violations().empty());
  }).join();
}

TEST_CASE("streams: the legacy stream's id first needed during a blocking capture is gpukit's, for the process") {
  // The id is kept for the process: each test case runs in a process of its own (tests/cudasim/sim_main.cpp), so
  // no earlier test has looked it up (CUDASIM_IN_PROCESS, which runs them in one, would fail this test).
  gpukit::stream blocking(cuda1, gpukit::stream_options{false, 0});
  const gpukit::device_guard current(cuda1);
  REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  const unsigned long long during = gpukit::stream_view::default_stream(cuda1).id();  // no cudaStreamGetId
  CHECK((during & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);  // intact
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  unsigned long long on_other_thread = 0;
  std::thread([&] { on_other_thread = gpukit::stream_view::default_stream(cuda1).id(); }).join();
  CHECK(on_other_thread == during);  // one id for the legacy stream in the whole process
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a blocking capture begun just before the legacy stream's id is asked gives gpukit's id, for good") {
  // The legacy stream is not captured when gpukit checks (cudaStreamIsCapturing), but another thread begins a blocking
  // capture with the raw runtime before the id's question, which joins that capture and fails (as on an H200). That
  // capture is lost (its end says so); the id is one of gpukit's, kept for the process, and the failure is not left
  // as the last error. Needs a process of its own, as the test before (no earlier lookup of the legacy stream's id).
  gpukit::stream blocking(cuda1, gpukit::stream_options{false, 0});
  const gpukit::device_guard current(cuda1);
  cudasim::before_call("cudaStreamGetId", 1, [&] {
    REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  });
  const unsigned long long id = gpukit::stream_view::default_stream(cuda1).id();
  CHECK((id & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudasim::take_violations().size() == 1);  // the id's question, refused
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaErrorStreamCaptureInvalidated);
  CHECK(graph == nullptr);
  (void)cudaGetLastError();
  CHECK(gpukit::stream_view::default_stream(cuda1).id() == id);  // not asked again
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: during a gpukit capture of a blocking stream the legacy stream's id is gpukit's, asked of no one") {
  // gpukit's own captures are counted: the id is not asked of CUDA while one of a blocking stream of the device runs
  // (the question would join it), nor can one begin between the capture check and the question. Needs a process of
  // its own (no earlier lookup of the legacy stream's id).
  gpukit::stream blocking(cuda1, gpukit::stream_options{false, 0});
  unsigned long long during = 0;
  std::size_t questions = 0;
  gpukit::graph g = gpukit::capture(blocking.view(), [&] {
    const std::size_t before = cudasim::calls("cudaStreamIsCapturing") + cudasim::calls("cudaStreamGetId");
    during = gpukit::stream_view::default_stream(cuda1).id();
    questions = cudasim::calls("cudaStreamIsCapturing") + cudasim::calls("cudaStreamGetId") - before;
  });
  CHECK(questions == 0);
  CHECK((during & gpukit::detail::cuda_backend::own_stream_id_bit) != 0);
  std::thread([&] { CHECK(gpukit::stream_view::default_stream(cuda1).id() == during); }).join();  // for the process
  g.launch(blocking.view());
  blocking.synchronize();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: gpukit::capture of a raw handle already captured refuses without invalidating that capture") {
  const cudaStream_t handle = create_raw_stream(cuda0);
  const gpukit::device_guard current(cuda0);
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK_THROWS_AS(gpukit::capture(gpukit::stream_view(handle), [] {}), gpukit::error);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHECK(cudaStreamIsCapturing(handle, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);
  for (const cudasim::violation& v : cudasim::take_violations()) {
    INFO(v.call << ": " << v.message);
    CHECK(v.call == "cudaStreamBeginCapture");  // refused; no question asked of the captured stream
  }
}

TEST_CASE("streams: a pinned pool keeps a recorded stream from destruction while its free uses the handle") {
  // Another thread destroys the recorded stream while the pool asks whether it is captured or records its event
  // there: on the destroyed handle the call fails (the block was lost, or stayed allocated for good). The destruction
  // waits until the pool is done with the handle instead, and the block waits for the stream's work.
  struct point {
    const char* call;
    bool after_captures;  // deallocate_after_captures (~pooled_pinned_buffer) rather than deallocate
  };
  point at{"cudaEventRecord", false};
  SUBCASE("deallocate: its event record") {}
  SUBCASE("deallocate: the question whether it is captured") { at = {"cudaStreamIsCapturing", false}; }
  SUBCASE("deallocate_after_captures: its event record") { at = {"cudaEventRecord", true}; }
  SUBCASE("deallocate_after_captures: the question whether it is captured") { at = {"cudaStreamIsCapturing", true}; }
  CAPTURE(at.call);
  CAPTURE(at.after_captures);
  gate g;
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto s = std::make_unique<gpukit::stream>(cuda0);
  open_at_exit at_exit{&g};
  g.hold(*s);  // the work that uses the block
  void* p = pool.allocate(4096);
  pool.record_stream(p, *s);
  destroyed_by_another_thread destroyer(at.call, 1, s);
  if (at.after_captures) {
    CHECK_NOTHROW(pool.deallocate_after_captures(p));
  } else {
    CHECK_NOTHROW(pool.deallocate(p));
  }
  CHECK(destroyer.ran());
  CHECK_FALSE(destroyer.destroyed_during_call());  // held off until the pool was done with the handle
  destroyer.join();
  CHECK_FALSE(pool.is_allocated(p));
  gpukit::pinned_pool_stats st = pool.stats();
  CHECK(st.lost_blocks == 0);
  CHECK(st.active_blocks == 0);
  CHECK(st.pending_blocks == 1);  // until the destroyed stream's held work has run
  void* q = pool.allocate(4096);
  CHECK(q != p);
  g.open();
  cudasim::drain_all();
  pool.deallocate(q);
  st = pool.stats();
  CHECK(st.pending_blocks == 0);
  CHECK(st.free_blocks == 2);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a graph pool keeps the allocation's stream from destruction while a free without one asks it") {
  // A free without a stream is made on the allocation's (device_buffer's destructor frees so): the pool asks whether
  // that stream is captured, then records its event there. Another thread destroying the stream in between left the
  // question on a destroyed handle; the destruction waits until the pool is done with it instead.
  const char* call = "cudaStreamIsCapturing";
  SUBCASE("the question whether it is captured") {}
  SUBCASE("its event record") { call = "cudaEventRecord"; }
  CAPTURE(call);
  gate g;
  auto pool = gpukit::graph_pool::create(cuda0, 1 << 20);
  auto s = std::make_unique<gpukit::stream>(cuda0);
  open_at_exit at_exit{&g};
  void* p = pool->allocate(4096, *s);
  g.hold(*s);  // the work that uses the block
  destroyed_by_another_thread destroyer(call, 1, s);
  CHECK_NOTHROW(pool->deallocate(p));
  CHECK(destroyer.ran());
  CHECK_FALSE(destroyer.destroyed_during_call());  // held off until the pool was done with the handle
  destroyer.join();
  g.open();
  cudasim::drain_all();
  CHECK(pool->memory_allocated() == 0);
  CHECK(cudasim::violations().empty());
}

// --- ownership of wrapped handles, leases that outlive their pool, errors on raw handles, use at exit ---

TEST_CASE("streams: wrap refuses to own a handle a gpukit::stream owns already, naming the handle and its device") {
  // Two owners would both destroy the handle: the second time perhaps after CUDA gave it to a new stream.
  gpukit::stream owner(cuda1);
  const cudaStream_t handle = owner.cuda_handle();
  cudaStream_t raw = create_raw_stream(cuda1);
  gpukit::stream adopted = gpukit::stream::wrap(raw, cuda1, true);
  for (const cudaStream_t owned : {handle, raw}) {
    try {
      (void)gpukit::stream::wrap(owned, cuda1, true);
      FAIL("no exception");
    } catch (const gpukit::invalid_argument_error& e) {
      const std::string what = e.what();
      CHECK(what.find(gpukit::detail::describe_stream(owned, cuda1)) != std::string::npos);
      CHECK(what.find("owned by a gpukit::stream already") != std::string::npos);
      CHECK(e.device() == 1);
    }
    CHECK_NOTHROW(gpukit::stream::wrap(owned, cuda1, false));  // borrowing it is fine
  }
  CHECK(owner.owns_handle());
  CHECK(gpukit::detail::cuda_backend::find_created_stream(handle).has_value());
  CHECK(stream_idle(handle));
  CHECK(stream_idle(raw));
  CHECK(cudasim::violations().empty());  // nothing destroyed twice
}

TEST_CASE("streams: a lease that outlives its pool destroys its stream when it ends, and the pool warns") {
  captured_warnings warnings;
  auto pool = std::make_unique<gpukit::stream_pool>(cuda0, 1, gpukit::stream_options{}, 2);
  std::optional<gpukit::stream_pool::lease> late = pool->acquire_exclusive();
  { gpukit::stream_pool::lease ended = pool->acquire_exclusive(); }  // recycled: a stream the pool holds
  const std::shared_ptr<const gpukit::detail::stream_life> life = late->view().lifetime();
  REQUIRE(life.get() != nullptr);
  pool.reset();
  CHECK(warnings.contains("destroyed with 1 exclusive lease(s) still out"));
  CHECK_FALSE(life->expired());
  late->view().synchronize();                           // still usable until the lease ends
  gpukit::stream_pool::lease moved = std::move(*late);  // and movable
  late.reset();                                         // the moved-from lease: nothing to end
  CHECK_FALSE(life->expired());
  { gpukit::stream_pool::lease ended = std::move(moved); }  // destroyed, with no pool to give it back to
  CHECK(life->expired());
  CHECK(warnings.messages().size() == 1);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a lease that outlives its pool while its stream is captured leaves that capture intact") {
  captured_warnings warnings;
  auto pool = std::make_unique<gpukit::stream_pool>(cuda0, 1, gpukit::stream_options{}, 1);
  std::optional<gpukit::stream_pool::lease> late = pool->acquire_exclusive();
  const cudaStream_t handle = late->view().cuda_handle();
  pool.reset();
  REQUIRE(cudaStreamBeginCapture(handle, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  late.reset();
  CHECK(warnings.contains("ended after its pool while its stream is still being captured: left undestroyed"));
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(handle, &graph) == cudaSuccess);  // the capture was not broken
  CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaStreamDestroy(handle) == cudaSuccess);  // the handle was left to the program
  CHECK(cudasim::violations().empty());
}

TEST_CASE("streams: a failed call on a raw stream handle names the handle, and its device where gpukit knows it") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);  // a context is current: a raw handle's device is not looked up
  const cudaStream_t raw = create_raw_stream(cuda1);
  const gpukit::stream_view view(raw);
  const std::string unknown_device = gpukit::detail::describe_stream(raw, std::nullopt);
  const std::size_t lookups = cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cuStreamGetCtx");
  cudasim::fail_call("cudaStreamSynchronize", 1, cudaErrorUnknown);
  try {
    view.synchronize();
    FAIL("no exception");
  } catch (const gpukit::cuda_error& e) {
    CHECK(std::string(e.what()).find("cudaStreamSynchronize(" + unknown_device + ") failed: ") == 0);
    CHECK(e.device() == -1);
  }
  cudasim::fail_call("cudaLaunchHostFunc", 1, cudaErrorUnknown);
  try {
    view.enqueue_host([] {});
    FAIL("no exception");
  } catch (const gpukit::cuda_error& e) {
    CHECK(std::string(e.what()).find("cudaLaunchHostFunc(" + unknown_device + ") failed: ") == 0);
  }
  // Not asked of CUDA on the failure path (a handle a call refused would likely fail that lookup too).
  CHECK(cudasim::calls("cudaStreamGetDevice") + cudasim::calls("cuStreamGetCtx") == lookups);
  // On a thread without a context the device was looked up to enter it (ready() asks nothing before): named.
  std::thread([&] {
    cudasim::fail_call("cudaStreamQuery", 1, cudaErrorUnknown);
    try {
      (void)view.ready();
      FAIL("no exception");
    } catch (const gpukit::cuda_error& e) {
      const std::string expected =
          "cudaStreamQuery(" + gpukit::detail::describe_stream(raw, cuda1) + ") failed on cuda:1: ";
      CHECK(std::string(e.what()).find(expected) == 0);
      CHECK(e.device() == 1);
    }
  }).join();
  // A gpukit::stream's handle: its device is known without asking.
  gpukit::stream owned(cuda1);
  cudasim::fail_call("cudaStreamSynchronize", 1, cudaErrorUnknown);
  try {
    gpukit::stream_view(owned.cuda_handle()).synchronize();
    FAIL("no exception");
  } catch (const gpukit::cuda_error& e) {
    const std::string expected =
        "cudaStreamSynchronize(" + gpukit::detail::describe_stream(owned.cuda_handle(), cuda1) + ") failed on cuda:1";
    CHECK(std::string(e.what()).find(expected) == 0);
    CHECK(e.device() == 1);
  }
  destroy_raw_stream(raw);
  CHECK(cudasim::violations().empty());
}

namespace {
// The at-exit child below: what main saw, for its atexit handler to compare with.
const gpukit::device_properties* properties_in_main = nullptr;
gpukit::priority_range range_in_main;

/// Run at exit, after the statics constructed in main were destroyed: reads what properties() and
/// stream_priority_range() cached in main, and makes their first entries for cuda:1 through a default pool's first
/// stream. Were the caches destroyed, that is a use after free (AddressSanitizer reports it; without it, the cached
/// entries read back wrong or the heap is corrupted).
void use_device_state_at_exit() {
  try {
    const bool same_properties = &gpukit::properties(cuda0) == properties_in_main;
    const gpukit::priority_range range = gpukit::stream_priority_range(cuda0);
    const bool same_range = range.least == range_in_main.least && range.greatest == range_in_main.greatest;
    const bool named = !gpukit::properties(cuda1).name.empty();
    gpukit::stream_view pooled = gpukit::default_stream_pool(cuda1).next();
    pooled.synchronize();
    gpukit::stream s(cuda0);
    s.synchronize();
    if (!same_properties || !same_range || !named) {
      std::fprintf(stderr, "at exit: properties %s, priority range %s, cuda:1's name %s\n",
                   same_properties ? "same" : "differ", same_range ? "same" : "differs", named ? "read" : "empty");
      std::_Exit(1);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "at exit: %s\n", e.what());
    std::_Exit(1);
  }
}
}  // namespace

// Run only as the child of the test below (GPUKIT_STREAMS_AT_EXIT set); skipped, so ctest does not list it.
TEST_CASE("streams: at-exit child" * doctest::skip()) {
  if (std::getenv("GPUKIT_STREAMS_AT_EXIT") == nullptr) return;
  // Registered before the caches are made: exit runs the handler after their destruction, were they destroyed.
  REQUIRE(std::atexit(use_device_state_at_exit) == 0);
  properties_in_main = &gpukit::properties(cuda0);
  range_in_main = gpukit::stream_priority_range(cuda0);
  gpukit::stream s(cuda0);  // the first stream: constructs the priority-range cache
  s.synchronize();
}

TEST_CASE("streams: properties, priority ranges and default pools serve code that runs at exit") {
  const gpukit_test::child_result child =
      gpukit_test::run_test_case_in_child("GPUKIT_STREAMS_AT_EXIT=1", "streams: at-exit child");
  CHECK(child.status == 0);
  CHECK(child.stderr_text.empty());
  if (!child.stderr_text.empty()) MESSAGE(child.stderr_text);
}
