// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// async_pool_upstream: the caching allocator's segments from a CUDA memory pool (cudaMallocAsync / cudaFreeAsync)
/// instead of cudaMalloc / cudaFree, so that gpukit's cache sits in front of a pool the other libraries of the process
/// may use too (cuDNN, NCCL, a framework's cudaMallocAsync backend). That is the device's default pool unless a pool
/// is given: cudaMallocAsync uses the device's current pool (cudaDeviceGetMemPool), which is the default one unless
/// someone called cudaDeviceSetMemPool; pass that pool to share it.
///
///     // with <gpukit/memory/caching_allocator_impl.hpp> included (the engine for this upstream; compiled mode)
///     gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(gpukit::device::cuda(0));
///     gpukit::device_buffer<float> x(n, stream, a);   // a segment from the device's default pool
///     a.empty_cache();                                // segments go back to the pool, not to the driver
///
/// What it changes against cudaMalloc: a segment given back (empty_cache, trim, pressure) returns to the pool, which
/// keeps it up to its release threshold, so growing again is a pool hit instead of a driver allocation, and other
/// users of the pool can take it meanwhile. A segment is given back in stream order (deallocate_after): cudaFreeAsync
/// after events the caching allocator records on the streams that may still use it, so a release waits for nothing
/// on the host, where cudaFree waits for the whole device. What it keeps: the engine's contract
/// (synchronizes_on_free: deallocate, the fallback, waits for the device) and its hot path are those of cudaMalloc's
/// upstream; an allocation is enqueued on a private stream and waited for on the host, so a segment is usable on
/// every stream at once.
///
/// The release threshold: CUDA's default, 0, gives the pool's unused memory back to the driver at every
/// synchronization (this upstream synchronizes at each allocation), which would make every segment given back a
/// driver allocation again. So at the first allocation, a pool whose threshold is still 0 gets the constructor's (by
/// default the maximum: keep everything, as gpukit's cache does). A threshold someone set (another library,
/// gpukit::async_allocator(d, 1 GiB), cudaMemPoolSetAttribute) is theirs and is left alone. The threshold stays as
/// raised: gpukit's async_allocator and other users may count on it (putting CUDA's 0 back could not tell them
/// apart). Memory the pool keeps is not free for cudaMalloc (nor for another pool) until the pool trims it
/// (cudaMemPoolTrimTo on pool()) or this upstream is destroyed: an upstream, when destroyed, trims the pool
/// (cudaMemPoolTrimTo(pool, 0)), so that the memory it gave back goes back to the driver, except frees still queued
/// in stream order then; that also returns the unused memory other users of the pool keep cached (they get it from
/// the driver again).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/capture_held_segments.hpp>
#include <gpukit/memory/detail/upstream_stream.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/event.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// Segments from a CUDA memory pool (see the file comment). Thread-safe; not copyable or movable (the caching
/// allocator builds it in place).
class async_pool_upstream {
 public:
  /// Segments from `pool`, or from the device's default pool (cudaDeviceGetDefaultMemPool) when it is null. `pool`
  /// must be a pool of device `d` (not checked: CUDA serves a pool of another device on `d`'s streams, and the
  /// allocator would count its memory as `d`'s). At the first allocation, if the pool's release threshold is still
  /// CUDA's default (0), it becomes `release_threshold` bytes (the maximum: keep everything, as gpukit's cache does;
  /// this changes the pool for its other users too); a threshold already set is left as it is (see the file
  /// comment). Makes no CUDA call; throws invalid_argument_error for the CPU.
  explicit async_pool_upstream(gpukit::device d,
                               std::size_t release_threshold = std::numeric_limits<std::size_t>::max(),
                               cudaMemPool_t pool = nullptr)
      : device_(d), pool_(pool), release_threshold_(release_threshold) {
    if (!d.is_cuda()) {
      throw invalid_argument_error("gpukit::async_pool_upstream: " + d.to_string() +
                                   " is not a CUDA device (memory pools are a CUDA device's)");
    }
  }
  async_pool_upstream(const async_pool_upstream&) = delete;
  async_pool_upstream& operator=(const async_pool_upstream&) = delete;

  /// Waits for the work of its private stream (allocations, and frees made after a device-wide wait), trims the pool
  /// (cudaMemPoolTrimTo(pool, 0): the memory it gave back that the pool keeps goes back to the driver) and destroys
  /// the stream. Frees still queued on gpukit's shared release stream are not waited for (that stream may wait for
  /// other upstreams' streams, which a host function may hold): their memory stays in the pool, up to its threshold,
  /// which stays as raised. Failures are reported through gpukit::warn (none at process exit). Segments still out are
  /// the caching allocator's to give back first; those held back by a gpukit capture still underway stay allocated in
  /// the pool (reported).
  ~async_pool_upstream() {
    if (stream_ == nullptr) return;  // never allocated
    give_back(held_.take_at_destruction("gpukit::async_pool_upstream"), "gpukit::async_pool_upstream");
    try {
      device_guard guard(device_);
      const detail::relaxed_capture_mode relaxed;  // as in allocate: this wait and the trim join no capture
      const int ordinal = device_.ordinal();
      detail::report_cuda_failure(cudaStreamSynchronize(stream_),
                                  "cudaStreamSynchronize (async_pool_upstream, before trimming the pool)", ordinal);
      detail::report_cuda_failure(cudaMemPoolTrimTo(pool_, 0),
                                  "cudaMemPoolTrimTo(0) (async_pool_upstream, at its destruction)", ordinal);
      detail::report_cuda_failure(cudaStreamDestroy(stream_), "cudaStreamDestroy (async_pool_upstream)", ordinal);
    } catch (const error& e) {
      if (!detail::is_teardown_result(e.cuda_result())) detail::warn_parts("gpukit::async_pool_upstream: ", e.what());
    } catch (const std::exception& e) {
      detail::warn_parts("gpukit::async_pool_upstream: ", e.what());
    }
  }

  /// cudaMallocFromPoolAsync on the private stream, waited for on the host (so the segment is usable on any
  /// stream). When the pool cannot serve it, the segments given back in stream order are waited for, the pool's
  /// unused memory (which may be in pieces too small, or another user's) goes back to the driver
  /// (cudaMemPoolTrimTo(0)) and the request is tried once more; nullptr if that fails
  /// too (the caching allocator then gives back its cache and retries). Any other failure throws the matching gpukit
  /// exception.
  [[nodiscard]] void* allocate(std::size_t bytes) {
    device_guard guard(device_);
    // The private stream is never captured: its allocations, waits and trims are refused in global mode while any
    // thread captures (and invalidate that capture); relaxed, they are not.
    const detail::relaxed_capture_mode relaxed;
    const cudaStream_t s = private_stream();
    void* p = nullptr;
    cudaError_t result = cudaMallocFromPoolAsync(&p, bytes, pool_, s);
    if (result == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      give_back(held_.take_unless_capturing(device_));  // segments held back during a capture, if none runs now
      GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamSynchronize(s), "cudaStreamSynchronize (before trimming the pool)",
                                device_.ordinal());
      // Segments given back in stream order reach the pool when their streams' work is done: wait for them too.
      detail::synchronize_upstream_stream(device_, detail::upstream_stream_use::releases);
      GPUKIT_CUDA_TRY_DESCRIBED(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo", device_.ordinal());
      result = cudaMallocFromPoolAsync(&p, bytes, pool_, s);
    }
    if (result == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaMallocFromPoolAsync(" + std::to_string(bytes) + ")", device_.ordinal());
    const cudaError_t ready = cudaStreamSynchronize(s);
    if (ready != cudaSuccess) {
      (void)cudaFreeAsync(p, s);
      GPUKIT_CUDA_TRY_DESCRIBED(ready, "cudaStreamSynchronize (a segment from the pool)", device_.ordinal());
    }
    return p;
  }

  /// Waits for the device's work (as cudaFree does: queued kernels may still use the segment), then cudaFreeAsync
  /// into the pool on the private stream. Failures are reported through gpukit::warn (none at process exit); when
  /// the wait fails the segment is kept (leaked) rather than handed back while the device may still use it. The
  /// wait (cudaDeviceSynchronize) is refused during any capture, in any mode, and invalidates that capture: while a
  /// gpukit capture runs (gpukit::capture, on any thread), or a blocking stream of the device is captured (raw
  /// captures included), the segment is held back, and given back with the next one after the captures end (or at
  /// destruction). A raw capture of a non-blocking stream cannot be seen. The caching allocator takes this path only
  /// for segments it cannot order by events (used on raw stream handles, or when recording failed).
  void deallocate(void* p, std::size_t bytes) noexcept {
    // Held back during a capture, given back with the next one after the captures.
    held_.hold_or_give_back({p, bytes}, device_, true,
                            [this](span<const detail::held_segment> segments) { give_back(segments); });
  }

  /// Gives segment `p` back to the pool once the events in `after` have completed, without waiting on the host:
  /// cudaStreamWaitEvent for each on gpukit's release stream of the device (detail/upstream_stream.hpp), then
  /// cudaFreeAsync there. The caching allocator records them on the streams that may still use the segment. Another
  /// stream than the allocations', so that an allocation does not queue behind every pending release; one the pool
  /// serves from a segment whose free has not run yet waits for it (the pool adds that dependency:
  /// cudaMemPoolReuseAllowInternalDependencies), which is what makes that reuse safe. false when a call fails: the
  /// segment was not freed, and the allocator calls deallocate (which waits for the device) instead.
  bool deallocate_after(void* p, std::size_t /*bytes*/, const std::vector<const event*>& after) noexcept {
    try {
      device_guard guard(device_);
      const detail::relaxed_capture_mode relaxed;                           // as in allocate
      const cudaStream_t s = detail::release_stream_after(device_, after);  // throws on failure
      if (cudaFreeAsync(p, s) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      return true;
    } catch (...) {  // no release stream, or a wait refused
      (void)cudaGetLastError();
      return false;
    }
  }

  /// The device's free memory (cudaMemGetInfo) plus what the pool holds unused (reserved minus used), which the pool
  /// serves before asking the driver.
  upstream_memory_info memory_info() const {
    upstream_memory_info info = cuda_upstream(device_).memory_info();  // cudaMemGetInfo; never throws
    if (!info.known) return info;
    try {
      device_guard guard(device_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (pool_ == nullptr) return info;  // nothing allocated yet: the pool holds nothing of ours
      cuuint64_t reserved = 0;
      cuuint64_t used = 0;
      if (cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess &&
          cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess) {
        if (reserved > used) info.free_bytes += static_cast<std::size_t>(reserved - used);
      } else {
        (void)cudaGetLastError();
      }
    } catch (const error&) {
    }
    return info;
  }

  /// Gives back the segments held back during a capture, unless one is in sight now (the caching allocator's
  /// empty_cache and trim call it). No CUDA call when none is held.
  void release_held() noexcept { give_back(held_.take_unless_capturing(device_)); }

  /// deallocate waits for all work of the device, so the allocator need not wait before it.
  bool synchronizes_on_free() const noexcept { return true; }
  /// The CUDA device whose memory this upstream allocates.
  gpukit::device device() const noexcept { return device_; }
  /// The pool (null until the first allocation when the device's default pool was asked for).
  cudaMemPool_t pool() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pool_;
  }

 private:
  /// Gives `segments` back to the pool after the device's work. When the wait meets a capture they are held back
  /// again (at destruction, `owner` names the upstream in the warning that they stay allocated); when it fails
  /// otherwise they are kept (leaked) rather than handed back while the device may still use them.
  void give_back(span<const detail::held_segment> segments, const char* owner = nullptr) noexcept {
    if (segments.empty()) return;
    if (!held_.wait_before_giving_back(device_, "returning a segment to the pool", segments, owner)) return;
    try {
      device_guard guard(device_);
      const detail::relaxed_capture_mode relaxed;  // as in allocate
      for (const detail::held_segment& segment : segments) {
        detail::report_cuda_failure(cudaFreeAsync(segment.pointer, stream_),
                                    "cudaFreeAsync (returning a segment to the pool)", device_.ordinal());
      }
    } catch (const error& e) {
      if (detail::is_teardown_result(e.cuda_result())) return;
      detail::warn_parts("gpukit::async_pool_upstream: could not return a segment to the pool: ", e.what());
    } catch (const std::exception& e) {
      detail::warn_parts("gpukit::async_pool_upstream: could not return a segment to the pool: ", e.what());
    }
  }

  /// The private stream, created with the pool's settings at the first call (a failure is thrown, and the next call
  /// tries again).
  cudaStream_t private_stream() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream_ != nullptr) return stream_;
    if (pool_ == nullptr) {
      GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceGetDefaultMemPool(&pool_, device_.ordinal()), "cudaDeviceGetDefaultMemPool",
                                device_.ordinal());
    }
    raise_threshold_locked();  // again on a retry after a failed stream creation: it finds its own raise then
    GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags (async_pool_upstream)", device_.ordinal());
    return stream_;
  }

  /// Under mutex_, at the first allocation: raises the pool's release threshold to release_threshold_ if it is still
  /// CUDA's default (0). A threshold someone set is theirs: left alone.
  void raise_threshold_locked() {
    cuuint64_t current = 0;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &current),
                              "cudaMemPoolGetAttribute(cudaMemPoolAttrReleaseThreshold)", device_.ordinal());
    if (current != 0 || release_threshold_ == 0) return;  // set by someone (or nothing to raise): left as it is
    cuuint64_t threshold = release_threshold_;
    GPUKIT_CUDA_TRY_DESCRIBED(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
        "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold, " + std::to_string(threshold) + ")",
        device_.ordinal());
  }

  gpukit::device device_;
  mutable std::mutex mutex_;            // guards pool_ and stream_ while they are set
  cudaMemPool_t pool_ = nullptr;        // the pool segments come from
  cudaStream_t stream_ = nullptr;       // where allocations (and frees after a device-wide wait) are enqueued
  detail::capture_held_segments held_;  // segments given back during a gpukit capture, not yet freed
  std::size_t release_threshold_;
};

GPUKIT_END_NAMESPACE
