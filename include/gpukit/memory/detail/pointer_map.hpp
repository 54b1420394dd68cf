// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The allocator's pointer → block map: open addressing (linear probing, backward-shift deletion, no tombstones)
/// split into shards by a hash of the address, each with its own spin lock. Threads freeing different pointers
/// rarely meet on a shard, and a lookup never allocates, so the map adds a few nanoseconds to each allocation and
/// free instead of a node allocation and a global lock.

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

template <class Value>
class sharded_pointer_map {
 public:
  static constexpr std::size_t shard_count = 64;

  /// Adds key → value. The key must be non-zero and absent. May throw std::bad_alloc when a shard grows.
  void insert(std::uintptr_t key, Value* value) {
    const std::uint64_t h = hash(key);
    shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    if ((s.count + 1) * 2 > s.slots.size()) s.grow();
    const std::size_t mask = s.slots.size() - 1;
    std::size_t i = static_cast<std::size_t>(h) & mask;
    while (s.slots[i].key != 0) i = (i + 1) & mask;
    s.slots[i] = entry{key, value};
    ++s.count;
  }

  /// Removes the key and returns its value, or nullptr when it is absent.
  Value* erase(std::uintptr_t key) noexcept {
    const std::uint64_t h = hash(key);
    shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    if (s.slots.empty()) return nullptr;
    const std::size_t mask = s.slots.size() - 1;
    std::size_t i = static_cast<std::size_t>(h) & mask;
    for (;;) {
      if (s.slots[i].key == 0) return nullptr;
      if (s.slots[i].key == key) break;
      i = (i + 1) & mask;
    }
    Value* value = s.slots[i].value;
    // Backward-shift deletion: move later entries of the probe run into the hole when their home allows it.
    std::size_t hole = i;
    std::size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      if (s.slots[j].key == 0) break;
      const std::size_t home = static_cast<std::size_t>(hash(s.slots[j].key)) & mask;
      // The entry at j may fill the hole when its home is not cyclically within (hole, j].
      const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        s.slots[hole] = s.slots[j];
        hole = j;
      }
    }
    s.slots[hole] = entry{};
    --s.count;
    return value;
  }

  /// The value of the key, or nullptr.
  Value* find(std::uintptr_t key) const noexcept {
    const std::uint64_t h = hash(key);
    const shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    if (s.slots.empty()) return nullptr;
    const std::size_t mask = s.slots.size() - 1;
    for (std::size_t i = static_cast<std::size_t>(h) & mask;; i = (i + 1) & mask) {
      if (s.slots[i].key == key) return s.slots[i].value;
      if (s.slots[i].key == 0) return nullptr;
    }
  }

  /// Number of entries (adds up the shards; for tests and reports).
  std::size_t size() const noexcept {
    std::size_t n = 0;
    for (const auto& s : shards_) {
      std::lock_guard<spin_mutex> lock(s.mutex);
      n += s.count;
    }
    return n;
  }

 private:
  struct entry {
    std::uintptr_t key = 0;
    Value* value = nullptr;
  };
  struct alignas(64) shard {
    mutable spin_mutex mutex;
    std::size_t count = 0;
    std::vector<entry> slots;
    void grow() {
      std::vector<entry> old(slots.size() < 16 ? 32 : slots.size() * 2);
      old.swap(slots);
      const std::size_t mask = slots.size() - 1;
      for (const entry& e : old) {
        if (e.key == 0) continue;
        std::size_t i = static_cast<std::size_t>(hash(e.key)) & mask;
        while (slots[i].key != 0) i = (i + 1) & mask;
        slots[i] = e;
      }
    }
  };

  /// A 64-bit mix (the MurmurHash3 finalizer): block addresses share their low bits, so they must be mixed.
  static std::uint64_t hash(std::uintptr_t key) noexcept {
    std::uint64_t h = static_cast<std::uint64_t>(key);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
  }

  shard shards_[shard_count];
};

}  // namespace detail
GPUKIT_END_NAMESPACE
