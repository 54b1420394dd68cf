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
#include <gpukit/memory/memory_history.hpp>

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
  std::size_t requested = 0;              ///< bytes the user asked for; 0 unless allocated or pending
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
  /// The `snapshot` event the allocator recorded for this snapshot in the history attached then
  /// (memory_history::record_snapshot); history_id 0 when none was attached. The exports end the history's trace
  /// at exactly this event.
  memory_history_position history_position;
};

namespace detail {

/// Where `snapshot`'s own `snapshot` event is among a history's `contents` (memory_history::contents()).
struct snapshot_event_place {
  enum kind_type {
    unknown,  ///< the snapshot was taken with no history attached, with another one, or before a clear()
    held,     ///< contents.events[index] is the event
    dropped,  ///< the history recorded it but holds it no longer (the ring dropped it) or never could (no memory)
  } kind = unknown;
  std::size_t index = 0;
};

inline snapshot_event_place find_snapshot_event(const allocator_snapshot& snapshot,
                                                const memory_history_contents& contents) noexcept {
  const memory_history_position& p = snapshot.history_position;
  snapshot_event_place place;
  if (p.history_id == 0 || p.history_id != contents.history_id || p.recorded > contents.recorded) return place;
  if (p.recorded <= contents.dropped) {
    place.kind = snapshot_event_place::dropped;
    return place;
  }
  place.index = p.recorded - contents.dropped - 1;
  place.kind = contents.events[place.index].action == memory_action::snapshot ? snapshot_event_place::held
                                                                              : snapshot_event_place::unknown;
  return place;
}

}  // namespace detail

GPUKIT_END_NAMESPACE
