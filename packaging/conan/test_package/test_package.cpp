// gpukit from its Conan package: include, select a device (the CPU without a GPU), run work on a stream, and
// allocate from the default allocator (whose engine comes from libgpukit.a in the compiled mode).
#include <gpukit/gpukit.hpp>

#include <cstdio>
#include <exception>

int main() {
  try {
    const gpukit::device d = gpukit::select_device().device;
    gpukit::stream s(d);
    int done = 0;
    s.enqueue_host([&done] { done = 1; });
    s.synchronize();
    const gpukit::device_buffer<float> buffer(1024, s);
    const bool allocated = gpukit::memory_allocated(d) >= buffer.size_bytes();
#ifdef GPUKIT_SEPARATE_COMPILATION
    const char* mode = "compiled mode";
#else
    const char* mode = "header-only";
#endif
    std::printf("gpukit %s from Conan (%s): %d CUDA device(s), selected %s, stream work %s, %s\n",
                GPUKIT_VERSION_STRING, mode, gpukit::device_count(), d.to_string().c_str(),
                done == 1 ? "done" : "NOT DONE", allocated ? "allocated" : "NOT ALLOCATED");
    return done == 1 && allocated ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_package: %s\n", e.what());
    return 1;
  }
}
