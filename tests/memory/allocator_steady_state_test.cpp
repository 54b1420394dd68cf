// Steady state (issue 9): once a workload whose live set fits has warmed up, the allocator makes no upstream free:
// every cudaFree drains the device. Upstream frees happen only under pressure (a refused upstream allocation, the
// reserved limit), when asked for (empty_cache, trim, a lower limit), or when opted into (release_before_grow,
// counted as num_device_free_unforced).
#include "allocator_support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <cstdint>
#include <deque>
#include <random>
#include <utility>
#include <vector>

using namespace gpukit_test;

namespace {

struct upstream_calls {
  std::int64_t allocs = 0, frees = 0, unforced = 0;
};
upstream_calls calls_of(const fake_allocator& a) {
  const auto s = a.stats();
  return {s.num_device_alloc, s.num_device_free, s.num_device_free_unforced};
}

/// One stream, at most `live_bytes` live, `count` allocations of sizes uniform in [1 KiB, max_size]; the oldest
/// allocation is freed first. Returns the upstream calls after the first tenth (warm-up) of the allocations.
upstream_calls churn(const gpukit::allocator_options& options, std::size_t max_size, std::size_t live_bytes,
                     int count) {
  fake_setup setup(options);
  fake_allocator& a = setup.a;
  const fake_stream s = setup.add_stream();
  std::mt19937_64 rng(2024);
  std::uniform_int_distribution<std::size_t> size(KiB, max_size);
  std::deque<std::pair<void*, std::size_t>> live;
  std::size_t bytes = 0;
  upstream_calls warm;
  for (int i = 0; i < count; ++i) {
    if (i == count / 10) warm = calls_of(a);
    const std::size_t n = size(rng);
    while (bytes + n > live_bytes && !live.empty()) {
      a.deallocate(live.front().first);
      bytes -= live.front().second;
      live.pop_front();
    }
    live.emplace_back(a.allocate(n, s), n);
    bytes += n;
  }
  for (const auto& l : live) a.deallocate(l.first);
  const upstream_calls end = calls_of(a);
  return {end.allocs - warm.allocs, end.frees - warm.frees, end.unforced - warm.unforced};
}

/// An inference server: 3 streams, each request allocates a few buffers of varied sizes on its stream (input,
/// activations, output), its work runs, and it frees them. Returns the upstream calls after the first 300 requests.
upstream_calls server(const gpukit::allocator_options& options, int requests) {
  fake_setup setup(options);
  fake_allocator& a = setup.a;
  fake_world& world = setup.world;
  const fake_stream streams[] = {setup.add_stream(), setup.add_stream(), setup.add_stream()};
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> input(4 * KiB, 2 * MiB), activation(MiB, 48 * MiB), output(KiB, 256 * KiB);
  std::vector<void*> held;
  upstream_calls warm;
  for (int r = 0; r < requests; ++r) {
    if (r == 300) warm = calls_of(a);
    const fake_stream s = streams[r % 3];
    held = {a.allocate(input(rng), s), a.allocate(activation(rng), s), a.allocate(activation(rng), s),
            a.allocate(output(rng), s)};
    world.enqueue(s.id);
    for (void* p : held) a.deallocate(p);
    if (r % 7 == 0) world.complete_all();
  }
  const upstream_calls end = calls_of(a);
  return {end.allocs - warm.allocs, end.frees - warm.frees, end.unforced - warm.unforced};
}

}  // namespace

TEST_CASE("steady state: a churning stream makes no upstream free after warm-up, with gpukit's defaults") {
  for (const std::size_t max_size : {1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB}) {
    CAPTURE(max_size);
    const upstream_calls defaults = churn(gpukit::allocator_options{}, max_size, 4 * MiB, 4000);
    CHECK(defaults.frees == 0);
    CHECK(defaults.unforced == 0);
    CHECK(defaults.allocs <= 2);  // the cache is warm: a new size at most
    const upstream_calls pytorch = churn(gpukit::allocator_options::pytorch(), max_size, 4 * MiB, 4000);
    CHECK(pytorch.frees == 0);
  }
}

TEST_CASE("steady state: an inference server on three streams makes no upstream free after warm-up") {
  const upstream_calls defaults = server(gpukit::allocator_options{}, 3000);
  CHECK(defaults.frees == 0);
  CHECK(defaults.unforced == 0);
  CHECK(defaults.allocs <= 3);
  CHECK(server(gpukit::allocator_options::pytorch(), 3000).frees == 0);
}

TEST_CASE("steady state: release_before_grow trades upstream frees for footprint, and they are counted") {
  // The server's activations drift in size: with release_before_grow, free segments that cannot serve a larger
  // one are given back, each an unforced upstream free.
  gpukit::allocator_options o;
  o.release_before_grow = true;
  const upstream_calls releasing = server(o, 3000);
  CHECK(releasing.unforced > 0);
  CHECK(releasing.frees == releasing.unforced);
}

TEST_CASE("steady state: under stream churn, the cache of abandoned streams is released before the footprint grows") {
  // Streams the allocator cannot see destroyed (raw handles; fake streams here): each of 1000 allocates once.
  fake_setup setup;
  fake_allocator& a = setup.a;
  const fake_stream busy = setup.add_stream();  // allocates all along: never abandoned
  void* kept = a.allocate(MiB, busy);
  for (int i = 0; i < 1000; ++i) {
    const fake_stream s = setup.add_stream();
    a.deallocate(a.allocate(64 * KiB, s));
    a.deallocate(a.allocate(64 * KiB, busy));
  }
  CHECK(a.stream_count() <= 128);
  CHECK(a.memory_reserved() <= 128 * 2 * MiB);  // at most two sweep periods of small segments
  const auto s = a.stats();
  CHECK(s.num_device_free > 0);
  CHECK(s.num_device_free == s.num_device_free_unforced);
  CHECK(a.owns(kept));  // the busy stream's memory was never touched
  a.deallocate(kept);
  CHECK(check_invariants(a.snapshot(), {}, a.options().rounding) == "");
}
