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
///   the free's event on the device (cudaStreamWaitEvent), never on the host (on the legacy default stream, not
///   while a gpukit capture is underway: such blocks are passed over then).
/// - Before host memory is returned to its upstream, the allocator waits for work that may still use it (CUDA's
///   cudaFree synchronizes the device by itself). For that it records a "fence" event when a block is freed on a
///   stream that may still have work pending (a CUDA stream under cross-stream reuse, or a busy CPU queue).
/// - Footprint (gpukit's defaults, measured in bench_fragmentation): requests below medium_size share segments that
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
///   legacy default stream (stream_ops.hpp). Events and waits on the legacy stream are made under a capture hold
///   (StreamOps::needs_capture_hold): while a gpukit capture is underway an event is recorded after it, its block
///   pending until then, and the legacy stream takes no other stream's fenced block. The state of a stream that holds
///   nothing (nothing cached, allocated, recorded or pending) is dropped in sweeps amortized over registrations, so
///   creating and destroying streams does not grow the allocator.
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
#include <gpukit/memory/detail/device_mutex.hpp>
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
#include <string_view>
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

/// ... that can wait for the device apart from unmapping (wait_before_unmap, then unmap_after_wait, upstream.hpp): the
/// allocator waits without its lock held.
template <class U, class = void>
struct has_unmap_after_wait : std::false_type {};
template <class U>
struct has_unmap_after_wait<U, std::void_t<decltype(bool{std::declval<U&>().wait_before_unmap()}),
                                           decltype(bool{std::declval<U&>().unmap_after_wait(nullptr, std::size_t{})})>>
    : std::true_type {};

/// ... and that can wait for given events instead of the whole device before unmapping (wait_before_unmap(after),
/// upstream.hpp): the allocator then waits only for the streams that may still use the pages.
template <class U, class Event, class = void>
struct has_unmap_wait_for_events : std::false_type {};
template <class U, class Event>
struct has_unmap_wait_for_events<
    U, Event,
    std::void_t<decltype(bool{std::declval<U&>().wait_before_unmap(std::declval<const std::vector<const Event*>&>())})>>
    : std::true_type {};

/// Upstreams that can give a segment back once events complete, without a wait on the host (upstream.hpp).
template <class U, class Event, class = void>
struct has_ordered_release : std::false_type {};
template <class U, class Event>
struct has_ordered_release<U, Event,
                           std::void_t<decltype(std::declval<U&>().deallocate_after(
                               nullptr, std::size_t{}, std::declval<const std::vector<const Event*>&>()))>>
    : std::true_type {};

/// Upstreams that hold segments back while a capture runs (capture_held_segments), and give them back when asked.
template <class U, class = void>
struct has_held_release : std::false_type {};
template <class U>
struct has_held_release<U, std::void_t<decltype(std::declval<U&>().release_held())>> : std::true_type {};

/// ... which may say at run time that the device has none (device_upstream: the CPU, or an old driver or GPU).
template <class U, class = void>
struct has_virtual_memory_query : std::false_type {};
template <class U>
struct has_virtual_memory_query<U, std::void_t<decltype(std::declval<const U&>().virtual_memory_supported())>>
    : std::true_type {};

/// Upstreams that can make the device give back memory held outside the allocator (cuda_upstream: the default memory
/// pool's unused memory), the last resort before out of memory.
template <class U, class = void>
struct has_release_elsewhere : std::false_type {};
template <class U>
struct has_release_elsewhere<U, std::void_t<decltype(std::declval<U&>().release_unused_elsewhere())>> : std::true_type {
};

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
  /// the upstream takes a device, like device_upstream). Makes no CUDA call, except with
  /// allocator_options::expandable_segments_required: it then asks whether the device has virtual memory, and throws
  /// invalid_argument_error (an upstream without it) or no_device_error (a device or driver without it).
  template <class... UpstreamArgs>
  explicit basic_caching_allocator(gpukit::device d, allocator_options options = {}, UpstreamArgs&&... upstream_args);

  basic_caching_allocator(const basic_caching_allocator&) = delete;
  basic_caching_allocator& operator=(const basic_caching_allocator&) = delete;

  /// Returns every segment to the upstream (after the work that may use them). Allocations still live at this point
  /// are a bug in the program: they are reported through gpukit::warn and their memory is released anyway.
  ~basic_caching_allocator();

  // ---------------------------------------------------------------------------------------------------------------
  // Allocation
  // ---------------------------------------------------------------------------------------------------------------

  /// `bytes` of memory usable on `stream` at once (stream-ordered), aligned to at least min(rounding, 256) bytes.
  /// Zero bytes gives nullptr. Throws out_of_memory_error when the upstream (or the reserved limit) cannot supply it
  /// even after the cache is released; invalid_argument_error for a stream of another device, a size that
  /// overflows when rounded, or a stream being captured into a CUDA graph.
  [[nodiscard]] void* allocate(std::size_t bytes, const stream_type& stream);

  /// Frees `p` in the order of the stream it was allocated on: the block can be reused on that stream at once, and
  /// on other streams once the work recorded with record_stream completes. nullptr is ignored. Throws
  /// invalid_argument_error for a pointer this allocator does not own (never allocated here, already freed, or
  /// pointing inside an allocation), and, leaving it allocated, while its stream or a stream recorded for it is
  /// being captured into a CUDA graph. A second free of a pointer is detected when it is ordered after the first
  /// (the same thread, or synchronized); two frees of one pointer racing on two threads are a data race in the
  /// program, as they are with malloc.
  void deallocate(void* p);

  /// Frees `p` after the work enqueued so far on `stream` as well (as if record_stream(p, stream) had been called),
  /// for memory last used on a stream other than its own. The stream may belong to another CUDA device (a peer copy
  /// read it), as with record_stream.
  void deallocate(void* p, const stream_type& stream);

  /// Notes that `stream` uses the allocation at `p` (like torch's Tensor.record_stream): when `p` is freed, its
  /// block is reused only after the work enqueued on `stream` until then has completed. `stream` may belong to
  /// another CUDA device (a peer copy): the event is then one of that device, recorded with it current. It may be
  /// destroyed before the free: the block then waits for its last work.
  void record_stream(void* p, const stream_type& stream);

  /// True when `p` is the start of a live allocation of this allocator.
  [[nodiscard]] bool owns(const void* p) const noexcept;

  /// The bytes `p` was allocated with (as requested, before rounding). Throws for pointers not owned.
  std::size_t allocation_size(const void* p) const;

  // ---------------------------------------------------------------------------------------------------------------
  // Statistics
  // ---------------------------------------------------------------------------------------------------------------

  /// Every statistic. Each value is one the statistic had (read without a lock; see consistent_read), but the values
  /// are read one by one: while other threads allocate, a statistic's current, allocated and freed counts (and a
  /// pool's sum) can disagree by the operations made meanwhile. Take snapshot() for a consistent set.
  allocator_stats stats() const noexcept;

  /// Bytes handed out to users (rounded), like torch.cuda.memory_allocated().
  std::size_t memory_allocated() const noexcept;
  /// Bytes held from the upstream, like torch.cuda.memory_reserved().
  std::size_t memory_reserved() const noexcept;
  /// Peak of memory_allocated() since the last reset_peak_stats().
  std::size_t max_memory_allocated() const noexcept;
  /// Peak of memory_reserved() since the last reset_peak_stats().
  std::size_t max_memory_reserved() const noexcept;

  /// Starts new peaks from the current values (e.g. to measure one phase of a program).
  void reset_peak_stats() noexcept;
  /// Zeroes the totals allocated/freed and the counters (retries, OOMs, upstream calls, ...).
  void reset_accumulated_stats() noexcept;

  /// The cached free memory's layout (walks the segments under the lock: for reports, not hot paths).
  free_space_info free_space() const;

  /// Every segment and block with the statistics, consistent with each other.
  allocator_snapshot snapshot() const;

  /// Calls `f(address, bytes)` (noexcept) for every segment: where it starts and its bytes of address space (of an
  /// expandable segment, its reserved virtual range). Under the lock; records nothing in the memory history.
  template <class F>
  void for_each_segment(F&& f) const {
    std::lock_guard<detail::device_mutex> lock(mutex_);
    for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) f(seg->address, seg->size);
  }

  /// A table of the statistics like torch.cuda.memory_summary(), with the largest free block and fragmentation.
  std::string memory_summary() const;

  // ---------------------------------------------------------------------------------------------------------------
  // Control
  // ---------------------------------------------------------------------------------------------------------------

  /// Waits for pending events, then returns every completely free segment to the upstream. Memory still allocated
  /// (or in a segment with an allocated block) stays: memory_summary() shows it as non-releasable. So do blocks whose
  /// event on the legacy default stream a gpukit capture underway keeps from being recorded (not waited for).
  void empty_cache();

  /// Like empty_cache(), but stops once reserved memory is at most `target_reserved` bytes, releasing the largest
  /// free segments first. Returns the reserved bytes afterwards (more than the target if too little is free).
  std::size_t trim(std::size_t target_reserved);

  /// Caps reserved memory at `bytes` (allocator_options::unlimited for none), releasing free segments at once if
  /// the cache is above it. Allocations that would exceed it free cache and retry, then throw out_of_memory_error.
  void set_reserved_limit(std::size_t bytes);

  /// Caps reserved memory at a fraction (0, 1] of the upstream's total (the device's memory), like
  /// torch.cuda.set_per_process_memory_fraction but without depending on garbage collection.
  void set_memory_fraction(double fraction);

  /// Calls `observer` with the numbers of every out-of-memory error, just before it is thrown: from the allocating
  /// thread, outside the allocator's lock, so it may use the allocator (snapshot, memory_summary, free buffers to
  /// shed load; the failed request is not retried). One that throws is reported through gpukit::warn and the error
  /// is thrown all the same. Returns an id for remove_out_of_memory_observer.
  std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer);
  /// Removes an observer; returns false when no observer has that id. Once it returns, the observer is not called
  /// again and its calls on other threads have ended, so what it uses may be destroyed (the exceptions, which prevent
  /// deadlocks: detail::out_of_memory_observers::remove). An observer whose own allocation from this allocator fails
  /// gets the error, and the observers are not called for it.
  bool remove_out_of_memory_observer(std::uint64_t id);

  /// Records this allocator's events into `history` from now on (memory_history.hpp); nullptr stops recording.
  /// While no history is set, the cost is one acquire load (a plain load on x86) and a branch per call. A history once
  /// set is kept alive until the allocator is destroyed (a call on another thread may still be recording into it), so
  /// setting a new history per step grows without bound: reuse one, clear()ing it.
  void set_memory_history(std::shared_ptr<memory_history> history);
  /// The history being recorded into, or null.
  std::shared_ptr<memory_history> history() const;

  /// The limit on reserved bytes (allocator_options::unlimited when none), read without locking.
  std::size_t reserved_limit() const noexcept;
  /// The options the allocator was built with (their reserved_limit is the initial one; see reserved_limit()).
  const allocator_options& options() const noexcept;
  /// The device whose memory this allocator hands out.
  gpukit::device device() const noexcept;
  /// The upstream segments come from (e.g. for address_space_upstream's used() and set_capacity()).
  Upstream& upstream() noexcept;
  /// The upstream segments come from, read-only.
  const Upstream& upstream() const noexcept;
  /// The stream ops the allocator uses (tests drive their fake streams through it).
  StreamOps& stream_operations() noexcept;
  /// How many streams the allocator keeps state for (diagnostics and tests).
  std::size_t stream_count() const;

  /// The rounded size a request of `bytes` is served with: 0 for 0 (throws invalid_argument_error on overflow).
  std::size_t rounded_size(std::size_t bytes) const;
  /// The segment size a rounded request `size` would get from the upstream on a cache miss.
  std::size_t segment_size_for(std::size_t size) const;

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

  // Lines of its own (detail::false_sharing_range): threads freeing and taking blocks in front caches do not share
  // lines, nor pairs of lines.
  struct alignas(detail::false_sharing_range) block {
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
    std::uint64_t free_since = 0;  // free_clock_ when it last went back to the heap (the latest of merged blocks)
    block_state state = block_state::free;
    bool small = false;
    bool taken_split = false;  // counts_as_split when allocated (cannot change until it is free)
    bool split_whole = false;  // found by reuse_before_release's search: take() splits it, dedicated or not
    // Taken whole in an expandable segment with pages of its tail unmapped (pages are mapped for the request, and the
    // remainder was too small to split off): never cached in front, where a request of its whole size would get it
    // without mapping them (found by review: a fault on the unmapped tail). Written under the lock by take().
    bool partly_mapped = false;
    // In a front cache: allocated to the heap (and in the pointer map), free to the user. Written under the slot's
    // lock; read without it by a free, which is ordered after the allocation that cleared it.
    std::atomic<bool> in_front{false};
  };

  struct segment {
    std::uintptr_t address = 0;
    std::size_t size = 0;  // for an expandable segment, the reserved virtual range
    bool small = false;
    bool dedicated = false;         // made for one request of own_segment_size() or more (not shared by design)
    bool expandable = false;        // a virtual range whose pages are mapped on demand (expandable_segments)
    bool left_to_upstream = false;  // at destruction: a capture keeps the legacy stream's use of it unknown
    detail::page_map pages;         // expandable: which pages are mapped
    // Expandable: the stream whose range it is, the only one that maps pages in it (none once that stream is gone).
    stream_state* range_of = nullptr;
    /// Bytes backed by memory: the whole segment, or the mapped pages of an expandable one.
    std::size_t mapped() const noexcept { return expandable ? pages.mapped_bytes() : size; }
    block* first = nullptr;
    segment* prev_segment = nullptr;
    segment* next_segment = nullptr;
  };

  struct pending_record {
    std::unique_ptr<event_type> event;
    block* b = nullptr;
    // Not recorded yet: its stream needs a capture hold (the legacy default stream) and a gpukit capture was
    // underway at the free; recorded once none is (record_deferred), and incomplete until then.
    bool unrecorded = false;
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
    std::deque<pending_record> pending;    // events of this stream, in order (null: its final work; or unrecorded)
    std::size_t in_use = 0;                // allocated or pending blocks it owns, and blocks that recorded it
    bool dead = false;             // destroyed: its free blocks wait for its last work (nobody else may take them)
    bool retired = false;          // ... which has completed: its blocks belong to no stream from now on
    bool slots_released = false;   // dead, and its front slots gave their blocks to the heap (release_slots_of_dead)
    std::uint64_t last_sweep = 0;  // the stream-registry sweep during which it last allocated (abandoned_state)
    int pins = 0;  // allocations on it in progress, which may release the lock: prune_streams keeps it meanwhile
    segment* expandable[2] = {nullptr, nullptr};  // its expandable segments: [1] small, [0] large
  };

  struct all_stats_t {
    detail::atomic_pool_stats allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
        active_bytes, inactive_split_bytes, requested_bytes;
    detail::atomic_counter num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free,
        num_device_free_unforced, num_lock_waits;
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
  /// The counters that follow quantity q in a slot of small blocks (or of large ones): two statistics at most, each
  /// counted in all pools and in the slot's pool.
  struct quantity_counters {
    std::array<std::size_t, 4> k{};
    std::size_t n = 0;
    const std::size_t* begin() const noexcept { return k.data(); }
    const std::size_t* end() const noexcept { return k.data() + n; }
  };
  using quantity_table = std::array<std::array<quantity_counters, detail::front_quantity_count>, 2>;
  static constexpr quantity_table make_quantity_table() noexcept {
    quantity_table t{};
    for (std::size_t large = 0; large < 2; ++large) {
      for (std::size_t k = 0; k < counter_count; ++k) {
        const std::size_t q = quantity_of(k, large != 0);
        if (q == detail::front_quantity_count) continue;
        quantity_counters& c = t[large][q];
        c.k[c.n++] = k;
      }
    }
    return t;
  }
  static constexpr quantity_table quantity_counters_table = make_quantity_table();
  static const quantity_counters& counters_of(std::size_t q, bool large_slot) noexcept {
    return quantity_counters_table[large_slot ? 1 : 0][q];
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
  GPUKIT_DETAIL_ALWAYS_INLINE detail::atomic_pool_stats& stat_ref(std::size_t id) noexcept {
    return stats_.*stat_members[id];
  }
  GPUKIT_DETAIL_ALWAYS_INLINE const detail::atomic_pool_stats& stat_ref(std::size_t id) const noexcept {
    return stats_.*stat_members[id];
  }

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
      std::lock_guard<detail::device_mutex> lock(mutex_);
      fronts_lock all(*this);
      return read();
    }
    return read();
  }

  /// The statistics, each value read atomically: consistent with each other when the caller holds the device lock
  /// and every slot lock, or when there are no front caches.
  allocator_stats read_stats() const noexcept;

  /// Statistic `id` as users see it: the heap's counters plus the front caches' differences.
  pool_stats load_stat(std::size_t id) const noexcept;
  std::size_t user_current(std::size_t id) const noexcept;

  static std::size_t current(const detail::atomic_pool_stats& s) noexcept;
  static std::size_t peak(const detail::atomic_pool_stats& s) noexcept;
  static std::int64_t as_delta(std::size_t v) noexcept;

  // --- sizes ---

  [[noreturn]] void throw_overflow(std::size_t bytes) const;

  // The growth policy is detail/segment_sizing.hpp; these read it with this allocator's options and state.
  std::size_t round_request(std::size_t bytes) const;
  std::size_t segment_size(std::size_t size, bool small) const noexcept;
  std::size_t fitted_segment_size(std::size_t size, bool small) const noexcept;
  bool should_split(const block* b, std::size_t size, std::size_t remainder) const noexcept;

  // --- streams and events ---

  /// The state of stream `s`, registered on first use (detail/stream_registry.hpp). Streams of other CUDA devices
  /// are accepted only where `other_devices` (record_stream, deallocate(p, s)).
  ///
  /// The device is checked first, on every call: computing the key may need the stream's device (a CUDA default
  /// stream's id), and a stream of another device must be refused with that reason, not with the error its key would
  /// raise, even when its key equals that of a stream seen before (keys are the stream ops' business; a CUDA default
  /// stream must not pass for the CPU's). Naming the wrong device needs no CUDA call (a CPU allocator on a machine
  /// without a driver still says "wrong device"). For a view that knows its device (every gpukit stream and
  /// default_stream(d)) this costs nothing; a raw cudaStream_t costs a lookup (stream_view::device()).
  stream_state& stream_for(const stream_type& s, bool other_devices = false);

  [[noreturn]] void throw_wrong_device(gpukit::device d) const;

  /// Two streams of different devices with one key: the stream ops broke their contract (keys are unique across
  /// devices), and the allocator would take one stream for the other.
  [[noreturn]] void throw_key_collision(gpukit::device known, gpukit::device passed, std::uintptr_t key) const;

  /// The CUDA ordinal for exceptions (-1 for the CPU).
  int device_ordinal() const noexcept;

  /// Registers stream `s` of device `d` (checked by stream_for) under `key`.
  stream_state* register_stream(const stream_type& s, std::uintptr_t key, gpukit::device d);

  /// Removes the states of streams that hold nothing: no cached, allocated or pending block, no event, and not a
  /// destroyed stream whose work is still running. They are made again if the stream comes back.
  void prune_streams();

  /// A stream abandoned while others keep being created (a server making a stream per request, raw handles above
  /// all, whose destruction the allocator cannot see): it holds only cached memory and allocated nothing since the
  /// last sweep, i.e. while at least min_prune_at other streams were registered. A fixed set of streams makes no
  /// sweeps, so no stream of it is ever abandoned.
  bool abandoned_state(const stream_state& st) const noexcept;

  /// Before the footprint grows under stream churn: returns the completely free segments whose blocks all belong to
  /// abandoned streams to the upstream, so memory cached for streams that are gone does not pile up
  /// until the device runs short. Counted as unforced frees; the states, then empty, go at the next sweep.
  std::size_t release_abandoned(std::unique_lock<detail::device_mutex>& lock);

  // --- stream lifetimes (stream_ops.hpp: gpukit streams are tracked, raw handles are not) ---

  bool expired(const stream_state& st) const noexcept;
  bool owner_expired(const block* b) const noexcept;
  bool finished(const stream_state& st) const;

  /// Marks the states of streams destroyed since the last look (an O(streams) scan, once per destruction), and
  /// empties their front slots.
  void note_expirations();

  /// The front slots of the streams found destroyed since the last call (device lock held) give their blocks to the
  /// heap, where they wait for the stream's last work, whichever path noticed the destruction (note_expirations, or
  /// free_allocated, which cannot: it may run under the slot locks): cached, they would hold the slot and their
  /// memory for a stream that never asks again. A free racing the destruction cannot cache a block after this:
  /// front_give_to finds the slot marked (owner_gone) under its lock. The slots are marked unused since another
  /// stream last asked, so the first stream to ask takes one over instead of the second (owners are never reset to
  /// unowned: see front_slot_at). If taking a block back throws, the next request tries again.
  void release_slots_of_dead();

  /// Retires the destroyed streams whose last work has completed (polled, never waited for).
  void retire_finished();

  /// A destroyed stream's work has completed: its free blocks go to no stream, so any stream may take them at once
  /// (those in a range another stream has go to that stream: heir_of).
  void retire(stream_state* st);

  /// Who a free block of a retired stream goes to: the stream whose range holds it, else no stream (any may take it).
  stream_state* heir_of(const block* b) const noexcept;

  /// Free block `b`, whose work has completed, becomes `heir`'s (its fence recycled) and merges with `heir`'s free
  /// neighbours; returns the merged block. `heir`'s index for `b`'s pool must exist (then nothing can throw).
  block* give_free_block(block* b, stream_state* heir);

  /// `st` is gone (retired, or its state pruned): its ranges belong to no stream until one without a range takes one.
  static void disown_ranges(const stream_state& st) noexcept;

  /// `st`, without a range of its own in `range`'s pool, takes over `range` (of a stream gone) and its unowned free
  /// blocks: a stream created in place of a destroyed one continues where it left off. False (nothing changed) when
  /// `st`'s index cannot be made.
  bool take_over(stream_state& st, segment* range) noexcept;

  void wait_finished_quietly(const tracker_type& tracker) noexcept;

  /// Waits (lock released) until the work of every destroyed stream has completed, and retires them.
  void wait_for_dead_streams(std::unique_lock<detail::device_mutex>& lock);

  std::string describe(const stream_state& st) const;

  /// The warning for freeing `b` after its stream was destroyed (a stream must outlive its allocations).
  std::string expired_owner_message(const block* b) const;

  /// An event of device `d` (an event can be recorded only on streams of its own device): a pooled one, or new.
  std::unique_ptr<event_type> acquire_event(gpukit::device d);

  /// Pools event `e` of device `d` (none: nothing to do).
  void recycle_event(std::unique_ptr<event_type> e, gpukit::device d) noexcept;

  void synchronize_quietly(const event_type& e) noexcept;

  void note_stream_use(block* b, stream_state& st);

  /// Forgets the streams recorded for `b` (their events, if any, are pending by now).
  void clear_recorded(block* b) noexcept;

  /// A null event stands for the last work of a stream destroyed before the free.
  bool record_complete(const stream_state& st, const pending_record& record) const;

  /// Moves blocks whose events have completed back to their pools. Events recorded on one stream complete in
  /// order, so each stream's queue is polled only up to its first incomplete event.
  void process_events();

  /// Whether recording or waiting on `s` must be done under a detail::capture_hold (StreamOps::needs_capture_hold).
  bool needs_capture_hold(const stream_type& s) const noexcept;
  /// Records `e` on `st` (a stream of this device or, for record_stream, another's: recorded with that one current).
  void record_on(event_type& e, const stream_state& st);
  /// Records the pending events a gpukit capture kept from being recorded (pending_record::unrecorded), unless one
  /// is still underway; a record that fails is tried again at the next call.
  void record_deferred() noexcept;

  void complete_pending(block* b);

  // The heap's side of allocate and deallocate, out of line so that the front caches' path stays small.

  /// A block of `size` bytes (`bytes` asked) from the heap: found free, or a new one from the upstream.
  GPUKIT_DETAIL_NOINLINE void* allocate_from_heap(const stream_type& stream, std::size_t bytes, std::size_t size,
                                                  bool small);

  /// Gives live block `b` (the user freed it) back to the heap; `busy`: its stream may still use it.
  GPUKIT_DETAIL_NOINLINE void free_to_heap(block* b, bool busy, bool expired_owner);

  /// The device lock for a heap operation. A wait for it is counted (num_lock_waits) before waiting; for a large
  /// block (`large`), watch_contention_ may turn front_cache_large_ on.
  std::unique_lock<detail::device_mutex> lock_for_heap(bool large);

  /// Under the device lock: a large block's heap operation waited for the lock (or not). Turns front_cache_large_
  /// on once 8 of the last 64 such operations waited.
  void watch_large_contention(bool waited) noexcept;

  // --- statistics and front caches (detail/front_cache.hpp explains the claims) ---

  using front_slot_type = detail::front_slot<block>;
  static_assert(front_slot_type::unowned == no_stream_key, "a slot never owned has the key of no stream");
  /// Slots [0, 16) cache small blocks; slots [16, 32) large ones once front_cache_large_ is on (fronts_used_ 32).
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
  slot_range<front_slot_type> used_fronts() noexcept;
  slot_range<const front_slot_type> used_fronts() const noexcept;
  /// The slots some stream has owned (owners change, but never back to none), in the order they were first owned
  /// (device lock). A slot never owned holds no
  /// block and no claim, and only a holder of the device lock gives it an owner (front_give_slow), so the paths that
  /// hold the device lock lock and rebalance these alone: one slot for one stream, not 32 (when every slot was
  /// locked and rebalanced, a cycle of 9 sizes on one stream, one of them served by the heap, cost 1.3 us a pair).
  slot_range<front_slot_type* const> owned_fronts() const noexcept;
  /// Adds `slot`, never owned before, to owned_fronts (the device lock held, and the slot's lock).
  void note_owned(front_slot_type& slot) noexcept;
  bool is_large_slot(const front_slot_type& slot) const noexcept;
  /// Slot's part of counter k (the users' view minus the heap's).
  std::int64_t front_value(const front_slot_type& slot, std::size_t k) const noexcept;

  /// Marks every owned slot as changing (their locks held): lock-free readers of the statistics retry meanwhile, for
  /// changes that move values between the heap and the slots or reset peaks. A slot never owned keeps its zeros.
  class all_changing {
   public:
    explicit all_changing(basic_caching_allocator& a) noexcept {
      std::size_t i = 0;
      for (front_slot_type* slot : a.owned_fronts()) changes_[i++].emplace(slot->sequence);
    }

   private:
    std::array<std::optional<detail::sequence_write>, front_slot_count> changes_;
  };

  /// Holds the lock of every owned slot, the device lock held (taken first). Only the device lock's holder waits
  /// for a slot lock while holding another (a fast path that holds its own slot's lock only try-locks others:
  /// borrow_claims), and a slot gets an owner only under the device lock, so the set cannot grow unseen and no order
  /// among the slots is needed.
  class fronts_lock {
   public:
    explicit fronts_lock(const basic_caching_allocator& a) noexcept : slots_(a.owned_fronts()) {
      for (const front_slot_type* s : slots_) s->mutex.lock();
    }
    fronts_lock(const fronts_lock&) = delete;
    fronts_lock& operator=(const fronts_lock&) = delete;
    ~fronts_lock() {
      for (front_slot_type* const* s = slots_.last; s != slots_.first;) (*--s)->mutex.unlock();
    }

   private:
    slot_range<front_slot_type* const> slots_;
  };

  /// Adds `d` to statistic `id` of the heap (device lock held), keeping its peak that of the users' view. Inlined,
  /// `id` a constant there: the heap's path makes 10 to 14 of these per allocate+free pair.
  GPUKIT_DETAIL_ALWAYS_INLINE void count(stat_id id, bool small, std::int64_t d) noexcept {
    detail::atomic_pool_stats& s = stat_ref(id);
    if (fronts_active_ && fronted(id)) {
      count_with_fronts(s.pools[0], id * 3, d);
      count_with_fronts(s.pools[small ? 1 : 2], id * 3 + (small ? 1 : 2), d);
    } else {
      s.add(small, d);
    }
  }

  /// The heap's part `g` of counter `k` changes while front caches hold blocks: the peak is that of the sum.
  /// An increase is covered by the peak before it is stored, so lock-free readers never see a value above it.
  GPUKIT_DETAIL_ALWAYS_INLINE void count_with_fronts(detail::atomic_stat& g, std::size_t k, std::int64_t d) noexcept {
    if (d < 0) {
      slack_[k] += -d;
    } else if (!peaks_deferred_) {
      if (slack_[k] >= d) {
        slack_[k] -= d;
      } else {
        raise_peak_with_fronts(k, d);
      }
    }
    g.add_current(d);
  }

  /// count_with_fronts' slow path: takes back what the slots' claims hold above their values, one slot lock at a
  /// time, until the heap has room for `d` under counter `k`'s peak; else takes every slot lock and rebalances
  /// counter `k` before `d` is added.
  GPUKIT_DETAIL_NOINLINE void raise_peak_with_fronts(std::size_t k, std::int64_t d) noexcept;
  /// raise_peak_with_fronts' first look (device lock held): takes back up to `missing` of the slots' claims for
  /// counter `k` above their values, one slot lock at a time, into slack_; true when it found all of it.
  bool take_spare_claims(std::size_t k, std::int64_t missing) noexcept;

  /// With the device lock and every slot lock held: records the true value of counter `k` in its peak, lets every
  /// slot keep its current value, and takes back claims (others' before `acting`'s) until peak >= heap + claims.
  /// Counters that follow one quantity share the slots' claims for it: a claim taken back for counter k is room
  /// under the others' peaks too, added to their slack_.
  /// `pending`: an increase of the heap's part about to be stored, counted as if it were.
  void rebalance(std::size_t k, const front_slot_type* acting, std::int64_t pending = 0) noexcept;

  void rebalance_all() noexcept;

  /// With every lock held, after slot's quantities rose: records the peaks of the counters that rose, resets the
  /// claims (a block left: allocation, active and requested rose; one entered: inactive-split rose), and gives
  /// `slot` the room left under those peaks (taken from slack_).
  void rebalance_risen(front_slot_type& slot, bool left) noexcept;
  /// Moves `amount` of room under the peaks of quantity q's counters (slack_) into `slot`'s claim on q (the device
  /// lock and the slot's lock held): the heap may find spare claims again (spare_exhausted_ cleared).
  void grant_claim(front_slot_type& slot, std::size_t q, std::int64_t amount) noexcept;
  /// The reverse: `amount` of `slot`'s claim on q back into the room of every counter of q (the same locks held).
  void return_claim(front_slot_type& slot, std::size_t q, std::int64_t amount) noexcept;

  /// The `probe`-th slot for stream `key`'s small blocks (or large ones): linear probing from the key's hash. A
  /// stream's slots come before the first slot never owned in its sequence, as owners are never reset to unowned.
  front_slot_type& front_slot_at(std::uintptr_t key, std::size_t probe, bool large) noexcept;
  /// The key of the stream that owns `slot` (detail::front_owners).
  std::atomic<std::uintptr_t>& owner_of(const front_slot_type& slot) noexcept;

  /// A cached block of exactly `size` bytes for the stream `key`, taken for a request of `requested` bytes and put
  /// in the pointer map; nullptr when there is none (the heap then serves the request).
  GPUKIT_DETAIL_FLATTEN block* front_take(std::uintptr_t key, std::size_t size, std::size_t requested, bool large);
  /// front_take's search of the slots past the home slot.
  GPUKIT_DETAIL_NOINLINE block* front_take_probing(std::uintptr_t key, std::size_t size, std::size_t requested,
                                                   bool large);

  /// What front_take found in one slot: the block it took (or nullptr), and whether the next slot may hold one.
  struct probe_outcome {
    block* taken;
    bool search_on;
  };
  /// front_take's work in one slot of its search: takes a block of `size` there if the slot is stream `key`'s.
  probe_outcome front_take_at(front_slot_type& slot, std::uintptr_t key, std::size_t size, std::size_t requested,
                              bool large);

  /// Moves `need` of the claims of other slots of the pool to `slot` (its lock held), from those whose locks are free
  /// at once and who can spare some; false when they cannot spare it all (the slow path then rebalances). The claims'
  /// sum stays the same, so no peak needs a look: with one thread taking turns on two streams at the peak, only one
  /// slot can hold the room for a take, and every pair took the slow path (every lock) to move it.
  bool borrow_claims(front_slot_type& slot, typename front_slot_type::amounts need) noexcept;

  /// When borrow_claims could not: with the device lock if it is free at once (a try_lock: `slot`'s lock is held),
  /// gives `slot` the room under the peaks (slack_) of each quantity it needs, topped up from other slots' spare
  /// claims whose locks are free. False when `need` is not there (the slow path then records a new peak). A small
  /// block taken and freed beside a large one (the common step: a small and a large temporary, at the step's peak)
  /// moved the same room between the slot and the heap (or the large blocks' slot) every step, through the slow
  /// path and the heap's every-lock path each time.
  GPUKIT_DETAIL_NOINLINE bool claim_from_heap(front_slot_type& slot, typename front_slot_type::amounts need) noexcept;

  /// Hands out the top block of `bin` (the slot's lock held; every lock when `slow`).
  block* take_cached(front_slot_type& slot, typename front_slot_type::bin& bin, std::size_t requested, bool slow);

  /// Caches `b` in `bin` (the slot's lock held; every lock when `slow`).
  void give_cached(front_slot_type& slot, typename front_slot_type::bin& bin, block* b, bool slow) noexcept;

  GPUKIT_DETAIL_NOINLINE block* front_take_slow(std::uintptr_t key, std::size_t size, std::size_t requested,
                                                bool large);

  enum class front_result { cached, no_room, already_free };

  /// Caches block `b` (freed by the user on its own live stream, recorded by no other) in its stream's front slot.
  /// no_room when the slot is taken by another stream, or full and nothing in it is stale, or the stream was
  /// destroyed meanwhile (the heap then takes the block); already_free when another free of the same pointer cached
  /// it first. Throws only when a stale bin's blocks cannot go back to the heap (see flush_bin): `b` is still
  /// allocated then.
  GPUKIT_DETAIL_FLATTEN front_result front_give(block* b);
  /// front_give's search of the slots, from the home slot on.
  GPUKIT_DETAIL_NOINLINE front_result front_give_probing(block* b);

  /// front_give's work once it holds the lock of stream `b->owner`'s own slot.
  GPUKIT_DETAIL_FLATTEN front_result front_give_to(front_slot_type& slot, std::unique_lock<detail::spin_mutex>& lock,
                                                   block* b);

  /// A slot's owner and use() as front_give_to saw them under the slot's lock, before it went the slow way.
  struct slot_seen {
    std::uintptr_t owner;
    std::uint64_t use;
  };
  slot_seen seen_by_fast_path(front_slot_type& slot) noexcept;

  /// front_give with every lock held, for `chosen`, the slot front_give picked, or, when it no longer may be used
  /// (it changed hands, or its owner used it, since front_give_to saw it as `seen`), the stream's own slot or one
  /// never owned.
  GPUKIT_DETAIL_NOINLINE front_result front_give_slow(block* b, front_slot_type& chosen, slot_seen seen);

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
  void flush_bin(front_slot_type& slot, typename front_slot_type::bin& bin);

  /// Takes every cached block back into the heap (device lock held), so it can coalesce, serve other sizes and be
  /// released. Returns whether there were any. Throws only when freeing a block does (an event could not be
  /// recorded): that block stays cached.
  bool flush_fronts(bool large_only = false);

  // --- blocks ---

  /// Records the free of a block entering a front cache: requested, and completed at once (reusable on its stream).
  GPUKIT_DETAIL_NOINLINE void note_cached_free(const block* b) const noexcept;

  /// Records an allocation just handed out (only called while a history is set).
  GPUKIT_DETAIL_NOINLINE void note(memory_action action, const block* b) const noexcept;

  /// The block of the live allocation at `address`, or nullptr (never allocated, freed, or cached in front: a
  /// cached block stays in the map, marked, so that its next allocation and free skip the map). No lock taken.
  /// A flush (another thread) may take a cached block to the heap between the lookup and the look at its mark: it
  /// erases the block from the map before clearing the mark (release), so a cleared mark seen here (acquire) with
  /// the shard changed since the lookup sends us to the map again. Without that, a second free ordered after the
  /// first could cache a block the heap holds (found by review; test "a double free racing with a flush").
  block* live_block(std::uintptr_t address) const noexcept;

  block* new_block();

  void recycle(block* b) noexcept;

  /// The free-block index of `st`'s small or large pool, made when it has none (the only step that allocates).
  index_type& index_in(stream_state& st, bool small);
  /// index_in(*b->owner, b->small).
  index_type& index_of(block* b);

  /// Whether free block `b` counts as inactive split (PyTorch's non-releasable memory): a piece of a split segment,
  /// not of an expandable one, whose free pages empty_cache unmaps (PyTorch leaves those out too).
  static bool counts_as_split(const block* b) noexcept;
  /// Whether the memory of block `b` may go back to the upstream now: it is free, and not held for a destroyed stream's
  /// last work (`quarantine`: an upstream that does not wait for the device on a free).
  static bool releasable(const block* b, bool quarantine) noexcept;

  /// Puts a free block in its stream's pool; counts it as inactive-split when it is a piece of a segment.
  void index_free(block* b);

  void unindex_free(block* b) noexcept;

  /// Keeps the later of two fences of the same stream (its work includes the earlier one's).
  void absorb_fence(block* into, block* from) noexcept;

  /// A freed block (no longer allocated or pending) joins its pool. Its stream's, unless that stream was destroyed
  /// and its work has completed: then no stream's.
  void return_to_pool(block* b);

  /// Free neighbour `n` can join a free block of `owner`: it is that stream's too, or no stream's (unused by all).
  bool joinable(const block* n, const stream_state* owner) const noexcept;

  /// Indexes free block `b` in its stream's pool, joined with its joinable free neighbours. A neighbour of no stream
  /// may itself border a free block of b's stream, hence the loops (two steps at most each way). Returns the block
  /// `b` ended in.
  block* insert_free(block* b);

  /// Which free blocks find_free considers.
  enum class free_search {
    ordinary,     ///< what max_split_size and max_oversize_waste allow
    mapped_only,  ///< only blocks of expandable segments whose first `size` bytes are mapped
    kept_whole,   ///< only blocks those two keep from the request (reuse_before_release), split when taken
  };
  /// Best fit for `size` bytes among the free blocks `st` may take (its own, those of destroyed streams, others' with
  /// cross_stream_reuse), of those `search` considers. A block that needs pages must lie in `st`'s range, or in one
  /// no stream has while `st` has none (which `st` then takes over).
  block* find_free(stream_state& st, std::size_t size, bool small, free_search search = free_search::ordinary);

  /// Turns free block `b` (in a pool) into an allocation of `size` bytes on `st`, splitting off the remainder. False
  /// (nothing changed) when `st` would have to wait for another stream's fence on the legacy default stream and a
  /// gpukit capture began since find_free looked: the caller searches again (find_free passes such blocks over then).
  [[nodiscard]] bool take(block* b, stream_state& st, std::size_t size, std::size_t requested);

  /// Whether the stream that owns `b` may still have work using it (false lets a free skip the event); never when it
  /// was destroyed (`owner_gone`: owner_expired(b), which the caller has read once for both uses).
  bool owner_may_be_busy(const block* b, bool owner_gone) const;

  /// Frees an allocated block that is no longer in the pointer map. Events are recorded before any state changes,
  /// so if recording throws the block is put back as it was and the exception propagates.
  /// A destroyed stream gets no more events (its handle may be another stream's by now): its blocks wait for its
  /// final work instead (retire).
  /// `owner_busy` says whether the owner stream may still have work using the block (asked before the lock is
  /// taken: on a CPU stream the question takes the queue's own lock).
  /// `user_free`: the user freed it (recorded in the history); false for blocks the heap takes back from a front
  /// cache (their free was recorded when they were cached) and for blocks never handed out.
  void free_allocated(block* b, bool owner_busy, bool user_free = true);

  // --- growing and releasing ---

  bool within_limit(std::size_t segment_bytes) const noexcept;

  /// Gets a new segment from the upstream (lock released meanwhile) and returns it as one free block in `st`'s
  /// pool, or nullptr when the limit or the upstream refuses.
  block* grow(std::unique_lock<detail::device_mutex>& lock, stream_state& st, std::size_t size,
              std::size_t segment_bytes, bool small, bool& limit_hit);

  /// Adds a new segment of `bytes` at `address` to the list, as one free block `b` (whose pool index exists).
  void link_segment(std::unique_ptr<segment> seg, block* b, std::uintptr_t address, std::size_t bytes, bool small);

  // --- expandable segments (virtual memory) ---

  /// With expandable segments, the free block of `st`'s expandable segment of the pool that holds `size` bytes,
  /// reserving that segment first if `st` has none (no memory yet: pages are mapped when a block is taken). Null
  /// when expandable segments are off, the address space is exhausted (`refused_range` then holds the range that
  /// could not be reserved), or the request exceeds the range.
  block* grow_expandable(stream_state& st, std::size_t size, bool small, std::size_t& refused_range);

  /// Maps the unmapped pages under the first `size` bytes of free block `b` of an expandable segment. False when
  /// the reserved limit (`limit_hit`) or the upstream refuses a page; nothing stays mapped then.
  bool map_pages(block* b, std::size_t size, bool& limit_hit);
  /// The last resort once the cache is given back: the upstream's release_unused_elsewhere(), with the lock released.
  /// False (nothing asked) when the upstream has none or our own limit refused (`limit_hit`).
  bool release_elsewhere(std::unique_lock<detail::device_mutex>& lock, bool limit_hit);
  /// Counts page `i` of `seg` as mapped (statistics, history).
  void note_mapped(segment* seg, std::size_t i) noexcept;
  /// Unmaps `n` pages of `seg` (indices `pages`) that map_pages mapped for a request it then failed.
  void unmap_unused(segment* seg, const std::size_t* pages, std::size_t n) noexcept;

  /// Makes free block `b` of an expandable segment usable for `size` bytes: maps its pages, and under pressure
  /// releases cached memory (free pages included) and looks again, like allocate_slow. Returns the block to take.
  block* back_with_pages(std::unique_lock<detail::device_mutex>& lock, stream_state& st, block* b,
                         std::size_t requested, std::size_t size, bool small);

  /// Whether the first `size` bytes of free block `b` of an expandable segment have a page not mapped yet.
  bool needs_pages(const block* b, std::size_t size) const noexcept;

  /// The wait before pages of expandable segments are unmapped (wait_for_unmap), shared by everything one release
  /// unmaps: which blocks' pages it lets go (covers).
  struct unmap_wait {
    bool every_stream = false;  // the whole device was waited for (the upstream's wait_before_unmap())
    std::uint64_t horizon = 0;  // free_clock_ at the wait: a block freed since may have work the wait did not cover
    std::vector<const stream_state*> streams;  // streams whose work queued before the wait has completed
  };

  /// Waits for the work that may still use mapped pages of expandable segments, with the lock released when
  /// `unlocked` (threads allocate meanwhile; only blocks free since before the wait then lose pages). Which pages:
  /// those of the free blocks of every expandable segment (`ranges` null), or those of every block of `ranges`. A free
  /// block's pages are used only by work its owner stream queued before now (other streams' uses were waited for
  /// before it became free), so over an upstream that waits for events (wait_before_unmap(after)) the wait is for an
  /// event recorded now on each owner stream, as PyTorch's expandable segments synchronize their stream, and another
  /// thread's capture survives it; a destroyed owner's last work is waited for (wait_finished); blocks of no stream
  /// need no wait. The whole device is waited for (the upstream's wait_before_unmap()) only for an owner that cannot
  /// be recorded on (a raw handle: it may have been destroyed and its handle reused) or an upstream that waits no
  /// other way. Never for a stream being captured (the event would be the graph's), nor the device while one is
  /// (the wait would fail and invalidate the capture): their blocks keep their pages until a later release. An
  /// upstream whose unmap waits by itself is not waited for here. Never throws: what could not be waited for is not
  /// covered. `w` says what the wait covers.
  void wait_for_unmap(std::unique_lock<detail::device_mutex>& lock, const std::vector<segment*>* ranges, bool unlocked,
                      unmap_wait& w) noexcept;

  /// Whether `w` covers block `b`: its pages may be unmapped (the work of its owner, and of the streams recorded for
  /// it, was waited for, or needs none).
  bool covers(const unmap_wait& w, const block* b) const noexcept;

  /// Whether an event recorded on `st` now follows all work of the stream that may use its blocks: a stream known to
  /// be alive (tracked and not destroyed) or a default stream; not a raw handle (it may have been destroyed, and its
  /// handle be another stream's).
  bool recordable(const stream_state& st) const noexcept;

  /// Whether `st` is being captured (true where that cannot be told).
  bool captured_now(const stream_state& st) const noexcept;

  /// Unmaps (lock held) the pages of expandable segments that lie wholly in free blocks `w` covers (free_pages_of),
  /// until reserved memory is at most `target` (0: all); returns the bytes unmapped.
  std::size_t unmap_free_pages(std::size_t target, const unmap_wait& w);
  /// (Lock held, after a release that unmapped pages.) A free block of an expandable segment in a range of another
  /// stream (or of no stream) goes to that range's heir (heir_of) and merges there once no work can use it: its
  /// pages are all unmapped (they went after its work), or `w` waited for its work. Left with its stream, it split
  /// the range's free space, and a request of the range's stream then needed a page more than its size, or failed
  /// with room for it (found by the fuzzer).
  void give_to_heirs(const unmap_wait& w) noexcept;

  /// Whether a free block of an expandable segment holds a whole mapped page (one unmap_free_pages could take).
  bool has_unmappable_pages() const noexcept;

  /// Whether block `b` of expandable segment `seg` lies on a mapped page: only such a block's stream has work that may
  /// use pages to unmap. wait_for_unmap waits for exactly those streams, and unmap_victims requires exactly those
  /// blocks to be covered.
  static bool on_mapped_page(const segment* seg, const block* b) noexcept;

  /// The pages of free block `b` of expandable segment `seg` that nothing else uses: those wholly inside it, and a
  /// page it shares at either end with other blocks that are all free too (`quarantine`: releasable) and, with `w`,
  /// covered by it.
  detail::page_map::page_range free_pages_of(const segment* seg, const block* b, const unmap_wait* w,
                                             bool quarantine) const noexcept;

  /// Whether a release of `victims` (completely free segments) and of free pages has pages to unmap.
  bool has_pages_to_release(const std::vector<segment*>& victims) const noexcept;

  /// Unmaps (lock held), in place, every mapped page of the expandable segments among `victims` whose blocks `w`
  /// covers, before they are unlinked: one it does not cover wholly, or whose pages the upstream kept mapped, is
  /// dropped from `victims` and stays linked and counted, its pages unmapped at a later release (unlinked, it would
  /// hold its memory and range for good, counted nowhere). With `recheck` (the lock was released since `victims` were
  /// chosen), also drops those no longer completely free segments (taken, or released by another thread), before
  /// anything of them is read. Returns the bytes unmapped.
  std::size_t unmap_victims(std::vector<segment*>& victims, const unmap_wait& w, bool recheck);

  /// Unmaps the run of mapped pages of `seg` that starts at page `i` (and ends at `end` at most) in one upstream call
  /// (`waited`: the device was waited for after the pages' last use, so unmap_after_wait; else unmap, which on CUDA
  /// synchronizes the device); counts one upstream free per page. Returns the pages unmapped: 0 when the upstream kept
  /// them mapped (it could not wait for the device). Device lock held: no thread maps them meanwhile.
  std::size_t unmap_run(segment* seg, std::size_t i, std::size_t end, bool waited) noexcept;

  /// The upstream's unmap (unmap_after_wait when `waited`); false when it unmapped nothing (an upstream whose unmap
  /// returns void always unmaps).
  bool upstream_unmap(std::uintptr_t address, std::size_t bytes, bool waited) noexcept;

  /// An expandable segment is going: its stream reserves a new one when it needs it.
  void forget_expandable(const segment* seg) noexcept;

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
  ordered_release order_release(const segment& seg) noexcept;

  /// Gives a whole (not expandable) segment back in stream order, after the events of `ordered`; false when that is
  /// not possible or the upstream refused (nothing was done: the caller deallocates, which waits).
  bool deallocate_in_order(const segment* seg, const ordered_release& ordered) noexcept;

  /// Returns a segment's memory to the upstream (lock released): in stream order when `ordered` allows it, else
  /// cudaFree (or the upstream's deallocate); an expandable one's range is unreserved, its pages unmapped already
  /// (unmap_victims; one that kept pages mapped, which only the destructor gives here, keeps its range, with a
  /// warning).
  void return_segment(segment* seg, const ordered_release& ordered) noexcept;
  /// Records the free of an ordinary segment in the memory history (under the lock, where it is unlinked); nothing for
  /// an expandable range (its unmaps were recorded).
  void record_segment_free(const segment& seg) noexcept;

  block* allocate_slow(std::unique_lock<detail::device_mutex>& lock, stream_state& st, std::size_t requested,
                       std::size_t size, bool small);

  /// Returns completely free segments to the upstream (largest first, until reserved <= target; all when target
  /// is 0), then unmaps free pages of expandable segments until reserved <= target. With `wait_pending`, first waits
  /// on the host for every pending event, so blocks held back by other streams become free too. Returns the bytes
  /// released. Pages are unmapped after one wait (wait_for_unmap) for the ranges and the free pages together. The lock
  /// is released while waiting and freeing; with `wait_unlocked` (the users' releases), also during that wait, else
  /// (an allocation that needs every free page: a block freed during an unlocked wait would keep the pages of the
  /// free neighbours it merges with) the free pages are unmapped before the lock is first released.
  std::size_t release_cached(std::unique_lock<detail::device_mutex>& lock, bool wait_pending, std::size_t target,
                             bool wait_unlocked = false);

  /// The upstream's free and total memory, unknown where asking fails (call without the lock: it may ask the driver).
  upstream_memory_info memory_info_quietly() const noexcept;

  /// For reuse_before_release: what a new segment of `segment_bytes` lacks, under the reserved limit when it refused
  /// (`limit_hit`), else beside the upstream's free memory where it knows it (the whole segment where it does not);
  /// 0 when there is room for it.
  std::size_t growth_shortfall(std::unique_lock<detail::device_mutex>& lock, std::size_t segment_bytes, bool limit_hit);

  /// For release_before_grow (`unforced`: memory was available) and reuse_before_release: frees at least `deficit`
  /// bytes of completely free segments, disturbing the cache as little as possible: the smallest single segment that
  /// covers the deficit, else the largest ones until covered.
  std::size_t release_for_growth(std::unique_lock<detail::device_mutex>& lock, std::size_t deficit,
                                 bool unforced = true);

  /// Waits (lock released) for every pending event and returns the blocks they held back to their pools; events not
  /// recorded yet (record_deferred could not: a gpukit capture is underway) stay pending, not waited for.
  void wait_for_pending_events(std::unique_lock<detail::device_mutex>& lock);

  /// Segments whose blocks are all free. A block of a destroyed stream whose work may still run has no fence to
  /// wait for: its segment is released only to an upstream whose free synchronizes (cudaFree).
  std::vector<segment*> free_segments() const;

  /// Unlinks completely free segments and returns them to the upstream, after waiting for their fences (lock
  /// released meanwhile). `unforced`: memory was available (counted in num_device_free_unforced). The pages of
  /// expandable ones are unmapped first, while they are linked (unmap_victims): after `waited` (release_cached's wait,
  /// whose unmap_victims ran), else after a wait of its own for them (wait_for_unmap, unlocked). Returns the bytes
  /// released.
  std::size_t release_segments(std::unique_lock<detail::device_mutex>& lock, const std::vector<segment*>& victims,
                               bool unforced = false, const unmap_wait* waited = nullptr);

  /// The bytes of block `b` (of an expandable segment) that lie on mapped pages.
  std::size_t mapped_bytes_of(const block* b) const noexcept;

  free_space_info free_space_locked() const noexcept;

  // --- graph capture (stream_ops.hpp says why these operations are refused while a stream is captured) ---

  /// Whether allocate and free ask about captures now (allocator_options::capture_check).
  bool checks_captures() const noexcept;

  void refuse_if_captured(const stream_type& s, const char* operation) const;

  /// Before freeing `b` (taken out of the pointer map, so ours alone; the caller puts it back when this throws):
  /// throws if its stream is captured, since the graph's launches may use it after the free.
  void refuse_free_if_captured(const block* b) const;

  /// empty_cache and trim (lock held): refused while a stream of a live allocation is captured. Only those streams
  /// are asked, since a stream must outlive the memory allocated on it, and only while allocated.
  void refuse_release_if_captured(const char* operation) const;
  /// Segments the upstream held back during a capture that has ended go back (release_held, for upstreams that hold
  /// any: has_held_release), before empty_cache, trim and set_reserved_limit take the lock. They are not counted as
  /// reserved here; a segment held back during this very call waits for a later one.
  void release_held_segments() noexcept {
    if constexpr (detail::has_held_release<Upstream>::value) upstream_.release_held();
  }

  [[noreturn]] void throw_stream_captured(const stream_type& s, const char* operation) const;

  // --- errors ---

  [[noreturn]] void throw_out_of_memory(std::unique_lock<detail::device_mutex>& lock, std::size_t requested,
                                        std::size_t size, std::size_t segment_bytes, bool limit_hit,
                                        std::size_t page_bytes = 0, std::string_view cause = {});

  [[noreturn]] void throw_not_owned(const void* p, const char* operation) const;

  [[noreturn]] void throw_not_owned_locked(const void* p, const char* operation) const;

  gpukit::device device_;
  allocator_options options_;
  Upstream upstream_;
  StreamOps ops_{};
  bool needs_fence_ = false;
  bool front_cache_ = false;
  // Large blocks are cached in front too (slots [16, 32)): from the start with front_cache_large, else turned on
  // (never off) under the device lock once watch_contention_ sees threads wait for it on large blocks.
  std::atomic<bool> front_cache_large_{false};
  bool watch_contention_ = false;
  bool vm_refused_ = false;  // no virtual memory, or no range could be sized or reserved: not tried again

  mutable detail::device_mutex
      mutex_;  // the device lock (spin_mutex.hpp says why not std::mutex; device_mutex.hpp, warnings)
  using map_type = detail::sharded_pointer_map<block>;
  map_type map_;
  all_stats_t stats_;
  std::size_t limit_ = allocator_options::unlimited;  // guarded by mutex_
  std::atomic<std::size_t> limit_atomic_{allocator_options::unlimited};
  std::atomic<std::size_t> address_space_{0};      // reserved by expandable segments (written under mutex_)
  std::atomic<std::size_t> expandable_mapped_{0};  // bytes of pages mapped in them (written under mutex_)
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
  std::size_t unrecorded_ = 0;                     // ... of which not recorded yet (pending_record::unrecorded)
  std::uint64_t fence_counter_ = 0;
  std::uint64_t free_clock_ = 0;                            // counts blocks going back to the heap (block::free_since)
  detail::event_pool<std::unique_ptr<event_type>> events_;  // this device's, and others' for record_stream

  segment* segments_ = nullptr;
  std::vector<std::unique_ptr<block[]>> block_chunks_;
  block* spare_blocks_ = nullptr;

  std::size_t fronts_used_ = front_slots_per_pool;  // 32 when large blocks may be cached in front
  std::uint64_t large_waits_seen_ = 0;  // the last 64 large heap operations, a bit set for each wait (device lock)
  bool fronts_active_ = false;          // a block was ever cached in front (written with every lock held)
  bool peaks_deferred_ = false;         // flush_fronts is moving blocks: peaks are settled when it ends
  std::array<std::int64_t, counter_count> slack_{};  // peak - heap - claims (device lock)
  // Bit k: the heap's last look for spare claims of counter k found too little; cleared when a slot's claims rise
  // (device lock; a hint: the every-lock path is right either way).
  std::uint32_t spare_exhausted_ = 0;
  static_assert(counter_count <= 32, "one bit a counter");
  std::array<front_slot_type*, front_slot_count> owned_{};  // owned_fronts(): the first owned_count_ (device lock)
  std::size_t owned_count_ = 0;
  // Paths that take every slot lock for the claims (device lock), read by tests (caching_diagnostics): a front
  // cache's call past its claim (front_take_slow, front_give_slow), and the heap's count past its slack and the
  // slots' spare claims (raise_peak_with_fronts).
  std::size_t front_slow_paths_ = 0;
  std::size_t heap_peak_raises_ = 0;
  std::size_t heap_spare_looks_ = 0;                        // take_spare_claims' passes over the slots
  detail::front_owners<front_slot_count> front_owners_;     // read by every front-cache call, written rarely
  std::array<front_slot_type, front_slot_count> fronts_{};  // last: the large blocks' slots are cold unless used
};

GPUKIT_END_NAMESPACE

// The engine's member functions. The compiled mode leaves them out: gpukit::compiled holds the instantiation gpukit
// uses, and caching_allocator_impl.hpp is there for other template arguments.
#if GPUKIT_DETAIL_DEFINITIONS
#include <gpukit/memory/caching_allocator_impl.hpp>
#endif
