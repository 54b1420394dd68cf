// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// resource_upstream<Resource>: any CCCL memory resource (cuda::mr) as the caching allocator's upstream, so gpukit's
/// cache, statistics, limits and out-of-memory handling sit in front of memory another library manages (an RMM
/// pool, a resource of your own, a `cuda::mr::resource_ref`):
///
///     using upstream = gpukit::resource_upstream<my_resource>;
///     gpukit::caching_device_allocator<upstream> cached(d, {}, my_resource{...}, d);
///
/// Segments come from the resource's synchronous calls (CCCL 3.0: allocate/deallocate; CCCL 3.1+:
/// allocate_sync/deallocate_sync) at upstream_alignment. A refusal for lack of memory — std::bad_alloc (which RMM's
/// out_of_memory is), gpukit::out_of_memory_error, or CCCL's cuda::cuda_error for cudaErrorMemoryAllocation — is
/// the upstream's "out of memory" (nullptr): the caching allocator then releases its cache and retries before it
/// throws. Other exceptions propagate. On a CUDA device a segment is given back after the device's work, as
/// cudaFree does (queued kernels may still use it); releases happen only under pressure or when asked, so that
/// wait is not on any hot path.
///
/// Needs CCCL on the include path, as memory_resource.hpp does. Not included by gpukit.hpp.

#include <gpukit/memory/memory_resource.hpp>  // first: it sets up CCCL's concepts (see its file comment)

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/upstream.hpp>

#include <cuda/memory_resource>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

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
/// resource is.
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
  /// Segments from `resource` (kept by value: a resource_ref, or a resource that refers to its state, shares it) for
  /// device `d`: the device whose free memory memory_info() reports (the CPU: unknown) and whose work a release waits
  /// for.
  resource_upstream(Resource resource, gpukit::device d) : resource_(std::move(resource)), device_(d) {}

  /// `bytes` from the resource at upstream_alignment; nullptr when it refuses for lack of memory (see the file
  /// comment); other failures throw.
  [[nodiscard]] void* allocate(std::size_t bytes) {
    try {
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

  /// Gives a segment back: on a CUDA device after the device's work (cudaDeviceSynchronize), as cudaFree does.
  /// Failures are reported through gpukit::warn, the segment then kept rather than handed back while in use.
  void deallocate(void* p, std::size_t bytes) noexcept {
    try {
      if (device_.is_cuda() &&
          !detail::device_idle_before_release(device_, "returning a segment to a cuda::mr resource")) {
        return;  // kept (leaked) rather than handed back while the device may still use it
      }
#if CCCL_VERSION >= 3001000
      resource_.deallocate_sync(p, bytes, upstream_alignment);
#else
      resource_.deallocate(p, bytes, upstream_alignment);
#endif
    } catch (const std::exception& e) {
      warn(std::string("gpukit::resource_upstream: could not return a segment of ") + std::to_string(bytes) +
           " bytes to its resource: " + e.what());
    } catch (...) {
      warn("gpukit::resource_upstream: could not return a segment to its resource (a non-standard exception)");
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
  /// Whether `e` is CCCL's cuda::cuda_error for cudaErrorMemoryAllocation.
  static bool is_cccl_out_of_memory(const std::exception& e) noexcept {
    const auto* error = dynamic_cast<const ::cuda::cuda_error*>(&e);
    return error != nullptr && detail::is_out_of_memory_status(*error);
  }

  Resource resource_;
  gpukit::device device_;
};

GPUKIT_END_NAMESPACE
