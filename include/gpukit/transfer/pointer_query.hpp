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
/// does not call cudaPointerGetAttributes at all then (device_count() is asked once per process). With a GPU, asking
/// initialises the CUDA runtime like any CUDA call.

#include <gpukit/device/device.hpp>

#include <cuda_runtime_api.h>

#include <atomic>

namespace gpukit {
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
inline std::atomic<pointer_query_function>& pointer_query_override() {
  static std::atomic<pointer_query_function> function{nullptr};
  return function;
}

/// True when some CUDA device is usable, so CUDA pointers can exist. Asked once per process.
inline bool cuda_pointers_possible() {
  static const bool possible = device_count() > 0;
  return possible;
}

/// Classifies `p` (see the file comment). Never throws.
inline pointer_info query_pointer(const void* p) noexcept {
  if (pointer_query_function f = pointer_query_override().load(std::memory_order_acquire)) return f(p);
  try {
    if (!cuda_pointers_possible()) return {};
  } catch (...) {
    return {};
  }
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();
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
}  // namespace gpukit
