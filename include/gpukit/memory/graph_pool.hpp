// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// graph_pool: the memory of CUDA graphs. Memory a captured graph uses must stay its own for as long as the graph
/// may be launched, and a capture must not call cudaMalloc (prohibited during capture) nor record events it would
/// later query. A graph_pool reserves memory before the capture (from a backing device_resource, the device's
/// default one unless given) and hands it out during the capture with no allocating CUDA call; while a capture with a
/// pool runs (gpukit::capture, graph/graph.hpp), allocations that gpukit's caching allocators receive for the captured
/// streams come from the pool, and frees of pool memory go back to it, from any of those allocators (async_allocator
/// makes graph memory nodes in a capture instead, and does not take pool memory back). A block freed during a
/// capture is reused there only by allocations on the stream that freed it: a capture orders each stream's work, not
/// the work of streams forked into it. Blocks another stream used (record_stream, a free on another stream) wait until
/// the pool's captures have ended; blocks freed outside a capture serve any stream of later captures (the graphs, run
/// in the order they were captured, order them). Streams outside a capture that use a block (record_stream, or a free
/// on such a stream: a consumer of a graph's output) are ordered at its free by an event, which later launches of
/// the pool's graphs wait for on the device; a free without a stream is made on the stream the block was allocated on.
/// A free or record_stream on a stream captured by a capture the pool does not serve is refused (that graph would use
/// the block at each launch). The reserve goes back to the backing allocator once the pool's graphs and
/// every allocation from it are gone, ordered on the device after the work of the graphs' launches and of those
/// streams (the host does not wait for it). Direct allocations from a pool (outside a capture) wait for the reserve and
/// for those streams, not for its graphs' launches: they take only blocks no graph of the pool used. An allocation
/// on a stream captured by a capture the pool does not serve is refused. Several graphs may share a pool
/// (launched in the order they were captured, as with PyTorch's shared graph pools).
///
///     auto pool = gpukit::graph_pool::create(d, 64 << 20);   // reserve 64 MiB now, before capturing

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/capture_pools.hpp>
#include <gpukit/memory/detail/map_node.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// A graph-private memory pool (see the file comment). Create it with graph_pool::create; thread-safe.
class graph_pool final : public device_allocator {
  struct private_tag {};

 public:
  /// Allocations are aligned (and rounded) to this.
  static constexpr std::size_t alignment = 256;

  /// A pool of CUDA device `d` reserving `reserve_bytes` now from `backing` (d's default allocator unless given;
  /// it must outlive the pool), on the device's default stream (see reserve). Throws invalid_argument_error for the
  /// CPU or a backing allocator of another device, out_of_memory_error if the reserve cannot be had. (`Deferred`, never
  /// given: see default_allocator.)
  template <int Deferred = 0>
  static std::shared_ptr<graph_pool> create(gpukit::device d, std::size_t reserve_bytes,
                                            device_resource* backing = nullptr) {
    if (!d.is_cuda()) throw invalid_argument_error("gpukit::graph_pool: " + d.to_string() + " is not a CUDA device");
    device_resource& b = backing != nullptr ? *backing : default_allocator(d);
    if (b.device() != d) {
      throw invalid_argument_error("gpukit::graph_pool: the backing allocator serves " + b.device().to_string() +
                                   ", not " + d.to_string());
    }
    // The deleter keeps a pool whose memory is still allocated alive until its last allocation is freed.
    std::shared_ptr<graph_pool> pool(new graph_pool(private_tag{}, d, b), [](graph_pool* p) { p->orphan(); });
    if (reserve_bytes != 0) pool->reserve(reserve_bytes);
    return pool;
  }

  graph_pool(const graph_pool&) = delete;
  graph_pool& operator=(const graph_pool&) = delete;
  ~graph_pool() override { release_reserve(); }

  /// Adds `bytes` (rounded up to the alignment) to the reserve, taken from the backing allocator on the device's
  /// default stream, whose work may still use that memory (the caching allocator reuses a block on its stream at
  /// once): the pool's graphs, on whatever stream they are launched, and its direct allocations run after the
  /// default stream's work so far (an event; for the legacy stream, recorded on a private blocking stream, which CUDA
  /// orders after it, as an event on the legacy stream itself would be refused while another thread captures a
  /// blocking stream). Throws invalid_argument_error during a capture the pool serves, or one of this thread's
  /// per-thread default stream (it would allocate inside the capture: reserve before it), out_of_memory_error from the
  /// backing allocator, cuda_error when the stream or its event cannot be created.
  void reserve(std::size_t bytes) {
    if (bytes == 0) return;
    if (bytes > std::numeric_limits<std::size_t>::max() - (alignment - 1)) {
      throw invalid_argument_error("gpukit::graph_pool::reserve: " + std::to_string(bytes) + " bytes overflow");
    }
    bytes = round(bytes);
    const stream_view home = stream_view::default_stream(device_).resolved();
    const bool legacy = detail::uses_legacy_stream(home);
    if (!legacy && detail::capture_status(home) != cudaStreamCaptureStatusNone) {  // this thread's per-thread stream
      throw invalid_argument_error("gpukit::graph_pool::reserve(" + std::to_string(bytes) + ") on " +
                                   device_.to_string() +
                                   " while this thread's default stream is being captured: reserve before the "
                                   "capture (the reserve would be allocated inside it)");
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (captures_ != 0) {
        throw invalid_argument_error("gpukit::graph_pool::reserve(" + std::to_string(bytes) + ") on " +
                                     device_.to_string() +
                                     " during a capture the pool serves: reserve before the capture (allocating "
                                     "device memory inside a capture is prohibited)");
      }
    }
    const stream_view mark = legacy ? marker_stream()->view() : home;  // where the event is recorded
    event ready(device_);  // made before the chunk: nothing to undo if it fails
    void* chunk = backing_->allocate(bytes, home);
    try {
      register_live();
      device_guard on_device(device_);  // before the lock: the record's own guard then changes nothing (nor warns)
      std::lock_guard<std::mutex> lock(mutex_);
      // Recorded under the lock, so that the event kept is the latest: it covers every chunk in the reserve.
      ready.record(mark);
      uses_.insert_or_assign(mark.id(), std::move(ready));
      has_uses_.store(true, std::memory_order_release);
      chunks_.push_back({reinterpret_cast<std::uintptr_t>(chunk), bytes});
      try {
        insert_free(reinterpret_cast<std::uintptr_t>(chunk), bytes, chunks_.size() - 1, untouched);
      } catch (...) {
        // Forgotten under the same lock (another reserve may push next): inside the reserve of a live pool, its free
        // below would be routed back to this pool.
        chunks_.pop_back();
        throw;
      }
      reserved_ += bytes;
      detail::add_to_stat(segments_, 1);
      detail::add_to_stat(reserved_bytes_, static_cast<std::int64_t>(bytes));
    } catch (...) {
      backing_->deallocate(chunk);
      throw;
    }
  }

  gpukit::device device() const noexcept override { return device_; }

  allocator_stats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_locked();
  }
  free_space_info free_space() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return free_space_locked();
  }
  /// The reserve's chunks as segments, with their allocated and free blocks, and the statistics of the same moment.
  allocator_snapshot snapshot() const override {
    allocator_snapshot snap;
    snap.device = device_;
    std::lock_guard<std::mutex> lock(mutex_);
    snap.stats = stats_locked();
    for (const chunk_info& c : chunks_) {
      segment_info seg;
      seg.address = c.address;
      seg.size = c.size;
      seg.mapped = c.size;
      for (auto it = live_.lower_bound(c.address); it != live_.end() && it->first < c.address + c.size; ++it) {
        seg.blocks.push_back(
            block_info{it->first, it->second.size, it->second.requested, block_state::allocated, 0, 0});
      }
      for (auto it = free_.lower_bound(c.address); it != free_.end() && it->first < c.address + c.size; ++it) {
        seg.blocks.push_back(block_info{it->first, it->second.size, 0, block_state::free, 0, 0});
      }
      std::sort(seg.blocks.begin(), seg.blocks.end(),
                [](const block_info& a, const block_info& b) { return a.address < b.address; });
      snap.segments.push_back(std::move(seg));
    }
    snap.pointer_map_entries = live_.size();
    return snap;
  }
  std::string memory_summary() const override {
    allocator_stats s;
    free_space_info f;
    {
      std::lock_guard<std::mutex> lock(mutex_);  // one moment for both
      s = stats_locked();
      f = free_space_locked();
    }
    return format_memory_summary("gpukit graph pool, " + device_.to_string(), s, f);
  }

  /// The reserve stays until the pool ends: its graphs may be launched again.
  void empty_cache() override {}
  std::size_t trim(std::size_t) override { return memory_reserved(); }
  /// Sets each peak to the value now (the reserve's is its size, which only grows).
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (stat* each : all_stats()) each->peak = each->current;
  }
  /// Zeroes the totals allocated and freed, and the count of out-of-memory failures.
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (stat* each : all_stats()) each->allocated = each->freed = 0;
    ooms_ = 0;
  }
  /// A pool's size is its reserve: refused.
  void set_reserved_limit(std::size_t) override {
    throw invalid_argument_error("gpukit::graph_pool: its limit is its reserve (graph_pool::reserve)");
  }
  void set_memory_fraction(double) override {
    throw invalid_argument_error("gpukit::graph_pool: its limit is its reserve (graph_pool::reserve)");
  }
  std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer) override {
    return observers_.add(std::move(observer));
  }
  bool remove_out_of_memory_observer(std::uint64_t id) override { return observers_.remove(id); }

  std::size_t memory_allocated() const noexcept override {
    return locked([this] { return static_cast<std::size_t>(allocated_bytes_.current); });
  }
  std::size_t memory_reserved() const noexcept override {
    return locked([this] { return reserved_; });
  }
  /// The most bytes allocated from the reserve at once since the pool was created or reset_peak_stats() was called.
  std::size_t max_memory_allocated() const noexcept override {
    return locked([this] { return static_cast<std::size_t>(allocated_bytes_.peak); });
  }
  /// The reserve's size: it only grows while the pool lives, so its peak is its size.
  std::size_t max_memory_reserved() const noexcept override { return memory_reserved(); }

  // --- for gpukit::capture and gpukit::graph (graph/graph.hpp) ---

  /// The capture `id` allocates from this pool until end_capture(id).
  void begin_capture(unsigned long long id) {
    auto& registry = detail::capture_pools();
    // First: while capturing, even an empty pool is asked (its allocations fail clearly). It may throw; a pool stays
    // registered until it ends anyway, so nothing needs undoing, whereas a capture entry left behind would not be.
    register_live();
    {
      std::lock_guard<std::mutex> lock(registry.mutex);
      if (!registry.capturing.emplace(id, this).second) {
        throw invalid_argument_error("gpukit::graph_pool: capture " + std::to_string(id) + " already has a pool");
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ++captures_;
  }
  /// Ends begin_capture(id): the capture `id` no longer allocates from this pool.
  void end_capture(unsigned long long id) noexcept {
    auto& registry = detail::capture_pools();
    {
      std::lock_guard<std::mutex> lock(registry.mutex);
      registry.capturing.erase(id);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--captures_ == 0) free_for_any_stream();
  }
  /// A graph of the pool is about to be launched on `s`: its work waits on the device for the reserve's readiness and
  /// for the work that streams outside the captures did with pool blocks freed since (record_stream), as the graph
  /// may write them again. Not for a launch into a capture (a captured stream cannot wait for an event recorded
  /// outside it).
  void order_launch(const stream_view& s) {
    if (!has_uses_.load(std::memory_order_acquire)) return;
    if (detail::capture_status(s) != cudaStreamCaptureStatusNone) return;
    device_guard on_device(device_);  // before the lock: the waits' own guards then change nothing (nor warn)
    after_lock later;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (record_deferred_uses(&s, &later) && !warned_unordered_) {
        // A stream that used a freed block is captured now: its work from before that capture cannot be waited for
        // until the capture ends (a later launch does), so this graph may write the block while that work reads it
        // (found by review). Said rather than refused: the launch is the user's, and the capture may be another
        // thread's.
        try {  // a warning, never a failed launch
          later.failures +=
              std::string(later.failures.empty() ? "" : "\n") +
              "gpukit::graph::launch: a stream that used a block of this launch's graph pool, since freed, is being "
              "captured (or was destroyed while captured): the launch cannot wait for that stream's work from before "
              "its capture, and the graph may overwrite the block while the work still uses it (said once per pool). "
              "End that capture before launching, or free the block once that work has completed";
          warned_unordered_ = true;
        } catch (...) {
        }
      }
      wait_for_uses_locked(s);
    }
    finish_host_waits(later);  // before the launch
  }
  /// A graph of the pool is about to be launched on `s`: returns the event note_launch records after it (created
  /// once per stream), so that once the graph runs only the record itself can fail. Throws before anything is
  /// launched, leaving nothing behind.
  cudaEvent_t prepare_launch(const stream_view& s) {
    const unsigned long long id = s.id();
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = launches_.find(id);
    if (found != launches_.end()) {
      ++found->second.preparing;
      return found->second.event;
    }
    device_guard guard(device_);
    if (launches_.size() >= prune_launches_at_) drop_completed_launches_locked();
    cudaEvent_t e = nullptr;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                              device_.ordinal());
    try {
      launches_.emplace(id, launch_event{e, 1});
    } catch (...) {
      (void)cudaEventDestroy(e);
      throw;
    }
    return e;
  }
  /// A launch prepare_launch was called for did not happen (it threw first). `s` is resolved (its id known).
  void abandon_launch(const stream_view& s) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    end_preparing_locked(s.id());
  }
  /// A graph of the pool was just launched on `s`, with the pool's device current: records `e` (from prepare_launch)
  /// after it, so that the reserve goes back only after that work (the pool's release waits for each stream's latest
  /// launch). Returns CUDA's result, for note_launch. No lock and no host wait: graph::launch records it under the
  /// legacy stream's hold (detail::legacy_stream_hold), which a wait must not be made under.
  cudaError_t record_launch(const stream_view& s, cudaEvent_t e) const noexcept {
    return cudaEventRecord(e, s.cuda_handle());
  }
  /// After record_launch on `s` returned `recorded`: if it failed, the host waits for `s` now, so that no launch is
  /// left unordered; if even that fails, the pool keeps its reserve at its release (a device-wide wait would do, but
  /// cudaDeviceSynchronize invalidates any capture another thread runs, in relaxed mode too), and the record's error
  /// propagates. The wait is made outside the pool's lock, and called after the legacy stream's hold; the launch stops
  /// holding the event only after its record (a record by another launch on `s` covers this one's as well).
  void note_launch(const stream_view& s, cudaError_t recorded) {
    const std::uint64_t id = s.id();
    std::exception_ptr failed;
    bool unordered = false;
    if (recorded != cudaSuccess) {
      try {
        GPUKIT_CUDA_TRY_DESCRIBED(recorded, "cudaEventRecord (after a graph launch)", device_.ordinal());
      } catch (...) {
        failed = std::current_exception();
      }
      try {
        s.synchronize();  // relaxed: legal while another thread captures
      } catch (...) {
        unordered = true;
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      end_preparing_locked(id);
      if (unordered) unordered_launch_ = true;
    }
    if (failed) std::rethrow_exception(failed);
  }

 private:
  // The statistics and the free space, mutex_ held.
  allocator_stats stats_locked() const {
    allocator_stats s;  // one pool (the small/large split does not apply); a block is active while allocated
    s.allocation.pools[0] = s.active.pools[0] = allocations_;
    s.allocated_bytes.pools[0] = s.active_bytes.pools[0] = allocated_bytes_;
    s.requested_bytes.pools[0] = requested_bytes_;
    s.reserved_bytes.pools[0] = reserved_bytes_;
    s.segment.pools[0] = segments_;
    s.num_ooms = ooms_;
    return s;
  }
  free_space_info free_space_locked() const noexcept {
    free_space_info f;
    for (const auto& entry : free_) {
      f.free_bytes += entry.second.size;
      ++f.free_blocks;
      f.largest_free_block = std::max(f.largest_free_block, entry.second.size);
    }
    return f;
  }

  // device_allocator's allocate/deallocate/record_stream/owns land here.
  /// Blocks sit at multiples of `alignment` inside reserve chunks, which are as aligned as the backing allocator's
  /// memory.
  std::size_t do_natural_alignment() const noexcept override {
    return std::min<std::size_t>(alignment, backing_->natural_alignment());
  }
  /// Best fit from the reserve, with no allocating CUDA call (legal inside a capture: while the pool has uses to wait
  /// for, cudaStreamIsCapturing tells whether the stream waits for them). Throws out_of_memory_error when the
  /// reserve has no block that large (after the observers), invalid_argument_error for a stream of another device.
  void* do_allocate(std::size_t bytes, stream_view stream) override {
    if (bytes == 0) return nullptr;
    check_stream(stream, "allocate");
    if (bytes > std::numeric_limits<std::size_t>::max() - (alignment - 1)) {
      throw invalid_argument_error("gpukit::graph_pool::allocate: " + std::to_string(bytes) + " bytes overflow");
    }
    const std::size_t size = round(bytes);
    const std::uint64_t id = stream.id();  // before the lock: may look the id up (cudaStreamGetId)
    detail::kept_stream allocated_on = detail::kept_stream::of(stream);  // a free without a stream is ordered on it
    // A capture the pool does not serve would write the block at each launch, while the pool hands it out again
    // once it is freed: refused, as its free and record_stream are.
    // In a capture the pool serves (`capture`: its id, 0 when invalidated), the block is the graph's. Asked without
    // keeping the stream from destruction (its record's lock, which the pool's own calls take under the pool's lock):
    // the caller allocates on it, so it lives through the call.
    unsigned long long capture = 0;
    const bool in_capture = refuse_foreign_capture(
        detail::kept_stream{stream, nullptr}, "gpukit::graph_pool::allocate", false, &capture,
        "Allocate from it in a capture it serves, or outside captures (nothing was allocated, and the capture is "
        "intact)");
    std::optional<device_guard> on_device;  // taken before the lock when the allocation waits
    after_lock later;                       // declared before the lock: its warnings go after it, thrown or not
    std::unique_lock<std::mutex> lock(mutex_);
    // A direct allocation is ready on its stream as a launch's memory is, waiting on the device under the lock it
    // takes its block under (a reserve made meanwhile is covered). In a capture, no wait: the graph's launches are
    // ordered instead. The legacy default stream (a wait on it is refused while another thread captures a blocking
    // stream) waits through the pool's blocking stream, which its later work is ordered after; another thread's
    // per-thread stream cannot be named, and does not wait. Asked outside the lock, and only when there are uses. A
    // host wait (a destroyed stream's work that the device cannot wait for) is made outside the lock, then the uses
    // are looked at again.
    if (has_uses_.load(std::memory_order_relaxed)) {
      lock.unlock();
      const bool on_legacy = is_legacy_stream(stream);
      const bool can_wait = on_legacy || (!detail::may_use_legacy_stream(stream) &&
                                          detail::capture_status(stream) == cudaStreamCaptureStatusNone);
      if (can_wait) on_device.emplace(device_);
      if (on_legacy) (void)marker_stream();  // per-thread builds: the reserve made none
      lock.lock();
      // A use waited for on the host is dropped, so each round sees only uses deferred meanwhile. After a round that
      // waited for none (a gpukit capture began), one more looks at what came while the lock was let go, then the
      // rounds end, leaving the skipped uses as a capture running at the start would. The last step under the lock
      // before the block is taken is always the wait for the uses.
      bool stalled = false;
      while (can_wait) {
        const stream_view waiter = on_legacy ? marker_stream_->view() : stream;
        (void)record_deferred_uses(&waiter, &later);
        wait_for_uses_locked(waiter);
        if (later.host_waits.empty() || stalled) break;
        lock.unlock();
        stalled = finish_host_waits(later) == 0;
        lock.lock();
      }
    }
    // In a capture: best fit among the blocks this stream freed and those free for any stream. A direct allocation
    // (outside captures) takes only blocks no graph of the pool used: a launch (not waited for) may write those.
    auto fit = in_capture ? std::min({best_fit(id, size), best_fit(any_stream, size), best_fit(untouched, size)})
                          : best_fit(untouched, size);
    // Untouched blocks and blocks graphs used that touch may hold it together: the capture takes that run as one.
    if (fit.size == no_fit && in_capture && merge_run_for(size)) fit = best_fit(any_stream, size);
    if (fit.size == no_fit) {
      lock.unlock();
      later.warn_now();
      throw_out_of_memory(bytes, size, id, in_capture);
    }
    const auto [block_size, address] = fit;
    const auto taken = free_.find(address);
    // The one step that allocates.
    live_.emplace(
        address,
        live_block{size, bytes, taken->second.chunk, id, false, {}, std::move(allocated_on), capture, in_capture});
    if (block_size > size) {
      (void)rekey_free(taken, address + size, block_size - size, taken->second.stream);  // the rest, in its nodes
    } else {
      erase_free(address);
    }
    detail::add_to_stat(allocations_, 1);
    detail::add_to_stat(allocated_bytes_, static_cast<std::int64_t>(size));
    detail::add_to_stat(requested_bytes_, static_cast<std::int64_t>(bytes));
    return reinterpret_cast<void*>(address);  // `later` warns after the lock
  }

  /// Returns `p` to the reserve at once, for the stream it was allocated on while a capture runs (see the file
  /// comment), freed on that stream: outside a capture, its work so far is waited for before the block's reuse
  /// (launches of the pool's graphs) and the reserve's release. Throws invalid_argument_error for a pointer the pool
  /// did not hand out (a double free among them), or while that stream is captured by a capture the pool does not
  /// serve (the block stays allocated); nullptr is ignored.
  void do_deallocate(void* p) override { free_block_of(p, nullptr); }
  /// The same, freed on `stream`: another stream than the allocation's makes the block wait for the captures' end.
  /// Refused as above while `stream` is captured by a capture the pool does not serve.
  void do_deallocate(void* p, stream_view stream) override {
    check_stream(stream, "deallocate");
    free_block_of(p, &stream);
  }
  /// `stream` uses `p`. In a capture, another stream than the allocation's: once freed, the block waits for the
  /// pool's captures to end. Outside a capture: its free records an event on `stream` (or, should `stream` be
  /// captured then, once it no longer is), which later launches of the pool's graphs and the release of the reserve
  /// wait for. Throws invalid_argument_error while `stream` is captured by a capture the pool does not serve.
  void do_record_stream(void* p, stream_view stream) override {
    check_stream(stream, "record_stream");
    const std::uint64_t id = stream.id();
    detail::kept_stream use = detail::kept_stream::of(stream);
    const bool captured = refuse_foreign_capture(use, "gpukit::graph_pool::record_stream", false);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == live_.end()) throw_not_owned(p);
    if (id != it->second.stream) it->second.shared = true;
    if (captured) it->second.in_graph = true;
    std::vector<detail::kept_stream>& uses = it->second.uses;
    const bool listed =
        std::any_of(uses.begin(), uses.end(), [id](const detail::kept_stream& u) { return u.view.id() == id; });
    if (!captured && !listed) uses.push_back(std::move(use));
  }
  bool do_owns(const void* p) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(reinterpret_cast<std::uintptr_t>(p)) != 0;
  }

  /// Who may reuse a free block: allocations on one stream (its id), on any stream, or none until the pool's
  /// captures have ended.
  static constexpr std::uint64_t any_stream = std::numeric_limits<std::uint64_t>::max() - 1;
  static constexpr std::uint64_t after_captures = std::numeric_limits<std::uint64_t>::max();
  /// Free blocks no graph of the pool used (allocated, recorded or freed in a capture): any allocation may take them,
  /// and direct allocations (outside captures) only these, since a launch, which they do not wait for, may write the
  /// others. The reserve starts so; a block a graph used never is again.
  static constexpr std::uint64_t untouched = std::numeric_limits<std::uint64_t>::max() - 2;
  static constexpr std::size_t no_fit = std::numeric_limits<std::size_t>::max();

  struct free_block {
    std::size_t size;
    std::size_t chunk;
    std::uint64_t stream;  // who may reuse it: a stream id, any_stream, after_captures or untouched
  };
  struct live_block {
    std::size_t size;
    std::size_t requested;
    std::size_t chunk;
    std::uint64_t stream;                   // the id of the stream it was allocated on
    bool shared;                            // another stream used it (record_stream) or freed it
    std::vector<detail::kept_stream> uses;  // streams outside a capture that used it (record_stream)
    detail::kept_stream allocated_on;       // the stream it was allocated on: a free without a stream is made on it
    unsigned long long capture;             // the id of the capture it was allocated in (0: outside captures)
    bool in_graph;                          // allocated, recorded (record_stream) or freed in a capture
  };
  /// A candidate block: its size (no_fit: none), then its address.
  struct fit_result {
    std::size_t size;
    std::uintptr_t address;
    bool operator<(const fit_result& other) const noexcept {
      return size != other.size ? size < other.size : address < other.address;
    }
  };
  struct chunk_info {
    std::uintptr_t address;
    std::size_t size;
  };

  graph_pool(private_tag, gpukit::device d, device_resource& backing) : device_(d), backing_(&backing) {}

  static std::size_t round(std::size_t bytes) noexcept { return (bytes + alignment - 1) / alignment * alignment; }

  template <class F>
  std::size_t locked(F&& f) const noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      return f();
    } catch (...) {
      return 0;
    }
  }

  void check_stream(const stream_view& s, const char* operation) const {
    detail::require_stream_of(s, device_, "gpukit::graph_pool", operation);
  }

  /// The smallest free block of at least `size` bytes that `stream` (a stream id or any_stream) may reuse.
  fit_result best_fit(std::uint64_t stream, std::size_t size) const {
    const auto it = by_size_.lower_bound({stream, size, 0});
    if (it == by_size_.end() || std::get<0>(*it) != stream) return {no_fit, 0};
    return {std::get<1>(*it), std::get<2>(*it)};
  }

  using free_map = std::map<std::uintptr_t, free_block>;

  /// Adds a free block. Strong guarantee: throws std::bad_alloc having added nothing.
  void insert_free(std::uintptr_t address, std::size_t size, std::size_t chunk, std::uint64_t stream) {
    const auto it = free_.emplace(address, free_block{size, chunk, stream}).first;
    try {
      by_size_.emplace(stream, size, address);
    } catch (...) {
      free_.erase(it);
      throw;
    }
  }
  void erase_free(std::uintptr_t address) noexcept {
    const auto it = free_.find(address);
    by_size_.erase({it->second.stream, it->second.size, address});
    free_.erase(it);
  }
  /// Gives the free block at `it` another address, size and reuser in its own nodes (no allocation); returns where
  /// it is now.
  free_map::iterator rekey_free(free_map::iterator it, std::uintptr_t address, std::size_t size,
                                std::uint64_t stream) noexcept {
    auto index = by_size_.extract({it->second.stream, it->second.size, it->first});
    auto node = free_.extract(it);
    node.key() = address;
    node.mapped().size = size;
    node.mapped().stream = stream;
    index.value() = {stream, size, address};
    by_size_.insert(std::move(index));
    return free_.insert(std::move(node)).position;
  }
  /// Inserts a freed block, merged with free neighbours of the same chunk that the same streams may reuse (in a
  /// neighbour's nodes). Strong guarantee: throws std::bad_alloc, having changed nothing, only when nothing merges.
  void insert_free_coalesced(std::uintptr_t address, std::size_t size, std::size_t chunk, std::uint64_t stream) {
    const auto joins = [&](free_map::const_iterator it) {
      return it != free_.end() && it->second.chunk == chunk && it->second.stream == stream;
    };
    const auto next = free_.find(address + size);
    const auto after = free_.lower_bound(address);
    const auto previous = after != free_.begin() ? std::prev(after) : free_.end();
    const bool join_next = joins(next);
    const bool join_previous = joins(previous) && previous->first + previous->second.size == address;
    if (!join_next && !join_previous) {
      insert_free(address, size, chunk, stream);
      return;
    }
    if (join_next) size += next->second.size;
    if (join_previous) {
      if (join_next) erase_free(next->first);
      (void)rekey_free(previous, previous->first, previous->second.size + size, stream);
    } else {
      (void)rekey_free(next, address, size, stream);
    }
  }

  /// Frees the live block at `p` (freed on `*stream`, or on its own stream when null); see do_deallocate. The uses
  /// outside captures are recorded first, without the lock (CUDA calls), then the block is freed. Refused, before
  /// anything changes, on a stream captured by a capture the pool does not serve (refuse_foreign_capture).
  void free_block_of(void* p, const stream_view* stream) {
    if (p == nullptr) return;
    const std::uint64_t freeing_stream = stream != nullptr ? stream->id() : after_captures;
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    std::vector<detail::kept_stream> uses;
    detail::kept_stream freeing_on;
    unsigned long long allocated_in = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(address);
      if (it == live_.end()) throw_not_owned(p);
      uses = it->second.uses;
      allocated_in = it->second.capture;
      // Without a stream, the free is made on the allocation's ("in the order of the stream it was allocated on"):
      // its work so far is waited for before the block's reuse, as a consumer's that frees on its own stream is.
      if (stream == nullptr) freeing_on = it->second.allocated_on;
    }
    if (stream != nullptr) freeing_on = detail::kept_stream::of(*stream);
    unsigned long long freed_in = 0;
    const bool captured =
        refuse_foreign_capture(freeing_on, "gpukit::graph_pool::deallocate", stream == nullptr, &freed_in);
    for (const detail::kept_stream& use : uses) record_use(use, use_kind::recorded);
    if (!captured) {
      record_freeing_stream(freeing_on);
    } else if (freed_in == 0 || freed_in != allocated_in) {
      // Freed in a capture other than the one it was allocated in: the stream's work from before this capture (a
      // copy of an earlier graph's output) is not the graph's, and cannot take an event while the stream is
      // captured; recorded at the next launch, direct allocation or release, as a recorded stream's.
      record_use(freeing_on, use_kind::recorded, freed_in);
    }  // else the block's every use on the stream is the graph's
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(address);
      if (it == live_.end()) throw_not_owned(p);  // freed by another thread meanwhile: a double free
      const live_block& b = it->second;
      const bool shared = b.shared || (stream != nullptr && freeing_stream != b.stream);
      // A block no graph used, freed outside captures, stays untouched (later launches and direct allocations wait
      // for its streams' uses); one a graph used serves only captures: during the pool's captures the stream it was
      // allocated on (or none, if another used it), then any stream.
      const std::uint64_t reuser = !b.in_graph && !captured ? untouched
                                   : captures_ != 0         ? (shared ? after_captures : b.stream)
                                                            : any_stream;
      // First, as it may fail (no memory for a block of its own): the block is then still allocated.
      insert_free_coalesced(address, b.size, b.chunk, reuser);
      detail::add_to_stat(allocations_, -1);
      detail::add_to_stat(allocated_bytes_, -static_cast<std::int64_t>(b.size));
      detail::add_to_stat(requested_bytes_, -static_cast<std::int64_t>(b.requested));
      live_.erase(it);
      last = orphaned_ && live_.empty();
    }
    if (last) delete this;  // the pool's graphs went first: its last allocation ends it
  }

  /// Whether `use` cannot take an event now: the legacy default stream while a gpukit capture runs (`hold`, taken
  /// for `use` and kept until the event is recorded, refuses it: CUDA would invalidate the capture of a blocking
  /// stream), or captured.
  static bool unrecordable_now(const detail::kept_stream& use, const detail::capture_hold& hold) {
    return hold.refuses(use.view) || detail::capture_status(use.view) != cudaStreamCaptureStatusNone;
  }

  /// The id of the capture `s` is in, or 0 (none, or the question failed: a free in a capture then takes the
  /// stream's work as possibly not the graph's, the safe side).
  static unsigned long long capture_of(const stream_view& s) noexcept {
    try {
      return detail::capture_id(s);
    } catch (...) {
      return 0;
    }
  }

  /// How a stream used a block: named by record_stream, or the stream the block is freed on.
  enum class use_kind { recorded, freeing };

  /// The stream a block is freed on uses it too (a consumer freeing what it read). Never throws.
  void record_freeing_stream(const detail::kept_stream& s) noexcept { record_use(s, use_kind::freeing); }

  /// Whether `s` (a block is freed on it, or recorded as using it) is being captured, by a capture this pool serves
  /// (an invalidated capture counts as one). Throws invalid_argument_error, before anything changes, for a capture
  /// the pool does not serve (a raw one, one without a pool or with another): that graph would use the block at each
  /// launch, with no reference to the pool, which would hand the block out again at once. Asked while `s` is kept
  /// from destruction (another thread's would leave its handle invalid, or a new stream's); a destroyed stream is not
  /// asked. `allocation_stream` (a free without a stream): a failed question is taken as "not captured", so the free
  /// goes on (a raw handle destroyed before it; the event record then fails and is dealt with as any). `*capture`
  /// (if given) is set to the capture's id when `s` is captured (0: invalidated).
  bool refuse_foreign_capture(const detail::kept_stream& s, const char* operation, bool allocation_stream,
                              unsigned long long* capture = nullptr, const char* advice = nullptr) const {
    unsigned long long id = 0;
    const auto found = [&id, capture] {
      if (capture != nullptr) *capture = id;
      return true;
    };
    {
      std::unique_lock<std::mutex> alive;
      if (s.life != nullptr) alive = s.life->keep_alive();
      if (s.destroyed()) return false;
      try {
        if (detail::capture_status(s.view) == cudaStreamCaptureStatusNone) return false;
        id = detail::capture_id(s.view);  // 0: not active (invalidated, or ended since the question above)
        if (id == 0 && detail::capture_status(s.view) == cudaStreamCaptureStatusNone) return false;
      } catch (const error&) {
        if (allocation_stream) return false;
        throw;
      }
    }
    if (id == 0) return found();
    {
      auto& registry = detail::capture_pools();
      std::lock_guard<std::mutex> lock(registry.mutex);  // never under mutex_ (register_live)
      const auto it = registry.capturing.find(id);
      if (it != registry.capturing.end() && it->second == this) return found();
    }
    detail::throw_captured(operation, detail::describe_stream(s.view.native_handle(), device_), device_,
                           std::string("a capture this graph pool does not serve: the graph would use the pool's "
                                       "block at each launch, but the pool would hand it out again once freed. ") +
                               (advice != nullptr ? advice
                                                  : "Free it after that graph's last launch, or capture with "
                                                    "gpukit::capture(stream, work, pool) of this pool (nothing was "
                                                    "freed or recorded, and the capture is intact)"));
  }

  /// The pool's statistics, for the resets.
  std::array<stat*, 5> all_stats() noexcept {
    return {&allocations_, &allocated_bytes_, &requested_bytes_, &segments_, &reserved_bytes_};
  }

  /// A launch on the stream of id `id` no longer holds that stream's launch event (mutex_ held).
  void end_preparing_locked(std::uint64_t id) noexcept {
    const auto found = launches_.find(id);
    if (found != launches_.end() && found->second.preparing > 0) --found->second.preparing;
  }

  /// Makes `s` wait on the device for the recorded uses that have not completed (its own work is ordered by the
  /// stream), dropping those that have (mutex_ held; `s` not captured).
  void wait_for_uses_locked(const stream_view& s) {
    const std::uint64_t id = s.id();
    for (auto it = uses_.begin(); it != uses_.end();) {
      if (detail::cuda_backend::query_event(it->second.cuda_handle()) == cudaSuccess) {
        it = uses_.erase(it);  // done: nothing to wait for, now or later
        continue;
      }
      if (it->first != id) it->second.wait(s);
      ++it;
    }
    has_uses_.store(!uses_.empty() || !deferred_uses_.empty(), std::memory_order_release);
  }

  /// At the free of a block `use` used outside a capture: an event after that stream's work so far, which the pool's
  /// later launches and its release wait for (one per stream, re-recorded: a later record covers the earlier work).
  /// A destroyed stream's last work is waited for on the device through its final event, by later launches, direct
  /// allocations and the release (on the host where it has none). A captured stream cannot take the event now: the
  /// freeing stream's work in the capture is the graph's, and a recorded stream's earlier work is recorded once the
  /// stream can take an event, at a later launch. The legacy default stream, refused while a gpukit capture runs, is
  /// marked on the pool's blocking stream. Where no event can be recorded, the host waits for the stream. Called
  /// without mutex_; never throws.
  void record_use(const detail::kept_stream& use, use_kind kind, unsigned long long freed_in = 0) noexcept {
    try {
      if (use.destroyed()) {
        // Its final event is waited for on the device by the next launch, allocation or release; without one (it
        // was destroyed while captured) they decide, since a device synchronize now could invalidate a capture.
        defer(use, freed_in);
        return;
      }
      {
        device_guard on_device(device_);  // before the lock: the record's own guard then changes nothing (nor warns)
        // Recorded under the lock, so that the event kept for a stream is its latest (two threads freeing blocks one
        // stream used would otherwise keep the older event). The lock comes before the hold, which is never held
        // while waiting for it (a host wait may be made under it).
        std::lock_guard<std::mutex> lock(mutex_);
        // Kept from destruction by another thread while its handle is used (invalid then, or a new stream's); one
        // destroyed first is deferred: its final event.
        std::unique_lock<std::mutex> alive;
        if (use.life != nullptr) alive = use.life->keep_alive();
        if (use.destroyed()) {
          defer_locked(use, freed_in);
          return;
        }
        detail::capture_hold hold(detail::may_use_legacy_stream(use.view));  // until the event is recorded
        const bool refused = hold.refuses(use.view);
        if (!refused || !is_legacy_stream(use.view)) {
          if (refused || detail::capture_status(use.view) != cudaStreamCaptureStatusNone) {
            if (!refused && kind == use_kind::freeing) return;
            defer_locked(use, freed_in);
            return;
          }
          event done(device_);
          detail::record_from_any_thread(done, use.view);
          hold.release();
          uses_.insert_or_assign(use.view.id(), std::move(done));
          has_uses_.store(true, std::memory_order_release);
          return;
        }
      }
      // The legacy stream, refused while a gpukit capture runs: its work so far is marked on the pool's blocking
      // stream, which CUDA orders after it. If that fails, deferred (a wait for the legacy stream now would
      // invalidate the capture).
      try {
        const stream& marker = *marker_stream();  // made outside the lock
        device_guard on_device(device_);
        std::lock_guard<std::mutex> lock(mutex_);
        event done(device_);
        done.record(marker.view());  // under the lock, as above
        uses_.insert_or_assign(use.view.id(), std::move(done));
        has_uses_.store(true, std::memory_order_release);
        return;
      } catch (const std::exception& e) {
        detail::warn_parts(
            "gpukit::graph_pool: could not mark the legacy default stream's work on the pool's "
            "stream (",
            e.what(), "); it is recorded at a later launch instead");
      }
      defer(use, freed_in);
    } catch (const std::exception& e) {
      try {
        if (use.destroyed()) {  // meanwhile: the record may have failed on its handle's new owner
          defer(use, freed_in);
          return;
        }
      } catch (...) {
      }
      detail::warn_parts("gpukit::graph_pool: could not record the work of a stream that used a freed block (",
                         e.what(), "); waiting for it on the host");
      try {
        // Kept from destruction by another thread while waited for (its handle could be a new stream's). Neither a
        // destroyed stream nor another thread's per-thread stream can be named from here.
        std::unique_lock<std::mutex> alive;
        if (use.life != nullptr) alive = use.life->keep_alive();
        if (!use.destroyed() && use.handle_here() == use.view.cuda_handle()) use.view.synchronize();
      } catch (const std::exception& again) {
        detail::warn_parts("gpukit::graph_pool: could not wait for it either (", again.what(),
                           "); the block may be reused before that work is done");
      } catch (...) {
      }
    } catch (...) {
    }
  }

  /// Keeps `use` for a later launch (one entry per stream: a later record covers the earlier work). `freed_in`: the
  /// capture it was deferred by, a free in that capture of a block from outside it (0: any other reason).
  void defer(const detail::kept_stream& use, unsigned long long freed_in = 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    defer_locked(use, freed_in);
  }
  /// The same, mutex_ held.
  void defer_locked(const detail::kept_stream& use, unsigned long long freed_in = 0) {
    const std::uint64_t id = use.view.id();
    const auto listed = std::find_if(deferred_uses_.begin(), deferred_uses_.end(),
                                     [id](const deferred_use& u) { return u.view.id() == id; });
    if (listed == deferred_uses_.end()) {
      deferred_uses_.push_back(deferred_use{use, freed_in});
    } else if (listed->freed_in != freed_in) {
      listed->freed_in = 0;  // deferred for more than that capture's free
    }
    has_uses_.store(true, std::memory_order_release);
  }

  /// What a step under mutex_ leaves for after it: warnings (a warning handler may call into the pool), and host
  /// waits for destroyed streams' last work (under the lock they would stall every other call on the pool). Warns on
  /// destruction what is still unsaid, so that an exception loses nothing.
  struct after_lock {
    std::string failures;  // one warning per line
    std::vector<std::shared_ptr<const detail::stream_life>> host_waits;

    after_lock() = default;
    after_lock(const after_lock&) = delete;
    after_lock& operator=(const after_lock&) = delete;
    ~after_lock() { warn_now(); }
    /// Says the failures through gpukit::warn (not under mutex_); never throws.
    void warn_now() noexcept {
      if (failures.empty()) return;
      try {
        warn(failures);
      } catch (...) {
      }
      failures.clear();
    }
  };

  /// Waits on the host for the destroyed streams' work that record_deferred_uses left in `later` (without mutex_),
  /// then drops their uses; then warns. Returns how many were waited for (or failed). A stream destroyed during a
  /// capture has no final event: only a device synchronize covers its work, which would invalidate a capture running
  /// now, so while a gpukit capture runs (asked again here: a capture beginning between this check and the
  /// synchronize is not seen, nor one begun with the raw runtime) its use stays deferred (the release keeps the
  /// reserve if it is still left then). Never throws: a failed wait is reported and its use dropped (so that it does
  /// not fail every later call).
  std::size_t finish_host_waits(after_lock& later) noexcept {
    std::size_t waited = 0;
    for (const std::shared_ptr<const detail::stream_life>& life : later.host_waits) {
      const bool finished = life->finished();  // e.g. the device was synchronized for it since
      if (!finished && life->final_event() == nullptr && detail::gpukit_capture_underway()) continue;
      try {
        if (!finished) life->wait_finished();
      } catch (const std::exception& e) {
        note_failure(&later, "could not wait for the work of a destroyed stream that used a freed block (", e.what());
      } catch (...) {
        note_failure(&later, "could not wait for the work of a destroyed stream that used a freed block (",
                     "unknown exception");
      }
      ++waited;
      std::lock_guard<std::mutex> lock(mutex_);
      deferred_uses_.erase(std::remove_if(deferred_uses_.begin(), deferred_uses_.end(),
                                          [&](const detail::kept_stream& u) { return u.life == life; }),
                           deferred_uses_.end());
      has_uses_.store(!uses_.empty() || !deferred_uses_.empty(), std::memory_order_release);
    }
    later.host_waits.clear();
    later.warn_now();
    return waited;
  }

  /// Adds "gpukit::graph_pool: <what><why>); the block may be reused before that work is done" to `later` (said
  /// after the lock); said now (without the heap) when there is no `later` or even that fails.
  static void note_failure(after_lock* later, const char* what, const char* why) noexcept {
    constexpr const char* prefix = "gpukit::graph_pool: ";
    constexpr const char* consequence = "); the block may be reused before that work is done";
    try {
      if (later != nullptr) {
        later->failures += std::string(later->failures.empty() ? "" : "\n") + prefix + what + why + consequence;
        return;
      }
    } catch (...) {
    }
    detail::warn_parts(prefix, what, why, consequence);
  }

  /// Whether `s` is (or may be) the legacy default stream itself, whose earlier work the pool's blocking stream is
  /// ordered after; not another thread's per-thread default stream, which the legacy stream stands in for when
  /// recording (uses_legacy_stream) but whose work the blocking stream does not wait for.
  static bool is_legacy_stream(const stream_view& s) noexcept {
    return !s.is_per_thread() && detail::may_use_legacy_stream(s);
  }

  /// Records the deferred uses whose streams can take an event now (mutex_ held, outside a capture of the caller;
  /// or, at the release, no lock and `later` null). The legacy default stream, refused while a gpukit capture runs,
  /// is marked on the private blocking stream (when the pool has one), which CUDA orders after its earlier work.
  /// Where the event cannot be kept (out of host memory), `wait_on` (the launch's stream, or the release's) waits for
  /// it on the device at once and the use stays deferred; without `wait_on`, or when that wait fails, the host waits.
  /// A destroyed stream's last work (its final event) is waited for by `wait_on` on the device, the use kept until it
  /// completes; where the device cannot wait for it, the host waits: after the lock (finish_host_waits) when the
  /// stream can be put in `later`, else now. A use that fails is reported (in `later`, for the
  /// caller to warn after its lock; without `later`, now) and dropped, so that it does not fail every later launch.
  /// Returns whether a use is left that nothing waits for (its stream still cannot take an event).
  bool record_deferred_uses(const stream_view* wait_on, after_lock* later = nullptr) noexcept {
    bool unordered = false;
    for (auto it = deferred_uses_.begin(); it != deferred_uses_.end();) {
      const detail::kept_stream& use = *it;
      bool destroyed = false;
      // Destroyed by another thread since `destroyed` was read, its handle perhaps a new stream's by a record below
      // (which then ordered only that one's work, or failed): that event is not kept (an earlier one of the stream
      // stays), and the use is looked at again as a destroyed stream's (its final event).
      const auto destroyed_meanwhile = [&] { return !destroyed && use.destroyed(); };
      try {
        destroyed = use.destroyed();
        detail::capture_hold hold(!destroyed && detail::may_use_legacy_stream(use.view));
        // Not another thread's per-thread stream: the blocking stream is ordered after the legacy stream's work only.
        const bool through_marker =
            !destroyed && marker_stream_ && hold.refuses(use.view) && is_legacy_stream(use.view);
        const stream_view on = through_marker ? marker_stream_->view() : use.view;  // where its event is recorded
        if (destroyed) {
          if (use.life->finished()) {  // its final event has completed, or the device was synchronized since
            it = deferred_uses_.erase(it);
            continue;
          }
          const cudaEvent_t last = use.life->final_event();
          if (last != nullptr && wait_on != nullptr && waits_on_device(*wait_on, last)) {
            ++it;  // later launches wait for it too, until it completes
            continue;
          }
          if (last == nullptr && detail::gpukit_capture_underway()) {
            // No final event (destroyed while captured): only a device synchronize would do, which invalidates a
            // capture running now. Left for later; the release keeps the reserve if it is still left then.
            unordered = true;
            ++it;
            continue;
          }
          hold.release();
          if (later != nullptr && put_host_wait(*later, use.life)) {
            ++it;  // dropped once waited for
            continue;
          }
          use.life->wait_finished();
        } else if (!through_marker && unrecordable_now(use, hold)) {
          // Still captured: its earlier work is recorded at a later launch. Unordered, unless the stream is still in
          // the pool's capture whose free deferred it: until that capture ends the block serves only that capture's
          // own allocations (free_for_any_stream), so no launch can reuse it yet.
          if (it->freed_in == 0 || capture_of(use.view) != it->freed_in) unordered = true;
          ++it;
          continue;
        } else if (const auto found = uses_.find(use.view.id()); found != uses_.end()) {
          event done(device_);
          detail::record_from_any_thread(done, on);
          if (destroyed_meanwhile()) continue;
          found->second = std::move(done);
        } else {
          decltype(uses_)::node_type room;  // made before the record: keeping its event then cannot fail
          try {
            room = detail::detached_node<decltype(uses_)>(use.view.id(), event(device_));
          } catch (const std::bad_alloc&) {
          }
          if (room) {
            detail::record_from_any_thread(room.mapped(), on);
            if (destroyed_meanwhile()) continue;
            uses_.insert(std::move(room));
          } else {
            // No room to keep the event: `wait_on` waits for it now, and the use stays deferred, recorded again at
            // each launch until there is room (later launches must wait for it too).
            event done(device_);
            detail::record_from_any_thread(done, on);
            if (destroyed_meanwhile()) continue;
            if (wait_on != nullptr) {
              bool waited = true;
              try {
                if (wait_on->id() != use.view.id()) done.wait(*wait_on);  // its own work is ordered by the stream
              } catch (const std::exception&) {
                waited = false;
              }
              if (waited) {
                ++it;
                continue;
              }
            }
            hold.release();  // a capture may begin while the host waits
            done.synchronize();
          }
        }
      } catch (const std::exception& e) {
        if (destroyed_meanwhile()) continue;
        note_failure(later, "could not record the work of a stream that used a freed block (", e.what());
      } catch (...) {
        if (destroyed_meanwhile()) continue;
        note_failure(later, "could not record the work of a stream that used a freed block (", "unknown exception");
      }
      it = deferred_uses_.erase(it);
    }
    return unordered;
  }

  /// Puts `life` in `later`'s host waits once; false if there is no room (the caller waits now).
  static bool put_host_wait(after_lock& later, const std::shared_ptr<const detail::stream_life>& life) noexcept {
    try {
      if (std::find(later.host_waits.begin(), later.host_waits.end(), life) == later.host_waits.end()) {
        later.host_waits.push_back(life);
      }
      return true;
    } catch (...) {
      return false;
    }
  }

  /// Makes `s` wait on the device for event `e` (of the pool's device); false if that fails. On the legacy default
  /// stream, under its hold (as event::wait takes one): false, enqueueing nothing, while a gpukit capture of a blocking
  /// stream of the device runs (the wait would join that capture and invalidate it). A capture begun with the raw
  /// runtime is not seen: the wait then fails, and the caller waits on the host.
  bool waits_on_device(const stream_view& s, cudaEvent_t e) noexcept {
    try {
      std::optional<detail::legacy_stream_hold> hold;
      if (is_legacy_stream(s)) {
        hold.emplace(device_.ordinal(), true);
        if (hold->refused()) return false;
      }
      detail::cuda_backend::wait_event({s.cuda_handle(), device_.ordinal()}, e, device_.ordinal());
      return true;
    } catch (...) {
      return false;
    }
  }

  /// The pool's private blocking stream (made on first use, outside the lock): work on it is ordered after the legacy
  /// default stream's earlier work, and it can take an event while another thread captures. Throws cuda_error if it
  /// cannot be created.
  const stream* marker_stream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (marker_stream_) return &*marker_stream_;
    }
    stream_options blocking;
    blocking.non_blocking = false;
    std::optional<stream> made(std::in_place, device_, blocking);  // destroyed after the lock if another made one
    std::lock_guard<std::mutex> lock(mutex_);
    if (!marker_stream_) marker_stream_ = std::move(made);
    return &*marker_stream_;
  }

  /// The pool's captures have ended: every free block a graph used may serve any stream of later captures (merged
  /// again); untouched ones stay so.
  void free_for_any_stream() noexcept {
    // In address order, each block merged into the one before it when they touch (in their own nodes: no
    // allocation).
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second.stream == untouched) continue;
      it = rekey_free(it, it->first, it->second.size, any_stream);
      if (it == free_.begin()) continue;
      const auto previous = std::prev(it);
      if (previous->second.stream == any_stream && previous->second.chunk == it->second.chunk &&
          previous->first + previous->second.size == it->first) {
        const std::size_t size = previous->second.size + it->second.size;
        erase_free(it->first);
        it = rekey_free(previous, previous->first, size, any_stream);
      }
    }
  }

  /// For a capture that found no block of `size`: merges the smallest window of touching free blocks of one chunk,
  /// any stream's or untouched, that holds it into one block of any stream's (its untouched part is the graph's now),
  /// in the blocks' own nodes. The untouched blocks outside the window stay so. False, changing nothing, when none
  /// holds it.
  bool merge_run_for(std::size_t size) noexcept {
    const auto joins = [](const free_block& f) { return f.stream == any_stream || f.stream == untouched; };
    auto best = free_.end();
    std::size_t best_size = no_fit;
    auto left = free_.begin();  // the window is [left, right], touching blocks that join, its bytes `window`
    std::size_t window = 0;
    for (auto right = free_.begin(); right != free_.end(); ++right) {
      if (!joins(right->second)) {
        left = std::next(right);
        window = 0;
        continue;
      }
      if (right != left) {
        const auto previous = std::prev(right);
        if (previous->second.chunk != right->second.chunk || previous->first + previous->second.size != right->first) {
          left = right;  // a gap: a new run
          window = 0;
        }
      }
      window += right->second.size;
      while (left != right && window - left->second.size >= size) window -= (left++)->second.size;
      if (window >= size && window < best_size) {
        best = left;
        best_size = window;
      }
    }
    if (best == free_.end()) return false;
    for (std::size_t merged = best->second.size; merged < best_size;) {
      const auto next = std::next(best);
      merged += next->second.size;
      erase_free(next->first);
    }
    (void)rekey_free(best, best->first, best_size, any_stream);
    return true;
  }

  /// Whether `p` lies inside the reserve of `pool` (a graph_pool), freed or not.
  static bool holds_in_reserve(const device_allocator& pool, const void* p) noexcept {
    const auto& self = static_cast<const graph_pool&>(pool);
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    try {
      std::lock_guard<std::mutex> lock(self.mutex_);
      for (const chunk_info& c : self.chunks_) {
        if (address >= c.address && address - c.address < c.size) return true;
      }
    } catch (...) {
      // The mutex failed: not known to be the pool's.
    }
    return false;
  }

  /// Makes the pool known to the caching allocators (once; never with mutex_ held: the registry's lock comes first).
  void register_live() {
    auto& registry = detail::capture_pools();
    std::lock_guard<std::mutex> lock(registry.mutex);
    if (live_registered_) return;
    registry.live.push_back(detail::live_capture_pool{this, &holds_in_reserve});
    registry.live_count.fetch_add(1, std::memory_order_relaxed);
    live_registered_ = true;
  }

  /// The last shared_ptr went: end now, or when the last allocation is freed.
  void orphan() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!live_.empty()) {
        orphaned_ = true;
        return;
      }
    }
    delete this;
  }

  /// Returns the reserve to the backing allocator, ordered on the device after the work of the graphs' launches and
  /// of the streams that used its memory: a private stream waits for their events, and the reserve is freed after
  /// that stream's work. The host never waits for them (a launch held back by a host function this thread would
  /// release later must not deadlock the release), and the pool itself makes no wait on the legacy default stream
  /// (refused while another thread captures a blocking stream; what the backing allocator does with its own streams
  /// is its rule). Where the private stream cannot be had or cannot wait, the host waits instead (in relaxed capture
  /// mode); at process exit nothing is left to order. Where some work cannot be ordered at all (a launch that could
  /// not be waited for, or a stream that used the memory and is captured at the release), the reserve is kept for
  /// good, with a warning: better lost than reused under that work.
  void release_reserve() noexcept {
    {
      auto& registry = detail::capture_pools();
      std::lock_guard<std::mutex> lock(registry.mutex);
      if (live_registered_) {
        registry.live.erase(std::remove_if(registry.live.begin(), registry.live.end(),
                                           [this](const detail::live_capture_pool& live) { return live.pool == this; }),
                            registry.live.end());
        registry.live_count.fetch_sub(1, std::memory_order_relaxed);
      }
    }
    if (unordered_launch_) {  // a launch that neither took its event nor could be waited for may still run
      keep_reserve("a launch of its graphs could not be waited for");
      return;
    }
    bool torn_down = false;  // process exit: the runtime went, and the reserve with it
    std::optional<stream> order = release_order_stream(torn_down);
    if (!torn_down) make_marker_for_legacy_uses();
    bool unordered = false;
    if (order) {
      const stream_view order_view = order->view();
      unordered = record_deferred_uses(&order_view);
    } else if (!torn_down) {
      unordered = record_deferred_uses(nullptr);
    }
    if (unordered) {
      // Their stream is captured (its earlier work cannot take an event, nor be waited for) or is the legacy default
      // stream during a gpukit capture: nothing can order the reserve's reuse after their work.
      keep_reserve(
          "a stream that used its memory is being captured (or is the legacy default stream while a gpukit capture "
          "runs, or was destroyed during a capture and a gpukit capture runs now), so its work cannot be ordered "
          "before the memory's reuse");
      return;
    }
    for (auto& [id, launch] : launches_) {
      (void)id;
      if (torn_down) break;
      try {
        device_guard guard(device_);
        wait_before_release(order, launch.event);
        detail::report_cuda_failure(cudaEventDestroy(launch.event), "cudaEventDestroy", device_.ordinal());
      } catch (const std::exception& ex) {
        if (torn_down_by(ex)) break;
        report("could not make its device current to release it: ", ex);
      }
    }
    launches_.clear();
    for (auto& [id, e] : uses_) {
      (void)id;
      wait_before_release(order, e);
    }
    uses_.clear();
    for (const chunk_info& c : chunks_) {
      try {
        if (order) {
          backing_->deallocate(reinterpret_cast<void*>(c.address), order->view());
        } else {
          backing_->deallocate(reinterpret_cast<void*>(c.address));
        }
      } catch (const std::exception& ex) {
        detail::warn_parts("gpukit::graph_pool: returning ", detail::bytes_part{c.size}, " failed: ", ex.what());
      }
    }
  }

  /// At the release, a private blocking stream to mark the deferred uses of the legacy default stream on (it may be
  /// refused while a gpukit capture runs: record_deferred_uses), where the reserve did not make one. Never throws: a
  /// failure is reported, and the reserve is kept if such a use is left unordered.
  void make_marker_for_legacy_uses() noexcept {
    const bool legacy_use = std::any_of(deferred_uses_.begin(), deferred_uses_.end(), [](const detail::kept_stream& u) {
      return !u.destroyed() && is_legacy_stream(u.view);
    });
    if (!legacy_use) return;
    try {
      (void)marker_stream();
    } catch (const std::exception& ex) {
      report("could not create a stream to order the legacy default stream's work by: ", ex);
    }
  }

  /// The private stream the release orders the reserve's return by: none when there is nothing to wait for, or when
  /// it cannot be created (reported; the host waits then). `torn_down` is set when the runtime is gone (process exit).
  std::optional<stream> release_order_stream(bool& torn_down) noexcept {
    for (auto it = uses_.begin(); it != uses_.end();) {  // completed: nothing to order (the reserve's, usually)
      it = detail::cuda_backend::query_event(it->second.cuda_handle()) == cudaSuccess ? uses_.erase(it) : std::next(it);
    }
    if (launches_.empty() && uses_.empty() && deferred_uses_.empty()) return std::nullopt;
    try {
      return std::optional<stream>(std::in_place, device_);  // non-blocking: not ordered with the legacy stream
    } catch (const std::exception& ex) {
      torn_down = torn_down_by(ex);
      report("could not create a stream to order its release by, so the host waits for its work: ", ex);
    }
    return std::nullopt;
  }

  /// Orders the release after launch event `e` (device_ current): `order` waits for it on the device, or, without
  /// `order` or when that wait fails, the host waits.
  void wait_before_release(std::optional<stream>& order, cudaEvent_t e) noexcept {
    if (order) {
      const cudaError_t waited = cudaStreamWaitEvent(order->cuda_handle(), e, 0);
      if (waited == cudaSuccess) return;
      (void)cudaGetLastError();
    }
    try {
      detail::cuda_backend::synchronize_event(e, device_.ordinal(), "cudaEventSynchronize (a graph pool's release)");
    } catch (const std::exception& ex) {
      report("could not wait for its graphs' work: ", ex);
    }
  }

  /// The same for the event after a stream's use of the pool's memory (record_use).
  void wait_before_release(std::optional<stream>& order, const event& e) noexcept {
    try {
      if (order) {
        try {
          e.wait(order->view());
          return;
        } catch (const std::exception&) {  // the host waits instead
        }
      }
      e.synchronize();
    } catch (const std::exception& ex) {
      report("could not wait for the work of a stream that used its memory: ", ex);
    }
  }

  /// Drops the launch events that have completed and that no launch holds (mutex_ held, the device current): a
  /// stream launched on once would otherwise keep its event for the pool's life. The next prune waits until the
  /// list has doubled, so that a launch costs O(1) amortized.
  void drop_completed_launches_locked() noexcept {
    for (auto it = launches_.begin(); it != launches_.end();) {
      if (it->second.preparing == 0 && detail::cuda_backend::query_event(it->second.event) == cudaSuccess) {
        (void)cudaEventDestroy(it->second.event);
        it = launches_.erase(it);
      } else {
        ++it;
      }
    }
    prune_launches_at_ = std::max<std::size_t>(16, 2 * launches_.size());
  }

  /// Keeps the reserve from the backing allocator for good, saying `why` through gpukit::warn, and drops the launch
  /// events (legal while pending).
  void keep_reserve(const char* why) noexcept {
    detail::warn_parts("gpukit::graph_pool: keeps its reserve of ", detail::bytes_part{reserved_}, " on ", device_,
                       ": ", why);
    for (auto& [id, launch] : launches_) {
      (void)id;
      (void)cudaEventDestroy(launch.event);
    }
    (void)cudaGetLastError();
    launches_.clear();
  }

  /// True for the error of a runtime torn down at process exit (detail::is_teardown_result).
  static bool torn_down_by(const std::exception& ex) noexcept {
    const auto* failure = dynamic_cast<const error*>(&ex);
    return failure != nullptr && detail::is_teardown_result(failure->cuda_result());
  }

  /// Reports a failure of the release through gpukit::warn, except a teardown's (torn_down_by: nothing is left to
  /// release then); never throws.
  static void report(const char* what, const std::exception& ex) noexcept {
    if (torn_down_by(ex)) return;
    detail::warn_parts("gpukit::graph_pool: ", what, ex.what());
  }

  [[noreturn]] void throw_not_owned(const void* p) const {
    throw invalid_argument_error("gpukit::graph_pool of " + device_.to_string() + ": " + detail::format_pointer(p) +
                                 " is not a live allocation of this pool (a double free, a foreign pointer or one "
                                 "into the middle of an allocation)");
  }

  /// For a request of `bytes` (`size` rounded) on the stream of id `id` (`in_capture`: in a capture the pool serves,
  /// else a direct allocation) that no free block could serve.
  [[noreturn]] void throw_out_of_memory(std::size_t bytes, std::size_t size, std::uint64_t id, bool in_capture) {
    out_of_memory_info info;
    std::size_t kept_for_others = 0;  // free, but for other streams until the captures end
    std::size_t largest_kept = 0;
    std::size_t largest_usable = 0;  // by this stream
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++ooms_;
      info.device = device_.ordinal();
      info.requested = bytes;
      info.rounded = info.segment_bytes = size;
      info.allocated = static_cast<std::size_t>(allocated_bytes_.current);
      info.reserved = reserved_;
      for (const auto& entry : free_) {
        const free_block& f = entry.second;
        info.free_cached += f.size;
        info.largest_free_block = std::max(info.largest_free_block, f.size);  // as the caching allocators count it
        if (f.stream == untouched || (in_capture && (f.stream == id || f.stream == any_stream))) {
          largest_usable = std::max(largest_usable, f.size);
        } else {
          kept_for_others += f.size;
          largest_kept = std::max(largest_kept, f.size);
        }
      }
      info.reserved_limit = reserved_;
      info.limit_hit = true;
    }
    using detail::format_bytes;
    info.message =
        "gpukit: out of memory in the graph pool of " + device_.to_string() + ": tried to allocate " +
        detail::format_bytes_exact(bytes) + "; the pool reserves " + format_bytes(info.reserved) + ", " +
        format_bytes(info.allocated) + " allocated, largest free block this stream may take " +
        format_bytes(largest_usable) +
        (kept_for_others == 0
             ? std::string()
             : "; " + format_bytes(kept_for_others) + " more is free (largest block " + format_bytes(largest_kept) +
                   (in_capture ? ") but kept for other streams until the pool's captures end (a block freed in a "
                                 "capture serves only the stream it was allocated on, or none if another stream used "
                                 "it)"
                               : ") but used by the pool's graphs, which may write it at each launch: it serves "
                                 "their captures, not direct allocations")) +
        ". A capture cannot allocate device memory: reserve more before it (graph_pool::reserve).";
    observers_.notify(info, device_.to_string());
    throw out_of_memory_error(info.message, cudaSuccess, "gpukit::graph_pool::allocate(" + std::to_string(bytes) + ")",
                              device_.ordinal());
  }

  gpukit::device device_;
  device_resource* backing_;
  mutable std::mutex mutex_;
  std::vector<chunk_info> chunks_;
  std::map<std::uintptr_t, free_block> free_;
  // Best fit per reuser (a stream id, any_stream, after_captures): smallest size, then lowest address.
  std::set<std::tuple<std::uint64_t, std::size_t, std::uintptr_t>> by_size_;
  std::map<std::uintptr_t, live_block> live_;
  /// The event after a stream's latest launch; `preparing`: launches between prepare_launch and note_launch, which
  /// hold the event (not dropped meanwhile).
  struct launch_event {
    cudaEvent_t event;
    unsigned preparing;
  };
  std::map<unsigned long long, launch_event> launches_;  // by stream id
  std::size_t prune_launches_at_ = 16;                   // launches_'s size at which completed events are dropped
  std::map<unsigned long long, event> uses_;  // stream id -> the event after its work at its latest free (record_use)
  std::optional<stream> marker_stream_;       // blocking: marks the legacy stream's work before the reserve (reserve)
  /// A use whose stream was captured at the free (record_use); `freed_in`: see defer.
  struct deferred_use : detail::kept_stream {
    unsigned long long freed_in = 0;
  };
  std::vector<deferred_use> deferred_uses_;
  std::atomic<bool> has_uses_{false};  // uses_ or deferred_uses_ is not empty (read without the lock)
  std::size_t reserved_ = 0;
  stat allocations_, allocated_bytes_, requested_bytes_, segments_, reserved_bytes_;  // stats(), as PyTorch keeps them
  std::int64_t ooms_ = 0;
  int captures_ = 0;
  bool orphaned_ = false;
  bool warned_unordered_ = false;  // order_launch said once that a launch could not wait for a captured stream
  bool unordered_launch_ = false;  // a launch could be neither recorded nor waited for: the reserve is kept
  bool live_registered_ = false;   // guarded by the registry's mutex
  detail::out_of_memory_observers observers_;
};

GPUKIT_END_NAMESPACE
