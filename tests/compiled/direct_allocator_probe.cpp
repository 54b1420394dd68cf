// gpukit — a compiled-mode translation unit that builds a caching_allocator of its own (no *_impl.hpp): the engine's
// constructor and functions must stay the library's. tests/compiled/check_custom_probe.cmake reads its symbols.
#include <gpukit/memory/device_allocator.hpp>

void gpukit_direct_allocator_probe(gpukit::stream_view stream);
void gpukit_direct_allocator_probe(gpukit::stream_view stream) {
  gpukit::caching_allocator own(stream.device());
  own.deallocate(own.allocate(1024, stream), stream);
}
