// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Over-aligned allocations: an allocator whose blocks have a natural alignment serves a larger one by allocating
/// `alignment - natural` more bytes and handing out the first aligned address inside. This table remembers, for
/// each such address that is not the block's start, the block's start, so that frees and queries reach the
/// allocator with the pointer it handed out. Empty (one relaxed load per lookup) until an over-aligned request
/// lands off its block's start.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Throws invalid_argument_error (naming `who`) unless `alignment` is a power of two.
inline void require_power_of_two_alignment(std::size_t alignment, const char* who) {
  if (alignment != 0 && (alignment & (alignment - 1)) == 0) return;
  throw invalid_argument_error(std::string(who) + ": the alignment must be a power of two, not " +
                               std::to_string(alignment));
}

/// The bytes to ask for so that a block of natural alignment `natural` holds `bytes` at an `alignment` boundary;
/// throws invalid_argument_error (naming `who`) when that overflows.
inline std::size_t over_aligned_request(std::size_t bytes, std::size_t alignment, std::size_t natural,
                                        const char* who) {
  const std::size_t extra = alignment - natural;
  if (bytes > std::numeric_limits<std::size_t>::max() - extra) {
    throw invalid_argument_error(std::string(who) + ": " + std::to_string(bytes) + " bytes aligned to " +
                                 std::to_string(alignment) + " overflow");
  }
  return bytes + extra;
}

/// Aligned address → start of the block it lies in, for over-aligned allocations. Thread-safe. Copying gives an
/// empty table (an allocator's copy owns none of the original's blocks).
class aligned_offsets {
 public:
  aligned_offsets() = default;
  aligned_offsets(const aligned_offsets& /*other*/) noexcept {}
  aligned_offsets& operator=(const aligned_offsets& /*other*/) noexcept { return *this; }

  /// The first `alignment` boundary at or after `block`.
  static void* align_up(void* block, std::size_t alignment) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(block);
    return reinterpret_cast<void*>((address + alignment - 1) & ~(static_cast<std::uintptr_t>(alignment) - 1));
  }

  /// Remembers that `aligned` lies in the block starting at `block` (aligned != block).
  void add(void* aligned, void* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = find_in(blocks_, aligned);
    if (it != blocks_.end() && it->first == aligned) {
      it->second = block;
    } else {
      blocks_.insert(it, {aligned, block});
    }
    size_.store(blocks_.size(), std::memory_order_relaxed);
  }

  /// The block start behind `p`, or `p` itself when it is not an over-aligned address (or is null).
  void* block_of(const void* p) const noexcept {
    if (p == nullptr || size_.load(std::memory_order_relaxed) == 0) return const_cast<void*>(p);
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = find_in(blocks_, p);
    return it == blocks_.end() || it->first != p ? const_cast<void*>(p) : it->second;
  }

  /// Frees `p` with `free_block(block start)`. The address is forgotten before the block is freed (once free, the
  /// block and so the same aligned address may be handed out again at once) and remembered again if the free
  /// throws (the allocation is still live).
  template <class FreeBlock>
  void free_with(void* p, FreeBlock&& free_block) {
    void* block = block_of(p);
    if (block == p) return free_block(p);
    erase(p);
    try {
      free_block(block);
    } catch (...) {
      add(p, block);
      throw;
    }
  }

  /// Forgets `aligned`; nothing when it is not in the table.
  void erase(const void* aligned) noexcept {
    if (aligned == nullptr || size_.load(std::memory_order_relaxed) == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = find_in(blocks_, aligned);
    if (it != blocks_.end() && it->first == aligned) blocks_.erase(it);
    size_.store(blocks_.size(), std::memory_order_relaxed);
  }

 private:
  using entry = std::pair<const void*, void*>;

  /// The first entry whose address is not below `p` (the entries are sorted by address; caller holds mutex_).
  template <class Entries>
  static auto find_in(Entries& entries, const void* p) -> decltype(entries.begin()) {
    const auto below = [](const entry& e, std::uintptr_t key) {
      return reinterpret_cast<std::uintptr_t>(e.first) < key;
    };
    return std::lower_bound(entries.begin(), entries.end(), reinterpret_cast<std::uintptr_t>(p), below);
  }

  mutable std::mutex mutex_;
  /// Sorted by aligned address. A vector: over-aligned allocations are few, and it costs no header of its own.
  std::vector<entry> blocks_;
  std::atomic<std::size_t> size_{0};
};

}  // namespace detail
GPUKIT_END_NAMESPACE
