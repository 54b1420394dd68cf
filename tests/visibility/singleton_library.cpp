// A shared library built with -fvisibility=hidden -fvisibility-inlines-hidden (see tests.cmake), twice: as
// gpukit_visibility_a and gpukit_visibility_b. It exports only the C functions below; gpukit's own exported
// (GPUKIT_EXPORT) functions are the only other symbols it shares with the process.
#include "singletons.hpp"

#include <gpukit/error.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#define GPUKIT_VISIBILITY_CONCAT2(a, b) a##b
#define GPUKIT_VISIBILITY_CONCAT(a, b) GPUKIT_VISIBILITY_CONCAT2(a, b)
#define GPUKIT_VISIBILITY_ENTRY(name) \
  GPUKIT_VISIBILITY_CONCAT(GPUKIT_VISIBILITY_CONCAT(gpukit_visibility_, GPUKIT_VISIBILITY_LIBRARY), name)

extern "C" __attribute__((visibility("default"))) gpukit_visibility::singleton_addresses GPUKIT_VISIBILITY_ENTRY(
    _singletons)() {
  return gpukit_visibility::collect_singleton_addresses();
}

extern "C" __attribute__((visibility("default"))) void GPUKIT_VISIBILITY_ENTRY(_warn)(const char* message) {
  gpukit::warn(std::string_view(message));
}

// A caching allocator of the CPU whose engine this library's copy of gpukit runs (its engine() calls are inline and
// hidden here), with a reserved limit of 8 MiB.
extern "C" __attribute__((visibility("default"))) gpukit::caching_allocator* GPUKIT_VISIBILITY_ENTRY(
    _make_allocator)() {
  gpukit::allocator_options o;
  o.reserved_limit = std::size_t{8} << 20;
  return new gpukit::caching_allocator(gpukit::device::cpu(), o);
}

extern "C" __attribute__((visibility("default"))) void GPUKIT_VISIBILITY_ENTRY(_destroy_allocator)(
    gpukit::caching_allocator* a) {
  delete a;
}

// An allocation over the limit, whose error calls the observers from this library's copy; true if it was refused.
extern "C" __attribute__((visibility("default"))) bool GPUKIT_VISIBILITY_ENTRY(_out_of_memory)(
    gpukit::caching_allocator* a) {
  try {
    a->engine().deallocate(
        a->engine().allocate(std::size_t{64} << 20, gpukit::stream_view::default_stream(gpukit::device::cpu())));
  } catch (const gpukit::out_of_memory_error&) {
    return true;
  }
  return false;
}

// Adds an observer that removes itself through this library's copy, from inside its call (which must not wait for
// that call); each call adds 1 to `calls`, and 1 to `removed` when the removal succeeded.
extern "C" __attribute__((visibility("default"))) void GPUKIT_VISIBILITY_ENTRY(_add_self_removing_observer)(
    gpukit::caching_allocator* a, std::atomic<int>* calls, std::atomic<int>* removed) {
  auto id = std::make_shared<std::uint64_t>(0);
  *id = a->engine().add_out_of_memory_observer([a, id, calls, removed](const gpukit::out_of_memory_info&) {
    ++*calls;
    if (a->engine().remove_out_of_memory_observer(*id)) ++*removed;
  });
}
