// memory_stats: the caching allocator at work, and how it explains itself. Allocates some device buffers on the
// first GPU (or on the CPU device when there is none), frees a few, prints memory_summary(), empties the cache,
// and shows the out-of-memory message under a reserved limit. Exits 0.
#include <gpukit/gpukit.hpp>

#include <cstdio>
#include <exception>
#include <vector>

static int run() {
  const gpukit::device d = gpukit::device_count() > 0 ? gpukit::device::cuda(0) : gpukit::device::cpu();
  std::printf("allocating on %s\n", d.to_string().c_str());
  gpukit::stream s(d);
  {
    // A few "layers" of activations and a scratch buffer, like a forward pass.
    std::vector<gpukit::device_buffer<float>> activations;
    for (std::size_t layer = 0; layer < 8; ++layer) activations.emplace_back((layer + 1) << 18, s);
    gpukit::device_buffer<char> scratch(3 << 20, s);
    gpukit::device_allocation small_tensor(1000, s);
    activations.erase(activations.begin() + 2, activations.begin() + 5);  // freed in s's order, cached
    std::printf("memory_allocated = %s, memory_reserved = %s, max_memory_allocated = %s\n",
                gpukit::detail::format_bytes(gpukit::memory_allocated(d)).c_str(),
                gpukit::detail::format_bytes(gpukit::memory_reserved(d)).c_str(),
                gpukit::detail::format_bytes(gpukit::max_memory_allocated(d)).c_str());
    std::puts(gpukit::memory_summary(d).c_str());
  }
  s.synchronize();
  gpukit::empty_cache(d);  // every completely free segment goes back to the device
  std::printf("after empty_cache: memory_reserved = %s\n",
              gpukit::detail::format_bytes(gpukit::memory_reserved(d)).c_str());

  gpukit::set_reserved_memory_limit(std::size_t{64} << 20, d);
  try {
    gpukit::device_buffer<char> too_big((std::size_t{100} << 20) + 1, s);
  } catch (const gpukit::out_of_memory_error& e) {
    std::printf("\n%s\n", e.what());
  }
  gpukit::set_reserved_memory_limit(gpukit::allocator_options::unlimited, d);
  std::printf("out-of-memory errors so far: %lld\n", static_cast<long long>(gpukit::memory_stats(d).num_ooms));
  return 0;
}

// Any gpukit error (a bad GPUKIT_ALLOC_CONF, no memory, a CUDA failure) is printed, and the exit code says it: 1.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_stats: %s\n", e.what());
    return 1;
  }
}
