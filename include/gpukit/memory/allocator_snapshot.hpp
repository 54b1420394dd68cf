// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A snapshot of a caching allocator's segments and blocks (like torch.cuda.memory_snapshot()), taken atomically
/// under the allocator's lock together with its statistics. It is what a user inspects to understand where reserved
/// memory went, and what gpukit's tests check the allocator's invariants against.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/memory/allocator_stats.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// What a block is doing.
enum class block_state : unsigned char {
  free,       ///< cached, reusable on its stream (or, with cross-stream reuse, on any)
  allocated,  ///< handed out to a user
  pending,    ///< freed, but waits for work of other streams (record_stream) before it can be reused
  cached,     ///< freed on its own stream and kept for that stream's next request of its size (front cache);
              ///< the heap takes it back (coalescing it) before it grows or releases memory
};

/// One block of a segment.
struct block_info {
  std::uintptr_t address = 0;             ///< where the block starts
  std::size_t size = 0;                   ///< bytes the block spans (rounded)
  std::size_t requested = 0;              ///< bytes the user asked for; 0 unless allocated
  block_state state = block_state::free;  ///< what the block is doing
  std::uintptr_t stream = 0;              ///< the stream the block belongs to (the stream ops' key)
  std::uint32_t pending_events = 0;       ///< events still awaited (pending blocks)
};

/// One segment obtained from the upstream, with its blocks in address order (they tile the segment exactly).
struct segment_info {
  std::uintptr_t address = 0;  ///< where the segment starts (as the upstream returned it, or reserved it if expandable)
  std::size_t size = 0;        ///< bytes of address space (of an expandable segment: its reserved virtual range)
  std::size_t mapped = 0;      ///< bytes backed by device memory (reserved_bytes counts these): size, unless expandable
  bool expandable = false;     ///< a virtual range whose pages are mapped as blocks need them (expandable_segments)
  /// Expandable segments: the mapped runs of pages as (address, bytes), in address order (their sum is `mapped`).
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped_ranges;
  bool small_pool = false;         ///< a segment of the small pool (requests up to allocator_options::small_size)
  std::vector<block_info> blocks;  ///< the segment's blocks, in address order
};

/// Every segment (in address order) and the statistics, taken together.
struct allocator_snapshot {
  gpukit::device device{};              ///< the device of the allocator
  std::vector<segment_info> segments;   ///< every segment, sorted by address
  allocator_stats stats;                ///< the statistics at the moment of the snapshot
  std::size_t pointer_map_entries = 0;  ///< allocations the pointer map knows (equals allocated blocks when quiet)
};

GPUKIT_END_NAMESPACE
