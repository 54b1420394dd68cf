// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator engine: basic_caching_allocator<Upstream, StreamOps>. It does not depend on CUDA: the
/// upstream supplies segments (cudaMalloc, host memory, a fake address space; see upstream.hpp) and the stream ops
/// supply streams and events (gpukit's, or a test's fake; see stream_ops.hpp).
///
/// Design:
/// - Requests are rounded to `rounding` bytes. Small requests (<= small_size) are carved from small segments, the
///   others from large segments, so short-lived small tensors do not fragment large segments. Blocks are split on
///   allocation (when the remainder is worth keeping) and coalesced with free neighbours on free.
/// - Free blocks sit in segregated-fit size classes per (stream, pool) with bitmaps of non-empty classes, so a
///   lookup is O(1) (size_classes.hpp); a pointer → block map sharded by address finds the block of a free.
/// - One lock per allocator (i.e. per device) guards the pools; it is never held while the upstream allocates or
///   frees (nor while the host waits for events), so a slow cudaMalloc/cudaFree does not stall other threads.
/// - Stream order: a block belongs to the stream it was allocated on and is reused on that stream at once.
///   record_stream(p, s) notes that s also uses it; freeing it then records an event on each such stream, and the
///   block returns to the pool when they complete (polled at allocation; the host never waits on the hot path).
///   With options.cross_stream_reuse, a block cached for another stream may be taken, the new stream waiting for
///   the free's event on the device (cudaStreamWaitEvent), never on the host.
/// - Before host memory is returned to its upstream, the allocator waits for work that may still use it (CUDA's
///   cudaFree synchronizes the device by itself). For that it records a "fence" event when a block is freed on a
///   stream that may still have work pending (a CUDA stream under cross-stream reuse, or a busy CPU queue).
/// - Footprint (gpukit's defaults, measured in bench_fragmentation): before a new segment would raise reserved
///   memory above its high-water mark, completely free segments the request cannot use are returned first; requests
///   up to medium_size share segments that grow with the footprint; huge blocks are kept whole (max_split_size).
/// - Out of memory: the allocator releases its free segments and retries; then waits for pending events, releases
///   again and retries once more (always: a failure may be transient); then throws out_of_memory_error with the
///   numbers needed to understand why.
/// - Statistics are atomics written under the lock and read without it.
///
/// Zero-size requests return nullptr (no statistic changes); deallocate(nullptr) does nothing. A stream passed to
/// allocate, deallocate or record_stream must outlive the blocks it is used with, as with RMM and CUDA.

#include <gpukit/detail/format.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/detail/pointer_map.hpp>
#include <gpukit/memory/detail/size_classes.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/memory/upstream.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpukit {

/// How a caching allocator rounds, pools, splits and limits. The defaults are gpukit's choice, measured with
/// bench_fragmentation (README, "Caching device allocator"): PyTorch's rounding, small pool and split threshold,
/// plus three changes that cut the footprint of variable-shape workloads and the number of cudaMalloc/cudaFree
/// calls: requests up to 64 MiB share segments that grow with the footprint, huge blocks are kept whole
/// (max_split_size), and cached segments a request cannot use are released before the footprint grows.
/// pytorch() gives PyTorch's constants for comparison.
struct allocator_options {
  static constexpr std::size_t KiB = std::size_t{1} << 10;
  static constexpr std::size_t MiB = std::size_t{1} << 20;
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

  std::size_t rounding = 512;               ///< requests are rounded up to a multiple of this (a power of two)
  std::size_t small_size = 1 * MiB;         ///< requests up to this are small and come from small segments
  std::size_t small_segment_size = 2 * MiB; ///< size of a small segment
  /// Larger requests below this share segments of medium_segment_size (or more, see medium_segment_growth);
  /// requests of this size or more get a segment of their own, rounded up to large_segment_rounding.
  std::size_t medium_size = 64 * MiB;
  std::size_t medium_segment_size = 20 * MiB;
  std::size_t large_segment_rounding = 2 * MiB;
  std::size_t small_split_threshold = 0;         ///< a small block is split when the remainder exceeds this
  std::size_t large_split_threshold = 1 * MiB;   ///< a large block is split when the remainder exceeds this
  /// Blocks of segments made for one request of this size or more are never split, and smaller requests never use
  /// them (PyTorch's max_split_size_mb): huge blocks stay whole for huge requests, so they become completely free
  /// and releasable when the sizes of the huge requests drift.
  std::size_t max_split_size = 256 * MiB;
  /// A request of max_split_size or more takes a cached block at most this much larger than itself.
  std::size_t max_oversize_waste = 20 * MiB;
  /// Reserved bytes never exceed this: the allocator frees cache and retries, then reports out of memory.
  std::size_t reserved_limit = unlimited;
  /// Reuse a block cached for another stream (the new stream waits for the free's event on the device) before
  /// asking the upstream. Costs an event record per free on CUDA streams.
  bool cross_stream_reuse = false;
  /// Before a new segment would raise reserved memory above its high-water mark, return completely free segments
  /// to the upstream first (the smallest that covers the growth): the request could not use them, and keeping
  /// them would grow the footprint when request sizes drift (variable sequence lengths). Costs upstream frees on
  /// such misses only.
  bool release_before_grow = true;
  /// When non-zero, segments shared by requests in (small_size, medium_size) grow with the footprint: they are
  /// max(medium_segment_size, reserved / medium_segment_growth) (rounded to large_segment_rounding, at most
  /// 4 × medium_size), so big programs make few upstream calls while small ones keep small segments.
  std::size_t medium_segment_growth = 8;

  /// PyTorch's CUDACachingAllocator constants (as of 2.x): the configuration users compare gpukit with.
  static allocator_options pytorch() {
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

  /// Throws invalid_argument_error naming the first inconsistent setting.
  void validate() const {
    auto fail = [](const std::string& what) {
      throw invalid_argument_error("gpukit::allocator_options: " + what);
    };
    auto power_of_two = [](std::size_t v) { return v != 0 && (v & (v - 1)) == 0; };
    if (!power_of_two(rounding) || rounding < 16) fail("rounding must be a power of two of at least 16 bytes");
    if (!power_of_two(large_segment_rounding) || large_segment_rounding < rounding) {
      fail("large_segment_rounding must be a power of two and at least the rounding");
    }
    if (small_size == 0 || small_size > small_segment_size) fail("small_size must be in [1, small_segment_size]");
    if (small_segment_size % rounding != 0 || medium_segment_size % rounding != 0) {
      fail("segment sizes must be multiples of the rounding");
    }
    if (medium_size < small_size) fail("medium_size must be at least small_size");
    if (medium_segment_growth == 0 && medium_size > small_size && medium_segment_size < medium_size) {
      fail("medium_segment_size must be at least medium_size (or set medium_segment_growth)");
    }
    if (max_split_size < rounding) fail("max_split_size must be at least the rounding");
  }
};

template <class Upstream, class StreamOps = stream_ops>
class basic_caching_allocator {
 public:
  using upstream_type = Upstream;
  using stream_ops_type = StreamOps;
  using stream_type = typename StreamOps::stream_type;
  using event_type = typename StreamOps::event_type;

  /// An allocator for device `d` whose upstream is built from `upstream_args` (or from `d` when none are given and
  /// the upstream takes a device, like device_upstream). Makes no CUDA call.
  template <class... UpstreamArgs>
  explicit basic_caching_allocator(gpukit::device d, allocator_options options = {}, UpstreamArgs&&... upstream_args)
      : device_(d), options_(options), upstream_(make_upstream(d, std::forward<UpstreamArgs>(upstream_args)...)) {
    options_.validate();
    limit_ = options_.reserved_limit;
    needs_fence_ = options_.cross_stream_reuse || !upstream_.synchronizes_on_free();
  }

  basic_caching_allocator(const basic_caching_allocator&) = delete;
  basic_caching_allocator& operator=(const basic_caching_allocator&) = delete;

  /// Returns every segment to the upstream (after the work that may use them). Allocations still live at this point
  /// are a bug in the program: they are reported through gpukit::warn and their memory is released anyway.
  ~basic_caching_allocator() {
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    const std::int64_t live = stats_.allocation.pools[0].current.load(std::memory_order_relaxed);
    if (live > 0) {
      warn("gpukit: the caching allocator of " + device_.to_string() + " is destroyed with " + std::to_string(live) +
           " live allocation(s) (" +
           detail::format_bytes(static_cast<std::size_t>(
               stats_.allocated_bytes.pools[0].current.load(std::memory_order_relaxed))) +
           "); their memory is released now, so any later use of it is invalid");
    }
    for (auto& st : streams_) {
      for (auto& record : st->pending) synchronize_quietly(*record.event);
      st->pending.clear();
    }
    for (segment* seg = segments_; seg != nullptr;) {
      for (block* b = seg->first; b != nullptr; b = b->next) {
        if (b->fence) synchronize_quietly(*b->fence);
      }
      upstream_.deallocate(reinterpret_cast<void*>(seg->address), seg->size);
      segment* next = seg->next_segment;
      delete seg;
      seg = next;
    }
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Allocation
  // ---------------------------------------------------------------------------------------------------------------

  /// `bytes` of memory usable on `stream` at once (stream-ordered), aligned to at least min(rounding, 256) bytes.
  /// Zero bytes gives nullptr. Throws out_of_memory_error when the upstream (or the reserved limit) cannot supply it
  /// even after the cache is released; invalid_argument_error for a stream of another device or a size that
  /// overflows when rounded.
  void* allocate(std::size_t bytes, const stream_type& stream) {
    if (bytes == 0) return nullptr;
    const std::size_t size = round_request(bytes);
    const bool small = size <= options_.small_size;
    block* b;
    {
      std::unique_lock<detail::spin_mutex> lock(mutex_);
      stream_state& st = stream_for(stream);
      if (pending_total_ != 0) process_events();
      b = find_free(st, size, small);
      if (b == nullptr) b = allocate_slow(lock, st, bytes, size, small);
      take(b, st, size, bytes);
    }
    try {
      map_.insert(b->address, b);
    } catch (...) {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      free_allocated(b, false);  // never handed out: nothing can use it
      throw;
    }
    return reinterpret_cast<void*>(b->address);
  }

  /// Frees `p` in the order of the stream it was allocated on: the block can be reused on that stream at once, and
  /// on other streams once the work recorded with record_stream completes. nullptr is ignored. Throws
  /// invalid_argument_error for a pointer this allocator does not own (never allocated here, already freed, or
  /// pointing inside an allocation).
  void deallocate(void* p) {
    if (p == nullptr) return;
    block* b = map_.erase(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned(p, "deallocate");
    // The block is ours alone now: its owner (set under the lock when it was allocated) cannot change.
    const bool busy = owner_may_be_busy(b);
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    free_allocated(b, busy);
  }

  /// Frees `p` after the work enqueued so far on `stream` as well (as if record_stream(p, stream) had been called),
  /// for memory last used on a stream other than its own. The stream must belong to this allocator's device.
  void deallocate(void* p, const stream_type& stream) {
    if (p == nullptr) return;
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    stream_state& st = stream_for(stream);  // checks the device before anything changes
    block* b = map_.find(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "deallocate");
    note_stream_use(b, st);  // may throw (memory): the block is still allocated then
    if (map_.erase(reinterpret_cast<std::uintptr_t>(p)) != b) throw_not_owned_locked(p, "deallocate");
    free_allocated(b, owner_may_be_busy(b));
  }

  /// Notes that `stream` uses the allocation at `p` (like torch's Tensor.record_stream): when `p` is freed, its
  /// block is reused only after the work enqueued on `stream` until then has completed.
  void record_stream(void* p, const stream_type& stream) {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    stream_state& st = stream_for(stream);
    block* b = map_.find(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "record_stream");
    note_stream_use(b, st);
  }

  /// True when `p` is the start of a live allocation of this allocator.
  bool owns(const void* p) const noexcept {
    return p != nullptr && map_.find(reinterpret_cast<std::uintptr_t>(p)) != nullptr;
  }

  /// The bytes `p` was allocated with (as requested, before rounding). Throws for pointers not owned.
  std::size_t allocation_size(const void* p) const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    const block* b = map_.find(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "allocation_size");
    return b->requested;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Statistics (lock-free reads)
  // ---------------------------------------------------------------------------------------------------------------

  /// Every statistic (each value read atomically; take snapshot() for a mutually consistent set).
  allocator_stats stats() const noexcept {
    allocator_stats s;
    s.allocation = stats_.allocation.load();
    s.segment = stats_.segment.load();
    s.active = stats_.active.load();
    s.inactive_split = stats_.inactive_split.load();
    s.allocated_bytes = stats_.allocated_bytes.load();
    s.reserved_bytes = stats_.reserved_bytes.load();
    s.active_bytes = stats_.active_bytes.load();
    s.inactive_split_bytes = stats_.inactive_split_bytes.load();
    s.requested_bytes = stats_.requested_bytes.load();
    s.num_alloc_retries = stats_.num_alloc_retries.load();
    s.num_ooms = stats_.num_ooms.load();
    s.num_sync_all_streams = stats_.num_sync_all_streams.load();
    s.num_device_alloc = stats_.num_device_alloc.load();
    s.num_device_free = stats_.num_device_free.load();
    s.reserved_limit = limit_atomic_.load(std::memory_order_relaxed);
    return s;
  }

  /// Bytes handed out to users (rounded), like torch.cuda.memory_allocated().
  std::size_t memory_allocated() const noexcept { return current(stats_.allocated_bytes); }
  /// Bytes held from the upstream, like torch.cuda.memory_reserved().
  std::size_t memory_reserved() const noexcept { return current(stats_.reserved_bytes); }
  /// Peak of memory_allocated() since the last reset_peak_stats().
  std::size_t max_memory_allocated() const noexcept { return peak(stats_.allocated_bytes); }
  /// Peak of memory_reserved() since the last reset_peak_stats().
  std::size_t max_memory_reserved() const noexcept { return peak(stats_.reserved_bytes); }

  /// Starts new peaks from the current values (e.g. to measure one phase of a program).
  void reset_peak_stats() noexcept {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    for (detail::atomic_pool_stats* s : all_stats()) s->reset_peak();
  }
  /// Zeroes the totals allocated/freed and the counters (retries, OOMs, upstream calls, ...).
  void reset_accumulated_stats() noexcept {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    for (detail::atomic_pool_stats* s : all_stats()) s->reset_accumulated();
    stats_.num_alloc_retries.reset();
    stats_.num_ooms.reset();
    stats_.num_sync_all_streams.reset();
    stats_.num_device_alloc.reset();
    stats_.num_device_free.reset();
  }

  /// The cached free memory's layout (walks the segments under the lock: for reports, not hot paths).
  free_space_info free_space() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    return free_space_locked();
  }

  /// Every segment and block with the statistics, consistent with each other.
  allocator_snapshot snapshot() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    allocator_snapshot s;
    s.device = device_;
    for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      segment_info info;
      info.address = seg->address;
      info.size = seg->size;
      info.small_pool = seg->small;
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        block_info bi;
        bi.address = b->address;
        bi.size = b->size;
        bi.requested = b->requested;
        bi.state = b->state;
        bi.stream = b->owner->key;
        bi.pending_events = b->pending_events;
        info.blocks.push_back(bi);
      }
      s.segments.push_back(std::move(info));
    }
    std::sort(s.segments.begin(), s.segments.end(),
              [](const segment_info& a, const segment_info& b) { return a.address < b.address; });
    s.stats = stats();
    s.pointer_map_entries = map_.size();
    return s;
  }

  /// A table of the statistics like torch.cuda.memory_summary(), with the largest free block and fragmentation.
  std::string memory_summary() const {
    allocator_stats s;
    free_space_info f;
    {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      s = stats();
      f = free_space_locked();
    }
    return format_memory_summary("gpukit caching allocator, " + device_.to_string(), s, f);
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Control
  // ---------------------------------------------------------------------------------------------------------------

  /// Waits for pending events, then returns every completely free segment to the upstream. Memory still allocated
  /// (or in a segment with an allocated block) stays: memory_summary() shows it as non-releasable.
  void empty_cache() {
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    release_cached(lock, true, 0);
  }

  /// Like empty_cache(), but stops once reserved memory is at most `target_reserved` bytes, releasing the largest
  /// free segments first. Returns the reserved bytes afterwards (more than the target if too little is free).
  std::size_t trim(std::size_t target_reserved) {
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    release_cached(lock, true, target_reserved);
    return current(stats_.reserved_bytes);
  }

  /// Caps reserved memory at `bytes` (allocator_options::unlimited for none), releasing free segments at once if
  /// the cache is above it. Allocations that would exceed it free cache and retry, then throw out_of_memory_error.
  void set_reserved_limit(std::size_t bytes) {
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    limit_ = bytes;
    limit_atomic_.store(bytes, std::memory_order_relaxed);
    if (current(stats_.reserved_bytes) > bytes) release_cached(lock, true, bytes);
  }

  /// Caps reserved memory at a fraction (0, 1] of the upstream's total (the device's memory), like
  /// torch.cuda.set_per_process_memory_fraction but without depending on garbage collection.
  void set_memory_fraction(double fraction) {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw invalid_argument_error("gpukit: a memory fraction must be in (0, 1], not " + std::to_string(fraction));
    }
    const upstream_memory_info info = upstream_.memory_info();
    if (!info.known || info.total_bytes == 0) {
      throw invalid_argument_error("gpukit: the total memory of " + device_.to_string() +
                                   " is unknown, so a fraction of it cannot be a limit; use set_reserved_limit");
    }
    set_reserved_limit(static_cast<std::size_t>(fraction * static_cast<double>(info.total_bytes)));
  }

  std::size_t reserved_limit() const noexcept { return limit_atomic_.load(std::memory_order_relaxed); }
  const allocator_options& options() const noexcept { return options_; }
  gpukit::device device() const noexcept { return device_; }
  Upstream& upstream() noexcept { return upstream_; }
  const Upstream& upstream() const noexcept { return upstream_; }
  StreamOps& stream_operations() noexcept { return ops_; }

  /// The rounded size a request of `bytes` is served with (throws invalid_argument_error on overflow).
  std::size_t rounded_size(std::size_t bytes) const { return round_request(bytes); }
  /// The segment size a rounded request `size` would get from the upstream on a cache miss.
  std::size_t segment_size_for(std::size_t size) const { return segment_size(size, size <= options_.small_size); }

 private:
  struct stream_state;
  struct segment;

  template <class... Args>
  static Upstream make_upstream(gpukit::device d, Args&&... args) {
    if constexpr (sizeof...(Args) == 0 && std::is_constructible<Upstream, gpukit::device>::value) {
      return Upstream(d);
    } else {
      (void)d;
      return Upstream(std::forward<Args>(args)...);
    }
  }

  struct block {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    block* prev = nullptr;  // neighbours in the segment, in address order
    block* next = nullptr;
    block* free_prev = nullptr;  // in a size class while free
    block* free_next = nullptr;
    segment* seg = nullptr;
    stream_state* owner = nullptr;
    std::unique_ptr<event_type> fence;  // completes when the owner's work before the free has
    std::uint64_t fence_sequence = 0;
    std::vector<stream_state*> recorded;  // other streams using the block (record_stream)
    std::uint32_t pending_events = 0;
    block_state state = block_state::free;
    bool small = false;
  };

  struct segment {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    bool small = false;
    bool dedicated = false;  // made for one request of medium_size or more (not shared by design)
    block* first = nullptr;
    segment* prev_segment = nullptr;
    segment* next_segment = nullptr;
  };

  struct pending_record {
    std::unique_ptr<event_type> event;
    block* b = nullptr;
  };

  using index_type = detail::size_class_index<block>;

  struct stream_state {
    stream_state(std::uintptr_t k, const stream_type& s) : key(k), stream(s) {}
    std::uintptr_t key;
    stream_type stream;
    std::unique_ptr<index_type> pools[2];  // [1]: small, [0]: large; created on first use
    std::deque<pending_record> pending;    // events recorded on this stream, in order
  };

  struct all_stats_t {
    detail::atomic_pool_stats allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
        active_bytes, inactive_split_bytes, requested_bytes;
    detail::atomic_counter num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free;
  };

  std::array<detail::atomic_pool_stats*, 9> all_stats() noexcept {
    return {&stats_.allocation,      &stats_.segment,        &stats_.active,
            &stats_.inactive_split,  &stats_.allocated_bytes, &stats_.reserved_bytes,
            &stats_.active_bytes,    &stats_.inactive_split_bytes, &stats_.requested_bytes};
  }

  static std::size_t current(const detail::atomic_pool_stats& s) noexcept {
    return static_cast<std::size_t>(s.pools[0].current.load(std::memory_order_relaxed));
  }
  static std::size_t peak(const detail::atomic_pool_stats& s) noexcept {
    return static_cast<std::size_t>(s.pools[0].peak.load(std::memory_order_relaxed));
  }
  static std::int64_t as_delta(std::size_t v) noexcept { return static_cast<std::int64_t>(v); }

  // --- sizes ---

  [[noreturn]] void throw_overflow(std::size_t bytes) const {
    throw invalid_argument_error("gpukit: cannot allocate " + std::to_string(bytes) + " bytes on " +
                                 device_.to_string() + ": the size overflows when rounded up");
  }

  std::size_t round_request(std::size_t bytes) const {
    const std::size_t r = options_.rounding;
    if (bytes > std::numeric_limits<std::size_t>::max() - (r - 1)) throw_overflow(bytes);
    const std::size_t size = (bytes + r - 1) & ~(r - 1);
    if (size > options_.small_size && size >= options_.medium_size) {
      const std::size_t g = options_.large_segment_rounding;
      if (size > std::numeric_limits<std::size_t>::max() - (g - 1)) throw_overflow(bytes);
    }
    return size;
  }

  std::size_t segment_size(std::size_t size, bool small) const noexcept {
    if (small) return options_.small_segment_size;
    if (size < options_.medium_size) {
      std::size_t seg = options_.medium_segment_size;
      if (options_.medium_segment_growth != 0) {
        const std::size_t g = options_.large_segment_rounding;
        const std::size_t scaled = (current(stats_.reserved_bytes) / options_.medium_segment_growth + g - 1) / g * g;
        seg = std::max(seg, std::min(scaled, 4 * options_.medium_size));
        seg = std::max(seg, (size + g - 1) / g * g);  // the request always fits
      }
      return seg;
    }
    const std::size_t g = options_.large_segment_rounding;
    return (size + g - 1) / g * g;
  }

  bool should_split(const block* b, std::size_t size, std::size_t remainder) const noexcept {
    if (remainder == 0) return false;
    if (b->small) return remainder > options_.small_split_threshold;
    if (b->seg->dedicated && size >= options_.max_split_size) return false;  // oversize blocks are used whole
    return remainder > options_.large_split_threshold;
  }

  // --- streams and events ---

  /// The state of a stream, registered (and its device checked) on first use. The keys sit in one contiguous
  /// vector that a lookup only reads, so threads using different streams do not write shared cache lines here.
  stream_state& stream_for(const stream_type& s) {
    const std::uintptr_t key = ops_.key(s);
    if (stream_index_.empty()) {
      for (const auto& entry : stream_keys_) {
        if (entry.first == key) return *entry.second;
      }
    } else {
      const auto it = stream_index_.find(key);
      if (it != stream_index_.end()) return *it->second;
    }
    return *register_stream(s, key);
  }

  stream_state* register_stream(const stream_type& s, std::uintptr_t key) {
    const gpukit::device d = ops_.device_of(s);
    if (d != device_) {
      throw invalid_argument_error("gpukit: a stream of " + d.to_string() + " was passed to the caching allocator of " +
                                   device_.to_string() + " (wrong device)");
    }
    streams_.push_back(std::make_unique<stream_state>(key, s));
    stream_state* st = streams_.back().get();
    stream_keys_.emplace_back(key, st);
    if (!stream_index_.empty() || stream_keys_.size() > linear_stream_lookup) {
      for (const auto& entry : stream_keys_) stream_index_.emplace(entry.first, entry.second);
    }
    return st;
  }

  std::unique_ptr<event_type> acquire_event() {
    if (!event_pool_.empty()) {
      std::unique_ptr<event_type> e = std::move(event_pool_.back());
      event_pool_.pop_back();
      return e;
    }
    return std::make_unique<event_type>(ops_.create_event(device_));
  }

  void release_event(std::unique_ptr<event_type> e) noexcept {
    if (!e) return;
    try {
      event_pool_.push_back(std::move(e));
    } catch (...) {
      // the event is destroyed instead of pooled
    }
  }

  void synchronize_quietly(const event_type& e) noexcept {
    try {
      ops_.synchronize(e);
    } catch (const std::exception& ex) {
      warn(std::string("gpukit: waiting for an event of the caching allocator failed: ") + ex.what());
    } catch (...) {
      warn("gpukit: waiting for an event of the caching allocator failed");
    }
  }

  void note_stream_use(block* b, stream_state& st) {
    if (&st == b->owner) return;
    if (std::find(b->recorded.begin(), b->recorded.end(), &st) == b->recorded.end()) b->recorded.push_back(&st);
  }

  /// Moves blocks whose events have completed back to their pools. Events recorded on one stream complete in
  /// order, so each stream's queue is polled only up to its first incomplete event.
  void process_events() {
    for (std::size_t i = 0; i < pending_streams_.size();) {
      stream_state* st = pending_streams_[i];
      while (!st->pending.empty() && ops_.ready(*st->pending.front().event)) {
        pending_record record = std::move(st->pending.front());
        st->pending.pop_front();
        release_event(std::move(record.event));
        complete_pending(record.b);
      }
      if (st->pending.empty()) {
        pending_streams_[i] = pending_streams_.back();
        pending_streams_.pop_back();
      } else {
        ++i;
      }
    }
  }

  void complete_pending(block* b) {
    --pending_total_;
    if (--b->pending_events != 0) return;
    stats_.active.add(b->small, -1);
    stats_.active_bytes.add(b->small, -as_delta(b->size));
    return_to_pool(b);
  }

  // --- blocks ---

  block* new_block() {
    if (spare_blocks_ == nullptr) {
      constexpr std::size_t chunk = 256;
      block_chunks_.push_back(std::make_unique<block[]>(chunk));
      block* blocks = block_chunks_.back().get();
      for (std::size_t i = 0; i < chunk; ++i) {
        blocks[i].next = spare_blocks_;
        spare_blocks_ = &blocks[i];
      }
    }
    block* b = spare_blocks_;
    spare_blocks_ = b->next;
    b->next = nullptr;
    return b;
  }

  void recycle(block* b) noexcept {
    b->address = 0;
    b->size = 0;
    b->requested = 0;
    b->prev = b->free_prev = b->free_next = nullptr;
    b->seg = nullptr;
    b->owner = nullptr;
    b->fence.reset();
    b->recorded.clear();
    b->pending_events = 0;
    b->state = block_state::free;
    b->next = spare_blocks_;
    spare_blocks_ = b;
  }

  index_type& index_of(block* b) {
    auto& pool = b->owner->pools[b->small ? 1 : 0];
    if (!pool) pool = std::make_unique<index_type>();
    return *pool;
  }

  static bool is_split(const block* b) noexcept { return b->prev != nullptr || b->next != nullptr; }

  /// Puts a free block in its stream's pool; counts it as inactive-split when it is a piece of a segment.
  void index_free(block* b) {
    index_of(b).insert(b);
    if (is_split(b)) {
      stats_.inactive_split.add(b->small, 1);
      stats_.inactive_split_bytes.add(b->small, as_delta(b->size));
    }
  }

  void unindex_free(block* b) noexcept {
    b->owner->pools[b->small ? 1 : 0]->remove(b);
    if (is_split(b)) {
      stats_.inactive_split.add(b->small, -1);
      stats_.inactive_split_bytes.add(b->small, -as_delta(b->size));
    }
  }

  /// Keeps the later of two fences of the same stream (its work includes the earlier one's).
  void absorb_fence(block* into, block* from) noexcept {
    if (!from->fence) return;
    if (!into->fence || from->fence_sequence > into->fence_sequence) {
      std::swap(into->fence, from->fence);
      into->fence_sequence = from->fence_sequence;
    }
    release_event(std::move(from->fence));
  }

  /// A freed block (no longer allocated or pending) joins its free neighbours of the same stream and its pool.
  void return_to_pool(block* b) {
    b->state = block_state::free;
    b->requested = 0;
    b->recorded.clear();
    block* p = b->prev;
    if (p != nullptr && p->state == block_state::free && p->owner == b->owner) {
      unindex_free(p);
      p->size += b->size;
      p->next = b->next;
      if (b->next != nullptr) b->next->prev = p;
      absorb_fence(p, b);
      recycle(b);
      b = p;
    }
    block* n = b->next;
    if (n != nullptr && n->state == block_state::free && n->owner == b->owner) {
      unindex_free(n);
      b->size += n->size;
      b->next = n->next;
      if (n->next != nullptr) n->next->prev = b;
      absorb_fence(b, n);
      recycle(n);
    }
    index_free(b);
  }

  block* find_free(stream_state& st, std::size_t size, bool small) {
    const std::size_t max_split = options_.max_split_size;
    const std::size_t max_waste = options_.max_oversize_waste;
    // max_split_size concerns segments made for one large request; shared segments are always split.
    auto accept = [size, max_split, max_waste](const block* candidate) {
      if (!candidate->seg->dedicated) return true;
      return size < max_split ? candidate->size < max_split : candidate->size - size <= max_waste;
    };
    const int pool = small ? 1 : 0;
    if (const auto& index = st.pools[pool]; index && !index->empty()) {
      if (block* b = index->find(size, accept)) return b;
    }
    if (!options_.cross_stream_reuse) return nullptr;
    for (const auto& other : streams_) {
      if (other.get() == &st) continue;
      if (const auto& index = other->pools[pool]; index && !index->empty()) {
        if (block* b = index->find(size, accept)) return b;
      }
    }
    return nullptr;
  }

  /// Turns free block `b` (in a pool) into an allocation of `size` bytes on `st`, splitting off the remainder.
  void take(block* b, stream_state& st, std::size_t size, std::size_t requested) {
    const std::size_t remainder = b->size - size;
    const bool split = should_split(b, size, remainder);
    block* rest = split ? new_block() : nullptr;  // the only step that can fail before anything changes
    unindex_free(b);
    std::unique_ptr<event_type> fence = std::move(b->fence);
    if (b->owner != &st && fence) {
      try {
        ops_.wait(*fence, st.stream);  // the new stream waits for the old one's work, on the device
      } catch (...) {
        b->fence = std::move(fence);
        index_free(b);
        if (rest != nullptr) recycle(rest);
        throw;
      }
    }
    if (split) {
      rest->address = b->address + size;
      rest->size = remainder;
      rest->seg = b->seg;
      rest->owner = b->owner;  // the remainder stays with the stream it was cached for
      rest->small = b->small;
      rest->state = block_state::free;
      rest->prev = b;
      rest->next = b->next;
      if (b->next != nullptr) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      rest->fence = std::move(fence);  // the old stream's work may still use the remainder's memory
      rest->fence_sequence = b->fence_sequence;
      index_free(rest);
    } else {
      release_event(std::move(fence));
    }
    b->owner = &st;
    b->state = block_state::allocated;
    b->requested = requested;
    stats_.allocation.add(b->small, 1);
    stats_.allocated_bytes.add(b->small, as_delta(b->size));
    stats_.active.add(b->small, 1);
    stats_.active_bytes.add(b->small, as_delta(b->size));
    stats_.requested_bytes.add(b->small, as_delta(requested));
  }

  /// Frees an allocated block that is no longer in the pointer map. Events are recorded before any state changes,
  /// so if recording throws the block is put back as it was and the exception propagates.
  bool owner_may_be_busy(const block* b) const {
    return needs_fence_ && ops_.may_have_pending_work(b->owner->stream);
  }

  /// `owner_busy` says whether the owner stream may still have work using the block (asked before the lock is
  /// taken: on a CPU stream the question takes the queue's own lock).
  void free_allocated(block* b, bool owner_busy) {
    std::unique_ptr<event_type> fence;
    std::vector<std::pair<stream_state*, std::unique_ptr<event_type>>> uses;
    try {
      if (owner_busy) {
        fence = acquire_event();
        ops_.record(*fence, b->owner->stream);
      }
      for (stream_state* user : b->recorded) {
        uses.emplace_back(user, acquire_event());
        ops_.record(*uses.back().second, user->stream);
      }
      if (!uses.empty()) pending_streams_.reserve(pending_streams_.size() + uses.size());
    } catch (...) {
      release_event(std::move(fence));
      for (auto& use : uses) release_event(std::move(use.second));
      map_.insert(b->address, b);  // still allocated; the map had room for it a moment ago
      throw;
    }
    if (fence) {
      b->fence = std::move(fence);
      b->fence_sequence = ++fence_counter_;
    }
    stats_.allocation.add(b->small, -1);
    stats_.allocated_bytes.add(b->small, -as_delta(b->size));
    stats_.requested_bytes.add(b->small, -as_delta(b->requested));
    if (uses.empty()) {
      stats_.active.add(b->small, -1);
      stats_.active_bytes.add(b->small, -as_delta(b->size));
      return_to_pool(b);
      return;
    }
    b->state = block_state::pending;
    b->requested = 0;
    b->recorded.clear();
    b->pending_events = static_cast<std::uint32_t>(uses.size());
    pending_total_ += uses.size();
    for (auto& use : uses) {
      stream_state* user = use.first;
      if (user->pending.empty() &&
          std::find(pending_streams_.begin(), pending_streams_.end(), user) == pending_streams_.end()) {
        pending_streams_.push_back(user);
      }
      user->pending.push_back(pending_record{std::move(use.second), b});
    }
  }

  // --- growing and releasing ---

  bool within_limit(std::size_t segment_bytes) const noexcept {
    const std::size_t reserved = current(stats_.reserved_bytes) + in_flight_;
    return reserved <= limit_ && segment_bytes <= limit_ - reserved;
  }

  /// Gets a new segment from the upstream (lock released meanwhile) and returns it as one free block in `st`'s
  /// pool, or nullptr when the limit or the upstream refuses.
  block* grow(std::unique_lock<detail::spin_mutex>& lock, stream_state& st, std::size_t size, std::size_t segment_bytes,
              bool small, bool& limit_hit) {
    if (!within_limit(segment_bytes)) {
      limit_hit = true;
      return nullptr;
    }
    in_flight_ += segment_bytes;
    lock.unlock();
    void* p = nullptr;
    try {
      p = upstream_.allocate(segment_bytes);
    } catch (...) {
      lock.lock();
      in_flight_ -= segment_bytes;
      throw;
    }
    lock.lock();
    in_flight_ -= segment_bytes;
    if (p == nullptr) return nullptr;
    limit_hit = false;
    std::unique_ptr<segment> seg;
    block* b = nullptr;
    try {
      seg = std::make_unique<segment>();
      b = new_block();
      b->owner = &st;
      b->small = small;
      (void)index_of(b);
    } catch (...) {
      if (b != nullptr) recycle(b);
      lock.unlock();
      upstream_.deallocate(p, segment_bytes);
      lock.lock();
      throw;
    }
    seg->address = reinterpret_cast<std::uintptr_t>(p);
    seg->size = segment_bytes;
    seg->small = small;
    seg->dedicated = !small && size >= options_.medium_size;
    seg->first = b;
    seg->next_segment = segments_;
    if (segments_ != nullptr) segments_->prev_segment = seg.get();
    segments_ = seg.release();
    b->address = segments_->address;
    b->size = segment_bytes;
    b->seg = segments_;
    b->state = block_state::free;
    index_free(b);
    stats_.segment.add(small, 1);
    stats_.reserved_bytes.add(small, as_delta(segment_bytes));
    stats_.num_device_alloc.increment();
    high_water_ = std::max(high_water_, current(stats_.reserved_bytes));
    return b;
  }

  block* allocate_slow(std::unique_lock<detail::spin_mutex>& lock, stream_state& st, std::size_t requested, std::size_t size,
                       bool small) {
    const std::size_t segment_bytes = segment_size(size, small);
    bool limit_hit = false;
    if (options_.release_before_grow) {
      const std::size_t reserved = current(stats_.reserved_bytes) + in_flight_;
      const std::size_t room = high_water_ > reserved ? high_water_ - reserved : 0;
      if (segment_bytes > room && release_for_growth(lock, segment_bytes - room) > 0) {
        if (block* b = find_free(st, size, small)) return b;  // freed by another thread meanwhile
      }
    }
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    // The upstream (or the limit) refused. Other threads may have freed memory while the lock was released.
    if (block* b = find_free(st, size, small)) return b;
    // First retry: give back the free segments (waiting only for fences of work that may still use them).
    if (release_cached(lock, false, 0) > 0) {
      stats_.num_alloc_retries.increment();
      if (block* b = find_free(st, size, small)) return b;
      if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    }
    // Last retry, always made (the failure may have been transient): wait for blocks that other streams still
    // use, give back everything free, and try once more.
    release_cached(lock, true, 0);
    stats_.num_alloc_retries.increment();
    if (block* b = find_free(st, size, small)) return b;
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    throw_out_of_memory(lock, requested, size, segment_bytes, limit_hit);
  }

  /// Returns completely free segments to the upstream (largest first, until reserved <= target; all when target
  /// is 0). With `wait_pending`, first waits on the host for every pending event, so blocks held back by other
  /// streams become free too. Returns the bytes released. The lock is released while waiting and freeing.
  std::size_t release_cached(std::unique_lock<detail::spin_mutex>& lock, bool wait_pending, std::size_t target) {
    if (wait_pending) wait_for_pending_events(lock);
    std::vector<segment*> victims = free_segments();
    if (target != 0) {
      std::sort(victims.begin(), victims.end(), [](const segment* a, const segment* b) { return a->size > b->size; });
      std::size_t reserved = current(stats_.reserved_bytes);
      std::size_t keep = 0;
      while (keep < victims.size() && reserved > target) reserved -= victims[keep++]->size;
      victims.resize(keep);
    }
    return release_segments(lock, victims);
  }

  /// For release_before_grow: frees at least `deficit` bytes of completely free segments, disturbing the cache as
  /// little as possible: the smallest single segment that covers the deficit, else the largest ones until covered.
  std::size_t release_for_growth(std::unique_lock<detail::spin_mutex>& lock, std::size_t deficit) {
    std::vector<segment*> candidates = free_segments();
    if (candidates.empty()) return 0;
    std::sort(candidates.begin(), candidates.end(), [](const segment* a, const segment* b) { return a->size < b->size; });
    const auto covering = std::find_if(candidates.begin(), candidates.end(),
                                       [deficit](const segment* seg) { return seg->size >= deficit; });
    std::vector<segment*> victims;
    if (covering != candidates.end()) {
      victims.push_back(*covering);
    } else {
      std::size_t covered = 0;
      for (auto it = candidates.rbegin(); it != candidates.rend() && covered < deficit; ++it) {
        victims.push_back(*it);
        covered += (*it)->size;
      }
    }
    return release_segments(lock, victims);
  }

  /// Waits (lock released) for every pending event and returns the blocks they held back to their pools.
  void wait_for_pending_events(std::unique_lock<detail::spin_mutex>& lock) {
    stats_.num_sync_all_streams.increment();
    std::vector<pending_record> records;
    for (stream_state* st : pending_streams_) {
      for (auto& record : st->pending) records.push_back(std::move(record));
      st->pending.clear();
    }
    pending_streams_.clear();
    if (records.empty()) return;
    lock.unlock();
    for (auto& record : records) synchronize_quietly(*record.event);
    lock.lock();
    for (auto& record : records) {
      release_event(std::move(record.event));
      complete_pending(record.b);
    }
  }

  /// Segments whose blocks are all free.
  std::vector<segment*> free_segments() const {
    std::vector<segment*> result;
    for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      bool all_free = true;
      for (const block* b = seg->first; b != nullptr && all_free; b = b->next) all_free = b->state == block_state::free;
      if (all_free) result.push_back(seg);
    }
    return result;
  }

  /// Unlinks completely free segments and returns them to the upstream, after waiting for their fences (lock
  /// released meanwhile). Returns the bytes released.
  std::size_t release_segments(std::unique_lock<detail::spin_mutex>& lock, const std::vector<segment*>& victims) {
    if (victims.empty()) return 0;
    std::vector<std::unique_ptr<event_type>> fences;
    std::size_t released = 0;
    for (segment* seg : victims) {
      for (block* b = seg->first; b != nullptr;) {
        block* next = b->next;
        unindex_free(b);
        if (b->fence) fences.push_back(std::move(b->fence));
        recycle(b);
        b = next;
      }
      if (seg->prev_segment != nullptr) {
        seg->prev_segment->next_segment = seg->next_segment;
      } else {
        segments_ = seg->next_segment;
      }
      if (seg->next_segment != nullptr) seg->next_segment->prev_segment = seg->prev_segment;
      stats_.segment.add(seg->small, -1);
      stats_.reserved_bytes.add(seg->small, -as_delta(seg->size));
      released += seg->size;
    }
    lock.unlock();
    for (const auto& fence : fences) synchronize_quietly(*fence);
    for (segment* seg : victims) {
      upstream_.deallocate(reinterpret_cast<void*>(seg->address), seg->size);
      delete seg;
    }
    lock.lock();
    for (auto& fence : fences) release_event(std::move(fence));
    for (std::size_t i = 0; i < victims.size(); ++i) stats_.num_device_free.increment();
    return released;
  }

  free_space_info free_space_locked() const noexcept {
    free_space_info f;
    for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state != block_state::free) continue;
        f.free_bytes += b->size;
        ++f.free_blocks;
        f.largest_free_block = std::max(f.largest_free_block, b->size);
      }
    }
    return f;
  }

  // --- errors ---

  [[noreturn]] void throw_out_of_memory(std::unique_lock<detail::spin_mutex>& lock, std::size_t requested, std::size_t size,
                                        std::size_t segment_bytes, bool limit_hit) {
    stats_.num_ooms.increment();
    const free_space_info f = free_space_locked();
    const std::size_t allocated = current(stats_.allocated_bytes);
    const std::size_t reserved = current(stats_.reserved_bytes);
    const std::size_t limit = limit_;
    lock.unlock();
    upstream_memory_info info;
    try {
      info = upstream_.memory_info();
    } catch (...) {
    }
    using detail::format_bytes;
    using detail::format_bytes_exact;
    std::string m = "gpukit: out of memory on " + device_.to_string() + ": tried to allocate " +
                    format_bytes_exact(requested) + ", rounded to " + format_bytes_exact(size) +
                    ", which needs a new segment of " + format_bytes(segment_bytes) + ". ";
    if (info.known) {
      m += "Device: " + format_bytes(info.total_bytes) + " total, " + format_bytes(info.free_bytes) + " free. ";
    } else {
      m += "Device: total and free memory unknown. ";
    }
    char fragmentation[32];
    std::snprintf(fragmentation, sizeof fragmentation, "%.2f", f.fragmentation());
    m += "This allocator: " + format_bytes(allocated) + " allocated, " +
         format_bytes(reserved > allocated ? reserved - allocated : 0) +
         " reserved but unallocated (largest free block " + format_bytes(f.largest_free_block) +
         ", fragmentation " + fragmentation + " = 1 - largest free block / free), reserved limit " +
         (limit == allocator_options::unlimited ? std::string("none") : format_bytes(limit)) + ".";
    if (limit_hit) {
      m += " The reserved limit would be exceeded: raise it (set_reserved_limit / set_memory_fraction) or free memory.";
    } else if (f.free_bytes >= size) {
      m += " Enough memory is cached, but in pieces smaller than the request (fragmentation): a smaller "
           "max_split_size or fewer long-lived small allocations among large ones may help.";
    } else if (info.known && allocated < info.total_bytes / 2 && reserved < info.total_bytes / 2) {
      m += " Most of the device is used outside this allocator (other processes or libraries).";
    }
    const cudaError_t result = device_.is_cuda() && !limit_hit ? cudaErrorMemoryAllocation : cudaSuccess;
    throw out_of_memory_error(m, result, "gpukit::basic_caching_allocator::allocate(" + std::to_string(requested) + ")",
                              device_.ordinal());
  }

  [[noreturn]] void throw_not_owned(const void* p, const char* operation) const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    throw_not_owned_locked(p, operation);
  }

  [[noreturn]] void throw_not_owned_locked(const void* p, const char* operation) const {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    std::string m = std::string("gpukit: ") + operation + "(" + text + ") on the caching allocator of " +
                    device_.to_string() + ": ";
    const block* containing = nullptr;
    for (const segment* seg = segments_; seg != nullptr && containing == nullptr; seg = seg->next_segment) {
      if (address < seg->address || address >= seg->address + seg->size) continue;
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (address >= b->address && address < b->address + b->size) {
          containing = b;
          break;
        }
      }
    }
    if (containing == nullptr) {
      m += "the pointer was not allocated by this allocator (another device's allocator, cudaMalloc, or freed and "
           "already returned to the device)";
    } else if (containing->address != address) {
      m += "the pointer points " + std::to_string(address - containing->address) + " bytes into a block of " +
           std::to_string(containing->size) + " bytes; pass the pointer the allocation returned";
    } else if (containing->state == block_state::allocated) {
      m += "the allocation is being freed by another thread at the same time";
    } else {
      m += "the pointer was already freed (double free)";
    }
    throw invalid_argument_error(m, cudaSuccess, operation, device_.ordinal());
  }

  static constexpr std::size_t linear_stream_lookup = 16;

  gpukit::device device_;
  allocator_options options_;
  Upstream upstream_;
  StreamOps ops_{};
  bool needs_fence_ = false;

  mutable detail::spin_mutex mutex_;  // the device lock (spin_mutex.hpp says why not std::mutex)
  detail::sharded_pointer_map<block> map_;
  all_stats_t stats_;
  std::size_t limit_ = allocator_options::unlimited;  // guarded by mutex_
  std::atomic<std::size_t> limit_atomic_{allocator_options::unlimited};
  std::size_t in_flight_ = 0;  // bytes being allocated from the upstream right now (counted against the limit)
  std::size_t high_water_ = 0;  // most bytes ever reserved (release_before_grow keeps below it when it can)

  std::vector<std::unique_ptr<stream_state>> streams_;
  std::vector<std::pair<std::uintptr_t, stream_state*>> stream_keys_;
  std::unordered_map<std::uintptr_t, stream_state*> stream_index_;  // used once there are many streams
  std::vector<stream_state*> pending_streams_;  // streams with pending events
  std::size_t pending_total_ = 0;               // events not yet seen complete
  std::uint64_t fence_counter_ = 0;
  std::vector<std::unique_ptr<event_type>> event_pool_;

  segment* segments_ = nullptr;
  std::vector<std::unique_ptr<block[]>> block_chunks_;
  block* spare_blocks_ = nullptr;
};

}  // namespace gpukit
