// What the CUDA runtime makes visible under this process's CUDA_VISIBLE_DEVICES, for gpu_visible_devices_test.cpp:
// "count N" (or "error E" when cudaGetDeviceCount fails), then the UUID of each visible device in ordinal order.
// Plain CUDA calls, no gpukit: the answer compared with gpukit's reading of the variable.
#include <cuda_runtime_api.h>

#include <cstdio>

int main() {
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    std::printf("error %d\n", static_cast<int>(result));
    return 0;
  }
  std::printf("count %d\n", count);
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      std::printf("no properties for %d\n", i);
      return 1;
    }
    const auto* b = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
    std::printf("GPU-");
    for (int k = 0; k < 16; ++k) std::printf(k == 4 || k == 6 || k == 8 || k == 10 ? "-%02x" : "%02x", b[k]);
    std::printf("\n");
  }
  return 0;
}
