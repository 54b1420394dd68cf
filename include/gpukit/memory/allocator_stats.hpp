// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The statistics of gpukit's allocators, in PyTorch's vocabulary so its users can read them at once: the caching
/// allocator's (torch.cuda.memory_stats), plus what PyTorch does not tell: the largest free block and how fragmented
/// the cache is; and the pinned pool's (torch.cuda.host_memory_stats). Both are made of `stat` (current, peak,
/// allocated, freed). Also the text report memory_summary() prints.
///
/// Vocabulary (all per pool: all / small / large; small blocks come from small segments, see allocator_options):
/// - allocated: blocks handed out to users and not freed (bytes rounded as the allocator stores them);
/// - requested: the bytes users asked for (before rounding);
/// - active: allocated, plus freed blocks that wait for other streams' work (record_stream) before reuse;
/// - reserved: segments obtained from the upstream (cudaMalloc), i.e. what other processes cannot use;
/// - inactive_split: free blocks that are pieces of a split segment (cached, but not releasable on their own); not
///   those of expandable segments, whose free pages are released (as in PyTorch);
/// - segment / allocation counts; each with current, peak, total allocated, total freed.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>

GPUKIT_BEGIN_NAMESPACE

/// One statistic: its current value, its peak since the last reset_peak_stats(), and the totals added and removed
/// since the last reset_accumulated_stats().
struct stat {
  std::int64_t current = 0;    ///< the value now
  std::int64_t peak = 0;       ///< the highest value since the last reset_peak_stats()
  std::int64_t allocated = 0;  ///< total increase since the last reset_accumulated_stats() (PyTorch's "allocated")
  std::int64_t freed = 0;      ///< total decrease since the last reset_accumulated_stats() (PyTorch's "freed")
};

/// The time calls took (PyTorch's host_alloc_time / host_free_time): how many, in total, the shortest and the longest.
struct duration_stat {
  std::int64_t count = 0;             ///< calls timed since the last reset_accumulated_stats()
  std::chrono::nanoseconds total{0};  ///< their total time
  std::chrono::nanoseconds min{0};    ///< the shortest call since the last reset_peak_stats() (0: none yet)
  std::chrono::nanoseconds max{0};    ///< the longest call since the last reset_peak_stats()
  /// The mean time per call (0 when count is 0).
  std::chrono::nanoseconds average() const noexcept;
};

/// A pinned-host-memory pool's statistics in the caching allocator's vocabulary, as torch.cuda.host_memory_stats()
/// gives them (basic_pinned_pool::memory_stats; flat_host_memory_stats makes PyTorch's flat map of them). Bytes are
/// size-class bytes. As in PyTorch, a block counts as allocated from allocate() until it can be reused: a block freed
/// while its streams' events are pending is still allocated here (pinned_pool_stats counts it pending instead).
struct host_allocator_stats {
  stat allocation;                  ///< blocks handed out
  stat segment;                     ///< blocks obtained from the upstream (each one a pinning, e.g. cudaHostAlloc)
  stat allocated_bytes;             ///< bytes of the blocks handed out
  stat reserved_bytes;              ///< bytes of the blocks obtained from the upstream: allocated plus cached
  duration_stat host_alloc_time;    ///< the upstream allocations that succeeded (cudaHostAlloc)
  duration_stat host_free_time;     ///< the upstream frees (cudaFreeHost)
  std::int64_t num_host_alloc = 0;  ///< upstream allocations kept as blocks (segment.allocated, as PyTorch)
  std::int64_t num_host_free = 0;   ///< upstream frees of blocks (segment.freed)
};

/// Which pool a statistic covers.
enum class stat_pool : std::size_t { all = 0, small = 1, large = 2 };

/// A statistic for each pool, indexed by stat_pool.
struct pool_stats {
  std::array<stat, 3> pools{};  ///< the statistic of each pool, in stat_pool order: all, small, large
  /// The statistic of pool `p`.
  stat& operator[](stat_pool p) noexcept;
  /// The statistic of pool `p`, read-only.
  const stat& operator[](stat_pool p) const noexcept;
  /// Both pools together (PyTorch's "all").
  const stat& all() const noexcept;
  /// The small pool: blocks of small segments (PyTorch's "small_pool").
  const stat& small() const noexcept;
  /// The large pool: blocks of the other segments (PyTorch's "large_pool").
  const stat& large() const noexcept;
};

/// A copy of every statistic of one allocator (see the file comment for the vocabulary).
struct allocator_stats {
  pool_stats allocation;            ///< number of allocated blocks
  pool_stats segment;               ///< number of segments obtained from the upstream
  pool_stats active;                ///< number of active blocks
  pool_stats inactive_split;        ///< number of free blocks that are pieces of split segments
  pool_stats allocated_bytes;       ///< bytes of allocated blocks
  pool_stats reserved_bytes;        ///< bytes of segments
  pool_stats active_bytes;          ///< bytes of active blocks
  pool_stats inactive_split_bytes;  ///< bytes of free pieces of split segments
  pool_stats requested_bytes;       ///< bytes requested by users for the allocated blocks

  std::int64_t num_alloc_retries = 0;     ///< upstream failures (or limit hits) answered by freeing cache and retrying
  std::int64_t num_ooms = 0;              ///< out_of_memory_error thrown
  std::int64_t num_sync_all_streams = 0;  ///< waits on the host for all pending stream work (release paths only)
  std::int64_t num_device_alloc = 0;      ///< upstream allocations (cudaMalloc calls that succeeded)
  std::int64_t num_device_free = 0;       ///< upstream frees (cudaFree calls)
  /// Upstream frees the allocator chose to make while memory was available: neither under pressure (a refused
  /// upstream allocation, the reserved limit) nor asked for (empty_cache, trim, a lower limit). Each drains the
  /// device on CUDA. With the default options (release_before_grow off) only the segments of streams abandoned under
  /// stream churn (many streams used once and left; README, "Stream churn") are freed so, before the cache grows.
  std::int64_t num_device_free_unforced = 0;
  /// Allocations and frees that reached the heap (the front caches could not serve them) and found the device lock
  /// held by another thread: how much the threads serialize. Reset with the accumulated statistics; memory_summary
  /// prints it once it is not 0.
  std::int64_t num_lock_waits = 0;
  /// Whether large blocks are cached in front (allocator_options::front_cache_large, or turned on by contention:
  /// front_cache_large_when_contended).
  bool front_cache_large_on = false;
  /// Address space reserved by expandable segments (not memory: reserved_bytes counts their mapped pages).
  std::size_t expandable_address_space = 0;
  /// Bytes of the pages mapped in that address space: reserved_bytes less the ordinary segments the allocator may hold
  /// beside its expandable ones (a request that no stream's range can hold gets one).
  std::size_t expandable_mapped_bytes = 0;

  /// The limit on reserved bytes (std::numeric_limits<std::size_t>::max() when none).
  std::size_t reserved_limit = std::numeric_limits<std::size_t>::max();
};

/// How the cached free memory is laid out: what a request can get without asking the upstream. Computed on demand
/// (it walks the free lists), unlike the statistics.
struct free_space_info {
  std::size_t free_bytes = 0;          ///< reserved bytes in free blocks (reusable now or after pending work)
  std::size_t largest_free_block = 0;  ///< the largest request the cache can serve without the upstream
  std::size_t free_blocks = 0;         ///< number of free blocks

  /// External fragmentation of the cache: 1 − largest_free_block / free_bytes. 0 when the free memory is one
  /// block (or there is none); close to 1 when it is scattered in many small pieces, so that a large request needs
  /// new memory although much is cached.
  double fragmentation() const noexcept;
};

namespace detail {

/// A statistic updated under the allocator's lock and read without it. Writers hold the lock, so updates are a
/// load and a store (no read-modify-write instructions on the hot path); readers see each value whole. Stores are
/// release (plain on x86): a reader that sees a value stored inside a front slot's change (the caching allocator's
/// consistent reads) then also sees the slot's odd sequence count stored before it.
struct atomic_stat {
  std::atomic<std::int64_t> current{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> allocated{0};
  std::atomic<std::int64_t> freed{0};

  /// Adds `delta` (may be negative). Caller holds the allocator's lock. The peak is raised before the value is
  /// stored (with release), so a reader never sees a value above the peak.
  GPUKIT_DETAIL_ALWAYS_INLINE void add(std::int64_t delta) noexcept {
    const std::int64_t value = current.load(std::memory_order_relaxed) + delta;
    if (delta >= 0 && value > peak.load(std::memory_order_relaxed)) peak.store(value, std::memory_order_release);
    current.store(value, std::memory_order_release);
    std::atomic<std::int64_t>& total = delta >= 0 ? allocated : freed;
    total.store(total.load(std::memory_order_relaxed) + (delta >= 0 ? delta : -delta), std::memory_order_release);
  }
  /// Like add, leaving the peak to the caller (the caching allocator's front caches make it a sum).
  GPUKIT_DETAIL_ALWAYS_INLINE void add_current(std::int64_t delta) noexcept {
    current.store(current.load(std::memory_order_relaxed) + delta, std::memory_order_release);
    std::atomic<std::int64_t>& total = delta >= 0 ? allocated : freed;
    total.store(total.load(std::memory_order_relaxed) + (delta >= 0 ? delta : -delta), std::memory_order_release);
  }
  GPUKIT_DETAIL_ALWAYS_INLINE void raise_peak(std::int64_t value) noexcept {
    if (value > peak.load(std::memory_order_relaxed)) peak.store(value, std::memory_order_release);
  }
  /// Acquire loads: a reader that checks sequence counts afterwards (the caching allocator's consistent reads)
  /// needs them to stay before that check (plain loads on x86).
  stat load() const noexcept;
  void reset_accumulated() noexcept;
};

/// A statistic for all, small and large pools, updated together.
struct atomic_pool_stats {
  std::array<atomic_stat, 3> pools;
  /// Adds `delta` to the `all` pool and to the block's own pool (small or large).
  GPUKIT_DETAIL_ALWAYS_INLINE void add(bool small, std::int64_t delta) noexcept {
    pools[0].add(delta);
    pools[small ? 1 : 2].add(delta);
  }
  pool_stats load() const noexcept;
  void reset_accumulated() noexcept;
};

/// Adds `delta` (may be negative) to a statistic kept under a lock (the pinned pool's), raising its peak.
GPUKIT_INLINE void add_to_stat(stat& s, std::int64_t delta) noexcept;

/// Adds calls timed elsewhere (a batch timed outside the lock) to a timing statistic.
GPUKIT_INLINE void add_to_stat(duration_stat& d, const duration_stat& calls) noexcept;

/// Adds one call that took `spent` to a timing statistic.
GPUKIT_INLINE void add_to_stat(duration_stat& d, std::chrono::nanoseconds spent) noexcept;

/// Adds `value` to a flat statistics map as PyTorch names its parts: "<prefix>current", "<prefix>peak",
/// "<prefix>allocated" and "<prefix>freed" (flat_memory_stats, flat_host_memory_stats).
template <class FlatMap>
void add_flat_stat(FlatMap& flat, const std::string& prefix, const stat& value) {
  flat[prefix + "current"] = value.current;
  flat[prefix + "peak"] = value.peak;
  flat[prefix + "allocated"] = value.allocated;
  flat[prefix + "freed"] = value.freed;
}

/// A counter with the same single-writer discipline as atomic_stat (increment_shared: for several writers).
struct atomic_counter {
  std::atomic<std::int64_t> value{0};
  void increment() noexcept;
  void increment_shared() noexcept;
  std::int64_t load() const noexcept;
  void reset() noexcept;
};

GPUKIT_INLINE std::string summary_bytes(std::int64_t bytes);

GPUKIT_INLINE void summary_line(std::string& out, const char* text);

GPUKIT_INLINE void summary_row(std::string& out, const char* name, const stat& s, bool bytes);

GPUKIT_INLINE void summary_group(std::string& out, const char* name, const pool_stats& s, bool bytes);

}  // namespace detail

/// The human-readable table of memory_summary(): current / peak / total allocated / total freed of each statistic,
/// split by pool like torch.cuda.memory_summary(), followed by the free-space layout and the counters.
GPUKIT_INLINE std::string format_memory_summary(std::string_view title, const allocator_stats& s,
                                                const free_space_info& f);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE std::chrono::nanoseconds duration_stat::average() const noexcept {
  return count == 0 ? total : total / count;
}

GPUKIT_INLINE stat& pool_stats::operator[](stat_pool p) noexcept { return pools[static_cast<std::size_t>(p)]; }

GPUKIT_INLINE const stat& pool_stats::operator[](stat_pool p) const noexcept {
  return pools[static_cast<std::size_t>(p)];
}

GPUKIT_INLINE const stat& pool_stats::all() const noexcept { return pools[0]; }

GPUKIT_INLINE const stat& pool_stats::small() const noexcept { return pools[1]; }

GPUKIT_INLINE const stat& pool_stats::large() const noexcept { return pools[2]; }

GPUKIT_INLINE double free_space_info::fragmentation() const noexcept {
  if (free_bytes == 0) return 0.0;
  return 1.0 - static_cast<double>(largest_free_block) / static_cast<double>(free_bytes);
}
namespace detail {

GPUKIT_INLINE stat atomic_stat::load() const noexcept {
  stat s;
  s.current = current.load(std::memory_order_acquire);
  s.peak = peak.load(std::memory_order_acquire);
  s.allocated = allocated.load(std::memory_order_acquire);
  s.freed = freed.load(std::memory_order_acquire);
  return s;
}

GPUKIT_INLINE void atomic_stat::reset_accumulated() noexcept {
  allocated.store(0, std::memory_order_release);
  freed.store(0, std::memory_order_release);
}

GPUKIT_INLINE pool_stats atomic_pool_stats::load() const noexcept {
  pool_stats s;
  for (std::size_t i = 0; i < 3; ++i) s.pools[i] = pools[i].load();
  return s;
}

GPUKIT_INLINE void atomic_pool_stats::reset_accumulated() noexcept {
  for (auto& p : pools) p.reset_accumulated();
}

GPUKIT_INLINE void add_to_stat(stat& s, std::int64_t delta) noexcept {
  s.current += delta;
  if (s.current > s.peak) s.peak = s.current;
  (delta >= 0 ? s.allocated : s.freed) += delta >= 0 ? delta : -delta;
}

GPUKIT_INLINE void add_to_stat(duration_stat& d, const duration_stat& calls) noexcept {
  if (calls.count == 0) return;
  if (d.min.count() == 0 || calls.min < d.min) d.min = calls.min;  // 0: none since the last reset (PyTorch's rule)
  if (calls.max > d.max) d.max = calls.max;
  d.total += calls.total;
  d.count += calls.count;
}

GPUKIT_INLINE void add_to_stat(duration_stat& d, std::chrono::nanoseconds spent) noexcept {
  add_to_stat(d, duration_stat{1, spent, spent, spent});
}

GPUKIT_INLINE void atomic_counter::increment() noexcept {
  value.store(value.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

GPUKIT_INLINE void atomic_counter::increment_shared() noexcept { value.fetch_add(1, std::memory_order_relaxed); }

GPUKIT_INLINE std::int64_t atomic_counter::load() const noexcept { return value.load(std::memory_order_relaxed); }

GPUKIT_INLINE void atomic_counter::reset() noexcept { value.store(0, std::memory_order_relaxed); }

GPUKIT_INLINE std::string summary_bytes(std::int64_t bytes) {
  if (bytes < 0) return "-" + format_bytes(static_cast<std::size_t>(-bytes));
  return format_bytes(static_cast<std::size_t>(bytes));
}

GPUKIT_INLINE void summary_line(std::string& out, const char* text) {
  out += text;
  out += '\n';
}

GPUKIT_INLINE void summary_row(std::string& out, const char* name, const stat& s, bool bytes) {
  auto cell = [bytes](std::int64_t v) { return bytes ? summary_bytes(v) : std::to_string(v); };
  char line[160];
  std::snprintf(line, sizeof line, "| %-25s | %12s | %12s | %12s | %12s |", name, cell(s.current).c_str(),
                cell(s.peak).c_str(), cell(s.allocated).c_str(), cell(s.freed).c_str());
  summary_line(out, line);
}

GPUKIT_INLINE void summary_group(std::string& out, const char* name, const pool_stats& s, bool bytes) {
  summary_row(out, name, s.all(), bytes);
  summary_row(out, "      from large pool", s.large(), bytes);
  summary_row(out, "      from small pool", s.small(), bytes);
  summary_line(out, "|---------------------------------------------------------------------------------------|");
}
}  // namespace detail

GPUKIT_INLINE std::string format_memory_summary(std::string_view title, const allocator_stats& s,
                                                const free_space_info& f) {
  std::string out;
  const char* rule = "|=======================================================================================|";
  detail::summary_line(out, rule);
  char line[200];
  std::snprintf(line, sizeof line, "| %-85.*s |", static_cast<int>(title.size()), title.data());
  detail::summary_line(out, line);
  detail::summary_line(out,
                       "|---------------------------------------------------------------------------------------|");
  std::snprintf(line, sizeof line, "| %-30s %-20s %-33s |",
                ("out-of-memory errors: " + std::to_string(s.num_ooms)).c_str(),
                ("retries: " + std::to_string(s.num_alloc_retries)).c_str(),
                ("host waits for all streams: " + std::to_string(s.num_sync_all_streams)).c_str());
  detail::summary_line(out, line);
  if (s.num_lock_waits != 0 || s.front_cache_large_on) {  // threads contended (the caching allocator only)
    std::snprintf(line, sizeof line, "| %-54s %-30s |",
                  ("device lock waits: " + std::to_string(s.num_lock_waits)).c_str(),
                  s.front_cache_large_on ? "large blocks cached per stream" : "");
    detail::summary_line(out, line);
  }
  detail::summary_line(out, rule);
  detail::summary_line(out,
                       "| Metric                    |  Cur Usage   |  Peak Usage  |  Tot Alloc   |  Tot Freed   |");
  detail::summary_line(out,
                       "|---------------------------------------------------------------------------------------|");
  detail::summary_group(out, "Allocated memory", s.allocated_bytes, true);
  detail::summary_group(out, "Active memory", s.active_bytes, true);
  detail::summary_group(out, "Requested memory", s.requested_bytes, true);
  detail::summary_group(out, "Reserved memory", s.reserved_bytes, true);
  detail::summary_group(out, "Non-releasable memory", s.inactive_split_bytes, true);
  detail::summary_group(out, "Allocations", s.allocation, false);
  detail::summary_group(out, "Active allocs", s.active, false);
  detail::summary_group(out, "Reserved segments", s.segment, false);
  detail::summary_group(out, "Non-releasable allocs", s.inactive_split, false);
  const std::int64_t reserved = s.reserved_bytes.all().current;
  const std::int64_t allocated = s.allocated_bytes.all().current;
  std::snprintf(line, sizeof line, "| %-36s %-48s |",
                "Cached (reserved - allocated):", detail::summary_bytes(reserved - allocated).c_str());
  detail::summary_line(out, line);
  std::snprintf(line, sizeof line, "| %-36s %-48s |", "Largest free block:",
                (detail::format_bytes(f.largest_free_block) + " of " + detail::format_bytes(f.free_bytes) +
                 " free in " + std::to_string(f.free_blocks) + " blocks")
                    .c_str());
  detail::summary_line(out, line);
  char ratio[64];
  std::snprintf(ratio, sizeof ratio, "%.3f (1 - largest free / free)", f.fragmentation());
  std::snprintf(line, sizeof line, "| %-36s %-48s |", "Fragmentation:", ratio);
  detail::summary_line(out, line);
  if (allocated > 0) {
    std::snprintf(ratio, sizeof ratio, "%.3f", static_cast<double>(reserved) / static_cast<double>(allocated));
  } else {
    std::snprintf(ratio, sizeof ratio, "-");
  }
  std::snprintf(line, sizeof line, "| %-36s %-48s |", "Reserved / allocated:", ratio);
  detail::summary_line(out, line);
  std::snprintf(line, sizeof line, "| %-36s %-48s |", "Reserved limit:",
                s.reserved_limit == std::numeric_limits<std::size_t>::max()
                    ? "none"
                    : detail::format_bytes(s.reserved_limit).c_str());
  detail::summary_line(out, line);
  std::snprintf(line, sizeof line, "| %-36s %-48s |", "Upstream allocs / frees:",
                (std::to_string(s.num_device_alloc) + " / " + std::to_string(s.num_device_free) + " (" +
                 std::to_string(s.num_device_free_unforced) + " unforced)")
                    .c_str());
  detail::summary_line(out, line);
  if (s.expandable_address_space != 0) {
    std::snprintf(line, sizeof line, "| %-36s %-48s |", "Expandable segments:",
                  (detail::format_bytes(s.expandable_mapped_bytes) + " mapped in " +
                   detail::format_bytes(s.expandable_address_space) + " of address space")
                      .c_str());
    detail::summary_line(out, line);
  }
  detail::summary_line(out, rule);
  return out;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
