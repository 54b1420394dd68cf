// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The streams on which upstreams enqueue their own work: the segments they give back in stream order (the upstream
/// contract's deallocate_after, upstream.hpp), on a stream made to wait for the caching allocator's events so that a
/// release waits for nothing on the host; and allocations from a stream-ordered source, waited for on the host so
/// that a segment is usable on every stream. Two streams per device, so that an allocation never queues behind the
/// releases, shared by every upstream of the process (async_pool_upstream, resource_upstream).
///
/// They are never destroyed, like PyTorch's pooled streams: a resource behind an upstream may keep the handle (a
/// gpukit caching allocator behind device_memory_resource keeps a state for each stream it saw, and asks about it
/// later), and a destroyed handle may become another stream's. Nothing is done at process exit. cudaDeviceReset
/// destroys them under gpukit's feet: it is not supported while gpukit's upstreams are in use.
///
/// Sharing has a cost: with a pool that serves an allocation from memory whose release is still queued (a
/// cudaMallocAsync pool's internal dependencies), the host wait for that allocation waits for the streams the release
/// waits for, and so do other threads' allocations queued behind it on the device's allocation stream.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

// One set per process, outside the per-mode namespace that gives each default-stream mode its own copy of gpukit
// (detail/config.hpp): an out-of-memory retry in one mode must wait for the releases queued by the other, and the
// streams (non-blocking, created explicitly) do not depend on the mode.
namespace gpukit {
namespace mode_independent {

/// The upstream streams of every device, by ordinal: [0] allocations, [1] releases, null until created.
struct upstream_streams {
  std::mutex mutex;  ///< guards by_ordinal and the creation of streams
  std::vector<std::array<cudaStream_t, 2>> by_ordinal;
};
/// The process's upstream_streams (exported: one per process). Never destroyed: upstreams may be used by other
/// statics' destructors. The name carries the layout's version, as peer_access_holders_v2's does.
GPUKIT_EXPORT inline upstream_streams& upstream_streams_v1() {
  static auto* streams = new upstream_streams;
  return *streams;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// What an upstream stream carries.
enum class upstream_stream_use : unsigned char { allocations = 0, releases = 1 };

/// The stream of CUDA device `d` for `use`, created at the first call (cudaStreamCreateWithFlags, non-blocking, with
/// `d` current); null when `create` is false and it does not exist yet. Throws when it cannot be created (the next
/// call tries again).
inline cudaStream_t upstream_stream(gpukit::device d, upstream_stream_use use, bool create = true) {
  mode_independent::upstream_streams& all = mode_independent::upstream_streams_v1();
  const auto ordinal = static_cast<std::size_t>(d.ordinal());
  const auto slot = static_cast<std::size_t>(use);
  std::lock_guard<std::mutex> lock(all.mutex);
  if (ordinal < all.by_ordinal.size() && all.by_ordinal[ordinal][slot] != nullptr) return all.by_ordinal[ordinal][slot];
  if (!create) return nullptr;
  if (all.by_ordinal.size() <= ordinal) all.by_ordinal.resize(ordinal + 1, {nullptr, nullptr});
  device_guard guard(d);
  cudaStream_t s = nullptr;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                            use == upstream_stream_use::releases ? "cudaStreamCreateWithFlags (upstream releases)"
                                                                 : "cudaStreamCreateWithFlags (upstream allocations)",
                            d.ordinal());
  all.by_ordinal[ordinal][slot] = s;
  return s;
}

/// The release stream of CUDA device `d`, made to wait (cudaStreamWaitEvent) for each of `after`: what is enqueued
/// on it next runs once they have completed. Throws on failure (then what was enqueued, if anything, is a wait only).
inline cudaStream_t release_stream_after(gpukit::device d, const std::vector<const event*>& after) {
  const cudaStream_t s = upstream_stream(d, upstream_stream_use::releases);
  const stream_view view(d, s);
  for (const event* e : after) e->wait(view);
  return s;
}

/// Waits on the host for what was enqueued on device `d`'s stream for `use` (nothing if it was never created), e.g.
/// so that the segments given back in stream order are back where they came from. Throws on failure.
inline void synchronize_upstream_stream(gpukit::device d, upstream_stream_use use) {
  const cudaStream_t s = upstream_stream(d, use, false);
  if (s == nullptr) return;
  const relaxed_capture_mode relaxed;  // refused in global mode while any thread captures, and invalidating it
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamSynchronize(s),
                            use == upstream_stream_use::releases ? "cudaStreamSynchronize (upstream releases)"
                                                                 : "cudaStreamSynchronize (upstream allocations)",
                            d.ordinal());
}

}  // namespace detail
GPUKIT_END_NAMESPACE
