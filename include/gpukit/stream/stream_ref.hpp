// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Interoperability with CCCL's cuda::stream_ref (the toolkit's include/cccl: gpukit's CMake targets, pkg-config
/// file and Conan package bring it, and nvcc adds it itself). After including this header, stream_view and stream
/// convert to cuda::stream_ref, and cuda::stream_ref to stream_view, implicitly:
///
///     cuda::stream_ref ref = gpukit_stream.view();
///     gpukit::stream_view view = ref;

#include <gpukit/detail/config.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda/stream_ref>

GPUKIT_BEGIN_NAMESPACE
namespace detail {
template <>
struct is_cuda_stream_ref<::cuda::stream_ref> : std::true_type {};
}  // namespace detail

/// The cuda::stream_ref of a CUDA stream. Throws invalid_argument_error for a CPU stream, and for a default stream of
/// a device other than the current one, or of another thread (see stream_view's conversion).
inline ::cuda::stream_ref to_stream_ref(stream_view s) {
  const ::cuda::stream_ref ref = s;
  return ref;
}

GPUKIT_END_NAMESPACE
