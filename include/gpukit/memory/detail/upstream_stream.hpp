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
/// later), and a destroyed handle may become another stream's. Nothing is done at process exit.

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

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// What an upstream stream carries.
enum class upstream_stream_use : unsigned char { allocations = 0, releases = 1 };

/// The upstream streams of every device, created on demand (exported: one per process).
struct upstream_streams {
  std::mutex mutex;
  std::vector<std::array<cudaStream_t, 2>> by_ordinal;  // null until created
};
GPUKIT_EXPORT inline upstream_streams& upstream_streams_of_process() {
  static auto* streams = new upstream_streams;  // never destroyed: upstreams may be used by other statics' destructors
  return *streams;
}

/// The stream of CUDA device `d` for `use`, created at the first call (cudaStreamCreateWithFlags, non-blocking, with
/// `d` current); null when `create` is false and it does not exist yet. Throws when it cannot be created (the next
/// call tries again).
inline cudaStream_t upstream_stream(gpukit::device d, upstream_stream_use use, bool create = true) {
  upstream_streams& all = upstream_streams_of_process();
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
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamSynchronize(s),
                            use == upstream_stream_use::releases ? "cudaStreamSynchronize (upstream releases)"
                                                                 : "cudaStreamSynchronize (upstream allocations)",
                            d.ordinal());
}

}  // namespace detail
GPUKIT_END_NAMESPACE
