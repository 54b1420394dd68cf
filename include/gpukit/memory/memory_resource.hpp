// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// gpukit memory as CCCL memory resources (cuda::mr), so that code written against cuda::mr::resource_ref, CCCL
/// containers or RMM-style adaptors can use gpukit's caching allocator and pinned pool:
///
///     gpukit::device_memory_resource mr(gpukit::device::cuda(0));        // the default allocator of cuda:0
///     cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{mr};  // CCCL 3.0 (resource_ref from 3.1)
///     void* p = ref.allocate_async(1 << 20, 256, stream);
///
/// Both of CCCL's shapes are provided by each class, so the same code builds against the toolkit's CCCL and a
/// newer one:
/// - CCCL 3.0 (CUDA 13.0): `resource` = allocate(bytes, alignment) / deallocate(p, bytes, alignment);
///   `async_resource` adds allocate_async(bytes, alignment, stream) / deallocate_async(p, bytes, alignment, stream).
///   These concepts need LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE, which this header defines when it is
///   included before <cuda/memory_resource> (include it first, or define the macro for the whole build).
/// - CCCL 3.1 and later: `synchronous_resource` = allocate_sync / deallocate_sync; `resource` adds
///   allocate(stream, bytes, alignment) / deallocate(stream, p, bytes, alignment).
///
/// Synchronous calls are ordered on the calling thread's current stream of the device (current_stream(device):
/// the default stream unless a stream_guard says otherwise), as PyTorch orders everything: the memory is ready for
/// work on that stream at once. Stream-ordered calls use the stream given. Resources refer to the allocator or
/// pool they were made from (which must outlive them) and compare equal when they refer to the same one.
///
/// Needs CCCL on the include path (gpukit's CMake targets, pkg-config file and Conan package bring the toolkit's;
/// nvcc adds it itself). Not included by gpukit.hpp.

#include <cuda/std/version>  // CCCL_VERSION, before anything else of CCCL decides the concepts' shape

#if CCCL_VERSION < 3001000 && !defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE)
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/pinned_aligned.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream_ref.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>
#include <string>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// `d`, or invalid_argument_error naming `resource` when `d` is the CPU device: its memory is ordinary host memory,
/// which the resource's cuda::mr::device_accessible property would misstate.
inline gpukit::device cuda_only(gpukit::device d, const char* resource) {
  if (d.is_cpu()) {
    throw invalid_argument_error(std::string("gpukit::") + resource +
                                 ": the CPU device's memory is ordinary host memory, not device-accessible as "
                                 "cuda::mr::device_accessible says (use a CUDA device)");
  }
  return d;
}

/// A resource's stream as a view: a default stream is the resource's device's (its handle does not say which
/// device); any other handle's device is asked of CUDA, so a stream of another device is refused by an allocator, and
/// a pinned block waits for the stream on its own device.
inline stream_view view_of(::cuda::stream_ref stream, gpukit::device resource_device) {
  const cudaStream_t handle = stream.get();
  return is_default_stream_handle(handle) ? stream_view(resource_device, handle) : stream_view(handle);
}

/// CCCL 3.0's names for a resource's calls (`resource`: allocate/deallocate(bytes, alignment); `async_resource`:
/// allocate_async/deallocate_async), forwarded to the CCCL 3.1+ names Derived defines (allocate_sync,
/// deallocate_sync, allocate(stream, ...), deallocate(stream, ...)). Derived says `using` for allocate and
/// deallocate: its own overloads would hide these.
template <class Derived, std::size_t DefaultAlignment>
class cccl_3_0_names {
 public:
  void* allocate(std::size_t bytes, std::size_t alignment = DefaultAlignment) {
    return self().allocate_sync(bytes, alignment);
  }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = DefaultAlignment) {
    self().deallocate_sync(p, bytes, alignment);
  }
  void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref stream) {
    return self().allocate(stream, bytes, alignment);
  }
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, ::cuda::stream_ref stream) {
    self().deallocate(stream, p, bytes, alignment);
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};
}  // namespace detail

/// A device_resource (by default the per-device default allocator) as a cuda::mr resource: device-accessible,
/// stream-ordered, with statistics and caching from the allocator. Alignments above the allocator's natural one
/// (256 bytes) are honoured by device_resource::allocate. CUDA devices only: the CPU device's memory is ordinary host
/// memory, which the type's cuda::mr::device_accessible would misstate, so it is refused (invalid_argument_error).
class device_memory_resource
    : public detail::cccl_3_0_names<device_memory_resource, device_resource::default_alignment> {
 public:
  using cccl_3_0_names::allocate;
  using cccl_3_0_names::deallocate;

  /// The default allocator of `d` (default_allocator(d); `Deferred`, never given, is explained there). Throws
  /// invalid_argument_error for the CPU device.
  template <int Deferred = 0>
  explicit device_memory_resource(gpukit::device d)
      : allocator_(&default_allocator(detail::cuda_only(d, "device_memory_resource"))) {}
  /// `allocator`, which must outlive this resource and its copies. Throws invalid_argument_error for an allocator of
  /// the CPU device.
  explicit device_memory_resource(device_resource& allocator) : allocator_(&allocator) {
    (void)detail::cuda_only(allocator.device(), "device_memory_resource");
  }

  /// The allocator behind this resource.
  device_resource& allocator() const noexcept { return *allocator_; }
  /// The device whose memory this resource hands out.
  gpukit::device device() const noexcept { return allocator_->device(); }

  // CCCL 3.1 and later (CCCL 3.0's names come from cccl_3_0_names).

  /// `bytes` aligned to `alignment`, ready for work on the calling thread's current stream of the device.
  /// Stream-ordered like everything in gpukit, not synchronous: the block may have been freed on that stream by
  /// work still running there, so use it on that stream (or order another stream, or the host, after it).
  void* allocate_sync(std::size_t bytes, std::size_t alignment = device_resource::default_alignment) {
    return allocator_->allocate(bytes, alignment, current_stream(device()));
  }
  /// Frees `p` once the work enqueued so far on the calling thread's current stream of the device (and on the stream
  /// it was allocated on) is done, as device_pmr_resource does: the memory may have been used on the current stream
  /// (a stream_guard's). A current stream destroyed meanwhile leaves the allocation's stream alone. CCCL's references
  /// call it noexcept: a refused free (a pointer this allocator does not own, a double free) is reported through
  /// gpukit::warn.
  void deallocate_sync(void* p, std::size_t /*bytes*/,
                       std::size_t /*alignment*/ = device_resource::default_alignment) noexcept {
    detail::free_reporting_errors("gpukit::device_memory_resource::deallocate", [&] {
      stream_view on;
      try {
        on = current_stream(device());
      } catch (const invalid_argument_error&) {  // the current stream was destroyed: freed on the allocation's
        allocator_->deallocate(p);
        return;
      }
      allocator_->deallocate(p, on);
    });
  }
  /// `bytes` aligned to `alignment`, usable on `stream` at once.
  void* allocate(::cuda::stream_ref stream, std::size_t bytes, std::size_t alignment) {
    return allocator_->allocate(bytes, alignment, detail::view_of(stream, device()));
  }
  /// Frees `p` once the work enqueued so far on `stream` (and on the stream it was allocated on) is done. Errors
  /// are reported through gpukit::warn, as for deallocate_sync.
  void deallocate(::cuda::stream_ref stream, void* p, std::size_t /*bytes*/, std::size_t /*alignment*/) noexcept {
    detail::free_reporting_errors("gpukit::device_memory_resource::deallocate",
                                  [&] { allocator_->deallocate(p, detail::view_of(stream, device())); });
  }

  /// Equal when both use the same allocator (memory from one may be freed through the other).
  friend bool operator==(const device_memory_resource& a, const device_memory_resource& b) noexcept {
    return a.allocator_ == b.allocator_;
  }
  /// Not equal when they use different allocators.
  friend bool operator!=(const device_memory_resource& a, const device_memory_resource& b) noexcept {
    return !(a == b);
  }
  /// Device memory: kernels may touch it.
  friend void get_property(const device_memory_resource& /*resource*/, ::cuda::mr::device_accessible) noexcept {}

 private:
  device_resource* allocator_;
};

/// A pinned_pool (by default the process-wide one of a device) as a cuda::mr resource: page-locked host memory,
/// host- and device-accessible. Frees return a block after the work enqueued so far on the stream (the calling
/// thread's current stream of the resource's device for deallocate_sync), as pinned_pool::deallocate(p, stream) does;
/// during a capture of that stream, after the capture ends (pinned_pool::deallocate_after_captures). Blocks are
/// 256-byte aligned; larger power-of-two alignments cost up to `alignment - 256` extra bytes. CUDA devices and
/// page-locked pools only: the CPU device's pool holds ordinary host memory, which the type's
/// cuda::mr::device_accessible would misstate, so it is refused (invalid_argument_error).
class pinned_memory_resource : public detail::cccl_3_0_names<pinned_memory_resource, detail::pinned_natural_alignment> {
 public:
  using cccl_3_0_names::allocate;
  using cccl_3_0_names::deallocate;

  /// The alignment of every pinned block.
  static constexpr std::size_t natural_alignment = detail::pinned_natural_alignment;

  /// default_pinned_pool(d). Throws invalid_argument_error for the CPU device.
  explicit pinned_memory_resource(gpukit::device d)
      : pinned_memory_resource(default_pinned_pool(detail::cuda_only(d, "pinned_memory_resource")), d) {}
  /// `pool`, which must outlive this resource and its copies; stream-ordered calls name streams of device `d`. Throws
  /// invalid_argument_error for the CPU device or a pool that is not page-locked (pinned_upstream of the CPU).
  pinned_memory_resource(pinned_pool& pool, gpukit::device d)
      : pool_(&pool), device_(detail::cuda_only(d, "pinned_memory_resource")) {
    if (!pool.page_locked()) {
      throw invalid_argument_error(
          "gpukit::pinned_memory_resource: the pool's memory is not page-locked (a CPU pool), so not "
          "device-accessible as cuda::mr::device_accessible says");
    }
  }

  /// The pool behind this resource.
  pinned_pool& pool() const noexcept { return *pool_; }
  /// The device whose current stream orders the "synchronous" calls (allocate_sync, deallocate_sync).
  gpukit::device device() const noexcept { return device_; }

  // CCCL 3.1 and later (CCCL 3.0's names come from cccl_3_0_names).

  /// `bytes` of pinned memory aligned to `alignment`, usable at once.
  void* allocate_sync(std::size_t bytes, std::size_t alignment = natural_alignment) {
    return detail::pinned_allocate_aligned(*pool_, bytes, alignment, "gpukit::pinned_memory_resource::allocate");
  }
  /// Returns `p` to the pool once the work enqueued so far on current_stream(device()) is done (a copy from or to
  /// it there, as PyTorch orders everything). Errors are reported through gpukit::warn.
  void deallocate_sync(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/ = natural_alignment) noexcept {
    detail::free_reporting_errors("gpukit::pinned_memory_resource::deallocate", [&] {
      stream_view current = stream_view::default_stream(device_);
      try {
        current = current_stream(device_);
      } catch (...) {  // the current stream was destroyed: the default stream's work follows a blocking stream's
      }
      detail::pinned_deallocate_aligned(*pool_, p, &current);
    });
  }
  /// allocate_sync: pinned memory is usable by any stream at once.
  void* allocate(::cuda::stream_ref /*stream*/, std::size_t bytes, std::size_t alignment) {
    return allocate_sync(bytes, alignment);
  }
  /// Returns `p` once the work enqueued so far on `stream` is done. Errors are reported through gpukit::warn.
  void deallocate(::cuda::stream_ref stream, void* p, std::size_t /*bytes*/, std::size_t /*alignment*/) noexcept {
    detail::free_reporting_errors("gpukit::pinned_memory_resource::deallocate", [&] {
      const stream_view view = detail::view_of(stream, device_);
      detail::pinned_deallocate_aligned(*pool_, p, &view);
    });
  }

  /// Equal when both use the same pool.
  friend bool operator==(const pinned_memory_resource& a, const pinned_memory_resource& b) noexcept {
    return a.pool_ == b.pool_;
  }
  /// Not equal when they use different pools.
  friend bool operator!=(const pinned_memory_resource& a, const pinned_memory_resource& b) noexcept {
    return !(a == b);
  }
  /// Device-accessible: kernels may touch it (page-locked memory is mapped under unified addressing).
  friend void get_property(const pinned_memory_resource& /*resource*/, ::cuda::mr::device_accessible) noexcept {}
  /// Host-accessible: host code may touch it.
  friend void get_property(const pinned_memory_resource& /*resource*/, ::cuda::mr::host_accessible) noexcept {}

 private:
  pinned_pool* pool_;
  gpukit::device device_;
};

GPUKIT_END_NAMESPACE
