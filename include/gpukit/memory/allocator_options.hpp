// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// allocator_options: how the caching allocator (caching_allocator.hpp) rounds, pools, splits and limits. Apart
/// from the engine, so that configuration code (allocator_config.hpp, GPUKIT_ALLOC_CONF) does not parse it.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/error.hpp>

#include <cstddef>
#include <limits>
#include <string>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

/// When a caching allocator asks CUDA whether a stream is being captured into a CUDA graph (it then refuses to
/// allocate or free on it: allocations made during a capture belong in a graph_pool).
enum class capture_checks {
  /// On every allocate and free on a CUDA stream: one cudaStreamIsCapturing each, which measured 102 ns on an H100
  /// host (bench_allocator, BM_gpu_capture_query), against 40-65 ns for the rest of a cache-hit pair.
  every_call,
  /// Only while a capture begun by gpukit::capture is under way somewhere in the process (one atomic load
  /// otherwise). Captures begun with cudaStreamBeginCapture directly are not seen: memory allocated or freed on
  /// such a stream is handed out and reused as if the stream were not captured, and the graph's replays may then
  /// use memory that was reused (PyTorch's allocator has the same contract). For programs that capture only through
  /// gpukit::capture, or not at all.
  gpukit_captures,
};

/// How a caching allocator rounds, pools, splits and limits. The defaults are gpukit's choice, measured with
/// bench_fragmentation (README, "Caching device allocator"): PyTorch's rounding, small pool and split threshold,
/// plus two changes that cut the memory variable-shape workloads need and the number of cudaMalloc calls: requests
/// up to 64 MiB share segments that grow with the footprint, and huge blocks are kept whole (max_split_size). Like
/// PyTorch, nothing is freed to the upstream while memory is available. pytorch() gives PyTorch's constants.
struct allocator_options {
  static constexpr std::size_t KiB = std::size_t{1} << 10;  ///< 1024 bytes, for writing sizes
  static constexpr std::size_t MiB = std::size_t{1} << 20;  ///< 1024 KiB, for writing sizes
  /// No limit, for reserved_limit and max_split_size (the largest std::size_t).
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

  std::size_t rounding = 512;                ///< requests are rounded up to a multiple of this (a power of two)
  std::size_t small_size = 1 * MiB;          ///< requests up to this are small and come from small segments
  std::size_t small_segment_size = 2 * MiB;  ///< size of a small segment
  /// Larger requests below this share segments of medium_segment_size (or more, see medium_segment_growth);
  /// requests of this size or more get a segment of their own, rounded up to large_segment_rounding (from
  /// max_split_size on where that is smaller: own_segment_size()).
  std::size_t medium_size = 64 * MiB;
  /// Size of the segments shared by requests in (small_size, own_segment_size()); with medium_segment_growth, where
  /// their growth starts.
  std::size_t medium_segment_size = 20 * MiB;
  /// A request's own segment (own_segment_size() or more) is rounded up to a multiple of this, and so are shared
  /// segments that grow (a power of two, at least the rounding and at most 4 × medium_size, the largest shared
  /// segment).
  std::size_t large_segment_rounding = 2 * MiB;
  std::size_t small_split_threshold = 0;  ///< a small block is split when the remainder exceeds this
  /// A large block is split when the remainder exceeds this; in expandable segments, whatever the remainder (as
  /// PyTorch's: a remainder kept with its block holds mapped pages no neighbour can use until the block is freed).
  std::size_t large_split_threshold = 1 * MiB;
  /// Blocks of segments made for one request of this size or more are never split, and smaller requests never use
  /// them (PyTorch's max_split_size_mb): huge blocks stay whole for huge requests, so they become completely free
  /// and releasable when the sizes of the huge requests drift. Below medium_size it also lowers the size from which
  /// a request gets a segment of its own (own_segment_size()), so that such requests' blocks are kept whole there too.
  /// Blocks of shared segments are split whatever their size: those grow up to 4 x medium_size (PyTorch's 20 MiB
  /// ones stay below its max_split_size, which must exceed 20 MiB), so where max_split_size is below that, keep them
  /// under it with medium_segment_growth 0 or a smaller medium_size. Must exceed max_oversize_waste.
  std::size_t max_split_size = 256 * MiB;
  /// A request of max_split_size or more takes a cached block at most this much larger than itself.
  std::size_t max_oversize_waste = 20 * MiB;
  /// Reserved bytes never exceed this: the allocator frees cache and retries, then reports out of memory.
  std::size_t reserved_limit = unlimited;
  /// Reuse a block cached for another stream (the new stream waits for the free's event on the device) before
  /// asking the upstream. Costs an event record per free on CUDA streams. With expandable segments, a stream with a
  /// range of its own maps pages there; another stream's free memory serves it before its first range, or when
  /// mapping fails, and only where pages are mapped already (taking the unmapped rest of another stream's range
  /// interleaved the streams' free blocks, which do not merge). A range whose stream was destroyed is taken over,
  /// unmapped rest included, by the first stream without a range that finds a free block there.
  bool cross_stream_reuse = false;
  /// Before a new segment would raise reserved memory above its high-water mark, return completely free segments
  /// to the upstream first (the smallest that covers the growth): keeps peak reserved memory low when request
  /// sizes drift, at the price of upstream frees (each cudaFree drains the device) while memory is available,
  /// counted in num_device_free_unforced. Off: it brings no measured gain in the memory a job needs (minimum
  /// capacity in bench_fragmentation), because the out-of-memory path releases such segments anyway.
  bool release_before_grow = false;
  /// When non-zero, segments shared by requests in (small_size, own_segment_size()) grow with the footprint: they are
  /// max(medium_segment_size, reserved / medium_segment_growth) (at most 4 × medium_size), trimmed to a whole
  /// number of the request that makes them and rounded to large_segment_rounding, so big programs make few upstream
  /// calls, small ones keep small segments, and a run of equal requests leaves no unusable tail.
  std::size_t medium_segment_growth = 8;
  /// Keep blocks freed on their own stream in a small per-stream cache of exact sizes (front_cache.hpp), so the
  /// next request of that size on that stream takes one uncontended lock instead of the device lock: threads on
  /// different streams do not serialize, and a 256 B cache hit costs about 7x malloc instead of 12x
  /// (bench_allocator; blocks up to small_size, larger ones only once threads contend: caching them delays their
  /// coalescing, see front_cache_large).
  /// The heap takes the blocks back before it grows (with expandable segments: before it maps pages, large blocks
  /// only) or releases memory, so the footprint is unchanged. Snapshots
  /// show such blocks as block_state::cached. Not used with cross_stream_reuse (blocks move between streams there).
  bool front_cache = true;
  /// Cache large blocks (above small_size) in front too, in per-stream slots of their own, from the start: threads
  /// allocating large blocks on different streams then no longer serialize on the device lock (bench_allocator,
  /// 8 MiB pairs: 2 threads reach 1.8x one thread's throughput, against 0.3x without, and one thread's pair is 2x
  /// faster). Off by default: a cached large block does not coalesce with its neighbours until the heap takes it
  /// back, which raised the memory single-threaded training traces need by up to 12 % (bench_fragmentation, minimum
  /// capacity); front_cache_large_when_contended (on by default) turns it on once threads contend. Needs front_cache
  /// (validate() refuses it without, and with cross_stream_reuse).
  bool front_cache_large = false;
  /// Back each stream's small and large pools with one reserved virtual address range, into which the upstream's
  /// pages (2 MiB on current GPUs) are mapped as blocks are taken and unmapped when memory is released (PyTorch's
  /// expandable_segments): free space never fragments across segments, so a job needs less memory. Needs an upstream
  /// with virtual memory (address_space_upstream models it); with another, a warning says so and ordinary segments
  /// are used (or, with expandable_segments_required, the constructor throws). Off by default: on an H200 the pages'
  /// mapping cost 1.2-3.2x per operation after the warm-up, for 1-6 % less minimum capacity on average (10 % on the
  /// worst seed; README, "Expandable segments").
  bool expandable_segments = false;
  /// When allocate, free and record_stream ask whether a stream is being captured (capture_checks). empty_cache and
  /// trim ask in either mode. Added after the others (as is the next), so that options written in order still compile.
  capture_checks capture_check = capture_checks::every_call;
  /// Turn front_cache_large on by itself once threads are seen waiting for the device lock on large blocks (8 of
  /// the last 64 large allocations and frees that reached the heap found it held): a single-threaded
  /// job keeps the defaults' footprint, while threads allocating large blocks on their own streams stop serializing.
  /// Once on, it stays on for the allocator's life (allocator_stats::front_cache_large_on tells).
  /// Needs front_cache; off: large blocks are cached in front only with front_cache_large.
  bool front_cache_large_when_contended = true;
  /// With expandable_segments: where they cannot be had, the allocator's constructor throws instead of warning and
  /// using ordinary segments: invalid_argument_error for an upstream without virtual memory (host_upstream, the CPU),
  /// no_device_error for a device or driver without virtual memory management; a range that cannot be sized or
  /// reserved when a stream first grows is an error too (no_device_error, out_of_memory_error), not a fallback. A
  /// request that no longer fits in its stream's range (its freed holes too small) still takes an ordinary segment:
  /// this requires the ranges, not that every block is in one (README, "Expandable segments"). For jobs sized on the
  /// assumption. GPUKIT_ALLOC_CONF's expandable segments do not apply to the CPU's default allocator.
  bool expandable_segments_required = false;
  /// When the upstream (or reserved_limit) refuses a new segment: first let the request split a free block that
  /// max_split_size or max_oversize_waste keep from it, then give back only what the new segment lacks (the
  /// smallest free segment that covers the shortfall, else the largest ones), and only then everything cached.
  /// Where memory is available nothing changes. Off, the allocator gives back every free segment at once, which
  /// keeps the least memory a job needs (minimum capacity) lowest, but a job whose shapes vary, on a device not much
  /// larger than its peak, then gives back and regrows segments step after step, and each cudaFree drains the
  /// device. bench_fragmentation's pressure table (README, "Memory pressure") measured 40 variable-length training
  /// steps at 1.2-2x their peak: 82-197 upstream frees with the defaults, 0-3 with this on, 0-14 for PyTorch's
  /// allocator. The minimum capacity rises on 3 of 7 trace families (L12 by 6 %, L4 2 %, L6 2 %; L4 above PyTorch's)
  /// and falls on 2. On the 3-stream server it gives back fewer segments but one at a time, so more operations wait
  /// for the device (87 against the defaults' 57 at 1.5x). No effect with expandable_segments on an upstream with
  /// virtual memory (nothing is kept whole).
  bool reuse_before_release = false;

  /// PyTorch's CUDACachingAllocator constants (as of 2.x): the configuration users compare gpukit with.
  static allocator_options pytorch();

  /// Throws invalid_argument_error naming the first inconsistent setting.
  void validate() const;

  /// The rounded request size from which a large request gets a segment of its own: medium_size, or max_split_size
  /// where that is smaller (PyTorch's max_split_size_mb:32 keeps 40 MiB blocks whole, which a shared segment would
  /// not: it is always split).
  constexpr std::size_t own_segment_size() const noexcept {
    return max_split_size < medium_size ? max_split_size : medium_size;
  }
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE allocator_options allocator_options::pytorch() {
  allocator_options o;
  o.rounding = 512;
  o.small_size = 1 * MiB;
  o.small_segment_size = 2 * MiB;
  o.medium_size = 10 * MiB;
  o.medium_segment_size = 20 * MiB;
  o.large_segment_rounding = 2 * MiB;
  o.small_split_threshold = 0;
  o.large_split_threshold = 1 * MiB;
  o.max_split_size = unlimited;
  o.release_before_grow = false;
  o.medium_segment_growth = 0;
  return o;
}

GPUKIT_INLINE void allocator_options::validate() const {
  auto fail = [](const std::string& what) { throw invalid_argument_error("gpukit::allocator_options: " + what); };
  const auto n = [](std::size_t bytes) { return std::to_string(bytes); };  // exact: the figures a user typed
  if (!detail::is_power_of_two(rounding) || rounding < 16) {
    fail("rounding must be a power of two of at least 16 bytes (it is " + n(rounding) + ")");
  }
  if (!detail::is_power_of_two(large_segment_rounding) || large_segment_rounding < rounding) {
    fail("large_segment_rounding must be a power of two and at least the rounding (it is " + n(large_segment_rounding) +
         ", the rounding " + n(rounding) + ")");
  }
  if (small_size == 0 || small_size > small_segment_size) {
    fail("small_size must be in [1, small_segment_size] (it is " + n(small_size) + ", small_segment_size " +
         n(small_segment_size) + ")");
  }
  for (const auto& [name, size] : {std::pair<const char*, std::size_t>{"small_segment_size", small_segment_size},
                                   {"medium_segment_size", medium_segment_size}}) {
    if (size % rounding != 0) {
      fail(std::string("segment sizes must be multiples of the rounding (") + n(rounding) + " bytes): " + name + " " +
           n(size) + " is not");
    }
  }
  if (medium_size < small_size) {
    fail("medium_size must be at least small_size (it is " + n(medium_size) + ", small_size " + n(small_size) + ")");
  }
  if (medium_size % rounding != 0) {
    // Requests are rounded before they are compared with it, and it bounds segment sizes (4 x medium_size).
    const std::size_t below = medium_size / rounding * rounding;
    const bool above_fits = below <= std::numeric_limits<std::size_t>::max() - rounding;
    fail("medium_size must be a multiple of the rounding (" + n(rounding) + " bytes): " + n(medium_size) +
         " is not; use " + n(below) + (above_fits ? " or " + n(below + rounding) : std::string()));
  }
  // Shared segments grow to at most 4 x medium_size rounded down to large_segment_rounding: a larger rounding makes
  // that 0, and every segment of a request above small_size at least the rounding (2^63 bytes: none could be had).
  const std::size_t largest_shared = medium_size > std::numeric_limits<std::size_t>::max() / 4
                                         ? std::numeric_limits<std::size_t>::max()
                                         : 4 * medium_size;
  if (large_segment_rounding > largest_shared) {
    fail("large_segment_rounding must be at most 4 x medium_size, the largest shared segment (it is " +
         n(large_segment_rounding) + ", 4 x medium_size " + n(largest_shared) + ")");
  }
  // Shared segments serve the requests below own_segment_size().
  if (medium_segment_growth == 0 && own_segment_size() > small_size && medium_segment_size < own_segment_size()) {
    fail(
        "medium_segment_size must be at least medium_size (or max_split_size where smaller), or set "
        "medium_segment_growth (it is " +
        n(medium_segment_size) + ", medium_size " + n(medium_size) + ", max_split_size " + n(max_split_size) + ")");
  }
  if (max_split_size < rounding) {
    fail("max_split_size must be at least the rounding (it is " + n(max_split_size) + ", the rounding " + n(rounding) +
         ")");
  }
  if (max_split_size <= max_oversize_waste) {
    // Every request from max_split_size on would take cached blocks up to max_oversize_waste larger, whole: with
    // max_split_size 4 MiB, ten 4 MiB requests held 220 MiB. PyTorch refuses max_split_size_mb of 20 or less alike.
    fail("max_split_size must be larger than max_oversize_waste (it is " + n(max_split_size) + ", max_oversize_waste " +
         n(max_oversize_waste) +
         "): a request of max_split_size or more takes a cached block up to max_oversize_waste larger, whole");
  }
  if (expandable_segments_required && !expandable_segments) {
    fail("expandable_segments_required needs expandable_segments");
  }
  if (front_cache_large && !front_cache) fail("front_cache_large needs front_cache (it would be ignored)");
  // Blocks cached in front serve their own stream only, so the allocator turns the front caches off there.
  if (front_cache_large && cross_stream_reuse) {
    fail("front_cache_large cannot be used with cross_stream_reuse (it would be ignored)");
  }
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
