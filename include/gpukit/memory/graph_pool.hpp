// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// graph_pool: the memory of CUDA graphs. Memory a captured graph uses must stay its own for as long as the graph
/// may be launched, and a capture must not call cudaMalloc (prohibited during capture) nor record events it would
/// later query. A graph_pool reserves memory before the capture (from a backing device_resource, the device's
/// default one unless given) and hands it out during the capture with no CUDA call; while a capture with a pool
/// runs (gpukit::capture, graph/graph.hpp), allocations that gpukit's caching allocators receive for the captured
/// streams come from the pool, and frees of pool memory go back to it, from any allocator. A block freed during
/// the capture is reused by later allocations of the same pool (the graphs order them). The reserve goes back to
/// the backing allocator once the pool's graphs and every allocation from it are gone, after the work of the
/// graphs' launches (device-side waits, never on the host). Several graphs may share a pool (launched in the order
/// they were captured, as with PyTorch's shared graph pools).
///
///     auto pool = gpukit::graph_pool::create(d, 64 << 20);   // reserve 64 MiB now, before capturing

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/capture_pools.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
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
  /// it must outlive the pool), on the device's legacy default stream. Throws invalid_argument_error for the CPU or
  /// a backing allocator of another device, out_of_memory_error if the reserve cannot be had. (`Deferred`, never
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

  /// Adds `bytes` (rounded up to the alignment) to the reserve. Throws invalid_argument_error during a capture the
  /// pool serves (it would allocate inside the capture: reserve before it), out_of_memory_error from the backing
  /// allocator.
  void reserve(std::size_t bytes) {
    if (bytes == 0) return;
    if (bytes > std::numeric_limits<std::size_t>::max() - (alignment - 1)) {
      throw invalid_argument_error("gpukit::graph_pool::reserve: " + std::to_string(bytes) + " bytes overflow");
    }
    bytes = round(bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (captures_ != 0) {
        throw invalid_argument_error("gpukit::graph_pool::reserve(" + std::to_string(bytes) + ") on " +
                                     device_.to_string() +
                                     " during a capture the pool serves: reserve before the capture (allocating "
                                     "device memory inside a capture is prohibited)");
      }
    }
    void* chunk = backing_->allocate(bytes, stream_view::default_stream(device_));
    try {
      register_live();
      std::lock_guard<std::mutex> lock(mutex_);
      chunks_.push_back({reinterpret_cast<std::uintptr_t>(chunk), bytes});
      insert_free(reinterpret_cast<std::uintptr_t>(chunk), bytes, chunks_.size() - 1);
      reserved_ += bytes;
    } catch (...) {
      backing_->deallocate(chunk);
      throw;
    }
  }

  gpukit::device device() const noexcept override { return device_; }

  allocator_stats stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    allocator_stats s;
    s.allocation.pools[0].current = s.active.pools[0].current = static_cast<std::int64_t>(live_.size());
    s.allocation.pools[0].allocated = static_cast<std::int64_t>(allocations_);
    s.allocated_bytes.pools[0].current = s.active_bytes.pools[0].current = static_cast<std::int64_t>(allocated_);
    s.allocated_bytes.pools[0].peak = static_cast<std::int64_t>(peak_allocated_);
    std::int64_t requested = 0;
    for (const auto& entry : live_) requested += static_cast<std::int64_t>(entry.second.requested);
    s.requested_bytes.pools[0].current = requested;
    s.reserved_bytes.pools[0].current = s.reserved_bytes.pools[0].peak = static_cast<std::int64_t>(reserved_);
    s.segment.pools[0].current = static_cast<std::int64_t>(chunks_.size());
    s.num_ooms = ooms_;
    return s;
  }
  free_space_info free_space() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    free_space_info f;
    for (const auto& entry : free_) {
      f.free_bytes += entry.second.size;
      ++f.free_blocks;
      f.largest_free_block = std::max(f.largest_free_block, entry.second.size);
    }
    return f;
  }
  /// The reserve's chunks as segments, with their allocated and free blocks.
  allocator_snapshot snapshot() const override {
    allocator_snapshot snap;
    snap.device = device_;
    snap.stats = stats();
    std::lock_guard<std::mutex> lock(mutex_);
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
    return format_memory_summary("gpukit graph pool, " + device_.to_string(), stats(), free_space());
  }

  /// The reserve stays until the pool ends: its graphs may be launched again.
  void empty_cache() override {}
  std::size_t trim(std::size_t) override { return memory_reserved(); }
  /// Sets the peak of allocated bytes to the bytes allocated now (the reserve's peak is its size and stays).
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_allocated_ = allocated_;
  }
  /// Zeroes the counts of allocations and of out-of-memory failures.
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    allocations_ = 0;
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
    return locked([this] { return allocated_; });
  }
  std::size_t memory_reserved() const noexcept override {
    return locked([this] { return reserved_; });
  }
  /// The most bytes allocated from the reserve at once since the pool was created or reset_peak_stats() was called.
  std::size_t max_memory_allocated() const noexcept override {
    return locked([this] { return peak_allocated_; });
  }
  /// The reserve's size: it only grows while the pool lives, so its peak is its size.
  std::size_t max_memory_reserved() const noexcept override { return memory_reserved(); }

  // --- for gpukit::capture and gpukit::graph (graph/graph.hpp) ---

  /// The capture `id` allocates from this pool until end_capture(id).
  void begin_capture(unsigned long long id) {
    auto& registry = detail::capture_pools();
    {
      std::lock_guard<std::mutex> lock(registry.mutex);
      if (!registry.capturing.emplace(id, this).second) {
        throw invalid_argument_error("gpukit::graph_pool: capture " + std::to_string(id) + " already has a pool");
      }
    }
    register_live();  // while capturing, even an empty pool is asked (its allocations fail clearly)
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
    --captures_;
  }
  /// A graph of the pool was launched on `s`: the reserve goes back only after that work (an event, re-recorded
  /// per stream; the backing allocator's stream waits for it on the device).
  void note_launch(const stream_view& s) {
    std::lock_guard<std::mutex> lock(mutex_);
    const unsigned long long id = s.id();
    cudaEvent_t& e = launches_[id];
    device_guard guard(device_);
    if (e == nullptr) {
      GPUKIT_CUDA_TRY_DESCRIBED(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                                device_.ordinal());
    }
    GPUKIT_CUDA_TRY_DESCRIBED(cudaEventRecord(e, s.cuda_handle()), "cudaEventRecord (after a graph launch)",
                              device_.ordinal());
  }

 private:
  // device_allocator's allocate/deallocate/record_stream/owns land here.
  /// Blocks sit at multiples of `alignment` inside reserve chunks, which are as aligned as the backing allocator's
  /// memory.
  std::size_t do_natural_alignment() const noexcept override {
    return std::min<std::size_t>(alignment, backing_->natural_alignment());
  }
  /// Best fit from the reserve, with no CUDA call (legal inside a capture). Throws out_of_memory_error when the
  /// reserve has no block that large (after the observers), invalid_argument_error for a stream of another device.
  void* do_allocate(std::size_t bytes, stream_view stream) override {
    if (bytes == 0) return nullptr;
    check_stream(stream, "allocate");
    if (bytes > std::numeric_limits<std::size_t>::max() - (alignment - 1)) {
      throw invalid_argument_error("gpukit::graph_pool::allocate: " + std::to_string(bytes) + " bytes overflow");
    }
    const std::size_t size = round(bytes);
    std::unique_lock<std::mutex> lock(mutex_);
    const auto fit = by_size_.lower_bound({size, 0});
    if (fit == by_size_.end()) {
      lock.unlock();
      throw_out_of_memory(bytes, size);
    }
    const auto [block_size, address] = *fit;
    const std::size_t chunk = free_.at(address).chunk;
    erase_free(address);
    if (block_size > size) insert_free(address + size, block_size - size, chunk);
    live_.emplace(address, live_block{size, bytes, chunk});
    allocated_ += size;
    peak_allocated_ = std::max(peak_allocated_, allocated_);
    ++allocations_;
    return reinterpret_cast<void*>(address);
  }

  /// Returns `p` to the reserve at once (the graphs order its reuse). Throws invalid_argument_error for a pointer
  /// the pool did not hand out; nullptr is ignored.
  void do_deallocate(void* p) override {
    if (p == nullptr) return;
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it == live_.end()) throw_not_owned(p);
      const live_block b = it->second;
      live_.erase(it);
      allocated_ -= b.size;
      insert_free_coalesced(reinterpret_cast<std::uintptr_t>(p), b.size, b.chunk);
      last = orphaned_ && live_.empty();
    }
    if (last) delete this;  // the pool's graphs went first: its last allocation ends it
  }
  void do_deallocate(void* p, stream_view stream) override {
    check_stream(stream, "deallocate");
    deallocate(p);
  }
  /// Nothing to do: pool memory is reused only by later work of the pool's graphs, which they order.
  void do_record_stream(void* p, stream_view stream) override {
    check_stream(stream, "record_stream");
    if (!owns(p)) throw_not_owned(p);
  }
  bool do_owns(const void* p) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(reinterpret_cast<std::uintptr_t>(p)) != 0;
  }

  struct free_block {
    std::size_t size;
    std::size_t chunk;
  };
  struct live_block {
    std::size_t size;
    std::size_t requested;
    std::size_t chunk;
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

  void insert_free(std::uintptr_t address, std::size_t size, std::size_t chunk) {
    free_.emplace(address, free_block{size, chunk});
    by_size_.emplace(size, address);
  }
  void erase_free(std::uintptr_t address) {
    const auto it = free_.find(address);
    by_size_.erase({it->second.size, address});
    free_.erase(it);
  }
  /// Inserts a freed block, merged with free neighbours of the same chunk.
  void insert_free_coalesced(std::uintptr_t address, std::size_t size, std::size_t chunk) {
    const auto next = free_.find(address + size);
    if (next != free_.end() && next->second.chunk == chunk) {
      size += next->second.size;
      erase_free(next->first);
    }
    const auto after = free_.lower_bound(address);
    if (after != free_.begin()) {
      const auto previous = std::prev(after);
      if (previous->second.chunk == chunk && previous->first + previous->second.size == address) {
        address = previous->first;
        size += previous->second.size;
        erase_free(previous->first);
      }
    }
    insert_free(address, size, chunk);
  }

  /// Makes the pool known to the caching allocators (once; never with mutex_ held: the registry's lock comes first).
  void register_live() {
    auto& registry = detail::capture_pools();
    std::lock_guard<std::mutex> lock(registry.mutex);
    if (live_registered_) return;
    registry.live.push_back(this);
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

  /// Returns the reserve to the backing allocator after the launches' work (the legacy default stream, on which
  /// the reserve was allocated, waits for it on the device).
  void release_reserve() noexcept {
    {
      auto& registry = detail::capture_pools();
      std::lock_guard<std::mutex> lock(registry.mutex);
      if (live_registered_) {
        registry.live.erase(std::remove(registry.live.begin(), registry.live.end(), this), registry.live.end());
        registry.live_count.fetch_sub(1, std::memory_order_relaxed);
      }
    }
    try {
      device_guard guard(device_);
      for (auto& [id, e] : launches_) {
        (void)id;
        detail::report_cuda_failure(cudaStreamWaitEvent(cudaStreamLegacy, e, 0),
                                    "cudaStreamWaitEvent (a graph pool's release)", device_.ordinal());
        detail::report_cuda_failure(cudaEventDestroy(e), "cudaEventDestroy", device_.ordinal());
      }
    } catch (const std::exception& ex) {
      warn(std::string("gpukit::graph_pool: could not order its release after its graphs' work: ") + ex.what());
    }
    for (const chunk_info& c : chunks_) {
      try {
        backing_->deallocate(reinterpret_cast<void*>(c.address));
      } catch (const std::exception& ex) {
        warn(std::string("gpukit::graph_pool: returning ") + detail::format_bytes(c.size) + " failed: " + ex.what());
      }
    }
  }

  [[noreturn]] void throw_not_owned(const void* p) const {
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    throw invalid_argument_error(std::string("gpukit::graph_pool of ") + device_.to_string() + ": " + text +
                                 " is not a live allocation of this pool (a double free, a foreign pointer or one "
                                 "into the middle of an allocation)");
  }

  [[noreturn]] void throw_out_of_memory(std::size_t bytes, std::size_t size) {
    out_of_memory_info info;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++ooms_;
      info.device = device_.ordinal();
      info.requested = bytes;
      info.rounded = info.segment_bytes = size;
      info.allocated = allocated_;
      info.reserved = reserved_;
      for (const auto& entry : free_) {
        info.free_cached += entry.second.size;
        info.largest_free_block = std::max(info.largest_free_block, entry.second.size);
      }
      info.reserved_limit = reserved_;
      info.limit_hit = true;
    }
    using detail::format_bytes;
    info.message = "gpukit: out of memory in the graph pool of " + device_.to_string() + ": tried to allocate " +
                   detail::format_bytes_exact(bytes) + "; the pool reserves " + format_bytes(info.reserved) + ", " +
                   format_bytes(info.allocated) + " allocated, largest free block " +
                   format_bytes(info.largest_free_block) +
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
  std::set<std::pair<std::size_t, std::uintptr_t>> by_size_;  // best fit: smallest size, then lowest address
  std::map<std::uintptr_t, live_block> live_;
  std::map<unsigned long long, cudaEvent_t> launches_;  // stream id -> the event after its latest launch
  std::size_t reserved_ = 0, allocated_ = 0, peak_allocated_ = 0;
  std::int64_t allocations_ = 0, ooms_ = 0;
  int captures_ = 0;
  bool orphaned_ = false;
  bool live_registered_ = false;  // guarded by the registry's mutex
  detail::out_of_memory_observers observers_;
};

GPUKIT_END_NAMESPACE
