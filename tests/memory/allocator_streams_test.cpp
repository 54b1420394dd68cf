// Stream-ordered reuse, with real CPU streams (asynchronous queues held back by gates) and with the deterministic
// fake: a block freed while another stream still uses it is not handed out before that stream's work completes;
// cross-stream reuse makes the new stream wait on the device, not the host; host memory is not returned to the
// upstream while a CPU stream may still use it; events are pooled and polled, never waited for on the hot path.
#include "allocator_support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace gpukit_test;
using namespace std::chrono_literals;

namespace {

const gpukit::device cpu = gpukit::device::cpu();
using host_allocator = gpukit::basic_caching_allocator<gpukit::host_upstream>;

class event_log {
 public:
  void add(std::string entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back(std::move(entry));
  }
  std::vector<std::string> entries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> entries_;
};

/// Two fake streams and an allocator over an address space that reuses blocks across streams (recording fences:
/// this upstream does not synchronize on free).
struct cross_stream_setup {
  cross_stream_setup() { a.stream_operations().world = &world; }
  static gpukit::allocator_options options() {
    gpukit::allocator_options o;
    o.cross_stream_reuse = true;
    return o;
  }
  fake_world world;
  const fake_stream s0{world.add_stream()};
  const fake_stream s1{world.add_stream()};
  gpukit::basic_caching_allocator<gpukit::address_space_upstream, fake_stream_ops> a{cpu, options(), GiB};
};

}  // namespace

TEST_CASE("a block freed while another CPU stream still uses it is not reused before that work completes") {
  gpukit::allocator_options heap_only;
  heap_only.front_cache = false;  // y, freed on `owner`, would be kept in front for the last request
  host_allocator a(cpu, heap_only);
  gpukit::stream owner(cpu);
  gpukit::stream user(cpu);
  gate g;
  std::atomic<bool> user_done{false};
  constexpr std::size_t n = 64 * KiB;
  auto* x = static_cast<unsigned char*>(a.allocate(n, owner));
  user.enqueue_host([&] {
    g.wait();
    std::memset(x, 7, n);  // the other stream writes the block long after the host freed it
    user_done = true;
  });
  a.record_stream(x, user);
  a.deallocate(x);
  CHECK(a.memory_allocated() == 0);
  CHECK(a.stats().active.all().current == 1);  // freed, but pending on `user`
  auto* y = static_cast<unsigned char*>(a.allocate(n, owner));
  CHECK(y != x);  // not handed out while `user` is held back by the gate
  a.deallocate(y);
  for (int i = 0; i < 100; ++i) {  // polling at allocation never hands it out early, and never blocks
    void* z = a.allocate(n, owner);
    CHECK(z != x);
    a.deallocate(z);
  }
  CHECK_FALSE(user_done.load());
  g.open();
  user.synchronize();
  auto* z = static_cast<unsigned char*>(a.allocate(n, owner));
  CHECK(z == x);  // reused once the work completed
  CHECK(z[0] == 7);
  CHECK(z[n - 1] == 7);
  CHECK(a.stats().num_sync_all_streams == 0);
  a.deallocate(z);
}

TEST_CASE("without record_stream a freed block is reused at once on its own stream (stream order makes it safe)") {
  host_allocator a(cpu);
  gpukit::stream owner(cpu);
  gate g;
  void* x = a.allocate(4096, owner);
  owner.enqueue_host([&] { g.wait(); });
  a.deallocate(x);
  void* y = a.allocate(4096, owner);
  CHECK(y == x);  // later work on `owner` runs after the earlier work that used x
  g.open();
  owner.synchronize();
  a.deallocate(y);
}

TEST_CASE("deallocate(p, stream) orders the free after that stream's work too") {
  host_allocator a(cpu);
  gpukit::stream owner(cpu);
  gpukit::stream last_user(cpu);
  gate g;
  void* x = a.allocate(4096, owner);
  last_user.enqueue_host([&] { g.wait(); });
  a.deallocate(x, last_user);
  void* y = a.allocate(4096, owner);
  CHECK(y != x);
  g.open();
  last_user.synchronize();
  void* z = a.allocate(4096, owner);
  CHECK(z == x);
  a.deallocate(y);
  a.deallocate(z);
}

TEST_CASE("cross-stream reuse: the new stream waits for the old stream's work, the host does not") {
  gpukit::allocator_options o;
  o.cross_stream_reuse = true;
  host_allocator a(cpu, o);
  gpukit::stream first(cpu);
  gpukit::stream second(cpu);
  gate g;
  event_log log;
  auto* x = static_cast<int*>(a.allocate(4096, first));
  first.enqueue_host([&] {
    g.wait();
    x[0] = 42;
    log.add("first wrote");
  });
  a.deallocate(x);
  const auto start = std::chrono::steady_clock::now();
  auto* y = static_cast<int*>(a.allocate(4096, second));
  CHECK(std::chrono::steady_clock::now() - start < 2s);  // no host wait for `first`
  CHECK(y == x);
  second.enqueue_host([&] { log.add("second read " + std::to_string(y[0])); });
  std::this_thread::sleep_for(50ms);
  CHECK(log.entries().empty());  // `second` is held back until `first`'s work is done
  g.open();
  second.synchronize();
  first.synchronize();
  CHECK(log.entries() == std::vector<std::string>{"first wrote", "second read 42"});
  a.deallocate(y);
}

TEST_CASE("without cross-stream reuse a block cached for another stream is not taken") {
  host_allocator a(cpu, gpukit::allocator_options::pytorch());  // keeps the other stream's cache (no release)
  gpukit::stream first(cpu);
  gpukit::stream second(cpu);
  void* x = a.allocate(4096, first);
  a.deallocate(x);
  void* y = a.allocate(4096, second);
  CHECK(y != x);
  CHECK(a.stats().segment.all().current == 2);
  a.deallocate(y);
}

namespace {
/// Host memory that notes whether a segment was returned while a stream's work on it was still outstanding.
struct observed_upstream {
  explicit observed_upstream(std::atomic<bool>* work_done) : done(work_done) {}
  void* allocate(std::size_t bytes) { return host.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (!done->load()) early_frees.fetch_add(1);
    host.deallocate(p, bytes);
  }
  gpukit::upstream_memory_info memory_info() const { return host.memory_info(); }
  bool synchronizes_on_free() const noexcept { return false; }
  gpukit::host_upstream host;
  std::atomic<bool>* done;
  std::atomic<int> early_frees{0};
};
}  // namespace

TEST_CASE("host memory is not returned while a CPU stream still uses it: empty_cache waits for the work") {
  std::atomic<bool> done{false};
  gpukit::basic_caching_allocator<observed_upstream> a(cpu, gpukit::allocator_options{}, &done);
  gpukit::stream s(cpu);
  gate g;
  constexpr std::size_t n = 256 * KiB;
  auto* x = static_cast<unsigned char*>(a.allocate(n, s));
  s.enqueue_host([&] {
    g.wait();
    std::memset(x, 1, n);  // would be a use after free (ASan) if the segment were returned early
    done = true;
  });
  a.deallocate(x);  // stream-ordered: legal while the work is pending
  auto emptied = std::async(std::launch::async, [&] { a.empty_cache(); });
  CHECK(emptied.wait_for(100ms) == std::future_status::timeout);  // blocked on the stream's work
  CHECK(a.upstream().early_frees.load() == 0);
  g.open();
  emptied.get();
  CHECK(a.upstream().early_frees.load() == 0);
  CHECK(a.memory_reserved() == 0);
  CHECK(a.upstream().host.used() == 0);
}

TEST_CASE("a fence event is recorded only when the freeing stream may still be busy, and is pooled") {
  struct unsynchronized_space : gpukit::address_space_upstream {
    using gpukit::address_space_upstream::address_space_upstream;
    bool synchronizes_on_free() const noexcept { return false; }
  };
  fake_world world;
  const fake_stream s{world.add_stream()};
  gpukit::basic_caching_allocator<unsynchronized_space, fake_stream_ops> a(cpu, gpukit::allocator_options{}, GiB);
  a.stream_operations().world = &world;
  void* p = a.allocate(1000, s);
  a.deallocate(p);  // the stream is idle: nothing can still use the block
  CHECK(world.events_created == 0);
  for (int i = 0; i < 500; ++i) {
    p = a.allocate(1000, s);
    world.enqueue(s.id);  // work on the block
    a.deallocate(p);      // the stream may still be using it: fence
  }
  CHECK(world.events_created <= 2);  // pooled: two events circulate (the remainder keeps the older fence)
  CHECK(world.synchronizations == 0);
  a.empty_cache();  // waits for the fence before returning the memory
  CHECK(world.synchronizations == 1);
  CHECK(world.streams[0].completed == world.streams[0].enqueued);
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("record_stream events are pooled and polled at allocation, never waited for on the host") {
  fake_world world;
  const fake_stream s0{world.add_stream()};
  const fake_stream s1{world.add_stream()};
  gpukit::basic_caching_allocator<gpukit::address_space_upstream, fake_stream_ops> a(cpu, gpukit::allocator_options{},
                                                                                     GiB);
  a.stream_operations().world = &world;
  void* first = nullptr;
  for (int i = 0; i < 1000; ++i) {
    void* p = a.allocate(8192, s0);
    if (i == 0) first = p;
    world.enqueue(s1.id);
    a.record_stream(p, s1);
    a.deallocate(p);
    if (i % 2 == 1) world.complete(s1.id);  // every other round the user stream catches up
  }
  CHECK(world.events_created <= 2);
  CHECK(world.synchronizations == 0);
  CHECK(a.stats().num_sync_all_streams == 0);
  world.complete(s1.id);
  CHECK(a.allocate(8192, s0) == first);  // everything came back and coalesced
  CHECK(check_invariants(a.snapshot(), {{reinterpret_cast<std::uintptr_t>(first), 8192}}, 512) == "");
  a.deallocate(first);
}

TEST_CASE("record_stream with several streams: the block returns only when all of them complete") {
  fake_world world;
  const fake_stream s0{world.add_stream()};
  const fake_stream s1{world.add_stream()};
  const fake_stream s2{world.add_stream()};
  gpukit::allocator_options heap_only;
  heap_only.front_cache = false;  // y, freed on s0, would be kept in front for the last request
  gpukit::basic_caching_allocator<gpukit::address_space_upstream, fake_stream_ops> a(cpu, heap_only, GiB);
  a.stream_operations().world = &world;
  void* x = a.allocate(4000, s0);
  world.enqueue(s1.id);
  world.enqueue(s2.id);
  a.record_stream(x, s1);
  a.record_stream(x, s2);
  a.record_stream(x, s1);  // recorded once
  a.record_stream(x, s0);  // its own stream: nothing to do
  a.deallocate(x);
  auto snapshot = a.snapshot();
  REQUIRE(snapshot.segments.size() == 1);
  CHECK(snapshot.segments[0].blocks[0].state == gpukit::block_state::pending);
  CHECK(snapshot.segments[0].blocks[0].pending_events == 2);
  CHECK(snapshot.segments[0].blocks[0].requested == 4000);  // still the user's until its streams are done
  world.complete(s1.id);
  void* y = a.allocate(4096, s0);
  CHECK(y != x);
  a.deallocate(y);
  world.complete(s2.id);
  void* z = a.allocate(4096, s0);
  CHECK(z == x);
  a.deallocate(z);
}

TEST_CASE("cross-stream reuse with the fake: the taker waits for the fence, the remainder stays with its stream") {
  cross_stream_setup f;
  fake_world& world = f.world;
  const fake_stream s0 = f.s0;
  const fake_stream s1 = f.s1;
  auto& a = f.a;
  void* x = a.allocate(4096, s0);
  world.enqueue(s0.id, 3);
  a.deallocate(x);  // s0 busy: fence at point 3
  void* y = a.allocate(1024, s1);
  CHECK(y == x);
  REQUIRE(world.waits.size() == 1);
  CHECK(world.waits[0].waiting_stream == s1.id);
  CHECK(world.waits[0].event_stream == s0.id);
  CHECK(world.waits[0].point == 3);
  const auto snapshot = a.snapshot();
  REQUIRE(snapshot.segments.size() == 1);
  const auto& blocks = snapshot.segments[0].blocks;
  REQUIRE(blocks.size() == 2);
  CHECK(blocks[0].stream == a.stream_operations().key(s1));
  CHECK(blocks[1].stream == a.stream_operations().key(s0));  // the rest of the segment is still s0's
  a.deallocate(y);  // its free neighbour belongs to s0: no merge across streams
  CHECK(a.snapshot().segments[0].blocks.size() == 2);
  void* z = a.allocate(1024, s0);  // s0 prefers its own cache: the remainder
  CHECK(z != y);
  CHECK(world.waits.size() == 1);
  a.deallocate(z);
  CHECK(check_invariants(a.snapshot(), {}, 512) == "");
}

TEST_CASE("a free racing its busy stream's destruction records no event on the destroyed stream") {
  // deallocate asks whether the stream was destroyed, then whether it is busy, before it takes the lock. Destroyed
  // after either question, the stream must not be recorded on (a destroyed CUDA stream's handle may already be
  // another stream's): the block waits for the stream's last work instead, and no other stream takes it before that
  // work has completed.
  for (const bool after_busy_question : {false, true}) {
    CAPTURE(after_busy_question);
    cross_stream_setup f;
    fake_world& world = f.world;
    const fake_stream doomed = f.s0;
    const fake_stream other = f.s1;
    auto& a = f.a;
    void* p = a.allocate(4096, doomed);
    world.enqueue(doomed.id, 2);
    // The first question is answered "alive"; the stream is destroyed right after it, or right after the second,
    // which is answered "busy".
    if (after_busy_question) {
      world.after_pending_query = [&] { world.destroy(doomed.id); };
    } else {
      world.after_expired_query = [&] { world.destroy(doomed.id); };
    }
    const captured_warnings warnings;
    CHECK_NOTHROW(a.deallocate(p));  // recording on the destroyed stream threw here
    CHECK(world.streams[static_cast<std::size_t>(doomed.id)].destroyed);
    CHECK(warnings.contains("was destroyed while the allocation was live"));
    void* q = a.allocate(4096, other);
    CHECK(q != p);  // the destroyed stream's work has not completed
    a.deallocate(q);
    CHECK(check_invariants(a.snapshot(), {}, 512) == "");
    world.complete(doomed.id);
    a.empty_cache();  // the block is free once that work has completed: every segment goes back
    CHECK(a.memory_reserved() == 0);
  }
}
TEST_CASE("a destroyed CPU stream's cached blocks go to no stream, and the allocator forgets the stream") {
  host_allocator a(cpu);
  void* x = nullptr;
  {
    gpukit::stream s(cpu);
    x = a.allocate(64 * KiB, s);
    a.deallocate(x);  // cached for s
    CHECK(a.stream_count() == 1);
  }  // a CPU stream waits for its work when destroyed: the block is unused from now on
  {
    gpukit::stream t(cpu);
    void* y = a.allocate(64 * KiB, t);
    CHECK(y == x);  // no new segment: the block belongs to no stream any more
    const auto snapshot = a.snapshot();
    CHECK(check_invariants(snapshot, {{reinterpret_cast<std::uintptr_t>(y), 64 * KiB}}, a.options().rounding) == "");
    a.deallocate(y);
  }
  CHECK(a.stats().num_device_alloc == 1);
  for (int i = 0; i < 1000; ++i) {
    gpukit::stream u(cpu);
    a.deallocate(a.allocate(64 * KiB, u));
  }
  CHECK(a.stream_count() <= 128);
  CHECK(a.stats().num_device_alloc == 1);  // every stream reused the first segment
}

TEST_CASE("freeing a CPU buffer after its stream was destroyed is reported, naming the allocation and the stream") {
  host_allocator a(cpu);
  void* x = nullptr;
  {
    gpukit::stream s(cpu);
    x = a.allocate(1000, s);
  }
  captured_warnings warnings;
  a.deallocate(x);
  CHECK(warnings.contains("1000 bytes"));
  CHECK(warnings.contains("a CPU stream (id "));
  CHECK(warnings.contains("was destroyed while the allocation was live"));
  CHECK(a.memory_allocated() == 0);
}

// Issue 12, defect 4: CUDA's default stream is not the CPU's. A CPU allocator refuses it as a stream of another
// device, naming both, before asking CUDA anything (so also on a machine without a driver), and changes nothing.
TEST_CASE("a CPU allocator refuses CUDA's default stream as a stream of another device") {
  host_allocator a(cpu);
  const auto cpu_default = gpukit::stream_view::default_stream(cpu);
  const auto cuda_default = gpukit::stream_view::default_stream(gpukit::device::cuda(0));
  void* p = a.allocate(1000, cpu_default);
  auto message_of = [](auto&& call) {
    try {
      call();
    } catch (const gpukit::invalid_argument_error& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("wrong exception type: ") + e.what();
    }
    return std::string("no exception");
  };
  for (const std::string& m :
       {message_of([&] { a.deallocate(p, cuda_default); }), message_of([&] { a.record_stream(p, cuda_default); }),
        message_of([&] { (void)a.allocate(1000, cuda_default); })}) {
    INFO(m);
    CHECK(m.find("a stream of cuda:0 was passed to the caching allocator of cpu") != std::string::npos);
  }
  CHECK(a.owns(p));
  CHECK(a.memory_allocated() == 1024);
  a.deallocate(p, cpu_default);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("a stream whose first allocation grows the heap keeps its state while streams are registered meanwhile") {
  // address_space_upstream that runs `during_allocate` once, inside the next allocate (which the allocator calls
  // without its lock): what other threads may do while a segment is requested, made deterministic.
  struct hooked_upstream : gpukit::address_space_upstream {
    using address_space_upstream::address_space_upstream;
    [[nodiscard]] void* allocate(std::size_t bytes) {
      if (during_allocate) std::exchange(during_allocate, nullptr)();
      return address_space_upstream::allocate(bytes);
    }
    std::function<void()> during_allocate;
  };
  fake_world world;
  gpukit::basic_caching_allocator<hooked_upstream, fake_stream_ops> a(cpu, {}, 1 * GiB);
  a.stream_operations().world = &world;
  const fake_stream first{world.add_stream()};
  std::vector<void*> others;
  a.upstream().during_allocate = [&] {
    // 70 registrations: the 64th sweeps the registry of idle stream states, which `first` is until it holds a block.
    for (int i = 0; i < 70; ++i) others.push_back(a.allocate(256, fake_stream{world.add_stream()}));
  };
  void* p = a.allocate(4 * MiB, first);
  REQUIRE(others.size() == 70);
  const gpukit::allocator_snapshot snapshot = a.snapshot();
  bool found = false;
  for (const auto& seg : snapshot.segments) {
    for (const auto& b : seg.blocks) {
      if (b.address != reinterpret_cast<std::uintptr_t>(p)) continue;
      found = true;
      CHECK(b.stream == a.stream_operations().key(first));  // its state survived the sweep
    }
  }
  CHECK(found);
  a.deallocate(p);
  void* again = a.allocate(4 * MiB, first);  // from first's own cache
  CHECK(again == p);
  a.deallocate(again);
  for (void* q : others) a.deallocate(q);
  world.complete_all();
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
}
