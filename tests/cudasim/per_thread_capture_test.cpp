// Compiled in CUDA's per-thread default stream mode (CUDA_API_PER_THREAD_DEFAULT_STREAM, see cudasim.cmake): handle
// 0 names this thread's per-thread stream, which CUDA can capture, while cudaStreamLegacy stays refused.
#include <gpukit/graph/graph.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>

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
