// gpukit — a translation unit as users write them (device_buffer, copy_async), compiled in both modes by
// tests/compiled/tests.cmake, whose check_probe.cmake reads the symbols each object file defines.
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/transfer/copy.hpp>

#include <vector>

void gpukit_compiled_probe(const std::vector<float>& host, gpukit::stream_view stream);
void gpukit_compiled_probe(const std::vector<float>& host, gpukit::stream_view stream) {
  gpukit::device_buffer<float> buffer(host.size(), stream);
  gpukit::copy_async(buffer, host, stream);
  stream.synchronize();
}
