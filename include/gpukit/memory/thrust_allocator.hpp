// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// thrust_allocator<T>: Thrust containers on gpukit memory, ordered on a stream:
///
///     gpukit::stream s(gpukit::device::cuda(0));
///     thrust::device_vector<float, gpukit::thrust_allocator<float>> v(n, gpukit::thrust_allocator<float>(s));
///     thrust::sort(thrust::cuda::par_nosync.on(s.cuda_handle()), v.begin(), v.end());
///
/// The allocator takes memory from a device_resource (the default allocator of the device unless one is given)
/// on its stream, and frees it in that stream's order, so a vector's memory is reused only after the work its
/// stream had enqueued by the free. Thrust's own kernels (a vector's construction and resize fills, algorithms
/// without an execution policy) run on the default stream: give algorithms the allocator's stream through an
/// execution policy, and before using freshly filled elements on a non-blocking stream (or in code built with
/// per-thread default streams) synchronize the default stream. The other way round too: memory handed out may have
/// been freed on the allocator's stream by work still running there, which a fill on the default stream does not
/// wait for if the allocator's stream is non-blocking (gpukit::stream's default) or with per-thread default streams:
/// synchronize the allocator's stream before a vector's filling constructor or resize. (The allocator cannot order
/// the fill itself: Thrust asks it for algorithms' temporary memory too, possibly during a capture.) The stream and
/// the allocator must outlive the containers. Needs Thrust (the toolkit's CCCL, which gpukit's CMake targets bring);
/// not included by gpukit.hpp.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/stream/current_stream.hpp>

#include <thrust/device_malloc_allocator.h>
#include <thrust/device_ptr.h>

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

GPUKIT_BEGIN_NAMESPACE

/// A Thrust allocator of `T` over a device_resource, ordered on a stream.
template <class T>
class thrust_allocator : public thrust::device_malloc_allocator<T> {
 public:
  /// The element type.
  using value_type = T;
  /// Thrust's pointer to device memory of `T`.
  using pointer = thrust::device_ptr<T>;
  /// Thrust's pointer to device memory of `const T`.
  using const_pointer = thrust::device_ptr<const T>;
  /// The type of element counts.
  using size_type = std::size_t;
  /// The type of pointer differences.
  using difference_type = std::ptrdiff_t;
  /// A vector moved into another takes its allocator with its memory, and two swapped vectors swap allocators:
  /// Thrust hands the storage over in both cases without asking whether the allocators are equal, so memory must go
  /// back through the allocator that gave it (helper-203: vectors of two default allocators, moved, freed through the
  /// wrong one, which refused and leaked it). A copy assignment keeps the target's allocator.
  using propagate_on_container_move_assignment = std::true_type;
  /// See propagate_on_container_move_assignment.
  using propagate_on_container_swap = std::true_type;
  /// The allocator for another element type `U`.
  template <class U>
  struct rebind {
    /// thrust_allocator of `U` (same allocator and stream once converted).
    using other = thrust_allocator<U>;
  };

  /// The default allocator of the current device, on the calling thread's current stream of it (read now).
  thrust_allocator() : thrust_allocator(current_stream(current_device())) {}
  /// The default allocator of the stream's device, on `stream`.
  explicit thrust_allocator(stream_view stream) : allocator_(&default_allocator(stream.device())), stream_(stream) {}
  /// `allocator` on `stream` (a stream of the allocator's device).
  thrust_allocator(device_resource& allocator, stream_view stream) noexcept : allocator_(&allocator), stream_(stream) {}
  /// The same allocator and stream, for another element type.
  template <class U>
  thrust_allocator(const thrust_allocator<U>& other) noexcept  // NOLINT(google-explicit-constructor)
      : allocator_(&other.allocator()), stream_(other.stream()) {}

  /// Memory for `n` elements on the stream, aligned for `T` (at least the allocator's natural alignment). Throws
  /// out_of_memory_error, or invalid_argument_error when `n * sizeof(T)` overflows.
  pointer allocate(size_type n) {
    if (n > std::numeric_limits<size_type>::max() / sizeof(T)) {
      throw invalid_argument_error("gpukit::thrust_allocator::allocate: " + std::to_string(n) + " elements of " +
                                   std::to_string(sizeof(T)) + " bytes overflow");
    }
    return pointer(static_cast<T*>(allocator_->allocate(n * sizeof(T), alignof(T), stream_)));
  }
  /// Frees in the stream's order. Thrust calls it from destructors: a failure is reported through gpukit::warn.
  void deallocate(pointer p, size_type /*n*/) noexcept {
    detail::free_reporting_errors("gpukit::thrust_allocator::deallocate",
                                  [&] { allocator_->deallocate(thrust::raw_pointer_cast(p), stream_); });
  }

  /// The allocator memory comes from.
  device_resource& allocator() const noexcept { return *allocator_; }
  /// The stream allocations and frees are ordered on.
  stream_view stream() const noexcept { return stream_; }

 private:
  device_resource* allocator_;
  stream_view stream_;
};

/// Equal when both use the same allocator, whatever their element types: memory from one may be freed through the
/// other (on either stream), so vectors on different streams of one allocator swap and move their storage.
template <class T, class U>
bool operator==(const thrust_allocator<T>& a, const thrust_allocator<U>& b) noexcept {
  return &a.allocator() == &b.allocator();
}
/// Not equal when they use different allocators.
template <class T, class U>
bool operator!=(const thrust_allocator<T>& a, const thrust_allocator<U>& b) noexcept {
  return !(a == b);
}

GPUKIT_END_NAMESPACE
