// gpukit — a compiled-mode translation unit that instantiates the caching engine with an upstream of its own (it
// includes caching_allocator_impl.hpp for that) and also uses the default allocators' engine, which must stay the
// library's. tests/compiled/check_custom_probe.cmake reads the symbols the object defines.
#include <gpukit/memory/caching_allocator_impl.hpp>
#include <gpukit/memory/device_allocator.hpp>

void gpukit_custom_engine_probe(gpukit::stream_view stream);
void gpukit_custom_engine_probe(gpukit::stream_view stream) {
  gpukit::basic_caching_allocator<gpukit::host_upstream> own(gpukit::device::cpu());
  own.deallocate(own.allocate(1024, stream));
  gpukit::basic_caching_allocator<gpukit::device_upstream> library_s(stream.device());
  library_s.deallocate(library_s.allocate(1024, stream));
}
