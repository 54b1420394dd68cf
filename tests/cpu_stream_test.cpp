// Streams and events of the CPU device: a real in-order asynchronous queue, events that complete when the work
// before them has, cross-stream waits, timing, pools, the current-stream guard and misuse.
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>

#include "support.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
const gpukit::device cpu = gpukit::device::cpu();

using gpukit_test::gate;
}  // namespace

TEST_CASE("a CPU stream runs work asynchronously, in order") {
  gpukit::stream s(cpu);
  CHECK(s.device() == cpu);
  CHECK(s.ready());
  gate g;
  std::vector<int> order;
  s.enqueue_host([&] { g.wait(); });
  for (int i = 0; i < 100; ++i) s.enqueue_host([&order, i] { order.push_back(i); });
  CHECK_FALSE(s.ready());  // held back by the gate: the enqueue did not run the work
  CHECK(order.empty());
  g.open();
  s.synchronize();
  CHECK(s.ready());
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("each producer thread's work keeps its order on a shared CPU stream") {
  gpukit::stream s(cpu);
  constexpr int producers = 4;
  constexpr int per_producer = 2000;
  std::vector<std::vector<int>> seen(producers);
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < per_producer; ++i)
        s.enqueue_host([&seen, p, i] { seen[static_cast<std::size_t>(p)].push_back(i); });
    });
  }
  for (auto& t : threads) t.join();
  s.synchronize();
  for (int p = 0; p < producers; ++p) {
    const auto& v = seen[static_cast<std::size_t>(p)];
    REQUIRE(v.size() == per_producer);
    bool in_order = true;
    for (int i = 0; i < per_producer; ++i) in_order = in_order && v[static_cast<std::size_t>(i)] == i;
    CHECK(in_order);
  }
}

TEST_CASE("an event completes exactly when the work before its record has completed") {
  gpukit::stream s(cpu);
  gpukit::event e(cpu);
  CHECK(e.ready());  // never recorded: complete, as in CUDA
  gate g;
  std::atomic<bool> before{false};
  std::atomic<bool> after_started{false};
  s.enqueue_host([&] {
    g.wait();
    before = true;
  });
  e.record(s);
  gate hold_after;
  s.enqueue_host([&] {
    after_started = true;
    hold_after.wait();
  });
  CHECK_FALSE(e.ready());
  g.open();
  e.synchronize();
  CHECK(before.load());
  CHECK(e.ready());  // complete although later work is still held back
  hold_after.open();
  s.synchronize();
  CHECK(after_started.load());
}

TEST_CASE("re-recording an event tracks the most recent record") {
  gpukit::stream a(cpu);
  gpukit::stream b(cpu);
  gpukit::event e(cpu);
  gate g;
  b.enqueue_host([&] { g.wait(); });
  e.record(a);
  a.synchronize();
  CHECK(e.ready());
  e.record(b);  // now captures b's blocked work
  CHECK_FALSE(e.ready());
  g.open();
  e.synchronize();
  CHECK(e.ready());
}

TEST_CASE("a stream waiting on an event does not run later work before the event completes") {
  gpukit::stream producer(cpu);
  gpukit::stream consumer(cpu);
  gpukit::event produced(cpu);
  gate g;
  std::atomic<int> value{0};
  std::atomic<int> observed{-1};
  producer.enqueue_host([&] {
    g.wait();
    value = 42;
  });
  produced.record(producer);
  produced.wait(consumer);
  consumer.enqueue_host([&] { observed = value.load(); });
  std::this_thread::sleep_for(20ms);
  CHECK(observed.load() == -1);  // the consumer is held back by the event, not by the host
  g.open();
  consumer.synchronize();
  CHECK(observed.load() == 42);
}

TEST_CASE("a wait captures the record at the time of the call") {
  gate g;  // outlives the streams: the producer's worker may still be leaving g.wait() when the test ends
  gpukit::stream producer(cpu);
  gpukit::stream consumer(cpu);
  gpukit::event e(cpu);
  e.record(producer);
  producer.synchronize();
  e.wait(consumer);  // the event is complete now: the wait is a no-op
  producer.enqueue_host([&] { g.wait(); });
  e.record(producer);  // a later record must not hold back the earlier wait
  std::atomic<bool> ran{false};
  consumer.enqueue_host([&] { ran = true; });
  consumer.synchronize();
  CHECK(ran.load());
  g.open();
}

TEST_CASE("the CPU default stream runs work synchronously on the calling thread") {
  const auto s = gpukit::stream_view::default_stream(cpu);
  CHECK(s.is_cpu());
  CHECK(s.is_default());
  std::thread::id ran_on;
  s.enqueue_host([&] { ran_on = std::this_thread::get_id(); });
  CHECK((ran_on == std::this_thread::get_id()));
  gpukit::event e(cpu);
  e.record(s);
  CHECK(e.ready());
  gpukit::stream other(cpu);
  gate g;
  other.enqueue_host([&] { g.wait(); });
  e.record(other);
  std::thread opener([&] {
    std::this_thread::sleep_for(10ms);
    g.open();
  });
  e.wait(s);  // blocks the calling thread, which is the default stream
  CHECK(e.ready());
  opener.join();
  s.synchronize();
  CHECK(s.ready());
}

TEST_CASE("event timing measures the stream's time") {
  gpukit::stream s(cpu);
  gpukit::event start(cpu, {true, false, false});
  gpukit::event end(cpu, {true, false, false});
  start.record(s);
  s.enqueue_host([] { std::this_thread::sleep_for(30ms); });
  end.record(s);
  const auto ms = gpukit::elapsed_time(start, end);
  CHECK(ms.count() >= 29.0f);
  CHECK(ms.count() < 5000.0f);
  gpukit::stream_timer timer(s);
  s.enqueue_host([] { std::this_thread::sleep_for(10ms); });
  CHECK(timer.elapsed().count() >= 9.0f);
}

TEST_CASE("event timing misuse is reported") {
  gpukit::event untimed(cpu);
  gpukit::event timed(cpu, {true, false, false});
  gpukit::event timed2(cpu, {true, false, false});
  CHECK_THROWS_WITH_AS(gpukit::elapsed_time(untimed, timed),
                       doctest::Contains("the start event was not created with event_options::timing"),
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(gpukit::elapsed_time(timed, untimed), doctest::Contains("the end event was not"),
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(gpukit::elapsed_time(timed, timed2), doctest::Contains("must have been recorded"),
                       gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::event(cpu, {false, false, true}), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::event(cpu, {true, false, true}), gpukit::invalid_argument_error);
}

TEST_CASE("an event from another device is rejected") {
  gpukit::event e(cpu);
  const gpukit::stream_view cuda_stream(gpukit::device::cuda(0), nullptr);  // no CUDA call until used
  CHECK_THROWS_WITH_AS(e.record(cuda_stream),
                       "gpukit::event::record: the event belongs to cpu but the stream to cuda:0",
                       gpukit::invalid_argument_error);
  CHECK_THROWS_WITH_AS(e.wait(cuda_stream), doctest::Contains("a CUDA stream cannot wait for an event of the CPU"),
                       gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::stream_view(cpu, reinterpret_cast<cudaStream_t>(0x1)), gpukit::invalid_argument_error);
}

TEST_CASE("moved-from streams and events throw on use") {
  gpukit::stream a(cpu);
  gpukit::stream b(std::move(a));
  CHECK_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): testing exactly that
  CHECK(b.valid());
  CHECK_THROWS_WITH_AS(a.synchronize(), "gpukit::stream::view: use of a moved-from stream",
                       gpukit::invalid_argument_error);
  CHECK_THROWS_AS(a.device(), gpukit::invalid_argument_error);
  CHECK_THROWS_AS((void)static_cast<gpukit::stream_view>(a), gpukit::invalid_argument_error);
  b.synchronize();
  gpukit::event e(cpu);
  gpukit::event f = std::move(e);
  CHECK_THROWS_WITH_AS(e.record(b), "gpukit::event::record: use of a moved-from event",  // NOLINT
                       gpukit::invalid_argument_error);
  CHECK_THROWS_AS((void)e.ready(), gpukit::invalid_argument_error);  // NOLINT
  CHECK_NOTHROW(f.record(b));
  gpukit::stream c(cpu);
  c = std::move(b);  // move-assign over a live stream destroys the old one cleanly
  CHECK(c.valid());
}

TEST_CASE("destroying a CPU stream with pending work waits for that work") {
  std::atomic<int> done{0};
  {
    gpukit::stream s(cpu);
    for (int i = 0; i < 10; ++i) {
      s.enqueue_host([&] {
        std::this_thread::sleep_for(1ms);
        ++done;
      });
    }
  }
  CHECK(done.load() == 10);
}

TEST_CASE("an exception escaping a host function becomes a warning and the stream goes on") {
  gpukit_test::captured_warnings warnings;
  gpukit::stream s(cpu);
  std::atomic<bool> later{false};
  s.enqueue_host([] { throw std::runtime_error("boom"); });
  s.enqueue_host([&] { later = true; });
  s.synchronize();
  CHECK(later.load());
  CHECK(warnings.contains("host function enqueued on a stream threw, and was abandoned: boom"));
}

TEST_CASE("synchronizing a CPU stream from its own host function is refused instead of deadlocking") {
  gpukit_test::captured_warnings warnings;
  gpukit::stream s(cpu);
  const gpukit::stream_view v = s;
  s.enqueue_host([v] { v.synchronize(); });
  s.synchronize();
  CHECK(warnings.contains("would wait forever"));
}

TEST_CASE("host functions may own move-only state") {
  gpukit::stream s(cpu);
  auto owned = std::make_unique<int>(7);
  std::atomic<int> seen{0};
  s.enqueue_host([p = std::move(owned), &seen] { seen = *p; });
  s.synchronize();
  CHECK(seen.load() == 7);
}

TEST_CASE("stream views compare by identity") {
  gpukit::stream a(cpu);
  gpukit::stream b(cpu);
  CHECK(a.view() == a.view());
  CHECK(a.view() != b.view());
  CHECK(gpukit::stream_view::default_stream(cpu) == gpukit::stream_view::default_stream(cpu));
  CHECK(gpukit::stream_view::default_stream(cpu) != gpukit::stream_view::default_stream(gpukit::device::cuda(0)));
  CHECK(gpukit::stream_view::default_stream(gpukit::device::cuda(0)) !=
        gpukit::stream_view::default_stream(gpukit::device::cuda(1)));
  CHECK_THROWS_AS(a.view().cuda_handle(), gpukit::invalid_argument_error);
}

TEST_CASE("a stream pool hands out streams round-robin, created lazily, aliasing after size() requests") {
  gpukit::stream_pool pool(cpu, 4);
  CHECK(pool.created() == 0);
  std::vector<gpukit::stream_view> got;
  for (int i = 0; i < 9; ++i) got.push_back(pool.next());
  CHECK(pool.created() == 4);
  CHECK(got[0] == got[4]);
  CHECK(got[0] == got[8]);
  CHECK(got[1] == got[5]);
  for (int i = 0; i < 4; ++i) {
    for (int j = i + 1; j < 4; ++j) CHECK(got[static_cast<std::size_t>(i)] != got[static_cast<std::size_t>(j)]);
  }
  CHECK_THROWS_AS(gpukit::stream_pool(cpu, 0), gpukit::invalid_argument_error);
}

TEST_CASE("exclusive leases are never shared and are recycled") {
  gpukit::stream_pool pool(cpu, 2);
  gpukit::stream_view first;
  {
    auto a = pool.acquire_exclusive();
    auto b = pool.acquire_exclusive();
    CHECK(a.view() != b.view());
    CHECK(a.view() != pool.next());
    first = a.view();
    auto moved = std::move(a);
    CHECK_THROWS_AS(a.view(), gpukit::invalid_argument_error);  // NOLINT(bugprone-use-after-move)
    CHECK(moved.view() == first);
  }
  CHECK(pool.exclusive_available() == 2);
  auto again = pool.acquire_exclusive();
  CHECK(pool.exclusive_available() == 1);
}

TEST_CASE("exclusive leases are bounded by the pool's exclusive capacity") {
  gpukit::stream_pool pool(cpu, 2);
  CHECK(pool.exclusive_capacity() == 2);  // by default the pool's size
  CHECK(pool.exclusive_in_use() == 0);
  auto a = pool.acquire_exclusive();
  auto b = pool.try_acquire_exclusive();
  REQUIRE(b.has_value());
  CHECK(pool.exclusive_in_use() == 2);
  CHECK(a.view() != b->view());
  // All leased: no third stream, and the message says whose pool, how many and what to do.
  CHECK_FALSE(pool.try_acquire_exclusive().has_value());
  try {
    (void)pool.acquire_exclusive();
    FAIL("acquire_exclusive() beyond the exclusive capacity did not throw");
  } catch (const gpukit::invalid_argument_error& e) {
    const std::string what = e.what();
    CHECK(what.find("cpu") != std::string::npos);
    CHECK(what.find("2 leases out") != std::string::npos);
    CHECK(what.find("exclusive capacity 2") != std::string::npos);
    CHECK(what.find("try_acquire_exclusive") != std::string::npos);
  }
  CHECK(pool.exclusive_in_use() == 2);  // failed attempts leave the count alone
  // Ending a lease makes its stream available again, and only that one.
  const gpukit::stream_view b_stream = b->view();
  b.reset();
  CHECK(pool.exclusive_in_use() == 1);
  CHECK(pool.exclusive_available() == 1);
  auto c = pool.try_acquire_exclusive();
  REQUIRE(c.has_value());
  CHECK(c->view() == b_stream);  // recycled, not a new stream
  CHECK_FALSE(pool.try_acquire_exclusive().has_value());
  // A moved lease still counts once; a moved-from one gives nothing back.
  auto moved = std::move(a);
  CHECK(pool.exclusive_in_use() == 2);
  { auto sink = std::move(moved); }
  CHECK(pool.exclusive_in_use() == 1);
  CHECK(pool.try_acquire_exclusive().has_value());  // acquired and ended at once
  CHECK(pool.exclusive_in_use() == 1);
}

TEST_CASE("a pool's exclusive capacity is set independently of its size, and can be zero") {
  gpukit::stream_pool wide(cpu, 1, {}, 3);
  CHECK(wide.size() == 1);
  CHECK(wide.exclusive_capacity() == 3);
  std::vector<gpukit::stream_pool::lease> leases;
  for (int i = 0; i < 3; ++i) leases.push_back(wide.acquire_exclusive());
  CHECK(wide.exclusive_in_use() == 3);
  CHECK(wide.created() == 0);  // exclusive streams are not the round-robin ones
  CHECK_THROWS_AS(wide.acquire_exclusive(), gpukit::invalid_argument_error);
  leases.clear();
  CHECK(wide.exclusive_in_use() == 0);
  CHECK(wide.exclusive_available() == 3);

  gpukit::stream_pool shared_only(cpu, 4, {}, 0);
  CHECK(shared_only.exclusive_capacity() == 0);
  CHECK_FALSE(shared_only.try_acquire_exclusive().has_value());
  CHECK_THROWS_AS(shared_only.acquire_exclusive(), gpukit::invalid_argument_error);
  CHECK(shared_only.next().is_cpu());

  CHECK(gpukit::default_stream_pool(cpu).exclusive_capacity() == gpukit::stream_pool::default_size);
}

TEST_CASE("exclusive leases from many threads never exceed the capacity nor share a stream") {
  gpukit::stream_pool pool(cpu, 1, {}, 3);
  std::mutex mutex;
  std::vector<gpukit::stream_view> held;
  std::atomic<int> granted{0};
  std::atomic<int> refused{0};
  std::atomic<bool> violation{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto lease = pool.try_acquire_exclusive();
        if (!lease) {
          refused.fetch_add(1);
          continue;
        }
        granted.fetch_add(1);
        {
          std::lock_guard<std::mutex> lock(mutex);
          for (const auto& s : held) {
            if (s == lease->view()) violation = true;
          }
          held.push_back(lease->view());
          if (held.size() > 3) violation = true;
        }
        std::this_thread::yield();
        std::lock_guard<std::mutex> lock(mutex);
        held.erase(std::find(held.begin(), held.end(), lease->view()));
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK_FALSE(violation.load());
  CHECK(granted.load() + refused.load() == 6 * 200);
  CHECK(granted.load() > 0);
  CHECK(pool.exclusive_in_use() == 0);
  CHECK(pool.exclusive_available() <= 3);
}

namespace {
bool pool_used = false;
// Registered before main, so before the pools' registry exists: exit runs it after the registry's destruction, were
// the registry destroyed (a use after free, which AddressSanitizer reports), as code at exit may use the pools.
const int pool_use_at_exit = std::atexit([] {
  if (!pool_used) return;
  gpukit::stream_view s = gpukit::default_stream_pool(gpukit::device::cpu()).next();
  int ran = 0;
  s.enqueue_host([&ran] { ran = 1; });
  s.synchronize();
  if (ran != 1) {
    std::fputs("a stream of the default pool did not run its work at exit\n", stderr);
    std::_Exit(1);
  }
});
}  // namespace

namespace {
// A device no test uses otherwise: its entry stays in this thread's table to the end, with no CUDA call.
const gpukit::device unused_device = gpukit::device::cuda(7);
bool current_stream_set = false;
// Registered before main: exit runs it after this (main) thread's thread_local objects are destroyed. The current
// streams' table must not be walked then (a use after free, which AddressSanitizer reports): the default stream is
// current again, and setting one or guarding is ignored.
const int current_stream_at_exit = std::atexit([] {
  if (!current_stream_set) return;
  if (!gpukit::current_stream(unused_device).is_default()) {
    std::fputs("the current stream at exit is not the default stream\n", stderr);
    std::_Exit(1);
  }
  gpukit::set_current_stream(gpukit::default_stream_pool(gpukit::device::cpu()).next());
  { gpukit::stream_guard guard(gpukit::default_stream_pool(gpukit::device::cpu()).next()); }
});
}  // namespace

namespace {
bool inline_chain_used = false;
// Registered before main: exit runs it after this (main) thread's thread_local objects are destroyed. A host function
// enqueued inline from inside another on the CPU default stream must still run after it, in order, without touching
// the thread's destroyed deferral state (a use after free, which AddressSanitizer reports: helper-187).
const int inline_chain_at_exit = std::atexit([] {
  if (!inline_chain_used) return;
  const gpukit::stream_view s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  std::string order;
  s.enqueue_host([&] {
    s.enqueue_host([&] {
      s.enqueue_host([&] { order += 'c'; });
      order += 'b';
    });
    order += 'a';
  });
  s.enqueue_host([&] { order += 'd'; });
  if (order != "abcd") {
    std::fprintf(stderr, "host functions at exit ran as \"%s\", not \"abcd\"\n", order.c_str());
    std::_Exit(1);
  }
});
}  // namespace

TEST_CASE("host functions enqueued inline from inside another run after it at exit, after the state is gone") {
  CHECK(inline_chain_at_exit == 0);
  inline_chain_used = true;
  const gpukit::stream_view s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  std::string order;
  s.enqueue_host([&] {  // makes this thread's state now, so that it is destroyed before the handler runs
    s.enqueue_host([&] { order += 'b'; });
    order += 'a';
  });
  CHECK(order == "ab");
}

TEST_CASE("the current stream is usable at exit, after this thread's table is gone") {
  CHECK(current_stream_at_exit == 0);
  current_stream_set = true;
  const gpukit::stream_view other(unused_device, nullptr);  // a view only: no CUDA call
  gpukit::set_current_stream(other);                        // left current, to the end
  CHECK(gpukit::current_stream(unused_device) == other);
}

TEST_CASE("the process-wide pool of a device is one object, usable at exit") {
  CHECK(pool_use_at_exit == 0);
  pool_used = true;
  auto& p1 = gpukit::default_stream_pool(cpu);
  auto& p2 = gpukit::default_stream_pool(cpu);
  auto& high = gpukit::default_stream_pool(cpu, gpukit::stream_priority::high);
  CHECK(&p1 == &p2);
  CHECK(&p1 != &high);
  CHECK(p1.size() == gpukit::stream_pool::default_size);
  CHECK(p1.next().is_cpu());
}

TEST_CASE("the current stream is per thread and the guard restores it") {
  const auto default_cpu = gpukit::stream_view::default_stream(cpu);
  CHECK(gpukit::current_stream(cpu) == default_cpu);
  gpukit::stream s(cpu);
  gpukit::stream t(cpu);
  {
    gpukit::stream_guard guard(s);
    CHECK(gpukit::current_stream(cpu) == s.view());
    {
      gpukit::stream_guard inner(t);
      CHECK(gpukit::current_stream(cpu) == t.view());
    }
    CHECK(gpukit::current_stream(cpu) == s.view());
    auto other_thread = std::async(std::launch::async, [] { return gpukit::current_stream(cpu); });
    CHECK(other_thread.get() == default_cpu);  // another thread is unaffected
  }
  CHECK(gpukit::current_stream(cpu) == default_cpu);
  gpukit::set_current_stream(t);
  CHECK(gpukit::current_stream(cpu) == t.view());
  gpukit::set_current_stream(default_cpu);
}

TEST_CASE("a current stream destroyed while current is refused, held or not, and a guard restores past one") {
  const auto default_cpu = gpukit::stream_view::default_stream(cpu);
  {
    auto s = std::make_unique<gpukit::stream>(cpu);
    gpukit::set_current_stream(*s);
    std::shared_ptr<const gpukit::detail::stream_life> held = s->view().lifetime();  // as an allocator holds it
    s.reset();
    CHECK_THROWS_WITH_AS((void)gpukit::current_stream(cpu), doctest::Contains("destroyed while current"),
                         gpukit::invalid_argument_error);
    held.reset();  // the record gone too
    CHECK_THROWS_AS((void)gpukit::current_stream(cpu), gpukit::invalid_argument_error);
    gpukit::set_current_stream(default_cpu);
    CHECK(gpukit::current_stream(cpu) == default_cpu);
  }
  {
    // The stream current before a guard is destroyed during its scope: the guard restores the entry without using
    // the stream, and current_stream() then says it is gone.
    auto before = std::make_unique<gpukit::stream>(cpu);
    gpukit::set_current_stream(*before);
    gpukit::stream during(cpu);
    {
      gpukit::stream_guard guard(during);
      before.reset();
      CHECK(gpukit::current_stream(cpu) == during.view());
    }
    CHECK_THROWS_AS((void)gpukit::current_stream(cpu), gpukit::invalid_argument_error);
    gpukit::set_current_stream(default_cpu);
  }
  {
    gpukit::stream s(cpu);
    { gpukit::stream_guard guard(s); }  // nothing was set before: the default stream again
    CHECK(gpukit::current_stream(cpu) == default_cpu);
  }
}

TEST_CASE("a CPU stream destroyed by its own host function runs the rest of its work, and its worker ends") {
  // The task holding the last reference destroys the stream on the stream's own worker thread, which cannot join
  // itself (std::terminate before): the queue runs the tasks queued after that one itself.
  auto s = std::make_shared<gpukit::stream>(cpu);
  const std::weak_ptr<gpukit::stream> watch = s;
  gate g;
  g.hold(*s);
  std::promise<int> later;
  std::future<int> later_ran = later.get_future();
  int order = 0;
  s->enqueue_host([keep = s] {});  // the stream's last reference, once the test lets go of its own
  s->enqueue_host([&later, &order] { later.set_value(++order); });
  s.reset();
  CHECK_FALSE(watch.expired());  // kept by its own task
  g.open();
  CHECK(later_ran.get() == 1);  // ran, after the task that destroyed the stream
  CHECK(watch.expired());
}

TEST_CASE("events and streams used from many threads stay consistent") {
  gpukit::stream a(cpu);
  gpukit::stream b(cpu);
  std::atomic<int> counter{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        gpukit::event e(cpu);
        a.enqueue_host([&] { counter.fetch_add(1); });
        e.record(a);
        e.wait(b);
        b.enqueue_host([&] { counter.fetch_add(1); });
        if (i % 50 == 0) e.synchronize();
      }
    });
  }
  for (auto& t : threads) t.join();
  a.synchronize();
  b.synchronize();
  CHECK(counter.load() == 4 * 200 * 2);
}

TEST_CASE("stream ids: unique per stream, carried by its views and moves, and a record of its destruction") {
  gpukit::stream a(cpu);
  gpukit::stream b(cpu);
  CHECK(a.view().id() != b.view().id());
  CHECK(a.view().id() == a.view().id());
  CHECK(gpukit::stream_view::default_stream(cpu).id() != a.view().id());
  const unsigned long long id = a.view().id();
  gpukit::stream moved(std::move(a));
  CHECK(moved.view().id() == id);
  auto life = moved.view().lifetime();
  REQUIRE(static_cast<bool>(life));
  CHECK_FALSE(life->expired());
  CHECK_FALSE(static_cast<bool>(gpukit::stream_view::default_stream(cpu).lifetime()));  // nothing to track
  { gpukit::stream gone(std::move(moved)); }
  CHECK(life->expired());
  CHECK(life->finished());  // a CPU stream's destructor waits for its work
  gpukit::stream c(cpu);
  CHECK(c.view().id() != id);  // ids are never reused, even if the queue's address is
}

TEST_CASE("a destroyed CPU stream's queue stays readable while its record is kept, for a free racing the destruction") {
  // An allocator remembers a stream by its record (lifetime()) and a view. A free on another thread looks at the
  // record (alive), then asks the view whether the queue is idle: destroyed in between, the stream must leave the
  // queue there to answer. It was freed with the stream, and the question read freed memory (ASan: use after free).
  auto s = std::make_unique<gpukit::stream>(cpu);
  const gpukit::stream_view view = s->view();
  const auto life = view.lifetime();
  REQUIRE(static_cast<bool>(life));
  std::atomic<bool> ran{false};
  s->enqueue_host([&ran] { ran = true; });
  s.reset();  // waits for that work, then ends the queue's worker
  CHECK(ran.load());
  CHECK(life->expired());
  REQUIRE(view.cpu_queue() != nullptr);
  CHECK(view.cpu_queue()->idle());
  CHECK(view.cpu_queue()->pending() == 0);
  gpukit::stream_ops ops;
  CHECK_FALSE(ops.may_have_pending_work(view));  // what the allocator asks
  // What such a free may do next, having seen the stream alive: record an event there (a fence), which another
  // stream may then wait for. All the stream's work has run, so it is complete at once, rather than never (the
  // queue's worker is gone). Other work is refused: nothing would run it.
  gpukit::event fence(cpu);
  fence.record(view);
  CHECK(fence.ready());
  gpukit::stream other(cpu);
  fence.wait(other);
  other.synchronize();  // hung here when the record was left in the stopped queue
  CHECK_THROWS_AS(view.enqueue_host([] {}), gpukit::invalid_argument_error);
  CHECK(view.cpu_queue()->idle());
}

TEST_CASE("a CPU stream's queue can be synchronized through a kept record while and after its stream is destroyed") {
  // A view whose record is kept (lifetime()) synchronized on one thread while another destroys the stream. The wait
  // read the worker's thread handle while the destruction joined it, a data race that TSan cannot see (the join's
  // write is inside libstdc++); the wait now reads an id kept apart. After the destruction, a thread that may have been
  // given the ended worker's id (ids are reused: the loop makes that likely) is not taken for one of the queue's own
  // tasks.
  for (int round = 0; round < 10; ++round) {
    auto s = std::make_unique<gpukit::stream>(cpu);
    const gpukit::stream_view view = s->view();
    const auto life = view.lifetime();
    std::atomic<int> ran{0};
    for (int i = 0; i < 4; ++i) {
      s->enqueue_host([&ran] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // keeps the destruction joining a while
        ++ran;
      });
    }
    std::atomic<bool> destroyed{false};
    std::thread waiter([&] {
      while (!destroyed.load()) view.cpu_queue()->synchronize();
    });
    s.reset();
    bool refused = false;
    std::thread([&] {  // made right after the worker ended, so likely given its id
      try {
        view.cpu_queue()->synchronize();  // the queue closed: nothing left to wait for
      } catch (const gpukit::invalid_argument_error&) {
        refused = true;
      }
    })
        .join();
    destroyed = true;
    waiter.join();
    CHECK_FALSE(refused);
    CHECK(ran.load() == 4);
    CHECK(life->expired());
    CHECK(view.cpu_queue()->idle());
  }
}

namespace {
/// A host function that enqueues the next link of the chain on the CPU default stream from inside itself.
struct nested_chain {
  std::size_t* ran;
  std::size_t remaining;
  void operator()() const {
    ++*ran;
    if (remaining > 0) {
      gpukit::stream_view::default_stream(gpukit::device::cpu()).enqueue_host(nested_chain{ran, remaining - 1});
    }
  }
};
}  // namespace

TEST_CASE("host functions enqueued 200000 deep from inside each other on the CPU default stream run iteratively") {
  std::size_t ran = 0;
  gpukit::stream_view::default_stream(cpu).enqueue_host(nested_chain{&ran, 200000});
  CHECK(ran == 200001);  // all of them, by the time the outermost enqueue_host returns, without exhausting the stack
}

TEST_CASE("a host function enqueued from inside one on the CPU default stream runs after the enclosing one returns") {
  const auto s = gpukit::stream_view::default_stream(cpu);
  std::vector<std::string> order;
  s.enqueue_host([&] {
    order.push_back("outer begins");
    s.enqueue_host([&] {
      order.push_back("inner");
      s.enqueue_host([&] { order.push_back("innermost"); });
      order.push_back("inner ends");
    });
    s.enqueue_host([&] { order.push_back("second inner"); });
    order.push_back("outer ends");
  });
  CHECK(order ==
        std::vector<std::string>{"outer begins", "outer ends", "inner", "inner ends", "second inner", "innermost"});
  // An exception escaping a deferred one is reported like any other and the rest still run.
  gpukit_test::captured_warnings warnings;
  bool last_ran = false;
  s.enqueue_host([&] {
    s.enqueue_host([] { throw std::runtime_error("nested boom"); });
    s.enqueue_host([&] { last_ran = true; });
  });
  CHECK(last_ran);
  CHECK(warnings.contains("nested boom"));
}

TEST_CASE("inside a CPU stream's host function, the CPU default stream still runs work at once") {
  gpukit::stream s(cpu);
  std::atomic<bool> ran_before_return{false};
  s.enqueue_host([&] {
    bool ran = false;
    gpukit::stream_view::default_stream(gpukit::device::cpu()).enqueue_host([&] { ran = true; });
    ran_before_return = ran;
  });
  s.synchronize();
  CHECK(ran_before_return.load());
}

TEST_CASE("a CPU event waited for in a host function of the stream it is later recorded on is refused, no deadlock") {
  for (const bool on_default_stream : {false, true}) {
    CAPTURE(on_default_stream);
    auto s = std::make_unique<gpukit::stream>(cpu);
    auto e = std::make_unique<gpukit::event>(cpu);
    auto recorded = std::make_shared<std::promise<void>>();
    auto answer = std::make_shared<std::promise<std::string>>();
    std::future<std::string> answered = answer->get_future();
    s->enqueue_host([go = recorded->get_future().share(), answer, waited = e.get(), on_default_stream] {
      go.wait();  // until e is recorded after this task
      try {
        if (on_default_stream) {
          waited->wait(gpukit::stream_view::default_stream(cpu));
        } else {
          waited->synchronize();
        }
        answer->set_value("returned");
      } catch (const gpukit::invalid_argument_error& error) {
        answer->set_value(error.what());
      }
    });
    e->record(*s);
    recorded->set_value();
    if (answered.wait_for(10s) != std::future_status::ready) {
      FAIL_CHECK("the wait never returned");
      (void)s.release();  // leaked: destroying it would join the stuck worker
      (void)e.release();
      continue;
    }
    CHECK(answered.get().find("a CPU event was waited for") != std::string::npos);
    s->synchronize();
    CHECK(e->ready());
  }
}
