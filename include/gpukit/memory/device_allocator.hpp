// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// device_allocator: a device_resource (device_resource.hpp) with statistics and control, the interface of the
/// per-device default allocators; and caching_device_allocator<Upstream>, the caching engine behind it.
/// `gpukit::caching_allocator` (cudaMalloc for CUDA devices, host memory for the CPU) is what the default
/// allocators are.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/memory/detail/capture_pools.hpp>
#include <gpukit/memory/device_resource.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Throws invalid_argument_error unless `s` is a stream of CUDA device `d` (`who`::`operation` names the call).
GPUKIT_INLINE void require_stream_of(const stream_view& s, gpukit::device d, const char* who, const char* operation);
}  // namespace detail

/// A device_resource with the statistics and control PyTorch users know (memory_allocated, memory_summary,
/// empty_cache, limits, out-of-memory observers, history): what the per-device default allocators are.
/// Implementations are thread-safe.
class device_allocator : public device_resource {
 public:
  /// Statistics, read without locking.
  [[nodiscard]] virtual allocator_stats stats() const = 0;
  /// The cached free memory's layout (largest free block, fragmentation).
  [[nodiscard]] virtual free_space_info free_space() const = 0;
  /// Segments and blocks with consistent statistics (for debugging and tests).
  [[nodiscard]] virtual allocator_snapshot snapshot() const = 0;
  /// A torch.cuda.memory_summary()-style table.
  [[nodiscard]] virtual std::string memory_summary() const = 0;

  /// Returns completely free segments to the device after pending work completes. May throw invalid_argument_error
  /// while a CUDA graph capture is underway whose device-wide wait or stream it would disturb (the implementations
  /// say when).
  virtual void empty_cache() = 0;
  /// Releases free segments, largest first, until at most `target_reserved` bytes are reserved; returns reserved.
  virtual std::size_t trim(std::size_t target_reserved) = 0;
  /// Starts new peaks from the current values (e.g. to measure one phase of a program).
  virtual void reset_peak_stats() = 0;
  /// Zeroes the totals allocated/freed and the counters (retries, OOMs, upstream calls, ...).
  virtual void reset_accumulated_stats() = 0;
  /// Caps reserved memory; allocations beyond it free cache, retry, then throw out_of_memory_error.
  virtual void set_reserved_limit(std::size_t bytes) = 0;
  /// Caps reserved memory at a fraction of the device's total memory.
  virtual void set_memory_fraction(double fraction) = 0;

  /// Calls `observer` with the numbers of every out-of-memory error of this allocator just before it is thrown
  /// (outside the allocator's lock); returns an id for remove_out_of_memory_observer. Allocators that cannot
  /// report them throw invalid_argument_error.
  virtual std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer);
  /// Removes an observer; false when none has that id. Once it returns, the observer is not called again and its
  /// calls on other threads have ended, except, when removed inside an observer, those of threads waiting in a
  /// removal themselves (detail::out_of_memory_observers::remove says why).
  virtual bool remove_out_of_memory_observer(std::uint64_t id);

  /// Records this allocator's events into `history` from now on (memory_history.hpp); nullptr stops. Allocators
  /// that cannot record a history throw invalid_argument_error.
  virtual void set_memory_history(std::shared_ptr<memory_history> history);
  /// The history being recorded into, or null.
  [[nodiscard]] virtual std::shared_ptr<memory_history> history() const;

  /// Bytes handed out to users, like torch.cuda.memory_allocated().
  [[nodiscard]] virtual std::size_t memory_allocated() const noexcept = 0;
  /// Bytes held from the device, like torch.cuda.memory_reserved().
  [[nodiscard]] virtual std::size_t memory_reserved() const noexcept = 0;
  /// Peak of memory_allocated() since the last reset_peak_stats(), like torch.cuda.max_memory_allocated().
  [[nodiscard]] virtual std::size_t max_memory_allocated() const noexcept = 0;
  /// Peak of memory_reserved() since the last reset_peak_stats(), like torch.cuda.max_memory_reserved().
  [[nodiscard]] virtual std::size_t max_memory_reserved() const noexcept = 0;

 protected:
  device_allocator() = default;
  /// The interface holds no state; whether an implementation can be copied is its own choice.
  device_allocator(const device_allocator&) = default;
  /// The interface holds no state; whether an implementation can be assigned is its own choice.
  device_allocator& operator=(const device_allocator&) = default;
};

/// The caching engine (basic_caching_allocator) over `Upstream`, with gpukit's streams and events, as a
/// device_allocator. engine() gives the full engine API (options, upstream, rounded sizes).
template <class Upstream>
class caching_device_allocator final : public device_allocator {
 public:
  /// The caching engine behind this allocator, with gpukit's streams and events.
  using engine_type = basic_caching_allocator<Upstream, stream_ops>;

  /// An allocator of device `d`; the upstream is built from `upstream_args`. Makes no CUDA call, except with
  /// allocator_options::expandable_segments_required (see basic_caching_allocator's constructor).
  template <class... UpstreamArgs>
  explicit caching_device_allocator(gpukit::device d, allocator_options options = {}, UpstreamArgs&&... upstream_args)
      : engine_(d, options, std::forward<UpstreamArgs>(upstream_args)...) {}
  caching_device_allocator(const caching_device_allocator&) = delete;
  caching_device_allocator& operator=(const caching_device_allocator&) = delete;
  /// The engine releases the memory of allocations still live (and warns): their over-aligned addresses are
  /// forgotten first, so that a block which later starts at one is not taken for them.
  ~caching_device_allocator() override {
    if (engine_.memory_allocated() == 0) return;
    engine_.for_each_segment([](std::uintptr_t address, std::size_t bytes) noexcept {
      forget_over_aligned_addresses(reinterpret_cast<const void*>(address), bytes);
    });
  }

  gpukit::device device() const noexcept override { return engine_.device(); }

  /// The engine's full API (options, upstream, rounded sizes); it knows nothing of graph pools or over-aligned
  /// addresses, which this wrapper handles.
  engine_type& engine() noexcept { return engine_; }
  /// The engine's full API, read-only.
  const engine_type& engine() const noexcept { return engine_; }

  allocator_stats stats() const override { return engine_.stats(); }
  free_space_info free_space() const override { return engine_.free_space(); }
  allocator_snapshot snapshot() const override { return engine_.snapshot(); }
  std::string memory_summary() const override { return engine_.memory_summary(); }
  void empty_cache() override { engine_.empty_cache(); }
  std::size_t trim(std::size_t target_reserved) override { return engine_.trim(target_reserved); }
  void reset_peak_stats() override { engine_.reset_peak_stats(); }
  void reset_accumulated_stats() override { engine_.reset_accumulated_stats(); }
  void set_reserved_limit(std::size_t bytes) override { engine_.set_reserved_limit(bytes); }
  void set_memory_fraction(double fraction) override { engine_.set_memory_fraction(fraction); }
  std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer) override {
    return engine_.add_out_of_memory_observer(std::move(observer));
  }
  void set_memory_history(std::shared_ptr<memory_history> history) override {
    engine_.set_memory_history(std::move(history));
  }
  std::shared_ptr<memory_history> history() const override { return engine_.history(); }
  bool remove_out_of_memory_observer(std::uint64_t id) override { return engine_.remove_out_of_memory_observer(id); }
  std::size_t memory_allocated() const noexcept override { return engine_.memory_allocated(); }
  std::size_t memory_reserved() const noexcept override { return engine_.memory_reserved(); }
  std::size_t max_memory_allocated() const noexcept override { return engine_.max_memory_allocated(); }
  std::size_t max_memory_reserved() const noexcept override { return engine_.max_memory_reserved(); }

 private:
  /// While a graph pool exists (graph_pool.hpp), allocations for a capture it serves come from it.
  void* do_allocate(std::size_t bytes, stream_view stream) override {
    if (detail::any_capture_pool() && bytes != 0) {
      // At this allocator's natural alignment, which callers (over-aligned requests among them) rely on.
      if (device_allocator* pool = detail::pool_for_capture(stream)) {
        // A stream of another device is refused, as outside a capture: its pool's memory is not this device's.
        detail::require_stream_of(stream, device(), "gpukit::caching_allocator", "allocate");
        return pool->allocate(bytes, do_natural_alignment(), stream);
      }
    }
    return engine_.allocate(bytes, stream);
  }
  /// Memory of a graph pool goes back to it.
  void do_deallocate(void* p) override {
    if (device_allocator* pool = graph_pool_owning(p)) return pool->deallocate(p);
    engine_.deallocate(p);
  }
  void do_deallocate(void* p, stream_view stream) override {
    if (device_allocator* pool = graph_pool_owning(p)) return pool->deallocate(p, stream);
    engine_.deallocate(p, stream);
  }
  void do_record_stream(void* p, stream_view stream) override {
    if (device_allocator* pool = graph_pool_owning(p)) return pool->record_stream(p, stream);
    engine_.record_stream(p, stream);
  }
  /// Memory a graph pool served for this allocator is this allocator's to free (do_deallocate routes it); a pool's
  /// reserve is not, beyond the blocks the pool has handed out.
  bool do_owns(const void* p) const noexcept override {
    if (p != nullptr && detail::any_capture_pool()) {
      try {
        auto& registry = detail::capture_pools();
        std::lock_guard<std::mutex> lock(registry.mutex);  // held while the pool is asked: it may end meanwhile
        for (const detail::live_capture_pool& live : registry.live) {
          if (live.in_reserve(*live.pool, p)) return live.pool->owns(p);
        }
      } catch (...) {
        return false;  // the mutex failed
      }
    }
    return engine_.owns(p);
  }
  /// Blocks start at multiples of the rounding inside segments aligned to upstream_alignment.
  std::size_t do_natural_alignment() const noexcept override {
    return std::min(engine_.options().rounding, upstream_alignment);
  }

  /// The graph pool whose reserve holds `p`, when graph pools exist. Asked before the engine: a pool's first block
  /// starts where its reserve, an allocation of the engine, does, and a freed pool block (a double free) must reach
  /// the pool, which refuses it, not free the whole reserve in the engine.
  static device_allocator* graph_pool_owning(const void* p) {
    if (p == nullptr || !detail::any_capture_pool()) return nullptr;
    auto& registry = detail::capture_pools();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (const detail::live_capture_pool& live : registry.live) {
      if (live.in_reserve(*live.pool, p)) return live.pool;
    }
    return nullptr;
  }

  engine_type engine_;
};

/// The default allocators' type: cudaMalloc-backed for cuda:N, host-memory-backed for the CPU.
using caching_allocator = caching_device_allocator<device_upstream>;

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE void require_stream_of(const stream_view& s, gpukit::device d, const char* who, const char* operation) {
  if (!s.is_cpu() && s.device() == d) return;
  throw invalid_argument_error(std::string(who) + "::" + operation + ": a stream of " +
                                   (s.is_cpu() ? std::string("cpu") : s.device().to_string()) +
                                   " was passed to the allocator of " + d.to_string() + " (wrong device)",
                               cudaSuccess, who, d.ordinal());
}
}  // namespace detail

GPUKIT_INLINE std::uint64_t device_allocator::add_out_of_memory_observer(out_of_memory_observer observer) {
  (void)observer;
  throw invalid_argument_error("gpukit: the allocator of " + device().to_string() +
                               " does not support out-of-memory observers");
}

GPUKIT_INLINE bool device_allocator::remove_out_of_memory_observer(std::uint64_t id) {
  (void)id;
  return false;
}

GPUKIT_INLINE void device_allocator::set_memory_history(std::shared_ptr<memory_history> history) {
  (void)history;
  throw invalid_argument_error("gpukit: the allocator of " + device().to_string() +
                               " does not record a memory history");
}

GPUKIT_INLINE std::shared_ptr<memory_history> device_allocator::history() const { return nullptr; }

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
