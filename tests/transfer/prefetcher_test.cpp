// The prefetcher on CPU streams: batches in order with the right contents, produced ahead while the consumer works,
// handed to the consumer stream with device-side dependencies (a gated consumer stream does not stop the loader),
// buffers refilled only after release, end of data, producer failures, misuse, and concurrency with a slow consumer.
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
  for (int i = 0; i < 5000 && produced.load() < 2; ++i) std::this_thread::sleep_for(1ms);
  CHECK(produced.load() == 2);  // batch 1 is ready before batch 0 is released (double buffering)
  std::this_thread::sleep_for(20ms);
  CHECK(produced.load() == 2);  // and no further: batch 2 needs batch 0's buffer
  first->release();
  auto second = loader.next();
  REQUIRE(second);
  CHECK(second->index() == 1);
}

TEST_CASE("a gated consumer stream does not stop the loader, and a buffer is refilled only after its batch ran") {
  gpukit::stream s(cpu);
  gate g;
  g.hold(s);  // the consumer's stream is held until all batches have been handed out
  gpukit::prefetcher<std::uint32_t> loader(
      s, 3000, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 12); });
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
  gpukit::prefetcher<std::uint32_t> loader(s, 10, [](std::size_t, gpukit::span<std::uint32_t> out) {
    return out.size() + 1;
  });
  CHECK_THROWS_AS(loader.next(), gpukit::invalid_argument_error);
}

TEST_CASE("misuse: bad options, and asking for a batch whose buffer is still held") {
  gpukit::stream s(cpu);
  auto produce = [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 10); };
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 100, produce, gpukit::prefetch_options{1}),
                  gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 0, produce), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::prefetcher<std::uint32_t>(s, 100, nullptr), gpukit::invalid_argument_error);
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
  std::size_t n = 0;
  while (auto batch = loader.next()) {
    const auto span = batch->data();
    const std::size_t index = batch->index();
    s.enqueue_host([&wrong, span, index] {
      if (!batch_is_right(span.data(), span.size(), index)) ++wrong;
    });
    ++n;
  }
  s.synchronize();
  CHECK(n == 200);
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
    loader_built.wait();  // `self` is set before the gate opens
    if (i == 0) (void)self->next();  // waits for the batch this very call should produce
    return fill(i, out, 10);
  });
  self = &loader;
  loader_built.open();
  CHECK_THROWS_WITH_AS(loader.next(),
                       doctest::Contains("gpukit::prefetcher::next: called from the producer callback"),
                       gpukit::invalid_argument_error);
}
