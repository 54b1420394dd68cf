// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device value type ("cpu" or "cuda:N"), the number of visible CUDA devices, the current device and an RAII
/// guard that switches it for a scope. Nothing here creates a CUDA context on a device the user did not name.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/driver_api.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdlib>
#include <iosfwd>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

GPUKIT_BEGIN_NAMESPACE

namespace detail {

/// `s` without the whitespace around it (what isspace accepts in the C locale).
GPUKIT_INLINE std::string_view trim_whitespace(std::string_view s) noexcept;

/// The value of a non-empty string of decimal digits, saturated at ULLONG_MAX (so "too big" stays too big for any
/// range check, whatever its length); nullopt if `digits` is empty or holds anything but 0-9.
GPUKIT_INLINE std::optional<unsigned long long> parse_decimal_saturating(std::string_view digits) noexcept;

}  // namespace detail

/// Names where memory lives and work runs: the host CPU, or a CUDA device by its ordinal among the visible devices
/// (after CUDA_VISIBLE_DEVICES). A plain value: cheap to copy, comparable, hashable, printable as "cpu"/"cuda:N".
class device {
 public:
  /// Which kind of device: the host CPU or a CUDA GPU.
  enum class kind : unsigned char {
    cpu,  ///< the host CPU
    cuda  ///< a CUDA device, named by its ordinal
  };

  /// The CPU.
  constexpr device() noexcept = default;

  /// The CPU device.
  static constexpr device cpu() noexcept { return device{}; }

  /// The CUDA device with this ordinal. Throws invalid_argument_error for a negative ordinal. Whether the ordinal
  /// exists is checked when the device is used (so a value can be built before CUDA is initialised).
  static device cuda(int ordinal);

  /// Parses "cpu", "cuda" (meaning cuda:0) or "cuda:N" with N a decimal ordinal up to INT_MAX (leading zeros
  /// allowed); surrounding whitespace (spaces, tabs, newlines, `\r`, `\f`, `\v`) is ignored, nothing else is
  /// accepted. Throws invalid_argument_error naming the text otherwise, including for an ordinal beyond INT_MAX.
  static device parse(std::string_view text);

  /// kind::cpu or kind::cuda.
  constexpr kind type() const noexcept { return kind_; }
  /// True for the CPU.
  constexpr bool is_cpu() const noexcept { return kind_ == kind::cpu; }
  /// True for a CUDA device.
  constexpr bool is_cuda() const noexcept { return kind_ == kind::cuda; }
  /// The CUDA ordinal, or -1 for the CPU.
  constexpr int ordinal() const noexcept { return ordinal_; }

  /// "cpu" or "cuda:N"; device::parse(d.to_string()) == d.
  std::string to_string() const;

  /// Equal when both are the CPU or both are the same CUDA ordinal.
  friend constexpr bool operator==(device a, device b) noexcept {
    return a.kind_ == b.kind_ && a.ordinal_ == b.ordinal_;
  }
  /// Not equal (see operator==).
  friend constexpr bool operator!=(device a, device b) noexcept { return !(a == b); }
  /// The CPU orders first, then CUDA devices by ordinal.
  friend constexpr bool operator<(device a, device b) noexcept { return a.ordinal_ < b.ordinal_; }

  /// Writes to_string() ("cpu" or "cuda:N") to `out`.
  template <class CharT, class Traits>
  friend std::basic_ostream<CharT, Traits>& operator<<(std::basic_ostream<CharT, Traits>& out, device d) {
    return out << d.to_string().c_str();
  }

 private:
  constexpr device(kind k, int ordinal) noexcept : kind_(k), ordinal_(ordinal) {}
  kind kind_ = kind::cpu;
  int ordinal_ = -1;
};

/// The number of CUDA devices visible to this process. Never throws: 0 whenever cudaGetDeviceCount fails, whatever
/// the reason: no driver (cudaErrorInsufficientDriver), only the stub library (cudaErrorStubLibrary), no GPU
/// (cudaErrorNoDevice), but also an installed CUDA that fails to initialise (e.g. cudaErrorSystemDriverMismatch after
/// a driver upgrade without a reboot, cudaErrorInitializationError), where GPUs may be present. describe_no_gpu()
/// (select.hpp) says which; select_device() warns about the last kind before it falls back to the CPU.
GPUKIT_INLINE int device_count() noexcept;

/// The calling thread's current CUDA device. Throws no_device_error without a usable driver or GPU (no driver, no
/// GPU, or a CUDA that fails to initialise, such as cudaErrorSystemDriverMismatch: error.hpp's table).
/// cudaErrorUnknown and cudaErrorOperatingSystem are a cuda_error here: a running CUDA reports them too, so only
/// select_device() and describe_no_gpu(), which read them from cudaGetDeviceCount, call them a failed start.
GPUKIT_INLINE device current_device();

/// Makes `d` the calling thread's current CUDA device (cudaSetDevice). Does nothing for the CPU.
/// Throws invalid_argument_error for an ordinal that is not visible, naming the visible count.
GPUKIT_INLINE void set_current_device(device d);

/// RAII: makes a device current for the calling thread and restores the previous current device when the scope ends.
/// For the CPU it changes nothing. It calls cudaSetDevice only when the device differs from the current one, so
/// nesting is cheap; a guard that switched nothing still restores the device if code in its scope switched it (a
/// library's cudaSetDevice, say), asking cudaGetDevice once at its end, as PyTorch's guards do. Not copyable or
/// movable (it restores state of the thread that created it).
///
/// It never creates a context to restore: cudaSetDevice initialises the device's primary context, and cudaGetDevice
/// says 0 on a thread that never chose a device, so restoring "the previous device" blindly would create cuda:0's
/// context in every process that uses only another GPU. A thread that had no context current gets cudaGetDevice's
/// device back only if that device's primary context is active (else it keeps `d` current), and nothing is restored
/// onto a device whose primary context is no longer active. The driver is asked through
/// cudaGetDriverEntryPointByVersion (detail/driver_api.hpp). Devices, not contexts, are restored: a context the thread
/// made current with the driver API (cuCtxCreate, a green context, a video codec's) is replaced, when the guard
/// switches devices, by the primary context of `d`, and then by its own device's primary context only where that one
/// is active (else `d`'s stays current). Keep such a context current around gpukit calls with cuCtxSetCurrent, or make
/// them on another thread.
class device_guard {
 public:
  /// Makes `d` current. Throws invalid_argument_error for an ordinal that is not visible, no_device_error without a
  /// usable driver (as current_device()).
  explicit device_guard(device d);
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  /// Restores the previous device (see the class comment); failures are reported through gpukit::warn.
  ~device_guard();

 private:
  int previous_ = 0;
  bool had_context_ = true;
  bool changed_ = false;
  bool cuda_ = false;  // a CUDA device was made current (a guard of the CPU restores nothing)
};

namespace detail {

/// device_with_context's answer when the current context serves: one is current on the thread, or the driver entry
/// points are missing (then the runtime alone cannot tell, and the call runs as it would without gpukit).
inline constexpr int keep_current_context = -2;
/// device_with_context's answer when no device has a context and none may be created.
inline constexpr int no_context_anywhere = -1;

/// The device on which to make a call that any context can serve but that needs one (cudaHostAlloc and
/// cudaHostRegister of portable memory, cudaPointerGetAttributes, cudaHostGetDevicePointer under unified
/// addressing): such calls run in the current context, and on a thread with none the runtime would create cuda:0's.
/// In order: keep_current_context if a context is current; `preferred` if its primary context is active; the first
/// device whose primary context is active; else `preferred` when `allow_new` (the caller named it, so a context there
/// is expected), else no_context_anywhere. Creates nothing itself; never throws.
GPUKIT_INLINE int device_with_context(int preferred, bool allow_new = true) noexcept;

/// Throws invalid_argument_error, naming `who`, for a CUDA device whose ordinal is not visible: calls that any context
/// serves (portable pinned memory) would not refuse it themselves. Does nothing when no device is visible (the call
/// itself then says why, as no_device_error).
GPUKIT_INLINE void require_visible(device d, const char* who);

/// RAII for a call that needs a context: with `any_context` (the call is served by any context, e.g. portable pinned
/// memory) makes device_with_context(ordinal) current, else `ordinal` itself (device_guard). Nothing changes when
/// the current context serves. See device_guard for what is restored.
class context_scope {
 public:
  explicit context_scope(int ordinal, bool any_context = true);
  /// The device made current, or keep_current_context / no_context_anywhere (see device_with_context).
  int ordinal() const noexcept;

 private:
  int ordinal_;
  std::optional<device_guard> guard_;
};

}  // namespace detail

/// A range over the visible CUDA devices, cuda:0 ... cuda:(device_count()-1), taken when the range is created.
/// Enumerating creates no CUDA context.
class device_range {
 public:
  /// Steps through CUDA ordinals. Dereferencing yields a device by value (there is no stored device to refer to).
  class iterator {
   public:
    /// An input iterator for C++17's requirements (operator* returns a value, not a reference, as iota_view's) ...
    using iterator_category = std::input_iterator_tag;
#if defined(__cpp_lib_ranges) && __cpp_lib_ranges >= 201911L
    /// ... and a forward iterator for C++20's concepts, which allow that.
    using iterator_concept = std::forward_iterator_tag;
#endif
    /// gpukit::device.
    using value_type = device;
    /// std::ptrdiff_t.
    using difference_type = std::ptrdiff_t;
    /// `const device*` (declared for std::iterator_traits; there is no operator->).
    using pointer = const device*;
    /// gpukit::device, by value: operator* returns a temporary.
    using reference = device;

    /// At cuda:0.
    constexpr iterator() noexcept = default;
    /// At the given ordinal.
    constexpr explicit iterator(int ordinal) noexcept : ordinal_(ordinal) {}
    /// The device at this position (device::cuda of the ordinal).
    device operator*() const;
    /// Moves to the next ordinal.
    iterator& operator++() noexcept;
    /// Moves to the next ordinal; returns the position before the move.
    iterator operator++(int) noexcept;
    /// Equal at the same ordinal.
    friend constexpr bool operator==(iterator a, iterator b) noexcept { return a.ordinal_ == b.ordinal_; }
    /// Not equal (see operator==).
    friend constexpr bool operator!=(iterator a, iterator b) noexcept { return a.ordinal_ != b.ordinal_; }

   private:
    int ordinal_ = 0;
  };

  /// cuda:0 ... cuda:(count-1); a negative count gives an empty range. Ordinals are not checked against the machine.
  explicit device_range(int count) noexcept;
  /// At cuda:0.
  iterator begin() const noexcept;
  /// Past the last device.
  iterator end() const noexcept;
  /// The number of devices in the range.
  std::size_t size() const noexcept;
  /// True when the range holds no device.
  bool empty() const noexcept;

 private:
  int count_;
};

/// The visible CUDA devices: `for (gpukit::device d : gpukit::cuda_devices()) ...`. Empty without a GPU.
GPUKIT_INLINE device_range cuda_devices() noexcept;

GPUKIT_END_NAMESPACE

namespace std {
/// Hashes a gpukit::device, so it can key std::unordered_map and std::unordered_set.
template <>
struct hash<gpukit::device> {
  /// A hash of the ordinal (-1 for the CPU), which alone identifies the device.
  std::size_t operator()(gpukit::device d) const noexcept { return std::hash<int>()(d.ordinal()); }
};
}  // namespace std

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::string_view trim_whitespace(std::string_view s) noexcept {
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

GPUKIT_INLINE std::optional<unsigned long long> parse_decimal_saturating(std::string_view digits) noexcept {
  if (digits.empty()) return std::nullopt;
  constexpr unsigned long long max = std::numeric_limits<unsigned long long>::max();
  unsigned long long value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<unsigned long long>(c - '0');
    value = value > (max - digit) / 10 ? max : value * 10 + digit;
  }
  return value;
}
}  // namespace detail

GPUKIT_INLINE device device::cuda(int ordinal) {
  if (ordinal < 0) {
    throw invalid_argument_error("gpukit::device::cuda(" + std::to_string(ordinal) +
                                 "): a CUDA ordinal must be non-negative");
  }
  return device(kind::cuda, ordinal);
}

GPUKIT_INLINE device device::parse(std::string_view text) {
  const std::string_view original = text;
  text = detail::trim_whitespace(text);
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  constexpr std::string_view prefix = "cuda:";
  const char* why = "expected \"cpu\", \"cuda\" or \"cuda:N\" with N a non-negative integer";
  if (text.size() > prefix.size() && text.substr(0, prefix.size()) == prefix) {
    if (const auto ordinal = detail::parse_decimal_saturating(text.substr(prefix.size()))) {
      if (*ordinal <= static_cast<unsigned long long>(std::numeric_limits<int>::max())) {
        return cuda(static_cast<int>(*ordinal));
      }
      why = "the ordinal is beyond any device (cuda:N takes N up to 2147483647)";
    }
  }
  throw invalid_argument_error("invalid device \"" + std::string(original) + "\": " + why);
}

GPUKIT_INLINE std::string device::to_string() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(ordinal_);
}

GPUKIT_INLINE int device_count() noexcept {
  try {
    detail::note_cuda_use();
  } catch (...) {
  }
  int count = 0;  // not written by CUDA on error
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

GPUKIT_INLINE device current_device() {
  detail::note_cuda_use();
  int ordinal = 0;
  GPUKIT_CUDA_TRY(cudaGetDevice(&ordinal));
  return device::cuda(ordinal);
}

GPUKIT_INLINE void set_current_device(device d) {
  if (!d.is_cuda()) return;
  detail::note_cuda_use();
  GPUKIT_CUDA_TRY_DESCRIBED(cudaSetDevice(d.ordinal()), "cudaSetDevice(" + std::to_string(d.ordinal()) + ")",
                            d.ordinal());
}

GPUKIT_INLINE device_guard::device_guard(device d) {
  if (!d.is_cuda()) return;
  detail::note_cuda_use();
  GPUKIT_CUDA_TRY(cudaGetDevice(&previous_));
  cuda_ = true;
  // 0: no context is current, so cudaGetDevice's answer is a default, which the runtime would initialise.
  had_context_ = detail::thread_context_state() != 0;
  if (previous_ != d.ordinal() || !had_context_) {
    set_current_device(d);
    changed_ = previous_ != d.ordinal();
  }
}

GPUKIT_INLINE device_guard::~device_guard() {
  if (!cuda_) return;
  if (!changed_) {  // nothing switched at the start: restore only what code in the scope switched
    int now = previous_;
    const cudaError_t asked = cudaGetDevice(&now);
    detail::forget_failure(asked);
    if (asked != cudaSuccess || now == previous_) return;
  }
  // Not active (reset meanwhile, or never created for a thread that had no context): restoring would create it.
  const int state = detail::primary_context_state(previous_);
  if (state == 0 || (!had_context_ && state != 1)) return;
  detail::report_cuda_failure(cudaSetDevice(previous_), "cudaSetDevice (restoring in ~device_guard)", previous_);
}
namespace detail {

GPUKIT_INLINE int device_with_context(int preferred, bool allow_new) noexcept {
  if (thread_context_state() != 0) return keep_current_context;
  if (preferred >= 0 && primary_context_state(preferred) == 1) return preferred;
  const int count = device_count();
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    if (ordinal != preferred && primary_context_state(ordinal) == 1) return ordinal;
  }
  return allow_new && preferred >= 0 ? preferred : no_context_anywhere;
}

GPUKIT_INLINE void require_visible(device d, const char* who) {
  if (!d.is_cuda()) return;
  if (const int visible = device_count(); visible > 0 && d.ordinal() >= visible) {
    throw invalid_argument_error(std::string(who) + ": " + d.to_string() + " is not visible (" +
                                 std::to_string(visible) + " CUDA devices)");
  }
}

GPUKIT_INLINE context_scope::context_scope(int ordinal, bool any_context)
    : ordinal_(any_context ? device_with_context(ordinal) : ordinal) {
  if (ordinal_ >= 0) guard_.emplace(device::cuda(ordinal_));
}

GPUKIT_INLINE int context_scope::ordinal() const noexcept { return ordinal_; }
}  // namespace detail

GPUKIT_INLINE device device_range::iterator::operator*() const { return device::cuda(ordinal_); }

GPUKIT_INLINE device_range::iterator& device_range::iterator::operator++() noexcept {
  ++ordinal_;
  return *this;
}

GPUKIT_INLINE device_range::iterator device_range::iterator::operator++(int) noexcept {
  iterator old = *this;
  ++ordinal_;
  return old;
}

GPUKIT_INLINE device_range::device_range(int count) noexcept : count_(count < 0 ? 0 : count) {}

GPUKIT_INLINE device_range::iterator device_range::begin() const noexcept { return iterator(0); }

GPUKIT_INLINE device_range::iterator device_range::end() const noexcept { return iterator(count_); }

GPUKIT_INLINE std::size_t device_range::size() const noexcept { return static_cast<std::size_t>(count_); }

GPUKIT_INLINE bool device_range::empty() const noexcept { return count_ == 0; }

GPUKIT_INLINE device_range cuda_devices() noexcept { return device_range(device_count()); }

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
