// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Small text helpers shared by messages and reports.

#include <gpukit/detail/config.hpp>

#include <cstddef>
#include <cstdio>
#include <string>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Human-readable bytes with binary units: "512 B", "1.50 KiB", "16.69 GiB". Exact below 1 KiB.
GPUKIT_INLINE std::string format_bytes(std::size_t bytes);

/// format_bytes() written into `text` without allocating (for messages built where std::bad_alloc must not
/// escape); returns the length. 32 characters always suffice.
GPUKIT_INLINE std::size_t format_bytes_into(char (&text)[32], std::size_t bytes) noexcept;

/// Bytes with the exact count alongside: "1.50 GiB (1610612736 bytes)".
GPUKIT_INLINE std::string format_bytes_exact(std::size_t bytes);

/// format_bytes_exact() written into `text` without allocating; returns the length. 48 characters always suffice
/// (the longest: "16384.00 PiB (18446744073709551615 bytes)").
GPUKIT_INLINE std::size_t format_bytes_exact_into(char (&text)[48], std::size_t bytes) noexcept;

/// An address as messages write it ("0x7f00c0000000"; printf's %p).
GPUKIT_INLINE std::string format_pointer(const void* p);

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::size_t format_bytes_into(char (&text)[32], std::size_t bytes) noexcept {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int length = 0;
  if (bytes < 1024) {
    length = std::snprintf(text, sizeof text, "%zu B", bytes);
  } else {
    double value = static_cast<double>(bytes);
    int unit = 0;
    while (value >= 1024.0 && unit < 5) {
      value /= 1024.0;
      ++unit;
    }
    // "%.2f" rounds 1023.995 and above up to "1024.00": take the next unit then (1 MiB - 1 B is "1.00 MiB").
    if (value >= 1023.995 && unit < 5) {
      value /= 1024.0;
      ++unit;
    }
    length = std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  }
  return length < 0 ? 0 : static_cast<std::size_t>(length);
}

GPUKIT_INLINE std::string format_bytes(std::size_t bytes) {
  char text[32];
  return std::string(text, format_bytes_into(text, bytes));
}

GPUKIT_INLINE std::string format_pointer(const void* p) {
  char text[32];
  const int length = std::snprintf(text, sizeof text, "%p", p);
  return std::string(text, length > 0 ? static_cast<std::size_t>(length) : 0);
}

GPUKIT_INLINE std::string format_bytes_exact(std::size_t bytes) {
  char text[48];
  return std::string(text, format_bytes_exact_into(text, bytes));
}

GPUKIT_INLINE std::size_t format_bytes_exact_into(char (&text)[48], std::size_t bytes) noexcept {
  char rounded[32];
  const std::size_t length = format_bytes_into(rounded, bytes);
  const int written =
      bytes < 1024 ? std::snprintf(text, sizeof text, "%.*s", static_cast<int>(length), rounded)
                   : std::snprintf(text, sizeof text, "%.*s (%zu bytes)", static_cast<int>(length), rounded, bytes);
  return written < 0 ? 0 : static_cast<std::size_t>(written);
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
