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
/// - Footprint (gpukit's defaults, measured in bench_fragmentation): requests up to medium_size share segments that
///   grow with the footprint, each a whole number of the request that makes it; huge blocks are kept whole
///   (max_split_size). Nothing is returned to the upstream while memory is available (every cudaFree drains the
///   device): only under pressure (below), when asked (empty_cache, trim, a lower limit) or with release_before_grow.
/// - Out of memory: the allocator releases its free segments and retries; then waits for pending events, releases
///   again and retries once more (always: a failure may be transient); a shared segment sized for the footprint is
///   then replaced by the smallest one that holds the request; then it throws out_of_memory_error with the numbers
///   needed to understand why. Under a reserved limit, a new shared segment is sized to the room left below it.
/// - Statistics are atomics written under the lock and read without it.
///
/// - Stream identity: streams are keyed by the stream ops' key, for CUDA cudaStreamGetId (cached in views of
///   gpukit::stream and, per thread, for default streams), never by handle: CUDA gives a destroyed stream's handle to
///   the next stream created, which must not inherit blocks the old stream's work still uses (RMM #649).
///   cudaStreamPerThread is keyed per thread; an event for another thread's per-thread stream is recorded on the
///   legacy default stream (stream_ops.hpp). The state of a stream that holds nothing (nothing cached, allocated,
///   recorded or pending) is dropped in sweeps amortized over registrations, so creating and destroying streams
///   does not grow the allocator.
/// - Streams of other devices: record_stream (and deallocate(p, s)) accept streams of other CUDA devices, as for
///   peer copies; their events are that device's, recorded with it current.
/// - Destroyed streams (gpukit::stream only; the stream ops track them): such a stream gets no more events (its
///   handle may be another stream's). Its cached blocks wait until the work it had enqueued completes (an event its
///   destructor records), then belong to no stream, so any stream takes them. Freeing an allocation whose stream was
///   destroyed is a bug of the program (the buffer outlived its stream): it is reported through gpukit::warn, naming
///   the allocation and the stream, and the memory waits the same way, so nothing is reused too early and no stream
///   is made to wait. A stream recorded with record_stream may be destroyed before the free: the block then waits
///   for its last work. A raw cudaStream_t is not tracked: it must outlive the blocks it is used with (as with RMM).
///
/// Zero-size requests return nullptr (no statistic changes); deallocate(nullptr) does nothing.
///
/// CUDA graph capture: the engine serves no captured stream, so allocate, deallocate and record_stream on a stream
/// being captured (and empty_cache/trim while a stream with live allocations is) throw invalid_argument_error
/// before anything changes (stream_ops.hpp says why). Captures with a graph pool (graph/graph.hpp) are served by the
/// pool: caching_device_allocator routes their allocations and frees there before the engine sees them. Upstream calls
/// made for streams that are not captured relax the thread's capture mode, so they work while another thread captures
/// in global mode.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_options.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/detail/caching_diagnostics.hpp>
#include <gpukit/memory/detail/event_pool.hpp>
#include <gpukit/memory/detail/front_cache.hpp>
#include <gpukit/memory/detail/page_map.hpp>
#include <gpukit/memory/detail/pointer_map.hpp>
#include <gpukit/memory/detail/segment_sizing.hpp>
#include <gpukit/memory/detail/size_classes.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>
#include <gpukit/memory/detail/stream_registry.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/out_of_memory.hpp>
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
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Whether a StreamOps policy tracks stream lifetimes (tracker_type, track, expired, finished, wait_finished,
/// expirations: all or none; see stream_ops.hpp).
template <class Ops, class = void>
struct tracks_stream_lifetimes : std::false_type {};
template <class Ops>
struct tracks_stream_lifetimes<Ops, std::void_t<typename Ops::tracker_type>> : std::true_type {};

/// What a stream's state keeps to learn of its destruction: the policy's tracker, or nothing.
template <class Ops, bool = tracks_stream_lifetimes<Ops>::value>
struct stream_tracker {
  struct type {};
};
template <class Ops>
struct stream_tracker<Ops, true> {
  using type = typename Ops::tracker_type;
};

/// Whether a StreamOps policy resolves a stream into the copy the allocator keeps (`resolve`).
template <class Ops, class = void>
struct has_stream_resolve : std::false_type {};
template <class Ops>
struct has_stream_resolve<
    Ops, std::void_t<decltype(std::declval<const Ops&>().resolve(std::declval<const typename Ops::stream_type&>()))>>
    : std::true_type {};

/// Upstreams with virtual memory (reserve / map / unmap / unreserve whole pages): expandable segments.
template <class U, class = void>
struct has_virtual_memory : std::false_type {};
template <class U>
struct has_virtual_memory<U, std::void_t<decltype(std::declval<U&>().reserve(std::size_t{})),
                                         decltype(std::declval<U&>().map(nullptr, std::size_t{})),
                                         decltype(std::declval<U&>().unmap(nullptr, std::size_t{})),
                                         decltype(std::declval<U&>().unreserve(nullptr, std::size_t{})),
                                         decltype(std::declval<const U&>().page_size())>> : std::true_type {};

/// Upstreams that can give a segment back once events complete, without a wait on the host (upstream.hpp).
template <class U, class Event, class = void>
struct has_ordered_release : std::false_type {};
template <class U, class Event>
struct has_ordered_release<U, Event,
                           std::void_t<decltype(std::declval<U&>().deallocate_after(
                               nullptr, std::size_t{}, std::declval<const std::vector<const Event*>&>()))>>
    : std::true_type {};

/// ... which may say at run time that the device has none (device_upstream: the CPU, or an old driver or GPU).
template <class U, class = void>
struct has_virtual_memory_query : std::false_type {};
template <class U>
struct has_virtual_memory_query<U, std::void_t<decltype(std::declval<const U&>().virtual_memory_supported())>>
    : std::true_type {};

/// Whether a StreamOps policy describes streams for messages (`describe`).
template <class Ops, class = void>
struct has_stream_describe : std::false_type {};
template <class Ops>
struct has_stream_describe<
    Ops, std::void_t<decltype(std::declval<const Ops&>().describe(std::declval<const typename Ops::stream_type&>()))>>
    : std::true_type {};
}  // namespace detail

/// The caching allocator engine (see the file comment for its design): stream-ordered memory carved from segments
/// of `Upstream` (upstream.hpp), with the streams and events of `StreamOps` (stream_ops.hpp). Thread-safe; one per
/// device. caching_device_allocator puts it behind the device_allocator interface.
template <class Upstream, class StreamOps = stream_ops>
class basic_caching_allocator {
 public:
  using upstream_type = Upstream;                       ///< where segments come from (upstream.hpp)
  using stream_ops_type = StreamOps;                    ///< the stream and event policy (stream_ops.hpp)
  using stream_type = typename StreamOps::stream_type;  ///< the streams allocations are ordered on
  using event_type = typename StreamOps::event_type;    ///< the events the allocator records to wait for streams

  /// An allocator for device `d` whose upstream is built from `upstream_args` (or from `d` when none are given and
  /// the upstream takes a device, like device_upstream). Makes no CUDA call.
  template <class... UpstreamArgs>
  explicit basic_caching_allocator(gpukit::device d, allocator_options options = {}, UpstreamArgs&&... upstream_args)
      : device_(d), options_(options), upstream_(make_upstream(d, std::forward<UpstreamArgs>(upstream_args)...)) {
    options_.validate();
    unowned_ = std::make_unique<stream_state>(no_stream_key, stream_type{}, d, tracker_type{});
    for (auto& pool : unowned_->pools) pool = std::make_unique<index_type>();  // retire() must not fail midway
    limit_ = options_.reserved_limit;
    limit_atomic_.store(limit_, std::memory_order_relaxed);  // reported by reserved_limit(), stats(), memory_summary
    needs_fence_ = options_.cross_stream_reuse || !upstream_.synchronizes_on_free();
    // Blocks cached in front are reused by their own stream only: cross-stream reuse wants them in the heap.
    front_cache_ = options_.front_cache && !options_.cross_stream_reuse;
    front_cache_large_ = front_cache_ && options_.front_cache_large;
    fronts_used_ = front_cache_large_ ? front_slot_count : front_slots_per_pool;
    if (options_.expandable_segments && !has_vm) {
      warn("gpukit: expandable segments were asked for the caching allocator of " + d.to_string() +
           ", but its upstream has no virtual memory (reserve/map/unmap): ordinary segments are used");
    }
  }

  basic_caching_allocator(const basic_caching_allocator&) = delete;
  basic_caching_allocator& operator=(const basic_caching_allocator&) = delete;

  /// Returns every segment to the upstream (after the work that may use them). Allocations still live at this point
  /// are a bug in the program: they are reported through gpukit::warn and their memory is released anyway.
  ~basic_caching_allocator() {
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    const std::size_t live = user_current(st_allocation);  // blocks in front caches are not live
    if (live > 0) {
      warn("gpukit: the caching allocator of " + device_.to_string() + " is destroyed with " + std::to_string(live) +
           " live allocation(s) (" + detail::format_bytes(user_current(st_allocated_bytes)) +
           "); their memory is released now, so any later use of it is invalid");
    }
    for (auto& st : streams_) {
      for (auto& record : st->pending) {
        if (record.event) {
          synchronize_quietly(*record.event);
        } else {
          wait_finished_quietly(st->tracker);
        }
      }
      st->pending.clear();
    }
    if (!upstream_.synchronizes_on_free()) {
      for (stream_state* st : dead_streams_) wait_finished_quietly(st->tracker);  // their blocks had no fence
    }
    for (segment* seg = segments_; seg != nullptr;) {
      for (block* b = seg->first; b != nullptr; b = b->next) {
        if (b->fence) synchronize_quietly(*b->fence);
      }
      return_segment(seg);
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
  /// even after the cache is released; invalid_argument_error for a stream of another device, a size that
  /// overflows when rounded, or a stream being captured into a CUDA graph.
  [[nodiscard]] void* allocate(std::size_t bytes, const stream_type& stream) {
    if (bytes == 0) return nullptr;
    refuse_if_captured(stream, "allocate");
    const std::size_t size = round_request(bytes);
    const bool small = size <= options_.small_size;
    if (front_cache_ && (small || front_cache_large_) && ops_.device_of(stream) == device_) {
      if (block* cached = front_take(ops_.key(stream), size, bytes, !small)) {
        if (history_.load(std::memory_order_acquire) != nullptr) note(memory_action::alloc, cached);
        return reinterpret_cast<void*>(cached->address);
      }
    }
    return allocate_from_heap(stream, bytes, size, small);
  }

  /// Frees `p` in the order of the stream it was allocated on: the block can be reused on that stream at once, and
  /// on other streams once the work recorded with record_stream completes. nullptr is ignored. Throws
  /// invalid_argument_error for a pointer this allocator does not own (never allocated here, already freed, or
  /// pointing inside an allocation), and, leaving it allocated, while its stream or a stream recorded for it is
  /// being captured into a CUDA graph. A second free of a pointer is detected when it is ordered after the first
  /// (the same thread, or synchronized); two frees of one pointer racing on two threads are a data race in the
  /// program, as they are with malloc.
  void deallocate(void* p) {
    if (p == nullptr) return;
    block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned(p, "deallocate");
    // Until the block leaves the map (or enters a front cache) nothing else changes it: its owner (set under the
    // lock when it was allocated) is fixed. If anything below throws (captured, asking the stream failed on a
    // broken context, no memory for the message), the allocation stays live and the program can still free it.
    refuse_free_if_captured(b);
    const bool expired_owner = owner_expired(b);
    const bool busy = owner_may_be_busy(b);
    // Reusable at once on its own stream: a small block (a large one too with front_cache_large) is cached in front
    // for the next request of its size there (it stays in the map, marked). Only when it needs no fence: the stream
    // may be destroyed while the block is cached, and must not be asked (or recorded on) later.
    if (front_cache_ && (b->small || front_cache_large_) && !busy && !expired_owner && b->recorded.empty()) {
      const front_result r = front_give(b);  // refuses a stream whose destruction was noticed meanwhile
      if (r == front_result::cached) return;
      if (r == front_result::already_free) throw_not_owned(p, "deallocate");
    }
    free_to_heap(b, busy, expired_owner || owner_expired(b));
  }

  /// Frees `p` after the work enqueued so far on `stream` as well (as if record_stream(p, stream) had been called),
  /// for memory last used on a stream other than its own. The stream may belong to another CUDA device (a peer copy
  /// read it), as with record_stream.
  void deallocate(void* p, const stream_type& stream) {
    if (p == nullptr) return;
    refuse_if_captured(stream, "deallocate");
    std::string report;
    {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      stream_state& st = stream_for(stream, true);  // checks the device before anything changes
      block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
      if (b == nullptr) throw_not_owned_locked(p, "deallocate");
      refuse_if_captured(b->owner->stream, "deallocate");
      note_stream_use(b, st);  // may throw (memory): the block is still allocated then
      const bool busy = owner_may_be_busy(b);
      if (owner_expired(b)) report = expired_owner_message(b);  // may throw (memory): still allocated, still mapped
      if (map_.erase(reinterpret_cast<std::uintptr_t>(p)) != b) throw_not_owned_locked(p, "deallocate");
      free_allocated(b, busy);  // puts the block back in the map if it throws
    }
    if (!report.empty()) warn(report);
  }

  /// Notes that `stream` uses the allocation at `p` (like torch's Tensor.record_stream): when `p` is freed, its
  /// block is reused only after the work enqueued on `stream` until then has completed. `stream` may belong to
  /// another CUDA device (a peer copy): the event is then one of that device, recorded with it current. It may be
  /// destroyed before the free: the block then waits for its last work.
  void record_stream(void* p, const stream_type& stream) {
    refuse_if_captured(stream, "record_stream");
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    stream_state& st = stream_for(stream, true);
    block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "record_stream");
    note_stream_use(b, st);
  }

  /// True when `p` is the start of a live allocation of this allocator.
  [[nodiscard]] bool owns(const void* p) const noexcept {
    return p != nullptr && live_block(reinterpret_cast<std::uintptr_t>(p)) != nullptr;
  }

  /// The bytes `p` was allocated with (as requested, before rounding). Throws for pointers not owned.
  std::size_t allocation_size(const void* p) const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    const block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "allocation_size");
    return b->requested;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Statistics
  // ---------------------------------------------------------------------------------------------------------------

  /// Every statistic. Each value is one the statistic had (read without a lock; see consistent_read); take
  /// snapshot() for a set consistent across statistics.
  allocator_stats stats() const noexcept {
    return consistent_read([this] { return read_stats(); });
  }

  /// Bytes handed out to users (rounded), like torch.cuda.memory_allocated().
  std::size_t memory_allocated() const noexcept {
    return consistent_read([this] { return user_current(st_allocated_bytes); });
  }
  /// Bytes held from the upstream, like torch.cuda.memory_reserved().
  std::size_t memory_reserved() const noexcept { return current(stats_.reserved_bytes); }
  /// Peak of memory_allocated() since the last reset_peak_stats().
  std::size_t max_memory_allocated() const noexcept { return peak(stats_.allocated_bytes); }
  /// Peak of memory_reserved() since the last reset_peak_stats().
  std::size_t max_memory_reserved() const noexcept { return peak(stats_.reserved_bytes); }

  /// Starts new peaks from the current values (e.g. to measure one phase of a program).
  void reset_peak_stats() noexcept {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    fronts_lock all(*this);
    all_changing changes(*this);
    for (front_slot_type& slot : used_fronts()) {
      for (std::size_t q = 0; q < detail::front_quantity_count; ++q) slot.claim[q] = slot.value(q);
    }
    // Each peak is stored once, as the users' value (never the heap's part alone, which readers could see).
    for (std::size_t k = 0; k < counter_count; ++k) {
      detail::atomic_stat& g = stat_ref(k / 3).pools[k % 3];
      std::int64_t value = g.current.load(std::memory_order_relaxed);
      if (fronts_active_ && fronted(k / 3)) {
        for (const front_slot_type& slot : used_fronts()) value += front_value(slot, k);
        slack_[k] = 0;
      }
      g.peak.store(value, std::memory_order_release);
    }
  }
  /// Zeroes the totals allocated/freed and the counters (retries, OOMs, upstream calls, ...).
  void reset_accumulated_stats() noexcept {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    fronts_lock all(*this);
    all_changing changes(*this);
    for (std::size_t id = 0; id < stat_count; ++id) stat_ref(id).reset_accumulated();
    for (front_slot_type& slot : used_fronts()) {
      slot.reset_totals();
    }
    stats_.num_alloc_retries.reset();
    stats_.num_ooms.reset();
    stats_.num_sync_all_streams.reset();
    stats_.num_device_alloc.reset();
    stats_.num_device_free.reset();
    stats_.num_device_free_unforced.reset();
  }

  /// The cached free memory's layout (walks the segments under the lock: for reports, not hot paths).
  free_space_info free_space() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    return free_space_locked();
  }

  /// Every segment and block with the statistics, consistent with each other.
  allocator_snapshot snapshot() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    fronts_lock all(*this);  // blocks do not enter or leave the front caches meanwhile
    // Recorded under the locks: the history's events before it are exactly those the snapshot reflects (up to
    // allocations being returned on other threads), which is where memory_picture anchors its levels.
    if (memory_history* h = history_.load(std::memory_order_acquire)) h->record(memory_action::snapshot, 0, 0, 0);
    return detail::caching_diagnostics::snapshot(*this);
  }

  /// A table of the statistics like torch.cuda.memory_summary(), with the largest free block and fragmentation.
  std::string memory_summary() const {
    allocator_stats s;
    free_space_info f;
    {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      {
        fronts_lock all(*this);
        s = read_stats();
      }
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
    detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    refuse_release_if_captured("empty_cache");
    release_cached(lock, true, 0);
  }

  /// Like empty_cache(), but stops once reserved memory is at most `target_reserved` bytes, releasing the largest
  /// free segments first. Returns the reserved bytes afterwards (more than the target if too little is free).
  std::size_t trim(std::size_t target_reserved) {
    detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
    std::unique_lock<detail::spin_mutex> lock(mutex_);
    refuse_release_if_captured("trim");
    release_cached(lock, true, target_reserved);
    return current(stats_.reserved_bytes);
  }

  /// Caps reserved memory at `bytes` (allocator_options::unlimited for none), releasing free segments at once if
  /// the cache is above it. Allocations that would exceed it free cache and retry, then throw out_of_memory_error.
  void set_reserved_limit(std::size_t bytes) {
    detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
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

  /// Calls `observer` with the numbers of every out-of-memory error, just before it is thrown: from the allocating
  /// thread, outside the allocator's lock, so it may use the allocator (snapshot, memory_summary, free buffers to
  /// shed load; the failed request is not retried). One that throws is reported through gpukit::warn and the error
  /// is thrown all the same. Returns an id for remove_out_of_memory_observer.
  std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer) {
    return observers_.add(std::move(observer));
  }
  /// Removes an observer; returns false when no observer has that id. A call already under way finishes.
  bool remove_out_of_memory_observer(std::uint64_t id) { return observers_.remove(id); }

  /// Records this allocator's events into `history` from now on (memory_history.hpp); nullptr stops recording.
  /// While no history is set, the cost is one acquire load (a plain load on x86) and a branch per call. A history once
  /// set is kept alive until the allocator is destroyed (a call on another thread may still be recording into it).
  void set_memory_history(std::shared_ptr<memory_history> history) {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    memory_history* const raw = history.get();
    if (history != nullptr && std::find(histories_.begin(), histories_.end(), history) == histories_.end()) {
      histories_.push_back(history);
    }
    current_history_ = std::move(history);
    history_.store(raw, std::memory_order_release);  // the history's construction happens before its first record
  }
  /// The history being recorded into, or null.
  std::shared_ptr<memory_history> history() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    return current_history_;
  }

  /// The limit on reserved bytes (allocator_options::unlimited when none), read without locking.
  std::size_t reserved_limit() const noexcept { return limit_atomic_.load(std::memory_order_relaxed); }
  /// The options the allocator was built with (their reserved_limit is the initial one; see reserved_limit()).
  const allocator_options& options() const noexcept { return options_; }
  /// The device whose memory this allocator hands out.
  gpukit::device device() const noexcept { return device_; }
  /// The upstream segments come from (e.g. for address_space_upstream's used() and set_capacity()).
  Upstream& upstream() noexcept { return upstream_; }
  /// The upstream segments come from, read-only.
  const Upstream& upstream() const noexcept { return upstream_; }
  /// The stream ops the allocator uses (tests drive their fake streams through it).
  StreamOps& stream_operations() noexcept { return ops_; }
  /// How many streams the allocator keeps state for (diagnostics and tests).
  std::size_t stream_count() const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    return streams_.size();
  }

  /// The rounded size a request of `bytes` is served with (throws invalid_argument_error on overflow).
  std::size_t rounded_size(std::size_t bytes) const { return round_request(bytes); }
  /// The segment size a rounded request `size` would get from the upstream on a cache miss.
  std::size_t segment_size_for(std::size_t size) const { return segment_size(size, size <= options_.small_size); }

 private:
  friend struct detail::caching_diagnostics;  // snapshots, free space and misuse messages read the state below
  struct stream_state;
  struct segment;

  static constexpr bool tracks_lifetimes = detail::tracks_stream_lifetimes<StreamOps>::value;
  static constexpr bool has_vm = detail::has_virtual_memory<Upstream>::value;
  using tracker_type = typename detail::stream_tracker<StreamOps>::type;
  /// The key snapshots show for blocks that belong to no stream (stream ids never reach it).
  static constexpr std::uintptr_t no_stream_key = ~std::uintptr_t{0};

  template <class... Args>
  static Upstream make_upstream(gpukit::device d, Args&&... args) {
    if constexpr (sizeof...(Args) == 0 && std::is_constructible<Upstream, gpukit::device>::value) {
      return Upstream(d);
    } else {
      (void)d;
      return Upstream(std::forward<Args>(args)...);
    }
  }

  // A cache line (or two) of its own: threads freeing and taking blocks in front caches do not share lines.
  struct alignas(64) block {
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
    bool taken_split = false;  // a piece of a split segment when allocated (cannot change until it is free)
    // In a front cache: allocated to the heap (and in the pointer map), free to the user. Written under the slot's
    // lock; read without it by a free, which is ordered after the allocation that cleared it.
    std::atomic<bool> in_front{false};
  };

  struct segment {
    std::uintptr_t address = 0;
    std::size_t size = 0;  // for an expandable segment, the reserved virtual range
    bool small = false;
    bool dedicated = false;   // made for one request of medium_size or more (not shared by design)
    bool expandable = false;  // a virtual range whose pages are mapped on demand (expandable_segments)
    detail::page_map pages;   // expandable: which pages are mapped
    /// Bytes backed by memory: the whole segment, or the mapped pages of an expandable one.
    std::size_t mapped() const noexcept { return expandable ? pages.mapped_bytes() : size; }
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
    stream_state(std::uintptr_t k, const stream_type& s, gpukit::device d, tracker_type t)
        : key(k), stream(s), device(d), tracker(std::move(t)) {}
    std::uintptr_t key;
    stream_type stream;                    // resolved: means this stream from any thread
    gpukit::device device;                 // this allocator's, or another CUDA device's (record_stream)
    tracker_type tracker;                  // says when a tracked stream (gpukit::stream) is destroyed
    std::unique_ptr<index_type> pools[2];  // [1]: small, [0]: large; created on first use
    std::deque<pending_record> pending;    // events recorded on this stream, in order (null: its final work)
    std::size_t in_use = 0;                // allocated or pending blocks it owns, and blocks that recorded it
    bool dead = false;             // destroyed: its free blocks wait for its last work (nobody else may take them)
    bool retired = false;          // ... which has completed: its blocks belong to no stream from now on
    bool slots_released = false;   // dead, and its front slots gave their blocks to the heap (release_slots_of_dead)
    std::uint64_t last_sweep = 0;  // the stream-registry sweep during which it last allocated (abandoned_state)
    segment* expandable[2] = {nullptr, nullptr};  // its expandable segments: [1] small, [0] large
  };

  struct all_stats_t {
    detail::atomic_pool_stats allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
        active_bytes, inactive_split_bytes, requested_bytes;
    detail::atomic_counter num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free,
        num_device_free_unforced;
  };

  // The statistics, in the order of stat_members; a front cache counter is id * 3 + pool (0 all, 1 small, 2 large).
  enum stat_id : std::size_t {
    st_allocation,
    st_segment,
    st_active,
    st_inactive_split,
    st_allocated_bytes,
    st_reserved_bytes,
    st_active_bytes,
    st_inactive_split_bytes,
    st_requested_bytes
  };
  /// Segments are never in a front cache: their counters need no claims.
  static constexpr bool fronted(std::size_t id) noexcept { return id != st_segment && id != st_reserved_bytes; }
  static constexpr std::size_t counter_count = 27;  // 9 statistics x (all, small, large)
  /// The front-cache quantity (detail/front_cache.hpp) of a slot of small blocks (or of large ones: `large_slot`)
  /// that counter k follows, or front_quantity_count for a counter that slot's blocks never change (segments, and
  /// the other pool's counters).
  static constexpr std::size_t quantity_of(std::size_t k, bool large_slot) noexcept {
    if (k % 3 == (large_slot ? 1 : 2)) return detail::front_quantity_count;
    switch (k / 3) {
      case st_allocation:
      case st_active:
        return detail::fq_blocks;
      case st_allocated_bytes:
      case st_active_bytes:
        return detail::fq_bytes;
      case st_requested_bytes:
        return detail::fq_requested;
      case st_inactive_split:
        return detail::fq_split_blocks;
      case st_inactive_split_bytes:
        return detail::fq_split_bytes;
      default:
        return detail::front_quantity_count;
    }
  }

  static constexpr std::size_t stat_count = 9;
  using stat_member = detail::atomic_pool_stats all_stats_t::*;  // an alias: nvcc's generated code then compiles
                                                                 // without -Wparentheses warnings
  static constexpr stat_member stat_members[stat_count] = {
      &all_stats_t::allocation,      &all_stats_t::segment,
      &all_stats_t::active,          &all_stats_t::inactive_split,
      &all_stats_t::allocated_bytes, &all_stats_t::reserved_bytes,
      &all_stats_t::active_bytes,    &all_stats_t::inactive_split_bytes,
      &all_stats_t::requested_bytes};
  detail::atomic_pool_stats& stat_ref(std::size_t id) noexcept { return stats_.*stat_members[id]; }
  const detail::atomic_pool_stats& stat_ref(std::size_t id) const noexcept { return stats_.*stat_members[id]; }

  /// Runs `read` (loads of the heap's counters and the front slots' counts) so that it sees them at one moment.
  /// A value is the heap's part plus the slots' parts: read one after the other while a block moves between a front
  /// cache and the heap, or two threads free and allocate, it would count blocks twice or not at all (a current
  /// value above its peak was seen). No slot changing between the first and the last look at the slots' sequence
  /// counts means the heap's counters were read at a moment the slots had those counts. After a few tries under
  /// heavy traffic, takes the locks (a reader that always locked slowed 2 allocating threads 15-fold).
  template <class Read>
  auto consistent_read(const Read& read) const noexcept {
    if (front_cache_) {
      for (int attempt = 0; attempt < 16; ++attempt) {
        std::array<std::uint32_t, front_slot_count> before{};
        bool changing = false;
        for (std::size_t i = 0; i < fronts_used_; ++i) {
          before[i] = fronts_[i].sequence.load(std::memory_order_acquire);
          changing = changing || (before[i] & 1U) != 0;
        }
        if (changing) {
          detail::spin_mutex::pause();
          continue;
        }
        auto result = read();
        bool same = true;
        for (std::size_t i = 0; i < fronts_used_; ++i) {
          same = same && fronts_[i].sequence.load(std::memory_order_relaxed) == before[i];
        }
        if (same) return result;
      }
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      fronts_lock all(*this);
      return read();
    }
    return read();
  }

  /// The statistics, each value read atomically: consistent with each other when the caller holds the device lock
  /// and every slot lock, or when there are no front caches.
  allocator_stats read_stats() const noexcept {
    allocator_stats s;
    s.allocation = load_stat(st_allocation);
    s.segment = load_stat(st_segment);
    s.active = load_stat(st_active);
    s.inactive_split = load_stat(st_inactive_split);
    s.allocated_bytes = load_stat(st_allocated_bytes);
    s.reserved_bytes = load_stat(st_reserved_bytes);
    s.active_bytes = load_stat(st_active_bytes);
    s.inactive_split_bytes = load_stat(st_inactive_split_bytes);
    s.requested_bytes = load_stat(st_requested_bytes);
    s.num_alloc_retries = stats_.num_alloc_retries.load();
    s.num_ooms = stats_.num_ooms.load();
    s.num_sync_all_streams = stats_.num_sync_all_streams.load();
    s.num_device_alloc = stats_.num_device_alloc.load();
    s.num_device_free = stats_.num_device_free.load();
    s.num_device_free_unforced = stats_.num_device_free_unforced.load();
    s.reserved_limit = limit_atomic_.load(std::memory_order_relaxed);
    s.expandable_address_space = address_space_.load(std::memory_order_relaxed);
    return s;
  }

  /// Statistic `id` as users see it: the heap's counters plus the front caches' differences.
  pool_stats load_stat(std::size_t id) const noexcept {
    pool_stats p = stat_ref(id).load();
    if (!fronted(id)) return p;
    for (const front_slot_type& slot : used_fronts()) {
      for (std::size_t pool = 0; pool < 3; ++pool) {
        const std::size_t q = quantity_of(id * 3 + pool, is_large_slot(slot));
        if (q == detail::front_quantity_count) continue;
        p.pools[pool].current += slot.value(q);
        p.pools[pool].allocated += slot.raised_total(q);
        p.pools[pool].freed += slot.lowered_total(q);
      }
    }
    return p;
  }
  std::size_t user_current(std::size_t id) const noexcept {
    std::int64_t v = stat_ref(id).pools[0].current.load(std::memory_order_acquire);
    for (const front_slot_type& slot : used_fronts()) v += front_value(slot, id * 3);
    return v > 0 ? static_cast<std::size_t>(v) : 0;
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

  // The growth policy is detail/segment_sizing.hpp; these read it with this allocator's options and state.
  std::size_t round_request(std::size_t bytes) const {
    const std::size_t size = detail::segment_sizing::rounded_request(options_, bytes);
    if (size == 0) throw_overflow(bytes);
    return size;
  }
  std::size_t segment_size(std::size_t size, bool small) const noexcept {
    return detail::segment_sizing::preferred(options_, size, small, current(stats_.reserved_bytes));
  }
  std::size_t fitted_segment_size(std::size_t size, bool small) const noexcept {
    return detail::segment_sizing::fitted(options_, size, small, current(stats_.reserved_bytes), in_flight_, limit_);
  }
  bool should_split(const block* b, std::size_t size, std::size_t remainder) const noexcept {
    return detail::segment_sizing::should_split(options_, b->small, b->seg->dedicated, size, remainder);
  }

  // --- streams and events ---

  /// The state of stream `s`, registered on first use (detail/stream_registry.hpp). Streams of other CUDA devices
  /// are accepted only where `other_devices` (record_stream, deallocate(p, s)).
  ///
  /// The device is checked first, on every call: computing the key may need the stream's device (a CUDA default
  /// stream's id), and a stream of another device must be refused with that reason, not with the error its key would
  /// raise, even when its key equals that of a stream seen before (keys are the stream ops' business; a CUDA default
  /// stream must not pass for the CPU's). Naming the wrong device needs no CUDA call (a CPU allocator on a machine
  /// without a driver still says "wrong device"). For a view that knows its device (every gpukit stream and
  /// default_stream(d)) this costs nothing; a raw cudaStream_t costs one cudaStreamGetDevice.
  stream_state& stream_for(const stream_type& s, bool other_devices = false) {
    const gpukit::device d = ops_.device_of(s);
    if (d != device_ && !(other_devices && d.is_cuda() && device_.is_cuda())) throw_wrong_device(d);
    const std::uintptr_t key = ops_.key(s);
    stream_state* found = streams_.find(key);
    if (found == nullptr) return *register_stream(s, key, d);
    if (found->device != d) throw_key_collision(found->device, d, key);
    return *found;
  }

  [[noreturn]] void throw_wrong_device(gpukit::device d) const {
    throw invalid_argument_error("gpukit: a stream of " + d.to_string() + " was passed to the caching allocator of " +
                                     device_.to_string() + " (wrong device)",
                                 cudaSuccess, "gpukit::basic_caching_allocator", device_ordinal());
  }

  /// Two streams of different devices with one key: the stream ops broke their contract (keys are unique across
  /// devices), and the allocator would take one stream for the other.
  [[noreturn]] void throw_key_collision(gpukit::device known, gpukit::device passed, std::uintptr_t key) const {
    throw invalid_argument_error(
        "gpukit: a stream of " + passed.to_string() + " was passed to the caching allocator of " + device_.to_string() +
            ", but its key " + std::to_string(key) + " is that of a stream of " + known.to_string() +
            " the allocator already knows; stream keys must be unique across devices",
        cudaSuccess, "gpukit::basic_caching_allocator", device_ordinal());
  }

  /// The CUDA ordinal for exceptions (-1 for the CPU).
  int device_ordinal() const noexcept { return device_.is_cuda() ? device_.ordinal() : -1; }

  /// Registers stream `s` of device `d` (checked by stream_for) under `key`.
  stream_state* register_stream(const stream_type& s, std::uintptr_t key, gpukit::device d) {
    // A server that creates and destroys streams must not grow this registry forever: states with nothing cached,
    // pending or allocated go, in sweeps whose cost is amortized over the registrations since the last one.
    if (streams_.size() >= prune_at_) prune_streams();
    stream_type kept = s;
    if constexpr (detail::has_stream_resolve<StreamOps>::value) kept = ops_.resolve(s);
    tracker_type tracker{};
    if constexpr (tracks_lifetimes) tracker = ops_.track(s);
    return &streams_.add(key, key, kept, d, std::move(tracker));
  }

  /// Removes the states of streams that hold nothing: no cached, allocated or pending block, no event, and not a
  /// destroyed stream whose work is still running. They are made again if the stream comes back.
  void prune_streams() {
    if constexpr (tracks_lifetimes) {
      note_expirations();
      if (!dead_streams_.empty()) retire_finished();
    }
    streams_.remove_if([](const stream_state& st) noexcept {
      return st.in_use == 0 && st.pending.empty() && (!st.dead || st.retired) &&
             (!st.pools[0] || st.pools[0]->empty()) && (!st.pools[1] || st.pools[1]->empty());
    });
    ++sweeps_;
    // Abandoned states go at the next sweep (their cache is released before the footprint grows): the next sweep
    // comes after as many registrations again as there are streams still in use.
    std::size_t abandoned = 0;
    for (const auto& st : streams_) abandoned += abandoned_state(*st) ? 1 : 0;
    may_have_abandoned_ = abandoned != 0;
    prune_at_ = std::max(min_prune_at, 2 * (streams_.size() - abandoned));
  }

  /// A stream abandoned while others keep being created (a server making a stream per request, raw handles above
  /// all, whose destruction the allocator cannot see): it holds only cached memory and allocated nothing since the
  /// last sweep, i.e. while at least min_prune_at other streams were registered. A fixed set of streams makes no
  /// sweeps, so no stream of it is ever abandoned.
  bool abandoned_state(const stream_state& st) const noexcept {
    return st.last_sweep < sweeps_ && st.in_use == 0 && st.pending.empty() && !st.dead;
  }

  /// Before the footprint grows under stream churn: returns the completely free segments whose blocks all belong to
  /// abandoned streams to the upstream, so memory cached for streams that are gone does not pile up
  /// until the device runs short. Counted as unforced frees; the states, then empty, go at the next sweep.
  std::size_t release_abandoned(std::unique_lock<detail::spin_mutex>& lock) {
    if (!may_have_abandoned_) return 0;
    may_have_abandoned_ = false;
    std::vector<segment*> victims;
    for (segment* seg : free_segments()) {
      bool abandoned = true;
      for (const block* b = seg->first; b != nullptr && abandoned; b = b->next) {
        abandoned = b->owner != unowned_.get() && abandoned_state(*b->owner);  // unowned blocks serve any stream
      }
      if (abandoned) victims.push_back(seg);
    }
    return release_segments(lock, victims, true);
  }

  // --- stream lifetimes (stream_ops.hpp: gpukit streams are tracked, raw handles are not) ---

  bool expired(const stream_state& st) const noexcept {
    if constexpr (tracks_lifetimes) {
      return ops_.expired(st.tracker);
    } else {
      (void)st;
      return false;
    }
  }
  bool owner_expired(const block* b) const noexcept { return expired(*b->owner); }
  bool finished(const stream_state& st) const {
    if constexpr (tracks_lifetimes) {
      return ops_.finished(st.tracker);
    } else {
      (void)st;
      return true;
    }
  }

  /// Marks the states of streams destroyed since the last look (an O(streams) scan, once per destruction), and
  /// empties their front slots.
  void note_expirations() {
    if constexpr (tracks_lifetimes) {
      seen_expirations_ = ops_.expirations();  // before the scan: a destruction during it is seen next time
      for (const auto& st : streams_) {
        if (st->dead || !ops_.expired(st->tracker)) continue;
        dead_streams_.push_back(st.get());
        st->dead = true;
        slots_to_release_ = true;
      }
      if (slots_to_release_) release_slots_of_dead();
    }
  }

  /// The front slots of the streams found destroyed since the last call (device lock held) give their blocks to the
  /// heap, where they wait for the stream's last work, whichever path noticed the destruction (note_expirations, or
  /// free_allocated, which cannot: it may run under the slot locks): cached, they would hold the slot and their
  /// memory for a stream that never asks again. A free racing the destruction cannot cache a block after this:
  /// front_give_to finds the slot marked (owner_gone) under its lock. The slots are marked unused since another
  /// stream last asked, so the first stream to ask takes one over instead of the second (owners are never reset to
  /// unowned: see front_slot_at). If taking a block back throws, the next request tries again.
  void release_slots_of_dead() {
    const auto unreleased = [this](std::uintptr_t key) {
      return std::any_of(dead_streams_.begin(), dead_streams_.end(),
                         [key](const stream_state* st) { return st->key == key && !st->slots_released; });
    };
    // Slots change hands only under the device lock (front_give_slow), so their owners can be read without theirs.
    bool owned = false;
    for (const front_slot_type& slot : used_fronts())
      owned = owned || unreleased(owner_of(slot).load(std::memory_order_relaxed));
    if (owned) {
      fronts_lock all(*this);
      std::optional<deferred_peaks> deferred;  // only when blocks move: it settles every peak
      for (front_slot_type& slot : used_fronts()) {
        if (!unreleased(owner_of(slot).load(std::memory_order_relaxed))) continue;
        slot.owner_gone = true;
        slot.idle_mark = slot.use();
        if (slot.blocks.load(std::memory_order_relaxed) == 0) continue;
        if (!deferred) deferred.emplace(*this);
        for (auto& bin : slot.bins) flush_bin(slot, bin);
      }
    }
    for (stream_state* st : dead_streams_) st->slots_released = true;
    slots_to_release_ = false;
  }

  /// Retires the destroyed streams whose last work has completed (polled, never waited for).
  void retire_finished() {
    for (std::size_t i = 0; i < dead_streams_.size();) {
      stream_state* st = dead_streams_[i];
      if (!finished(*st)) {
        ++i;
        continue;
      }
      dead_streams_[i] = dead_streams_.back();
      dead_streams_.pop_back();
      retire(st);
    }
  }

  /// A destroyed stream's work has completed: its free blocks go to no stream, so any stream may take them at once.
  void retire(stream_state* st) {
    st->retired = true;
    for (auto& index : st->pools) {
      if (!index) continue;
      while (block* b = index->find(1, [](const block*) { return true; })) {
        unindex_free(b);
        recycle_event(std::move(b->fence), device_);  // its work is done, fenced work included
        b->owner = unowned_.get();
        insert_free(b);
      }
    }
  }

  void wait_finished_quietly(const tracker_type& tracker) noexcept {
    if constexpr (tracks_lifetimes) {
      try {
        ops_.wait_finished(tracker);
      } catch (const std::exception& ex) {
        warn(std::string("gpukit: waiting for the work of a destroyed stream failed: ") + ex.what());
      } catch (...) {
        warn("gpukit: waiting for the work of a destroyed stream failed");
      }
    } else {
      (void)tracker;
    }
  }

  /// Waits (lock released) until the work of every destroyed stream has completed, and retires them.
  void wait_for_dead_streams(std::unique_lock<detail::spin_mutex>& lock) {
    if constexpr (tracks_lifetimes) {
      note_expirations();
      if (dead_streams_.empty()) return;
      std::vector<tracker_type> trackers;
      for (const stream_state* st : dead_streams_) trackers.push_back(st->tracker);
      lock.unlock();
      for (const auto& t : trackers) wait_finished_quietly(t);
      lock.lock();
      retire_finished();
    } else {
      (void)lock;
    }
  }

  std::string describe(const stream_state& st) const {
    if constexpr (detail::has_stream_describe<StreamOps>::value) {
      try {
        return ops_.describe(st.stream);
      } catch (...) {
      }
    }
    return "stream " + std::to_string(st.key);
  }

  /// The warning for freeing `b` after its stream was destroyed (a stream must outlive its allocations).
  std::string expired_owner_message(const block* b) const {
    return detail::caching_diagnostics::expired_owner_message(*this, b);
  }

  /// An event of device `d` (an event can be recorded only on streams of its own device): a pooled one, or new.
  std::unique_ptr<event_type> acquire_event(gpukit::device d) {
    if (auto pooled = events_.take(d)) return std::move(*pooled);
    return std::make_unique<event_type>(ops_.create_event(d));
  }

  /// Pools event `e` of device `d` (none: nothing to do).
  void recycle_event(std::unique_ptr<event_type> e, gpukit::device d) noexcept {
    if (e) events_.give(d, std::move(e));
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
    if (std::find(b->recorded.begin(), b->recorded.end(), &st) != b->recorded.end()) return;
    b->recorded.push_back(&st);
    ++st.in_use;
  }

  /// Forgets the streams recorded for `b` (their events, if any, are pending by now).
  void clear_recorded(block* b) noexcept {
    for (stream_state* user : b->recorded) --user->in_use;
    b->recorded.clear();
  }

  /// A null event stands for the last work of a stream destroyed before the free.
  bool record_complete(const stream_state& st, const pending_record& record) const {
    return record.event ? ops_.ready(*record.event) : finished(st);
  }

  /// Moves blocks whose events have completed back to their pools. Events recorded on one stream complete in
  /// order, so each stream's queue is polled only up to its first incomplete event.
  void process_events() {
    for (std::size_t i = 0; i < pending_streams_.size();) {
      stream_state* st = pending_streams_[i];
      while (!st->pending.empty() && record_complete(*st, st->pending.front())) {
        pending_record record = std::move(st->pending.front());
        st->pending.pop_front();
        recycle_event(std::move(record.event), st->device);
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
    if (memory_history* h = history_.load(std::memory_order_acquire)) {
      h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
    }
    count(st_active, b->small, -1);
    count(st_active_bytes, b->small, -as_delta(b->size));
    return_to_pool(b);
  }

  // The heap's side of allocate and deallocate, out of line so that the front caches' path stays small.

  /// A block of `size` bytes (`bytes` asked) from the heap: found free, or a new one from the upstream.
  GPUKIT_DETAIL_NOINLINE void* allocate_from_heap(const stream_type& stream, std::size_t bytes, std::size_t size,
                                                  bool small) {
    block* b;
    {
      std::unique_lock<detail::spin_mutex> lock(mutex_);
      stream_state& st = stream_for(stream);
      st.last_sweep = sweeps_;
      if (pending_total_ != 0) process_events();
      if constexpr (tracks_lifetimes) {
        if (ops_.expirations() != seen_expirations_) {  // one relaxed load when nothing changed
          note_expirations();
        } else if (slots_to_release_) {
          release_slots_of_dead();  // free_allocated found a stream destroyed
        }
        if (!dead_streams_.empty()) retire_finished();
      }
      b = find_free(st, size, small);
      if (b == nullptr && flush_fronts()) b = find_free(st, size, small);  // cached blocks of other sizes
      if (b == nullptr) {
        // The upstream's cudaMalloc (and cudaFree) for this stream, which is not captured, must be neither refused
        // nor invalidate a capture in global mode that another thread has underway.
        detail::relaxed_capture_mode relaxed(device_.is_cuda());
        b = allocate_slow(lock, st, bytes, size, small);
      }
      if (b->seg->expandable) {
        detail::relaxed_capture_mode relaxed(device_.is_cuda());
        b = back_with_pages(lock, st, b, bytes, size, small);
      }
      take(b, st, size, bytes);
    }
    try {
      map_.insert(b->address, b);
    } catch (...) {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      free_allocated(b, false, false);  // never handed out: nothing can use it
      throw;
    }
    if (history_.load(std::memory_order_acquire) != nullptr) note(memory_action::alloc, b);
    return reinterpret_cast<void*>(b->address);
  }

  /// Gives live block `b` (the user freed it) back to the heap; `busy`: its stream may still use it.
  GPUKIT_DETAIL_NOINLINE void free_to_heap(block* b, bool busy, bool expired_owner) {
    void* p = reinterpret_cast<void*>(b->address);
    std::string report;
    if (expired_owner) report = expired_owner_message(b);
    // Two frees of one pointer: the first to take it out of the map frees it.
    if (map_.erase(b->address) != b) throw_not_owned(p, "deallocate");
    {
      std::lock_guard<detail::spin_mutex> lock(mutex_);
      free_allocated(b, busy);
    }
    if (!report.empty()) warn(report);
  }

  // --- statistics and front caches (detail/front_cache.hpp explains the claims) ---

  using front_slot_type = detail::front_slot<block>;
  static_assert(front_slot_type::unowned == no_stream_key, "a slot never owned has the key of no stream");
  /// Slots [0, 16) cache small blocks; with front_cache_large, slots [16, 32) cache large ones (fronts_used_ 32).
  static constexpr std::size_t front_slots_per_pool = detail::front_slots_per_pool;
  static constexpr std::size_t front_slot_count = 2 * front_slots_per_pool;
  /// The slots in use, for range-for.
  template <class Slot>
  struct slot_range {
    Slot* first;
    Slot* last;
    Slot* begin() const noexcept { return first; }
    Slot* end() const noexcept { return last; }
  };
  slot_range<front_slot_type> used_fronts() noexcept { return {fronts_.data(), fronts_.data() + fronts_used_}; }
  slot_range<const front_slot_type> used_fronts() const noexcept {
    return {fronts_.data(), fronts_.data() + fronts_used_};
  }
  bool is_large_slot(const front_slot_type& slot) const noexcept {
    return &slot >= fronts_.data() + front_slots_per_pool;
  }
  /// Slot's part of counter k (the users' view minus the heap's).
  std::int64_t front_value(const front_slot_type& slot, std::size_t k) const noexcept {
    const std::size_t q = quantity_of(k, is_large_slot(slot));
    return q < detail::front_quantity_count ? slot.value(q) : 0;
  }

  /// Marks every slot in use as changing (every slot lock held): lock-free readers of the statistics retry
  /// meanwhile, for changes that move values between the heap and the slots or reset peaks.
  class all_changing {
   public:
    explicit all_changing(basic_caching_allocator& a) noexcept {
      for (std::size_t i = 0; i < a.fronts_used_; ++i) changes_[i].emplace(a.fronts_[i].sequence);
    }

   private:
    std::array<std::optional<detail::sequence_write>, front_slot_count> changes_;
  };

  /// Holds the lock of every front slot in use (in index order; the device lock, when needed, is taken first).
  class fronts_lock {
   public:
    explicit fronts_lock(const basic_caching_allocator& a) noexcept : slots_(a.used_fronts()) {
      for (const auto& s : slots_) s.mutex.lock();
    }
    fronts_lock(const fronts_lock&) = delete;
    fronts_lock& operator=(const fronts_lock&) = delete;
    ~fronts_lock() {
      for (const front_slot_type* s = slots_.last; s != slots_.first;) (--s)->mutex.unlock();
    }

   private:
    slot_range<const front_slot_type> slots_;
  };

  /// Adds `d` to statistic `id` of the heap (device lock held), keeping its peak that of the users' view.
  void count(stat_id id, bool small, std::int64_t d) noexcept {
    detail::atomic_pool_stats& s = stat_ref(id);
    if (!fronts_active_ || !fronted(id)) {
      s.add(small, d);
    } else {
      count_with_fronts(s, id * 3, d);
      count_with_fronts(s, id * 3 + (small ? 1 : 2), d);
    }
  }

  /// The heap's part of counter `k` changes while front caches hold blocks: the peak is that of the sum.
  /// An increase is covered by the peak before it is stored, so lock-free readers never see a value above it.
  void count_with_fronts(detail::atomic_pool_stats& s, std::size_t k, std::int64_t d) noexcept {
    if (d < 0) {
      slack_[k] += -d;
    } else if (!peaks_deferred_) {
      if (slack_[k] >= d) {
        slack_[k] -= d;
      } else {
        fronts_lock all(*this);
        rebalance(k, nullptr, d);
      }
    }
    s.pools[k % 3].add_current(d);
  }

  /// With the device lock and every slot lock held: records the true value of counter `k` in its peak, lets every
  /// slot keep its current value, and takes back claims (others' before `acting`'s) until peak >= heap + claims.
  /// Counters that follow one quantity share the slots' claims for it; taking a claim back for one counter only
  /// leaves more room under the others' peaks.
  /// `pending`: an increase of the heap's part about to be stored, counted as if it were.
  void rebalance(std::size_t k, const front_slot_type* acting, std::int64_t pending = 0) noexcept {
    detail::atomic_stat& g = stat_ref(k / 3).pools[k % 3];
    std::int64_t claimed = g.current.load(std::memory_order_relaxed) + pending;
    std::int64_t value = claimed;
    for (front_slot_type& slot : used_fronts()) {  // the slots whose blocks counter k counts (none for segments)
      const std::size_t q = quantity_of(k, is_large_slot(slot));
      if (q == detail::front_quantity_count) continue;
      value += slot.value(q);
      slot.claim[q] = std::max(slot.claim[q], slot.value(q));
      claimed += slot.claim[q];
    }
    g.raise_peak(value);
    const std::int64_t peak = g.peak.load(std::memory_order_relaxed);
    std::int64_t excess = claimed - peak;
    for (int round = 0; round < 2 && excess > 0; ++round) {
      for (front_slot_type& slot : used_fronts()) {
        const std::size_t q = quantity_of(k, is_large_slot(slot));
        if (q == detail::front_quantity_count || (&slot == acting) == (round == 0)) continue;
        const std::int64_t spare = std::min(excess, slot.claim[q] - slot.value(q));
        slot.claim[q] -= spare;
        excess -= spare;
      }
    }
    slack_[k] = -excess;  // peak - heap - claims, >= 0
  }

  void rebalance_all() noexcept {
    for (std::size_t k = 0; k < counter_count; ++k) {
      if (fronted(k / 3)) rebalance(k, nullptr);
    }
  }

  /// With every lock held, after slot's quantities rose: records the peaks of the counters that rose and resets the
  /// claims (a block left: allocation, active and requested rose; one entered: inactive-split rose).
  void rebalance_risen(const front_slot_type& slot, bool left) noexcept {
    for (std::size_t k = 0; k < counter_count; ++k) {
      const std::size_t q = quantity_of(k, is_large_slot(slot));
      if (q == detail::front_quantity_count) continue;
      const bool split = q == detail::fq_split_blocks || q == detail::fq_split_bytes;
      if (split != left) rebalance(k, &slot);
    }
  }

  /// The `probe`-th slot for stream `key`'s small blocks (or large ones): linear probing from the key's hash. A
  /// stream's slots come before the first slot never owned in its sequence, as owners are never reset to unowned.
  front_slot_type& front_slot_at(std::uintptr_t key, std::size_t probe, bool large) noexcept {
    const std::size_t i = (detail::front_home(key, front_slots_per_pool) + probe) % front_slots_per_pool;
    return fronts_[large ? front_slots_per_pool + i : i];
  }
  /// The key of the stream that owns `slot` (detail::front_owners).
  std::atomic<std::uintptr_t>& owner_of(const front_slot_type& slot) noexcept {
    return front_owners_.key[static_cast<std::size_t>(&slot - fronts_.data())];
  }

  /// A cached block of exactly `size` bytes for the stream `key`, taken for a request of `requested` bytes and put
  /// in the pointer map; nullptr when there is none (the heap then serves the request).
  GPUKIT_DETAIL_FLATTEN block* front_take(std::uintptr_t key, std::size_t size, std::size_t requested, bool large) {
    for (std::size_t probe = 0; probe < front_slots_per_pool; ++probe) {
      front_slot_type& slot = front_slot_at(key, probe, large);
      const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
      if (owner == front_slot_type::unowned) return nullptr;  // hints: a miss only costs the heap's path
      if (owner != key) continue;
      if (slot.blocks.load(std::memory_order_relaxed) == 0) {
        slot.note_miss();  // in use, though empty: not to be taken over
        continue;
      }
      std::unique_lock<detail::spin_mutex> lock(slot.mutex);
      if (slot.blocks.load(std::memory_order_relaxed) == 0 || owner_of(slot).load(std::memory_order_relaxed) != key) {
        continue;
      }
      ++slot.tick;
      auto* bin = slot.find(size);
      if (bin == nullptr) continue;
      block* b = bin->top;
      if (!slot.may_leave(*b, requested)) {
        lock.unlock();
        return front_take_slow(key, size, requested, large);
      }
      return take_cached(slot, *bin, requested, false);
    }
    return nullptr;
  }

  /// Hands out the top block of `bin` (the slot's lock held; every lock when `slow`).
  block* take_cached(front_slot_type& slot, typename front_slot_type::bin& bin, std::size_t requested, bool slow) {
    block* b = bin.top;  // still in the pointer map
    slot.pop(bin);
    detail::sequence_write change(slot.sequence);  // readers see the counts with the peaks that cover them
    slot.leave(*b, requested);
    if (slow) rebalance_risen(slot, true);
    b->requested = requested;
    b->in_front.store(false, std::memory_order_relaxed);
    return b;
  }

  /// Caches `b` in `bin` (the slot's lock held; every lock when `slow`).
  void give_cached(front_slot_type& slot, typename front_slot_type::bin& bin, block* b, bool slow) noexcept {
    // Recorded under the slot's lock: no other thread can take the block (and record its alloc) before this free.
    if (history_.load(std::memory_order_acquire) != nullptr) note_cached_free(b);
    detail::sequence_write change(slot.sequence);
    slot.enter(*b);
    if (slow) rebalance_risen(slot, false);
    std::atomic<std::uintptr_t>& owner = owner_of(slot);
    if (owner.load(std::memory_order_relaxed) != b->owner->key) {
      owner.store(b->owner->key, std::memory_order_relaxed);
      slot.owner_gone = false;
    }
    slot.push(bin, b);
    b->in_front.store(true, std::memory_order_relaxed);
  }

  GPUKIT_DETAIL_NOINLINE block* front_take_slow(std::uintptr_t key, std::size_t size, std::size_t requested,
                                                bool large) {
    std::lock_guard<detail::spin_mutex> device_lock(mutex_);
    fronts_lock all(*this);
    for (std::size_t probe = 0; probe < front_slots_per_pool; ++probe) {
      front_slot_type& slot = front_slot_at(key, probe, large);
      const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
      if (owner == front_slot_type::unowned) return nullptr;
      if (slot.blocks.load(std::memory_order_relaxed) == 0 || owner != key) continue;
      auto* bin = slot.find(size);
      if (bin != nullptr) return take_cached(slot, *bin, requested, true);
    }
    return nullptr;
  }

  enum class front_result { cached, no_room, already_free };

  /// Caches block `b` (freed by the user on its own live stream, recorded by no other) in its stream's front slot.
  /// no_room when the slot is taken by another stream, or full and nothing in it is stale, or the stream was
  /// destroyed meanwhile (the heap then takes the block); already_free when another free of the same pointer cached
  /// it first. Throws only when a stale bin's blocks cannot go back to the heap (see flush_bin): `b` is still
  /// allocated then.
  GPUKIT_DETAIL_FLATTEN front_result front_give(block* b) {
    const std::uintptr_t key = b->owner->key;
    constexpr std::uintptr_t unowned = front_slot_type::unowned;
    if (key == unowned) return front_result::no_room;  // no stream has it (see front_slot::unowned)
    const bool large = !b->small;
    // Pass 0: the stream's own slot (before the first slot never owned); pass 1: a slot never owned; pass 2 (all
    // slots owned by other streams): one whose owner went idle, among the first few, so that with more busy streams
    // than slots a free without a slot locks only a few others' slots. Reads without the lock are hints, checked
    // under it. A slot changes hands only on the slow path, with every lock held, which looks for the stream's own
    // slot first: two threads freeing on one stream at once, each in pass 1, would otherwise claim a slot each.
    constexpr std::size_t takeover_probes = 4;
    for (int pass = 0; pass < 3; ++pass) {
      for (std::size_t probe = 0; probe < (pass == 2 ? takeover_probes : front_slots_per_pool); ++probe) {
        front_slot_type& slot = front_slot_at(key, probe, large);
        const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
        if (pass == 0 && owner == unowned) break;
        if (owner != (pass == 0 ? key : unowned) && pass != 2) continue;
        if (pass == 2 && (owner == key || owner == unowned || slot.blocks.load(std::memory_order_relaxed) != 0)) {
          continue;
        }
        std::unique_lock<detail::spin_mutex> lock(slot.mutex);
        const std::uintptr_t now = owner_of(slot).load(std::memory_order_relaxed);
        if (pass == 0) {
          if (now != key) continue;
          return front_give_to(slot, lock, b);
        }
        if (pass == 2 ? !slot.may_take_over(key, now) : now != unowned) continue;
        const slot_seen seen = seen_by_fast_path(slot);
        lock.unlock();
        return front_give_slow(b, slot, seen);
      }
    }
    return front_result::no_room;
  }

  /// front_give's work once it holds the lock of stream `b->owner`'s own slot.
  GPUKIT_DETAIL_FLATTEN front_result front_give_to(front_slot_type& slot, std::unique_lock<detail::spin_mutex>& lock,
                                                   block* b) {
    if (b->in_front.load(std::memory_order_relaxed)) return front_result::already_free;
    // Destroyed since deallocate asked, and the slot already emptied (release_slots_of_dead): the block would hold
    // it for a stream that never asks again. A flag on the slot's own line: asking the stream cost the pair 10 %.
    if (slot.owner_gone) return front_result::no_room;
    ++slot.tick;
    auto* bin = slot.room_for(b->size);
    if (bin == nullptr) {
      if (slot.stale_bin(b->size) == nullptr) return front_result::no_room;
      const slot_seen seen = seen_by_fast_path(slot);
      lock.unlock();
      return front_give_slow(b, slot, seen);  // a bin of sizes no longer used gives way
    }
    if (!fronts_active_ || !slot.may_enter(*b)) {
      const slot_seen seen = seen_by_fast_path(slot);
      lock.unlock();
      return front_give_slow(b, slot, seen);
    }
    give_cached(slot, *bin, b, false);
    return front_result::cached;
  }

  /// A slot's owner and use() as front_give_to saw them under the slot's lock, before it went the slow way.
  struct slot_seen {
    std::uintptr_t owner;
    std::uint64_t use;
  };
  slot_seen seen_by_fast_path(front_slot_type& slot) noexcept {
    return {owner_of(slot).load(std::memory_order_relaxed), slot.use()};
  }

  /// front_give with every lock held, for `chosen`, the slot front_give picked, or, when it no longer may be used
  /// (it changed hands, or its owner used it, since front_give_to saw it as `seen`), the stream's own slot or one
  /// never owned.
  GPUKIT_DETAIL_NOINLINE front_result front_give_slow(block* b, front_slot_type& chosen, slot_seen seen) {
    std::lock_guard<detail::spin_mutex> device_lock(mutex_);
    fronts_lock all(*this);
    if (b->in_front.load(std::memory_order_relaxed)) return front_result::already_free;
    if (owner_expired(b)) return front_result::no_room;  // as in front_give_to
    if (!fronts_active_) {
      // From now on the heap's counters alone no longer give the peaks: start the claims at zero.
      fronts_active_ = true;
      rebalance_all();
    }
    const std::uintptr_t key = b->owner->key;
    constexpr std::uintptr_t unowned = front_slot_type::unowned;
    // The stream's own slot first (another thread of it may have claimed one since front_give looked), then
    // `chosen`, then the first slot never owned. Another stream's slot is taken over only as front_give's pass 2
    // decided (empty, and unused since another stream last asked): not if it changed hands or was used since.
    front_slot_type* found = nullptr;
    front_slot_type* first_unowned = nullptr;
    for (std::size_t probe = 0; probe < front_slots_per_pool && first_unowned == nullptr; ++probe) {
      front_slot_type& slot = front_slot_at(key, probe, !b->small);
      const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
      if (owner == key) {
        found = &slot;
        break;
      }
      if (owner == unowned) first_unowned = &slot;  // a stream's slots come before it (see front_slot_at)
    }
    const std::uintptr_t chosen_owner = owner_of(chosen).load(std::memory_order_relaxed);
    const bool unchanged = chosen_owner == seen.owner && chosen.use() == seen.use;
    if (found == nullptr && chosen_owner != unowned && unchanged &&
        chosen.blocks.load(std::memory_order_relaxed) == 0) {
      found = &chosen;
    }
    if (found == nullptr) found = first_unowned;  // `chosen` when front_give found it never owned
    if (found != nullptr) {
      front_slot_type& slot = *found;
      auto* bin = slot.room_for(b->size);
      if (bin == nullptr) {
        bin = slot.stale_bin(b->size);
        if (bin == nullptr) return front_result::no_room;
        deferred_peaks deferred(*this);
        flush_bin(slot, *bin);
      }
      give_cached(slot, *bin, b, true);
      return front_result::cached;
    }
    return front_result::no_room;
  }

  /// While it lives, the heap's counters fall as the slots' rise (blocks move from the front caches to the heap):
  /// only the end result is a value, so peaks are recorded once, at the end (every lock held).
  /// Lock-free readers (consistent_read) wait meanwhile: every slot's sequence is odd.
  class deferred_peaks {
   public:
    explicit deferred_peaks(basic_caching_allocator& a) noexcept : a_(a), changes_(a) { a_.peaks_deferred_ = true; }
    deferred_peaks(const deferred_peaks&) = delete;
    deferred_peaks& operator=(const deferred_peaks&) = delete;
    ~deferred_peaks() {
      a_.peaks_deferred_ = false;
      a_.rebalance_all();
    }

   private:
    basic_caching_allocator& a_;
    all_changing changes_;
  };

  /// Takes the blocks of one bin back into the heap (the device lock and every slot lock held, peaks deferred).
  /// Throws only when freeing a block does (an event could not be recorded): that block stays cached.
  void flush_bin(front_slot_type& slot, typename front_slot_type::bin& bin) {
    while (bin.count != 0) {
      block* b = slot.pop(bin);
      map_.erase(b->address);  // a cached block stays in the map (marked) until the heap takes it
      b->in_front.store(false, std::memory_order_release);  // after the erase: see live_block
      // The user's free was counted when the block entered the cache; the heap's free below counts it again.
      slot.unwind(*b);
      try {
        free_allocated(b, false, false);  // cached only when it needed no fence; its free is already recorded
      } catch (...) {
        // free_allocated put it back in the map as allocated: it is cached again instead.
        slot.enter(*b);
        slot.push(bin, b);
        b->in_front.store(true, std::memory_order_relaxed);
        throw;
      }
    }
  }

  /// Takes every cached block back into the heap (device lock held), so it can coalesce, serve other sizes and be
  /// released. Returns whether there were any. Throws only when freeing a block does (an event could not be
  /// recorded): that block stays cached.
  bool flush_fronts(bool large_only = false) {
    if (!fronts_active_) return false;
    bool any = false;
    fronts_lock all(*this);
    deferred_peaks deferred(*this);
    for (front_slot_type& slot : used_fronts()) {
      if (slot.blocks.load(std::memory_order_relaxed) == 0 || (large_only && !is_large_slot(slot))) continue;
      for (auto& bin : slot.bins) {
        any = any || bin.count != 0;
        flush_bin(slot, bin);
      }
    }
    return any;
  }

  // --- blocks ---

  /// Records the free of a block entering a front cache: requested, and completed at once (reusable on its stream).
  GPUKIT_DETAIL_NOINLINE void note_cached_free(const block* b) const noexcept {
    if (memory_history* h = history_.load(std::memory_order_acquire)) {
      h->record(memory_action::free_requested, b->address, b->requested, b->owner->key);
      h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
    }
  }

  /// Records an allocation just handed out (only called while a history is set).
  GPUKIT_DETAIL_NOINLINE void note(memory_action action, const block* b) const noexcept {
    if (memory_history* h = history_.load(std::memory_order_acquire)) {
      h->record(action, b->address, b->requested, b->owner->key);
    }
  }

  /// The block of the live allocation at `address`, or nullptr (never allocated, freed, or cached in front: a
  /// cached block stays in the map, marked, so that its next allocation and free skip the map). No lock taken.
  /// A flush (another thread) may take a cached block to the heap between the lookup and the look at its mark: it
  /// erases the block from the map before clearing the mark (release), so a cleared mark seen here (acquire) with
  /// the shard changed since the lookup sends us to the map again. Without that, a second free ordered after the
  /// first could cache a block the heap holds (found by review; test "a double free racing with a flush").
  block* live_block(std::uintptr_t address) const noexcept {
    typename map_type::version_type version = 0;
    block* b = map_.find(address, version);
    if (b == nullptr || b->in_front.load(std::memory_order_acquire)) return nullptr;
    if (!map_.unchanged(address, version) && map_.find(address) != b) return nullptr;
    return b;
  }

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
    b->taken_split = false;
    b->in_front.store(false, std::memory_order_relaxed);
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
      count(st_inactive_split, b->small, 1);
      count(st_inactive_split_bytes, b->small, as_delta(b->size));
    }
  }

  void unindex_free(block* b) noexcept {
    b->owner->pools[b->small ? 1 : 0]->remove(b);
    if (is_split(b)) {
      count(st_inactive_split, b->small, -1);
      count(st_inactive_split_bytes, b->small, -as_delta(b->size));
    }
  }

  /// Keeps the later of two fences of the same stream (its work includes the earlier one's).
  void absorb_fence(block* into, block* from) noexcept {
    if (!from->fence) return;
    if (!into->fence || from->fence_sequence > into->fence_sequence) {
      std::swap(into->fence, from->fence);
      into->fence_sequence = from->fence_sequence;
    }
    recycle_event(std::move(from->fence), device_);
  }

  /// A freed block (no longer allocated or pending) joins its pool. Its stream's, unless that stream was destroyed
  /// and its work has completed: then no stream's.
  void return_to_pool(block* b) {
    b->state = block_state::free;
    b->requested = 0;
    clear_recorded(b);
    --b->owner->in_use;
    if (b->owner->retired) {
      recycle_event(std::move(b->fence), device_);
      b->owner = unowned_.get();
    }
    insert_free(b);
  }

  /// Free neighbour `n` can join a free block of `owner`: it is that stream's too, or no stream's (unused by all).
  bool joinable(const block* n, const stream_state* owner) const noexcept {
    return n != nullptr && n->state == block_state::free && (n->owner == owner || n->owner == unowned_.get());
  }

  /// Indexes free block `b` in its stream's pool, joined with its joinable free neighbours. A neighbour of no stream
  /// may itself border a free block of b's stream, hence the loops (two steps at most each way).
  void insert_free(block* b) {
    stream_state* const owner = b->owner;
    for (block* p = b->prev; joinable(p, owner); p = b->prev) {
      unindex_free(p);
      p->size += b->size;
      p->next = b->next;
      if (b->next != nullptr) b->next->prev = p;
      p->owner = owner;
      absorb_fence(p, b);
      recycle(b);
      b = p;
    }
    for (block* n = b->next; joinable(n, owner); n = b->next) {
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
    // Blocks of destroyed streams whose work has completed: no stream can still be using them.
    if (const auto& index = unowned_->pools[pool]; index && !index->empty()) {
      if (block* b = index->find(size, accept)) return b;
    }
    if (!options_.cross_stream_reuse) return nullptr;
    for (const auto& other : streams_) {
      if (other.get() == &st || other->dead) continue;  // a destroyed stream's blocks wait for its last work
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
      recycle_event(std::move(fence), device_);
    }
    b->owner = &st;
    ++st.in_use;
    b->state = block_state::allocated;
    b->requested = requested;
    b->taken_split = is_split(b);
    count(st_allocation, b->small, 1);
    count(st_allocated_bytes, b->small, as_delta(b->size));
    count(st_active, b->small, 1);
    count(st_active_bytes, b->small, as_delta(b->size));
    count(st_requested_bytes, b->small, as_delta(requested));
  }

  /// Frees an allocated block that is no longer in the pointer map. Events are recorded before any state changes,
  /// so if recording throws the block is put back as it was and the exception propagates.
  /// A destroyed stream gets no more events (its handle may be another stream's by now): its blocks wait for its
  /// final work instead (retire).
  bool owner_may_be_busy(const block* b) const {
    return needs_fence_ && !owner_expired(b) && ops_.may_have_pending_work(b->owner->stream);
  }

  /// `owner_busy` says whether the owner stream may still have work using the block (asked before the lock is
  /// taken: on a CPU stream the question takes the queue's own lock).
  /// `user_free`: the user freed it (recorded in the history); false for blocks the heap takes back from a front
  /// cache (their free was recorded when they were cached) and for blocks never handed out.
  void free_allocated(block* b, bool owner_busy, bool user_free = true) {
    std::unique_ptr<event_type> fence;
    std::vector<std::pair<stream_state*, std::unique_ptr<event_type>>> uses;
    try {
      if constexpr (tracks_lifetimes) {
        // Destroyed, but not yet noted (the expiration count was read before it changed): from now on no other
        // stream may take its blocks before its last work completes.
        stream_state* owner = b->owner;
        if (!owner->dead && expired(*owner)) {
          dead_streams_.push_back(owner);
          owner->dead = true;
          slots_to_release_ = true;  // not here: this may run under the slot locks (flush_bin)
        }
      }
      // A stream destroyed since the caller asked whether it was busy takes no event (its handle may be another
      // stream's by now): its blocks wait for its last work (retire) instead.
      if (owner_busy && !b->owner->dead) {
        fence = acquire_event(device_);
        ops_.record(*fence, b->owner->stream);
      }
      for (stream_state* user : b->recorded) {
        if (expired(*user)) {
          // Destroyed since: no event can be recorded on it; its last work is waited for instead (null event).
          if (!finished(*user)) uses.emplace_back(user, nullptr);
          continue;
        }
        uses.emplace_back(user, acquire_event(user->device));
        if (user->device == device_) {
          ops_.record(*uses.back().second, user->stream);
        } else {
          device_guard guard(user->device);  // a peer device's event, recorded with that device current
          ops_.record(*uses.back().second, user->stream);
        }
      }
      if (!uses.empty()) pending_streams_.reserve(pending_streams_.size() + uses.size());
    } catch (...) {
      recycle_event(std::move(fence), device_);
      for (auto& use : uses) recycle_event(std::move(use.second), use.first->device);
      map_.restore(b->address, b);  // still allocated (cannot throw: no growth)
      throw;
    }
    if (fence) {
      b->fence = std::move(fence);
      b->fence_sequence = ++fence_counter_;
    }
    memory_history* const h = user_free ? history_.load(std::memory_order_acquire) : nullptr;
    if (h != nullptr) h->record(memory_action::free_requested, b->address, b->requested, b->owner->key);
    count(st_allocation, b->small, -1);
    count(st_allocated_bytes, b->small, -as_delta(b->size));
    count(st_requested_bytes, b->small, -as_delta(b->requested));
    clear_recorded(b);  // the users' pending events (below) keep their states alive
    if (uses.empty()) {
      if (h != nullptr) h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
      count(st_active, b->small, -1);
      count(st_active_bytes, b->small, -as_delta(b->size));
      return_to_pool(b);
      return;
    }
    b->state = block_state::pending;  // keeps `requested` for the history's free_completed
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
    limit_hit = false;  // the last refusal, if any, is the upstream's
    in_flight_ += segment_bytes;
    lock.unlock();
    void* p = nullptr;
    try {
      p = upstream_.allocate(segment_bytes);
    } catch (const out_of_memory_error&) {
      p = nullptr;  // the upstream contract's other way to refuse (the pinned pool's upstreams throw)
    } catch (...) {
      lock.lock();
      in_flight_ -= segment_bytes;
      throw;
    }
    lock.lock();
    in_flight_ -= segment_bytes;
    if (p == nullptr) return nullptr;
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
    seg->dedicated = !small && size >= options_.medium_size;
    link_segment(std::move(seg), b, reinterpret_cast<std::uintptr_t>(p), segment_bytes, small);
    count(st_reserved_bytes, small, as_delta(segment_bytes));
    stats_.num_device_alloc.increment();
    high_water_ = std::max(high_water_, current(stats_.reserved_bytes));
    return b;
  }

  /// Adds a new segment of `bytes` at `address` to the list, as one free block `b` (whose pool index exists).
  void link_segment(std::unique_ptr<segment> seg, block* b, std::uintptr_t address, std::size_t bytes, bool small) {
    seg->address = address;
    seg->size = bytes;
    seg->small = small;
    seg->first = b;
    seg->next_segment = segments_;
    if (segments_ != nullptr) segments_->prev_segment = seg.get();
    segments_ = seg.release();
    b->address = address;
    b->size = bytes;
    b->seg = segments_;
    b->state = block_state::free;
    index_free(b);
    count(st_segment, small, 1);
    // An expandable segment's reserved range is no memory yet: its pages are recorded as they are mapped.
    if (memory_history* h = history_.load(std::memory_order_acquire); h != nullptr && !segments_->expandable) {
      h->record(memory_action::segment_alloc, address, bytes, 0);
    }
  }

  // --- expandable segments (virtual memory) ---

  /// With expandable segments, the free block of `st`'s expandable segment of the pool that holds `size` bytes,
  /// reserving that segment first if `st` has none (no memory yet: pages are mapped when a block is taken). Null
  /// when expandable segments are off, the address space is exhausted, or the request exceeds the range.
  block* grow_expandable(stream_state& st, std::size_t size, bool small) {
    if constexpr (has_vm) {
      if (!options_.expandable_segments || st.expandable[small ? 1 : 0] != nullptr || vm_refused_) return nullptr;
      if constexpr (detail::has_virtual_memory_query<Upstream>::value) {
        if (!upstream_.virtual_memory_supported()) {
          vm_refused_ = true;
          warn("gpukit: expandable segments were asked for the caching allocator of " + device_.to_string() +
               ", but the device (or its driver) has no virtual memory management: ordinary segments are used");
          return nullptr;
        }
      }
      const std::size_t page = upstream_.page_size();
      upstream_memory_info info;
      try {
        info = upstream_.memory_info();
      } catch (...) {
      }
      if (!info.known || info.total_bytes == 0 || page == 0) return nullptr;
      // Four times the device's memory (at most 4 TiB): holes left by freed blocks use address space too, and
      // address space is plentiful (2^47 bytes and more on GPUs).
      const std::size_t limit = std::size_t{1} << 42;
      const std::size_t total = std::min(info.total_bytes, limit / 4);
      const std::size_t range = (4 * total + page - 1) / page * page;
      if (range < size) return nullptr;
      auto seg = std::make_unique<segment>();
      block* b = new_block();
      b->owner = &st;
      b->small = small;
      try {
        seg->pages = detail::page_map(range / page, page);
        (void)index_of(b);
      } catch (...) {
        recycle(b);
        throw;
      }
      void* p = upstream_.reserve(range);
      if (p == nullptr) {
        recycle(b);
        return nullptr;
      }
      seg->expandable = true;
      link_segment(std::move(seg), b, reinterpret_cast<std::uintptr_t>(p), range, small);
      address_space_.store(address_space_.load(std::memory_order_relaxed) + range, std::memory_order_relaxed);
      st.expandable[small ? 1 : 0] = segments_;
      return find_free(st, size, small);
    } else {
      (void)st;
      (void)size;
      (void)small;
      return nullptr;
    }
  }

  /// Maps the unmapped pages under the first `size` bytes of free block `b` of an expandable segment. False when
  /// the reserved limit (`limit_hit`) or the upstream refuses a page; the pages mapped so far stay (cached memory).
  bool map_pages(block* b, std::size_t size, bool& limit_hit) {
    if constexpr (has_vm) {
      segment* seg = b->seg;
      const std::size_t page = seg->pages.page_size();
      const auto touched = seg->pages.touched_by(b->address - seg->address, size);
      for (std::size_t i = touched.first; i < touched.end; ++i) {
        if (seg->pages.is_mapped(i)) continue;
        if (!within_limit(page)) {
          limit_hit = true;
          return false;
        }
        limit_hit = false;
        if (!upstream_.map(reinterpret_cast<void*>(seg->address + i * page), page)) return false;
        if (memory_history* h = history_.load(std::memory_order_acquire)) {
          h->record(memory_action::segment_map, seg->address + i * page, page, 0);
        }
        seg->pages.set_mapped(i);
        count(st_reserved_bytes, seg->small, as_delta(page));
        stats_.num_device_alloc.increment();
        high_water_ = std::max(high_water_, current(stats_.reserved_bytes));
      }
      return true;
    } else {
      (void)b;
      (void)size;
      (void)limit_hit;
      return true;
    }
  }

  /// Makes free block `b` of an expandable segment usable for `size` bytes: maps its pages, and under pressure
  /// releases cached memory (free pages included) and looks again, like allocate_slow. Returns the block to take.
  block* back_with_pages(std::unique_lock<detail::spin_mutex>& lock, stream_state& st, block* b, std::size_t requested,
                         std::size_t size, bool small) {
    // Mapping pages grows the footprint: as before a new segment, cached large blocks go back to the heap first, so
    // that one of them (coalesced with its free neighbours) can serve the request with pages already mapped; else
    // each size would keep its own pages mapped in its bin (found by review: 304 MiB reserved against 160). Small
    // blocks stay cached: they hold little of a 2 MiB page, and taking them back at every page moved the minimum
    // capacity of the small transformer traces the wrong way (bench_fragmentation, L2 h256: 1.054 to 1.069).
    if (front_cache_large_ && needs_pages(b, size) && flush_fronts(true)) {
      b = find_free(st, size, small);  // the flush may have merged `b` away
      if (b == nullptr) b = allocate_slow(lock, st, requested, size, small);
      if (!b->seg->expandable) return b;
    }
    bool limit_hit = false;
    if (map_pages(b, size, limit_hit)) return b;
    for (const bool wait_pending : {false, true}) {
      release_cached(lock, wait_pending, 0);
      stats_.num_alloc_retries.increment();
      b = find_free(st, size, small);
      if (b == nullptr) b = allocate_slow(lock, st, requested, size, small);
      if (!b->seg->expandable || map_pages(b, size, limit_hit)) return b;
    }
    throw_out_of_memory(lock, requested, size, b->seg->pages.page_size(), limit_hit, true);
  }

  /// Whether the first `size` bytes of free block `b` of an expandable segment have a page not mapped yet.
  bool needs_pages(const block* b, std::size_t size) const noexcept {
    const detail::page_map& pages = b->seg->pages;
    return pages.any_unmapped(pages.touched_by(b->address - b->seg->address, size));
  }

  /// Unmaps the pages of expandable segments that lie wholly in free blocks (device lock held throughout, so no
  /// thread maps them meanwhile), until reserved memory is at most `target` (0: all). Waits for the fences of those
  /// blocks first: work enqueued before their free may still use them. Returns the bytes unmapped.
  std::size_t unmap_free_pages(std::size_t target) {
    if constexpr (has_vm) {
      if (!options_.expandable_segments) return 0;
      const bool quarantine = !upstream_.synchronizes_on_free();
      std::size_t unmapped = 0;
      for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
        if (!seg->expandable || seg->mapped() == 0) continue;
        const std::size_t page = seg->pages.page_size();
        for (block* b = seg->first; b != nullptr; b = b->next) {
          if (target != 0 && current(stats_.reserved_bytes) <= target) return unmapped;
          if (b->state != block_state::free || (quarantine && b->owner->dead)) continue;
          const auto inside = seg->pages.inside(b->address - seg->address, b->size);
          for (std::size_t i = inside.first; i < inside.end;) {
            if (!seg->pages.is_mapped(i)) {
              ++i;
              continue;
            }
            if (b->fence) {
              synchronize_quietly(*b->fence);
              recycle_event(std::move(b->fence), device_);
            }
            const std::size_t run = unmap_run(seg, i, inside.end);
            if (run == 0) return unmapped;  // the device could not be waited for: nothing more is unmapped now
            unmapped += run * page;
            count(st_reserved_bytes, seg->small, -as_delta(run * page));
            i += run;
          }
        }
      }
      return unmapped;
    } else {
      (void)target;
      return 0;
    }
  }

  /// Unmaps the run of mapped pages of `seg` that starts at page `i` (and ends at `end` at most) in one upstream call
  /// (on CUDA, one device synchronization); counts one upstream free per page. Returns the pages unmapped: 0 when
  /// the upstream kept them mapped (it could not wait for the device). Device lock held: no thread maps them meanwhile.
  std::size_t unmap_run(segment* seg, std::size_t i, std::size_t end) noexcept {
    const std::size_t page = seg->pages.page_size();
    const std::size_t n = seg->pages.mapped_run(i, end);
    if (n == 0 || !upstream_unmap(seg->address + i * page, n * page)) return 0;
    seg->pages.set_unmapped({i, i + n});
    if (memory_history* h = history_.load(std::memory_order_acquire); h != nullptr) {
      h->record(memory_action::segment_unmap, seg->address + i * page, n * page, 0);
    }
    for (std::size_t k = 0; k < n; ++k) stats_.num_device_free.increment();
    return n;
  }

  /// The upstream's unmap; false when it unmapped nothing (an upstream whose unmap returns void always unmaps).
  bool upstream_unmap(std::uintptr_t address, std::size_t bytes) noexcept {
    if constexpr (has_vm) {
      if constexpr (std::is_same_v<decltype(upstream_.unmap(nullptr, bytes)), bool>) {
        return upstream_.unmap(reinterpret_cast<void*>(address), bytes);
      } else {
        upstream_.unmap(reinterpret_cast<void*>(address), bytes);
        return true;
      }
    } else {
      (void)address;
      (void)bytes;
      return false;
    }
  }

  /// An expandable segment is going: its stream reserves a new one when it needs it.
  void forget_expandable(const segment* seg) noexcept {
    auto forget = [seg](stream_state& st) {
      for (segment*& e : st.expandable) {
        if (e == seg) e = nullptr;
      }
    };
    for (auto& st : streams_) forget(*st);
    forget(*unowned_);
  }

  /// Calls f(address, bytes) for each run of mapped pages of an expandable segment, in address order.
  template <class F>
  void for_each_mapped_run(const segment& seg, F&& f) const {
    seg.pages.for_each_mapped_run([&](std::size_t offset, std::size_t bytes) { f(seg.address + offset, bytes); });
  }

  /// A stream-ordered release (an upstream with deallocate_after): an event recorded on each stream that may still
  /// use the segment, so that the upstream gives it back once they complete, with no wait on the host (cudaFree and
  /// the other upstreams wait for the whole device). `possible` is false when that cannot be told (then the
  /// upstream's deallocate is used).
  struct ordered_release {
    bool possible = false;
    std::vector<std::unique_ptr<event_type>> after;
  };

  /// The events segment `seg` (all free, not expandable) is given back after (device lock held, before its blocks are
  /// recycled): one on each stream that owns a block of it. A free block's stream is the only one whose work may use
  /// it (others' uses were recorded, and were waited for before the block became free), and only work queued before
  /// now. Only streams known to be alive are recorded on: gpukit streams (tracked), checked before and after the
  /// record, since a destroyed stream's handle may already be another's. Not possible, so the upstream's deallocate
  /// (which waits for the device) is used, with:
  /// - a raw handle (it may have been destroyed and its handle reused, which the allocator cannot see);
  /// - a default stream: an event on the legacy stream (also how another thread's per-thread stream is reached)
  ///   would invalidate a capture of any blocking stream of the device;
  /// - a destroyed stream whose work may run, a captured stream (the event would be the graph's), a failed record.
  ordered_release order_release(const segment& seg) noexcept {
    ordered_release o;
    if constexpr (detail::has_ordered_release<Upstream, event_type>::value && tracks_lifetimes) {
      if (seg.expandable) return o;
      std::vector<const stream_state*> owners;
      const auto alive = [this](const stream_state* owner) {
        return owner->tracker && !owner->dead && !ops_.expired(owner->tracker);
      };
      bool orderable = true;
      try {
        for (const block* b = seg.first; b != nullptr; b = b->next) {
          const stream_state* owner = b->owner;
          if (owner == unowned_.get() || owner->retired) continue;  // no work of any stream can still use it
          if (!alive(owner)) return o;
          if (std::find(owners.begin(), owners.end(), owner) == owners.end()) owners.push_back(owner);
        }
        for (const stream_state* owner : owners) {
          auto e = acquire_event(device_);
          ops_.record(*e, owner->stream);  // refuses a captured stream
          o.after.push_back(std::move(e));
        }
        // Destroyed (its handle maybe reused) or captured since it was asked: the events may be on the wrong work.
        for (const stream_state* owner : owners) {
          bool captured = false;
          if constexpr (detail::has_capture_query<StreamOps>::value) captured = ops_.capturing(owner->stream);
          orderable = orderable && alive(owner) && !captured;
        }
      } catch (...) {  // no memory, no event, or a captured stream
        orderable = false;
      }
      if (!orderable) {  // the upstream's deallocate (which waits) instead
        for (auto& e : o.after) recycle_event(std::move(e), device_);
        o.after.clear();
        return o;
      }
      o.possible = true;
    } else {
      (void)seg;
    }
    return o;
  }

  /// Gives a whole (not expandable) segment back in stream order, after the events of `ordered`; false when that is
  /// not possible or the upstream refused (nothing was done: the caller deallocates, which waits).
  bool deallocate_in_order(const segment* seg, const ordered_release& ordered) noexcept {
    if constexpr (detail::has_ordered_release<Upstream, event_type>::value) {
      if (!ordered.possible) return false;
      std::vector<const event_type*> after;
      try {
        after.reserve(ordered.after.size());
      } catch (...) {
        return false;  // no memory for the list
      }
      for (const auto& e : ordered.after) after.push_back(e.get());
      return upstream_.deallocate_after(reinterpret_cast<void*>(seg->address), seg->size, after);
    } else {
      (void)seg;
      (void)ordered;
      return false;
    }
  }

  /// Returns a segment's memory to the upstream (lock released): in stream order when `ordered` allows it, else
  /// cudaFree (or the upstream's deallocate), or unmap and unreserve.
  void return_segment(segment* seg, const ordered_release& ordered = {}) noexcept {
    memory_history* const h = history_.load(std::memory_order_acquire);
    if constexpr (has_vm) {
      if (seg->expandable) {
        bool all_unmapped = true;
        for_each_mapped_run(*seg, [&](std::uintptr_t address, std::size_t bytes) {
          if (h != nullptr) h->record(memory_action::segment_unmap, address, bytes, 0);
          all_unmapped = all_unmapped && upstream_unmap(address, bytes);
        });
        if (all_unmapped) {
          upstream_.unreserve(reinterpret_cast<void*>(seg->address), seg->size);
        } else {  // pages the device may still use stay mapped: the range is kept (leaked), as after a failed cudaFree
          try {
            warn("gpukit: the caching allocator of " + device_.to_string() + " keeps an expandable segment of " +
                 std::to_string(seg->size) + " bytes reserved: its pages could not be unmapped");
          } catch (...) {  // no memory for the message
          }
        }
        return;
      }
    }
    // Recorded before the upstream call (this runs without the lock): once freed, the memory may be another
    // thread's new segment, whose segment_alloc must come after this.
    if (h != nullptr) h->record(memory_action::segment_free, seg->address, seg->size, 0);
    if (!deallocate_in_order(seg, ordered)) upstream_.deallocate(reinterpret_cast<void*>(seg->address), seg->size);
  }

  block* allocate_slow(std::unique_lock<detail::spin_mutex>& lock, stream_state& st, std::size_t requested,
                       std::size_t size, bool small) {
    if (block* b = grow_expandable(st, size, small)) return b;
    std::size_t segment_bytes = fitted_segment_size(size, small);
    bool limit_hit = false;
    if (options_.release_before_grow) {
      const std::size_t reserved = current(stats_.reserved_bytes) + in_flight_;
      const std::size_t room = high_water_ > reserved ? high_water_ - reserved : 0;
      if (segment_bytes > room && release_for_growth(lock, segment_bytes - room) > 0) {
        if (block* b = find_free(st, size, small)) return b;  // freed by another thread meanwhile
      }
    }
    if (release_abandoned(lock) > 0) {
      if (block* b = find_free(st, size, small)) return b;
    }
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    // The upstream (or the limit) refused. Other threads may have freed memory while the lock was released.
    if (block* b = find_free(st, size, small)) return b;
    // First retry: give back the free segments (waiting only for fences of work that may still use them). The
    // segment is sized again: it grows with reserved memory, which just shrank.
    if (release_cached(lock, false, 0) > 0) {
      stats_.num_alloc_retries.increment();
      if (block* b = find_free(st, size, small)) return b;
      segment_bytes = fitted_segment_size(size, small);
      if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    }
    // Last retry, always made (the failure may have been transient): wait for blocks that other streams still
    // use, give back everything free, and try once more.
    release_cached(lock, true, 0);
    stats_.num_alloc_retries.increment();
    if (block* b = find_free(st, size, small)) return b;
    segment_bytes = fitted_segment_size(size, small);
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    // A shared segment sized for the footprint may not fit where the request does: the smallest ones that hold it,
    // first a few such requests with nothing lost to rounding (two of 5 MiB: 10 MiB), then the request alone.
    for (const std::size_t smaller : {detail::segment_sizing::unrounded(options_, size, small),
                                      detail::segment_sizing::minimal(options_, size, small)}) {
      if (smaller >= segment_bytes) continue;
      segment_bytes = smaller;
      if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    }
    throw_out_of_memory(lock, requested, size, segment_bytes, limit_hit);
  }

  /// Returns completely free segments to the upstream (largest first, until reserved <= target; all when target
  /// is 0). With `wait_pending`, first waits on the host for every pending event, so blocks held back by other
  /// streams become free too. Returns the bytes released. The lock is released while waiting and freeing.
  std::size_t release_cached(std::unique_lock<detail::spin_mutex>& lock, bool wait_pending, std::size_t target) {
    flush_fronts();
    if (wait_pending) {
      wait_for_pending_events(lock);
      wait_for_dead_streams(lock);
    }
    std::vector<segment*> victims = free_segments();
    if (target != 0) {
      std::sort(victims.begin(), victims.end(),
                [](const segment* a, const segment* b) { return a->mapped() > b->mapped(); });
      std::size_t reserved = current(stats_.reserved_bytes);
      std::size_t keep = 0;
      while (keep < victims.size() && reserved > target) reserved -= victims[keep++]->mapped();
      victims.resize(keep);
    }
    const std::size_t released = release_segments(lock, victims);
    return released + unmap_free_pages(target);
  }

  /// For release_before_grow: frees at least `deficit` bytes of completely free segments, disturbing the cache as
  /// little as possible: the smallest single segment that covers the deficit, else the largest ones until covered.
  std::size_t release_for_growth(std::unique_lock<detail::spin_mutex>& lock, std::size_t deficit) {
    std::vector<segment*> candidates = free_segments();
    if (candidates.empty()) return 0;
    std::sort(candidates.begin(), candidates.end(),
              [](const segment* a, const segment* b) { return a->mapped() < b->mapped(); });
    const auto covering = std::find_if(candidates.begin(), candidates.end(),
                                       [deficit](const segment* seg) { return seg->mapped() >= deficit; });
    std::vector<segment*> victims;
    if (covering != candidates.end()) {
      victims.push_back(*covering);
    } else {
      std::size_t covered = 0;
      for (auto it = candidates.rbegin(); it != candidates.rend() && covered < deficit; ++it) {
        victims.push_back(*it);
        covered += (*it)->mapped();
      }
    }
    return release_segments(lock, victims, true);
  }

  /// Waits (lock released) for every pending event and returns the blocks they held back to their pools.
  void wait_for_pending_events(std::unique_lock<detail::spin_mutex>& lock) {
    stats_.num_sync_all_streams.increment();
    struct waiting {
      pending_record record;
      gpukit::device device;
      tracker_type tracker;  // for a null event: the destroyed stream whose last work is awaited
    };
    std::vector<waiting> records;
    for (stream_state* st : pending_streams_) {
      for (auto& record : st->pending) {
        tracker_type tracker{};
        if (!record.event) tracker = st->tracker;
        records.push_back(waiting{std::move(record), st->device, std::move(tracker)});
      }
      st->pending.clear();
    }
    pending_streams_.clear();
    if (records.empty()) return;
    lock.unlock();
    for (auto& w : records) {
      if (w.record.event) {
        synchronize_quietly(*w.record.event);
      } else {
        wait_finished_quietly(w.tracker);
      }
    }
    lock.lock();
    for (auto& w : records) {
      recycle_event(std::move(w.record.event), w.device);
      complete_pending(w.record.b);
    }
  }

  /// Segments whose blocks are all free. A block of a destroyed stream whose work may still run has no fence to
  /// wait for: its segment is released only to an upstream whose free synchronizes (cudaFree).
  std::vector<segment*> free_segments() const {
    const bool quarantine = !upstream_.synchronizes_on_free();
    std::vector<segment*> result;
    for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      bool all_free = true;
      for (const block* b = seg->first; b != nullptr && all_free; b = b->next) {
        all_free = b->state == block_state::free && !(quarantine && b->owner->dead);
      }
      if (all_free) result.push_back(seg);
    }
    return result;
  }

  /// Unlinks completely free segments and returns them to the upstream, after waiting for their fences (lock
  /// released meanwhile). `unforced`: memory was available (counted in num_device_free_unforced). Returns the bytes
  /// released.
  std::size_t release_segments(std::unique_lock<detail::spin_mutex>& lock, const std::vector<segment*>& victims,
                               bool unforced = false) {
    if (victims.empty()) return 0;
    std::vector<std::unique_ptr<event_type>> fences;
    std::vector<ordered_release> ordered(victims.size());
    std::size_t released = 0;
    std::size_t frees = 0;
    for (std::size_t i = 0; i < victims.size(); ++i) {
      segment* seg = victims[i];
      ordered[i] = order_release(*seg);
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
      if (seg->expandable) {
        forget_expandable(seg);
        address_space_.store(address_space_.load(std::memory_order_relaxed) - seg->size, std::memory_order_relaxed);
      }
      frees += seg->expandable ? seg->mapped() / seg->pages.page_size() : 1;  // an unmap per page, or a cudaFree
      count(st_segment, seg->small, -1);
      count(st_reserved_bytes, seg->small, -as_delta(seg->mapped()));
      released += seg->mapped();
    }
    lock.unlock();
    for (const auto& fence : fences) synchronize_quietly(*fence);
    for (std::size_t i = 0; i < victims.size(); ++i) {
      return_segment(victims[i], ordered[i]);
      delete victims[i];
    }
    lock.lock();
    for (auto& fence : fences) recycle_event(std::move(fence), device_);
    for (ordered_release& o : ordered) {
      for (auto& e : o.after) recycle_event(std::move(e), device_);
    }
    for (std::size_t i = 0; i < frees; ++i) {
      stats_.num_device_free.increment();
      if (unforced) stats_.num_device_free_unforced.increment();
    }
    return released;
  }

  /// The bytes of block `b` (of an expandable segment) that lie on mapped pages.
  std::size_t mapped_bytes_of(const block* b) const noexcept {
    return b->seg->pages.mapped_bytes_in(b->address - b->seg->address, b->size);
  }

  free_space_info free_space_locked() const noexcept {
    fronts_lock all(*this);
    return detail::caching_diagnostics::free_space(*this);
  }

  // --- graph capture (stream_ops.hpp says why these operations are refused while a stream is captured) ---

  /// Whether allocate and free ask about captures now (allocator_options::capture_check).
  bool checks_captures() const noexcept {
    return options_.capture_check == capture_checks::every_call ||
           mode_independent::gpukit_captures_underway().load(std::memory_order_acquire) != 0;
  }

  void refuse_if_captured(const stream_type& s, const char* operation) const {
    if constexpr (detail::has_capture_query<StreamOps>::value) {
      if (checks_captures() && ops_.capturing(s)) throw_stream_captured(s, operation);
    }
  }

  /// Before freeing `b` (taken out of the pointer map, so ours alone; the caller puts it back when this throws):
  /// throws if its stream is captured, since the graph's launches may use it after the free.
  void refuse_free_if_captured(const block* b) const {
    if constexpr (detail::has_capture_query<StreamOps>::value) {
      if (checks_captures() && ops_.capturing(b->owner->stream)) {
        throw_stream_captured(b->owner->stream, "deallocate");
      }
    } else {
      (void)b;
    }
  }

  /// empty_cache and trim (lock held): refused while a stream of a live allocation is captured. Only those streams
  /// are asked, since a stream must outlive the memory allocated on it, and only while allocated.
  void refuse_release_if_captured(const char* operation) const {
    if constexpr (detail::has_capture_query<StreamOps>::value) {
      std::vector<const stream_state*> asked;
      for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
        for (const block* b = seg->first; b != nullptr; b = b->next) {
          if (b->state != block_state::allocated || std::find(asked.begin(), asked.end(), b->owner) != asked.end()) {
            continue;
          }
          asked.push_back(b->owner);
          if (ops_.capturing(b->owner->stream)) throw_stream_captured(b->owner->stream, operation);
        }
      }
    }
  }

  [[noreturn]] void throw_stream_captured(const stream_type& s, const char* operation) const {
    std::string text;
    if constexpr (std::is_same<stream_type, stream_view>::value) {
      text = detail::describe_stream(s.native_handle(), device_);
    } else {
      text = "stream " + std::to_string(ops_.key(s)) + " of " + device_.to_string();
    }
    detail::throw_captured(operation, text, device_, detail::capture_advice_allocator);
  }

  // --- errors ---

  [[noreturn]] void throw_out_of_memory(std::unique_lock<detail::spin_mutex>& lock, std::size_t requested,
                                        std::size_t size, std::size_t segment_bytes, bool limit_hit,
                                        bool pages = false) {
    stats_.num_ooms.increment();
    const free_space_info f = free_space_locked();
    std::size_t allocated = 0;
    {
      fronts_lock all(*this);  // the heap's part and the slots' together
      allocated = user_current(st_allocated_bytes);
    }
    const std::size_t reserved = current(stats_.reserved_bytes);
    const std::size_t limit = limit_;
    lock.unlock();
    upstream_memory_info info;
    try {
      info = upstream_.memory_info();
    } catch (...) {
    }
    out_of_memory_info facts{
        device_ordinal(),     requested, size,      segment_bytes, allocated,        reserved,        f.free_bytes,
        f.largest_free_block, limit,     limit_hit, info.known,    info.total_bytes, info.free_bytes, {}};
    facts.message = detail::out_of_memory_message(facts, device_.to_string(), pages);
    if (memory_history* h = history_.load(std::memory_order_acquire)) {
      h->record(memory_action::oom, 0, requested, 0, info.known ? info.free_bytes : 0);
    }
    observers_.notify(facts, device_.to_string());
    const cudaError_t result = device_.is_cuda() && !limit_hit ? cudaErrorMemoryAllocation : cudaSuccess;
    throw out_of_memory_error(facts.message, result,
                              "gpukit::basic_caching_allocator::allocate(" + std::to_string(requested) + ")",
                              device_.ordinal());
  }

  [[noreturn]] void throw_not_owned(const void* p, const char* operation) const {
    std::lock_guard<detail::spin_mutex> lock(mutex_);
    throw_not_owned_locked(p, operation);
  }

  [[noreturn]] void throw_not_owned_locked(const void* p, const char* operation) const {
    throw invalid_argument_error(detail::caching_diagnostics::not_owned_message(*this, p, operation), cudaSuccess,
                                 operation, device_.ordinal());
  }

  gpukit::device device_;
  allocator_options options_;
  Upstream upstream_;
  StreamOps ops_{};
  bool needs_fence_ = false;
  bool front_cache_ = false;
  bool front_cache_large_ = false;  // large blocks are cached in front too (slots [16, 32))
  bool vm_refused_ = false;         // the device has no virtual memory: expandable segments are not tried again

  mutable detail::spin_mutex mutex_;  // the device lock (spin_mutex.hpp says why not std::mutex)
  using map_type = detail::sharded_pointer_map<block>;
  map_type map_;
  all_stats_t stats_;
  std::size_t limit_ = allocator_options::unlimited;  // guarded by mutex_
  std::atomic<std::size_t> limit_atomic_{allocator_options::unlimited};
  std::atomic<std::size_t> address_space_{0};  // reserved by expandable segments (written under mutex_)
  std::size_t in_flight_ = 0;   // bytes being allocated from the upstream right now (counted against the limit)
  std::size_t high_water_ = 0;  // most bytes ever reserved (release_before_grow keeps below it when it can)
  detail::out_of_memory_observers observers_;
  std::atomic<memory_history*> history_{nullptr};           // read on every call: one acquire load
  std::shared_ptr<memory_history> current_history_;         // guarded by mutex_
  std::vector<std::shared_ptr<memory_history>> histories_;  // every history ever set (see set_memory_history)

  static constexpr std::size_t min_prune_at = 64;

  detail::stream_registry<stream_state> streams_;  // every stream seen, by key
  std::size_t prune_at_ = min_prune_at;            // registrations sweep idle states when there are this many
  std::uint64_t sweeps_ = 0;                       // sweeps of the stream registry so far
  bool may_have_abandoned_ = false;                // a sweep happened since release_abandoned last looked
  std::unique_ptr<stream_state> unowned_;          // free blocks no stream can still be using (not registered)
  std::vector<stream_state*> dead_streams_;        // destroyed streams whose last work may still run
  std::uint64_t seen_expirations_ = 0;             // the stream ops' expiration count when last looked at
  bool slots_to_release_ = false;                  // a stream found destroyed may still hold front slots
  std::vector<stream_state*> pending_streams_;     // streams with pending events
  std::size_t pending_total_ = 0;                  // events not yet seen complete
  std::uint64_t fence_counter_ = 0;
  detail::event_pool<std::unique_ptr<event_type>> events_;  // this device's, and others' for record_stream

  segment* segments_ = nullptr;
  std::vector<std::unique_ptr<block[]>> block_chunks_;
  block* spare_blocks_ = nullptr;

  std::size_t fronts_used_ = front_slots_per_pool;   // 32 with front_cache_large_
  bool fronts_active_ = false;                       // a block was ever cached in front (written with every lock held)
  bool peaks_deferred_ = false;                      // flush_fronts is moving blocks: peaks are settled when it ends
  std::array<std::int64_t, counter_count> slack_{};  // peak - heap - claims (device lock)
  detail::front_owners<front_slot_count> front_owners_;     // read by every front-cache call, written rarely
  std::array<front_slot_type, front_slot_count> fronts_{};  // last: the large blocks' slots are cold unless used
};

GPUKIT_END_NAMESPACE
