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

/// Bytes with the exact count alongside: "1.50 GiB (1610612736 bytes)".
GPUKIT_INLINE std::string format_bytes_exact(std::size_t bytes);

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::string format_bytes(std::size_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  return text;
}

GPUKIT_INLINE std::string format_bytes_exact(std::size_t bytes) {
  if (bytes < 1024) return format_bytes(bytes);
  return format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)";
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
