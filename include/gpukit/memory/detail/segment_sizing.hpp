// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's growth policy: how requests are rounded, how large a new segment is, and when a block is
/// split. Pure functions of allocator_options and the reserved bytes, apart from the engine (caching_allocator.hpp)
/// so they can be read and tested alone. The README's "Constants: measured, not copied" says why these sizes.

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/allocator_options.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>

GPUKIT_BEGIN_NAMESPACE
namespace detail::segment_sizing {

/// `n` rounded up to a multiple of `g` (a power of two); the caller makes sure it does not overflow.
constexpr std::size_t round_up(std::size_t n, std::size_t g) noexcept { return (n + g - 1) / g * g; }

/// A request of `bytes` (> 0) rounded to `o.rounding`, or 0 when rounding it (or the segment rounding a request of
/// that size gets) would overflow.
constexpr std::size_t rounded_request(const allocator_options& o, std::size_t bytes) noexcept {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  if (bytes > max - (o.rounding - 1)) return 0;
  const std::size_t size = (bytes + o.rounding - 1) & ~(o.rounding - 1);
  if (size > o.small_size && size >= o.own_segment_size() && size > max - (o.large_segment_rounding - 1)) return 0;
  return size;
}

/// The largest shared segment growth makes: 4 x medium_size, rounded down to large_segment_rounding (so segments
/// stay multiples of it) and saturated instead of wrapping.
constexpr std::size_t medium_segment_cap(const allocator_options& o) noexcept {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  const std::size_t cap = o.medium_size > max / 4 ? max : 4 * o.medium_size;
  return cap / o.large_segment_rounding * o.large_segment_rounding;
}

/// The smallest segment that holds a rounded request: a small segment, or the request rounded to
/// large_segment_rounding. Tried when the preferred segment cannot be had.
constexpr std::size_t minimal(const allocator_options& o, std::size_t size, bool small) noexcept {
  if (small) return o.small_segment_size;
  return std::max(size, round_up(size, o.large_segment_rounding));  // the request itself if rounding overflows
}

/// The segment a rounded request of `size` gets on a cache miss, sized for the footprint (`reserved` bytes held
/// now): a small segment; a shared segment that grows with the footprint and holds a whole number of such
/// requests; or the request's own segment from own_segment_size() on.
constexpr std::size_t preferred(const allocator_options& o, std::size_t size, bool small,
                                std::size_t reserved) noexcept {
  if (small) return o.small_segment_size;
  const std::size_t g = o.large_segment_rounding;
  if (size >= o.own_segment_size()) return round_up(size, g);
  std::size_t seg = o.medium_segment_size;
  if (o.medium_segment_growth == 0) return seg;
  seg = std::max(seg, std::min(round_up(reserved / o.medium_segment_growth, g), medium_segment_cap(o)));
  // A whole number of such requests, so a run of equal sizes (the common case) leaves no unusable tail; one fewer
  // when that makes the rounding to g exact (5 MiB requests: 20 MiB segments, not 26).
  std::size_t count = std::max<std::size_t>(seg / size, 1);
  if (count > 1 && (count * size) % g != 0 && ((count - 1) * size) % g == 0) --count;
  // Segment sizes near the largest size_t (a huge medium_segment_size or medium_size) saturate, never wrap: as many
  // requests as round up without overflow, or minimal() (which keeps a request it cannot round).
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  if (count * size > max - (g - 1)) count = (max - (g - 1)) / size;
  return count == 0 ? minimal(o, size, small) : round_up(count * size, g);
}

/// For a shared (medium) segment: the fewest such requests, up to 4, whose total is a multiple of
/// large_segment_rounding, so that none of the segment is lost to rounding; minimal() otherwise.
constexpr std::size_t unrounded(const allocator_options& o, std::size_t size, bool small) noexcept {
  if (small || size >= o.own_segment_size()) return minimal(o, size, small);
  for (std::size_t count = 1; count <= 4; ++count) {
    if (size <= std::numeric_limits<std::size_t>::max() / count && (count * size) % o.large_segment_rounding == 0) {
      return count * size;
    }
  }
  return minimal(o, size, small);
}

/// preferred(), shrunk to the room left under `limit` (with `reserved` bytes held and `in_flight` being allocated)
/// when it would exceed it, never below minimal(): a request that does not fit even then hits the limit.
constexpr std::size_t fitted(const allocator_options& o, std::size_t size, bool small, std::size_t reserved,
                             std::size_t in_flight, std::size_t limit) noexcept {
  const std::size_t wanted = preferred(o, size, small, reserved);
  if (small || size >= o.own_segment_size() || limit == allocator_options::unlimited) return wanted;
  const std::size_t taken = reserved + in_flight;
  const std::size_t room = limit > taken ? limit - taken : 0;
  if (wanted <= room) return wanted;
  return std::max(minimal(o, size, small), room / o.large_segment_rounding * o.large_segment_rounding);
}

/// Whether a free block taken for a request of `size` leaves its `remainder` as a block of its own: small blocks
/// past small_split_threshold, large ones past large_split_threshold, and never the blocks of a segment made for
/// one request of max_split_size or more (`dedicated`), which are used whole. Large blocks of an expandable range
/// (`expandable`) are always split, as PyTorch's expandable segments do: a remainder kept with the block holds mapped
/// memory (up to large_split_threshold a block) that no neighbour can coalesce with until the block is freed
/// (bench_fragmentation, minimum capacity of expandable segments at the failing request, L6 h512 seed 5: 12 MiB of
/// 28 MiB above peak requested; worst of ten seeds 1.021 to 1.019).
constexpr bool should_split(const allocator_options& o, bool small, bool dedicated, std::size_t size,
                            std::size_t remainder, bool expandable = false) noexcept {
  if (remainder == 0) return false;
  if (small) return remainder > o.small_split_threshold;
  if (dedicated && size >= o.max_split_size) return false;
  return expandable || remainder > o.large_split_threshold;
}

}  // namespace detail::segment_sizing
GPUKIT_END_NAMESPACE
