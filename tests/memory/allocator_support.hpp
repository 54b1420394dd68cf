// Helpers for the allocator tests: a deterministic fake of streams and events, an invariant checker that
// recomputes every statistic from a snapshot, and a gate that holds CPU streams back.
#pragma once

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>

#include <doctest/doctest.h>

#include "support.hpp"  // gate, captured_warnings

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpukit_test {

/// A world of fake streams whose "work" is a counter: enqueue() adds work, complete() finishes it. Events capture
/// the enqueued count; they are ready once that much work has completed. Everything is deterministic.
struct fake_world {
  struct stream_state {
    std::uint64_t enqueued = 0;
    std::uint64_t completed = 0;
    gpukit::device device = gpukit::device::cpu();
    bool destroyed = false;             // its pending work still completes (CUDA semantics); no new work or events
    std::optional<std::uintptr_t> key;  // the stream ops' key; none: derived from the index (unique, never 0)
  };
  std::vector<stream_state> streams;
  struct wait_record {
    int waiting_stream;
    int event_stream;
    std::uint64_t point;
  };
  std::vector<wait_record> waits;  // every event.wait(stream), in order
  int events_created = 0;
  int synchronizations = 0;
  std::uint64_t destructions = 0;
  // Run once, the next time the allocator asks whether a stream was destroyed, after reading the answer: a test
  // makes something happen between a check and what the allocator does with it (a destruction racing a free).
  std::function<void()> after_expired_query;
  // The same, the next time it asks whether a stream may still have work (may_have_pending_work).
  std::function<void()> after_pending_query;

  int add_stream(gpukit::device d = gpukit::device::cpu()) {
    streams.push_back(stream_state{0, 0, d, false, std::nullopt});
    return static_cast<int>(streams.size()) - 1;
  }
  void enqueue(int s, std::uint64_t n = 1) { streams[static_cast<std::size_t>(s)].enqueued += n; }
  void complete(int s) {
    streams[static_cast<std::size_t>(s)].completed = streams[static_cast<std::size_t>(s)].enqueued;
  }
  void complete_all() {
    for (auto& s : streams) s.completed = s.enqueued;
  }
  /// Destroys stream `s`, as ~gpukit::stream does: ids are never reused, so a "new" stream is add_stream().
  void destroy(int s) {
    streams[static_cast<std::size_t>(s)].destroyed = true;
    ++destructions;
  }
};

struct fake_stream {
  int id = 0;
};

struct fake_event {
  int stream = -1;
  std::uint64_t point = 0;
};

/// Stream ops over a fake_world (set with `world`; the tests own the world).
struct fake_stream_ops {
  using stream_type = fake_stream;
  using event_type = fake_event;
  fake_world* world = nullptr;

  std::uintptr_t key(const fake_stream& s) const noexcept {
    const std::optional<std::uintptr_t>& forced = world->streams[static_cast<std::size_t>(s.id)].key;
    return forced ? *forced : static_cast<std::uintptr_t>(s.id) + 1;
  }
  gpukit::device device_of(const fake_stream& s) const { return world->streams[static_cast<std::size_t>(s.id)].device; }
  fake_event create_event(gpukit::device) const {
    ++world->events_created;
    return fake_event{};
  }
  void record(fake_event& e, const fake_stream& s) const {
    if (world->streams[static_cast<std::size_t>(s.id)].destroyed) {
      throw std::logic_error("fake_stream_ops: an event recorded on destroyed stream " + std::to_string(s.id));
    }
    e.stream = s.id;
    e.point = world->streams[static_cast<std::size_t>(s.id)].enqueued;
  }
  bool ready(const fake_event& e) const {
    return e.stream < 0 || world->streams[static_cast<std::size_t>(e.stream)].completed >= e.point;
  }
  void synchronize(const fake_event& e) const {
    ++world->synchronizations;
    if (e.stream < 0) return;
    auto& s = world->streams[static_cast<std::size_t>(e.stream)];
    s.completed = std::max(s.completed, e.point);
  }
  void wait(const fake_event& e, const fake_stream& s) const {
    world->waits.push_back(fake_world::wait_record{s.id, e.stream, e.point});
  }
  bool may_have_pending_work(const fake_stream& s) const {
    const auto& st = world->streams[static_cast<std::size_t>(s.id)];
    const bool pending = st.completed < st.enqueued;
    if (world->after_pending_query) {
      const std::function<void()> hook = std::move(world->after_pending_query);
      world->after_pending_query = nullptr;
      hook();
    }
    return pending;
  }

  // Lifetimes: every fake stream is tracked, like a gpukit::stream (world.destroy).
  using tracker_type = int;
  int track(const fake_stream& s) const { return s.id; }
  bool expired(int s) const noexcept {
    const bool destroyed = world->streams[static_cast<std::size_t>(s)].destroyed;
    if (world->after_expired_query) {
      const std::function<void()> hook = std::move(world->after_expired_query);
      world->after_expired_query = nullptr;
      hook();
    }
    return destroyed;
  }
  bool finished(int s) const {
    const auto& st = world->streams[static_cast<std::size_t>(s)];
    return st.destroyed && st.completed >= st.enqueued;
  }
  void wait_finished(int s) const {
    ++world->synchronizations;
    world->complete(s);
  }
  std::uint64_t expirations() const noexcept { return world->destructions; }
};

/// The caching allocator on a simulated address space, its streams and events fake_stream_ops's.
using fake_allocator = gpukit::basic_caching_allocator<gpukit::address_space_upstream, fake_stream_ops>;

/// Sums recomputed from a snapshot, per pool (0 all, 1 small, 2 large).
struct recomputed {
  std::array<std::int64_t, 3> allocation{}, segment{}, active{}, inactive_split{}, allocated_bytes{}, reserved_bytes{},
      active_bytes{}, inactive_split_bytes{}, requested_bytes{};
};

inline recomputed recompute(const gpukit::allocator_snapshot& s) {
  recomputed r;
  for (const auto& seg : s.segments) {
    const std::size_t pools[2] = {0, seg.small_pool ? std::size_t{1} : std::size_t{2}};
    const bool split = seg.blocks.size() > 1 && !seg.expandable;  // an expandable one's free pages are releasable
    for (std::size_t p : pools) {
      r.segment[p] += 1;
      r.reserved_bytes[p] += static_cast<std::int64_t>(seg.mapped);
      for (const auto& b : seg.blocks) {
        const auto size = static_cast<std::int64_t>(b.size);
        if (b.state == gpukit::block_state::allocated) {
          r.allocation[p] += 1;
          r.allocated_bytes[p] += size;
          r.requested_bytes[p] += static_cast<std::int64_t>(b.requested);
        }
        if (b.state == gpukit::block_state::allocated || b.state == gpukit::block_state::pending) {
          r.active[p] += 1;
          r.active_bytes[p] += size;
        } else if (split) {
          r.inactive_split[p] += 1;
          r.inactive_split_bytes[p] += size;
        }
      }
    }
  }
  return r;
}

/// A live allocation as the test sees it.
/// Writes `t.tag` into the first and last 8 bytes of block `t` (members p, bytes >= 8, tag), so a block handed out
/// twice, or reused while another thread still uses it, shows as a changed tag.
template <class Tagged>
void write_tag(const Tagged& t) {
  std::memcpy(t.p, &t.tag, 8);
  std::memcpy(t.p + t.bytes - 8, &t.tag, 8);
}
template <class Tagged>
bool tag_intact(const Tagged& t) {
  std::uint64_t head = 0;
  std::uint64_t tail = 0;
  std::memcpy(&head, t.p, 8);
  std::memcpy(&tail, t.p + t.bytes - 8, 8);
  return head == t.tag && tail == t.tag;
}

struct live_allocation {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
};

/// Checks every structural invariant of a snapshot and that the statistics equal the sums recomputed from its
/// blocks. Returns an empty string when all hold, else the first violation (so a failing step can be reported
/// with its seed and index). `live` are the allocations the test holds; `rounding` the allocator's.
inline std::string check_invariants(const gpukit::allocator_snapshot& s, const std::vector<live_allocation>& live,
                                    std::size_t rounding, bool quiet_map = true, bool check_limit = true,
                                    bool check_live = true) {
  using gpukit::block_state;
  std::string problem;
  auto fail = [&problem](const std::string& what) {
    if (problem.empty()) problem = what;
  };
  // Segments: sorted, disjoint; blocks tile each exactly, in address order.
  for (std::size_t i = 0; i < s.segments.size(); ++i) {
    const auto& seg = s.segments[i];
    if (i > 0 && s.segments[i - 1].address + s.segments[i - 1].size > seg.address) fail("segments overlap");
    if (seg.blocks.empty()) fail("segment without blocks");
    std::uintptr_t at = seg.address;
    for (std::size_t j = 0; j < seg.blocks.size(); ++j) {
      const auto& b = seg.blocks[j];
      if (b.address != at) fail("blocks do not tile their segment (gap or overlap)");
      if (b.size == 0 || b.size % rounding != 0) fail("block size is not a positive multiple of the rounding");
      const bool in_use = b.state == block_state::allocated || b.state == block_state::pending;
      if (in_use && (b.requested == 0 || b.requested > b.size)) {
        fail("an allocated or pending block's requested size is not in [1, size]");
      }
      if (!in_use && b.requested != 0) fail("a free block keeps a requested size");
      if ((b.state == block_state::pending) != (b.pending_events > 0)) fail("pending state and event count disagree");
      if (j > 0) {
        const auto& a = seg.blocks[j - 1];
        if (a.state == block_state::free && b.state == block_state::free && a.stream == b.stream) {
          fail("two adjacent free blocks of one stream were not coalesced");
        }
      }
      at += b.size;
    }
    if (at != seg.address + seg.size) fail("blocks do not cover their segment");
  }
  // The test's live allocations: each is an allocated block of the snapshot, at its start, big enough, and they
  // do not overlap one another.
  std::map<std::uintptr_t, const gpukit::block_info*> allocated;
  for (const auto& seg : s.segments) {
    for (const auto& b : seg.blocks) {
      if (b.state == block_state::allocated) allocated[b.address] = &b;
    }
  }
  std::vector<live_allocation> sorted = live;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.address < b.address; });
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const auto it = allocated.find(sorted[i].address);
    if (it == allocated.end()) {
      fail("a live allocation is not an allocated block inside a reserved segment");
      continue;
    }
    if (it->second->size < sorted[i].bytes || it->second->requested != sorted[i].bytes) {
      fail("a live allocation's block has the wrong size");
    }
    if (i > 0 && sorted[i - 1].address + sorted[i - 1].bytes > sorted[i].address) fail("live allocations overlap");
  }
  if (check_live && sorted.size() != allocated.size())
    fail("the allocator has allocated blocks the test does not hold (or fewer)");
  if (quiet_map && s.pointer_map_entries != allocated.size()) fail("pointer map and allocated blocks disagree");
  // Statistics equal the recomputed sums.
  const recomputed r = recompute(s);
  auto compare = [&](const char* name, const gpukit::pool_stats& stat, const std::array<std::int64_t, 3>& expected) {
    for (std::size_t p = 0; p < 3; ++p) {
      const auto& st = stat.pools[p];
      if (st.current != expected[p]) {
        fail(std::string(name) + "[" + std::to_string(p) + "].current is " + std::to_string(st.current) +
             ", recomputed " + std::to_string(expected[p]));
      }
      if (st.peak < st.current) fail(std::string(name) + ": peak below current");
    }
  };
  compare("allocation", s.stats.allocation, r.allocation);
  compare("segment", s.stats.segment, r.segment);
  compare("active", s.stats.active, r.active);
  compare("inactive_split", s.stats.inactive_split, r.inactive_split);
  compare("allocated_bytes", s.stats.allocated_bytes, r.allocated_bytes);
  compare("reserved_bytes", s.stats.reserved_bytes, r.reserved_bytes);
  compare("active_bytes", s.stats.active_bytes, r.active_bytes);
  compare("inactive_split_bytes", s.stats.inactive_split_bytes, r.inactive_split_bytes);
  compare("requested_bytes", s.stats.requested_bytes, r.requested_bytes);
  if (check_limit && static_cast<std::size_t>(s.stats.reserved_bytes.all().current) > s.stats.reserved_limit) {
    fail("reserved bytes exceed the limit");
  }
  return problem;
}

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// A fake allocator on the CPU device wired to a world of its own: where most allocator tests start. The world is
/// declared first so that it outlives the allocator, whose destruction still asks it about streams.
struct fake_setup {
  explicit fake_setup(const gpukit::allocator_options& options = {}, std::size_t capacity = 64 * GiB)
      : a(gpukit::device::cpu(), options, capacity) {
    a.stream_operations().world = &world;
  }
  fake_setup(const fake_setup&) = delete;
  fake_setup& operator=(const fake_setup&) = delete;
  fake_stream add_stream() { return fake_stream{world.add_stream()}; }

  fake_world world;
  fake_allocator a;
};

}  // namespace gpukit_test
