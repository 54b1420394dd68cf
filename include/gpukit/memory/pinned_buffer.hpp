// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// pinned_buffer<T>: page-locked (pinned) host memory from cudaHostAlloc, owned, typed and move-only. Copies from and
/// to pinned memory are one DMA (cudaMemcpyAsync), truly asynchronous, and reach the PCIe limit; pageable memory does
/// not (see <gpukit/transfer/copy.hpp>, which stages it).
///
/// The CPU-device story: a pinned_buffer is created for a device. For a CUDA device it is cudaHostAlloc'd memory; for
/// the CPU device (a machine without a GPU, or code that selected the CPU) it is plain host memory, page-aligned, and
/// page_locked() is false. Nothing else differs, so code that fills a pinned_buffer and copies it to a device buffer
/// runs unchanged on both: `gpukit::pinned_buffer<float> b(n, gpukit::select_device().device);`.
///
/// Allocating pinned memory is slow (with its free, 0.74 ms for 1 MiB and 30 ms for 64 MiB on an H200 host) and an
/// implicit synchronisation point between streams: keep pinned buffers for the life of a loop, or take them from a
/// pinned_pool (<gpukit/memory/pinned_pool.hpp>).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

/// cudaHostAlloc's flags. Ignored for the CPU device.
struct pinned_flags {
  /// Pinned for every CUDA context, not only the current device's (cudaHostAllocPortable). On by default so a buffer
  /// can feed copies to any device.
  bool portable = true;
  /// Mapped into the device address space (cudaHostAllocMapped): kernels can read it directly (zero-copy).
  bool mapped = false;
  /// Write-combined (cudaHostAllocWriteCombined): faster for the GPU to read across PCIe, very slow for the CPU to
  /// read; only for buffers the host writes and never reads.
  bool write_combined = false;

  /// The cudaHostAlloc flag word.
  unsigned cuda_flags() const noexcept;
  /// "cudaHostAllocPortable|cudaHostAllocMapped", for messages.
  std::string to_string() const;
};

namespace detail {

/// Alignment of host memory standing in for pinned memory on the CPU device: a page, like cudaHostAlloc.
inline constexpr std::size_t host_page_alignment = 4096;

/// Page-aligned plain host memory (the CPU device's "pinned" memory). Throws out_of_memory_error.
GPUKIT_INLINE void* allocate_host_pages(std::size_t bytes, const char* who);

/// Frees memory from allocate_host_pages.
GPUKIT_INLINE void free_host_pages(void* p) noexcept;

/// cudaHostAlloc with a message naming the size and flags, in relaxed capture mode (another thread's global capture
/// neither refuses it nor is invalidated by it). Throws out_of_memory_error, no_device_error, ...
GPUKIT_INLINE void* cuda_host_alloc(std::size_t bytes, pinned_flags flags, int ordinal);

/// cudaFreeHost in a host_memory_release_scope (a context that exists, `ordinal`'s preferred; relaxed capture mode).
/// Failures are reported through gpukit::warn, naming `what`.
GPUKIT_INLINE void cuda_free_host(void* p, int ordinal, const char* what) noexcept;

}  // namespace detail

/// Owned, typed host memory that is page-locked on CUDA devices and plain (page-aligned) on the CPU device. The
/// elements are not initialised (like cudaHostAlloc). Move-only; a moved-from or default-constructed buffer is empty.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable<T>::value && std::is_trivially_destructible<T>::value,
                "gpukit::pinned_buffer<T>: T must be trivially copyable and destructible (it is copied as bytes)");

 public:
  /// The element type.
  using value_type = T;

  /// An empty buffer (no memory).
  pinned_buffer() noexcept = default;

  /// `count` uninitialised elements for transfers with device `d`: cudaHostAlloc'd with `flags` for a CUDA device,
  /// plain page-aligned host memory for the CPU. A count of 0 allocates nothing. Throws out_of_memory_error,
  /// invalid_argument_error for a CUDA device that is not visible, or no_device_error without a driver.
  ///
  /// Page-locked memory belongs to the context current during cudaHostAlloc, and a thread that never chose a device
  /// would get a new context on cuda:0. Portable memory is pinned (and, under unified addressing, mapped) for every
  /// context, so it is allocated in a context that already exists: the current one, else `d`'s, else any device's,
  /// else `d` (detail::device_with_context). Without pinned_flags::portable only `d`'s context sees it, so `d` is
  /// made current.
  pinned_buffer(std::size_t count, gpukit::device d, pinned_flags flags = {})
      : size_(count), device_(d), flags_(flags) {
    const std::size_t bytes = detail::checked_bytes(count, sizeof(T), "gpukit::pinned_buffer");
    if (bytes == 0) return;
    if (d.is_cpu()) {
      data_ = static_cast<T*>(detail::allocate_host_pages(bytes, "gpukit::pinned_buffer"));
      return;
    }
    detail::note_cuda_use();
    detail::require_visible(d, "gpukit::pinned_buffer");  // portable memory may be allocated in any context
    detail::context_scope scope(d.ordinal(), flags.portable);
    data_ = static_cast<T*>(detail::cuda_host_alloc(bytes, flags, d.ordinal()));
    page_locked_ = true;
  }

  /// Takes over `other`'s memory; `other` is left empty.
  pinned_buffer(pinned_buffer&& other) noexcept { take(other); }
  /// Frees this buffer's memory (as the destructor does), then takes over `other`'s; `other` is left empty.
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      release_memory();
      take(other);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  /// Frees the memory (cudaFreeHost, itself a synchronisation point). The caller must have waited for copies that
  /// use it: freeing memory a DMA still reads is undefined, as with CUDA.
  ~pinned_buffer() { release_memory(); }

  /// The first element (host address), or nullptr when empty.
  T* data() noexcept { return data_; }
  /// The first element, read-only, or nullptr when empty.
  const T* data() const noexcept { return data_; }
  /// Number of elements.
  std::size_t size() const noexcept { return size_; }
  /// Size in bytes: size() * sizeof(T).
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// True when the buffer holds no elements.
  bool empty() const noexcept { return size_ == 0; }
  /// Iterator to the first element.
  T* begin() noexcept { return data_; }
  /// Iterator past the last element.
  T* end() noexcept { return data_ + size_; }
  /// Read-only iterator to the first element.
  const T* begin() const noexcept { return data_; }
  /// Read-only iterator past the last element.
  const T* end() const noexcept { return data_ + size_; }
  /// Unchecked element access.
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  /// Unchecked read-only element access.
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }

  /// The elements as a span (host memory).
  gpukit::span<T> span() noexcept { return {data_, size_}; }
  /// The elements as a read-only span (host memory).
  gpukit::span<const T> span() const noexcept { return {data_, size_}; }

  /// The device the buffer was made for: copies with it take the one-DMA path.
  gpukit::device device() const noexcept { return device_; }
  /// True when the memory is really page-locked (CUDA); false for the CPU device's plain memory.
  bool page_locked() const noexcept { return page_locked_; }
  /// The flags it was allocated with (meaningful for CUDA devices).
  pinned_flags flags() const noexcept { return flags_; }

  /// The address kernels use to read the memory (cudaHostGetDevicePointer). Under unified addressing (every 64-bit
  /// platform CUDA supports: properties(d).unified_addressing) every page-locked allocation is mapped, at its host
  /// address, whatever the flags; otherwise only memory allocated with pinned_flags::mapped is. For the CPU device,
  /// where "device" code runs on the host, it is data(). Throws invalid_argument_error for a CUDA buffer the device
  /// cannot address (not mapped, no unified addressing).
  T* device_pointer() const {
    if (data_ == nullptr || !page_locked_) return data_;
    if (!flags_.mapped) {
      int unified = 0;
      GPUKIT_CUDA_TRY_DESCRIBED(
          cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device_.ordinal()),
          "cudaDeviceGetAttribute(cudaDevAttrUnifiedAddressing, " + std::to_string(device_.ordinal()) + ")",
          device_.ordinal());
      if (unified == 0) {
        throw invalid_argument_error(
            "gpukit::pinned_buffer::device_pointer: the buffer was allocated without "
            "pinned_flags::mapped and " +
            device_.to_string() + " has no unified addressing, so the device cannot address it");
      }
    }
    detail::context_scope scope(device_.ordinal(), flags_.portable);  // as in the constructor
    void* p = nullptr;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaHostGetDevicePointer(&p, data_, 0), "cudaHostGetDevicePointer", device_.ordinal());
    return static_cast<T*>(p);
  }

 private:
  void take(pinned_buffer& other) noexcept {
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
    flags_ = other.flags_;
    page_locked_ = std::exchange(other.page_locked_, false);
  }
  void release_memory() noexcept {
    if (data_ == nullptr) return;
    if (page_locked_) {
      detail::cuda_free_host(data_, device_.ordinal(), "cudaFreeHost (in ~pinned_buffer)");
    } else {
      detail::free_host_pages(data_);
    }
    data_ = nullptr;
    size_ = 0;
    page_locked_ = false;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  gpukit::device device_{};
  pinned_flags flags_{};
  bool page_locked_ = false;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE unsigned pinned_flags::cuda_flags() const noexcept {
  unsigned f = cudaHostAllocDefault;
  if (portable) f |= cudaHostAllocPortable;
  if (mapped) f |= cudaHostAllocMapped;
  if (write_combined) f |= cudaHostAllocWriteCombined;
  return f;
}

GPUKIT_INLINE std::string pinned_flags::to_string() const {
  std::string text;
  auto add = [&text](const char* name) {
    if (!text.empty()) text += '|';
    text += name;
  };
  if (portable) add("cudaHostAllocPortable");
  if (mapped) add("cudaHostAllocMapped");
  if (write_combined) add("cudaHostAllocWriteCombined");
  return text.empty() ? std::string("cudaHostAllocDefault") : text;
}
namespace detail {

GPUKIT_INLINE void* allocate_host_pages(std::size_t bytes, const char* who) {
  void* p = ::operator new(bytes, std::align_val_t(host_page_alignment), std::nothrow);
  if (p == nullptr) {
    throw out_of_memory_error(std::string(who) + ": the host could not allocate " + std::to_string(bytes) + " bytes");
  }
  return p;
}

GPUKIT_INLINE void free_host_pages(void* p) noexcept {
  if (p != nullptr) ::operator delete(p, std::align_val_t(host_page_alignment));
}

GPUKIT_INLINE void* cuda_host_alloc(std::size_t bytes, pinned_flags flags, int ordinal) {
  void* p = nullptr;  // not written on failure
  const relaxed_capture_mode relaxed;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaHostAlloc(&p, bytes, flags.cuda_flags()),
                            "cudaHostAlloc(" + std::to_string(bytes) + ", " + flags.to_string() + ")", ordinal);
  return p;
}

GPUKIT_INLINE void cuda_free_host(void* p, int ordinal, const char* what) noexcept {
  const host_memory_release_scope scope(ordinal);
  report_cuda_failure(cudaFreeHost(p), what, ordinal);
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
