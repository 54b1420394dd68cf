// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Spans that say where their memory is, so a copy knows its direction and can check it:
///
/// | type           | memory                                       | made implicitly from                           |
/// |----------------|----------------------------------------------|------------------------------------------------|
/// | host_span<T>   | host memory, pageable or pinned              | std::vector, std::array, C arrays, pinned_span |
/// | pinned_span<T> | page-locked host memory (plain on the CPU)   | pinned_buffer, pooled_pinned_buffer            |
/// | device_span<T> | memory of a device (host memory for the CPU) | device buffers (data, size, device, stream)    |
///
/// A plain gpukit::span<T> says nothing about where it points (device_buffer::span() points to device memory), so it
/// converts only explicitly: `gpukit::host_span<float>(s)` or `gpukit::device_span<float>(s, d)`. A pinned_span made
/// from a raw pointer is a promise that the memory is page-locked (e.g. registered with host_registration).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/span.hpp>

#include <array>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// Where a located span's memory is.
enum class memory_location : unsigned char {
  host,    ///< host memory, pageable or pinned (gpukit asks CUDA which, on CUDA devices)
  pinned,  ///< page-locked host memory (or the CPU device's stand-in for it)
  device,  ///< memory of a device (on the CPU device: host memory)
};

namespace detail {

template <class From, class To>
using is_element_convertible = std::is_convertible<From (*)[], To (*)[]>;

template <class X, class = void>
struct is_device_buffer_like : std::false_type {};
/// A device buffer: data(), size(), device() (a gpukit::device) and stream(). Duck-typed so this header does not
/// depend on the allocator's.
template <class X>
struct is_device_buffer_like<X,
                             std::void_t<decltype(std::declval<X&>().data()), decltype(std::declval<X&>().size()),
                                         decltype(std::declval<X&>().device()), decltype(std::declval<X&>().stream())>>
    : std::is_same<std::decay_t<decltype(std::declval<X&>().device())>, gpukit::device> {};
}  // namespace detail

/// Host memory: pageable (std::vector, new[], a memory-mapped file) or pinned. Copies ask CUDA which: memory that is
/// page-locked (a host_registration covers it) takes one asynchronous DMA, used when the stream gets to it, where
/// pageable memory is staged and done with when copy_async returns.
template <class T>
class host_span {
 public:
  /// The element type, cv-qualifiers included.
  using element_type = T;
  /// The element type without cv-qualifiers.
  using value_type = std::remove_cv_t<T>;
  /// Where the memory is: memory_location::host.
  static constexpr memory_location location = memory_location::host;

  /// An empty span (null data).
  constexpr host_span() noexcept = default;
  /// `size` elements of host memory starting at `data`.
  constexpr host_span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// From a plain span, which does not say where it points: explicit.
  constexpr explicit host_span(gpukit::span<T> s) noexcept : data_(s.data()), size_(s.size()) {}
  /// The elements of a vector (implicit).
  template <class U, class A, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  host_span(std::vector<U, A>& v) noexcept : data_(v.data()), size_(v.size()) {}  // NOLINT: implicit
  /// The elements of a const vector (implicit), for a span of const elements.
  template <class U, class A, class = std::enable_if_t<detail::is_element_convertible<const U, T>::value>>
  host_span(const std::vector<U, A>& v) noexcept : data_(v.data()), size_(v.size()) {}  // NOLINT: implicit
  /// The elements of a std::array (implicit).
  template <class U, std::size_t N, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  constexpr host_span(std::array<U, N>& a) noexcept : data_(a.data()), size_(N) {}  // NOLINT: implicit
  /// The elements of a const std::array (implicit), for a span of const elements.
  template <class U, std::size_t N, class = std::enable_if_t<detail::is_element_convertible<const U, T>::value>>
  constexpr host_span(const std::array<U, N>& a) noexcept : data_(a.data()), size_(N) {}  // NOLINT: implicit
  /// The elements of a C array (implicit).
  template <std::size_t N>
  constexpr host_span(T (&a)[N]) noexcept : data_(a), size_(N) {}  // NOLINT: implicit
  /// host_span<T> → host_span<const T>.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  constexpr host_span(const host_span<U>& s) noexcept : data_(s.data()), size_(s.size()) {}  // NOLINT: implicit

  /// Pointer to the first element (null for an empty default-constructed span).
  constexpr T* data() const noexcept { return data_; }
  /// Number of elements.
  constexpr std::size_t size() const noexcept { return size_; }
  /// size() × sizeof(T) in bytes, or SIZE_MAX when that overflows.
  constexpr std::size_t size_bytes() const noexcept { return detail::saturating_bytes<T>(size_); }
  /// True when size() is 0.
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// Pointer to the first element.
  constexpr T* begin() const noexcept { return data_; }
  /// Pointer one past the last element.
  constexpr T* end() const noexcept { return data_ + size_; }
  /// Element `i`. Unchecked, like std::span.
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// Elements [offset, offset + count), still host memory. Unchecked, like std::span.
  constexpr host_span subspan(std::size_t offset, std::size_t count) const noexcept { return {data_ + offset, count}; }
  /// Elements from `offset` to the end, still host memory. Unchecked: `offset` must not exceed size().
  constexpr host_span subspan(std::size_t offset) const noexcept { return {data_ + offset, size_ - offset}; }
  /// The first `count` elements, still host memory. Unchecked: `count` must not exceed size().
  constexpr host_span first(std::size_t count) const noexcept { return {data_, count}; }
  /// The last `count` elements, still host memory. Unchecked: `count` must not exceed size().
  constexpr host_span last(std::size_t count) const noexcept { return {data_ + (size_ - count), count}; }
  /// The plain span.
  constexpr gpukit::span<T> span() const noexcept { return {data_, size_}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Page-locked host memory: copies from and to it are one DMA and are asynchronous, so it must stay valid until the
/// stream has passed the copy. On the CPU device the memory is plain but the rule is the same.
template <class T>
class pinned_span {
 public:
  /// The element type, cv-qualifiers included.
  using element_type = T;
  /// The element type without cv-qualifiers.
  using value_type = std::remove_cv_t<T>;
  /// Where the memory is: memory_location::pinned.
  static constexpr memory_location location = memory_location::pinned;

  /// An empty span (null data).
  constexpr pinned_span() noexcept = default;
  /// A promise that [data, data + size) is page-locked (registered, or from cudaHostAlloc).
  constexpr pinned_span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// The elements of a pinned_buffer (implicit); the span does not own them.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  pinned_span(pinned_buffer<U>& b) noexcept : data_(b.data()), size_(b.size()) {}  // NOLINT: implicit
  /// The elements of a const pinned_buffer (implicit), for a span of const elements.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<const U, T>::value>>
  pinned_span(const pinned_buffer<U>& b) noexcept : data_(b.data()), size_(b.size()) {}  // NOLINT: implicit
  /// The elements of a pooled_pinned_buffer (implicit); the span does not own them.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  pinned_span(pooled_pinned_buffer<U>& b) noexcept : data_(b.data()), size_(b.size()) {}  // NOLINT: implicit
  /// The elements of a const pooled_pinned_buffer (implicit), for a span of const elements.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<const U, T>::value>>
  pinned_span(const pooled_pinned_buffer<U>& b) noexcept : data_(b.data()), size_(b.size()) {}  // NOLINT: implicit
  /// pinned_span<T> → pinned_span<const T>.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  constexpr pinned_span(const pinned_span<U>& s) noexcept : data_(s.data()), size_(s.size()) {}  // NOLINT: implicit

  /// Pinned memory is host memory.
  constexpr operator host_span<T>() const noexcept { return {data_, size_}; }  // NOLINT: implicit

  /// Pointer to the first element (null for an empty default-constructed span).
  constexpr T* data() const noexcept { return data_; }
  /// Number of elements.
  constexpr std::size_t size() const noexcept { return size_; }
  /// size() × sizeof(T) in bytes, or SIZE_MAX when that overflows.
  constexpr std::size_t size_bytes() const noexcept { return detail::saturating_bytes<T>(size_); }
  /// True when size() is 0.
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// Pointer to the first element.
  constexpr T* begin() const noexcept { return data_; }
  /// Pointer one past the last element.
  constexpr T* end() const noexcept { return data_ + size_; }
  /// Element `i`. Unchecked, like std::span.
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// Elements [offset, offset + count), still pinned memory. Unchecked, like std::span.
  constexpr pinned_span subspan(std::size_t offset, std::size_t count) const noexcept {
    return {data_ + offset, count};
  }
  /// Elements from `offset` to the end, still pinned memory. Unchecked: `offset` must not exceed size().
  constexpr pinned_span subspan(std::size_t offset) const noexcept { return {data_ + offset, size_ - offset}; }
  /// The first `count` elements, still pinned memory. Unchecked: `count` must not exceed size().
  constexpr pinned_span first(std::size_t count) const noexcept { return {data_, count}; }
  /// The last `count` elements, still pinned memory. Unchecked: `count` must not exceed size().
  constexpr pinned_span last(std::size_t count) const noexcept { return {data_ + (size_ - count), count}; }
  /// The plain span.
  constexpr gpukit::span<T> span() const noexcept { return {data_, size_}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Memory of a device, with the device it belongs to (checked against the copy's stream). For the CPU device it is
/// host memory.
template <class T>
class device_span {
 public:
  /// The element type, cv-qualifiers included.
  using element_type = T;
  /// The element type without cv-qualifiers.
  using value_type = std::remove_cv_t<T>;
  /// Where the memory is: memory_location::device.
  static constexpr memory_location location = memory_location::device;

  /// An empty span (null data, default device).
  device_span() noexcept = default;
  /// `size` elements of memory of device `d` starting at `data`.
  device_span(T* data, std::size_t size, gpukit::device d) noexcept : data_(data), size_(size), device_(d) {}
  /// The elements of a plain span, which the caller says are memory of device `d`.
  device_span(gpukit::span<T> s, gpukit::device d) noexcept : data_(s.data()), size_(s.size()), device_(d) {}
  /// From a device buffer (gpukit::device_buffer<T> or anything with data(), size(), device() and stream()).
  template <class Buffer, class = std::enable_if_t<detail::is_device_buffer_like<Buffer>::value>,
            class = std::enable_if_t<detail::is_element_convertible<
                std::remove_pointer_t<decltype(std::declval<Buffer&>().data())>, T>::value>>  // not Derived → Base
  device_span(Buffer& b) : data_(b.data()), size_(b.size()), device_(b.device()) {}           // NOLINT: implicit
  /// device_span<T> → device_span<const T>.
  template <class U, class = std::enable_if_t<detail::is_element_convertible<U, T>::value>>
  device_span(const device_span<U>& s) noexcept  // NOLINT: implicit
      : data_(s.data()), size_(s.size()), device_(s.device()) {}

  /// Pointer to the first element, in the device's memory (null for an empty default-constructed span).
  T* data() const noexcept { return data_; }
  /// Number of elements.
  std::size_t size() const noexcept { return size_; }
  /// size() × sizeof(T) in bytes, or SIZE_MAX when that overflows.
  std::size_t size_bytes() const noexcept { return detail::saturating_bytes<T>(size_); }
  /// True when size() is 0.
  bool empty() const noexcept { return size_ == 0; }
  /// The device the memory belongs to.
  gpukit::device device() const noexcept { return device_; }
  /// Elements [offset, offset + count), on the same device. Unchecked, like std::span.
  device_span subspan(std::size_t offset, std::size_t count) const noexcept { return {data_ + offset, count, device_}; }
  /// Elements from `offset` to the end, on the same device. Unchecked: `offset` must not exceed size().
  device_span subspan(std::size_t offset) const noexcept { return {data_ + offset, size_ - offset, device_}; }
  /// The first `count` elements, on the same device. Unchecked: `count` must not exceed size().
  device_span first(std::size_t count) const noexcept { return {data_, count, device_}; }
  /// The last `count` elements, on the same device. Unchecked: `count` must not exceed size().
  device_span last(std::size_t count) const noexcept { return {data_ + (size_ - count), count, device_}; }
  /// The plain span, without the device.
  gpukit::span<T> span() const noexcept { return {data_, size_}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  gpukit::device device_{};
};

namespace detail {

template <class X>
struct is_located_span : std::false_type {};
template <class T>
struct is_located_span<host_span<T>> : std::true_type {};
template <class T>
struct is_located_span<pinned_span<T>> : std::true_type {};
template <class T>
struct is_located_span<device_span<T>> : std::true_type {};

template <class X>
struct is_pinned_container : std::false_type {};
template <class T>
struct is_pinned_container<pinned_buffer<T>> : std::true_type {};
template <class T>
struct is_pinned_container<pooled_pinned_buffer<T>> : std::true_type {};

template <class X>
struct is_pooled_pinned_buffer : std::false_type {};
template <class T>
struct is_pooled_pinned_buffer<pooled_pinned_buffer<T>> : std::true_type {};

template <class X>
struct is_std_array : std::false_type {};
template <class T, std::size_t N>
struct is_std_array<std::array<T, N>> : std::true_type {};

template <class X>
struct is_host_container : is_std_array<X> {};
template <class T, class A>
struct is_host_container<std::vector<T, A>> : std::true_type {};

/// Whether the type fixes where X's memory is (gpukit's pinned buffers, and device buffers: any type with data(),
/// size(), device() and stream(), a user's own included), so copies need not ask CUDA; spans and host containers are
/// checked (a vector may be registered, a span may lie).
template <class X>
struct location_is_known : std::integral_constant<bool, is_pinned_container<std::remove_cv_t<X>>::value ||
                                                            is_device_buffer_like<std::remove_cv_t<X>>::value> {};

template <class>
struct always_false : std::false_type {};

/// The located span of anything a copy accepts: located spans as they are, pinned buffers as pinned_span, vectors
/// and arrays as host_span, device buffers as device_span. Anything else (a plain span, a pointer) is a compile
/// error that says how to fix it.
template <class X>
auto located_view(X& x) {
  using D = std::remove_cv_t<X>;
  if constexpr (is_located_span<D>::value) {
    return D(x);
  } else if constexpr (is_pinned_container<D>::value) {
    using element = std::remove_pointer_t<decltype(x.data())>;
    return pinned_span<element>(x.data(), x.size());
  } else if constexpr (is_host_container<D>::value) {
    using element = std::remove_pointer_t<decltype(x.data())>;
    return host_span<element>(x.data(), x.size());
  } else if constexpr (is_device_buffer_like<D>::value) {
    using element = std::remove_pointer_t<decltype(x.data())>;
    return device_span<element>(x.data(), x.size(), x.device());
  } else {
    static_assert(always_false<D>::value,
                  "gpukit: cannot tell where this memory is. Wrap it: gpukit::host_span<T>(ptr, n), "
                  "gpukit::pinned_span<T>(ptr, n) or gpukit::device_span<T>(ptr, n, device)");
    return host_span<int>();
  }
}

}  // namespace detail
GPUKIT_END_NAMESPACE
