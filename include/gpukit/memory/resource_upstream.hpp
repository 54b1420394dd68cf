// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// resource_upstream<Resource>: any CCCL memory resource (cuda::mr) as the caching allocator's upstream, so gpukit's
/// cache, statistics, limits and out-of-memory handling sit in front of memory another library manages (an RMM
/// pool, a resource of your own, a `cuda::mr::resource_ref`):
///
///     // with <gpukit/memory/caching_allocator_impl.hpp> included (the engine for this upstream; compiled mode)
///     using upstream = gpukit::resource_upstream<my_resource>;
///     gpukit::caching_device_allocator<upstream> cached(d, {}, my_resource{...}, d);
///
/// Segments come from the resource's synchronous calls (CCCL 3.0: allocate/deallocate; CCCL 3.1+:
/// allocate_sync/deallocate_sync) at upstream_alignment. A stream-ordered resource (CCCL 3.0: cuda::mr::async_resource;
/// CCCL 3.1+: cuda::mr::resource) of a CUDA device is asked on gpukit's allocation stream of the device instead, which
/// is then waited for on the host: a segment must be usable on every stream at once, which a resource's "synchronous"
/// call need not promise. A refusal for lack of memory — std::bad_alloc (which RMM's out_of_memory is),
/// gpukit::out_of_memory_error, or CCCL's cuda::cuda_error for cudaErrorMemoryAllocation — is the upstream's "out of
/// memory" (nullptr): the caching allocator then releases its cache and retries before it throws. Other exceptions
/// propagate.
///
/// Giving a segment back: a stream-ordered resource of a CUDA device gets it in stream order (deallocate_after), on
/// gpukit's release stream of the device (detail/upstream_stream.hpp), which waits for events the caching allocator
/// records on the streams that may still use the segment, so nothing waits on the host. Otherwise (a synchronous
/// resource, the CPU, or where the caching allocator cannot tell the order) a segment goes back after the device's
/// work, as cudaFree does (queued kernels may still use it). Releases happen only under pressure or when asked, so
/// neither is on a hot path. That device-wide wait (cudaDeviceSynchronize) is refused during any capture, in any
/// mode, and invalidates that capture: while a gpukit capture runs (gpukit::capture, on any thread), or a blocking
/// stream of the device is captured (raw captures included), such a segment is held back, and given back with the
/// next one after the captures end, before the resource is asked again when it refuses, or at destruction. A capture
/// that begins between that look and the wait is not seen (nor a raw capture of a non-blocking stream), and the wait
/// then invalidates it.
///
/// Needs CCCL on the include path, as memory_resource.hpp does. Not included by gpukit.hpp.

#include <gpukit/memory/memory_resource.hpp>  // first: it sets up CCCL's concepts (see its file comment)

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/capture_held_segments.hpp>
#include <gpukit/memory/detail/upstream_stream.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/event.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Whether an exception type has status() (CCCL's cuda::cuda_error from CCCL 3.1 on).
template <class T, class = void>
struct has_status : std::false_type {};
template <class T>
struct has_status<T, std::void_t<decltype(std::declval<const T&>().status())>> : std::true_type {};

/// Whether a CCCL cuda_error says cudaErrorMemoryAllocation: its status() where CCCL has one (3.1+), else its
/// message, which CCCL 3.0 starts with "cudaError 2:".
template <class CudaError>
bool is_out_of_memory_status(const CudaError& error) noexcept {
  if constexpr (has_status<CudaError>::value) {
    return static_cast<int>(error.status()) == static_cast<int>(cudaErrorMemoryAllocation);
  } else {
    char prefix[32];
    std::snprintf(prefix, sizeof prefix, "cudaError %d:", static_cast<int>(cudaErrorMemoryAllocation));
    return std::strncmp(error.what(), prefix, std::strlen(prefix)) == 0;
  }
}
}  // namespace detail

/// The caching allocator's upstream over a CCCL memory resource (see the file comment). Thread-safe if the
/// resource is. Copyable and movable as the resource is; not assignable (the segments it holds back during a capture
/// belong to its resource). A copy holds none of the segments the original holds back.
template <class Resource>
class resource_upstream {
#if CCCL_VERSION >= 3001000
  static_assert(::cuda::mr::synchronous_resource<Resource>,
                "gpukit::resource_upstream needs a cuda::mr::synchronous_resource (allocate_sync / deallocate_sync)");
#else
  static_assert(::cuda::mr::resource<Resource>,
                "gpukit::resource_upstream needs a cuda::mr::resource (allocate / deallocate)");
#endif

 public:
  /// Whether the resource frees in a stream's order, so that segments can go back in stream order (deallocate_after).
#if CCCL_VERSION >= 3001000
  static constexpr bool stream_ordered = ::cuda::mr::resource<Resource>;
#else
  static constexpr bool stream_ordered = ::cuda::mr::async_resource<Resource>;
#endif

  /// Segments from `resource` (kept by value: a resource_ref, or a resource that refers to its state, shares it) for
  /// device `d`: the device whose free memory memory_info() reports (the CPU: unknown) and whose work a release waits
  /// for. Makes no CUDA call.
  resource_upstream(Resource resource, gpukit::device d) : resource_(std::move(resource)), device_(d) {}
  /// A copy over a copy of the resource, holding none of the segments `other` holds back.
  resource_upstream(const resource_upstream& other) = default;
  /// Takes over `other`'s resource and the segments it holds back.
  resource_upstream(resource_upstream&& other) = default;
  resource_upstream& operator=(const resource_upstream&) = delete;
  resource_upstream& operator=(resource_upstream&&) = delete;

  /// Gives back the segments held back during a capture (after the device's work), or, while a gpukit capture still
  /// runs, warns that they stay allocated.
  ~resource_upstream() {
    give_back(held_.take_at_destruction("gpukit::resource_upstream"), "gpukit::resource_upstream");
  }

  /// `bytes` from the resource at upstream_alignment; nullptr when it refuses for lack of memory (see the file
  /// comment), after the segments held back during a capture were given back and the segments given back in stream
  /// order were waited for (their memory reaches the resource once their streams' work is done), and the resource
  /// asked once more; other failures throw.
  [[nodiscard]] void* allocate(std::size_t bytes) {
    if constexpr (stream_ordered) {
      if (device_.is_cuda()) {
        device_guard guard(device_);  // the stream calls below must not touch another device's context
        void* p = allocate_once(bytes);
        if (p != nullptr) return p;
        // Asked again only when this upstream gave something back since it last waited: a refusal otherwise is
        // final, and asking again would run the resource's own out-of-memory handling twice.
        const bool gave_back_held = give_back(held_.take_unless_capturing(device_));
        if (releases_queued_->exchange(false)) {
          detail::synchronize_upstream_stream(device_, detail::upstream_stream_use::releases);
        } else if (!gave_back_held) {
          return nullptr;
        }
        return allocate_once(bytes);
      }
    }
    void* p = allocate_once(bytes);
    if (p == nullptr && give_back(held_.take_unless_capturing(device_))) p = allocate_once(bytes);
    return p;
  }

  /// Gives back the segments held back during a capture, unless one is in sight now (the caching allocator's
  /// empty_cache and trim call it). No CUDA call when none is held.
  void release_held() noexcept {
    if (device_.is_cuda()) (void)give_back(held_.take_unless_capturing(device_));
  }

  /// Gives a segment back: on a CUDA device after the device's work (cudaDeviceSynchronize), as cudaFree does, or,
  /// while a capture is in sight, later (see the file comment). Failures are reported through gpukit::warn, the
  /// segment then kept rather than handed back while in use.
  void deallocate(void* p, std::size_t bytes) noexcept {
    // Held back while a capture is in sight (the wait would break it); the CPU has none.
    held_.hold_or_give_back({p, bytes}, device_, device_.is_cuda(),
                            [this](span<const detail::held_segment> segments) { (void)give_back(segments); });
  }

  /// Gives segment `p` back in stream order (a stream-ordered resource only): gpukit's release stream of the device
  /// waits for the events in `after` (cudaStreamWaitEvent), then the resource frees `p` on that stream. Waits for
  /// nothing on the host. false when that is not possible (the CPU, no release stream, a refused wait, or the resource
  /// threw): nothing was freed, and the caching allocator calls deallocate (which waits for the device) instead. The
  /// resource's stream-ordered deallocate must therefore throw only when it did not free (or warn and not throw).
  template <bool Ordered = stream_ordered, std::enable_if_t<Ordered, int> = 0>
  bool deallocate_after(void* p, std::size_t bytes, const std::vector<const event*>& after) noexcept {
    if (!device_.is_cuda()) return false;
    const cudaError_t pending = cudaPeekAtLastError();  // the program's own error, not to be cleared below
    try {
      device_guard guard(device_);
      const ::cuda::stream_ref releases(detail::release_stream_after(device_, after));
#if CCCL_VERSION >= 3001000
      resource_.deallocate(releases, p, bytes, upstream_alignment);
#else
      resource_.deallocate_async(p, bytes, upstream_alignment, releases);
#endif
      releases_queued_->store(true);
      return true;
    } catch (...) {  // no release stream, a wait refused, or the resource refused the free
      // A failure of this call's (the resource's own CUDA call) is forgotten, unless the program had one pending:
      // CUDA keeps one last error, which a failing call there has already replaced (as any failing call would).
      if (pending == cudaSuccess) (void)cudaGetLastError();
      return false;
    }
  }

  /// The device's free and total memory (cudaMemGetInfo) on a CUDA device; unknown on the CPU, where the resource
  /// alone knows its capacity.
  upstream_memory_info memory_info() const {
    if (!device_.is_cuda()) return {};
    return cuda_upstream(device_).memory_info();
  }

  /// True on a CUDA device (deallocate waits for the device's work); on the CPU the caching allocator fences its
  /// frees itself.
  bool synchronizes_on_free() const noexcept { return device_.is_cuda(); }

  /// The resource segments come from.
  Resource& resource() noexcept { return resource_; }
  /// The device given at construction.
  gpukit::device device() const noexcept { return device_; }

 private:
  /// One request to the resource: nullptr when it refuses for lack of memory, other failures thrown.
  void* allocate_once(std::size_t bytes) {
    try {
      if constexpr (stream_ordered) {
        if (device_.is_cuda()) return allocate_ready(bytes);
      }
#if CCCL_VERSION >= 3001000
      return resource_.allocate_sync(bytes, upstream_alignment);
#else
      return resource_.allocate(bytes, upstream_alignment);
#endif
    } catch (const std::bad_alloc&) {
      return nullptr;
    } catch (const out_of_memory_error&) {
      return nullptr;
    } catch (const std::exception& e) {
      if (is_cccl_out_of_memory(e)) return nullptr;
      throw;
    }
  }

  /// A stream-ordered resource's allocation on gpukit's allocation stream of the device, waited for on the host: a
  /// segment must be usable on every stream at once (upstream.hpp), which a resource's "synchronous" call need not
  /// promise (gpukit's device_memory_resource orders it on the current stream). If the wait fails, the segment goes
  /// back in the stream's order and the wait's error is thrown; should that free fail too, it is reported through
  /// gpukit::warn (the segment may be lost), never thrown over the wait's error.
  void* allocate_ready(std::size_t bytes) {
    const ::cuda::stream_ref on(detail::upstream_stream(device_, detail::upstream_stream_use::allocations));
#if CCCL_VERSION >= 3001000
    void* p = resource_.allocate(on, bytes, upstream_alignment);
#else
    void* p = resource_.allocate_async(bytes, upstream_alignment, on);
#endif
    try {
      detail::synchronize_upstream_stream(device_, detail::upstream_stream_use::allocations);
    } catch (...) {
      deallocate_after_failed_wait(on, p, bytes);
      throw;
    }
    return p;
  }

  /// allocate_ready's cleanup, inside the handler of the wait's error: a free that throws would replace that error
  /// (and leave the segment to nobody), so its failure is reported instead.
  void deallocate_after_failed_wait(::cuda::stream_ref on, void* p, std::size_t bytes) noexcept {
    const auto report = [&](const char* why) noexcept {
      detail::warn_parts("gpukit::resource_upstream: a segment of ", detail::bytes_part{bytes, true}, " on ", device_,
                         " whose allocation could not be waited for could not be given back to its resource either (",
                         why, "); it may be lost");
    };
    try {
#if CCCL_VERSION >= 3001000
      resource_.deallocate(on, p, bytes, upstream_alignment);
#else
      resource_.deallocate_async(p, bytes, upstream_alignment, on);
#endif
    } catch (const std::exception& e) {
      report(e.what());
    } catch (...) {
      report("a non-standard exception");
    }
  }

  /// Gives `segments` back to the resource, on a CUDA device after the device's work. False when there was nothing to
  /// give back or the wait did not end with the device idle: when it met a capture, the segments are held back again
  /// (at destruction, `owner` names the upstream in the warning that they stay allocated); when it failed otherwise,
  /// they are kept (leaked), since the device may still use them.
  bool give_back(span<const detail::held_segment> segments, const char* owner = nullptr) noexcept {
    if (segments.empty()) return false;
    if (device_.is_cuda() &&
        !held_.wait_before_giving_back(device_, "returning a segment to a cuda::mr resource", segments, owner)) {
      return false;
    }
    for (const detail::held_segment& segment : segments) deallocate_now(segment);
    return true;
  }

  /// The resource's synchronous deallocate; a failure is reported through gpukit::warn.
  void deallocate_now(detail::held_segment segment) noexcept {
    try {
#if CCCL_VERSION >= 3001000
      resource_.deallocate_sync(segment.pointer, segment.bytes, upstream_alignment);
#else
      resource_.deallocate(segment.pointer, segment.bytes, upstream_alignment);
#endif
    } catch (const std::exception& e) {
      detail::warn_parts("gpukit::resource_upstream: could not return a segment of ", segment.bytes,
                         " bytes to its resource: ", e.what());
    } catch (...) {
      warn("gpukit::resource_upstream: could not return a segment to its resource (a non-standard exception)");
    }
  }

  /// Whether `e` is CCCL's cuda::cuda_error for cudaErrorMemoryAllocation.
  static bool is_cccl_out_of_memory(const std::exception& e) noexcept {
    const auto* error = dynamic_cast<const ::cuda::cuda_error*>(&e);
    return error != nullptr && detail::is_out_of_memory_status(*error);
  }

  Resource resource_;
  gpukit::device device_;
  detail::capture_held_segments held_;  // segments given back during a gpukit capture, not yet freed
  // Set when a release was queued in stream order, cleared when allocate waits for the queue. Shared by copies.
  std::shared_ptr<std::atomic<bool>> releases_queued_ = std::make_shared<std::atomic<bool>>(false);
};

GPUKIT_END_NAMESPACE
