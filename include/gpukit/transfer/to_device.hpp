// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Conveniences over copy_async: to_device(host data, stream) returns a new device_buffer holding a copy;
/// to_host(device data, stream) returns a std::vector once the copy has completed.
///
///     gpukit::device_buffer<float> x = gpukit::to_device(weights, s);   // weights may be reused at once
///     std::vector<float> y = gpukit::to_host(x, s);                     // waits for the copy (and the work before it)

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/spans.hpp>

#include <cstddef>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Why to_device cannot run in a capture, and what to do instead.
inline constexpr std::string_view capture_advice_to_device =
    "it allocates a device buffer, and the caching allocator cannot hand memory to a graph; allocate before "
    "cudaStreamBeginCapture and copy_async from pinned memory during the capture (nothing was allocated or enqueued)";
}  // namespace detail

/// A new buffer on `s`'s device (from its default allocator, usable on `s`) holding a copy of `src`. The copy is
/// stream-ordered: work enqueued on `s` afterwards sees the data. Pageable `src` may be reused as soon as this
/// returns; pinned `src` must stay valid until `s` has passed the copy.
template <class T>
device_buffer<std::remove_const_t<T>> to_device(host_span<T> src, stream_view s) {
  detail::refuse_capture(s, s.device(), "gpukit::to_device", detail::capture_advice_to_device);
  device_buffer<std::remove_const_t<T>> buffer(src.size(), s);
  detail::copy_located(buffer, host_span<const T>(src), s, detail::default_engine{}, "to_device");
  return buffer;
}

/// to_device of a plain span, which to_device reads as host memory (the direction is in the name).
template <class T>
device_buffer<std::remove_const_t<T>> to_device(gpukit::span<T> src, stream_view s) {
  return to_device(host_span<T>(src), s);
}

/// to_device of a vector. Pageable storage may be reused as soon as this returns; page-locked storage (a pinned
/// allocator or pinned_pmr_resource) must stay valid until `s` has passed the copy, as for a pinned_span.
template <class T, class A>
device_buffer<T> to_device(const std::vector<T, A>& src, stream_view s) {
  return to_device(host_span<const T>(src), s);
}

/// to_device of a temporary vector. Page-locked storage is read by DMA after this returns, and is freed (a pinned
/// pool may hand it out again at once) at the end of the caller's expression: for such storage the copy is waited
/// for (stream_view::synchronize) before returning, as copy_async does for any temporary. Pageable storage is read
/// before the call returns anyway.
template <class T, class A>
device_buffer<T> to_device(std::vector<T, A>&& src, stream_view s) {
  detail::refuse_capture(s, s.device(), "gpukit::to_device", detail::capture_advice_to_device);
  device_buffer<T> buffer(src.size(), s);
  detail::copy_located(buffer, std::move(src), s, detail::default_engine{}, "to_device");
  return buffer;
}

/// to_device of pinned memory: one DMA; `src` must stay valid until `s` has passed the copy.
template <class T>
device_buffer<std::remove_const_t<T>> to_device(pinned_span<T> src, stream_view s) {
  detail::refuse_capture(s, s.device(), "gpukit::to_device", detail::capture_advice_to_device);
  device_buffer<std::remove_const_t<T>> buffer(src.size(), s);
  detail::copy_located(buffer, pinned_span<const T>(src), s, detail::default_engine{}, "to_device");
  return buffer;
}

/// to_device of a pinned_buffer or pooled_pinned_buffer (one DMA, or staged when its memory is not page-locked), or of
/// a std::array (as a host_span). A pooled buffer's block is kept from the pool until `s` has passed the copy (on a
/// gpukit or default stream; see copy_async), so the buffer may be released at once; a temporary pinned_buffer, or a
/// temporary pooled one on a raw stream handle, is freed at the end of the caller's expression, so its copy is waited
/// for (stream_view::synchronize) before returning, as copy_async does; a pinned_buffer the caller keeps must stay
/// valid until `s` has passed the copy.
template <class Container, class = std::enable_if_t<detail::is_pinned_container<std::decay_t<Container>>::value ||
                                                    detail::is_std_array<std::decay_t<Container>>::value>>
auto to_device(Container&& src, stream_view s)
    -> device_buffer<std::remove_const_t<typename std::decay_t<Container>::value_type>> {
  using container = std::decay_t<Container>;
  detail::refuse_capture(s, s.device(), "gpukit::to_device", detail::capture_advice_to_device);
  device_buffer<std::remove_const_t<typename container::value_type>> buffer(src.size(), s);
  detail::copy_located(buffer, std::forward<Container>(src), s, detail::default_engine{}, "to_device");
  return buffer;
}

/// to_device on the calling thread's current stream of `d` (current_stream(d): the default stream unless a
/// stream_guard says otherwise), for any source to_device takes.
template <class Source>
auto to_device(Source&& src, gpukit::device d) -> decltype(to_device(std::forward<Source>(src), stream_view())) {
  return to_device(std::forward<Source>(src), current_stream(d));
}

/// The contents of device memory as a vector. Blocks until the copy has completed: it is enqueued on `s` after the
/// work already there, and an event recorded after it is waited for.
template <class T>
std::vector<std::remove_const_t<T>> to_host(device_span<T> src, stream_view s) {
  std::vector<std::remove_const_t<T>> out(src.size());
  if (out.empty()) return out;
  detail::refuse_capture(s, s.device(), "gpukit::to_host",
                         "it waits on the host for the copy, which a capture does not run; call it after "
                         "cudaStreamEndCapture (nothing was enqueued)");
  detail::copy_located(out, device_span<const T>(src), s, detail::default_engine{}, "to_host");
  event done(s.device());
  done.record(s);
  done.synchronize();
  return out;
}

/// to_host of a device buffer, on stream `s`.
template <class T>
std::vector<T> to_host(const device_buffer<T>& src, stream_view s) {
  return to_host(device_span<const T>(src.data(), src.size(), src.device()), s);
}
/// to_host of a device buffer, on the buffer's own stream (src.stream()).
template <class T>
std::vector<T> to_host(const device_buffer<T>& src) {
  return to_host(src, src.stream());
}

GPUKIT_END_NAMESPACE
