// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The allocator's free lists: segregated fit with two-level size classes (as in TLSF). A size falls in octave
/// floor(log2(size)) and in one of `subclasses` equal slices of that octave, so the classes are exact for small
/// sizes and within 1/subclasses of the size above. A bitmap of octaves and one of slices per octave find the
/// next non-empty class with two count-trailing-zeros instructions: lookups never scan the lists of other classes.
///
/// find() returns the best fit among a bounded number of blocks of the request's own class, else the best of a few
/// blocks of the next non-empty class (any of which fits), and only then scans the rest of the request's own
/// class, then, if every block seen was refused, the larger classes in order (these last steps run only when the
/// cache has nothing else to offer, i.e. just before the allocator would ask the upstream for a new segment, which
/// costs far more).
///
/// Block must have members `std::size_t size`, `std::uintptr_t address`, `Block* free_prev`, `Block* free_next`.

#include <gpukit/detail/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

inline int floor_log2(std::uint64_t x) noexcept { return 63 - __builtin_clzll(x); }
inline int lowest_bit(std::uint64_t x) noexcept { return __builtin_ctzll(x); }

template <class Block>
class size_class_index {
 public:
  static constexpr int subclass_log = 5;
  static constexpr int subclasses = 1 << subclass_log;  ///< slices per octave: classes within 1/32 of a size
  static constexpr int octaves = 64 - subclass_log + 1;
  static constexpr int probes = 4;  ///< blocks of one class compared before settling

  size_class_index() noexcept {
    heads_.fill(nullptr);
    octave_masks_.fill(0);
  }

  bool empty() const noexcept { return octave_bitmap_ == 0; }

  void insert(Block* b) noexcept {
    const unsigned c = class_of(b->size);
    Block*& head = heads_[c];
    b->free_prev = nullptr;
    b->free_next = head;
    if (head != nullptr) head->free_prev = b;
    head = b;
    const unsigned octave = c / subclasses;
    octave_masks_[octave] |= std::uint64_t{1} << (c % subclasses);
    octave_bitmap_ |= std::uint64_t{1} << octave;
  }

  void remove(Block* b) noexcept {
    if (b->free_prev != nullptr) {
      b->free_prev->free_next = b->free_next;
    } else {
      const unsigned c = class_of(b->size);
      heads_[c] = b->free_next;
      if (b->free_next == nullptr) {
        const unsigned octave = c / subclasses;
        octave_masks_[octave] &= ~(std::uint64_t{1} << (c % subclasses));
        if (octave_masks_[octave] == 0) octave_bitmap_ &= ~(std::uint64_t{1} << octave);
      }
    }
    if (b->free_next != nullptr) b->free_next->free_prev = b->free_prev;
    b->free_prev = b->free_next = nullptr;
  }

  /// The best free block of at least `size` bytes that `accept(block)` allows, or nullptr (see the file
  /// comment for the search order). The block stays in the index.
  template <class Accept>
  Block* find(std::size_t size, Accept&& accept) const noexcept {
    const unsigned own = class_of(size);
    Block* best = nullptr;
    int seen = 0;
    Block* b = heads_[own];
    for (; b != nullptr && seen < probes; b = b->free_next, ++seen) consider(best, b, size, accept);
    if (best != nullptr) return best;
    Block* const rest_of_own = b;
    const unsigned next = next_nonempty_class(own + 1);
    Block* rest_of_next = nullptr;
    if (next != no_class) {
      seen = 0;
      Block* c = heads_[next];
      for (; c != nullptr && seen < probes; c = c->free_next, ++seen) consider(best, c, size, accept);
      if (best != nullptr) return best;
      rest_of_next = c;
    }
    for (b = rest_of_own; b != nullptr; b = b->free_next) consider(best, b, size, accept);
    if (best != nullptr || next == no_class) return best;
    // Every block seen was refused (blocks kept whole for large requests, fenced ones during a capture): the larger
    // classes in order, each whole, rather than a new segment while a fitting block is cached.
    for (Block* c = rest_of_next; c != nullptr; c = c->free_next) consider(best, c, size, accept);
    for (unsigned k = next_nonempty_class(next + 1); best == nullptr && k != no_class; k = next_nonempty_class(k + 1)) {
      for (Block* c = heads_[k]; c != nullptr; c = c->free_next) consider(best, c, size, accept);
    }
    return best;
  }

  /// The largest free block (for reports).
  Block* largest() const noexcept {
    if (octave_bitmap_ == 0) return nullptr;
    const int octave = floor_log2(octave_bitmap_);
    const unsigned c = static_cast<unsigned>(octave) * subclasses +
                       static_cast<unsigned>(floor_log2(octave_masks_[static_cast<std::size_t>(octave)]));
    Block* best = heads_[c];
    for (Block* b = best; b != nullptr; b = b->free_next) {
      if (b->size > best->size) best = b;
    }
    return best;
  }

  /// The class of a size: exact below `subclasses`, then (octave, slice).
  static unsigned class_of(std::size_t size) noexcept {
    if (size < static_cast<std::size_t>(subclasses)) return static_cast<unsigned>(size);
    const int log = floor_log2(size);
    const unsigned slice = static_cast<unsigned>(size >> (log - subclass_log)) - subclasses;
    return static_cast<unsigned>(log - subclass_log + 1) * subclasses + slice;
  }

 private:
  static constexpr unsigned no_class = ~0u;
  static constexpr unsigned class_count = octaves * subclasses;

  template <class Accept>
  static void consider(Block*& best, Block* b, std::size_t size, Accept& accept) noexcept {
    if (b->size < size || !accept(static_cast<const Block*>(b))) return;
    if (best == nullptr || b->size < best->size || (b->size == best->size && b->address < best->address)) best = b;
  }

  unsigned next_nonempty_class(unsigned from) const noexcept {
    if (from >= class_count) return no_class;
    const unsigned octave = from / subclasses;
    const std::uint64_t in_octave = octave_masks_[octave] & (~std::uint64_t{0} << (from % subclasses));
    if (in_octave != 0) return octave * subclasses + static_cast<unsigned>(lowest_bit(in_octave));
    if (octave + 1 >= octaves) return no_class;
    const std::uint64_t later = octave_bitmap_ & (~std::uint64_t{0} << (octave + 1));
    if (later == 0) return no_class;
    const unsigned o = static_cast<unsigned>(lowest_bit(later));
    return o * subclasses + static_cast<unsigned>(lowest_bit(octave_masks_[o]));
  }

  std::uint64_t octave_bitmap_ = 0;
  std::array<std::uint64_t, octaves> octave_masks_;
  std::array<Block*, class_count> heads_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
