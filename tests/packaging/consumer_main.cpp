// The program each packaging consumer builds (find_package, add_subdirectory, FetchContent, pkg-config): it uses
// gpukit the way an application does and prints what it found. It exits 0 on a machine without a GPU or a driver,
// where gpukit selects the CPU.
#include <gpukit/gpukit.hpp>
#include <gpukit/stream/stream_ref.hpp>  // needs the toolkit's CCCL: gpukit's usage requirements bring it

#include <cuda_runtime_api.h>  // reachable only because gpukit's usage requirements bring CUDA's include directory

#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#ifdef GPUKIT_CONSUMER_EXPECTS_COMPILED
#ifndef GPUKIT_SEPARATE_COMPILATION
#error "gpukit::compiled must define GPUKIT_SEPARATE_COMPILATION"
#endif
#endif

// The consumers do not ask for C++17 themselves (the find_package one even asks for C++14): gpukit's cxx_std_17 must.
static_assert(__cplusplus >= 201703L, "gpukit::gpukit must bring C++17 (compile feature cxx_std_17)");

int main() {
  try {
    int runtime = 0;
    (void)cudaRuntimeGetVersion(&runtime);  // links only with CUDA::cudart (-lcudart) in gpukit's link interface

    const int count = gpukit::device_count();                            // 0 without a driver or GPU
    const gpukit::device_selection selection = gpukit::select_device();  // loads NVML with dlopen if it can

    const cuda::stream_ref legacy{cudaStream_t{}};  // interop with CCCL, no CUDA call
    const gpukit::stream_view from_ref = legacy;
    if (from_ref.native_handle() != cudaStream_t{}) return 1;

    gpukit::stream stream(gpukit::device::cpu());  // a worker thread serves the CPU stream
    std::atomic<int> ran{0};
    for (int i = 0; i < 3; ++i) stream.enqueue_host([&ran] { ran.fetch_add(1); });
    stream.synchronize();

    // The engines (caching allocator, pinned pool, staging): compiled here, or called in gpukit::compiled.
    const std::vector<int> host{1, 2, 3, 4};
    std::vector<int> back(host.size());
    gpukit::device_buffer<int> buffer(host.size(), stream);
    gpukit::copy_async(buffer, host, stream);
    gpukit::copy_async(back, buffer, stream);
    if (back != host) {
      std::fprintf(stderr, "consumer: the round trip through a device_buffer changed the data\n");
      return 1;
    }

    std::printf("gpukit %s, CUDA runtime %d, %d CUDA device(s), selected %s, CPU stream ran %d task(s)\n",
                GPUKIT_VERSION_STRING, runtime, count, selection.device.to_string().c_str(), ran.load());
#ifdef GPUKIT_EXPECTED_VERSION
    if (std::strcmp(GPUKIT_VERSION_STRING, GPUKIT_EXPECTED_VERSION) != 0) {
      std::fprintf(stderr, "consumer: the headers say gpukit %s, the package says %s\n", GPUKIT_VERSION_STRING,
                   GPUKIT_EXPECTED_VERSION);
      return 1;
    }
#endif
    if (ran.load() != 3) {
      std::fprintf(stderr, "consumer: the CPU stream ran %d of 3 tasks\n", ran.load());
      return 1;
    }
    std::printf("consumer: ok\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
