// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// async_allocator: a device_allocator over CUDA's stream-ordered allocator (cudaMallocAsync / cudaFreeAsync from
/// the device's default memory pool), for programs that prefer the driver's pool to gpukit's caching engine: the
/// pool is shared with every other library of the process that uses it, and allocations are legal inside CUDA graph
/// capture (they become graph memory nodes). With the same statistics, record_stream, out-of-memory handling and
/// observers as the caching allocator:
///
///     gpukit::async_allocator a(gpukit::device::cuda(0), 1ull << 30);  // keep up to 1 GiB in the pool at syncs
///     void* p = a.allocate(bytes, s);                                    // cudaMallocAsync on s
///     a.deallocate(p);                                                   // cudaFreeAsync on s
///
/// The pool's release threshold (cudaMemPoolAttrReleaseThreshold) is how much freed memory the pool keeps at a
/// synchronization point; CUDA's default, 0, returns it all, which makes every step after a synchronization pay for
/// new memory (300-400 ms stalls re-allocating 16 GB were reported). The constructor sets it on the device's default
/// pool, which other users of that pool then share. record_stream and deallocate(p, s) take only streams of the
/// allocator's device (the caching allocator takes other devices' too): for a peer's use, order a stream of this
/// device after it with event::record + event::wait and pass that stream.
///
/// Graph allocations. A request on a stream being captured becomes an allocation node of the graph (CUDA's graph
/// memory nodes): its address is fixed at the capture, and its memory, from the device's graph memory pool, not the
/// default pool, exists from each launch of the graph until its free (a free node, when it is freed in the capture;
/// otherwise a free after the launch). So the statistics (stats, memory_allocated, max_memory_allocated, snapshot)
/// leave graph allocations out, and the limit does not count them: they count memory of the pool, as reserved bytes
/// do (PyTorch's cudaMallocAsync backend reports the pool's used memory likewise; the caching allocators leave
/// captured memory to graph_pool, whose own statistics count it). graph_allocations() counts those not freed yet.
/// CUDA lets a graph allocation kept past its capture be freed outside the graph only after a launch of the graph,
/// ordered after it (on the launching stream, or one that waits for it). A free outside the capture while the
/// capture is underway is refused (invalid_argument_error). Once it has ended, gpukit cannot tell whether the graph
/// was launched (launches are the graph's, and may be made with the raw runtime): a free before the first launch,
/// or of memory of a graph never made or never launched, is not detected (CUDA may refuse it, or free memory not
/// yet allocated). Allocations are asked whether they are captured only while a gpukit capture (gpukit::capture) is
/// underway, to spare ordinary allocations that query: those of a capture begun with the raw runtime
/// (cudaStreamBeginCapture) are counted as the pool's, and their frees are not checked, unless a gpukit capture runs
/// at the same time.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/detail/map_node.hpp>
#include <gpukit/memory/detail/upstream_stream.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// cudaMallocAsync / cudaFreeAsync behind device_allocator (see the file comment). Thread-safe.
class async_allocator final : public device_allocator {
 public:
  /// An allocator of CUDA device `d` over its default memory pool, whose release threshold becomes
  /// `release_threshold` bytes (std::numeric_limits<std::size_t>::max(): keep everything, as gpukit's cache does).
  /// Throws invalid_argument_error for the CPU, cuda_error where the device has no memory pools.
  explicit async_allocator(gpukit::device d, std::size_t release_threshold = std::numeric_limits<std::size_t>::max())
      : device_(d) {
    if (!d.is_cuda()) {
      throw invalid_argument_error("gpukit::async_allocator: " + d.to_string() +
                                   " is not a CUDA device (cudaMallocAsync needs one)");
    }
    device_guard guard(d);
    GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceGetDefaultMemPool(&pool_, d.ordinal()), "cudaDeviceGetDefaultMemPool",
                              d.ordinal());
    cuuint64_t threshold = release_threshold;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
                              "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)", d.ordinal());
  }
  async_allocator(const async_allocator&) = delete;
  async_allocator& operator=(const async_allocator&) = delete;

  /// Live allocations are reported through gpukit::warn and freed after the device's work: the streams they were
  /// allocated on or recorded with may be gone by now, so none of them is used. Frees still waiting for a gpukit
  /// capture to end (deferred_frees()), and live allocations whose free would have to wait for one, are left undone,
  /// and reported: their memory stays in the pool.
  ~async_allocator() override {
    free_deferred();
    std::map<std::uintptr_t, allocation> live;
    std::size_t waiting = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live.swap(live_);
      waiting = deferred_.size();
    }
    if (waiting != 0) {
      detail::warn_parts("gpukit: the async allocator of ", device_, " is destroyed with ", waiting,
                         " free(s) waiting for a CUDA graph capture to end; that memory stays in the pool, unfreed");
    }
    if (live.empty()) return;
    detail::warn_parts("gpukit: the async allocator of ", device_, " is destroyed with ", live.size(),
                       " live allocation(s); they are freed now, so any later use of them is invalid");
    for (const auto& entry : live) {
      forget_over_aligned_addresses(reinterpret_cast<const void*>(entry.first), entry.second.bytes);
      if (free_after_device(reinterpret_cast<void*>(entry.first), entry.second.bytes) == free_result::done) continue;
      detail::warn_parts("gpukit: the async allocator of ", device_, " leaves ", detail::bytes_part{entry.second.bytes},
                         " unfreed: its free needs the legacy default stream while a CUDA graph capture is underway");
    }
  }

  gpukit::device device() const noexcept override { return device_; }

  /// Allocation counts and bytes as gpukit keeps them (graph allocations left out: see the file comment); reserved
  /// bytes as the pool reports them (current and high water mark; the pool's memory, shared with its other users).
  allocator_stats stats() const override { return stats_of(read_pool()); }
  /// The pool's reserved memory not in use (cudaMemPoolAttrUsedMemCurrent counts every user's live memory, the pool
  /// being shared: this allocator's is only part of it), reported as one block (the pool's layout is the driver's).
  free_space_info free_space() const override { return free_space_of(read_pool()); }
  /// One segment per live allocation (the pool's layout is the driver's), graph allocations left out.
  allocator_snapshot snapshot() const override {
    allocator_snapshot snap;
    snap.device = device_;
    const pool_reading pool = read_pool();
    std::lock_guard<std::mutex> lock(mutex_);  // the statistics and the allocations of one moment
    snap.stats = stats_locked(pool);
    for (const auto& [address, a] : live_) {
      if (a.capture != 0) continue;  // the graph's memory, as in the statistics
      segment_info seg;
      seg.address = address;
      seg.size = a.bytes;
      seg.mapped = a.bytes;
      seg.blocks.push_back(block_info{address, a.bytes, a.bytes, block_state::allocated,
                                      reinterpret_cast<std::uintptr_t>(a.stream.view.native_handle()), 0});
      snap.segments.push_back(std::move(seg));
    }
    snap.pointer_map_entries = live_.size() - graph_allocations_.count;
    return snap;
  }
  /// The statistics' table, and a row for the live graph allocations (the graphs' memory, which it leaves out).
  std::string memory_summary() const override {
    const pool_reading pool = read_pool();  // one reading for the table and the free space: they agree
    std::string summary = format_memory_summary("gpukit async allocator (cudaMallocAsync), " + device_.to_string(),
                                                stats_of(pool), free_space_of(pool));
    const graph_allocation_totals graphs = graph_allocations();
    const std::size_t last_rule = summary.rfind("|=");
    if (graphs.count == 0 || last_rule == std::string::npos) return summary;
    char row[200];
    std::snprintf(
        row, sizeof row, "| %-36s %-48s |\n", "Graph allocs (not counted above):",
        (std::to_string(graphs.count) + " of " + detail::format_bytes(graphs.bytes) + ", their graphs' memory")
            .c_str());
    return summary.insert(last_rule, row);
  }

  /// Synchronizes the device and returns all of the pool's unused memory (cudaMemPoolTrimTo(0)). Throws as trim()
  /// does while a capture is in sight.
  void empty_cache() override { trim(0); }
  /// Synchronizes the device and trims the pool's unused memory to `target_reserved` bytes; returns reserved.
  /// Throws invalid_argument_error while a capture is in sight (a gpukit capture on any thread, or a capture of a
  /// blocking stream of the device, raw ones included: detail::capture_in_sight): cudaDeviceSynchronize would
  /// invalidate it, in any mode (measured on an H200 and an H100). A capture begun meanwhile, or a raw one of a
  /// non-blocking stream, cannot be seen, and is invalidated: trim outside captures. (A detail::capture_hold cannot
  /// keep captures off through the wait: the device's work may wait for the very thread that is beginning a capture.)
  std::size_t trim(std::size_t target_reserved) override {
    if (detail::capture_in_sight(device_)) {
      throw invalid_argument_error("gpukit::async_allocator::trim on " + device_.to_string() +
                                       ": a CUDA graph capture is underway, and the device-wide wait would invalidate "
                                       "it; trim (or empty_cache) after the capture",
                                   cudaSuccess, "cudaDeviceSynchronize", device_.ordinal());
    }
    free_deferred();
    device_guard guard(device_);
    // cudaMemPoolTrimTo is refused in global mode while any thread captures (cudaDeviceSynchronize in any mode).
    const detail::relaxed_capture_mode relaxed;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceSynchronize(), "cudaDeviceSynchronize (trim)", device_.ordinal());
    GPUKIT_CUDA_TRY_DESCRIBED(cudaMemPoolTrimTo(pool_, target_reserved), "cudaMemPoolTrimTo", device_.ordinal());
    return pool_attribute(cudaMemPoolAttrReservedMemCurrent);
  }
  /// Sets the peaks of allocations and allocated bytes to their current values, and resets the pool's high water
  /// mark of reserved bytes (cudaMemPoolAttrReservedMemHigh), which the pool's other users share.
  void reset_peak_stats() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      allocations_.peak = allocations_.current;
      allocated_bytes_.peak = allocated_bytes_.current;
    }
    device_guard guard(device_);  // CUDA calls outside the lock, as everywhere in this allocator
    cuuint64_t zero = 0;
    detail::report_cuda_failure(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
                                "cudaMemPoolSetAttribute(cudaMemPoolAttrReservedMemHigh)", device_.ordinal());
  }
  /// Zeroes the cumulative counts: allocations and frees with their bytes, retries, out-of-memory failures, and
  /// cudaMallocAsync / cudaFreeAsync calls.
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (stat* s : {&allocations_, &allocated_bytes_}) s->allocated = s->freed = 0;
    retries_ = ooms_ = device_allocs_ = device_frees_ = 0;
  }
  /// Caps the bytes allocated through this allocator (the pool's reserve is the driver's; graph allocations are not
  /// counted): a request beyond it throws out_of_memory_error.
  void set_reserved_limit(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = bytes;
  }
  void set_memory_fraction(double fraction) override {
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw invalid_argument_error("gpukit: a memory fraction must be in (0, 1], not " + std::to_string(fraction));
    }
    device_guard guard(device_);
    std::size_t free_bytes = 0, total_bytes = 0;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo", device_.ordinal());
    set_reserved_limit(static_cast<std::size_t>(fraction * static_cast<double>(total_bytes)));
  }

  std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer) override {
    return observers_.add(std::move(observer));
  }
  bool remove_out_of_memory_observer(std::uint64_t id) override { return observers_.remove(id); }

  /// The bytes of live allocations of this allocator from the pool (graph allocations are not: graph_allocations()).
  std::size_t memory_allocated() const noexcept override { return static_cast<std::size_t>(guarded(&stat::current)); }
  std::size_t memory_reserved() const noexcept override { return pool_attribute(cudaMemPoolAttrReservedMemCurrent); }
  /// The most bytes allocated through this allocator at once since it was created or reset_peak_stats() was called
  /// (graph allocations left out).
  std::size_t max_memory_allocated() const noexcept override { return static_cast<std::size_t>(guarded(&stat::peak)); }
  /// The pool's high water mark of reserved bytes (cudaMemPoolAttrReservedMemHigh, shared with the pool's other
  /// users); 0 where the driver cannot say.
  std::size_t max_memory_reserved() const noexcept override { return pool_attribute(cudaMemPoolAttrReservedMemHigh); }

  /// The memory pool (the device's default pool).
  cudaMemPool_t pool() const noexcept { return pool_; }

  /// Live graph allocations (see the file comment): how many, and their bytes.
  struct graph_allocation_totals {
    std::size_t count = 0;  ///< live graph allocations
    std::size_t bytes = 0;  ///< their bytes
  };
  /// The graph allocations this allocator made in gpukit captures and has not freed yet (outputs kept past their
  /// capture, or a capture still underway): memory of their graphs, which the statistics leave out.
  graph_allocation_totals graph_allocations() const noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      return graph_allocations_;
    } catch (...) {
      return {};
    }
  }

  /// Frees made while a gpukit capture was underway that must wait until the captures end: those ordered through
  /// the legacy default stream (memory of the legacy stream, or of another thread's per-thread default stream, for
  /// which it stands in), which CUDA refuses, invalidating the capture, while a blocking stream is captured. Off the
  /// allocation counts already; the next allocate, deallocate, trim or empty_cache after the captures frees them.
  std::size_t deferred_frees() const noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      return deferred_.size() + being_asked_;
    } catch (...) {
      return 0;
    }
  }

 private:
  // device_allocator's allocate/deallocate/record_stream/owns land here.
  /// cudaMallocAsync of `bytes` on `stream` (usable there at once; elsewhere after synchronizing with it; on the
  /// legacy default stream while a gpukit capture runs, on the device's upstream allocation stream and waited for on
  /// the host, since cudaMallocAsync on the legacy stream would invalidate a capture of a blocking stream). On
  /// cudaErrorMemoryAllocation the pool is trimmed and the request retried, then the device synchronized (not while a
  /// capture is in sight: detail::capture_in_sight), trimmed and retried once more (each retry decides again whether
  /// the legacy stream may be used: a capture may have begun during the waits), then out_of_memory_error (after the
  /// observers) with the numbers.
  void* do_allocate(std::size_t bytes, stream_view stream) override {
    if (bytes == 0) return nullptr;
    check_device(stream, "allocate");
    free_deferred();
    // A request on a stream being captured is an allocation node (a graph allocation: the graph's memory, not the
    // pool's), kept out of the statistics and the limit. Asked only while a gpukit capture is underway (one atomic
    // load otherwise), as an ordinary allocation asks CUDA nothing.
    const unsigned long long capture = detail::gpukit_capture_underway() ? capture_of(stream) : 0;
    // The bytes count against the limit from the check on, so that requests made meanwhile by other threads see
    // them (counted as allocated once the memory is had; given back if it is not).
    bool over_limit = false;
    if (capture == 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      const std::size_t counted = static_cast<std::size_t>(allocated_bytes_.current) + in_flight_bytes_;
      over_limit = bytes > limit_ || counted > limit_ - bytes;
      if (!over_limit) in_flight_bytes_ += bytes;
    }
    if (over_limit) throw_out_of_memory(bytes, true);
    struct in_flight {
      async_allocator& self;
      std::size_t bytes;  // 0 once given back or counted as allocated
      void give_back() noexcept {
        if (bytes == 0) return;
        std::lock_guard<std::mutex> lock(self.mutex_);
        self.in_flight_bytes_ -= bytes;
        bytes = 0;
      }
      ~in_flight() { give_back(); }
    } reserved{*this, capture == 0 ? bytes : 0};
    // Before the allocation, as it may throw (it looks the stream's id up, and allocates): once the memory is had,
    // recording it cannot fail.
    live_map::node_type record =
        detail::detached_node<live_map>(std::uintptr_t{0}, allocation{bytes, kept_stream::of(stream), {}, capture});
    // On the legacy default stream it is work there, which invalidates a capture of a blocking stream in any mode
    // (as every legacy-stream call measured on an H200 does). While a gpukit capture runs, the memory comes from the
    // device's upstream allocation stream instead, waited for on the host, so that it is usable on any stream at once.
    const bool may_use_legacy = detail::may_use_legacy_stream(stream);
    detail::capture_hold hold(may_use_legacy);  // until the allocation is enqueued
    bool off_legacy = false;
    // Another thread's per-thread default stream cannot be named here (cudaStreamPerThread is this thread's): the
    // legacy default stream, which waits for it, stands in, as it does for frees.
    cudaStream_t handle = record.mapped().stream.handle_here();
    const auto choose_stream = [&] {
      if (off_legacy || !hold.refuses(stream)) return;
      off_legacy = true;
      handle = detail::upstream_stream(device_, detail::upstream_stream_use::allocations);
    };
    choose_stream();
    device_guard guard(device_);
    // On a stream that is not captured, cudaMallocAsync (and cudaMemPoolTrimTo) are refused in global mode while any
    // thread captures, and invalidate that capture; relaxed, they are not. Captured, it is a node either way.
    const detail::relaxed_capture_mode relaxed;
    void* p = nullptr;
    // From pool_ by name: cudaMallocAsync takes the device's current pool, which another library may have set
    // (cudaDeviceSetMemPool), while the threshold, trims and statistics here are pool_'s.
    cudaError_t result = cudaMallocFromPoolAsync(&p, bytes, pool_, handle);
    hold.release();  // the retries below wait for the device, and observers run on failure
    for (int retry = 0; result == cudaErrorMemoryAllocation && retry < 2; ++retry) {
      (void)cudaGetLastError();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++retries_;
      }
      // cudaDeviceSynchronize invalidates a capture in any mode: while one is in sight (a gpukit capture, or a
      // capture of a blocking stream of the device), or when this request is captured (an allocation node, in a
      // capture begun with the raw runtime), the pool is trimmed again without it (the memory freed on streams since
      // is all that can come back).
      if (retry == 1 && !detail::capture_in_sight(device_) && !captured_or_unknown(stream)) {
        GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceSynchronize(), "cudaDeviceSynchronize (out of memory)", device_.ordinal());
      }
      GPUKIT_CUDA_TRY_DESCRIBED(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo", device_.ordinal());
      (void)hold.retake(may_use_legacy);
      choose_stream();
      result = cudaMallocFromPoolAsync(&p, bytes, pool_, handle);
      hold.release();
    }
    if (result == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      reserved.give_back();  // before the observers run, which may allocate
      throw_out_of_memory(bytes, false);
    }
    GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaMallocFromPoolAsync(" + std::to_string(bytes) + ")", device_.ordinal());
    if (off_legacy) {
      try {
        detail::synchronize_upstream_stream(device_, detail::upstream_stream_use::allocations);
      } catch (...) {
        (void)cudaFreeAsync(p, handle);
        throw;
      }
    }
    record.key() = reinterpret_cast<std::uintptr_t>(p);
    live_map::insert_return_type inserted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      inserted = live_.insert(std::move(record));
      if (!inserted.inserted) {
        // The pool handed out an address still recorded as live: that memory was freed behind this allocator's back
        // (cudaFreeAsync of one of its pointers). The new allocation is the real one; the stale record goes, freed.
        std::swap(inserted.position->second, inserted.node.mapped());
        count_locked(inserted.node.mapped(), -1);
      }
      in_flight_bytes_ -= reserved.bytes;
      reserved.bytes = 0;
      count_locked(inserted.position->second, 1);
      if (capture == 0) ++device_allocs_;
    }
    if (!inserted.inserted) {  // outside the lock: a warning handler may use the allocator
      const std::string text = detail::format_pointer(p);
      detail::warn_parts("gpukit::async_allocator: cudaMallocAsync returned ", text.c_str(),
                         ", still a live allocation of ", detail::bytes_part{inserted.node.mapped().bytes},
                         " here: it was freed without this allocator (cudaFreeAsync on its pointer?); that record is "
                         "dropped, and the memory is the new allocation's");
    }
    return p;
  }

  /// cudaFreeAsync on the stream it was allocated on, after the work recorded streams had enqueued (they make it
  /// wait for an event on the device, never on the host). Throws invalid_argument_error for a pointer this allocator
  /// does not own, for a graph allocation freed outside its capture while that capture is underway (see the file
  /// comment), or when a stream the free must be ordered after (a recorded one, or the allocation stream when
  /// freed on another) is being captured and the freeing stream is not (the free would join the capture), or the
  /// freeing stream is being captured and such a stream, alive, is not (the wait would end the capture); cuda_error
  /// when the free fails during a capture (CUDA frees there only memory allocated in a capture). Either way nothing
  /// was freed: the allocation is still live. nullptr is ignored.
  void do_deallocate(void* p) override { deallocate_on(p, nullptr); }
  /// The same, in the order of `stream` (memory last used there).
  void do_deallocate(void* p, stream_view stream) override {
    check_user_device(stream, "deallocate");
    deallocate_on(p, &stream);
  }

  /// `stream` also uses `p`: its free waits for the work `stream` has enqueued by then. A stream already listed
  /// (or the allocation's own) is listed once: the free waits for its work up to then anyway.
  void do_record_stream(void* p, stream_view stream) override {
    check_user_device(stream, "record_stream");
    kept_stream use = kept_stream::of(stream);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == live_.end()) throw_not_owned(p, "record_stream");
    allocation& a = it->second;
    // Compared without a CUDA call: a gpukit stream by its record, a per-thread one by the id resolved with it.
    const auto same = [&use](const kept_stream& k) {
      return k.life == use.life && k.view.native_handle() == use.view.native_handle() &&
             (!k.view.is_per_thread() || k.view.id() == use.view.id());
    };
    if (same(a.stream) || std::any_of(a.users.begin(), a.users.end(), same)) return;
    a.users.push_back(std::move(use));
  }

  bool do_owns(const void* p) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(reinterpret_cast<std::uintptr_t>(p)) != 0;
  }

  using kept_stream = detail::kept_stream;

  struct allocation {
    std::size_t bytes;
    kept_stream stream;              // allocated on (and by default freed on) this stream
    std::vector<kept_stream> users;  // record_stream
    unsigned long long capture = 0;  // a graph allocation: the capture that made it (0: the pool's memory)
  };
  using live_map = std::map<std::uintptr_t, allocation>;
  /// A free that waits until the legacy default stream may be used (deferred_frees()).
  struct deferred_free {
    deferred_free(void* freed, allocation&& of, kept_stream&& freed_on) noexcept
        : p(freed), a(std::move(of)), on(std::move(freed_on)) {}
    void* p;
    allocation a;
    kept_stream on;  // freed on this stream, after a's users
  };
  /// Whether a free was made (or failed for good, reported), or must wait for the gpukit captures to end: a capture
  /// began while it waited on the host, and the rest of its work would use the legacy stream.
  /// refused_in_capture: it failed during a capture and freed nothing (only where the caller asked for that).
  enum class free_result { done, wait_for_captures, refused_in_capture };

  /// Counts `a` as allocated (`sign` 1) or freed (-1), with mutex_ held: in the statistics, or apart for a graph
  /// allocation.
  void count_locked(const allocation& a, int sign) noexcept {
    if (a.capture != 0) {
      if (sign > 0) {
        ++graph_allocations_.count;
        graph_allocations_.bytes += a.bytes;
      } else {
        --graph_allocations_.count;
        graph_allocations_.bytes -= a.bytes;
      }
      return;
    }
    add(allocations_, sign);
    add(allocated_bytes_, sign * static_cast<std::int64_t>(a.bytes));
  }
  static void add(stat& s, std::int64_t delta) noexcept {
    s.current += delta;
    if (delta > 0) {
      s.allocated += delta;
      s.peak = std::max(s.peak, s.current);
    } else {
      s.freed -= delta;
    }
  }
  std::int64_t guarded(std::int64_t stat::*member) const noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      return allocated_bytes_.*member;
    } catch (...) {
      return 0;
    }
  }

  /// The pool's reserved bytes, current and high-water mark, and its used bytes (CUDA calls: read before the lock is
  /// taken).
  struct pool_reading {
    std::int64_t reserved = 0;
    std::int64_t reserved_high = 0;
    std::int64_t used = 0;
  };
  pool_reading read_pool() const noexcept {
    return {static_cast<std::int64_t>(pool_attribute(cudaMemPoolAttrReservedMemCurrent)),
            static_cast<std::int64_t>(pool_attribute(cudaMemPoolAttrReservedMemHigh)),
            static_cast<std::int64_t>(pool_attribute(cudaMemPoolAttrUsedMemCurrent))};
  }
  /// free_space() from one reading of the pool.
  static free_space_info free_space_of(const pool_reading& pool) noexcept {
    free_space_info f;
    const std::int64_t free_bytes = pool.reserved - pool.used;
    f.free_bytes = free_bytes > 0 ? static_cast<std::size_t>(free_bytes) : 0;
    f.free_blocks = f.free_bytes > 0 ? 1 : 0;
    f.largest_free_block = f.free_bytes;
    return f;
  }
  /// stats() from one reading of the pool (read before: CUDA calls, with a guard that may warn, not under the lock).
  allocator_stats stats_of(const pool_reading& pool) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_locked(pool);
  }
  /// stats(), with mutex_ held.
  allocator_stats stats_locked(const pool_reading& pool) const {
    allocator_stats s;
    for (pool_stats* p : {&s.allocation, &s.active}) p->pools[0] = allocations_;
    for (pool_stats* p : {&s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) p->pools[0] = allocated_bytes_;
    s.reserved_bytes.pools[0].current = pool.reserved;
    s.reserved_bytes.pools[0].peak = pool.reserved_high;
    s.num_alloc_retries = retries_;
    s.num_ooms = ooms_;
    s.num_device_alloc = device_allocs_;
    s.num_device_free = device_frees_;
    s.reserved_limit = limit_;
    return s;
  }

  /// A pool attribute in bytes; 0 where the driver cannot say.
  std::size_t pool_attribute(cudaMemPoolAttr attribute) const noexcept {
    try {
      device_guard guard(device_);
      cuuint64_t value = 0;
      if (cudaMemPoolGetAttribute(pool_, attribute, &value) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
      }
      return static_cast<std::size_t>(value);
    } catch (...) {
      return 0;
    }
  }

  /// The capture `s` (whose record is `life`, or nullptr) takes part in, asked while it is kept from destruction; 0
  /// when it is not captured, destroyed, or cannot be asked (another thread's per-thread stream, a failed query).
  static unsigned long long capture_of(const stream_view& s, const detail::stream_life* life) noexcept {
    try {
      std::unique_lock<std::mutex> alive;
      if (life != nullptr) alive = life->keep_alive();
      if (life != nullptr && life->expired()) return 0;
      return detail::capture_id(s);
    } catch (...) {
      (void)cudaGetLastError();
      return 0;
    }
  }
  static unsigned long long capture_of(const stream_view& s) noexcept {
    try {
      return capture_of(s, s.lifetime().get());
    } catch (...) {
      return 0;
    }
  }
  /// Whether `s` is being captured, or cannot be asked (then no device-wide wait is risked). Asked on rare paths only.
  static bool captured_or_unknown(const stream_view& s) noexcept {
    try {
      return detail::capture_status(s) != cudaStreamCaptureStatusNone;
    } catch (...) {
      return true;
    }
  }

  void check_device(const stream_view& stream, const char* operation) const {
    detail::require_stream_of(stream, device_, "gpukit::async_allocator", operation);
  }
  /// record_stream and deallocate(p, s): unlike the caching allocator, no other device's stream (its events would
  /// be recorded and waited for across devices); the message says how to order the free instead.
  void check_user_device(const stream_view& stream, const char* operation) const {
    if (stream.is_cpu()) check_device(stream, operation);  // a CPU stream: refused as everywhere ("wrong device")
    if (stream.device() == device_) return;
    throw invalid_argument_error("gpukit::async_allocator::" + std::string(operation) + ": a stream of " +
                                     stream.device().to_string() + " for memory of " + device_.to_string() +
                                     ": async_allocator takes only streams of its own device here (nothing was "
                                     "done). Record an event on that stream (event::record), wait for it on a "
                                     "stream of " +
                                     device_.to_string() + " (event::wait), and pass that stream",
                                 cudaSuccess, "gpukit::async_allocator", device_.ordinal());
  }

  void deallocate_on(void* p, const stream_view* stream) {
    if (p == nullptr) return;
    // Out of the map and counted freed while the free is decided (a second free of `p` finds nothing); a refused
    // free puts it back (put_back).
    live_map::node_type taken;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it == live_.end()) throw_not_owned(p, "deallocate");
      // Room for the allocation stream and the stream freeing it (below, and defer), while the free may still fail.
      it->second.users.reserve(it->second.users.size() + 2);
      taken = live_.extract(it);
      count_locked(taken.mapped(), -1);
      if (taken.mapped().capture == 0) ++device_frees_;
    }
    allocation& a = taken.mapped();  // moved out only by defer()
    // The allocation stream's work too, when freed elsewhere or when it was destroyed (its handle may name another
    // stream now): then the device's upstream release stream frees it, after that work (stand_in_stream).
    const bool stream_destroyed = a.stream.destroyed();  // read once: it may change at any time
    const stream_view on = stream != nullptr ? *stream : usable_view(a.stream, stream_destroyed);
    const bool also_allocation_stream = stream != nullptr || stream_destroyed;
    if (also_allocation_stream) a.users.push_back(a.stream);  // room reserved above
    const auto keep_live = [&] {
      if (also_allocation_stream) a.users.pop_back();
      put_back(std::move(taken));
    };
    if (a.capture != 0 && freed_outside_capture_underway(a, on)) {
      const std::size_t bytes = a.bytes;  // read before a is given back: another thread may free it then
      const unsigned long long capture = a.capture;
      keep_live();
      throw_graph_allocation_freed_outside(p, bytes, capture, on);
    }
    bool into_capture = false;
    if (const stream_view* joined = capture_joined(a, on, into_capture)) {
      const stream_view user = *joined;
      keep_live();
      if (into_capture) throw_waits_into_capture(p, user, on);
      throw_joins_capture(p, user, on);
    }
    free_deferred();  // the earlier frees first, and not under this one's hold (they may wait on the host)
    detail::capture_hold hold(may_use_legacy_stream(a, on));  // until the free is enqueued
    if (must_wait_for_captures(a, on, hold) && defer(p, a, on)) return;
    // A free that fails during a capture frees nothing: the allocation is put back, and the caller told.
    std::exception_ptr refusal;
    const auto refused = [&](free_result r) {
      if (r != free_result::refused_in_capture) return false;
      keep_live();
      throw_refused_in_capture(p, refusal);
    };
    // A free that waited on the host (a failed ordering) and found a capture begun meanwhile waits for it to end
    // too; if it cannot (no memory), it is made anyway, as before deferral existed (its orderings again, then the
    // free, without a hold).
    // A refused hold here means the free involves a captured stream (or one that could not be asked): made now.
    const free_result first = free_on_streams(p, a, on, hold, !hold.refused(), &refusal);
    if (first == free_result::done || (!refused(first) && defer(p, a, on))) return;
    hold.release();
    (void)refused(free_on_streams(p, a, on, hold, false, &refusal));
  }
  /// Undoes deallocate_on's bookkeeping for a free it refused: the allocation is live again. Another thread's
  /// allocation meanwhile may have raised a peak (kept at least the current value) or reset the cumulative counts
  /// (kept at least 0). (The limit is not held for the bytes meanwhile: such a request may pass it.)
  void put_back(live_map::node_type taken) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    const allocation& a = live_.insert(std::move(taken)).position->second;  // a node: allocates nothing
    if (a.capture != 0) {  // a graph allocation: counted apart, as when it was freed
      count_locked(a, 1);
      return;
    }
    const auto bytes = static_cast<std::int64_t>(a.bytes);
    for (auto [s, delta] : {std::pair<stat*, std::int64_t>{&allocations_, 1}, {&allocated_bytes_, bytes}}) {
      s->current += delta;
      s->peak = std::max(s->peak, s->current);
      s->freed = std::max<std::int64_t>(0, s->freed - delta);
    }
    device_frees_ = std::max<std::int64_t>(0, device_frees_ - 1);
  }
  /// Whether the graph allocation `a`, freed on `on`, is freed outside the capture that made it while that capture is
  /// underway (a gpukit capture not yet ended, or a stream of `a` still in it): its graph does not exist yet, so the
  /// free could only precede the graph's first launch. Asks CUDA for graph allocations only.
  bool freed_outside_capture_underway(const allocation& a, const stream_view& on) const noexcept {
    if (capture_of(on) == a.capture) return false;  // a free node of its own graph
    try {
      if (detail::gpukit_capture_active(a.capture)) return true;
    } catch (...) {  // the registry's lock failed: the streams are asked
    }
    if (capture_of(a.stream.view, a.stream.life.get()) == a.capture) return true;
    return std::any_of(a.users.begin(), a.users.end(),
                       [&](const kept_stream& user) { return capture_of(user.view, user.life.get()) == a.capture; });
  }
  /// "gpukit: deallocate(<p>) on the async allocator of <device>", which the refusals of a free begin with.
  std::string deallocate_prefix(const void* p) const {
    return "gpukit: deallocate(" + detail::format_pointer(p) + ") on the async allocator of " + device_.to_string();
  }
  [[noreturn]] void throw_graph_allocation_freed_outside(const void* p, std::size_t bytes, unsigned long long capture,
                                                         const stream_view& on) const {
    throw invalid_argument_error(
        deallocate_prefix(p) + ": " + detail::format_bytes_exact(bytes) + " allocated during CUDA graph capture " +
            std::to_string(capture) +
            " (a graph allocation, whose memory exists from each launch of the graph) freed on " +
            detail::describe_stream(on.native_handle(), on.device()) +
            ", outside that capture, while it is underway: the graph cannot have been launched yet, and CUDA lets a "
            "graph allocation be freed outside its graph only after a launch of the graph, ordered after it. Free it "
            "in the capture (on a stream of it, from the thread that captures a per-thread default stream), or "
            "after a launch, on the launching stream or one that waits for it. The memory is still allocated",
        cudaSuccess, "gpukit::async_allocator::deallocate", device_.ordinal());
  }
  /// A stream the free must be ordered after (record_stream's, or the allocation stream when freed on another) that
  /// is being captured while `on` is not, if any: the ordering (an event recorded there, waited for on `on`) would
  /// pull `on` into that capture, and the free and all later work on `on` would go into the graph. Asks CUDA only
  /// for those streams other than `on` (one query each: an ordinary free asks nothing); a stream that cannot be
  /// asked is taken as not captured (the free goes on as before). Also, with `into_capture` set, a live stream the
  /// free must be ordered after that is not captured while `on` is: the free would wait in the capture for an event
  /// recorded outside it, which CUDA refuses (cudaErrorStreamCaptureIsolation) and which ends the capture (found by
  /// review: the free was refused afterwards, as a free of memory from outside a capture is, but the capture was lost
  /// with it). `on` is asked only then, once.
  const stream_view* capture_joined(const allocation& a, const stream_view& on, bool& into_capture) const noexcept {
    into_capture = false;
    try {
      const auto capturing = [](const stream_view& s, const detail::stream_life* life) {
        // The legacy stream, or another thread's, cannot be asked.
        return !detail::uses_legacy_stream(s) && detail::captured_while_kept(s, life);
      };
      int on_captured = -1;  // not asked yet
      const auto on_is_captured = [&] {
        if (on_captured < 0) on_captured = capturing(on, on.lifetime().get()) ? 1 : 0;
        return on_captured == 1;
      };
      for (const kept_stream& user : a.users) {
        if (user.view == on) continue;
        if (capturing(user.view, user.life.get())) {
          if (!on_is_captured()) return &user.view;
          continue;  // both captured: an ordering in the graph; the others may still be outside (found by review)
        }
        if (!user.destroyed() && on_is_captured()) {
          into_capture = true;
          return &user.view;
        }
      }
    } catch (...) {
    }
    return nullptr;
  }
  [[noreturn]] void throw_refused_in_capture(const void* p, const std::exception_ptr& failure) const {
    std::string reason = "an unknown exception";
    cudaError_t result = cudaErrorStreamCaptureUnsupported;
    try {
      if (failure) std::rethrow_exception(failure);
    } catch (const error& e) {
      reason = e.what();
      result = e.cuda_result();
    } catch (const std::exception& e) {
      reason = e.what();
    } catch (...) {
    }
    throw cuda_error(deallocate_prefix(p) + " during a CUDA graph capture failed: " + reason +
                         ". Nothing was freed: the memory is still allocated (a free in a capture may free only memory "
                         "allocated in a capture); free it after the capture ends, and after the graph's last launch "
                         "if the graph uses it",
                     result, "gpukit::async_allocator::deallocate", device_.ordinal());
  }
  [[noreturn]] void throw_waits_into_capture(const void* p, const stream_view& user, const stream_view& on) const {
    throw invalid_argument_error(
        deallocate_prefix(p) + " on " + detail::describe_stream(on.native_handle(), on.device()) +
            ", which is being captured into a CUDA graph: the free must be ordered after the work of " +
            detail::describe_stream(user.native_handle(), user.device()) +
            " (not captured, or another thread's per-thread default stream, which cannot be asked), and a captured "
            "stream cannot wait for work outside its capture (CUDA would end the capture). Free it after the capture "
            "ends (memory allocated in the capture: after a launch of its graph, ordered after it), or fork that "
            "stream into the capture first. The memory is still allocated, and the capture intact",
        cudaErrorStreamCaptureIsolation, "gpukit::async_allocator", device_.ordinal());
  }
  [[noreturn]] void throw_joins_capture(const void* p, const stream_view& user, const stream_view& on) const {
    throw invalid_argument_error(
        deallocate_prefix(p) + ": " + detail::describe_stream(user.native_handle(), user.device()) +
            ", which the free must be ordered after, is being captured into a CUDA graph, and the free on " +
            detail::describe_stream(on.native_handle(), on.device()) +
            " (not captured) would join that capture; free it after the capture ends, or on a stream of the "
            "capture. The memory is still allocated",
        cudaErrorStreamCaptureUnjoined, "gpukit::async_allocator", device_.ordinal());
  }

  /// Puts the free of `p` (`a` on `on`) among the deferred frees (or, should the lock fail, makes it now); false (`a`
  /// untouched) when there is no memory for that or `on` cannot be looked up.
  bool defer(void* p, allocation& a, const stream_view& on) noexcept {
    try {
      kept_stream kept_on = kept_stream::of(on);  // its record: `on` may be destroyed before the free is made
      a.users.reserve(a.users.size() + 1);        // room for `on` if it is destroyed by then (free_deferred)
      std::list<deferred_free> node;
      node.emplace_back(p, std::move(a), std::move(kept_on));  // allocates first: `a` is moved only if that worked
      requeue(node, false);
      return true;
    } catch (...) {
      return false;
    }
  }

  /// Calls `f` with each stream freeing `a` on `on` names: `on`, then the streams recorded (not destroyed).
  template <class F>
  static void for_each_stream(const allocation& a, const stream_view& on, F&& f) {
    f(on);
    for (const kept_stream& user : a.users) {
      if (!user.destroyed()) f(user.view);
    }
  }
  /// Whether freeing `a` on `on` may name the legacy default stream (detail::may_use_legacy_stream): then the free
  /// is decided and enqueued under a detail::capture_hold.
  static bool may_use_legacy_stream(const allocation& a, const stream_view& on) noexcept {
    bool legacy = false;
    for_each_stream(a, on, [&](const stream_view& s) { legacy = legacy || detail::may_use_legacy_stream(s); });
    return legacy;
  }

  /// What freeing `a` on `on` would meet now: the legacy default stream while a gpukit capture is underway (`hold`
  /// refuses it), on `on` itself or to order after a recorded stream; and, only then (an ordinary free asks CUDA
  /// nothing) or when `always_ask`, a stream being captured. May throw (a stream's id or capture status unknown).
  struct capture_state {
    bool legacy_refused = false;
    bool captured = false;
  };
  capture_state capture_state_of(const allocation& a, const stream_view& on, const detail::capture_hold& hold,
                                 bool always_ask = false) const {
    capture_state state;
    for_each_stream(a, on,
                    [&](const stream_view& s) { state.legacy_refused = state.legacy_refused || hold.refuses(s); });
    if (!state.legacy_refused && !always_ask) return state;
    device_guard guard(device_);
    const auto ask = [&](const stream_view& s, const detail::stream_life* life) {
      // The legacy stream, or another thread's per-thread one, is not gpukit's to capture (and cannot be asked).
      if (!detail::uses_legacy_stream(s) && detail::captured_while_kept(s, life)) state.captured = true;
    };
    ask(on, on.lifetime().get());
    for (const kept_stream& user : a.users) ask(user.view, user.life.get());
    return state;
  }
  /// A free that needs the legacy stream during a gpukit capture waits until the captures end, unless a stream it
  /// involves is being captured: made after the capture, it would precede the graph's work instead of following it
  /// in the graph, so it is made now and fails, saying so, as any free that cannot be captured does. Otherwise the
  /// free is made while `hold` lives.
  bool must_wait_for_captures(const allocation& a, const stream_view& on,
                              const detail::capture_hold& hold) const noexcept {
    try {
      const capture_state state = capture_state_of(a, on, hold);
      return state.legacy_refused && !state.captured;
    } catch (...) {  // a stream could not be asked: freed now, as before deferral existed
      return false;
    }
  }

  /// Makes the frees deallocate deferred whose streams can be used again (no gpukit capture underway, none of them
  /// captured); the others keep waiting. Cheap when none waits (one atomic load), so every allocate and deallocate
  /// calls it. A free whose stream was destroyed meanwhile waits for that stream's last work and runs on the device's
  /// release stream, as deallocate does for a destroyed allocation stream.
  void free_deferred() noexcept {
    if (!has_deferred_.load(std::memory_order_acquire)) return;
    // Taken out under the lock, asked about outside it and without a capture hold: asking whether a stream is
    // captured keeps it from destruction, which another free may keep through a host wait (free_on_streams), and
    // neither the lock (every call of this allocator) nor a hold (gpukit::capture) may wait for that.
    std::list<deferred_free> asked;
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      asked.splice(asked.end(), deferred_);
      being_asked_ += asked.size();
      has_deferred_.store(false, std::memory_order_release);
    } catch (...) {  // the lock failed: they wait for the next call
      return;
    }
    const std::size_t count = asked.size();
    std::list<deferred_free> due;
    // Moves the frees of `asked` that may be made now (given `hold`) to `due`. Captured streams are asked about in
    // any case: a free deferred by another thread may name this thread's per-thread stream, legacy work there but
    // not here, and this thread may be capturing it.
    const auto sort_out = [&](const detail::capture_hold& hold) {
      for (auto it = asked.begin(); it != asked.end();) {
        const auto next = std::next(it);
        bool wait = false;
        try {
          const capture_state state = capture_state_of(it->a, usable_view_of(it->on), hold, true);
          wait = state.legacy_refused || state.captured;
        } catch (...) {  // a stream could not be asked: made once the hold is held, and reported if it fails
        }
        if (!wait) due.splice(due.end(), asked, it);
        it = next;
      }
    };
    sort_out(detail::capture_hold(false));
    detail::capture_hold hold(true);  // until the due frees are enqueued: most use the legacy stream
    if (hold.refused()) {  // a gpukit capture began after they were asked about: asked again (nothing is held)
      asked.splice(asked.end(), due);
      sort_out(hold);
    }
    requeue(asked, true, count);     // those that wait, before those deferred meanwhile
    std::list<deferred_free> again;  // refused once a capture began meanwhile
    while (!due.empty()) {
      deferred_free& d = due.front();
      bool on_destroyed = false;
      const stream_view on = prepare(d, on_destroyed);
      // The hold is let go once a free is enqueued, or to wait on the host: taken again for the next one; if a
      // capture began meanwhile, a free that needs the legacy stream waits for the next call.
      if (!hold.retake(may_use_legacy_stream(d.a, on)) ||
          free_on_streams(d.p, d.a, on, hold, true) == free_result::wait_for_captures) {
        if (on_destroyed) d.a.users.pop_back();  // as deferred, to be made again
        again.splice(again.end(), due, due.begin());
        continue;
      }
      due.pop_front();
    }
    if (!again.empty()) requeue(again, true);
  }
  /// Moves the frees of `frees` (all) among the deferred ones, before the others if `oldest` (they were deferred
  /// first): no allocation. `asked`: how many frees free_deferred took out to ask about are now back or made.
  void requeue(std::list<deferred_free>& frees, bool oldest, std::size_t asked = 0) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      being_asked_ -= asked;
      deferred_.splice(oldest ? deferred_.begin() : deferred_.end(), frees);
      has_deferred_.store(!deferred_.empty(), std::memory_order_release);
    } catch (...) {  // the lock failed (never seen): made now rather than lost, as before deferral existed
      for (deferred_free& d : frees) {
        detail::capture_hold none(false);
        bool on_destroyed = false;
        (void)free_on_streams(d.p, d.a, prepare(d, on_destroyed), none, false);
      }
      frees.clear();
    }
  }

  /// The stream the deferred free `d` is made on now: its own, or, once that is destroyed (`on_destroyed`), the
  /// device's release stream after the destroyed one's last work, which then joins the users (in the room reserved
  /// when deferred: cannot throw; taken out again by pop_back if the free waits once more).
  stream_view prepare(deferred_free& d, bool& on_destroyed) const noexcept {
    on_destroyed = d.on.destroyed();  // read once: it may change at any time
    if (on_destroyed) d.a.users.push_back(d.on);
    return usable_view(d.on, on_destroyed);
  }
  /// The stream a free is made on instead of `s`: `s` itself, or stand_in_stream() once `s` is destroyed (its handle
  /// may name another stream now; the caller waits for its final event).
  stream_view usable_view_of(const kept_stream& s) const noexcept { return usable_view(s, s.destroyed()); }
  stream_view usable_view(const kept_stream& s, bool destroyed) const noexcept {
    return destroyed ? stand_in_stream() : s.view;
  }
  /// Where a free whose stream was destroyed is made: the device's upstream release stream, never captured by gpukit
  /// (this thread's per-thread stream may be, and the free would join that capture and fail); this thread's
  /// per-thread stream if the release stream cannot be created.
  stream_view stand_in_stream() const noexcept {
    try {
      return stream_view(device_, detail::upstream_stream(device_, detail::upstream_stream_use::releases));
    } catch (...) {
      return stream_view(device_, cudaStreamPerThread);
    }
  }

  /// cudaFreeAsync of `p` on `on`, after the work of the streams that recorded it (device-side waits). Where a wait
  /// cannot be enqueued, the host waits for that stream instead; where the free cannot be enqueued on `on`, it
  /// happens after the device's work (free_after_device): the memory is never leaked for a failed ordering. `hold`
  /// (taken when the free was decided) is released before any host wait or warning: a capture waiting for it may be
  /// what the host waits for. After a host wait it is taken again; if a gpukit capture began meanwhile, the free
  /// stops there and says it must wait for the captures, if `may_defer`. It goes on instead when `may_defer` is false:
  /// a last resort, or a free that involves a captured stream (made now, since made after the capture it would
  /// precede the graph's work). The caller says which: `hold` may have been refused for another free.
  [[nodiscard]] free_result free_on_streams(void* p, const allocation& a, const stream_view& on,
                                            detail::capture_hold& hold, bool may_defer,
                                            std::exception_ptr* refusal = nullptr) noexcept {
    const bool may_use_legacy = may_use_legacy_stream(a, on);
    // After a host wait: whether the rest may be enqueued now.
    const auto resume = [&] { return hold.retake(may_use_legacy) || !may_defer; };
    bool capturing = false;  // host waits are illegal then: a failure leaks the memory instead (with a warning)
    // Asked only once something failed or a destroyed stream's work is waited for, since only those paths differ:
    // an ordinary free makes no cudaStreamIsCapturing call (each costs about 100 ns on an H100 host). A capture a
    // failure invalidated still answers "captured" (cudaStreamCaptureStatusInvalidated).
    bool asked = false;
    try {
      device_guard guard(device_);
      // cudaFreeAsync on a stream that is not captured, and the host waits, are refused in global mode while any
      // thread captures (and invalidate that capture); relaxed, they are not.
      const detail::relaxed_capture_mode relaxed;
      // `on` is kept from destruction (its ~stream waits) while work is enqueued on its handle: another thread could
      // destroy it after the caller's look, and a new stream get the handle. It is let go for host waits, and while a
      // recorded stream is kept (one stream at a time: two frees with their roles swapped would deadlock). Once
      // destroyed, the device's upstream release stream frees instead (gpukit never captures it; this thread's
      // per-thread stream may be captured), after `on`'s final event (which follows what was enqueued on it so far).
      const kept_stream kept_on = kept_stream::of(on);
      std::unique_lock<std::mutex> on_alive;
      cudaStream_t free_stream = nullptr;
      stream_view free_view = on;  // the stream freed on
      bool on_gone = false;
      // Each stream asked while kept (captured_while_kept): first called while no stream is kept (or only `on`,
      // whose keep is then used; another's would risk the deadlock above).
      const auto captured = [&] {
        if (!asked) {
          asked = true;
          if (on_gone) {
            capturing = detail::capture_status(free_view) != cudaStreamCaptureStatusNone;
          } else if (on_alive.owns_lock()) {
            capturing = !kept_on.destroyed() && detail::capture_status(free_view) != cudaStreamCaptureStatusNone;
          } else {
            capturing = detail::captured_while_kept(free_view, kept_on.life.get());
          }
          for (const kept_stream& user : a.users) {
            const bool held = on_alive.owns_lock() && user.life == kept_on.life;
            capturing = capturing ||
                        (held ? !user.destroyed() && detail::capture_status(user.view) != cudaStreamCaptureStatusNone
                              : detail::captured_while_kept(user.view, user.life.get()));
          }
        }
        return capturing;
      };
      // Called first and after `on` was let go: false when the free must wait for the captures.
      const auto keep_free_stream = [&] {
        if (!on_gone) {
          if (kept_on.life != nullptr && !on_alive.owns_lock()) on_alive = kept_on.life->keep_alive();
          if (!kept_on.destroyed()) {
            free_stream = kept_on.handle_here();
          } else {
            on_alive = {};
            on_gone = true;
            asked = false;  // asked again, about the release stream
            capturing = false;
            free_view = stand_in_stream();
            free_stream = free_view.cuda_handle();
            (void)wait_for_destroyed(free_stream, *kept_on.life, captured, hold, on_alive);
          }
        }
        return resume();
      };
      if (!keep_free_stream()) return free_result::wait_for_captures;
      // Each recorded stream is kept while it is looked at and its event recorded (its handle may be a new stream's
      // once it is destroyed), `on` only while the event is waited for there.
      const auto keep = [](const kept_stream& s) {
        return s.life != nullptr ? s.life->keep_alive() : std::unique_lock<std::mutex>();
      };
      struct new_event {
        cudaEvent_t e = nullptr;
        ~new_event() {
          if (e != nullptr) (void)cudaEventDestroy(e);  // CUDA releases it once the wait is done
        }
      };
      for (const kept_stream& user : a.users) {
        // `on` itself: its work precedes the free (and if it was destroyed, its final event was waited for above).
        if (user.life == kept_on.life && user.view.native_handle() == kept_on.view.native_handle() &&
            (!user.view.is_per_thread() || user.view.id() == kept_on.view.id())) {
          continue;
        }
        if (user.life == nullptr && user.handle_here() == free_stream) continue;  // a default stream, the freeing one
        if (user.life != nullptr) on_alive = {};
        new_event done;
        cudaError_t ordered = cudaSuccess;
        bool gone = false;
        {
          const std::unique_lock<std::mutex> user_alive = keep(user);
          gone = user.destroyed();
          if (!gone) ordered = record_new_event(user.handle_here(), done.e);
        }
        if (gone) (void)captured();  // wait_for_destroyed asks: before `on` is kept (captured() keeps each stream)
        if (!keep_free_stream()) return free_result::wait_for_captures;
        if (gone) {
          if (!wait_for_destroyed(free_stream, *user.life, captured, hold, on_alive) && !keep_free_stream()) {
            return free_result::wait_for_captures;
          }
          continue;
        }
        if (ordered == cudaSuccess) {
          ordered = cudaStreamWaitEvent(free_stream, done.e, 0);
          if (ordered == cudaSuccess) continue;
        }
        (void)cudaGetLastError();
        on_alive = {};  // before captured(), which keeps each stream it asks
        if (captured()) {
          GPUKIT_CUDA_TRY_DESCRIBED(ordered, "ordering a free after a recorded stream", device_.ordinal());
        }
        hold.release();
        {
          // Kept through the host wait, which its destruction then waits for (the same work).
          const std::unique_lock<std::mutex> user_alive = keep(user);
          gone = user.destroyed();
          if (!gone && !wait_on_host(user.handle_here(), may_defer)) return free_result::wait_for_captures;
        }
        if (!keep_free_stream()) return free_result::wait_for_captures;
        if (gone && !wait_for_destroyed(free_stream, *user.life, captured, hold, on_alive) && !keep_free_stream()) {
          return free_result::wait_for_captures;
        }
      }
      const cudaError_t freed = cudaFreeAsync(p, free_stream);
      on_alive = {};
      hold.release();
      if (freed == cudaSuccess) return free_result::done;
      (void)cudaGetLastError();
      if (detail::is_teardown_result(freed)) return free_result::done;
      if (captured()) GPUKIT_CUDA_TRY_DESCRIBED(freed, "cudaFreeAsync", device_.ordinal());
      detail::warn_parts("gpukit::async_allocator: cudaFreeAsync of ", detail::bytes_part{a.bytes},
                         " on its stream failed (", cudaGetErrorName(freed),
                         "); freeing it after the device's work instead");
    } catch (const std::exception& e) {
      hold.release();
      if (const auto* ge = dynamic_cast<const error*>(&e);
          ge != nullptr && detail::is_teardown_result(ge->cuda_result())) {
        return free_result::done;
      }
      if (capturing && refusal != nullptr) {  // nothing was freed: the caller keeps the allocation
        *refusal = std::current_exception();
        return free_result::refused_in_capture;
      }
      if (capturing) {  // synchronizing now would invalidate the capture
        detail::warn_parts("gpukit::async_allocator: freeing ", detail::bytes_part{a.bytes},
                           " during a CUDA graph capture failed: ", e.what(), "; the memory is lost to the pool");
        return free_result::done;
      }
      detail::warn_parts("gpukit::async_allocator: ordering the free of ", detail::bytes_part{a.bytes},
                         " failed: ", e.what(), "; freeing it after the device's work instead");
    }
    return free_after_device(p, a.bytes, may_defer);
  }

  /// The host waits for stream `s` of this device, whose ordering failed; the whole device's work where that wait
  /// fails. The legacy stream's wait is refused while a blocking stream of the device is captured, by gpukit or with
  /// the raw runtime (stream_view::synchronize: it would join and invalidate that capture): false then, when the free
  /// `may_defer` (it waits for the captures to end); a last resort waits on the stream anyway, as before.
  bool wait_on_host(cudaStream_t s, bool may_defer) const {
    const stream_view view(device_, s);
    if (may_defer && view.is_default() && !view.is_per_thread()) {
      try {
        view.synchronize();
        return true;
      } catch (const invalid_argument_error& e) {
        if (e.cuda_result() == cudaSuccess) return false;  // refused; a CUDA failure: the device-wide wait below
      } catch (const error&) {
      }
    } else if (cudaStreamSynchronize(s) == cudaSuccess) {
      return true;
    }
    (void)cudaGetLastError();
    GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceSynchronize(), "cudaDeviceSynchronize (ordering a free)", device_.ordinal());
    return true;
  }

  /// `free_stream` waits for the work a destroyed stream had enqueued before its destruction: on the device for its
  /// final event; on the host where that wait cannot be enqueued, or during a capture (a captured stream cannot wait
  /// for an event recorded outside the capture, and a host wait for one is legal in relaxed mode). False when the
  /// host waited (`hold` and `free_stream_alive` let go for it).
  template <class Captured>
  bool wait_for_destroyed(cudaStream_t free_stream, const detail::stream_life& life, Captured& captured,
                          detail::capture_hold& hold, std::unique_lock<std::mutex>& free_stream_alive) const {
    if (life.finished()) return true;
    const cudaEvent_t last = life.final_event();
    if (last == nullptr && captured()) {  // only a device-wide wait would do, which would invalidate the capture
      throw cuda_error("a destroyed stream that used the memory has no final event to wait for",
                       cudaErrorStreamCaptureUnsupported, "cudaFreeAsync", device_.ordinal());
    }
    if (last != nullptr && !captured()) {
      if (cudaStreamWaitEvent(free_stream, last, 0) == cudaSuccess) return true;
      (void)cudaGetLastError();
    }
    hold.release();  // a host wait (see free_on_streams)
    free_stream_alive = {};
    life.wait_finished();
    return false;
  }

  /// A new event recorded on `s`, for a wait on another stream. On failure none is left.
  static cudaError_t record_new_event(cudaStream_t s, cudaEvent_t& e) noexcept {
    cudaError_t result = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (result != cudaSuccess) {
      e = nullptr;
      return result;
    }
    result = cudaEventRecord(e, s);
    if (result != cudaSuccess) {
      (void)cudaEventDestroy(e);
      e = nullptr;
    }
    return result;
  }

  /// Frees `p` without any stream of the program: the device's work is waited for, then cudaFreeAsync on the legacy
  /// default stream (which always exists), under a capture hold. While a capture is in sight (a gpukit capture, or a
  /// capture of a blocking stream of the device: detail::capture_in_sight), before the wait (cudaDeviceSynchronize
  /// would invalidate it, in any mode) or after it, or when the wait was refused by a capture, nothing is freed and
  /// the caller is told to wait for the captures (unless `may_wait` is false: then it is freed all the same).
  /// Failures are reported through gpukit::warn (the memory is lost).
  [[nodiscard]] free_result free_after_device(void* p, std::size_t bytes, bool may_wait = true) noexcept {
    if (may_wait && detail::capture_in_sight(device_)) return free_result::wait_for_captures;
    try {
      device_guard guard(device_);
      const detail::relaxed_capture_mode relaxed;  // for cudaFreeAsync (cudaDeviceSynchronize is refused all the same)
      cudaError_t result = cudaDeviceSynchronize();
      if (result == cudaErrorStreamCaptureUnsupported && may_wait) {
        // Refused by a capture gpukit could not see (a raw one of a non-blocking stream, or one begun since the look
        // above), which the wait invalidated: nothing was freed; tried again later.
        (void)cudaGetLastError();
        return free_result::wait_for_captures;
      }
      if (result == cudaSuccess) {
        detail::capture_hold hold(true);
        if (hold.refused() && may_wait) return free_result::wait_for_captures;
        result = cudaFreeAsync(p, cudaStreamLegacy);
      }
      if (result == cudaSuccess || detail::is_teardown_result(result)) return free_result::done;
      (void)cudaGetLastError();
      detail::warn_parts("gpukit::async_allocator: ", detail::bytes_part{bytes}, " could not be freed (",
                         cudaGetErrorName(result), "); the memory is lost to the pool");
    } catch (const std::exception& e) {
      if (const auto* ge = dynamic_cast<const error*>(&e);
          ge != nullptr && detail::is_teardown_result(ge->cuda_result())) {
        return free_result::done;
      }
      detail::warn_parts("gpukit::async_allocator: ", detail::bytes_part{bytes}, " could not be freed: ", e.what());
    }
    return free_result::done;
  }

  [[noreturn]] void throw_not_owned(const void* p, const char* operation) const {
    throw invalid_argument_error(std::string("gpukit: ") + operation + "(" + detail::format_pointer(p) +
                                     ") on the async allocator of " + device_.to_string() +
                                     ": not a live allocation of this allocator (a double free, "
                                     "a foreign pointer or one into the middle of an allocation)",
                                 cudaSuccess, "gpukit::async_allocator", device_.ordinal());
  }

  [[noreturn]] void throw_out_of_memory(std::size_t bytes, bool limit_hit) {
    out_of_memory_info info;
    info.reserved = pool_attribute(cudaMemPoolAttrReservedMemCurrent);  // a CUDA call: not under the lock
    std::size_t in_flight = 0;  // other requests' bytes, counted against the limit before they are allocated
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++ooms_;
      info.device = device_.ordinal();
      info.requested = info.rounded = info.segment_bytes = bytes;
      info.allocated = static_cast<std::size_t>(allocated_bytes_.current);
      in_flight = in_flight_bytes_;
      info.reserved_limit = limit_;
      info.limit_hit = limit_hit;
    }
    const upstream_memory_info device_memory = cuda_upstream(device_).memory_info();  // never throws
    info.device_memory_known = device_memory.known;
    info.device_free = device_memory.free_bytes;
    info.device_total = device_memory.total_bytes;
    using detail::format_bytes;
    // A request the allocator's own limit refused made no CUDA call: the message must not send the user looking for
    // exhausted device memory.
    info.message =
        "gpukit: out of memory on " + device_.to_string() + ": " +
        (limit_hit ? "an allocation of " + detail::format_bytes_exact(bytes) + " refused: this allocator's limit of " +
                         format_bytes(info.reserved_limit) + " would be exceeded (no cudaMallocAsync was made)"
                   : "cudaMallocAsync of " + detail::format_bytes_exact(bytes) + " failed") +
        ". Device: " +
        (info.device_memory_known
             ? format_bytes(info.device_total) + " total, " + format_bytes(info.device_free) + " free"
             : std::string("total and free memory unknown")) +
        ". This allocator: " + format_bytes(info.allocated) + " allocated" +
        (in_flight != 0 ? " (and " + format_bytes(in_flight) + " being allocated by other requests)" : "") +
        "; the pool holds " + format_bytes(info.reserved) + ".";
    observers_.notify(info, device_.to_string());
    throw out_of_memory_error(info.message, limit_hit ? cudaSuccess : cudaErrorMemoryAllocation,
                              "gpukit::async_allocator::allocate(" + std::to_string(bytes) + ")", device_.ordinal());
  }

  gpukit::device device_;
  cudaMemPool_t pool_ = nullptr;
  mutable std::mutex mutex_;
  live_map live_;
  std::list<deferred_free> deferred_;      // guarded by mutex_; a list: frees move in and out without allocating
  std::atomic<bool> has_deferred_{false};  // !deferred_.empty(), read without the lock
  std::size_t being_asked_ = 0;            // deferred frees free_deferred took out to ask about (guarded by mutex_)
  stat allocations_, allocated_bytes_;
  graph_allocation_totals graph_allocations_;  // live graph allocations, kept out of the statistics
  std::int64_t retries_ = 0, ooms_ = 0, device_allocs_ = 0, device_frees_ = 0;
  std::size_t limit_ = std::numeric_limits<std::size_t>::max();
  std::size_t in_flight_bytes_ = 0;  // requests past the limit check, not yet allocated (guarded by mutex_)
  detail::out_of_memory_observers observers_;
};

GPUKIT_END_NAMESPACE
