// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Size arithmetic shared by the allocators, pools and buffers: one power-of-two test and one checked
/// count * element size, so that every caller reports bad sizes the same way.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>

#include <cstddef>
#include <limits>
#include <string>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// True when n is a power of two (1, 2, 4, ...); false for 0.
constexpr bool is_power_of_two(std::size_t n) noexcept { return n != 0 && (n & (n - 1)) == 0; }

/// count * size, or invalid_argument_error naming `who` when it does not fit in size_t (a count that large is always
/// a bug).
GPUKIT_INLINE std::size_t checked_bytes(std::size_t count, std::size_t element_size, const char* who);

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::size_t checked_bytes(std::size_t count, std::size_t element_size, const char* who) {
  if (element_size != 0 && count > std::numeric_limits<std::size_t>::max() / element_size) {
    throw invalid_argument_error(std::string(who) + ": " + std::to_string(count) + " elements of " +
                                 std::to_string(element_size) + " bytes overflow size_t");
  }
  return count * element_size;
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
