// Default-stream modes (include/gpukit/detail/config.hpp): this translation unit uses the legacy default stream,
// odr_mode_per_thread_tu.cpp the per-thread one (CUDA_API_PER_THREAD_DEFAULT_STREAM, see tests.cmake). gpukit's
// inline functions differ between the modes, so each mode must get its own symbols (an inline namespace per mode);
// with one set of names the linker would keep one definition for both translation units.
#include <gpukit/gpukit.hpp>
#include <gpukit/device/peer_access.hpp>

#include <doctest/doctest.h>

#include <string>

// Defined in odr_mode_per_thread_tu.cpp.
using mode_function = bool (*)() noexcept;
mode_function odr_mode_per_thread_tu_mode_function();
const void* odr_mode_per_thread_tu_default_allocators();
std::string odr_mode_per_thread_tu_device_text();
const void* odr_mode_per_thread_tu_peer_access_holders_v2();
const void* odr_mode_per_thread_tu_capture_holds();
const void* odr_mode_per_thread_tu_cuda_environment();

namespace {
mode_function this_tu_mode_function() { return &gpukit::detail::per_thread_default_stream_mode; }
}  // namespace

TEST_CASE("translation units in the two default-stream modes each get their own gpukit") {
  static_assert(!gpukit::detail::per_thread_default_stream_mode(), "this translation unit is in the legacy mode");
  // Called through pointers, so the linker's choice of definition is what runs (a constant would be folded).
  const mode_function legacy = this_tu_mode_function();
  const mode_function per_thread = odr_mode_per_thread_tu_mode_function();
  const bool distinct_functions = legacy != per_thread;  // (doctest cannot print function pointers)
  CHECK(distinct_functions);
  CHECK_FALSE(legacy());
  CHECK(per_thread());
  // Each mode has its own process-wide state too (documented in the README, "Default-stream mode").
  CHECK(odr_mode_per_thread_tu_default_allocators() != static_cast<const void*>(&gpukit::detail::default_allocators()));
  // Except the driver's own process-wide state: peer access is counted once for both modes.
  CHECK(odr_mode_per_thread_tu_peer_access_holders_v2() ==
        static_cast<const void*>(&gpukit::mode_independent::peer_access_holders_v2()));
  // And the gate of gpukit's captures: a capture begun in one mode waits for work on the legacy stream in the other.
  CHECK(odr_mode_per_thread_tu_capture_holds() == static_cast<const void*>(&gpukit::mode_independent::capture_holds()));
  // And CUDA_VISIBLE_DEVICES as CUDA read it (once per process), which both modes' error messages name.
  CHECK(odr_mode_per_thread_tu_cuda_environment() ==
        static_cast<const void*>(&gpukit::detail::cuda_environment_at_init()));
  // Both copies work.
  CHECK(odr_mode_per_thread_tu_device_text() == gpukit::device::cuda(2).to_string());
}
