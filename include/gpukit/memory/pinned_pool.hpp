// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A caching allocator of pinned host memory. Pinning is slow (cudaHostAlloc with its cudaFreeHost: 0.74 ms for
/// 1 MiB, 30 ms for 64 MiB on an H200 host, bench_pinned_pool; and a synchronisation point between streams), so freed
/// blocks are kept and served again; after warm-up no pinning happens on the hot path (stats().upstream_allocations
/// stops growing).
///
/// - Stream-ordered reuse, record_stream-style: a block used by copies on streams is reused only after events
///   recorded on those streams *at free* have completed. Call record_stream(p, s) for each stream that uses the
///   block (or deallocate(p, s)); no event is recorded per copy. allocate() never waits for an event: a block whose
///   events are pending is simply not served yet. Streams are told apart by id (stream_view::id), not by handle,
///   which CUDA gives to the next stream created once one is destroyed; a gpukit::stream recorded for a block may be
///   destroyed before the block is freed: it gets no event then, and the block waits for its last work instead.
/// - Size classes: requests are rounded to one of `classes_per_doubling` (default 8) sizes per power of two, so a
///   large request wastes less than 12.5% (PyTorch's pinned allocator rounds to a power of two: 129.5 MiB costs
///   256 MiB; here it costs 144 MiB). Requests up to 4 KiB round to a power of two (minimum 512 B). Blocks are
///   never split: a request is served by a cached block of exactly its class.
/// - A cap on cached free bytes: above it, the oldest free blocks go back to the upstream (blocks still pending on
///   their streams do not count).
/// - Statistics (allocated / reserved current and peak, counts, time spent pinning) and empty_cache(); the same
///   figures in the caching allocator's vocabulary, as torch.cuda.host_memory_stats() gives them (memory_stats(),
///   host_memory_stats_map()).
///
/// The engine, basic_pinned_pool<Upstream, Sync>, knows nothing of CUDA: the upstream supplies memory (cudaHostAlloc
/// for CUDA, page-aligned host memory for the CPU device and tests) and Sync records and polls stream events.
/// pinned_pool is the engine with gpukit's upstream and events; default_pinned_pool(device) gives the process-wide
/// pool of a device kind (one for every CUDA device, since its memory is portable, and one for the CPU).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/detail/event_pool.hpp>
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// The size a pinned pool reserves for a request of `bytes`: a power of two (at least 512 B) up to 4 KiB, above that
/// the next of `classes_per_doubling` evenly spaced sizes per power of two (1 gives power-of-two rounding). Lets
/// callers plan memory; the waste is below 1/classes_per_doubling of the class for requests above 4 KiB. Returns 0
/// for 0 and SIZE_MAX when the class would not fit in size_t. `classes_per_doubling` must be a power of two.
GPUKIT_INLINE std::size_t pinned_size_class(std::size_t bytes, std::size_t classes_per_doubling = 8) noexcept;

/// How a pinned pool behaves.
struct pinned_pool_options {
  /// Free blocks kept above this are released to the upstream, oldest first. Pinned memory cannot be paged out, so
  /// an unbounded cache starves the host; 2 GiB holds a staging ring per stream plus a prefetcher's batches. SIZE_MAX
  /// disables the cap. Pending blocks (freed, waiting for their streams: pending_bytes) do not count: their streams'
  /// work still uses them, and counting them made every free unpin (a cudaFreeHost that waits for the whole device)
  /// and every allocation pin again while they alone exceeded the cap. A block is capped once it becomes free. Blocks
  /// given back by a staging engine's to_device/to_host stay cached over the cap until the pool's next deallocate or
  /// set_max_cached_bytes made elsewhere: cudaFreeHost waits for all the device's work, which may wait for the copying
  /// thread.
  std::size_t max_cached_bytes = std::size_t{2} << 30;
  /// Size classes per power of two above 4 KiB (a power of two; 1 = PyTorch-style power-of-two rounding).
  std::size_t classes_per_doubling = 8;
};

/// A pool's counters. Byte figures are size-class bytes unless named "requested".
struct pinned_pool_stats {
  std::size_t allocated_bytes = 0;             ///< in blocks handed out and not yet deallocated
  std::size_t allocated_bytes_peak = 0;        ///< highest allocated_bytes since creation or reset_peak_stats()
  std::size_t requested_bytes = 0;             ///< what the callers of those blocks asked for (allocated - waste)
  std::size_t reserved_bytes = 0;              ///< obtained from the upstream and not released (allocated + cached)
  std::size_t reserved_bytes_peak = 0;         ///< highest reserved_bytes
  std::size_t cached_bytes = 0;                ///< reserved, not allocated and not lost: free plus pending blocks
  std::size_t pending_bytes = 0;               ///< cached blocks still waiting for their events
  std::size_t active_blocks = 0;               ///< blocks handed out
  std::size_t free_blocks = 0;                 ///< blocks ready to serve a request
  std::size_t pending_blocks = 0;              ///< freed blocks whose events have not completed
  std::size_t lost_blocks = 0;                 ///< blocks taken out of use: their events could not be recorded or kept
  std::uint64_t allocations = 0;               ///< successful allocate() calls with a non-zero size
  std::uint64_t cache_hits = 0;                ///< of those, served from a cached block (no pinning)
  std::uint64_t upstream_allocations = 0;      ///< blocks obtained from the upstream (pinnings)
  std::uint64_t upstream_frees = 0;            ///< blocks given back to the upstream
  std::uint64_t cap_releases = 0;              ///< of those, released because the cache exceeded max_cached_bytes
  std::uint64_t oom_retries = 0;               ///< upstream failures retried after emptying the cache
  std::uint64_t events_recorded = 0;           ///< events recorded at deallocation (one per stream that used a block)
  std::chrono::nanoseconds pinning_time{0};    ///< total time in the upstream's allocate (cudaHostAlloc)
  std::chrono::nanoseconds unpinning_time{0};  ///< total time in the upstream's deallocate (cudaFreeHost)
};

namespace detail {

/// Whether a pinned pool's upstream says if its memory is page-locked (the caching allocator's upstreams do not).
template <class Upstream, class = void>
struct has_page_locked : std::false_type {};
template <class Upstream>
struct has_page_locked<Upstream, std::void_t<decltype(std::declval<const Upstream&>().page_locked())>>
    : std::true_type {};

/// Calls on this thread that must not wait for the device (the staging engine's to_device and to_host, whose stream
/// may be held by work that waits for the caller): while not zero, pinned pools leave their cache over
/// max_cached_bytes instead of releasing blocks (cudaFreeHost waits for all the device's work); the pool's next
/// free, or a poll that makes blocks reusable, on a thread where it is zero applies the cap.
GPUKIT_EXPORT inline int& pinned_cap_deferrals_on_this_thread() noexcept {
  thread_local int count = 0;
  return count;
}

/// Defers pinned pools' cap on this thread for its lifetime (see pinned_cap_deferrals_on_this_thread).
class defer_pinned_cap {
 public:
  defer_pinned_cap() noexcept { ++pinned_cap_deferrals_on_this_thread(); }
  defer_pinned_cap(const defer_pinned_cap&) = delete;
  defer_pinned_cap& operator=(const defer_pinned_cap&) = delete;
  ~defer_pinned_cap() { --pinned_cap_deferrals_on_this_thread(); }
};

/// The process-wide pool of events that pinned pools and staging engines share (defined with the functions, so the
/// compiled mode parses none of it), so recording "this block is free once s gets here" does not create and destroy a
/// CUDA event each time.
class recycled_event_cache;
/// The process-wide recycled_event_cache. Thread-safe. Leaked on purpose: pools and staging engines that outlive
/// static destruction (host callbacks at exit) may still return events to it.
GPUKIT_EXPORT GPUKIT_INLINE recycled_event_cache& shared_recycled_events();
/// An event of `d` (timing disabled) from the shared cache, recycled when available.
GPUKIT_INLINE event acquire_recycled_event(device d);
/// Gives an event back to the shared cache for reuse; it keeps at most 1024 per device and destroys the rest.
GPUKIT_INLINE void give_recycled_event(event&& e) noexcept;

}  // namespace detail

/// The Sync policy of pinned_pool: gpukit events (CUDA or CPU), recycled through a process-wide cache.
///
/// A Sync policy provides: `marker` (movable); `marker record(stream_view)` — completes when the stream's work so far
/// has; `bool ready(const marker&)` — never blocks; `void wait(const marker&)` — blocks (used only when a pool is
/// destroyed); `void recycle(marker&&) noexcept`.
struct pinned_pool_sync {
  /// A gpukit event.
  using marker = event;
  /// An event recorded on `s` now (from any thread: detail::record_from_any_thread).
  marker record(stream_view s);
  /// Whether the work it captured has completed.
  bool ready(const marker& m);
  /// Blocks until it has.
  void wait(const marker& m);
  /// Returns the event to the cache.
  void recycle(marker&& m) noexcept;
};

/// The upstream of pinned_pool: cudaHostAlloc (portable by default) for CUDA, page-aligned host memory for the CPU.
///
/// An Upstream follows the caching allocator's upstream contract (upstream.hpp), of which the pool needs only
/// `void* allocate(std::size_t)` (out of memory: out_of_memory_error or nullptr) and
/// `void deallocate(void*, std::size_t) noexcept`, plus, optionally, `bool page_locked() const noexcept` (false when
/// absent).
class pinned_upstream {
 public:
  /// Memory for devices of `kind`; `flags` apply to CUDA. `context_device`: the CUDA ordinal whose context pins the
  /// memory when no device has a context yet (-1: the current device); see allocate().
  explicit pinned_upstream(device::kind kind = device::kind::cpu, pinned_flags flags = {},
                           int context_device = -1) noexcept;

  /// Pins `bytes` (cudaHostAlloc) or allocates page-aligned host memory. Pinned memory belongs to the context current
  /// during the call, and a thread that never chose a device (the prefetcher's, a staging caller's) would create
  /// cuda:0's: portable memory serves every context, so one that exists is used (detail::device_with_context).
  [[nodiscard]] void* allocate(std::size_t bytes);
  /// Unpins and frees (cudaFreeHost; failures are reported through gpukit::warn).
  void deallocate(void* p, std::size_t /*bytes*/) noexcept;
  /// True for CUDA (the memory is page-locked).
  bool page_locked() const noexcept;
  /// The device kind the memory is for.
  device::kind kind() const noexcept;

 private:
  device::kind kind_;
  pinned_flags flags_;
  int context_device_;
};

/// The caching pinned-memory engine (see the file comment). Thread-safe: one mutex; the upstream is called without
/// holding it, so a slow cudaHostAlloc does not stall other threads' cache hits.
///
/// Exceptions. Every call leaves the pool consistent (its statistics equal a recount of its blocks, no block is
/// listed twice, every block taken off the books goes back to the upstream) whichever call of the upstream or of
/// Sync throws, or std::bad_alloc:
/// - allocate, record_stream, block_size and a deallocate refused (foreign pointer, double free, captured stream):
///   strong guarantee for the caller's block (nothing is allocated, recorded or freed).
/// - deallocate when recording an event fails: the block is lost (kept out of use for good, lost_blocks) and the
///   error is rethrown; nothing else changes.
/// - Sync::ready throwing (a failed cudaEventQuery) while a call polls the pending blocks: the blocks promoted before
///   stay promoted and capped, the failed one and those after it stay pending (polled again by the next call), and
///   the error propagates. allocate and stats then do nothing more; empty_cache still releases every free block and
///   set_max_cached_bytes still applies its cap to them before rethrowing.
/// - std::bad_alloc while trimming to the cap stops the trimming (the next call resumes it); it is not reported.
template <class Upstream, class Sync = pinned_pool_sync>
class basic_pinned_pool {
 public:
  /// What Sync records on a stream when a block is freed (an event for pinned_pool).
  using marker = typename Sync::marker;

  /// An empty pool (nothing is allocated until the first request). Throws invalid_argument_error when
  /// `options.classes_per_doubling` is not a power of two.
  explicit basic_pinned_pool(Upstream upstream = Upstream(), pinned_pool_options options = {}, Sync sync = Sync());

  basic_pinned_pool(const basic_pinned_pool&) = delete;
  basic_pinned_pool& operator=(const basic_pinned_pool&) = delete;

  /// Waits for the events of pending blocks, then releases every cached block. Blocks still allocated are leaked
  /// (their owners may still use them) and reported through gpukit::warn; so are lost blocks (see deallocate) and
  /// blocks freed during a capture that is still underway (deallocate_after_captures: no event can wait for them).
  ~basic_pinned_pool();

  /// A block of at least `bytes` (its size class), served from the cache when a block of that class is free, else
  /// from the upstream. Returns nullptr for 0. If the upstream is out of memory the cache is emptied and the request
  /// retried once before out_of_memory_error is thrown; not on a thread that must not wait for the device (inside a
  /// staging transfer, detail::defer_pinned_cap: emptying calls cudaFreeHost, which waits for all the device's work,
  /// and the transfer's stream may be waiting for that thread), which gets out_of_memory_error at once.
  [[nodiscard]] void* allocate(std::size_t bytes);

  /// Declares that work on `s` uses block `p`: when it is deallocated, an event is recorded on `s` and the block is
  /// reused only after it completes. Call it for every stream a copy from or to the block was issued on. A raw
  /// cudaStream_t must still exist when the block is deallocated; a gpukit::stream may be destroyed before (the block
  /// then waits for its last work). `p` may also be an address the resource adaptors served over-aligned inside a
  /// block (pinned_pmr_resource, pinned_memory_resource). Throws invalid_argument_error for a pointer this pool did
  /// not hand out (or one already freed).
  void record_stream(const void* p, stream_view s);

  /// Gives block `p` back. With no recorded stream it is free at once; otherwise one event is recorded on each
  /// recorded stream now and the block waits for them. Null does nothing. Throws invalid_argument_error for a pointer
  /// not handed out by this pool, or freed twice, and, changing nothing, while a recorded stream is being captured
  /// into a CUDA graph. If recording an event fails, or there is no host memory to keep the events, the block is taken
  /// out of use (it may still be read by the device) and the error is rethrown, unless the runtime is torn down
  /// (process exit: nothing is left to protect).
  void deallocate(void* p);

  /// deallocate(p) for destructors (pooled_pinned_buffer's): a block whose recorded stream is being captured is not
  /// refused but waits until no recorded stream is, then for events recorded then, which complete after the work
  /// those streams had enqueued before their captures. What a capture enqueues is its graph's: as with any memory, a
  /// graph must not run after the memory it uses is freed. Throws invalid_argument_error for a pointer not handed out
  /// by this pool, or freed twice, and what deallocate throws when recording an event fails. A recorded stream named
  /// by a raw handle must outlive the capture (a gpukit::stream may be destroyed: its last work is waited for); a
  /// pool destroyed while the block waits leaks it and says so.
  void deallocate_after_captures(void* p);

  /// record_stream(p, s) then deallocate_after_captures(p): a stream-ordered free that cannot be refused (a
  /// noexcept adaptor's, such as pinned_memory_resource's), for `s` being captured too.
  void deallocate_after_captures(void* p, stream_view s);

  /// record_stream(p, s) then deallocate(p): the usual way to free a block a copy on `s` uses. One capture query
  /// for `s` (record_stream and deallocate would each ask), and one lock.
  void deallocate(void* p, stream_view s);

  /// Releases every free block to the upstream (pending blocks stay until their events complete and go at a later
  /// call). Returns the bytes released, those of pending blocks promoted and trimmed to the cap by this call
  /// included. Use it before handing pinned memory back to the system. If polling a pending block's event throws,
  /// the free blocks are released all the same and then the error is rethrown. A pending block whose recorded stream
  /// was destroyed without a final event (while captured, or its record failed) could otherwise wait for good: for
  /// it this call synchronizes the device (cudaDeviceSynchronize, without the pool's lock) and releases it, unless a
  /// gpukit capture is underway (the synchronize would invalidate it) or the call is made inside a staging transfer
  /// (the device's work may wait for this thread). A capture begun with the raw runtime on another thread is not
  /// seen: do not call it then. (An allocation's out-of-memory retry empties the cache without that synchronize.)
  std::size_t empty_cache();

  /// The counters, after promoting pending blocks whose events have completed (a failed event query propagates).
  pinned_pool_stats stats();

  /// The statistics in the caching allocator's vocabulary (torch.cuda.host_memory_stats), after promoting pending
  /// blocks whose events have completed (a failed event query propagates).
  host_allocator_stats memory_stats();

  /// Resets the peaks to the current values (to measure one phase of a program), in stats() and memory_stats(), and
  /// the shortest and longest call times, as torch.cuda.reset_peak_host_memory_stats does.
  void reset_peak_stats();

  /// Resets memory_stats()'s accumulated figures: the totals allocated and freed (num_host_alloc and num_host_free
  /// with them) and the calls' count and total time, as torch.cuda.reset_accumulated_host_memory_stats does (the
  /// shortest and longest go with reset_peak_stats). stats()'s counters still count from the pool's creation.
  void reset_accumulated_stats();

  /// The usable size of a block handed out by this pool (its size class). Throws invalid_argument_error otherwise.
  std::size_t block_size(const void* p);

  /// Whether `p` is a block this pool handed out and has not taken back: false once it is deallocated or lost. After
  /// a deallocate that threw, it tells the caller whether the block is still theirs (a refused deallocate) or gone
  /// (an event that could not be recorded). Never throws: false if the pool's lock cannot be taken.
  [[nodiscard]] bool is_allocated(const void* p) noexcept;

  /// Changes the cap; blocks above it are released now (free ones) or when their events complete (pending ones). If
  /// polling a pending block's event throws, the new cap is in force and applied to the free blocks all the same,
  /// and the error is rethrown.
  void set_max_cached_bytes(std::size_t bytes);

  /// A copy of the options in force (max_cached_bytes as last set by set_max_cached_bytes, which another thread may
  /// call meanwhile).
  pinned_pool_options options() const;
  /// Whether the memory is really page-locked (false for the CPU device's upstream).
  bool page_locked() const noexcept;
  /// The upstream memory comes from and goes back to.
  Upstream& upstream() noexcept;

 private:
  // deferred: freed while a recorded stream could not take an event (deallocate_recorded); pending: waiting for the
  // events recorded at the free.
  enum class block_state : unsigned char { active, deferred, pending, free, lost };
  struct block {
    std::size_t size = 0;
    std::size_t requested = 0;
    block_state state = block_state::active;
    std::uint64_t freed_at = 0;        // when it last became free, to release the oldest first
    std::vector<stream_view> streams;  // streams recorded while active (resolved)
    std::vector<std::shared_ptr<const detail::stream_life>> lives;   // theirs (null: a raw handle, not tracked)
    std::vector<marker> markers;                                     // events recorded at deallocation
    std::vector<std::shared_ptr<const detail::stream_life>> finals;  // destroyed recorded streams still working
  };

  using block_list = std::vector<std::pair<void*, std::size_t>>;

  // Blocks already taken off the books under the lock, handed to the upstream when this goes out of scope, after the
  // lock (declared after it) is released, and also when the call throws: a block taken off the books is never lost.
  class release_list {
   public:
    explicit release_list(basic_pinned_pool& pool) noexcept : pool_(pool) {}
    release_list(const release_list&) = delete;
    release_list& operator=(const release_list&) = delete;
    ~release_list() {
      pool_.release_all(blocks);
      pool_.report_deferred_losses();
    }
    block_list blocks;

   private:
    basic_pinned_pool& pool_;
  };

  // A recorded gpukit::stream destroyed since gets no event (its handle may belong to another stream by now, or to
  // none): the block waits for its last work instead (detail::stream_life). Basic guarantee: a stream is erased only
  // after its life is in `finals`.
  static void forget_destroyed_streams_locked(block& b);

  /// deallocate(p), with `caller`'s stream (bound as record_stream binds it) recorded first when it is not null. A
  /// recorded stream that is being captured, the caller's included, is refused, changing nothing, unless
  /// `defer_captured`. A block that a recorded
  /// stream cannot take an event for now (captured, or the legacy default stream during a gpukit capture, or during
  /// any capture of a blocking stream of its device: see detail::capture_hold) is deferred: off the users' books,
  /// counted as pending, and given its events once every recorded stream can take one (process_deferred_locked).
  void deallocate_recorded(void* p, const stream_view* caller, bool defer_captured);

  /// Whether each of `b`'s streams can take an event now: `hold` (taken where one uses the legacy default stream:
  /// needs_capture_hold) refuses none, no capture of a blocking stream (a raw one too) holds the legacy stream where
  /// one uses it, and, when `ask_captures`, none is being captured (otherwise the caller refused those). The events
  /// are recorded while `hold` lives.
  static bool can_record_now(const block& b, bool ask_captures, const detail::capture_hold& hold);
  /// Whether one of `b`'s streams may use the legacy default stream (detail::may_use_legacy_stream).
  static bool needs_capture_hold(const block& b) noexcept;

  /// Records an event on each of `b`'s streams and makes it pending (pending_bytes_ is the caller's). Room comes
  /// first, so that nothing can fail once the events are recorded; if recording fails, the block keeps its streams
  /// and the error propagates.
  void make_pending_locked(void* p, block& b);

  /// Deferred blocks whose streams can all take an event now get them and wait as pending blocks do; true if one
  /// became free at once (the caller trims to the cap). Never throws, since the caller's call is about other blocks: a
  /// block whose capture query or recording fails is lost (as in deallocate; it may still be read by the device) and
  /// reported after the lock is dropped (report_deferred_losses); std::bad_alloc leaves the rest deferred, for the
  /// next call.
  bool process_deferred_locked() noexcept;

  /// empty_cache's first step: waits (without the lock) for the destroyed streams without a final event that pending
  /// blocks wait for, by a device synchronize each (stream_life::wait_finished); see empty_cache for when it does not.
  void wait_for_streams_without_final_event();

  /// empty_cache's second step, and all of an out-of-memory retry's: promotes the pending blocks whose events have
  /// completed, releases every free block, then rethrows `failure` (or a failed event query) if any.
  std::size_t release_cached(std::exception_ptr failure);

  /// Reports, through gpukit::warn and without the lock (a handler may call the pool), the deferred blocks
  /// process_deferred_locked lost since the last report.
  void report_deferred_losses() noexcept;

  /// Adds `s` (bound) to the streams whose work block `b` waits for, once. Strong: unchanged if it throws.
  void record_stream_locked(block& b, const stream_view& s);

  // A block used on a stream that is being captured would be reused while the graph's launches still use it, and
  // its event would belong to the graph (stream_ops.hpp): refused before anything changes.
  static void refuse_if_captured(stream_view s, const char* who);

  void lose_locked(block& b) noexcept;

  block& active_block_locked(const void* p, const char* who);

  void on_activate_locked(block& b) noexcept;

  void on_deactivate_locked(const block& b) noexcept;

  // memory_stats() counts a freed block as allocated until it can be reused, as PyTorch's host allocator does: while
  // it waits for its streams' events it is still allocated there (stats() counts it pending instead).
  void on_reusable_locked(const block& b) noexcept;

  // Puts a block on its free list. Strong guarantee: growing the list is the only step that can throw, and it comes
  // first; the caller adjusts the counters of the state the block leaves.
  void make_free_locked(void* p, block& b);

  bool events_completed(const block& b);

  // Promotes pending blocks whose events have all completed, then trims to the cap. If Sync::ready throws, the
  // blocks promoted before stay promoted (and trimmed), the failed block and those after it stay pending, in order
  // and once each, and the error propagates: the list is compacted on every path.
  void process_pending_locked(block_list& releases);

  // Takes free block list[index] out of the pool: off its free list and the books, onto `releases` for the upstream.
  // The one place a cached block leaves the pool, so no path counts a block out twice. Strong guarantee: the append,
  // the only step that can throw, comes first.
  void release_free_block_locked(std::vector<void*>& list, std::size_t index, block_list& releases);

  // Releases the oldest free blocks until the cached bytes fit the cap. Pending blocks count as cached but cannot be
  // released: they are trimmed when promoted. Out of memory for the release list stops the trimming (a later call
  // resumes it); nothing is half done.
  void enforce_cap_locked(block_list& releases) noexcept;

  void release_all(const block_list& blocks) noexcept;

  void* upstream_allocate_timed(std::size_t size);

  void add_pinning_time(std::chrono::steady_clock::duration spent, bool succeeded);

  void* upstream_allocate_with_retry(std::size_t size, std::size_t requested);

  // The out_of_memory_error for a block of class `size` (`requested` bytes asked for) that `upstream` refused, the
  // cache `emptied` first or not.
  [[noreturn]] void throw_exhausted(std::size_t size, std::size_t requested, bool emptied,
                                    const out_of_memory_error& upstream);

  Upstream upstream_;
  Sync sync_;
  pinned_pool_options options_;
  mutable std::mutex mutex_;                                  // options() const takes it too
  std::unordered_map<void*, block> blocks_;                   // every reserved block
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // free blocks by size class (LIFO: warm memory)
  std::vector<void*> pending_;                                // freed, waiting for events
  std::vector<void*> deferred_;                               // freed, waiting until their streams can take events
  std::size_t deferred_losses_ = 0;                           // deferred blocks lost, not yet reported
  std::size_t pinnings_in_flight_ = 0;                        // allocate() calls between reserve and insert
  std::exception_ptr deferred_loss_;                          // why the last of them was lost
  std::size_t pending_bytes_ = 0;
  std::size_t free_count_ = 0;
  std::size_t active_count_ = 0;
  std::size_t lost_count_ = 0;
  std::size_t lost_bytes_ = 0;
  std::uint64_t tick_ = 0;
  pinned_pool_stats stats_;
  host_allocator_stats host_stats_;  // the same books in the caching allocator's vocabulary (memory_stats)
};

/// The pinned pool gpukit uses: gpukit's upstream (cudaHostAlloc or host pages) and gpukit events.
using pinned_pool = basic_pinned_pool<pinned_upstream, pinned_pool_sync>;

/// The process-wide pinned pool for a device kind: one for all CUDA devices (its memory is portable: pinned for every
/// device) and one for the CPU device (plain page-aligned memory), created on first use with default options. Never
/// destroyed, so host callbacks and static destructors may still free into it at exit; the memory goes with the
/// process. A call for a CUDA device that is not visible throws invalid_argument_error (the first creates no pool: the
/// pool pins in that device's context while no context exists).
GPUKIT_EXPORT GPUKIT_INLINE pinned_pool& default_pinned_pool(device d);

/// A pinned pool's memory_stats() as torch.cuda.host_memory_stats() returns them: a flat map, sorted by key, from
/// "<statistic>.<metric>" (statistic: allocation, segment, allocated_bytes, reserved_bytes; metric: current, peak,
/// allocated, freed), "<timing>.<metric>" (timing: host_alloc_time, host_free_time; metric: total, max, min, count,
/// avg; times in microseconds, as PyTorch gives them) and the counters num_host_alloc and num_host_free, so code and
/// dashboards written for PyTorch read gpukit's numbers unchanged.
GPUKIT_INLINE std::map<std::string, std::int64_t> flat_host_memory_stats(const host_allocator_stats& s);

// The functions below are templates called as plain functions (the parameter is defaulted), so that the pool's
// engine is instantiated only in the translation units that call them (see README, "Compile time").

/// The statistics of default_pinned_pool(d) in the caching allocator's vocabulary (torch.cuda.host_memory_stats).
/// One pool serves every CUDA device, another the CPU device.
template <int Deferred = 0>
host_allocator_stats host_memory_stats(device d) {
  detail::dependent_t<Deferred, pinned_pool>& pool = default_pinned_pool(d);
  return pool.memory_stats();
}
/// The same as torch.cuda.host_memory_stats()'s flat key → value map ("allocated_bytes.current", …).
template <int Deferred = 0>
std::map<std::string, std::int64_t> host_memory_stats_map(device d) {
  return flat_host_memory_stats(host_memory_stats(d));
}
/// Resets the peaks of default_pinned_pool(d) to the current values (torch.cuda.reset_peak_host_memory_stats).
template <int Deferred = 0>
void reset_peak_host_memory_stats(device d) {
  detail::dependent_t<Deferred, pinned_pool>& pool = default_pinned_pool(d);
  pool.reset_peak_stats();
}
/// Resets the accumulated figures of default_pinned_pool(d) (torch.cuda.reset_accumulated_host_memory_stats).
template <int Deferred = 0>
void reset_accumulated_host_memory_stats(device d) {
  detail::dependent_t<Deferred, pinned_pool>& pool = default_pinned_pool(d);
  pool.reset_accumulated_stats();
}

/// A typed, move-only block from a pinned pool: the pool's counterpart of pinned_buffer, cheap to create after
/// warm-up. Its destructor gives the block back stream-ordered: record_stream(s) for every stream whose work uses it,
/// and the block is reused only after that work completes (so it may be destroyed right after enqueueing).
/// gpukit::copy_async records its copy's stream only when it is a gpukit::stream or a default stream. On a raw
/// cudaStream_t it records nothing (the handle may be destroyed and reused before the buffer goes): call
/// record_stream(s) yourself, with the handle alive until the buffer goes, or synchronize before the buffer goes;
/// otherwise the next buffer may get the block while the copy still reads or writes it.
template <class T>
class pooled_pinned_buffer {
  static_assert(std::is_trivially_copyable<T>::value && std::is_trivially_destructible<T>::value,
                "gpukit::pooled_pinned_buffer<T>: T must be trivially copyable and destructible");

 public:
  /// The element type.
  using value_type = T;
  /// The pool blocks come from: pinned_pool, named through T so that its class is instantiated with this one.
  using pool_type = detail::dependent_t<sizeof(T), pinned_pool>;

  /// An empty buffer (no block, no pool).
  pooled_pinned_buffer() noexcept = default;
  /// `count` uninitialised elements from `pool`.
  pooled_pinned_buffer(std::size_t count, pool_type& pool)
      : pool_(&pool),
        data_(
            static_cast<T*>(pool_->allocate(detail::checked_bytes(count, sizeof(T), "gpukit::pooled_pinned_buffer")))),
        size_(count) {}
  /// `count` uninitialised elements from the default pool of `d`'s kind.
  pooled_pinned_buffer(std::size_t count, device d) : pooled_pinned_buffer(count, default_pinned_pool(d)) {}

  /// Takes over `other`'s block; `other` is left empty.
  pooled_pinned_buffer(pooled_pinned_buffer&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}
  /// Gives this buffer's block back (as reset() does), then takes over `other`'s; `other` is left empty.
  pooled_pinned_buffer& operator=(pooled_pinned_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      pool_ = std::exchange(other.pool_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  pooled_pinned_buffer(const pooled_pinned_buffer&) = delete;
  pooled_pinned_buffer& operator=(const pooled_pinned_buffer&) = delete;
  ~pooled_pinned_buffer() { reset(); }

  /// Copies on `s` use this buffer: its block is reused only after `s`'s work up to the buffer's release completes.
  /// gpukit::copy_async calls it for the copies it enqueues directly from or into this buffer on a gpukit::stream or
  /// a default stream, not on a raw cudaStream_t: call it yourself there (the handle must still exist when the
  /// buffer goes).
  void record_stream(stream_view s) const {
    if (data_ != nullptr) pool_->record_stream(data_, s);
  }

  /// Gives the block back now (stream-ordered, as in the destructor). Errors are reported through gpukit::warn.
  void reset() noexcept {
    if (data_ != nullptr) {
      try {
        pool_->deallocate_after_captures(data_);  // a destructor: waits for a capture instead of failing
      } catch (const std::exception& e) {
        detail::warn_parts("gpukit::pooled_pinned_buffer: returning the block failed: ", e.what(), fate_of_refused());
      } catch (...) {
        detail::warn_parts("gpukit::pooled_pinned_buffer: returning the block failed: an unknown exception",
                           fate_of_refused());
      }
    }
    data_ = nullptr;
    size_ = 0;
  }

  /// The first element (host address), or nullptr when empty.
  T* data() noexcept { return data_; }
  /// The first element, read-only, or nullptr when empty.
  const T* data() const noexcept { return data_; }
  /// Number of elements (the block may be larger: its size class).
  std::size_t size() const noexcept { return size_; }
  /// Size in bytes of the elements: size() * sizeof(T).
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// True when the buffer holds no elements.
  bool empty() const noexcept { return size_ == 0; }
  /// Iterator to the first element.
  T* begin() noexcept { return data_; }
  /// Iterator past the last element.
  T* end() noexcept { return data_ + size_; }
  /// Read-only iterator to the first element.
  const T* begin() const noexcept { return data_; }
  /// Read-only iterator past the last element.
  const T* end() const noexcept { return data_ + size_; }
  /// Unchecked element access.
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  /// Unchecked read-only element access.
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// The elements as a span (host memory).
  gpukit::span<T> span() noexcept { return {data_, size_}; }
  /// The elements as a read-only span (host memory).
  gpukit::span<const T> span() const noexcept { return {data_, size_}; }
  /// True when the memory is page-locked (a CUDA pool).
  bool page_locked() const noexcept { return pool_ != nullptr && pool_->page_locked(); }
  /// The pool the block came from and goes back to (kept after reset()), or nullptr for a default-constructed or
  /// moved-from buffer.
  pool_type* pool() const noexcept { return pool_; }

 private:
  // After a failed return: what a refused block (the pool counts it allocated still) becomes, for the warning.
  const char* fate_of_refused() const noexcept {
    return pool_->is_allocated(data_) ? "; the block stays allocated in the pool, unused, until the pool is destroyed"
                                      : "";
  }
  pool_type* pool_ = nullptr;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE std::map<std::string, std::int64_t> flat_host_memory_stats(const host_allocator_stats& s) {
  std::map<std::string, std::int64_t> flat;
  const std::pair<const char*, const stat*> stats[] = {{"allocation", &s.allocation},
                                                       {"segment", &s.segment},
                                                       {"allocated_bytes", &s.allocated_bytes},
                                                       {"reserved_bytes", &s.reserved_bytes}};
  for (const auto& named : stats) detail::add_flat_stat(flat, std::string(named.first) + ".", *named.second);
  const std::pair<const char*, const duration_stat*> timings[] = {{"host_alloc_time", &s.host_alloc_time},
                                                                  {"host_free_time", &s.host_free_time}};
  const auto microseconds = [](std::chrono::nanoseconds t) {
    return static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(t).count());
  };
  for (const auto& named : timings) {
    const std::string prefix = std::string(named.first) + ".";
    flat[prefix + "total"] = microseconds(named.second->total);
    flat[prefix + "max"] = microseconds(named.second->max);
    flat[prefix + "min"] = microseconds(named.second->min);
    flat[prefix + "count"] = named.second->count;
    flat[prefix + "avg"] = microseconds(named.second->average());
  }
  flat["num_host_alloc"] = s.num_host_alloc;
  flat["num_host_free"] = s.num_host_free;
  return flat;
}

GPUKIT_INLINE std::size_t pinned_size_class(std::size_t bytes, std::size_t classes_per_doubling) noexcept {
  constexpr std::size_t min_class = 512;
  constexpr std::size_t fine_from = 4096;
  if (bytes == 0) return 0;
  if (bytes <= min_class) return min_class;
  int log2 = 0;  // floor(log2(bytes))
  for (std::size_t v = bytes; v > 1; v >>= 1) ++log2;
  const std::size_t power = std::size_t{1} << log2;
  if (bytes <= fine_from || classes_per_doubling <= 1) {
    if (bytes == power) return bytes;
    return log2 + 1 >= std::numeric_limits<std::size_t>::digits ? std::numeric_limits<std::size_t>::max() : power << 1;
  }
  std::size_t step = power / classes_per_doubling;
  if (step == 0) step = 1;
  const std::size_t remainder = bytes % step;
  if (remainder == 0) return bytes;
  if (bytes > std::numeric_limits<std::size_t>::max() - (step - remainder)) {
    return std::numeric_limits<std::size_t>::max();
  }
  return bytes + (step - remainder);
}
namespace detail {

/// detail::event_pool behind a mutex.
class recycled_event_cache {
 public:
  event acquire(device d) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto pooled = pool_.take(d)) return std::move(*pooled);
    }
    return event(d);
  }
  void give(event&& e) noexcept {
    if (!e.valid()) return;
    try {
      const device d = e.device();
      std::lock_guard<std::mutex> lock(mutex_);
      pool_.give(d, std::move(e));
    } catch (...) {
      // The mutex failed: the event is destroyed instead.
    }
  }

 private:
  std::mutex mutex_;
  event_pool<event> pool_{1024};
};

GPUKIT_INLINE recycled_event_cache& shared_recycled_events() {
  static recycled_event_cache* cache = new recycled_event_cache();  // never destroyed: see its declaration
  return *cache;
}

GPUKIT_INLINE event acquire_recycled_event(device d) { return shared_recycled_events().acquire(d); }

GPUKIT_INLINE void give_recycled_event(event&& e) noexcept { shared_recycled_events().give(std::move(e)); }
}  // namespace detail

GPUKIT_INLINE pinned_pool_sync::marker pinned_pool_sync::record(stream_view s) {
  event e = detail::acquire_recycled_event(s.device());
  detail::record_from_any_thread(e, s);
  return e;
}

GPUKIT_INLINE bool pinned_pool_sync::ready(const marker& m) { return m.ready(); }

GPUKIT_INLINE void pinned_pool_sync::wait(const marker& m) { m.synchronize(); }

GPUKIT_INLINE void pinned_pool_sync::recycle(marker&& m) noexcept { detail::give_recycled_event(std::move(m)); }

GPUKIT_INLINE pinned_upstream::pinned_upstream(device::kind kind, pinned_flags flags, int context_device) noexcept
    : kind_(kind), flags_(flags), context_device_(context_device) {}

GPUKIT_INLINE void* pinned_upstream::allocate(std::size_t bytes) {
  if (kind_ == device::kind::cpu) return detail::allocate_host_pages(bytes, "gpukit::pinned_pool");
  detail::note_cuda_use();
  detail::context_scope scope(context_device_, flags_.portable);
  return detail::cuda_host_alloc(bytes, flags_, scope.ordinal() >= 0 ? scope.ordinal() : -1);
}

GPUKIT_INLINE void pinned_upstream::deallocate(void* p, std::size_t /*bytes*/) noexcept {
  if (kind_ == device::kind::cpu) {
    detail::free_host_pages(p);
  } else {
    detail::cuda_free_host(p, context_device_, "cudaFreeHost (pinned_pool)");
  }
}

GPUKIT_INLINE bool pinned_upstream::page_locked() const noexcept { return kind_ == device::kind::cuda; }

GPUKIT_INLINE device::kind pinned_upstream::kind() const noexcept { return kind_; }

GPUKIT_INLINE pinned_pool& default_pinned_pool(device d) {
  if (d.is_cpu()) {
    static pinned_pool* cpu_pool = new pinned_pool(pinned_upstream(device::kind::cpu));
    return *cpu_pool;
  }
  // Pinned in a context that exists; the device first asked for if none does yet, so that device must be visible.
  // Checked at every call, not only the first: a device that does not exist is a misuse whenever it is named.
  detail::require_visible(d, "gpukit::default_pinned_pool");
  static pinned_pool* cuda_pool = new pinned_pool(pinned_upstream(device::kind::cuda, {}, d.ordinal()));
  return *cuda_pool;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS

// The engine's member functions. The compiled mode leaves them out: gpukit::compiled holds the instantiation gpukit
// uses, and pinned_pool_impl.hpp is there for other template arguments.
#if GPUKIT_DETAIL_DEFINITIONS
#include <gpukit/memory/pinned_pool_impl.hpp>
#endif
