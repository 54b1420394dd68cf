// A shared library built with -fvisibility=hidden -fvisibility-inlines-hidden (see tests.cmake), twice: as
// gpukit_visibility_a and gpukit_visibility_b. It exports only the two C functions below; gpukit's own exported
// (GPUKIT_EXPORT) functions are the only other symbols it shares with the process.
#include "singletons.hpp"

#include <gpukit/error.hpp>

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
