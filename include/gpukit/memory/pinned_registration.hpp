// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// host_registration: page-locks memory the program already owns (cudaHostRegister) for the life of the object and
/// unlocks it after (cudaHostUnregister). Use it when the data lives in memory you do not allocate (a memory-mapped
/// file, a framework's tensor) and is copied often enough to repay the registration (its cost grows with the size,
/// as cudaHostAlloc's does: 30 ms for 64 MiB with its free on an H200 host).
///
/// The CPU-device story: registering for the CPU device is a no-op (registered() is false): the CPU has nothing to
/// pin, and the same code runs without a GPU. While registered, gpukit's copies detect the memory as pinned and use
/// one DMA instead of staging it, which changes when the memory may be touched again: a copy_async from or into
/// pageable memory returns with the source reusable or the destination written, one from or into registered memory
/// returns at once, and the memory is read or written when the stream gets to the copy (synchronize the stream, or
/// an event recorded after it, before reusing or reading it).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

/// cudaHostRegister's flags. Ignored for the CPU device.
struct registration_flags {
  /// Pinned for every CUDA context (cudaHostRegisterPortable).
  bool portable = true;
  /// Mapped into the device address space (cudaHostRegisterMapped).
  bool mapped = false;
  /// The device only reads it (cudaHostRegisterReadOnly); lets CUDA register read-only mappings.
  bool read_only = false;

  /// The cudaHostRegister flag word.
  unsigned cuda_flags() const noexcept;
};

/// RAII page-locking of caller-owned host memory. Move-only. The memory must outlive the registration, and copies
/// that use it must have completed before the registration ends (unregistering memory a DMA still reads is undefined,
/// as with CUDA).
class host_registration {
 public:
  /// Registers nothing.
  host_registration() noexcept = default;

  /// Page-locks [data, data + bytes) for device `d`. For the CPU device nothing is done. Zero bytes registers nothing
  /// (CUDA rejects an empty range). Throws invalid_argument_error for a null pointer with a non-zero size; CUDA
  /// failures map as usual (cudaErrorHostMemoryAlreadyRegistered is a cuda_error).
  ///
  /// The registration belongs to the context current during cudaHostRegister. Portable registrations serve every
  /// context, so they are made in one that already exists (the current one, else `d`'s, else any device's, else
  /// `d`: detail::device_with_context) rather than in a new context of cuda:0 on a thread that never chose a device.
  /// Without registration_flags::portable, `d` is made current.
  host_registration(void* data, std::size_t bytes, gpukit::device d, registration_flags flags = {});

  /// Registers the memory of a span of trivially copyable elements. A count whose byte size overflows throws
  /// invalid_argument_error.
  template <class T>
  host_registration(gpukit::span<T> s, gpukit::device d, registration_flags flags = {})
      : host_registration(const_cast<void*>(static_cast<const void*>(s.data())), span_bytes(s), d, flags) {}

  /// Takes over `other`'s registration; `other` is left empty.
  host_registration(host_registration&& other) noexcept;
  /// Unregisters this range (failures are reported through gpukit::warn), then takes over `other`'s registration;
  /// `other` is left empty.
  host_registration& operator=(host_registration&& other) noexcept;
  host_registration(const host_registration&) = delete;
  host_registration& operator=(const host_registration&) = delete;
  /// Unregisters (failures are reported through gpukit::warn).
  ~host_registration();

  /// True while CUDA holds the range page-locked; false for the CPU device and empty registrations.
  bool registered() const noexcept;
  /// Start of the range (nullptr for an empty or reset registration).
  void* data() const noexcept;
  /// Length of the range in bytes.
  std::size_t size_bytes() const noexcept;
  /// The device it was made for.
  gpukit::device device() const noexcept;

  /// Ends the registration now (idempotent), e.g. before freeing the memory early.
  void reset() noexcept;

 private:
  template <class T>
  static std::size_t span_bytes(gpukit::span<T> s) {
    if (s.size() > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
      throw invalid_argument_error("gpukit::host_registration: " + std::to_string(s.size()) + " elements of " +
                                   std::to_string(sizeof(T)) + " bytes overflow size_t");
    }
    return s.size_bytes();
  }

  void take(host_registration& other) noexcept;
  /// Ends the registration; a failure is reported through gpukit::warn as made in `caller`.
  void unregister(const char* caller) noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  gpukit::device device_{};
  bool registered_ = false;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE unsigned registration_flags::cuda_flags() const noexcept {
  unsigned f = cudaHostRegisterDefault;
  if (portable) f |= cudaHostRegisterPortable;
  if (mapped) f |= cudaHostRegisterMapped;
  if (read_only) f |= cudaHostRegisterReadOnly;
  return f;
}

namespace detail {
/// The flags by name, for errors ("cudaHostRegisterPortable|cudaHostRegisterMapped").
GPUKIT_INLINE std::string registration_flags_text(const registration_flags& f) {
  std::string text;
  for (const auto& named :
       {std::make_pair(f.portable, "cudaHostRegisterPortable"), std::make_pair(f.mapped, "cudaHostRegisterMapped"),
        std::make_pair(f.read_only, "cudaHostRegisterReadOnly")}) {
    if (!named.first) continue;
    if (!text.empty()) text += '|';
    text += named.second;
  }
  return text.empty() ? std::string("cudaHostRegisterDefault") : text;
}
}  // namespace detail

GPUKIT_INLINE host_registration::host_registration(void* data, std::size_t bytes, gpukit::device d,
                                                   registration_flags flags)
    : data_(data), bytes_(bytes), device_(d) {
  if (data == nullptr && bytes != 0) {
    throw invalid_argument_error("gpukit::host_registration: null pointer with a size of " + std::to_string(bytes) +
                                 " bytes");
  }
  if (bytes == 0 || d.is_cpu()) return;
  detail::note_cuda_use();
  detail::require_visible(d, "gpukit::host_registration");  // a portable registration may use any context
  detail::context_scope scope(d.ordinal(), flags.portable);
  const detail::relaxed_capture_mode relaxed;  // another thread's global capture neither refuses nor loses it
  const cudaError_t result = cudaHostRegister(data, bytes, flags.cuda_flags());
  if (result != cudaSuccess) {
    std::string call =
        "cudaHostRegister(" + std::to_string(bytes) + " bytes, " + detail::registration_flags_text(flags);
    if (result == cudaErrorHostMemoryAlreadyRegistered) {
      call += "; the range, or a page it shares, is already page-locked by another registration or pinned allocation";
    }
    detail::throw_cuda_error(result, call + ")", d.ordinal(), __FILE__, __LINE__);
  }
  registered_ = true;
}

GPUKIT_INLINE host_registration::host_registration(host_registration&& other) noexcept { take(other); }

GPUKIT_INLINE host_registration& host_registration::operator=(host_registration&& other) noexcept {
  if (this != &other) {
    unregister("host_registration's move assignment");
    take(other);
  }
  return *this;
}

GPUKIT_INLINE host_registration::~host_registration() { unregister("~host_registration"); }

GPUKIT_INLINE bool host_registration::registered() const noexcept { return registered_; }

GPUKIT_INLINE void* host_registration::data() const noexcept { return data_; }

GPUKIT_INLINE std::size_t host_registration::size_bytes() const noexcept { return bytes_; }

GPUKIT_INLINE gpukit::device host_registration::device() const noexcept { return device_; }

GPUKIT_INLINE void host_registration::reset() noexcept {
  unregister("host_registration::reset");
  data_ = nullptr;
  bytes_ = 0;
}

GPUKIT_INLINE void host_registration::take(host_registration& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  device_ = other.device_;
  registered_ = std::exchange(other.registered_, false);
}

GPUKIT_INLINE void host_registration::unregister(const char* caller) noexcept {
  if (!registered_) return;
  registered_ = false;
  const detail::host_memory_release_scope scope(device_.ordinal());
  const cudaError_t result = cudaHostUnregister(data_);
  if (result == cudaSuccess) return;
  char call[160];  // no heap: this runs in destructors
  std::snprintf(call, sizeof call, "cudaHostUnregister (in %s; the range may stay page-locked)", caller);
  detail::report_cuda_failure(result, call, device_.ordinal());
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
