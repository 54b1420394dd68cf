// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// gpukit memory as std::pmr::memory_resource, for standard containers and pool resources:
///
///     gpukit::pinned_pmr_resource pinned(gpukit::device::cuda(0));   // page-locked, from the pinned pool
///     std::pmr::vector<float> staging(1 << 20, &pinned);              // a host vector the GPU copies at full speed
///
/// - pinned_pmr_resource: page-locked host memory from a pinned_pool; any standard container or pool resource may
///   use it. A free returns the block to the pool, which serves it again after the events of the streams recorded
///   for it (pool().record_stream) and once captures that used it end.
/// - device_pmr_resource: device memory from a device_resource (any device_allocator among them), ordered on a stream.
/// **Device-only**: the host must
///   not touch it, so hand it only to code that passes the bytes to the device, never to a container or to
///   std::pmr's pool and monotonic resources (they write their bookkeeping into the memory). On the CPU device
///   the memory is host memory and anything goes. Stream-ordered: see device_memory_resource::allocate_sync.
/// Both honour every power-of-two alignment (standard pool resources ask for large ones).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/pinned_aligned.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/current_stream.hpp>

#include <algorithm>
#include <cstddef>
#include <memory_resource>
#include <optional>

GPUKIT_BEGIN_NAMESPACE

/// Page-locked host memory from a pinned_pool as a std::pmr::memory_resource.
class pinned_pmr_resource final : public std::pmr::memory_resource {
 public:
  /// The process-wide pinned pool of `d` (default_pinned_pool(d)).
  explicit pinned_pmr_resource(gpukit::device d) : pool_(&default_pinned_pool(d)) {}
  /// `pool`, which must outlive this resource.
  explicit pinned_pmr_resource(pinned_pool& pool) noexcept : pool_(&pool) {}

  /// The pool behind this resource.
  pinned_pool& pool() const noexcept { return *pool_; }

 private:
  /// std::pmr wants memory even for 0 bytes: a smallest block.
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return detail::pinned_allocate_aligned(*pool_, std::max<std::size_t>(bytes, 1), alignment,
                                           "gpukit::pinned_pmr_resource::allocate");
  }
  /// std::pmr's deallocate throws nothing: a refused free is reported through gpukit::warn.
  void do_deallocate(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/) override {
    detail::free_reporting_errors("gpukit::pinned_pmr_resource::deallocate",
                                  [&] { detail::pinned_deallocate_aligned(*pool_, p, nullptr); });
  }
  /// Equal to any pinned_pmr_resource of the same pool.
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
    const auto* pinned = dynamic_cast<const pinned_pmr_resource*>(&other);
    return pinned != nullptr && pinned->pool_ == pool_;
  }

  pinned_pool* pool_;
};

/// Device memory from a device_resource as a std::pmr::memory_resource; device-only (see the file comment).
class device_pmr_resource final : public std::pmr::memory_resource {
 public:
  /// The default allocator of `d`, ordered on the calling thread's current stream of `d` at each call. (`Deferred`,
  /// never given: see default_allocator.)
  template <int Deferred = 0>
  explicit device_pmr_resource(gpukit::device d) : allocator_(&default_allocator(d)) {}
  /// `allocator` (which must outlive this resource), ordered on `stream` (which must outlive it too) or, when none
  /// is given, on the calling thread's current stream of the allocator's device at each call.
  explicit device_pmr_resource(device_resource& allocator, std::optional<stream_view> stream = std::nullopt) noexcept
      : allocator_(&allocator), stream_(stream) {}

  /// The allocator behind this resource.
  device_resource& allocator() const noexcept { return *allocator_; }

 private:
  stream_view stream() const { return stream_ ? *stream_ : current_stream(allocator_->device()); }

  /// std::pmr wants memory even for 0 bytes: a smallest block.
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return allocator_->allocate(std::max<std::size_t>(bytes, 1), alignment, stream());
  }
  /// std::pmr's deallocate throws nothing: a refused free is reported through gpukit::warn.
  void do_deallocate(void* p, std::size_t /*bytes*/, std::size_t /*alignment*/) override {
    detail::free_reporting_errors("gpukit::device_pmr_resource::deallocate", [&] {
      std::optional<stream_view> on = stream_;
      if (!on) {
        try {
          on = current_stream(allocator_->device());
        } catch (const invalid_argument_error&) {  // the current stream was destroyed: freed on the allocation's
          allocator_->deallocate(p);
          return;
        }
      }
      allocator_->deallocate(p, *on);
    });
  }
  /// Equal to any device_pmr_resource of the same allocator (memory is freed in its streams' order either way).
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
    const auto* device = dynamic_cast<const device_pmr_resource*>(&other);
    return device != nullptr && device->allocator_ == allocator_;
  }

  device_resource* allocator_;
  std::optional<stream_view> stream_;
};

GPUKIT_END_NAMESPACE
