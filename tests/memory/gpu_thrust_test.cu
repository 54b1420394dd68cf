// thrust_allocator with Thrust's CUDA system, built with nvcc: a device_vector on gpukit memory, sorted on a
// gpukit stream with an execution policy. Needs a GPU (the simulated runtime runs no kernels); without one it says
// so and exits 0. tests/gpu/run.sh runs it on a GPU.
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/thrust_allocator.hpp>
#include <gpukit/stream/stream.hpp>

#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/host_vector.h>
#include <thrust/reduce.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>

#include <cstdio>
#include <functional>

int main() {
  if (gpukit::device_count() == 0) {
    std::printf("GPUKIT_TEST_SKIPPED: no CUDA device is usable on this machine\n");
    return 0;
  }
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  auto& allocator = gpukit::default_allocator(d);
  const std::size_t before = allocator.memory_allocated();
  int failures = 0;
  {
    const auto on_s = thrust::cuda::par_nosync.on(s.cuda_handle());
    thrust::device_vector<int, gpukit::thrust_allocator<int>> v{gpukit::thrust_allocator<int>(s)};
    v.resize(1 << 20);  // Thrust fills the new elements on the default stream: wait before using them on s
    gpukit::stream_view::default_stream(d).synchronize();
    thrust::sequence(on_s, v.begin(), v.end());
    thrust::sort(on_s, v.begin(), v.end(), thrust::greater<int>());
    const long long sum = thrust::reduce(on_s, v.begin(), v.end(), 0LL);
    s.synchronize();
    const int first = v[0];
    if (first != (1 << 20) - 1) {
      std::printf("FAIL: the largest element is %d, expected %d\n", first, (1 << 20) - 1);
      ++failures;
    }
    if (sum != (1LL << 20) * ((1LL << 20) - 1) / 2) {
      std::printf("FAIL: sum %lld\n", sum);
      ++failures;
    }
    if (allocator.memory_allocated() < before + (std::size_t{1} << 22)) {
      std::printf("FAIL: the vector's memory is not the default allocator's\n");
      ++failures;
    }
  }
  s.synchronize();
  if (allocator.memory_allocated() != before) {
    std::printf("FAIL: %zu bytes still allocated after the vector was destroyed\n",
                allocator.memory_allocated() - before);
    ++failures;
  }
  std::printf("%s: thrust::device_vector on gpukit memory, sorted on a gpukit stream\n", failures ? "FAIL" : "OK");
  return failures == 0 ? 0 : 1;
}
