// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's fast path: per-stream front caches. A block freed on its own stream (no record_stream,
/// stream alive) goes to a small LIFO bin of its exact size in the front slot of its stream, and the next request
/// of that size on that stream takes it back: one slot lock, no device lock, no split or coalesce. Threads that
/// allocate on different streams use different slots, so they do not serialize (issue 9, §5).
///
/// To the block heap a cached block is still allocated: no neighbour coalesces with it and nothing else takes it.
/// The heap takes the blocks back (flush) before it grows, releases memory or reports its layout, so the footprint
/// and out-of-memory behaviour are the heap's.
///
/// Statistics stay exact. The heap keeps its counters under the device lock; each slot keeps its difference from
/// them (`delta`: a cached block is free to the user, allocated to the heap), so a current value is the heap's plus
/// the slots'. Peaks are exact through claims: a slot may raise a counter on its own only up to its `claim`, and
/// the allocator keeps peak >= heap + sum of claims, so no value above the peak can arise unseen. Going past a claim
/// takes the slow path, which sees every slot and the heap at once (all locks) and records the true peak.

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The allocator's counters as the front caches see them: 9 statistics × (all, small, large).
constexpr std::size_t front_counter_count = 27;

/// One slot: the blocks cached for one stream (its key), with the slot's part of the statistics. `Block` needs
/// `size` and a `free_next` link (unused while the block is allocated to the heap).
template <class Block>
struct alignas(64) front_slot {
  static constexpr std::size_t bin_count = 8;       // distinct sizes cached per stream
  static constexpr std::uint32_t bin_depth = 8;     // blocks cached per size

  struct bin {
    std::size_t size = 0;  // 0: unused
    Block* top = nullptr;
    std::uint32_t count = 0;
  };

  mutable spin_mutex mutex;
  std::uintptr_t key = 0;                 // the stream whose blocks are cached, while blocks != 0
  std::atomic<std::uint32_t> blocks{0};   // written under the lock; read without it to skip empty slots
  std::array<bin, bin_count> bins{};
  std::array<std::atomic<std::int64_t>, front_counter_count> delta{};  // user view minus heap view
  // Increases made here (totals allocated); the decreases (totals freed) are added - delta - freed_base.
  std::array<std::atomic<std::int64_t>, front_counter_count> added{};
  std::array<std::atomic<std::int64_t>, front_counter_count> freed_base{};  // set by reset_totals
  std::array<std::int64_t, front_counter_count> claim{};               // delta may rise to this without a look

  /// The bin of blocks of `size`, or nullptr.
  bin* find(std::size_t size) noexcept {
    for (bin& b : bins) {
      if (b.size == size && b.count != 0) return &b;
    }
    return nullptr;
  }
  /// The bin a block of `size` joins (that size's, else an unused one), or nullptr when the slot is full.
  bin* room_for(std::size_t size) noexcept {
    bin* spare = nullptr;
    for (bin& b : bins) {
      if (b.size == size && b.count != 0) return b.count < bin_depth ? &b : nullptr;
      if (b.count == 0 && spare == nullptr) spare = &b;
    }
    return spare;
  }
  void push(bin& b, Block* block) noexcept {
    b.size = block->size;
    block->free_next = b.top;
    b.top = block;
    ++b.count;
    blocks.store(blocks.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  Block* pop(bin& b) noexcept {
    Block* block = b.top;
    b.top = block->free_next;
    block->free_next = nullptr;
    if (--b.count == 0) b.size = 0;
    blocks.store(blocks.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
    return block;
  }

  /// Adds `d` to counter `k` (the caller holds the lock and has checked the claim).
  void add(std::size_t k, std::int64_t d) noexcept {
    delta[k].store(delta[k].load(std::memory_order_relaxed) + d, std::memory_order_relaxed);
    if (d > 0) added[k].store(added[k].load(std::memory_order_relaxed) + d, std::memory_order_relaxed);
  }
  /// Takes back change `d` that a block made when it entered the cache, as the heap takes the block: the value
  /// moves back to the heap, and the totals forget the change, which the heap counts again (`undo` reverts this).
  void unwind(std::size_t k, std::int64_t d, bool undo = false) noexcept {
    const std::int64_t change = undo ? d : -d;
    delta[k].store(delta[k].load(std::memory_order_relaxed) + change, std::memory_order_relaxed);
    // An increase leaves the totals allocated; a decrease leaves the totals freed, which follow from delta.
    if (d > 0) added[k].store(added[k].load(std::memory_order_relaxed) + change, std::memory_order_relaxed);
  }
  std::int64_t removed(std::size_t k) const noexcept {
    return added[k].load(std::memory_order_relaxed) - delta[k].load(std::memory_order_relaxed) -
           freed_base[k].load(std::memory_order_relaxed);
  }
  /// Zeroes the totals (the caller holds the lock).
  void reset_totals() noexcept {
    for (std::size_t k = 0; k < front_counter_count; ++k) {
      added[k].store(0, std::memory_order_relaxed);
      freed_base[k].store(-delta[k].load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
  }
  std::int64_t value(std::size_t k) const noexcept { return delta[k].load(std::memory_order_relaxed); }
};

}  // namespace detail
GPUKIT_END_NAMESPACE
