// The prefetcher on the simulated runtime: a bounded loader with several producer threads on cuda:1 creates no
// context on cuda:0, and it learns that a copy completed from the copy's event, never from a host function, so
// another stream's host function that blocks the device's host-function thread does not stop it.
#include <gpukit/gpukit.hpp>
#include <gpukit/graph/graph.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
std::uint32_t value(std::size_t index, std::size_t k) { return static_cast<std::uint32_t>(index * 7919 + k); }

/// Batch i holds value(i, k) for k < 100 + i (variable sizes); `batches` batches.
std::size_t fill(std::size_t index, gpukit::span<std::uint32_t> out, std::size_t batches) {
  if (index >= batches) return 0;
  const std::size_t n = 100 + index;
  for (std::size_t k = 0; k < n; ++k) out[k] = value(index, k);
  return n;
}

/// Two device buffers and one producer thread: batch i goes into buffer i % 2, after batch i - 2 is released.
gpukit::prefetch_options two_buffers() {
  gpukit::prefetch_options options;
  options.depth = 2;
  options.producer_threads = 1;
  return options;
}

/// Runs a loader of `batches` batches on `consumer`; each batch's first and last elements are copied back into
/// `probe` (2 × batches elements) on the consumer stream (device work, no host function). Returns the number of
/// wrong or missing batches.
std::size_t consume_and_check(gpukit::prefetcher<std::uint32_t>& loader, gpukit::stream& consumer,
                              gpukit::pinned_buffer<std::uint32_t>& probe, std::size_t batches) {
  std::vector<std::size_t> sizes(batches, 0);
  std::size_t handed = 0;
  while (auto batch = loader.next()) {
    const std::size_t i = batch->index();
    if (i >= batches) return batches;
    sizes[i] = batch->size();
    gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * i, 1), batch->data().first(1), consumer);
    gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * i + 1, 1), batch->data().last(1),
                       consumer);
    ++handed;
  }
  consumer.synchronize();
  std::size_t wrong = batches - handed;
  for (std::size_t i = 0; i < handed; ++i) {
    const std::size_t n = 100 + i;
    if (sizes[i] != n || probe.data()[2 * i] != value(i, 0) || probe.data()[2 * i + 1] != value(i, n - 1)) ++wrong;
  }
  return wrong;
}
}  // namespace

TEST_CASE("sim prefetcher: a bounded loader with 3 producer threads on cuda:1 touches no other device") {
  cudasim::allow_contexts_only_on({1});
  {
    const auto d = gpukit::device::cuda(1);
    gpukit::stream consumer(d);
    gpukit::prefetch_options options;
    options.producer_threads = 3;
    options.prefetch_factor = 1;
    gpukit::prefetcher<std::uint32_t> loader(
        consumer, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 60); }, options);
    gpukit::pinned_buffer<std::uint32_t> probe(2 * 60, d);
    CHECK(consume_and_check(loader, consumer, probe, 60) == 0);
    const gpukit::prefetch_stats stats = loader.stats();
    CHECK(stats.batches_produced == 60);
    CHECK(stats.pinned_buffers <= 3);  // prefetch_factor 1 × 3 threads
    CHECK(stats.max_batches_in_flight <= 3);
  }
  CHECK(cudasim::context_creations(0) == 0);
  cudasim::allow_contexts_only_on({});
}

TEST_CASE("sim prefetcher: another stream's blocked host function does not stop a bounded loader") {
  // The simulator runs the host functions of all streams of a device on one thread, as CUDA may. A loader that
  // waited for a host function to learn that its copies completed would wait for the gate below forever.
  const auto d = gpukit::device::cuda(0);
  gpukit::stream other(d);
  gpukit_test::gate g;
  std::mutex m;
  std::condition_variable cv;
  bool finished = false;
  bool gate_forced = false;
  std::thread watchdog([&] {  // a regression fails instead of hanging
    std::unique_lock<std::mutex> lock(m);
    if (cv.wait_for(lock, 30s, [&] { return finished; })) return;
    gate_forced = true;
    lock.unlock();
    g.open();
  });
  // Allocated before the gate closes, freed after it opens: cudaFreeHost waits for the device's work, host
  // functions included.
  gpukit::pinned_buffer<std::uint32_t> probe(2 * 50, d);
  g.hold(other);  // blocks the device's host-function thread until opened
  const std::size_t host_functions_before = cudasim::calls("cudaLaunchHostFunc");
  {
    gpukit::stream consumer(d);
    gpukit::prefetcher<std::uint32_t> loader(
        consumer, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 50); });
    CHECK(consume_and_check(loader, consumer, probe, 50) == 0);
    CHECK(loader.stats().pinned_buffers <= 2);
  }
  CHECK(cudasim::calls("cudaLaunchHostFunc") == host_functions_before);
  {
    std::lock_guard<std::mutex> lock(m);
    finished = true;
  }
  cv.notify_all();
  watchdog.join();
  CHECK_FALSE(gate_forced);
  g.open();
  other.synchronize();
}

TEST_CASE("sim prefetcher: next() while the consumer stream is captured is refused, and a release there is reported") {
  const auto d = gpukit::device::cuda(0);
  gpukit::stream consumer(d);
  gpukit::prefetcher<std::uint32_t> loader(
      consumer, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 10); });
  auto first = loader.next();
  REQUIRE(first);
  REQUIRE(cudaStreamBeginCapture(consumer.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  CHECK_THROWS_WITH_AS(loader.next(), doctest::Contains("is being captured into a CUDA graph"),
                       gpukit::invalid_argument_error);
  {
    gpukit_test::captured_warnings warnings;
    first.reset();  // released in the capture: no event recorded there
    CHECK(warnings.contains("released while its consumer stream is being captured"));
  }
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(consumer.cuda_handle(), &graph) == cudaSuccess);
  CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  std::size_t rest = 0;
  while (auto batch = loader.next()) ++rest;  // after the capture, the loader goes on
  CHECK(rest == 9);
}

TEST_CASE("sim prefetcher: a release whose event cannot be recorded waits for the consumer's work on the host") {
  // Without the event the copy stream would not wait for the consumer, and the next copy into the buffer could
  // overwrite what the consumer's work still reads.
  const auto d = gpukit::device::cuda(0);
  gpukit_test::gate g;
  gpukit::stream consumer(d);
  gpukit::prefetcher<std::uint32_t> loader(
      consumer, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 1); });
  auto batch = loader.next();
  REQUIRE(batch);
  CHECK_FALSE(loader.next());  // the end: the producer thread makes no more CUDA calls
  g.hold(consumer);            // the consumer's work on the batch waits for the gate
  gpukit_test::captured_warnings warnings;
  const std::size_t syncs = cudasim::calls("cudaStreamSynchronize");
  cudasim::fail_call("cudaEventRecord", 1, cudaErrorUnknown);
  std::atomic<bool> returned{false};
  std::thread releasing([&] {
    batch.reset();
    returned = true;
  });
  // The release waits for the held work: it calls cudaStreamSynchronize, which does not return while the gate holds.
  while (!returned && cudasim::calls("cudaStreamSynchronize") == syncs) std::this_thread::yield();
  CHECK_FALSE(returned.load());
  g.open();
  releasing.join();
  cudasim::clear_faults();
  CHECK(warnings.contains("waiting for the consumer's work on the host"));
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim prefetcher: a consumer wait that cannot be enqueued takes nothing: the next call hands out that batch") {
  // Handing the batch out before the wait was enqueued lost it on failure: the batch was released unseen and the
  // next call returned the one after it.
  const auto d = gpukit::device::cuda(0);
  gpukit::stream consumer(d);
  std::atomic<bool> batch_0_ready{false};
  std::atomic<bool> go_on{false};
  gpukit::prefetcher<std::uint32_t> loader(
      consumer, 200,
      [&](std::size_t i, gpukit::span<std::uint32_t> out) {
        // One producer thread: it asks for batch 1 once batch 0's copy and events are enqueued, and makes no CUDA
        // call until the test lets it go on.
        if (i == 1) {
          batch_0_ready = true;
          while (!go_on) std::this_thread::yield();
        }
        return fill(i, out, 3);
      },
      two_buffers());
  while (!batch_0_ready) std::this_thread::yield();
  cudasim::fail_call("cudaStreamWaitEvent", 1, cudaErrorUnknown);  // the consumer's wait for batch 0's copy
  CHECK_THROWS_AS(loader.next(), gpukit::cuda_error);
  cudasim::clear_faults();
  go_on = true;
  CHECK(loader.stats().batches_handed_out == 0);
  gpukit::pinned_buffer<std::uint32_t> probe(6, d);
  CHECK(consume_and_check(loader, consumer, probe, 3) == 0);  // batches 0, 1, 2 in order, with their contents
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim prefetcher: next() in a capture for a buffer released during it is refused, not a wait forever") {
  // A thread that captures releases batch 0 of another thread's per-thread consumer: its event could go only on the
  // legacy default stream, so the producer records it once the capture ends, before refilling that buffer. Batch 2,
  // which goes there, cannot arrive while the capture lasts: next() in the capture says so instead of waiting.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  const gpukit::prefetch_options options = two_buffers();
  gpukit::prefetcher<std::uint32_t> loader(
      mine, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 6); }, options);
  auto zero = loader.next();
  auto one = loader.next();
  REQUIRE(zero);
  REQUIRE(one);
  std::string message;
  std::string capture_failure;
  std::thread([&] {
    gpukit::stream captured(d);
    try {
      gpukit::graph g = gpukit::capture(captured, [&] {
        zero.reset();  // deferred: the event would go on the legacy stream
        try {
          (void)loader.next();
        } catch (const gpukit::invalid_argument_error& e) {
          message = e.what();
        }
      });
    } catch (const std::exception& e) {
      capture_failure = e.what();
    }
  }).join();
  CHECK(capture_failure == "");
  CHECK(message.find("released during a CUDA graph capture") != std::string::npos);
  one.reset();
  std::size_t rest = 0;  // after the capture the loader goes on, from batch 2
  while (auto batch = loader.next()) {
    CHECK(batch->index() == 2 + rest);
    ++rest;
  }
  CHECK(rest == 4);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim prefetcher: a per-thread default consumer stream is the constructing thread's, wherever batches go") {
  // cudaStreamPerThread names the calling thread's own stream: a batch taken or released on another thread must still
  // order the constructing thread's stream (through the legacy default stream), not the other thread's.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  gpukit_test::gate copies;   // holds the copy stream
  gpukit_test::gate produce;  // holds the producer before batch 1
  const gpukit::prefetch_options options = two_buffers();
  gpukit::prefetcher<std::uint32_t> loader(
      mine, 200,
      [&](std::size_t i, gpukit::span<std::uint32_t> out) {
        if (i == 1) produce.wait();
        return fill(i, out, 4);
      },
      options);
  loader.next().reset();  // batch 0, released on this thread
  copies.hold(loader.copy_stream());
  produce.open();  // batch 1's copy is enqueued behind the gate

  std::optional<gpukit::prefetcher<std::uint32_t>::batch> one;
  bool other_stream_idle = false;
  std::thread([&] {
    one = loader.next();
    // The wait for the copy went to the consumer's stream, not to this thread's own, which has no work.
    other_stream_idle = gpukit::stream_view(d, cudaStreamPerThread).ready();
  }).join();
  REQUIRE(one);
  CHECK(one->index() == 1);
  CHECK(other_stream_idle);

  // Work on the consumer stream after next() reads the batch only once its copy is done.
  std::uint32_t seen = 0;
  const std::uint32_t* first = one->data().data();
  mine.enqueue_host([&seen, first] { seen = *first; });
  std::thread([&] { one.reset(); }).join();  // released on another thread: the refill waits for the read above
  copies.open();
  mine.synchronize();
  CHECK(seen == value(1, 0));
  std::size_t rest = 0;
  while (auto batch = loader.next()) ++rest;
  CHECK(rest == 2);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim prefetcher: another thread takes and releases a batch of a per-thread consumer during a capture") {
  // That thread can order the consumer only through the legacy default stream, which a capture of a blocking stream
  // forbids: next() waits for the copy on the host, and the release's event is recorded by the producer once the
  // capture has ended, before the buffer is refilled (not skipped, which would let the refill overwrite the batch).
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  const gpukit::prefetch_options options = two_buffers();
  gpukit::prefetcher<std::uint32_t> loader(
      mine, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 4); }, options);
  gpukit_test::gate held;
  held.hold(mine);  // the consumer's work waits: so does the refill of batch 0's buffer, once ordered after it
  gpukit_test::captured_warnings warnings;
  gpukit::stream captured(d);
  std::uint32_t first = 0;  // read on the host: the copy has completed when next() returns
  std::size_t taken = gpukit::prefetcher<std::uint32_t>::batch::no_index;
  const std::size_t host_waits = cudasim::calls("cudaEventSynchronize");
  gpukit::graph g = gpukit::capture(captured, [&] {
    std::thread([&] {
      auto batch = loader.next();
      if (!batch) return;
      taken = batch->index();
      first = *batch->data().data();
    }).join();  // the batch is released on that thread, during the capture
  });
  CHECK(taken == 0);
  CHECK(first == value(0, 0));
  CHECK(cudasim::calls("cudaEventSynchronize") > host_waits);  // the copy was waited for on the host
  CHECK_FALSE(warnings.contains("refilled"));
  auto one = loader.next();  // on the consumer's thread, after the capture
  CHECK((one && one->index() == 1));
  one.reset();
  auto two = loader.next();  // in batch 0's buffer: its copy waits for the consumer's work, held by the gate
  CHECK((two && two->index() == 2));
  CHECK_FALSE(loader.copy_stream().ready());
  held.open();
  two.reset();
  std::size_t rest = 0;
  while (auto batch = loader.next()) ++rest;
  CHECK(rest == 1);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("sim prefetcher: a legacy default consumer stream stays the constructing device's, on any thread") {
  // stream_view{} names the legacy default stream of the device current where it is used: the loader binds it to its
  // device, so a thread whose current device is cuda:0 takes and releases batches on cuda:1's, touching no cuda:0.
  cudasim::allow_contexts_only_on({1});
  {
    const auto d = gpukit::device::cuda(1);
    std::optional<gpukit::prefetcher<std::uint32_t>> loader;
    {
      const gpukit::device_guard guard(d);
      loader.emplace(
          gpukit::stream_view{}, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 6); },
          two_buffers());
    }
    CHECK(loader->consumer_stream().device() == d);
    gpukit_test::captured_warnings warnings;
    std::vector<std::size_t> indices;
    std::thread([&] {
      while (auto batch = loader->next()) indices.push_back(batch->index());  // each released on this thread
    }).join();
    CHECK(indices == std::vector<std::size_t>{0, 1, 2, 3, 4, 5});
    CHECK(warnings.messages().empty());
  }
  CHECK(cudasim::context_creations(0) == 0);
  cudasim::allow_contexts_only_on({});
}

namespace {
/// Whether `s` has work pending within `limit` (polled): the refill a test expects to wait for a held consumer.
/// (A refill that does not wait completes at once, which the test's check of the consumer's data catches.)
bool busy_within(const gpukit::stream_view& s, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (s.ready()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}
}  // namespace

// A capture of a blocking stream begun with the raw runtime (cudaStreamBeginCapture) holds the legacy default stream
// as a gpukit capture does, but no capture_hold sees it: a release that orders the consumer through the legacy stream
// (a legacy consumer, or another thread's per-thread stream) asks the legacy stream's capture status (which the
// header lets one ask without breaking the capture) and leaves the record to the producer, as during a gpukit capture.

TEST_CASE("sim prefetcher: a per-thread consumer's batch released on another thread during a raw capture") {
  // The record on the legacy stream was refused (906) and the fallback waited for the whole device, which ended the
  // capture (cudaDeviceSynchronize); the buffer was then refilled under the consumer's work.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  gpukit::prefetcher<std::uint32_t> loader(
      mine, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 4); }, two_buffers());
  gpukit_test::captured_warnings warnings;
  std::optional<gpukit::prefetcher<std::uint32_t>::batch> batch;
  std::thread([&] { batch = loader.next(); }).join();
  REQUIRE(batch);
  REQUIRE(batch->index() == 0);
  gpukit_test::gate held;
  held.hold(mine);  // the consumer's work on batch 0, held back
  std::uint32_t seen = 0;
  const std::uint32_t* first = batch->data().data();
  mine.enqueue_host([&seen, first] { seen = *first; });
  cudaStream_t blocking = nullptr;
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(blocking, cudaStreamCaptureModeGlobal) == cudaSuccess);
  std::thread([&] { batch.reset(); }).join();  // released during the capture
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking, &graph) == cudaSuccess);  // intact
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaStreamDestroy(blocking) == cudaSuccess);
  auto one = loader.next();
  REQUIRE(one);
  // The producer enqueues batch 2's copy into batch 0's buffer, which waits for the consumer's work on batch 0.
  CHECK(busy_within(loader.copy_stream(), 5s));
  held.open();
  mine.synchronize();
  CHECK(seen == value(0, 0));  // read batch 0, not batch 2 written over it
  one.reset();
  std::size_t rest = 0;
  while (auto b = loader.next()) ++rest;
  CHECK(rest == 2);
  CHECK_FALSE(warnings.contains("failed"));
}

TEST_CASE("sim prefetcher: a legacy consumer's batch released during a raw capture keeps it, and orders the refill") {
  // The legacy stream's host wait was refused too, and the refill overwrote the batch under the consumer's work.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(d);
  gpukit::prefetcher<std::uint32_t> loader(
      legacy, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 4); }, two_buffers());
  gpukit_test::captured_warnings warnings;
  auto batch = loader.next();
  REQUIRE(batch);
  gpukit_test::gate held;
  held.hold(legacy);
  std::uint32_t seen = 0;
  const std::uint32_t* first = batch->data().data();
  legacy.enqueue_host([&seen, first] { seen = *first; });
  gpukit::stream blocking(d, gpukit::stream_options{false, 0});
  REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeGlobal) == cudaSuccess);
  batch.reset();  // on the capturing thread
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  auto one = loader.next();
  REQUIRE(one);
  CHECK(busy_within(loader.copy_stream(), 5s));  // batch 2's copy into batch 0's buffer waits for the consumer
  held.open();
  legacy.synchronize();
  CHECK(seen == value(0, 0));
  one.reset();
  std::size_t rest = 0;
  while (auto b = loader.next()) ++rest;
  CHECK(rest == 2);
  CHECK_FALSE(warnings.contains("failed"));
}

TEST_CASE("sim prefetcher: a deferred release's record waits for a raw capture to end instead of ending the data") {
  // Released during a gpukit capture, the record is the producer's; a raw capture of a blocking stream underway when
  // it records refused it, and every later next() rethrew that refusal, long after the capture had ended.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  gpukit::prefetcher<std::uint32_t> loader(
      mine, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 6); }, two_buffers());
  gpukit_test::captured_warnings warnings;
  gpukit::stream captured(d);
  gpukit::stream blocking(d, gpukit::stream_options{false, 0});
  std::thread([&] {  // relaxed: this thread's later calls are not refused for another thread's capture
    REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  })
      .join();
  {
    gpukit::graph g = gpukit::capture(captured, [&] {
      std::thread([&] {
        auto batch = loader.next();
        REQUIRE(batch);
      }).join();  // released during the gpukit capture: deferred to the producer
    });
  }
  std::this_thread::sleep_for(100ms);  // the producer reaches batch 2 (batch 0's buffer) while the raw capture lasts
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  std::size_t rest = 0;
  CHECK_NOTHROW([&] {
    while (auto batch = loader.next()) ++rest;
  }());
  CHECK(rest == 5);
  CHECK(cudasim::violations().empty());
}

TEST_CASE(
    "sim prefetcher: during a raw capture, a legacy consumer's batches are waited for on the host, never hung on") {
  // A batch whose buffer's release waits for the capture to end is refused (the capture may be this thread's, which
  // could not end while next() waits); one already copied is waited for on the host (a wait on the legacy stream
  // would break the capture), as during a gpukit capture.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(d);
  gpukit::prefetcher<std::uint32_t> loader(
      legacy, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 5); }, two_buffers());
  gpukit_test::captured_warnings warnings;
  auto zero = loader.next();
  REQUIRE(zero);
  gpukit::stream blocking(d, gpukit::stream_options{false, 0});
  std::thread([&] {
    REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  }).join();
  zero.reset();              // deferred: its buffer is batch 2's
  auto one = loader.next();  // copied before the capture: waited for on the host
  REQUIRE(one);
  CHECK(one->index() == 1);
  CHECK(*one->data().data() == value(1, 0));
  one.reset();
  CHECK_THROWS_WITH_AS(loader.next(), doctest::Contains("begun with the raw runtime"), gpukit::invalid_argument_error);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);  // intact
  if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  std::size_t rest = 0;
  while (auto batch = loader.next()) {
    CHECK(batch->index() == 2 + rest);
    ++rest;
  }
  CHECK(rest == 3);
  CHECK(cudasim::violations().empty());
  CHECK_FALSE(warnings.contains("failed"));
}

TEST_CASE("sim prefetcher: a deferred record refused by a raw capture begun just before it keeps next() from a wait") {
  // The producer cleared the buffer's deferral before its record, and a raw capture begun between its look and the
  // record refused it: next() then saw nothing deferred and waited for the refill, which waits for that capture.
  const auto d = gpukit::device::cuda(0);
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(d);
  gpukit::prefetcher<std::uint32_t> loader(
      legacy, 200, [](std::size_t i, gpukit::span<std::uint32_t> out) { return fill(i, out, 4); }, two_buffers());
  gpukit_test::captured_warnings warnings;
  auto zero = loader.next();
  REQUIRE(zero);
  auto one = loader.next();
  REQUIRE(one);
  one.reset();
  gpukit::stream blocking(d, gpukit::stream_options{false, 0});
  const auto begin_capture = [&] {
    REQUIRE(cudaStreamBeginCapture(blocking.cuda_handle(), cudaStreamCaptureModeRelaxed) == cudaSuccess);
  };
  std::thread(begin_capture).join();
  zero.reset();  // deferred: the producer records it once the capture ends
  std::atomic<bool> begun_again{false};
  // The producer's record, its first cudaEventRecord from here on: a capture begins just before it.
  cudasim::before_call("cudaEventRecord", 1, [&] {
    begin_capture();
    begun_again = true;
  });
  const auto end_capture = [&] {
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaSuccess);
    if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  };
  end_capture();
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!begun_again && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  REQUIRE(begun_again);
  // Batch 2 goes into batch 0's buffer, whose release is still to be recorded: refused, not waited for.
  auto taken = std::async(std::launch::async, [&] { return loader.next(); });
  const bool answered = taken.wait_for(2s) == std::future_status::ready;
  CHECK(answered);
  {
    // The refused record invalidated this capture (as any legacy-stream work would): it ends with 901.
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(blocking.cuda_handle(), &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
    CHECK(cudasim::take_violations().size() == 1);  // that record
  }
  if (answered) {
    CHECK_THROWS_WITH_AS(taken.get(), doctest::Contains("begun with the raw runtime"), gpukit::invalid_argument_error);
  } else {
    taken.wait();  // the defect: it waited for the capture's end
  }
  std::size_t rest = 0;
  while (auto batch = loader.next()) {
    CHECK(batch->index() == 2 + rest);
    ++rest;
  }
  CHECK(rest == 2);
  CHECK(cudasim::violations().empty());
}
