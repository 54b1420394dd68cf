// Both default-stream modes in one process (the other half: mixed_modes_per_thread.cpp), on the simulator: state the
// modes share because they share CUDA's streams.
#include <gpukit/stream/stream.hpp>

#include "cudasim.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

static_assert(!gpukit::detail::per_thread_default_stream_mode(), "this file must be compiled in legacy mode");

namespace per_thread_mode {
/// Creates a stream in per-thread mode, makes it that mode's current stream on this thread, and releases it.
cudaStream_t release_current_stream(int ordinal);
/// Whether per-thread mode's current_stream() says its stream was destroyed.
bool current_stream_destroyed(int ordinal);
/// Makes the default stream per-thread mode's current stream again.
void reset_current_stream(int ordinal);
}  // namespace per_thread_mode

TEST_CASE("mixed modes: a stream released in one mode keeps its record there until a gpukit::stream destroys it") {
  // Found by review: the released records were kept per mode, so a handle reused by the other mode's new stream left
  // the record, and the first mode's current stream named the new stream.
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  const cudaStream_t handle = per_thread_mode::release_current_stream(0);
  CHECK_FALSE(per_thread_mode::current_stream_destroyed(0));  // kept by handle: the stream lives
  {
    // Owned again by this mode (its own record: the other mode's stays with that mode's views), then destroyed.
    gpukit::stream owner = gpukit::stream::wrap(handle, cuda0, true);
    CHECK_FALSE(per_thread_mode::current_stream_destroyed(0));
  }
  CHECK(per_thread_mode::current_stream_destroyed(0));
  per_thread_mode::reset_current_stream(0);
  gpukit::stream reused(cuda0);  // the simulator hands the handle out again
  REQUIRE(reused.cuda_handle() == handle);
  CHECK_FALSE(per_thread_mode::current_stream_destroyed(0));
  CHECK(cudasim::violations().empty());
}

TEST_CASE("mixed modes: a stream released in both modes keeps both records while it lives") {
  // Found by review: one record per handle, so the second mode's release freed the first mode's record.
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  const cudaStream_t handle = per_thread_mode::release_current_stream(0);
  {
    gpukit::stream owner = gpukit::stream::wrap(handle, cuda0, true);
    REQUIRE(owner.release() == handle);
  }
  CHECK_FALSE(per_thread_mode::current_stream_destroyed(0));
  {
    gpukit::stream owner = gpukit::stream::wrap(handle, cuda0, true);  // takes this mode's record back
  }
  CHECK(per_thread_mode::current_stream_destroyed(0));
  per_thread_mode::reset_current_stream(0);
  CHECK(cudasim::violations().empty());
}
