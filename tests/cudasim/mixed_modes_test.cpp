// Both default-stream modes in one process (the other half: mixed_modes_per_thread.cpp), on the simulator: state the
// modes share because they share CUDA's streams.
#include <gpukit/graph/graph.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>

#include "cudasim.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <memory>
#include <optional>

static_assert(!gpukit::detail::per_thread_default_stream_mode(), "this file must be compiled in legacy mode");

namespace per_thread_mode {
/// Creates a stream in per-thread mode, makes it that mode's current stream on this thread, and releases it.
cudaStream_t release_current_stream(int ordinal);
/// Whether per-thread mode's current_stream() says its stream was destroyed.
bool current_stream_destroyed(int ordinal);
/// Makes the default stream per-thread mode's current stream again.
void reset_current_stream(int ordinal);
/// The handle of a stream of a per-thread-mode stream_pool's next().
cudaStream_t pool_next_handle(int ordinal);
/// Whether per-thread-mode gpukit::capture refuses `handle`.
bool capture_refused(cudaStream_t handle);
/// Per-thread-mode set_current_stream of a view made from `handle`.
void make_current_by_handle(int ordinal, cudaStream_t handle);
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

TEST_CASE("mixed modes: a pool's shared stream named by its raw handle is refused by either mode's capture") {
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  // A raw handle is how a stream crosses from one mode to the other: its owner's record says what it is (helper-188).
  gpukit::stream_pool pool(cuda0, 1);
  const cudaStream_t legacy_owned = pool.next().cuda_handle();
  const cudaStream_t per_thread_owned = per_thread_mode::pool_next_handle(0);
  CHECK_THROWS_AS(gpukit::capture(per_thread_owned, [] {}), gpukit::invalid_argument_error);
  CHECK(per_thread_mode::capture_refused(legacy_owned));
  CHECK(per_thread_mode::capture_refused(per_thread_owned));
  CHECK(cudasim::violations().empty());
}

TEST_CASE("mixed modes: a stream made current by its raw handle in the other mode is noticed destroyed") {
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  std::optional<gpukit::stream> s(std::in_place, cuda0);
  const cudaStream_t handle = s->cuda_handle();
  per_thread_mode::make_current_by_handle(0, handle);
  CHECK_FALSE(per_thread_mode::current_stream_destroyed(0));
  // Remembered elsewhere too (an allocator would hold its record): its destruction is counted in this mode only.
  const std::shared_ptr<const gpukit::detail::stream_life> held = s->view().lifetime();
  s.reset();
  const gpukit::stream next(cuda0);
  REQUIRE(next.cuda_handle() == handle);  // the simulator reuses the handle at once
  CHECK(per_thread_mode::current_stream_destroyed(0));
  per_thread_mode::reset_current_stream(0);
  CHECK(cudasim::violations().empty());
}
