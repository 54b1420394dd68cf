// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's fast path: per-stream front caches. A small block freed on its own stream (no
/// record_stream, stream alive) goes to a small LIFO bin of its exact size in the front slot of its stream, and the
/// next request of that size on that stream takes it back: one slot lock, no device lock, no split or coalesce.
/// Threads that allocate on different streams use different slots, so they do not serialize (issue 9, §5). Large
/// blocks have slots of their own, which work the same way, once threads contend for the device lock on them
/// (allocator_options::front_cache_large_when_contended) or from the start (front_cache_large).
///
/// To the block heap a cached block is still allocated: no neighbour coalesces with it and nothing else takes it.
/// The heap takes the blocks back (flush) before it grows, releases memory or reports its layout, so the footprint
/// and out-of-memory behaviour are the heap's.
///
/// Statistics stay exact. The heap keeps its counters under the device lock; each slot keeps its difference from
/// them (`delta`: a cached block is free to the user, allocated to the heap), so a current value is the heap's plus
/// the slots'. Peaks are exact through claims: a slot may raise a counter on its own only up to its `claim`, and
/// the allocator keeps peak >= heap + sum of claims, so no value above the peak can arise unseen. Going past a claim
/// takes the slow path, which sees every slot and the heap at once (all locks), records the true peak and gives the
/// slot the room left under it; the heap takes back only the room its own counts need. Before that, a slot borrows
/// room from the other slots of its pool whose locks are free (both locks held; the claims' sum is unchanged).
///
/// A slot keeps five quantities, not the 27 counters (9 statistics x all/small/large) they move: the fast path
/// stores 6 numbers per allocation, where 28 stores made the pair 1.5x slower (the lock's locked instruction waits
/// for them to drain).

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/detail/sequence_write.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// What the blocks cached in a slot change in the statistics. A slot caches blocks of one pool (small, or large), so
/// every counter they change (that pool's value and the all-pools value) follows one of five quantities, kept as
/// the users' view minus the heap's:
enum front_quantity : std::size_t {
  fq_blocks,        // blocks cached: the allocation and active counts are this much lower
  fq_bytes,         // their bytes: allocated and active bytes are this much lower
  fq_requested,     // requested bytes (the heap keeps a cached block's last request; users see it freed)
  fq_split_blocks,  // cached pieces of split segments: the inactive-split count is this much higher
  fq_split_bytes,   // and inactive-split bytes
  front_quantity_count
};
/// +1 where a counter rises with its quantity, -1 where it falls.
constexpr std::int64_t front_sign(std::size_t q) noexcept { return q == fq_blocks || q == fq_bytes ? -1 : 1; }

/// Front slots per pool (small blocks, and large ones once they are cached in front).
constexpr std::size_t front_slots_per_pool = 16;

/// The slot (of `slots`) where stream `key` starts looking for its own: a multiplicative hash of the key. Streams
/// whose homes coincide probe on (linear probing).
constexpr std::size_t front_home(std::uintptr_t key, std::size_t slots) noexcept {
  return static_cast<std::size_t>((static_cast<std::uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >> 32) % slots;
}

/// The owner key of a slot no stream ever owned (front_slot::unowned says why it is not 0).
constexpr std::uintptr_t front_unowned = ~std::uintptr_t{0};

/// The streams that own the slots, `Count` keys apart from the slots themselves. Ownership outlives the blocks:
/// while its stream takes and gives blocks, an empty slot stays its own, so threads on other streams never move in
/// between a take and a give (when they could, 8 threads on 8 streams ran slower together than one alone: they ended
/// up sharing slots or the heap). Apart, because streams whose homes coincide probe past other streams' owners on
/// every call: read in the slots, whose lines their threads write on every pair, that made two threads' pairs
/// 2.6x slower (bench_allocator, BM_gpukit_slot_homes); this table changes only when a slot changes hands.
/// An entry is written under its slot's lock, only when it changes, and read without it to find a stream's slot.
/// Never `unowned` again once set.
template <std::size_t Count>
struct alignas(false_sharing_range) front_owners {
  std::array<std::atomic<std::uintptr_t>, Count> key;
  front_owners() noexcept {
    for (auto& k : key) k.store(front_unowned, std::memory_order_relaxed);
  }
};

/// One slot: the blocks cached for one stream (its key), with the slot's part of the statistics. `Block` needs
/// `size`, `requested`, `taken_split` and a `free_next` link (unused while the block is allocated to the heap).
/// Counts change under the slot's lock and are read without it (relaxed atomics: plain stores, no locked
/// instruction, so the fast path pays no more than the lock).
template <class Block>
struct alignas(false_sharing_range) front_slot {
  static constexpr std::size_t bin_count = 8;    // distinct sizes cached per stream
  static constexpr std::uint32_t bin_depth = 8;  // blocks cached per size
  // A bin unused for this many of the slot's operations (takes and frees, hits or not) is stale: a new size may
  // have it (its blocks go back to the heap). Sizes in use never lose their bin to one another. With 256, new sizes
  // stayed cached instead of coalescing, and expandable segments' minimum capacity on the small transformer traces
  // rose (L2 h256: 1.067 to 1.094 worst); from 4096 on, bench_fragmentation's figures are those without eviction.
  static constexpr std::uint64_t stale_age = 4096;
  using counts = std::array<std::atomic<std::int64_t>, front_quantity_count>;

  // A bin keeps its size when it empties, so a size that is freed and taken in turn finds its bin at once; an
  // empty bin is free for any size. At most one bin has a given size (room_for gives a spare only when none has it).
  struct bin {
    std::size_t size = 0;  // of its blocks (or of its last ones, while empty)
    Block* top = nullptr;
    std::uint32_t count = 0;
    std::uint64_t last_use = 0;  // the slot's tick when a block last entered or left
  };

  /// The owner key of a slot no stream ever owned (see front_owners). Not 0, which a stream may have (a
  /// handle-keyed null stream): a stream keyed 0 whose slot still looked unowned would share it with the next
  /// stream, and could be handed its blocks. No stream has this key (it is the allocator's no-stream key); a stream
  /// that did would never be cached.
  static constexpr std::uintptr_t unowned = front_unowned;

  mutable spin_mutex mutex;
  std::uint64_t idle_mark = ~std::uint64_t{0};  // use() when another stream last found the slot empty (under lock)
  // The owner was destroyed and the allocator took its blocks back (under the lock; cleared when the slot changes
  // hands): a free on that stream racing its destruction must not cache a block here afterwards.
  bool owner_gone = false;
  // Requests of the owner that found the slot empty (counted without the lock, never backwards). They count as use,
  // so a stream whose blocks are all out keeps its slot while it allocates.
  std::atomic<std::uint64_t> misses{0};
  std::atomic<std::uint32_t> blocks{0};  // written under the lock; read without it to skip empty slots
  std::array<bin, bin_count> bins{};
  std::uint64_t tick = 0;  // operations on the slot (under its lock)
  // Odd while the counts below change (sequence_write.hpp): readers of the statistics check it around their reads,
  // so they see the heap's counters and every slot's at one moment without taking the locks. Every change of the
  // counts (enter, leave, unwind, reset_totals) happens inside one sequence_write, with the peaks the allocator
  // records for it.
  std::atomic<std::uint32_t> sequence{0};
  counts held{};        // the quantities (users' view minus the heap's)
  counts raised{};      // increases of the users' counters made here (their totals allocated)
  counts freed_base{};  // set by reset_totals: the totals freed are raised - value - freed_base
  // How far each quantity's counters may rise (in the counters' direction) without a look at the others: the
  // allocator keeps each counter's peak >= the heap's value + every slot's claim (front_cache explains).
  std::array<std::int64_t, front_quantity_count> claim{};

  /// Whether stream `k` may take this slot over from `owner` (the lock held): only when it is empty and its owner
  /// has not used it since another stream last asked (a stream that ended, or went idle, loses its slot on the
  /// second ask). Each ask that says no marks the slot.
  bool may_take_over(std::uintptr_t k, std::uintptr_t owner) noexcept {
    if (owner == k || owner == unowned || blocks.load(std::memory_order_relaxed) != 0) return false;
    if (idle_mark == use()) return true;
    idle_mark = use();
    return false;
  }
  /// Changes whenever the owner uses the slot: operations under the lock, and requests that found it empty.
  std::uint64_t use() const noexcept { return tick + misses.load(std::memory_order_relaxed); }
  /// The owner found the slot empty (no lock). An atomic increment, since several threads may use one stream: with a
  /// load and a store, a thread's stale store could move the count back to a value an earlier ask saw, and the slot
  /// could be taken from a stream still using it. The heap's path, which a miss takes next, costs far more.
  void note_miss() noexcept { misses.fetch_add(1, std::memory_order_relaxed); }

  /// The bin of blocks of `size`, or nullptr when none holds any.
  bin* find(std::size_t size) noexcept {
    for (bin& b : bins) {
      if (b.size == size) return b.count != 0 ? &b : nullptr;
    }
    return nullptr;
  }
  /// The bin a block of `size` joins (that size's, else an empty one), or nullptr when the slot is full.
  bin* room_for(std::size_t size) noexcept {
    bin* spare = nullptr;
    for (bin& b : bins) {
      if (b.size == size) return b.count < bin_depth ? &b : nullptr;
      if (b.count == 0 && spare == nullptr) spare = &b;
    }
    return spare;
  }
  /// The least recently used bin when it is stale and no bin holds `size`, else nullptr (call when room_for found
  /// none: the slot is full of other sizes).
  bin* stale_bin(std::size_t size) noexcept {
    bin* oldest = nullptr;
    for (bin& b : bins) {
      if (b.count == 0 || b.size == size) return nullptr;
      if (oldest == nullptr || b.last_use < oldest->last_use) oldest = &b;
    }
    return oldest != nullptr && tick - oldest->last_use >= stale_age ? oldest : nullptr;
  }
  void push(bin& b, Block* block) noexcept {
    b.last_use = tick;
    b.size = block->size;
    block->free_next = b.top;
    b.top = block;
    ++b.count;
    blocks.store(blocks.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  Block* pop(bin& b) noexcept {
    b.last_use = tick;
    Block* block = b.top;
    b.top = block->free_next;
    block->free_next = nullptr;
    --b.count;
    blocks.store(blocks.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
    return block;
  }

  /// Counter value of quantity q: the users' view minus the heap's. Loads acquire, for readers under `sequence`.
  std::int64_t value(std::size_t q) const noexcept { return front_sign(q) * held[q].load(std::memory_order_acquire); }
  std::int64_t raised_total(std::size_t q) const noexcept { return raised[q].load(std::memory_order_acquire); }
  std::int64_t lowered_total(std::size_t q) const noexcept {
    return raised_total(q) - value(q) - freed_base[q].load(std::memory_order_acquire);
  }

  /// Whether block `b` may enter (the user freed it) without a counter passing its claim: only the inactive-split
  /// counters rise then.
  bool may_enter(const Block& b) const noexcept {
    return !b.taken_split || (value(fq_split_blocks) + 1 <= claim[fq_split_blocks] &&
                              value(fq_split_bytes) + to_signed(b.size) <= claim[fq_split_bytes]);
  }
  /// Whether block `b` may leave for a request of `requested` bytes: allocation, active and requested rise.
  bool may_leave(const Block& b, std::size_t requested) const noexcept {
    return value(fq_blocks) + 1 <= claim[fq_blocks] && value(fq_bytes) + to_signed(b.size) <= claim[fq_bytes] &&
           value(fq_requested) + to_signed(requested) <= claim[fq_requested];
  }
  using amounts = std::array<std::int64_t, front_quantity_count>;
  /// How far each quantity would pass its claim if block `b` left for a request of `requested` bytes (zeros where
  /// it would not; all zeros when may_leave).
  amounts shortfall_to_leave(const Block& b, std::size_t requested) const noexcept {
    amounts need{};
    need[fq_blocks] = past_claim(fq_blocks, 1);
    need[fq_bytes] = past_claim(fq_bytes, to_signed(b.size));
    need[fq_requested] = past_claim(fq_requested, to_signed(requested));
    return need;
  }
  /// The same for block `b` entering (all zeros when may_enter).
  amounts shortfall_to_enter(const Block& b) const noexcept {
    amounts need{};
    if (b.taken_split) {
      need[fq_split_blocks] = past_claim(fq_split_blocks, 1);
      need[fq_split_bytes] = past_claim(fq_split_bytes, to_signed(b.size));
    }
    return need;
  }
  /// Moves to `to`, a slot of the same pool, as much of `need` as this slot's claims have above its values, and
  /// takes it off `need` (both locks held). Every counter either slot's blocks change counts both, so the claims' sum
  /// under each peak stays the same. Returns whether `need` is all met.
  bool give_spare(front_slot& to, amounts& need) noexcept {
    bool met = true;
    for (std::size_t q = 0; q < front_quantity_count; ++q) {
      const std::int64_t moved = std::min(need[q], std::max<std::int64_t>(0, claim[q] - value(q)));
      claim[q] -= moved;
      to.claim[q] += moved;
      need[q] -= moved;
      met = met && need[q] == 0;
    }
    return met;
  }

  /// The user freed `b` into the cache (the lock held).
  void enter(const Block& b) noexcept {
    const std::int64_t size = to_signed(b.size);
    bump(held, fq_blocks, 1);
    bump(held, fq_bytes, size);
    bump(held, fq_requested, -to_signed(b.requested));
    if (b.taken_split) {
      bump(held, fq_split_blocks, 1);
      bump(held, fq_split_bytes, size);
      bump(raised, fq_split_blocks, 1);
      bump(raised, fq_split_bytes, size);
    }
  }
  /// `b` leaves the cache for a user's request of `requested` bytes (the lock held).
  void leave(const Block& b, std::size_t requested) noexcept {
    const std::int64_t size = to_signed(b.size);
    const std::int64_t r = to_signed(requested);
    bump(held, fq_blocks, -1);
    bump(held, fq_bytes, -size);
    bump(held, fq_requested, r);
    bump(raised, fq_blocks, 1);
    bump(raised, fq_bytes, size);
    bump(raised, fq_requested, r);
    if (b.taken_split) {
      bump(held, fq_split_blocks, -1);
      bump(held, fq_split_bytes, -size);
    }
  }
  /// The heap takes `b` back (flush): the value moves back to the heap. The totals forget the allocation's changes,
  /// which the heap's free counts again; the inactive-split rise stays counted (reset_totals may have zeroed it, and
  /// the heap's merge may not count it again): the hand-back is a fall here and the heap's re-index a rise, so no
  /// total goes negative or backwards.
  void unwind(const Block& b) noexcept {
    const std::int64_t size = to_signed(b.size);
    bump(held, fq_blocks, -1);
    bump(held, fq_bytes, -size);
    bump(held, fq_requested, to_signed(b.requested));
    if (b.taken_split) {
      bump(held, fq_split_blocks, -1);
      bump(held, fq_split_bytes, -size);
    }
  }
  /// Zeroes the totals (the caller holds the lock).
  void reset_totals() noexcept {
    for (std::size_t q = 0; q < front_quantity_count; ++q) {
      raised[q].store(0, std::memory_order_release);
      freed_base[q].store(-value(q), std::memory_order_release);
    }
  }

 private:
  static std::int64_t to_signed(std::size_t v) noexcept { return static_cast<std::int64_t>(v); }
  std::int64_t past_claim(std::size_t q, std::int64_t rise) const noexcept {
    return std::max<std::int64_t>(0, value(q) + rise - claim[q]);
  }
  static void bump(counts& c, std::size_t q, std::int64_t d) noexcept {
    c[q].store(c[q].load(std::memory_order_relaxed) + d, std::memory_order_release);
  }
};

}  // namespace detail
GPUKIT_END_NAMESPACE
