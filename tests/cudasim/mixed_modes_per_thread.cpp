// The per-thread default stream half of test_sim_mixed_modes (compiled with CUDA_API_PER_THREAD_DEFAULT_STREAM, see
// cudasim.cmake): gpukit of this mode lives in its own ABI namespace, so the other half reaches it only through these
// functions, which take plain types.
#include <gpukit/graph/graph.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>

#include <cuda_runtime_api.h>

static_assert(gpukit::detail::per_thread_default_stream_mode(), "this file must be compiled in per-thread mode");

namespace per_thread_mode {

cudaStream_t release_current_stream(int ordinal) {
  gpukit::stream s(gpukit::device::cuda(ordinal));
  gpukit::set_current_stream(s);
  return s.release();
}

bool current_stream_destroyed(int ordinal) {
  try {
    (void)gpukit::current_stream(gpukit::device::cuda(ordinal));
    return false;
  } catch (const gpukit::invalid_argument_error&) {
    return true;
  }
}

cudaStream_t pool_next_handle(int ordinal) {
  static gpukit::stream_pool pool(gpukit::device::cuda(ordinal), 1);
  return pool.next().cuda_handle();
}

bool capture_refused(cudaStream_t handle) {
  try {
    (void)gpukit::capture(handle, [] {});
    return false;
  } catch (const gpukit::invalid_argument_error&) {
    return true;
  }
}

void make_current_by_handle(int ordinal, cudaStream_t handle) {
  gpukit::set_current_stream(gpukit::stream_view(gpukit::device::cuda(ordinal), handle));
}

void reset_current_stream(int ordinal) {
  gpukit::set_current_stream(gpukit::stream_view::default_stream(gpukit::device::cuda(ordinal)));
}

}  // namespace per_thread_mode
