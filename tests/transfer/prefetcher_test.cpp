// The prefetcher on CPU streams: batches in order with the right contents, produced ahead while the consumer works,
// handed to the consumer stream with device-side dependencies (a gated consumer stream does not stop the loader),
// buffers refilled only after release, end of data, producer failures, misuse, and concurrency with a slow consumer.
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/prefetcher.hpp>

#include "support.hpp"
#include "transfer/transfer_support.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using gpukit_test::gate;

namespace {
const gpukit::device cpu = gpukit::device::cpu();

/// Batch i holds i*1000, i*1000+1, ... with i % 3 + 1 thousand elements (variable sizes); `batches` batches.
std::size_t fill(std::size_t index, gpukit::span<std::uint32_t> out, std::size_t batches) {
  if (index >= batches) return 0;
  const std::size_t n = std::min(out.size(), (index % 3 + 1) * 1000);
  for (std::size_t k = 0; k < n; ++k) out[k] = static_cast<std::uint32_t>(index * 1000 + k);
  return n;
}

bool batch_is_right(const std::uint32_t* data, std::size_t n, std::size_t index) {
  if (n != (index % 3 + 1) * 1000) return false;
  for (std::size_t k = 0; k < n; ++k) {
    if (data[k] != index * 1000 + k) return false;
  }
  return true;
}

/// Takes every batch, checks each on the consumer stream `s` (after its copy), and waits for the checks. Returns
/// the number of batches; counts batches out of order or with wrong contents in `wrong`.
std::size_t consume_all(gpukit::prefetcher<std::uint32_t>& loader, gpukit::stream& s, std::atomic<int>& wrong) {
  std::size_t n = 0;
  while (auto batch = loader.next()) {
    if (batch->index() != n) ++wrong;
    const auto span = batch->data();
    const std::size_t index = batch->index();
    s.enqueue_host([&wrong, span, index] {
      if (!batch_is_right(span.data(), span.size(), index)) ++wrong;
    });
    ++n;
  }
  s.synchronize();
  return n;
}
}  // namespace

TEST_CASE("batches arrive in order with their contents, then the end of the data") {
  for (std::size_t depth : {2, 3}) {
    gpukit::stream s(cpu);
    gpukit::prefetcher<std::uint32_t> loader(
        s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 10); },
        gpukit::prefetch_options{depth});
    CHECK(loader.depth() == depth);
    std::size_t expected = 0;
    std::atomic<int> wrong{0};
    while (auto batch = loader.next()) {
      CHECK(batch->index() == expected);
      const auto span = batch->data();
      const std::size_t index = batch->index();
      // Work on the consumer stream sees the batch (the stream waits for its copy).
      s.enqueue_host([&wrong, span, index] {
        if (!batch_is_right(span.data(), span.size(), index)) ++wrong;
      });
      ++expected;
    }
    CHECK(expected == 10);
    CHECK_FALSE(loader.next().has_value());  // stays at the end
    s.synchronize();
    CHECK(wrong.load() == 0);
  }
}

TEST_CASE("the next batch is prepared while the consumer holds the current one") {
  gpukit::stream s(cpu);
  std::atomic<int> produced{0};
  gpukit::prefetcher<std::uint32_t> loader(s, 3000, [&](std::size_t i, gpukit::span<std::uint32_t> out) {
    const std::size_t n = fill(i, out, 5);
    if (n != 0) ++produced;
    return n;
  });
  auto first = loader.next();
  REQUIRE(first);
  for (int i = 0; i < 5000 && produced.load() < 3; ++i) std::this_thread::sleep_for(1ms);
  // Batch 1 is on the device before batch 0 is released (double buffering), and batch 2 in pinned memory.
  CHECK(produced.load() == 3);
  std::this_thread::sleep_for(20ms);
  CHECK(produced.load() == 3);  // and no further: batch 2 waits for batch 0's device buffer, holding the one thread
  // Batch 2, once the copy stream has run the copy of batch 1.
  for (int i = 0; i < 5000 && loader.stats().batches_in_flight != 1; ++i) std::this_thread::sleep_for(1ms);
  const gpukit::prefetch_stats stats = loader.stats();
  CHECK(stats.batches_produced == 3);
  CHECK(stats.batches_handed_out == 1);
  CHECK(stats.batches_in_flight == 1);
  first->release();
  auto second = loader.next();
  REQUIRE(second);
  CHECK(second->index() == 1);
}

TEST_CASE(
    "unbounded: a gated consumer stream does not stop the loader, and a buffer is refilled only after its batch "
    "ran") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);  // the consumer's stream is held until all batches have been handed out
  gpukit::prefetch_options unbounded;
  unbounded.prefetch_factor = 0;
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 12); }, unbounded);
  std::atomic<int> wrong{0};
  std::atomic<int> checked{0};
  std::size_t handed = 0;
  while (auto batch = loader.next()) {
    const auto span = batch->data();
    const std::size_t index = batch->index();
    s.enqueue_host([&, span, index] {
      std::this_thread::sleep_for(1ms);  // a slow kernel: a refill during it would corrupt the batch
      if (!batch_is_right(span.data(), span.size(), index)) ++wrong;
      ++checked;
    });
    ++handed;
  }
  CHECK(handed == 12);  // all handed out while the consumer stream had run nothing
  CHECK(checked.load() == 0);
  // The price: the copies of batches 2..11 wait for the held stream, each from its own pinned buffer (those of 0
  // and 1 complete once the copy stream has run them).
  for (int i = 0; i < 5000 && loader.stats().batches_in_flight != 10; ++i) std::this_thread::sleep_for(1ms);
  const gpukit::prefetch_stats stats = loader.stats();
  CHECK(stats.batches_in_flight == 10);
  CHECK(stats.pinned_buffers >= 10);
  CHECK(stats.pinned_bytes == stats.pinned_buffers * 3000 * sizeof(std::uint32_t));
  g.open();
  s.synchronize();
  CHECK(checked.load() == 12);
  CHECK(wrong.load() == 0);
}

TEST_CASE("a producer failure is rethrown by next() after the batches before it") {
  gpukit::stream s(cpu);
  gpukit::prefetcher<std::uint32_t> loader(s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) -> std::size_t {
    if (i == 2) throw std::runtime_error("disk on fire");
    return fill(i, out, 10);
  });
  CHECK(loader.next()->index() == 0);
  CHECK(loader.next()->index() == 1);
  CHECK_THROWS_WITH_AS(loader.next(), "disk on fire", std::runtime_error);
}

TEST_CASE("a producer writing more than the capacity is an error") {
  gpukit::stream s(cpu);
  gpukit::prefetcher<std::uint32_t> loader(s, 10,
                                           [](std::size_t, gpukit::span<std::uint32_t> out) { return out.size() + 1; });
  CHECK_THROWS_AS(loader.next(), gpukit::invalid_argument_error);
}

TEST_CASE("misuse: bad options, and asking for a batch whose buffer is still held") {
  gpukit::stream s(cpu);
  auto produce = [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 10); };
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 100, produce, gpukit::prefetch_options{1}),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 0, produce), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 100, nullptr), gpukit::invalid_argument_error);
  gpukit::prefetch_options no_threads;
  no_threads.producer_threads = 0;
  CHECK_THROWS_WITH_AS(gpukit::prefetcher<std::uint32_t>(s, 100, produce, no_threads),
                       "gpukit::prefetcher: producer_threads must be at least 1", gpukit::invalid_argument_error);
  gpukit::prefetch_options overflowing;
  overflowing.prefetch_factor = std::size_t{1} << 62;
  overflowing.producer_threads = 8;
  CHECK_THROWS_WITH_AS(gpukit::prefetcher<std::uint32_t>(s, 100, produce, overflowing),
                       doctest::Contains("overflows; use 0 for no bound"), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, std::size_t{1} << 62, produce), gpukit::invalid_argument_error);
  gpukit::prefetcher<std::uint32_t> loader(s, 3000, produce);
  auto a = loader.next();
  auto b = loader.next();
  try {
    (void)loader.next();
    FAIL("next() with every buffer held did not throw");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("batch 2 needs the buffer of batch 0, which is still held") != std::string::npos);
  }
  a->release();
  auto c = loader.next();
  CHECK(c->index() == 2);
}

TEST_CASE("batches outlive the prefetcher, and destroying it mid-stream stops the producer") {
  gpukit::stream s(cpu);
  std::optional<gpukit::prefetcher<std::uint32_t>::batch> kept;
  {
    gpukit::prefetcher<std::uint32_t> loader(
        s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 1000); });
    kept = loader.next();
    (void)loader.next();
  }
  s.synchronize();
  REQUIRE(kept);
  const auto span = kept->data();
  CHECK(batch_is_right(span.data(), span.size(), 0));
  kept.reset();
}

TEST_CASE("concurrency: a slow consumer stream with a fast producer, many batches, triple buffering") {
  gpukit::stream s(cpu);
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 200); },
      gpukit::prefetch_options{3});
  std::atomic<int> wrong{0};
  CHECK(consume_all(loader, s, wrong) == 200);
  CHECK(wrong.load() == 0);
}

TEST_CASE("the consumer stream waits for the batch's copy on the device, not the host") {
  gpukit::stream s(cpu);
  gate copies;
  std::mutex m;
  std::condition_variable cv;
  bool copy_stream_held = false;
  std::optional<gpukit::prefetcher<std::uint32_t>> loader;
  loader.emplace(s, 3000, [&](std::size_t i, gpukit::span<std::uint32_t> out) {
    if (i == 0) {  // the first copy is enqueued only after the test has held the copy stream
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return copy_stream_held; });
    }
    return fill(i, out, 3);
  });
  copies.hold(loader->copy_stream());
  {
    std::lock_guard<std::mutex> lock(m);
    copy_stream_held = true;
  }
  cv.notify_all();
  auto batch = loader->next();  // returns: the copy is enqueued, not done
  REQUIRE(batch);
  const auto span = batch->data();
  std::atomic<int> ran{0};
  std::atomic<bool> right{false};
  s.enqueue_host([&, span] {
    right = batch_is_right(span.data(), span.size(), 0);
    ++ran;
  });
  std::this_thread::sleep_for(20ms);
  CHECK(ran.load() == 0);  // the consumer stream is held by the copy, which is held by the gate
  copies.open();
  s.synchronize();
  CHECK(ran.load() == 1);
  CHECK(right.load());
  batch.reset();
  loader.reset();
}

TEST_CASE("a producer that calls next() gets an error instead of a deadlock, rethrown by the consumer's next()") {
  gpukit::stream s(cpu);
  gate loader_built;
  gpukit::prefetcher<std::uint32_t>* self = nullptr;
  gpukit::prefetcher<std::uint32_t> loader(s, 3000, [&](std::size_t i, gpukit::span<std::uint32_t> out) {
    loader_built.wait();             // `self` is set before the gate opens
    if (i == 0) (void)self->next();  // waits for the batch this very call should produce
    return fill(i, out, 10);
  });
  self = &loader;
  loader_built.open();
  CHECK_THROWS_WITH_AS(loader.next(), doctest::Contains("gpukit::prefetcher::next: called from the producer callback"),
                       gpukit::invalid_argument_error);
}

TEST_CASE(
    "bounded: a consumer stream behind the host holds the producer back, with at most prefetch_factor pinned "
    "buffers") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);  // the device (the consumer stream) is far behind the host
  std::atomic<int> produced{0};
  gpukit::prefetcher<std::uint32_t> loader(s, 3000, [&](std::size_t i, gpukit::span<std::uint32_t> out) {
    const std::size_t n = fill(i, out, 40);
    if (n != 0) ++produced;
    return n;
  });
  std::atomic<int> wrong{0};
  std::vector<std::optional<gpukit::prefetcher<std::uint32_t>::batch>> first(4);
  for (std::size_t i = 0; i < 4; ++i) {
    first[i] = loader.next();
    REQUIRE(first[i]);
    first[i].reset();  // released at once: the host runs ahead of its stream
  }
  // Batches 0 and 1 were copied at once; the copies of 2 and 3 wait for the held stream's releases of 0 and 1, and
  // with both pinned buffers (prefetch_factor 2 × 1 thread) in flight, batch 4 cannot be produced.
  for (int i = 0; i < 5000 && produced.load() < 4; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
  CHECK(produced.load() == 4);
  gpukit::prefetch_stats stats = loader.stats();
  CHECK(stats.batches_in_flight == 2);
  CHECK(stats.pinned_buffers == 2);
  CHECK(stats.pinned_bytes == 2 * 3000 * sizeof(std::uint32_t));
  g.open();  // the device catches up: the rest flows, never with more than 2 buffers
  std::size_t handed = 4;
  while (auto batch = loader.next()) {
    CHECK(batch->index() == handed);
    const auto span = batch->data();
    const std::size_t index = batch->index();
    s.enqueue_host([&wrong, span, index] {
      std::this_thread::sleep_for(200us);  // a slow step: the producer keeps waiting for its copies
      if (!batch_is_right(span.data(), span.size(), index)) ++wrong;
    });
    ++handed;
  }
  s.synchronize();
  CHECK(handed == 40);
  CHECK(wrong.load() == 0);
  stats = loader.stats();
  CHECK(stats.batches_produced == 40);
  CHECK(stats.batches_handed_out == 40);
  CHECK(stats.batches_in_flight == 0);
  CHECK(stats.pinned_buffers == 2);
  CHECK(stats.max_batches_in_flight == 2);
  CHECK(stats.producer_wait_for_pinned.count() > 0);  // it waited at least the 20 ms above
  CHECK(stats.to_string().find("batches 40 (in flight 0, max 2), pinned 0.0 MiB in 2 buffers") == 0);
}

TEST_CASE("several producer threads call the producer concurrently, and batches still arrive in order") {
  gpukit::stream s(cpu);
  constexpr std::size_t threads = 4;
  std::mutex m;
  std::condition_variable cv;
  std::size_t inside = 0;
  bool all_met = false;
  gpukit::prefetch_options options;
  options.producer_threads = threads;
  options.depth = 3;
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000,
      [&](std::size_t i, gpukit::span<std::uint32_t> out) {
        if (i < threads) {  // the first 4 batches meet: proof that 4 threads call at once
          std::unique_lock<std::mutex> lock(m);
          ++inside;
          cv.notify_all();
          if (cv.wait_for(lock, 10s, [&] { return inside == threads; })) all_met = true;
        } else if (i % 7 == 0) {
          std::this_thread::sleep_for(300us);  // uneven producers: later batches finish first
        }
        return fill(i, out, 300);
      },
      options);
  std::atomic<int> wrong{0};
  CHECK(consume_all(loader, s, wrong) == 300);
  CHECK(wrong.load() == 0);
  {
    std::lock_guard<std::mutex> lock(m);
    CHECK(all_met);
  }
  const gpukit::prefetch_stats stats = loader.stats();
  CHECK(stats.batches_produced == 300);
  CHECK(stats.pinned_buffers <= 2 * threads);  // prefetch_factor 2 per thread
  CHECK(stats.max_batches_in_flight <= 2 * threads);
}

TEST_CASE("several producer threads: the earliest end or failure wins, and no batch after it is handed out") {
  gpukit::stream s(cpu);
  gpukit::prefetch_options options;
  options.producer_threads = 3;
  SUBCASE("a failure at batch 5, while later batches are produced") {
    gpukit::prefetcher<std::uint32_t> loader(
        s, 3000,
        [](std::size_t i, gpukit::span<std::uint32_t> out) -> std::size_t {
          if (i == 5) {
            std::this_thread::sleep_for(5ms);  // later indices finish first
            throw std::runtime_error("bad record 5");
          }
          return fill(i, out, 100);
        },
        options);
    for (std::size_t i = 0; i < 5; ++i) CHECK(loader.next()->index() == i);
    CHECK_THROWS_WITH_AS(loader.next(), "bad record 5", std::runtime_error);
    CHECK_THROWS_WITH_AS(loader.next(), "bad record 5", std::runtime_error);  // stays failed
  }
  SUBCASE("the end at batch 6, and a failure after it that nobody sees") {
    gpukit::prefetcher<std::uint32_t> loader(
        s, 3000,
        [](std::size_t i, gpukit::span<std::uint32_t> out) -> std::size_t {
          if (i == 6) {
            std::this_thread::sleep_for(5ms);
            return 0;
          }
          if (i == 7) throw std::runtime_error("past the end");
          return fill(i, out, 100);
        },
        options);
    std::size_t n = 0;
    while (auto batch = loader.next()) {
      CHECK(batch->index() == n);
      ++n;
    }
    CHECK(n == 6);
    CHECK_FALSE(loader.next().has_value());
  }
}

TEST_CASE("a producer thread that calls next() is refused with several producer threads too") {
  gpukit::stream s(cpu);
  gate loader_built;
  gpukit::prefetcher<std::uint32_t>* self = nullptr;
  gpukit::prefetch_options options;
  options.producer_threads = 2;
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000,
      [&](std::size_t i, gpukit::span<std::uint32_t> out) {
        loader_built.wait();
        if (i == 1) (void)self->next();
        return fill(i, out, 10);
      },
      options);
  self = &loader;
  loader_built.open();
  CHECK(loader.next()->index() == 0);
  CHECK_THROWS_WITH_AS(loader.next(), doctest::Contains("gpukit::prefetcher::next: called from the producer callback"),
                       gpukit::invalid_argument_error);
}

TEST_CASE("without a stream, the prefetcher feeds the calling thread's current stream of the device") {
  gpukit::stream s(cpu);
  const auto produce = [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 4); };
  {
    gpukit::prefetcher<std::uint32_t> loader(cpu, 3000, produce);
    CHECK(loader.consumer_stream() == gpukit::current_stream(cpu));  // the default stream, no guard
    CHECK(loader.consumer_stream() != gpukit::stream_view(s));
  }
  gpukit::stream_guard guard(s);
  gpukit::prefetcher<std::uint32_t> loader(cpu, 3000, produce);
  CHECK(loader.consumer_stream() == gpukit::stream_view(s));
  std::atomic<int> wrong{0};
  CHECK(consume_all(loader, s, wrong) == 4);
  CHECK(wrong.load() == 0);
}

TEST_CASE("a moved-from or released batch is empty: no data, size 0, no index, and releasing it again is harmless") {
  gpukit::stream s(cpu);
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 3); });
  auto first = loader.next();
  REQUIRE(first.has_value());
  CHECK(first->held());
  CHECK(first->size() == 1000);
  auto moved = std::move(*first);
  CHECK(moved.held());
  CHECK(moved.index() == 0);
  CHECK_FALSE(first->held());  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
  CHECK(first->data().data() == nullptr);
  CHECK(first->data().empty());
  CHECK(first->size() == 0);
  CHECK(first->index() == gpukit::prefetcher<std::uint32_t>::batch::no_index);
  first->release();  // nothing to release
  moved.release();
  CHECK_FALSE(moved.held());
  CHECK(moved.size() == 0);
  moved.release();  // twice is harmless
  s.synchronize();
}

TEST_CASE("misuse: next() from two threads at once is refused for the second, which takes nothing") {
  // Both would wait for the same batch, and the one that did not get it would wait until the end of the data.
  gpukit::stream s(cpu);
  std::mutex m;
  std::condition_variable cv;
  int refused = 0;
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000,
      [&](std::size_t i, gpukit::span<std::uint32_t> out) {
        if (i == 0) {  // batch 0 is produced only once one of the two calls has been refused
          std::unique_lock<std::mutex> lock(m);
          // A watchdog, not a measurement: without the refusal both calls would wait for ever, and the checks below
          // fail instead.
          cv.wait_for(lock, 30s, [&] { return refused > 0; });
        }
        return fill(i, out, 3);
      },
      gpukit::prefetch_options{2});
  std::vector<std::size_t> taken;  // the index each call got (batch::no_index: refused)
  std::vector<std::string> errors;
  const auto take = [&] {
    try {
      auto batch = loader.next();
      std::lock_guard<std::mutex> lock(m);
      taken.push_back(batch ? batch->index() : gpukit::prefetcher<std::uint32_t>::batch::no_index);
    } catch (const gpukit::invalid_argument_error& e) {
      {
        std::lock_guard<std::mutex> lock(m);
        errors.emplace_back(e.what());
        ++refused;
      }
      cv.notify_all();
    }
  };
  std::thread first(take);
  std::thread second(take);
  first.join();
  second.join();
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].find("called while another thread's next() is underway (batch 0)") != std::string::npos);
  REQUIRE(taken.size() == 1);
  CHECK(taken[0] == 0);
  for (std::size_t expected = 1; expected <= 3; ++expected) {  // the refused call took nothing: then 1, 2, the end
    auto batch = loader.next();
    CHECK(batch.has_value() == (expected < 3));
    if (batch) CHECK(batch->index() == expected);
  }
}
