// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's diagnostics (caching_allocator.hpp): the snapshot of its segments and blocks, the layout of
/// its free space, and the messages that explain a misuse. They only read the engine's state, under the locks its
/// callers hold, and live apart from the engine so that its file keeps to the heap, the stream ordering and the
/// growth policy. basic_caching_allocator befriends caching_diagnostics; `Engine` below is always one of those.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Read-only views of a basic_caching_allocator (see the file comment).
struct caching_diagnostics {
  /// Every segment (sorted by address) and block of `e`, with its statistics (the device lock and every front slot's
  /// lock held: blocks neither change nor enter or leave the front caches meanwhile).
  template <class Engine>
  static allocator_snapshot snapshot(const Engine& e) {
    allocator_snapshot s;
    s.device = e.device_;
    for (auto* seg = e.segments_; seg != nullptr; seg = seg->next_segment) {
      segment_info info;
      info.address = seg->address;
      info.size = seg->size;
      info.mapped = seg->mapped();
      info.expandable = seg->expandable;
      info.small_pool = seg->small;
      if (seg->expandable) {
        e.for_each_mapped_run(
            *seg, [&](std::uintptr_t address, std::size_t bytes) { info.mapped_ranges.emplace_back(address, bytes); });
      }
      for (auto* b = seg->first; b != nullptr; b = b->next) {
        block_info bi;
        bi.address = b->address;
        bi.size = b->size;
        const bool cached = b->in_front.load(std::memory_order_relaxed);
        const bool in_use = b->state == block_state::allocated || b->state == block_state::pending;
        bi.requested = (cached || !in_use) ? 0 : b->requested;
        bi.state = cached ? block_state::cached : b->state;
        bi.stream = b->owner->key;
        bi.pending_events = b->pending_events;
        info.blocks.push_back(bi);
      }
      s.segments.push_back(std::move(info));
    }
    std::sort(s.segments.begin(), s.segments.end(),
              [](const segment_info& a, const segment_info& b) { return a.address < b.address; });
    s.stats = e.read_stats();
    std::size_t cached = 0;  // blocks in front caches stay in the pointer map, marked
    for (const auto& slot : e.used_fronts()) cached += slot.blocks.load(std::memory_order_relaxed);
    s.pointer_map_entries = e.map_.size() - cached;
    return s;
  }

  /// How often a front-cache call of `e` took every lock for the claims (front_take_slow, front_give_slow). Read
  /// with no call of `e` in flight.
  template <class Engine>
  static std::size_t front_slow_paths(const Engine& e) noexcept {
    return e.front_slow_paths_;
  }
  /// How often the heap of `e` took every lock to take room back from the slots' claims (raise_peak_with_fronts).
  template <class Engine>
  static std::size_t heap_peak_raises(const Engine& e) noexcept {
    return e.heap_peak_raises_;
  }
  /// How often the heap of `e` looked for spare claims one slot at a time before that (take_spare_claims).
  template <class Engine>
  static std::size_t heap_spare_looks(const Engine& e) noexcept {
    return e.heap_spare_looks_;
  }

  /// The free memory of `e`: free blocks in the heap and in the front caches, only their mapped pages for expandable
  /// segments (unmapped space is no memory). The device lock and every front slot's lock held.
  template <class Engine>
  static free_space_info free_space(const Engine& e) noexcept {
    free_space_info f;
    for (auto* seg = e.segments_; seg != nullptr; seg = seg->next_segment) {
      for (auto* b = seg->first; b != nullptr; b = b->next) {
        if (b->state != block_state::free && !b->in_front.load(std::memory_order_relaxed)) continue;
        const std::size_t backed = seg->expandable ? e.mapped_bytes_of(b) : b->size;
        if (backed == 0) continue;
        f.free_bytes += backed;
        ++f.free_blocks;
        // A request takes a block from its start: in an expandable segment only the mapped run there serves one
        // without the upstream (pages mapped past an unmapped one do not).
        const std::size_t usable =
            seg->expandable ? seg->pages.mapped_prefix(b->address - seg->address, b->size) : backed;
        f.largest_free_block = std::max(f.largest_free_block, usable);
      }
    }
    return f;
  }

  /// Why `operation`(p) was refused: `p` is not a live allocation of `e` (the device lock held). Names what `p` is
  /// instead: no block of `e`, inside a block, a block already freed (or cached in front), or one another thread is
  /// freeing.
  template <class Engine>
  static std::string not_owned_message(const Engine& e, const void* p, const char* operation) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    std::string m = std::string("gpukit: ") + operation + "(" + format_pointer(p) + ") on the caching allocator of " +
                    e.device_.to_string() + ": ";
    const std::remove_pointer_t<decltype(e.segments_->first)>* containing = nullptr;
    for (auto* seg = e.segments_; seg != nullptr && containing == nullptr; seg = seg->next_segment) {
      if (address < seg->address || address >= seg->address + seg->size) continue;
      for (auto* b = seg->first; b != nullptr; b = b->next) {
        if (address >= b->address && address < b->address + b->size) {
          containing = b;
          break;
        }
      }
    }
    if (containing == nullptr) {
      m += "the pointer was not allocated by this allocator (another device's allocator, cudaMalloc, or freed and "
           "already returned to the device)";
    } else if (containing->state == block_state::allocated && !containing->in_front.load(std::memory_order_relaxed)) {
      if (containing->address != address) {
        m += "the pointer points " + std::to_string(address - containing->address) + " bytes into a block of " +
             std::to_string(containing->size) + " bytes; pass the pointer the allocation returned";
      } else {
        m += "the allocation is being freed by another thread at the same time";
      }
    } else if (containing->address == address) {
      m += "the pointer was already freed (double free)";
    } else {  // a freed block merges with its free neighbours: the pointer now lies inside one
      m += "the pointer lies " + std::to_string(address - containing->address) + " bytes into a free block of " +
           std::to_string(containing->size) + " bytes: it was already freed (double free) or is stale";
    }
    return m;
  }

  /// The warning for freeing block `b` of `e` after its stream was destroyed (a stream must outlive its
  /// allocations).
  template <class Engine, class Block>
  static std::string expired_owner_message(const Engine& e, const Block* b) {
    return "gpukit: freeing " + format_pointer(reinterpret_cast<const void*>(b->address)) + " (" +
           std::to_string(b->requested) + " bytes) on the caching allocator of " + e.device_.to_string() +
           ": the stream it was allocated on, " + e.describe(*b->owner) +
           ", was destroyed while the allocation was live (a buffer must be freed before its stream is destroyed); "
           "the memory is reused only after the work that stream had enqueued has completed";
  }
};

}  // namespace detail
GPUKIT_END_NAMESPACE
