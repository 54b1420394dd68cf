// Randomized operation sequences through the caching allocator engine (fixed seeds, thousands of operations), with
// every invariant checked after every step (every 8th under the sanitizers: see check_every): blocks tile their
// segments, no two live allocations overlap, every live allocation is an allocated block inside a reserved segment,
// free neighbours of one stream are coalesced, the statistics equal the sums recomputed from the blocks, reserved
// memory respects the limit; and after everything is freed and the cache emptied, nothing is reserved.
#include "allocator_support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

using namespace gpukit_test;

namespace {

// Steps between two full invariant checks (a snapshot of every block): each step in the plain build; every 8th
// under the sanitizers, which would otherwise spend minutes instrumenting the checker rather than the allocator
// (the operations are the same, and the final check after everything is freed still runs).
constexpr int check_every = sanitized_build ? 8 : 1;

struct scenario {
  std::string name;
  gpukit::allocator_options options;
  std::size_t capacity;
};

std::vector<scenario> scenarios() {
  std::vector<scenario> list;
  list.push_back({"default", gpukit::allocator_options{}, 768 * MiB});
  list.push_back({"pytorch", gpukit::allocator_options::pytorch(), 768 * MiB});
  gpukit::allocator_options cross;
  cross.cross_stream_reuse = true;
  list.push_back({"cross-stream reuse", cross, 768 * MiB});
  gpukit::allocator_options tight;
  tight.rounding = 256;
  tight.max_split_size = 16 * MiB;
  tight.max_oversize_waste = 4 * MiB;
  tight.reserved_limit = 200 * MiB;
  list.push_back({"rounding 256, max_split 16 MiB, limit 200 MiB", tight, 400 * MiB});
  // reuse_before_release needs segments made for one request (medium_size or more) that max_split_size keeps whole.
  gpukit::allocator_options reuse = tight;
  reuse.medium_size = 8 * MiB;
  reuse.reuse_before_release = true;
  list.push_back({"reuse before release, medium 8 MiB, limit 200 MiB", reuse, 400 * MiB});
  reuse.reserved_limit = gpukit::allocator_options::unlimited;
  list.push_back({"reuse before release, medium 8 MiB, 160 MiB upstream", reuse, 160 * MiB});
  gpukit::allocator_options small_segments;
  small_segments.small_size = 64 * KiB;
  small_segments.small_segment_size = 256 * KiB;
  small_segments.medium_size = 4 * MiB;
  small_segments.medium_segment_size = 8 * MiB;
  small_segments.large_split_threshold = 64 * KiB;
  list.push_back({"small segments", small_segments, 256 * MiB});
  gpukit::allocator_options expandable;
  expandable.expandable_segments = true;
  list.push_back({"expandable segments", expandable, 768 * MiB});
  gpukit::allocator_options expandable_limited = expandable;
  expandable_limited.reserved_limit = 200 * MiB;
  list.push_back({"expandable segments, limit 200 MiB", expandable_limited, 400 * MiB});
  gpukit::allocator_options expandable_cross = expandable;  // blocks move between streams' ranges
  expandable_cross.cross_stream_reuse = true;
  list.push_back({"expandable segments, cross-stream reuse", expandable_cross, 768 * MiB});
  return list;
}

std::size_t random_size(std::mt19937_64& rng, const gpukit::allocator_options& o) {
  std::uniform_int_distribution<int> kind(0, 99);
  const int k = kind(rng);
  auto uniform = [&rng](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  if (k < 35) return uniform(1, 4 * KiB);
  if (k < 60) return uniform(4 * KiB, o.small_size);
  if (k < 70) {  // rounding and pool boundaries
    const std::size_t anchors[] = {o.rounding, o.small_size, o.medium_size, o.small_segment_size};
    const std::size_t a = anchors[uniform(0, 3)];
    return a - 1 + uniform(0, 2);
  }
  if (k < 90) return uniform(o.small_size, 12 * MiB);
  return uniform(12 * MiB, 48 * MiB);
}

void run(const scenario& sc, std::uint64_t seed, int steps) {
  fake_world world;
  const int streams = 3;
  for (int i = 0; i < streams; ++i) world.add_stream();
  fake_allocator a(gpukit::device::cpu(), sc.options, sc.capacity);
  a.stream_operations().world = &world;
  std::mt19937_64 rng(seed);
  std::vector<live_allocation> live;
  std::vector<int> live_stream;
  int ooms = 0;
  std::size_t previous_reserved = 0;
  auto pick = [&rng](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  for (int step = 0; step < steps; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 999)(rng);
    const fake_stream s{static_cast<int>(pick(streams))};
    if (op < 480) {
      const std::size_t bytes = random_size(rng, sc.options);
      try {
        void* p = a.allocate(bytes, s);
        live.push_back({reinterpret_cast<std::uintptr_t>(p), bytes});
        live_stream.push_back(s.id);
      } catch (const gpukit::out_of_memory_error&) {
        ++ooms;
      }
    } else if (op < 830) {
      if (!live.empty()) {
        const std::size_t i = pick(live.size());
        void* p = reinterpret_cast<void*>(live[i].address);
        if (op < 780) {
          a.deallocate(p);
        } else {
          a.deallocate(p, s);  // last used on s
        }
        live[i] = live.back();
        live.pop_back();
        live_stream[i] = live_stream.back();
        live_stream.pop_back();
      }
    } else if (op < 880) {
      if (!live.empty()) a.record_stream(reinterpret_cast<void*>(live[pick(live.size())].address), s);
    } else if (op < 940) {
      world.enqueue(s.id, 1 + pick(3));
    } else if (op < 985) {
      world.complete(s.id);
    } else if (op < 990) {
      a.empty_cache();
    } else if (op < 994) {
      (void)a.trim(pick(256) * MiB);
    } else if (op < 997) {
      if (sc.options.reserved_limit == gpukit::allocator_options::unlimited) {
        a.set_reserved_limit(pick(2) == 0 ? gpukit::allocator_options::unlimited : (128 + pick(512)) * MiB);
      }
    } else {
      a.reset_peak_stats();
    }
    // A limit lowered below memory in use cannot be met at once; the allocator must then only shrink.
    const auto stats = a.stats();
    const auto reserved = static_cast<std::size_t>(stats.reserved_bytes.all().current);
    std::string problem;
    if (step % check_every == 0 || step + 1 == steps) {
      problem = check_invariants(a.snapshot(), live, sc.options.rounding, true, false);
    }
    if (problem.empty() && reserved > stats.reserved_limit && reserved > previous_reserved) {
      problem = "reserved memory grew beyond the limit";
    }
    previous_reserved = reserved;
    if (!problem.empty()) {
      FAIL_CHECK(sc.name << ", seed " << seed << ", step " << step << " (operation " << op << "): " << problem);
      return;
    }
    for (const auto* st : {&stats.allocation, &stats.allocated_bytes, &stats.segment, &stats.reserved_bytes}) {
      if (st->all().allocated - st->all().freed != st->all().current) {
        FAIL_CHECK(sc.name << ", seed " << seed << ", step " << step << ": cumulative totals disagree with current");
        return;
      }
    }
  }
  INFO(sc.name << ", seed " << seed);
  const auto before = a.stats();
  CHECK(before.num_ooms == ooms);
  for (const auto& l : live) a.deallocate(reinterpret_cast<void*>(l.address));
  live.clear();
  a.empty_cache();  // waits for the events of streams that still "run"
  const auto snapshot = a.snapshot();
  CHECK(check_invariants(snapshot, live, sc.options.rounding) == "");
  CHECK(snapshot.segments.empty());
  CHECK(a.memory_reserved() == 0);
  CHECK(a.memory_allocated() == 0);
  CHECK(a.stats().active.all().current == 0);
  CHECK(a.upstream().used() == 0);
  CHECK(a.stats().num_device_alloc == a.stats().num_device_free);
  std::printf("%-48s seed %llu: %d steps, %lld upstream allocations, %d OOMs, peak reserved %zu MiB\n", sc.name.c_str(),
              static_cast<unsigned long long>(seed), steps, static_cast<long long>(before.num_device_alloc), ooms,
              a.max_memory_reserved() >> 20);
}

}  // namespace

TEST_CASE("randomized operation sequences keep every invariant after every step") {
  for (const auto& sc : scenarios()) {
    for (std::uint64_t seed : {1u, 2u, 3u}) run(sc, seed, 3000);
  }
}

TEST_CASE("a long randomized sequence keeps every invariant") { run(scenarios()[0], 12345, 20000); }

namespace {

/// Like run(), with streams destroyed and replaced as a server does: blocks of destroyed streams must wait for their
/// work, then serve any stream; frees of allocations that outlived their stream are reported; the allocator's
/// stream registry stays bounded; no event is ever recorded on a destroyed stream (the fake throws).
void run_with_stream_churn(const scenario& sc, std::uint64_t seed, int steps) {
  fake_world world;
  std::vector<int> current;  // the 3 live streams' ids
  for (int i = 0; i < 3; ++i) current.push_back(world.add_stream());
  fake_allocator a(gpukit::device::cpu(), sc.options, sc.capacity);
  a.stream_operations().world = &world;
  std::mt19937_64 rng(seed);
  std::vector<live_allocation> live;
  captured_warnings warnings;
  std::size_t outlived = 0;  // frees of allocations whose stream had been destroyed
  std::vector<int> live_stream;
  auto pick = [&rng](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  auto remove_live = [&](std::size_t i) {
    if (world.streams[static_cast<std::size_t>(live_stream[i])].destroyed) ++outlived;
    live[i] = live.back();
    live.pop_back();
    live_stream[i] = live_stream.back();
    live_stream.pop_back();
  };
  for (int step = 0; step < steps; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 999)(rng);
    const int slot = static_cast<int>(pick(current.size()));
    const fake_stream s{current[static_cast<std::size_t>(slot)]};
    try {
      if (op < 450) {
        void* p = a.allocate(random_size(rng, sc.options), s);
        live.push_back({reinterpret_cast<std::uintptr_t>(p), a.allocation_size(p)});
        live_stream.push_back(s.id);
      } else if (op < 800) {
        if (!live.empty()) {
          const std::size_t i = pick(live.size());
          if (op < 760) {
            a.deallocate(reinterpret_cast<void*>(live[i].address));
          } else {
            a.deallocate(reinterpret_cast<void*>(live[i].address), s);
          }
          remove_live(i);
        }
      } else if (op < 850) {
        if (!live.empty()) a.record_stream(reinterpret_cast<void*>(live[pick(live.size())].address), s);
      } else if (op < 910) {
        world.enqueue(s.id, 1 + pick(3));
      } else if (op < 950) {
        world.complete(static_cast<int>(pick(world.streams.size())));  // destroyed streams' work completes too
      } else if (op < 985) {
        world.destroy(s.id);  // with work pending, cached blocks and live allocations, as it may be
        current[static_cast<std::size_t>(slot)] = world.add_stream();
      } else if (op < 990) {
        a.empty_cache();
      } else {
        (void)a.trim(pick(256) * MiB);
      }
    } catch (const gpukit::out_of_memory_error&) {
    }
    const bool check = step % check_every == 0 || step + 1 == steps;
    const std::string problem = check ? check_invariants(a.snapshot(), live, sc.options.rounding, true, false) : "";
    if (!problem.empty()) {
      FAIL_CHECK(sc.name << " with stream churn, seed " << seed << ", step " << step << " (operation " << op
                         << "): " << problem);
      return;
    }
    if (a.stream_count() > 128 + 3) {
      FAIL_CHECK(sc.name << " with stream churn, seed " << seed << ", step " << step << ": " << a.stream_count()
                         << " stream states kept for " << world.streams.size() << " streams created");
      return;
    }
  }
  INFO(sc.name << " with stream churn, seed " << seed);
  while (!live.empty()) {
    a.deallocate(reinterpret_cast<void*>(live.back().address));
    remove_live(live.size() - 1);
  }
  std::size_t reported = 0;
  for (const auto& m : warnings.messages()) {
    if (m.find("was destroyed while the allocation was live") != std::string::npos) ++reported;
  }
  CHECK(reported == outlived);
  a.empty_cache();  // waits for pending events and for destroyed streams' last work
  const auto snapshot = a.snapshot();
  CHECK(check_invariants(snapshot, live, sc.options.rounding) == "");
  CHECK(snapshot.segments.empty());
  CHECK(a.memory_reserved() == 0);
  CHECK(a.upstream().used() == 0);
  std::printf(
      "%-48s seed %llu with stream churn: %zu streams created, %zu frees after their stream was destroyed, "
      "%zu stream states kept\n",
      sc.name.c_str(), static_cast<unsigned long long>(seed), world.streams.size(), outlived, a.stream_count());
}

}  // namespace

TEST_CASE("randomized sequences with streams destroyed and replaced keep every invariant") {
  for (const auto& sc : scenarios()) {
    for (std::uint64_t seed : {1u, 2u, 3u}) run_with_stream_churn(sc, seed, 3000);
  }
}

namespace {

/// Every statistic read after every step of a single-threaded sequence: each peak is the largest value read since
/// its reset, each pair of totals moves with its value, and no total is negative or goes back.
struct total_tracker {
  static constexpr std::size_t count = 9;
  std::array<std::array<gpukit::stat, 3>, count> last{};
  std::array<std::array<std::int64_t, 3>, count> max{}, base{};  // base: the value at the last reset of the totals
  static std::array<const gpukit::pool_stats*, count> of(const gpukit::allocator_stats& s) {
    return {&s.allocation,      &s.segment,        &s.active,       &s.inactive_split,
            &s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
            &s.requested_bytes};
  }
  void reset(const gpukit::allocator_stats& s, bool peaks, bool totals) {
    for (std::size_t k = 0; k < count; ++k) {
      for (std::size_t p = 0; p < 3; ++p) {
        const gpukit::stat& x = of(s)[k]->pools[p];
        if (peaks) max[k][p] = x.current;
        if (totals) base[k][p] = x.current;
        last[k][p] = x;
      }
    }
  }
  std::string step(const gpukit::allocator_stats& s) {
    for (std::size_t k = 0; k < count; ++k) {
      for (std::size_t p = 0; p < 3; ++p) {
        const gpukit::stat& x = of(s)[k]->pools[p];
        const std::string where = "statistic " + std::to_string(k) + " pool " + std::to_string(p) + ": ";
        max[k][p] = std::max(max[k][p], x.current);
        if (x.peak != max[k][p])
          return where + "peak " + std::to_string(x.peak) + ", seen " + std::to_string(max[k][p]);
        if (x.allocated - x.freed != x.current - base[k][p]) return where + "totals do not move with the value";
        if (x.allocated < last[k][p].allocated || x.freed < last[k][p].freed) return where + "a total went back";
        if (x.allocated < 0 || x.freed < 0) return where + "negative total";
        last[k][p] = x;
      }
    }
    return "";
  }
};

}  // namespace

TEST_CASE("randomized sequences with resets, flushes and trims keep every peak and total consistent") {
  // Front caches off, small, small and large; expandable segments.
  for (int mode = 0; mode < 4; ++mode) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      gpukit::allocator_options o;
      o.front_cache = mode != 0;
      o.front_cache_large = mode == 2;
      o.expandable_segments = mode == 3;
      fake_setup f(o, 4 * GiB);
      const fake_stream streams[] = {f.add_stream(), f.add_stream(), f.add_stream()};
      std::mt19937_64 rng(seed);
      std::vector<void*> held;
      total_tracker t;
      const std::size_t sizes[] = {512, 1000, 4096, 70 * KiB, 300 * KiB, 1 * MiB, 3 * MiB, 24 * MiB};
      std::string problem;
      int step = 0;
      for (; step < 3000 && problem.empty(); ++step) {
        const auto r = rng() % 1000;
        if (r < 5) {
          f.a.reset_peak_stats();
          t.reset(f.a.stats(), true, false);
        } else if (r < 10) {
          f.a.reset_accumulated_stats();
          t.reset(f.a.stats(), false, true);
        } else if (r < 15) {
          f.a.empty_cache();
        } else if (r < 20) {
          (void)f.a.trim(f.a.memory_reserved() / 2);
        } else if (held.empty() || (held.size() < 150 && r < 560)) {
          held.push_back(f.a.allocate(sizes[rng() % 8] - (rng() % 2) * 100, streams[rng() % 3]));
        } else {
          const std::size_t i = rng() % held.size();
          f.a.deallocate(held[i]);
          held[i] = held.back();
          held.pop_back();
        }
        problem = t.step(f.a.stats());
      }
      INFO("mode " << mode << ", seed " << seed << ", step " << step);
      CHECK(problem == "");
      for (void* p : held) f.a.deallocate(p);
    }
  }
}
