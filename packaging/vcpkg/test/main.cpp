// gpukit from its vcpkg port: include, select a device (the CPU without a GPU), run work on a stream.
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
    std::printf("gpukit %s from vcpkg: %d CUDA device(s), selected %s, stream work %s\n", GPUKIT_VERSION_STRING,
                gpukit::device_count(), d.to_string().c_str(), done == 1 ? "done" : "NOT DONE");
    return done == 1 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpukit_vcpkg_consumer: %s\n", e.what());
    return 1;
  }
}
