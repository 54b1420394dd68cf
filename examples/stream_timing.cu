// stream_timing: time GPU work with gpukit events. Part 1 times a tiled single-precision matrix multiply
// (C = A x B, n x n) with a stream_timer and reports TFLOP/s beside the device's FP32 peak (SMs x 128 lanes x 2 x
// clock: no tensor cores, so a simple kernel reaches a fraction of it). Part 2 runs the same jobs (a host-to-device
// copy of one input, then a multiply) on one stream and spread over several, timed between events, and reports the
// overlap: copies of one job run under the multiplies of others only when they are on different streams.
// The results are checked exactly (inputs are small integers, so every sum is exact in float).
//
// CUDA C++: built when the CUDA language is available (nvcc). Without a GPU it says so and exits 0; the simulated
// runtime runs no kernels, so this example runs only on a GPU (tests/gpu/run.sh).
//
//   stream_timing [n] [jobs] [streams]
#include <gpukit/gpukit.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <vector>

namespace {

constexpr int tile = 32;

// One output element per thread, A and B staged through shared memory one tile at a time. Row-major.
__global__ void multiply(const float* a, const float* b, float* c, int n) {
  __shared__ float a_tile[tile][tile];
  __shared__ float b_tile[tile][tile];
  const int row = blockIdx.y * tile + threadIdx.y;
  const int col = blockIdx.x * tile + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(n);  // n * n exceeds int beyond n = 46340
  float sum = 0.0f;
  for (int k0 = 0; k0 < n; k0 += tile) {
    const int ka = k0 + static_cast<int>(threadIdx.x), kb = k0 + static_cast<int>(threadIdx.y);
    a_tile[threadIdx.y][threadIdx.x] = (row < n && ka < n) ? a[row * stride + ka] : 0.0f;
    b_tile[threadIdx.y][threadIdx.x] = (col < n && kb < n) ? b[kb * stride + col] : 0.0f;
    __syncthreads();
    for (int k = 0; k < tile; ++k) sum += a_tile[threadIdx.y][k] * b_tile[k][threadIdx.x];
    __syncthreads();
  }
  if (row < n && col < n) c[row * stride + col] = sum;
}

void launch_multiply(const float* a, const float* b, float* c, int n, gpukit::stream_view s) {
  const dim3 block(tile, tile);
  const dim3 grid((n + tile - 1) / tile, (n + tile - 1) / tile);
  multiply<<<grid, block, 0, s.cuda_handle()>>>(a, b, c, n);
  GPUKIT_CUDA_TRY(cudaGetLastError());
}

float a_value(int i, int k) { return static_cast<float>((i + 2 * k) % 7 - 3); }
float b_value(int k, int j) { return static_cast<float>((3 * k + j) % 5 - 2); }

/// Checks a spread of C's elements against sums computed on the host (exact: small integers).
bool check(const gpukit::pinned_buffer<float>& c, int n) {
  for (int sample = 0; sample < 64; ++sample) {
    const int i = (sample * 7919) % n;
    const int j = (sample * 104729 + 13) % n;
    double expected = 0;
    for (int k = 0; k < n; ++k) expected += static_cast<double>(a_value(i, k)) * b_value(k, j);
    if (c.data()[static_cast<std::size_t>(i) * n + j] != static_cast<float>(expected)) {
      std::printf("wrong result at (%d, %d): %g, expected %g\n", i, j, c.data()[static_cast<std::size_t>(i) * n + j],
                  expected);
      return false;
    }
  }
  return true;
}

double tflops(int n, int launches, float ms) {
  return 2.0 * n * static_cast<double>(n) * n * launches / (static_cast<double>(ms) * 1e-3) / 1e12;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::min(32768, std::max(32, std::atoi(argv[1]))) : 2048;  // 4 GiB per matrix at most
  const int jobs = argc > 2 ? std::max(1, std::atoi(argv[2])) : 8;
  const int stream_count = argc > 3 ? std::max(1, std::atoi(argv[3])) : 4;
  try {
    const gpukit::device_selection selection = gpukit::select_device();
    if (selection.device.is_cpu()) {
      std::printf("stream_timing times CUDA kernels and needs a GPU: %s. Nothing to time.\n", selection.reason.c_str());
      return 0;
    }
    const gpukit::device d = selection.device;
    const gpukit::device_properties& p = gpukit::properties(d);
    const double peak = p.multiprocessor_count * 128.0 * 2.0 * p.clock_rate_khz * 1e3 / 1e12;
    std::printf("%s: %s, %d SMs, FP32 peak %.1f TFLOP/s (no tensor cores)\n", d.to_string().c_str(), p.name.c_str(),
                p.multiprocessor_count, peak);

    const std::size_t elements = static_cast<std::size_t>(n) * n;
    gpukit::pinned_buffer<float> host_a(elements, d), host_b(elements, d), host_c(elements, d);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        host_a.data()[static_cast<std::size_t>(i) * n + j] = a_value(i, j);
        host_b.data()[static_cast<std::size_t>(i) * n + j] = b_value(i, j);
      }
    }

    // Part 1: one multiply, timed on its stream.
    gpukit::stream s(d);
    gpukit::device_buffer<float> a(elements, s), b(elements, s), c(elements, s);
    gpukit::copy_async(a, host_a, s);
    gpukit::copy_async(b, host_b, s);
    launch_multiply(a.data(), b.data(), c.data(), n, s);  // warm-up (module load, clocks)
    constexpr int launches = 10;
    gpukit::stream_timer timer(s);
    for (int i = 0; i < launches; ++i) launch_multiply(a.data(), b.data(), c.data(), n, s);
    const float ms = timer.elapsed().count();
    gpukit::copy_async(host_c, c, s);
    s.synchronize();
    const bool right = check(host_c, n);
    std::printf("multiply %dx%d: %.3f ms each, %.2f TFLOP/s (%.0f%% of FP32 peak), result %s\n", n, n, ms / launches,
                tflops(n, launches, ms), 100.0 * tflops(n, launches, ms) / peak, right ? "checked" : "WRONG");

    // Part 2: `jobs` jobs (copy A in, multiply) on 1 stream, then over `stream_count` streams.
    std::vector<gpukit::device_buffer<float>> inputs, outputs;
    for (int j = 0; j < jobs; ++j) {
      inputs.emplace_back(elements, s);
      outputs.emplace_back(elements, s);
    }
    std::vector<std::unique_ptr<gpukit::stream>> streams;
    for (int i = 0; i < stream_count; ++i) streams.push_back(std::make_unique<gpukit::stream>(d));
    const gpukit::event_options timed{true, false, false};
    auto run_jobs = [&](int used_streams) {
      s.synchronize();
      gpukit::event start(d, timed);
      start.record(s);
      std::vector<gpukit::event> ends;
      for (int j = 0; j < jobs; ++j) {
        gpukit::stream& js = *streams[static_cast<std::size_t>(j % used_streams)];
        if (j < used_streams) start.wait(js);  // every stream starts after `start`
        gpukit::copy_async(inputs[static_cast<std::size_t>(j)], host_a, js);
        launch_multiply(inputs[static_cast<std::size_t>(j)].data(), b.data(),
                        outputs[static_cast<std::size_t>(j)].data(), n, js);
      }
      for (int i = 0; i < used_streams; ++i) {
        ends.emplace_back(d);
        ends.back().record(*streams[static_cast<std::size_t>(i)]);
        ends.back().wait(s);
      }
      gpukit::event end(d, timed);
      end.record(s);
      return gpukit::elapsed_time(start, end).count();
    };
    // Every input/output buffer was allocated on `s`; the job streams use them too.
    for (int j = 0; j < jobs; ++j) {
      for (auto& js : streams) {
        inputs[static_cast<std::size_t>(j)].record_stream(*js);
        outputs[static_cast<std::size_t>(j)].record_stream(*js);
      }
    }
    s.synchronize();
    (void)run_jobs(stream_count);  // warm-up
    const float serial = run_jobs(1);
    const float overlapped = run_jobs(stream_count);
    gpukit::copy_async(host_c, outputs.back(), s);
    s.synchronize();
    const bool right2 = check(host_c, n);
    std::printf("%d jobs (copy %zu MiB in, multiply): 1 stream %.2f ms, %d streams %.2f ms: %.2fx (result %s)\n", jobs,
                elements * sizeof(float) >> 20, serial, stream_count, overlapped, serial / overlapped,
                right2 ? "checked" : "WRONG");
    return right && right2 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stream_timing: %s\n", e.what());
    return 1;
  }
}
