// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What kind of memory a pointer refers to, as CUDA knows it (cudaPointerGetAttributes): pageable host memory,
/// pinned host memory, device memory of some device, or managed memory. Copies use it to pick the one-DMA path for
/// pinned memory and to reject a device pointer where host memory is expected (and the reverse).
///
/// Without a usable CUDA device (no driver, or no GPU) no pointer in the process can be device or pinned memory, so
/// the answer is `unknown` and the checks that depend on it accept the pointer: that is sound, not a guess. gpukit
/// does not call cudaPointerGetAttributes at all then (device_count() is asked once per process). With a GPU, it
/// asks in a context that exists (detail::device_with_context), never creating one: with no context in the process
/// no pointer can be CUDA memory, so the answer is `pageable` without asking.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <optional>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The kinds of memory copies distinguish.
enum class pointer_kind : unsigned char {
  unknown,   ///< no usable CUDA device, or CUDA could not tell
  pageable,  ///< host memory CUDA does not know (cudaMemoryTypeUnregistered)
  pinned,    ///< page-locked host memory (cudaHostAlloc or cudaHostRegister)
  device,    ///< device memory; `device` says whose
  managed,   ///< managed (unified) memory: any copy direction works
};

struct pointer_info {
  pointer_kind kind = pointer_kind::unknown;
  int device = -1;  ///< the CUDA ordinal for device memory, else -1
};

using pointer_query_function = pointer_info (*)(const void*);

/// Tests replace the query to exercise the checks without a GPU; nullptr restores CUDA's.
GPUKIT_EXPORT GPUKIT_INLINE std::atomic<pointer_query_function>& pointer_query_override();

/// True when some CUDA device is usable, so CUDA pointers can exist. Asked once per process.
GPUKIT_EXPORT GPUKIT_INLINE bool cuda_pointers_possible();

/// Classifies `p` (see the file comment). Never throws.
GPUKIT_INLINE pointer_info query_pointer(const void* p) noexcept;

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::atomic<pointer_query_function>& pointer_query_override() {
  static std::atomic<pointer_query_function> function{nullptr};
  return function;
}

GPUKIT_INLINE bool cuda_pointers_possible() {
  static const bool possible = device_count() > 0;
  return possible;
}

GPUKIT_INLINE pointer_info query_pointer(const void* p) noexcept {
  if (pointer_query_function f = pointer_query_override().load(std::memory_order_acquire)) return f(p);
  cudaPointerAttributes attributes{};
  try {
    if (!cuda_pointers_possible()) return {};
    // CUDA answers in the current context, and on a thread without one it would create cuda:0's: ask in a context
    // that exists. With none in the process, no CUDA allocation or registration can exist either.
    std::optional<device_guard> guard;
    const int ordinal = device_with_context(-1, false);
    if (ordinal == no_context_anywhere) return {pointer_kind::pageable, -1};
    if (ordinal >= 0) guard.emplace(device::cuda(ordinal));
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return {};
    }
  } catch (...) {
    return {};
  }
  switch (attributes.type) {
    case cudaMemoryTypeUnregistered:
      return {pointer_kind::pageable, -1};
    case cudaMemoryTypeHost:
      return {pointer_kind::pinned, -1};
    case cudaMemoryTypeDevice:
      return {pointer_kind::device, attributes.device};
    case cudaMemoryTypeManaged:
      return {pointer_kind::managed, attributes.device};
    default:
      return {};
  }
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
