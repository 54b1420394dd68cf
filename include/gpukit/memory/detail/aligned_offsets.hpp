// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Over-aligned allocations: an allocator whose blocks have a natural alignment serves a larger one by allocating
/// `alignment - natural` more bytes and handing out the first aligned address inside. One process-wide table
/// remembers, for each such address that is not its block's start, the block's start, so that frees and queries
/// reach the allocator with the pointer it handed out, whichever allocator or adaptor they come through (a graph
/// pool's memory may be freed through any allocator). Sharded by address: a lookup takes a lock only when its
/// shard holds an over-aligned address, otherwise it is one relaxed load. The table is keyed by address, and an
/// entry goes only with its allocation's free. A resource nested in an over-aligned allocation may start a block at
/// its address, and an arena released whole leaves its over-aligned addresses behind, to be reused: a resource that
/// has a live block starting at an address in the table gets that block (block_for; an over-aligned address never
/// starts a live block of the resource that handed it out, since it lies inside one). A resource that takes its memory
/// back whole forgets its addresses (erase_range; device_resource::forget_over_aligned_addresses). Left, where it does
/// not: a double free of such a block, or a query after its free, is taken for the old allocation while its entry
/// stays (a stale one, or a live one of the resource the block is nested in: the two cannot be told apart).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/error.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Throws invalid_argument_error (naming `who`) unless `alignment` is a power of two.
GPUKIT_INLINE void require_power_of_two_alignment(std::size_t alignment, const char* who);

/// The bytes to ask for so that a block of natural alignment `natural` holds `bytes` at an `alignment` boundary;
/// throws invalid_argument_error (naming `who`) when that overflows.
GPUKIT_INLINE std::size_t over_aligned_request(std::size_t bytes, std::size_t alignment, std::size_t natural,
                                               const char* who);

/// Runs `free_memory` for a caller that must not throw (a noexcept deallocate of an adaptor, which containers and
/// CCCL's references call from destructors): an error is reported through gpukit::warn, naming `who`.
template <class FreeMemory>
void free_reporting_errors(const char* who, FreeMemory&& free_memory) noexcept {
  try {
    free_memory();
  } catch (const std::exception& e) {
    warn_parts(who, ": ", e.what());
  } catch (...) {
    warn_parts(who, ": an unknown exception");
  }
}

/// Aligned address → start of the block it lies in, for over-aligned allocations. Thread-safe.
class aligned_offsets {
 public:
  /// The first `alignment` boundary at or after `block`.
  static void* align_up(void* block, std::size_t alignment) noexcept;

  /// Remembers that `aligned` lies in the block starting at `block` (aligned != block).
  void add(void* aligned, void* block);

  /// The block start behind `p`, or `p` itself when it is not an over-aligned address (or is null).
  void* block_of(const void* p) noexcept;

  /// block_of(p) for a resource that can tell whether a live block of its own starts at `p` (`owns_block_at(p)`,
  /// noexcept, asked only when `p` is in the table): then `p` is that block (a resource nested in the over-aligned
  /// allocation, or memory reused after an arena was released whole), else the block behind it (a graph pool's
  /// memory freed through another allocator included).
  template <class OwnsBlockAt>
  void* block_for(const void* p, OwnsBlockAt&& owns_block_at) noexcept {
    void* block = find(p);
    return block == nullptr || owns_block_at(p) ? const_cast<void*>(p) : block;
  }

  /// Frees `p` with `free_block(block start)`, the block start as block_for(p, owns_block_at) tells it. The address
  /// is forgotten before the block is freed: once free, the block, and so the same aligned address, may be handed
  /// out again at once. If the free throws, the allocator refused it and the allocation stays live, so the address
  /// is remembered again.
  template <class OwnsBlockAt, class FreeBlock>
  void free_with(void* p, OwnsBlockAt&& owns_block_at, FreeBlock&& free_block) {
    void* block = find(p);
    if (block == nullptr || owns_block_at(p)) return free_block(p);
    erase(p);
    try {
      free_block(block);
    } catch (...) {
      try {
        add(p, block);
      } catch (...) {
        warn_parts("gpukit: out of host memory while a refused free was undone; the over-aligned allocation at ",
                   reinterpret_cast<std::uintptr_t>(p), " can no longer be freed");
      }
      rethrow_naming(p, block);
    }
  }

  /// Forgets `aligned`; nothing when it is not in the table.
  void erase(const void* aligned) noexcept;

  /// Forgets every over-aligned address in (begin, begin + bytes): memory taken back whole (an arena's reset). Its
  /// first byte is kept: never an address handed out from the memory, it may be the parent's that handed it out.
  void erase_range(const void* begin, std::size_t bytes) noexcept;

 private:
  /// The start of the block behind the over-aligned address `p`; null when `p` is not in the table.
  void* find(const void* p) noexcept;

  /// Throws the current exception again; a refusal (invalid_argument_error), which names the block's start, an
  /// address the caller never saw, gets the caller's pointer too.
  [[noreturn]] static void rethrow_naming(const void* p, const void* block);

  struct entry {
    const void* aligned;
    void* block;
  };
  struct shard {
    std::atomic<std::size_t> size{0};  // read without the lock: a relaxed load when the shard is empty
    std::mutex mutex;
    std::vector<entry> entries;  // sorted by aligned address; over-aligned allocations are few
  };
  static constexpr std::size_t shard_count = 64;

  shard& shard_of(const void* p) noexcept;

  /// The first entry whose address is not below `p` (the entries are sorted by address; caller holds the lock).
  static std::vector<entry>::iterator find_in(std::vector<entry>& entries, const void* p);

  std::array<shard, shard_count> shards_;
};

/// The over-aligned addresses of every device allocator and pinned-memory adaptor, one table for the process:
/// memory may be freed through another allocator (a graph pool's) or adaptor than the one that handed it out.
GPUKIT_EXPORT GPUKIT_INLINE aligned_offsets& over_aligned_addresses();

/// `bytes` at an `alignment` boundary above the allocator's `natural` alignment: a block `alignment - natural`
/// bytes larger from `allocate_block(size)`, whose first `alignment` boundary is returned and, when it is not the
/// block's start, remembered in over_aligned_addresses() (so any allocator that could free the block frees it).
/// Should remembering fail, the block goes back through `free_block(block)` and the error propagates. An
/// out_of_memory_error for the block is thrown again with the caller's request and alignment in front of its message.
template <class AllocateBlock, class FreeBlock>
void* allocate_over_aligned(std::size_t bytes, std::size_t alignment, std::size_t natural, const char* who,
                            AllocateBlock&& allocate_block, FreeBlock&& free_block) {
  const std::size_t request = over_aligned_request(bytes, alignment, natural, who);
  void* block = nullptr;
  try {
    block = allocate_block(request);
  } catch (const out_of_memory_error& e) {
    // The allocator's message (and its observers) name the padded block it was asked for: say what the caller asked.
    throw out_of_memory_error(std::string(who) + "(" + std::to_string(bytes) + " bytes aligned to " +
                                  std::to_string(alignment) + ") asked for a block of " + std::to_string(request) +
                                  " bytes, for the alignment: " + e.what(),
                              e.cuda_result(), std::string(e.call()), e.device(), e.file(), e.line());
  }
  void* aligned = aligned_offsets::align_up(block, alignment);
  if (aligned == block) return block;
  try {
    over_aligned_addresses().add(aligned, block);
  } catch (...) {
    try {
      free_block(block);
    } catch (...) {
      // Just handed out, with no other stream recorded: its free is not refused; the first error is reported.
    }
    throw;
  }
  return aligned;
}

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE void require_power_of_two_alignment(std::size_t alignment, const char* who) {
  if (is_power_of_two(alignment)) return;
  throw invalid_argument_error(std::string(who) + ": the alignment must be a power of two, not " +
                               std::to_string(alignment));
}

GPUKIT_INLINE std::size_t over_aligned_request(std::size_t bytes, std::size_t alignment, std::size_t natural,
                                               const char* who) {
  const std::size_t extra = alignment - natural;
  if (bytes > std::numeric_limits<std::size_t>::max() - extra) {
    throw invalid_argument_error(std::string(who) + ": " + std::to_string(bytes) + " bytes aligned to " +
                                 std::to_string(alignment) + " overflow");
  }
  return bytes + extra;
}

GPUKIT_INLINE void* aligned_offsets::align_up(void* block, std::size_t alignment) noexcept {
  const auto address = reinterpret_cast<std::uintptr_t>(block);
  return reinterpret_cast<void*>((address + alignment - 1) & ~(static_cast<std::uintptr_t>(alignment) - 1));
}

GPUKIT_INLINE void aligned_offsets::add(void* aligned, void* block) {
  shard& s = shard_of(aligned);
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = find_in(s.entries, aligned);
  if (it != s.entries.end() && it->aligned == aligned) {
    it->block = block;
  } else {
    s.entries.insert(it, entry{aligned, block});
  }
  s.size.store(s.entries.size(), std::memory_order_relaxed);
}

GPUKIT_INLINE void aligned_offsets::rethrow_naming(const void* p, const void* block) {
  try {
    throw;
  } catch (const invalid_argument_error& e) {
    throw invalid_argument_error(std::string(e.what()) + " (" + format_pointer(block) +
                                     " is the start of the block holding the over-aligned address " +
                                     format_pointer(p) + " that was freed)",
                                 e.cuda_result(), std::string(e.call()), e.device(), e.file(), e.line());
  }
}

GPUKIT_INLINE void* aligned_offsets::block_of(const void* p) noexcept {
  void* block = find(p);
  return block == nullptr ? const_cast<void*>(p) : block;
}

GPUKIT_INLINE void* aligned_offsets::find(const void* p) noexcept {
  if (p == nullptr) return nullptr;
  shard& s = shard_of(p);
  if (s.size.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = find_in(s.entries, p);
  if (it == s.entries.end() || it->aligned != p) return nullptr;
  return it->block;
}

GPUKIT_INLINE void aligned_offsets::erase(const void* aligned) noexcept {
  if (aligned == nullptr) return;
  shard& s = shard_of(aligned);
  if (s.size.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto it = find_in(s.entries, aligned);
  if (it != s.entries.end() && it->aligned == aligned) s.entries.erase(it);
  s.size.store(s.entries.size(), std::memory_order_relaxed);
}

GPUKIT_INLINE void aligned_offsets::erase_range(const void* begin, std::size_t bytes) noexcept {
  // After the first byte: an address a resource handed out lies strictly inside one of its blocks, while the first
  // byte may be another resource's over-aligned address (memory a parent handed out over-aligned, kept by it).
  const auto first = reinterpret_cast<std::uintptr_t>(begin);
  const std::uintptr_t room = std::numeric_limits<std::uintptr_t>::max() - first;
  if (bytes <= 1 || room == 0) return;
  const void* from = reinterpret_cast<const void*>(first + 1);
  const void* end = reinterpret_cast<const void*>(bytes > room ? first + room : first + bytes);  // saturated
  for (shard& s : shards_) {  // a range spans every shard: 64 relaxed loads while they are empty
    if (s.size.load(std::memory_order_relaxed) == 0) continue;
    std::lock_guard<std::mutex> lock(s.mutex);
    s.entries.erase(find_in(s.entries, from), find_in(s.entries, end));
    s.size.store(s.entries.size(), std::memory_order_relaxed);
  }
}

GPUKIT_INLINE aligned_offsets::shard& aligned_offsets::shard_of(const void* p) noexcept {
  // Aligned addresses are multiples of at least 512: the bits above those pick the shard.
  return shards_[(reinterpret_cast<std::uintptr_t>(p) >> 9) % shard_count];
}

GPUKIT_INLINE std::vector<aligned_offsets::entry>::iterator aligned_offsets::find_in(std::vector<entry>& entries,
                                                                                     const void* p) {
  const auto below = [](const entry& e, std::uintptr_t key) {
    return reinterpret_cast<std::uintptr_t>(e.aligned) < key;
  };
  return std::lower_bound(entries.begin(), entries.end(), reinterpret_cast<std::uintptr_t>(p), below);
}

GPUKIT_INLINE aligned_offsets& over_aligned_addresses() {
  static aligned_offsets* table = new aligned_offsets();  // never destroyed: frees may come during exit
  return *table;
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
