// The event pool of the stream-ordered engines (memory/detail/event_pool.hpp) alone: per-device lists, the cap, and
// what an empty pool gives. The caching allocator keeps one under its lock; the pinned pool and the staging engine
// share a process-wide one (detail::recycled_event_cache), whose events are real gpukit events.
#include <gpukit/memory/detail/event_pool.hpp>
#include <gpukit/memory/pinned_pool.hpp>

#include <doctest/doctest.h>

#include <memory>
#include <utility>

using gpukit::device;
using gpukit::detail::event_pool;

TEST_CASE("event pool: an event given back is taken again, only for its own device") {
  event_pool<std::unique_ptr<int>> pool;
  CHECK_FALSE(pool.take(device::cuda(0)).has_value());  // empty: the caller creates an event
  pool.give(device::cuda(1), std::make_unique<int>(1));
  CHECK_FALSE(pool.take(device::cuda(0)).has_value());  // cuda:1's event cannot be recorded on cuda:0's streams
  pool.give(device::cuda(0), std::make_unique<int>(0));
  pool.give(device::cuda(0), std::make_unique<int>(2));
  auto last = pool.take(device::cuda(0));  // the most recently given first (its memory is warm)
  REQUIRE(last.has_value());
  CHECK(**last == 2);
  auto first = pool.take(device::cuda(0));
  REQUIRE(first.has_value());
  CHECK(**first == 0);
  CHECK_FALSE(pool.take(device::cuda(0)).has_value());
  auto other = pool.take(device::cuda(1));
  REQUIRE(other.has_value());
  CHECK(**other == 1);
  CHECK_FALSE(pool.take(device::cpu()).has_value());
}

TEST_CASE("event pool: beyond its capacity per device, events given back are destroyed") {
  event_pool<std::shared_ptr<int>> pool(2);
  auto a = std::make_shared<int>(1);
  auto b = std::make_shared<int>(2);
  auto c = std::make_shared<int>(3);
  pool.give(device::cpu(), a);
  pool.give(device::cpu(), b);
  pool.give(device::cpu(), c);  // the third is not kept: its only owner is the test now
  CHECK(a.use_count() == 2);
  CHECK(b.use_count() == 2);
  CHECK(c.use_count() == 1);
  pool.give(device::cuda(0), c);  // the cap is per device
  CHECK(c.use_count() == 2);
  CHECK(*pool.take(device::cpu()).value() == 2);
  CHECK(*pool.take(device::cpu()).value() == 1);
  CHECK_FALSE(pool.take(device::cpu()).has_value());
}

TEST_CASE("event pool: the pinned pool's process-wide cache takes events back and hands out usable ones") {
  gpukit::stream s(device::cpu());
  gpukit::event e = gpukit::detail::acquire_recycled_event(device::cpu());
  REQUIRE(e.device() == device::cpu());
  e.record(s);
  s.synchronize();
  CHECK(e.ready());
  gpukit::detail::give_recycled_event(std::move(e));
  CHECK_FALSE(e.valid());                             // NOLINT(bugprone-use-after-move): the cache took it
  gpukit::detail::give_recycled_event(std::move(e));  // NOLINT(bugprone-use-after-move): a moved-from one is not kept
  gpukit::event again = gpukit::detail::acquire_recycled_event(device::cpu());
  REQUIRE(again.device() == device::cpu());
  again.record(s);
  s.synchronize();
  CHECK(again.ready());
}
