// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// gpukit::span<T>: a pointer and a count, for C++17 (which has no std::span). It is a contiguous, sized range with
/// pointer iterators, so under C++20 a std::span can be built from it directly. It says nothing about where the
/// memory lives: device_buffer<T>::span() points to device memory.

#include <gpukit/detail/config.hpp>

#include <cstddef>
#include <limits>
#include <type_traits>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// count x sizeof(T), or SIZE_MAX when that overflows: a span that large describes no real memory, and SIZE_MAX
/// fails every later size check instead of passing a wrapped, small byte count on (copy_async rejects such spans
/// with a message naming the count and element size).
template <class T>
constexpr std::size_t saturating_bytes(std::size_t count) noexcept {
  return count > std::numeric_limits<std::size_t>::max() / sizeof(T) ? std::numeric_limits<std::size_t>::max()
                                                                     : count * sizeof(T);
}
}  // namespace detail

/// A pointer and a count: `size()` contiguous elements of T, not owned. It says nothing about where they live; the
/// located spans (host_span, pinned_span, device_span) do.
template <class T>
class span {
 public:
  /// The element type, cv-qualifiers included.
  using element_type = T;
  /// The element type without cv-qualifiers.
  using value_type = std::remove_cv_t<T>;
  /// The type of sizes and indices.
  using size_type = std::size_t;
  /// Pointer to an element.
  using pointer = T*;
  /// Reference to an element.
  using reference = T&;
  /// Iterator: a plain pointer.
  using iterator = T*;

  /// An empty span (null data).
  constexpr span() noexcept = default;
  /// `size` elements starting at `data`.
  constexpr span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// From a const-compatible span (span<int> → span<const int>).
  template <class U, class = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
  constexpr span(const span<U>& other) noexcept : data_(other.data()), size_(other.size()) {}  // NOLINT
  /// From a contiguous container with data() and size() (std::vector, std::array, std::string, std::span ...).
  template <class Container,
            class = std::enable_if_t<
                !std::is_same<std::remove_cv_t<std::remove_reference_t<Container>>, span>::value &&
                // As std::span: qualification conversions only (no Derived → Base)
                std::is_convertible<std::remove_pointer_t<decltype(std::declval<Container&>().data())> (*)[],
                                    T (*)[]>::value>,
            class = decltype(std::declval<Container&>().size())>
  constexpr span(Container&& c) noexcept : data_(c.data()), size_(c.size()) {}  // NOLINT(google-explicit-constructor)
  /// From a C array.
  template <std::size_t N>
  constexpr span(T (&array)[N]) noexcept : data_(array), size_(N) {}  // NOLINT(google-explicit-constructor)

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

  /// The first `count` elements. Unchecked, like std::span: `count` must not exceed size().
  constexpr span first(std::size_t count) const noexcept { return span(data_, count); }
  /// The last `count` elements. Unchecked, like std::span: `count` must not exceed size().
  constexpr span last(std::size_t count) const noexcept { return span(data_ + (size_ - count), count); }
  /// Elements [offset, offset + count). Unchecked, like std::span.
  constexpr span subspan(std::size_t offset, std::size_t count) const noexcept { return span(data_ + offset, count); }
  /// Elements from `offset` to the end. Unchecked, like std::span: `offset` must not exceed size().
  constexpr span subspan(std::size_t offset) const noexcept { return span(data_ + offset, size_ - offset); }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// The bytes of a span, read-only.
template <class T>
span<const unsigned char> as_bytes(span<T> s) noexcept {
  return {reinterpret_cast<const unsigned char*>(s.data()), s.size_bytes()};
}

GPUKIT_END_NAMESPACE
