// The per-thread default-stream translation unit of odr_mode_test.cpp, compiled with
// CUDA_API_PER_THREAD_DEFAULT_STREAM defined (tests.cmake), as nvcc --default-stream per-thread does.
#include <gpukit/gpukit.hpp>
#include <gpukit/device/peer_access.hpp>

#include <string>

#ifndef CUDA_API_PER_THREAD_DEFAULT_STREAM
#error "tests.cmake must compile this file with CUDA_API_PER_THREAD_DEFAULT_STREAM defined"
#endif
static_assert(gpukit::detail::per_thread_default_stream_mode(), "this translation unit is in the per-thread mode");

using mode_function = bool (*)() noexcept;
mode_function odr_mode_per_thread_tu_mode_function() { return &gpukit::detail::per_thread_default_stream_mode; }
const void* odr_mode_per_thread_tu_default_allocators() { return &gpukit::detail::default_allocators(); }
std::string odr_mode_per_thread_tu_device_text() { return gpukit::device::parse("cuda:2").to_string(); }
const void* odr_mode_per_thread_tu_peer_access_holders_v2() {
  return &gpukit::mode_independent::peer_access_holders_v2();
}
const void* odr_mode_per_thread_tu_capture_holds() { return &gpukit::mode_independent::capture_holds(); }
const void* odr_mode_per_thread_tu_cuda_environment() { return &gpukit::detail::cuda_environment_at_init(); }
