// graph_replay: capture a small step once, replay it many times. The step's temporary buffers come from a graph
// pool reserved before the capture (a capture may not cudaMalloc), so allocating them inside the captured code
// costs nothing at replay and the device's memory is never touched by the capture itself. Without a GPU it says
// so and exits 0.
#include <gpukit/gpukit.hpp>
#include <gpukit/graph/graph.hpp>  // opt-in: gpukit.hpp leaves it out

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <vector>

static int run() {
  if (gpukit::device_count() == 0) {
    std::puts("graph_replay: no CUDA device here; CUDA graphs need one (nothing to do)");
    return 0;
  }
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  const std::size_t n = 1 << 20;
  gpukit::device_buffer<float> input(n, s), output(n, s);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(input.data(), 0, input.size_bytes(), s.cuda_handle()));

  // The step: two temporaries, each filled and copied along (stand-ins for kernels).
  auto pool = gpukit::graph_pool::create(d, 2 * n * sizeof(float));
  gpukit::graph step = gpukit::capture(
      s,
      [&] {
        gpukit::device_buffer<float> a(n, s), b(n, s);  // from the pool
        GPUKIT_CUDA_TRY(
            cudaMemcpyAsync(a.data(), input.data(), a.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
        GPUKIT_CUDA_TRY(cudaMemsetAsync(b.data(), 0x3f, b.size_bytes(), s.cuda_handle()));
        GPUKIT_CUDA_TRY(
            cudaMemcpyAsync(output.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToDevice, s.cuda_handle()));
      },
      pool);
  std::printf("captured a step on %s: its pool reserves %s, %s of it in use outside replays\n", d.to_string().c_str(),
              gpukit::detail::format_bytes(pool->memory_reserved()).c_str(),
              gpukit::detail::format_bytes(pool->memory_allocated()).c_str());

  const int replays = 100;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < replays; ++i) step.launch(s);
  s.synchronize();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::vector<float> host(4);
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(host.data(), output.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                  s.cuda_handle()));
  s.synchronize();
  std::printf("replayed %d times in %.2f ms (%.1f us per step); output[0] = %g\n", replays, ms, 1000.0 * ms / replays,
              static_cast<double>(host[0]));
  std::printf("default allocator: %lld cudaMalloc calls in all\n",
              static_cast<long long>(gpukit::memory_stats(d).num_device_alloc));
  return host[0] == host[3] ? 0 : 1;
}

// Any gpukit error (a bad GPUKIT_ALLOC_CONF, no memory, a CUDA failure) is printed, and the exit code says it: 1.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graph_replay: %s\n", e.what());
    return 1;
  }
}
