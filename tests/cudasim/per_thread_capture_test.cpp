// Compiled in CUDA's per-thread default stream mode (CUDA_API_PER_THREAD_DEFAULT_STREAM, see cudasim.cmake): handle
// 0 names this thread's per-thread stream, which CUDA can capture, while cudaStreamLegacy stays refused.
#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/graph_pool.hpp>
#include <gpukit/memory/stream_ops.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

static_assert(gpukit::detail::per_thread_default_stream_mode(), "this file must be compiled in per-thread mode");

TEST_CASE("per-thread mode: the default stream (handle 0) is captured and replayed, the legacy one is refused") {
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view per_thread(d, nullptr);
  REQUIRE(per_thread.is_per_thread());
  void* memory = nullptr;
  REQUIRE(cudaMalloc(&memory, sizeof(std::uint32_t)) == cudaSuccess);
  auto* p = static_cast<std::uint32_t*>(memory);
  REQUIRE(cudaMemsetAsync(p, 0, sizeof(std::uint32_t), per_thread.native_handle()) == cudaSuccess);
  gpukit::graph g = gpukit::capture(
      per_thread, [&] { GPUKIT_CUDA_TRY(cudaMemsetAsync(p, 7, sizeof(std::uint32_t), per_thread.native_handle())); });
  std::uint32_t value = 0;
  const auto read = [&] {
    REQUIRE(cudaMemcpyAsync(&value, p, sizeof value, cudaMemcpyDeviceToHost, per_thread.native_handle()) ==
            cudaSuccess);
    per_thread.synchronize();
  };
  read();
  CHECK(value == 0);  // captured, not run
  g.launch(per_thread);
  read();
  CHECK(value == 0x07070707u);
  CHECK_THROWS_WITH_AS(gpukit::capture(gpukit::stream_view(d, cudaStreamLegacy), [] {}),
                       doctest::Contains("not the legacy default stream"), gpukit::invalid_argument_error);
  REQUIRE(cudaFree(p) == cudaSuccess);
}

TEST_CASE("per-thread mode: a capture of handle 0 ends when the work throws, and allocates from its graph pool") {
  // Handle 0 is the captured stream here: a capture whose work throws must still be ended (the scope must not read
  // handle 0 as "already ended"), and the pool must be found for the stream (capture_id).
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view per_thread(d, nullptr);
  auto pool = gpukit::graph_pool::create(d, std::size_t{1} << 20);
  CHECK_THROWS_AS(gpukit::capture(
                      per_thread, [] { throw std::runtime_error("user code failed"); }, pool),
                  std::runtime_error);
  CHECK(gpukit::detail::capture_status(per_thread) == cudaStreamCaptureStatusNone);
  CHECK_NOTHROW(pool->reserve(std::size_t{1} << 20));  // refused while the pool counts a capture underway
  CHECK(pool->memory_reserved() == std::size_t{2} << 20);
  // Without a pool as well.
  CHECK_THROWS_AS(gpukit::capture(per_thread, [] { throw std::runtime_error("user code failed"); }),
                  std::runtime_error);
  CHECK(gpukit::detail::capture_status(per_thread) == cudaStreamCaptureStatusNone);

  void* inside = nullptr;
  gpukit::graph g = gpukit::capture(
      per_thread,
      [&] {
        gpukit::device_buffer<int> tmp(64, per_thread);
        inside = tmp.data();
        CHECK(pool->owns(tmp.data()));
        GPUKIT_CUDA_TRY(cudaMemsetAsync(tmp.data(), 0, tmp.size_bytes(), per_thread.native_handle()));
      },
      pool);
  CHECK(inside != nullptr);
  CHECK(pool->memory_allocated() == 0);
  g.launch(per_thread);
  per_thread.synchronize();
  gpukit::device_buffer<int> after(16, per_thread);  // outside a capture: the default allocator's
  CHECK_FALSE(pool->owns(after.data()));
}

TEST_CASE("per-thread mode: a capture of handle 0 ends on its own device when the work made another one current") {
  // Handle 0 names the per-thread stream of whichever device is current: ending it on cuda:1 would leave cuda:0's
  // stream capturing for good.
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view per_thread(d, nullptr);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  gpukit::graph g = gpukit::capture(per_thread, [&] { GPUKIT_CUDA_TRY(cudaSetDevice(1)); });
  CHECK(gpukit::detail::capture_status(per_thread) == cudaStreamCaptureStatusNone);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);  // the device current before the capture, as after any gpukit call
  g.launch(per_thread);
  per_thread.synchronize();
}

TEST_CASE("per-thread mode: a graph pool refuses to reserve while this thread's default stream is captured") {
  // The reserve is taken on this thread's per-thread stream: inside its capture, which allocation is prohibited in.
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view per_thread(d, nullptr);
  auto pool = gpukit::graph_pool::create(d, std::size_t{1} << 20);
  gpukit::graph g = gpukit::capture(per_thread, [&] {
    CHECK_THROWS_WITH_AS(pool->reserve(std::size_t{1} << 20), doctest::Contains("default stream is being captured"),
                         gpukit::invalid_argument_error);
  });
  CHECK(pool->memory_reserved() == std::size_t{1} << 20);
  g.launch(per_thread);  // the capture was left intact
  per_thread.synchronize();
  CHECK_NOTHROW(pool->reserve(std::size_t{1} << 20));
  CHECK(pool->memory_reserved() == std::size_t{2} << 20);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("per-thread mode: a capture forked into handle 0 counts as blocking until it ends") {
  // The per-thread stream synchronizes with the legacy one: once a capture of a non-blocking stream forks into it,
  // gpukit's calls on the legacy stream are refused (CUDA would join them to the capture), and allowed again after.
  const gpukit::device d = gpukit::device::cuda(0);
  const gpukit::stream_view per_thread(d, nullptr);
  const gpukit::stream_view legacy(d, cudaStreamLegacy);
  gpukit::stream s(d);  // non-blocking
  gpukit::event fork(d);
  gpukit::event join(d);
  std::string refused;
  gpukit::graph g = gpukit::capture(s, [&] {
    CHECK(gpukit::mode_independent::gpukit_blocking_captures_underway(0).load() == 0);
    fork.record(s);
    fork.wait(per_thread);
    CHECK(gpukit::mode_independent::gpukit_blocking_captures_underway(0).load() == 1);
    std::thread([&] {
      try {
        (void)legacy.ready();
      } catch (const gpukit::invalid_argument_error& e) {
        refused = e.what();
      }
    }).join();
    join.record(per_thread);
    join.wait(s);
  });
  CHECK(refused.find("a gpukit capture of a blocking stream of cuda:0 is underway") != std::string::npos);
  CHECK(gpukit::mode_independent::gpukit_blocking_captures_underway(0).load() == 0);
  CHECK(legacy.ready());
  g.launch(s);
  s.synchronize();
  CHECK(cudasim::violations().empty());
}
