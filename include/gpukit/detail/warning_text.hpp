// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Warnings built from parts where std::bad_alloc must not escape: destructors and catch handlers of noexcept code
/// warn with `warn("text: " + std::string(e.what()))` at their peril, since a second std::bad_alloc there calls
/// std::terminate. detail::warn_parts joins its parts on the heap when it can and in a fixed buffer when it cannot.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/error.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// A byte count in a warning, written as format_bytes() writes it ("1.50 GiB"), or with `exact` as
/// format_bytes_exact() does ("1.50 GiB (1610612736 bytes)").
struct bytes_part {
  std::size_t bytes;
  bool exact = false;
};

/// One part of a warning's text, held without allocating: text as it is (a null `const char*` reads "(null)"), or
/// an integer or a byte count written into the part's own buffer. Not copyable (the text may point into itself).
class warning_part {
 public:
  explicit warning_part(std::string_view text) noexcept : text_(text) {}
  explicit warning_part(const char* text) noexcept : text_(text != nullptr ? text : "(null)") {}
  explicit warning_part(const std::string& text) noexcept : text_(text) {}
  template <class Integer, std::enable_if_t<std::is_integral_v<Integer> && !std::is_same_v<Integer, bool> &&
                                                !std::is_same_v<Integer, char>,
                                            int> = 0>
  explicit warning_part(Integer value) noexcept {
    keep(std::is_signed_v<Integer>
             ? std::snprintf(written_, sizeof written_, "%lld", static_cast<long long>(value))
             : std::snprintf(written_, sizeof written_, "%llu", static_cast<unsigned long long>(value)));
  }
  /// A gpukit::device (anything with is_cuda() and ordinal()), written as device::to_string() writes it: "cpu" or
  /// "cuda:N" (this header cannot include device.hpp, which includes it).
  template <class Device, class = decltype(std::declval<const Device&>().is_cuda()),
            class = decltype(std::declval<const Device&>().ordinal())>
  explicit warning_part(const Device& d) noexcept {
    keep(d.is_cuda() ? std::snprintf(written_, sizeof written_, "cuda:%d", static_cast<int>(d.ordinal()))
                     : std::snprintf(written_, sizeof written_, "cpu"));
  }
  explicit warning_part(bytes_part count) noexcept {
    if (count.exact) {
      text_ = std::string_view(written_, format_bytes_exact_into(written_, count.bytes));
      return;
    }
    char rounded[32];
    const std::size_t length = format_bytes_into(rounded, count.bytes);
    keep(std::snprintf(written_, sizeof written_, "%.*s", static_cast<int>(length), rounded));
  }
  warning_part(const warning_part&) = delete;
  warning_part& operator=(const warning_part&) = delete;

  std::string_view text() const noexcept { return text_; }

 private:
  void keep(int written) noexcept {  // what std::snprintf wrote into written_: the text
    text_ = std::string_view(written_, written < 0 ? 0 : static_cast<std::size_t>(written));
  }

  char written_[48] = {};  // the longest: "16384.00 PiB (18446744073709551615 bytes)"
  std::string_view text_;
};

/// How many characters of a warning survive when the host is out of memory: the parts are then joined in a
/// buffer of this size on the stack, cut short with a marker when they do not fit.
inline constexpr std::size_t warning_fallback_capacity = 512;

/// warn()s `parts` joined (see warn_parts); never throws.
GPUKIT_INLINE void warn_joined(const warning_part* parts, std::size_t count) noexcept;

/// warn()s the concatenation of `parts` (text, integers, bytes_part), never throwing: out of host memory, the text
/// is joined in a stack buffer of warning_fallback_capacity characters instead, cut short with
/// " [cut short: out of host memory]" if it does not fit. For destructors and catch handlers of noexcept code.
template <class... Parts>
void warn_parts(const Parts&... parts) noexcept {
  const warning_part joined[] = {warning_part(parts)...};
  warn_joined(joined, sizeof...(Parts));
}

/// Calls `report(what)` with the message of the exception `failure` holds ("an unknown exception" for one not
/// derived from std::exception), inside the handler: a rethrown exception may be a copy that lives only there.
template <class Report>
void with_message_of(const std::exception_ptr& failure, Report&& report) noexcept {
  if (!failure) {
    report("an unknown exception");
    return;
  }
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    report(e.what());
  } catch (...) {
    report("an unknown exception");
  }
}

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE void warn_joined(const warning_part* parts, std::size_t count) noexcept {
  std::size_t length = 0;
  for (std::size_t i = 0; i < count; ++i) length += parts[i].text().size();
  try {
    std::string text;
    text.reserve(length);
    for (std::size_t i = 0; i < count; ++i) text += parts[i].text();
    warn(text);
    return;
  } catch (...) {  // std::bad_alloc: join on the stack instead
  }
  constexpr std::string_view marker = " [cut short: out of host memory]";
  char buffer[warning_fallback_capacity];
  const std::size_t room = length <= sizeof buffer ? sizeof buffer : sizeof buffer - marker.size();
  std::size_t used = 0;
  for (std::size_t i = 0; i < count && used < room; ++i) {
    const std::string_view part = parts[i].text();
    const std::size_t taken = part.size() < room - used ? part.size() : room - used;
    part.copy(buffer + used, taken);
    used += taken;
  }
  if (length > sizeof buffer) used += marker.copy(buffer + used, marker.size());
  warn(std::string_view(buffer, used));
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
