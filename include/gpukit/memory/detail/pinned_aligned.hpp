// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Aligned allocation from a pinned_pool, for the resource adaptors (memory_resource.hpp, pmr.hpp): blocks are
/// 256-byte aligned (pages on the CPU), larger power-of-two alignments are served from a larger block.

#include <gpukit/detail/config.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstddef>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The alignment every pinned_pool block is guaranteed: pages for the CPU, and CUDA promises cudaHostAlloc memory
/// "suitably aligned for any kind of variable" (256 bytes, as for device memory, is what gpukit relies on).
inline constexpr std::size_t pinned_natural_alignment = 256;

/// `bytes` from `pool` aligned to `alignment` (a power of two; `who` names the caller in errors).
template <class Pool>
void* pinned_allocate_aligned(Pool& pool, std::size_t bytes, std::size_t alignment, const char* who) {
  require_power_of_two_alignment(alignment, who);
  if (alignment <= pinned_natural_alignment || bytes == 0) return pool.allocate(bytes);
  return allocate_over_aligned(
      bytes, alignment, pinned_natural_alignment, who, [&pool](std::size_t size) { return pool.allocate(size); },
      [&pool](void* block) { pool.deallocate(block); });
}

/// Gives back what pinned_allocate_aligned returned: at once, or after the work enqueued so far on `*stream`. Never
/// refused for a captured stream (the adaptors' frees are noexcept): the block then waits for the capture to end.
/// A block of the pool starting at an address in the table of over-aligned addresses is that block (a stale entry:
/// see aligned_offsets::block_for). A template for the tests' pools; the adaptors pass a pinned_pool.
template <class Pool>
void pinned_deallocate_aligned(Pool& pool, void* p, const stream_view* stream) {
  const auto owns_block_at = [&pool](const void* q) noexcept { return pool.is_allocated(q); };
  over_aligned_addresses().free_with(p, owns_block_at, [&pool, stream](void* block) {
    if (stream != nullptr) {
      pool.deallocate_after_captures(block, *stream);
    } else {
      pool.deallocate_after_captures(block);
    }
  });
}

}  // namespace detail
GPUKIT_END_NAMESPACE
