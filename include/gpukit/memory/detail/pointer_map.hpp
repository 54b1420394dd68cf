// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The allocator's pointer → block map: open addressing (linear probing, backward-shift deletion, no tombstones)
/// split into shards by a hash of the address. Writers (insert, erase) take their shard's spin lock; a lookup
/// takes no lock: it reads the shard under a sequence count (a seqlock) and retries if a writer was at work. A free
/// that finds its block this way pays no locked instruction for the map (issue 9: the cache-hit pair).
///
/// A table that a shard outgrows is kept until the map is destroyed, since a lookup may still be reading it; the
/// tables double, so the old ones take less memory than the current one.

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/detail/sequence_write.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

template <class Value>
class sharded_pointer_map {
 public:
  static constexpr std::size_t shard_count = 64;

  /// The shard that holds `key` (tests fill one shard to make it grow).
  static std::size_t shard_of(std::uintptr_t key) noexcept { return static_cast<std::size_t>(hash(key) >> 58); }

  /// Adds key → value. The key must be non-zero and absent. May throw std::bad_alloc when a shard grows.
  void insert(std::uintptr_t key, Value* value) {
    const std::uint64_t h = hash(key);
    shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    table* t = s.current.load(std::memory_order_relaxed);
    if (t == nullptr || (s.count + 1) * 2 > t->size) t = s.grow();  // may throw: nothing has changed
    sequence_write w(s.sequence);
    const std::size_t mask = t->size - 1;
    std::size_t i = static_cast<std::size_t>(h) & mask;
    while (t->entries[i].key.load(std::memory_order_relaxed) != 0) i = (i + 1) & mask;
    t->entries[i].set(key, value);
    ++s.count;
  }

  /// Puts back a key erased a moment ago (an error path): never grows the shard, so it cannot throw. Other keys
  /// inserted meanwhile may have passed the load factor, never the table's size.
  void restore(std::uintptr_t key, Value* value) noexcept {
    const std::uint64_t h = hash(key);
    shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    table* t = s.current.load(std::memory_order_relaxed);  // it held the key: it exists
    sequence_write w(s.sequence);
    const std::size_t mask = t->size - 1;
    std::size_t i = static_cast<std::size_t>(h) & mask;
    while (t->entries[i].key.load(std::memory_order_relaxed) != 0) i = (i + 1) & mask;
    t->entries[i].set(key, value);
    ++s.count;
  }

  /// Removes the key and returns its value, or nullptr when it is absent.
  Value* erase(std::uintptr_t key) noexcept {
    const std::uint64_t h = hash(key);
    shard& s = shards_[h >> 58];
    std::lock_guard<spin_mutex> lock(s.mutex);
    table* t = s.current.load(std::memory_order_relaxed);
    if (t == nullptr) return nullptr;
    const std::size_t mask = t->size - 1;
    entry* e = t->entries.get();
    std::size_t i = static_cast<std::size_t>(h) & mask;
    for (;;) {
      const std::uintptr_t k = e[i].key.load(std::memory_order_relaxed);
      if (k == 0) return nullptr;
      if (k == key) break;
      i = (i + 1) & mask;
    }
    Value* value = e[i].value.load(std::memory_order_relaxed);
    sequence_write w(s.sequence);
    // Backward-shift deletion: move later entries of the probe run into the hole when their home allows it.
    std::size_t hole = i;
    std::size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      const std::uintptr_t k = e[j].key.load(std::memory_order_relaxed);
      if (k == 0) break;
      const std::size_t home = static_cast<std::size_t>(hash(k)) & mask;
      // The entry at j may fill the hole when its home is not cyclically within (hole, j].
      const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        e[hole].set(k, e[j].value.load(std::memory_order_relaxed));
        hole = j;
      }
    }
    e[hole].set(0, nullptr);
    --s.count;
    return value;
  }

  /// The value of the key, or nullptr. Takes no lock (see the file comment); a key inserted or erased by another
  /// thread concurrently is seen or not, as the two happen to be ordered.
  Value* find(std::uintptr_t key) const noexcept {
    version_type version = 0;
    return find(key, version);
  }
  /// find(), also giving the key's shard's version at the lookup, for unchanged().
  using version_type = std::uint32_t;
  Value* find(std::uintptr_t key, version_type& version) const noexcept {
    const std::uint64_t h = hash(key);
    const shard& s = shards_[h >> 58];
    for (;;) {
      const std::uint32_t before = s.sequence.load(std::memory_order_acquire);
      if ((before & 1U) == 0) {
        Value* found = probe(s.current.load(std::memory_order_acquire), h, key);
        if (s.sequence.load(std::memory_order_relaxed) == before) {
          version = before;
          return found;
        }
      }
      spin_mutex::pause();
    }
  }
  /// Whether nothing was inserted into or erased from the key's shard since a find() gave `version` (one load).
  bool unchanged(std::uintptr_t key, version_type version) const noexcept {
    return shards_[hash(key) >> 58].sequence.load(std::memory_order_acquire) == version;
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
  // Atomic so that lookups may read while a writer changes them: stored with release, loaded with acquire, under
  // the shard's sequence count (sequence_write.hpp says why that suffices).
  struct entry {
    std::atomic<std::uintptr_t> key{0};
    std::atomic<Value*> value{nullptr};
    void set(std::uintptr_t k, Value* v) noexcept {
      key.store(k, std::memory_order_release);
      value.store(v, std::memory_order_release);
    }
  };
  struct table {
    explicit table(std::size_t n) : size(n), entries(new entry[n]) {}
    std::size_t size;
    std::unique_ptr<entry[]> entries;
  };
  struct alignas(false_sharing_range) shard {
    mutable spin_mutex mutex;                // held by writers
    std::atomic<std::uint32_t> sequence{0};  // odd while a writer changes the current table
    std::atomic<table*> current{nullptr};
    std::size_t count = 0;
    std::vector<std::unique_ptr<table>> tables;  // every table the shard had; the current one last

    /// A table twice the size holding the same entries, made current (the lock held).
    table* grow() {
      table* old = current.load(std::memory_order_relaxed);
      tables.reserve(tables.size() + 1);
      auto bigger = std::make_unique<table>(old == nullptr ? 32 : old->size * 2);
      const std::size_t mask = bigger->size - 1;
      if (old != nullptr) {
        for (std::size_t n = 0; n < old->size; ++n) {
          const std::uintptr_t k = old->entries[n].key.load(std::memory_order_relaxed);
          if (k == 0) continue;
          std::size_t i = static_cast<std::size_t>(hash(k)) & mask;
          while (bigger->entries[i].key.load(std::memory_order_relaxed) != 0) i = (i + 1) & mask;
          bigger->entries[i].set(k, old->entries[n].value.load(std::memory_order_relaxed));
        }
      }
      table* t = bigger.get();
      tables.push_back(std::move(bigger));
      current.store(t, std::memory_order_release);  // lookups see it whole (its entries were written before)
      return t;
    }
  };

  static Value* probe(const table* t, std::uint64_t h, std::uintptr_t key) noexcept {
    if (t == nullptr) return nullptr;
    const std::size_t mask = t->size - 1;
    for (std::size_t i = static_cast<std::size_t>(h) & mask, n = 0; n < t->size; i = (i + 1) & mask, ++n) {
      const std::uintptr_t k = t->entries[i].key.load(std::memory_order_acquire);
      if (k == key) return t->entries[i].value.load(std::memory_order_acquire);
      if (k == 0) return nullptr;
    }
    return nullptr;  // a torn view (the caller retries): every slot was taken
  }

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

  std::array<shard, shard_count> shards_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
