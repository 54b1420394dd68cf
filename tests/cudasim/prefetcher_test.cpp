// The prefetcher on the simulated runtime: a bounded loader with several producer threads on cuda:1 creates no
// context on cuda:0, and it learns that a copy completed from the copy's event, never from a host function, so
// another stream's host function that blocks the device's host-function thread does not stop it.
#include <gpukit/gpukit.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
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
