// Concurrent stress: several threads, each with its own CPU stream, allocate, use (through stream work), hand over,
// free, record_stream on each other's streams, read statistics, take snapshots and empty the cache, all at once.
// Every allocation carries a pattern written and checked by stream work, so overlapping blocks or early reuse show
// up as corrupted patterns (and as data races under TSan, or use-after-free under ASan).
#include "allocator_support.hpp"

#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#if defined(__linux__)
#include "host_vm_upstream.hpp"
#endif

using namespace gpukit_test;

namespace {

const gpukit::device cpu = gpukit::device::cpu();

struct tagged {
  unsigned char* p = nullptr;
  std::size_t bytes = 0;
  std::uint64_t tag = 0;
  int stream = 0;  // index of the stream it was allocated on
};

struct shared_state {
  explicit shared_state(int n) {
    for (int i = 0; i < n; ++i) streams.push_back(std::make_unique<gpukit::stream>(cpu));
  }
  std::vector<std::unique_ptr<gpukit::stream>> streams;
  std::mutex handoff_mutex;
  std::vector<tagged> handoff;
  std::atomic<int> corrupted{0};
  std::atomic<int> ooms{0};
};

void worker(gpukit::device_allocator& a, shared_state& shared, int id, int operations, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&rng](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  const gpukit::stream_view own = shared.streams[static_cast<std::size_t>(id)]->view();
  std::vector<tagged> live;
  std::uint64_t counter = 0;
  auto free_one = [&](const tagged& t) {
    // Check the pattern in the allocation's own stream order, then free in that order.
    const gpukit::stream_view s = shared.streams[static_cast<std::size_t>(t.stream)]->view();
    s.enqueue_host([t, &shared] {
      if (!tag_intact(t)) shared.corrupted.fetch_add(1);
    });
    a.deallocate(t.p);
  };
  for (int op = 0; op < operations; ++op) {
    const int r = static_cast<int>(pick(1000));
    if (r < 480 || live.empty()) {
      std::size_t bytes = pick(10) == 0 ? MiB + pick(6 * MiB) : 64 + pick(64 * KiB);
      try {
        tagged t;
        t.p = static_cast<unsigned char*>(a.allocate(bytes, own));
        t.bytes = bytes;
        t.tag = (static_cast<std::uint64_t>(id) << 48) | ++counter;
        t.stream = id;
        own.enqueue_host([t] { write_tag(t); });  // used by stream work, as device memory would be
        live.push_back(t);
      } catch (const gpukit::out_of_memory_error&) {
        shared.ooms.fetch_add(1);
      }
    } else if (r < 830) {
      const std::size_t i = pick(live.size());
      free_one(live[i]);
      live[i] = live.back();
      live.pop_back();
    } else if (r < 880) {
      const std::size_t i = pick(live.size());
      std::lock_guard<std::mutex> lock(shared.handoff_mutex);
      shared.handoff.push_back(live[i]);
      live[i] = live.back();
      live.pop_back();
    } else if (r < 930) {
      tagged t;
      {
        std::lock_guard<std::mutex> lock(shared.handoff_mutex);
        if (shared.handoff.empty()) continue;
        t = shared.handoff.back();
        shared.handoff.pop_back();
      }
      free_one(t);  // freed by a thread other than the one that allocated it
    } else if (r < 970) {
      // Another stream reads the allocation; record_stream keeps the block from reuse until it has.
      const tagged t = live[pick(live.size())];
      const auto other = shared.streams[pick(shared.streams.size())]->view();
      // The reader must run after the pattern was written: wait for the owner's work so far.
      gpukit::event written(cpu);
      written.record(own);
      written.wait(other);
      other.enqueue_host([t, &shared] {
        if (!tag_intact(t)) shared.corrupted.fetch_add(1);
      });
      a.record_stream(t.p, other);
    } else if (r < 990) {
      const auto s = a.stats();
      if (s.allocated_bytes.all().current < 0 || s.reserved_bytes.all().current < 0) shared.corrupted.fetch_add(1000);
      (void)a.memory_allocated();
      (void)a.max_memory_reserved();
    } else if (r < 995) {
      const auto snapshot = a.snapshot();
      const std::string problem = check_invariants(snapshot, {}, 512, false, true, false);
      if (!problem.empty()) {
        FAIL_CHECK("thread " << id << ", operation " << op << ": " << problem);
      }
    } else {
      a.empty_cache();
    }
  }
  for (const auto& t : live) free_one(t);
}

/// Runs worker() on a thread per stream of `shared` (seeds seed, seed + 1, ...), frees what was handed over and not
/// taken, and waits for every stream's work.
void run_workers(gpukit::device_allocator& a, shared_state& shared, std::uint64_t seed) {
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < shared.streams.size(); ++t) {
    pool.emplace_back(worker, std::ref(a), std::ref(shared), static_cast<int>(t), 3000, seed + t);
  }
  for (auto& t : pool) t.join();
  for (const auto& t : shared.handoff) {
    shared.streams[static_cast<std::size_t>(t.stream)]->enqueue_host([t, &shared] {
      if (!tag_intact(t)) shared.corrupted.fetch_add(1);
    });
    a.deallocate(t.p);
  }
  for (auto& s : shared.streams) s->synchronize();
}

}  // namespace

TEST_CASE("concurrent allocate, free, hand-over, record_stream, statistics and empty_cache on 4 threads") {
  gpukit::caching_device_allocator<gpukit::host_upstream> a(cpu);
  constexpr int threads = 4;
  {
    shared_state shared(threads);
    run_workers(a, shared, 1000);
    CHECK(shared.corrupted.load() == 0);
    CHECK(shared.ooms.load() == 0);
  }  // streams destroyed: all their work is done
  CHECK(a.memory_allocated() == 0);
  const auto before = a.snapshot();
  CHECK(check_invariants(before, {}, 512) == "");
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(a.engine().upstream().used() == 0);
  CHECK(a.stats().active.all().current == 0);
  CHECK(a.stats().num_device_alloc == a.stats().num_device_free);
  const auto totals = a.stats();
  MESSAGE(totals.allocation.all().allocated << " allocations on 4 threads, " << totals.num_device_alloc
                                            << " upstream allocations, " << totals.num_sync_all_streams
                                            << " empty_cache calls");
  CHECK(totals.allocation.all().allocated > 4000);
}

TEST_CASE("concurrent allocations under a tight reserved limit: OOMs are clean and the limit holds") {
  gpukit::allocator_options o;
  o.reserved_limit = 64 * MiB;
  gpukit::caching_device_allocator<gpukit::host_upstream> a(cpu, o);
  std::atomic<int> ooms{0};
  std::atomic<int> successes{0};
  {
    std::vector<std::unique_ptr<gpukit::stream>> streams;
    for (int i = 0; i < 4; ++i) streams.push_back(std::make_unique<gpukit::stream>(cpu));
    std::vector<std::thread> pool;
    for (int t = 0; t < 4; ++t) {
      pool.emplace_back([&, t] {
        std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 7);
        const gpukit::stream_view s = streams[static_cast<std::size_t>(t)]->view();
        std::vector<void*> mine;
        for (int i = 0; i < 400; ++i) {
          if (mine.size() < 4 && rng() % 3 != 0) {
            try {
              mine.push_back(a.allocate((1 + rng() % 12) * MiB, s));
              successes.fetch_add(1);
            } catch (const gpukit::out_of_memory_error&) {
              ooms.fetch_add(1);
            }
          } else if (!mine.empty()) {
            a.deallocate(mine.back());
            mine.pop_back();
          }
        }
        for (void* p : mine) a.deallocate(p);
      });
    }
    for (auto& t : pool) t.join();
  }
  CHECK(successes.load() > 0);
  CHECK(a.stats().num_ooms == ooms.load());
  CHECK(a.max_memory_reserved() <= 64 * MiB);
  CHECK(a.memory_allocated() == 0);
  CHECK(check_invariants(a.snapshot(), {}, 512) == "");
  a.empty_cache();
  CHECK(a.engine().upstream().used() == 0);
  MESSAGE("under a 64 MiB limit: " << successes.load() << " allocations, " << ooms.load() << " out-of-memory errors");
}

#if defined(__linux__)
using gpukit_test::host_vm_upstream;

TEST_CASE("concurrent use of expandable segments over host pages: releases never unmap a page in use") {
  gpukit::allocator_options o;
  o.expandable_segments = true;
  gpukit::caching_device_allocator<host_vm_upstream> a(cpu, o);
  constexpr int threads = 4;
  {
    shared_state shared(threads);
    a.engine().upstream().streams = &shared.streams;
    run_workers(a, shared, 2000);
    CHECK(shared.corrupted.load() == 0);
    CHECK(shared.ooms.load() == 0);
    CHECK(a.engine().upstream().device_waits() > 0);  // empty_cache unmapped pages while the others worked
    CHECK(a.memory_allocated() == 0);
    CHECK(check_invariants(a.snapshot(), {}, 512) == "");
    a.empty_cache();
    CHECK(a.memory_reserved() == 0);
    CHECK(a.engine().upstream().mapped() == 0);
    a.engine().upstream().streams = nullptr;
  }
  MESSAGE(a.stats().allocation.all().allocated << " allocations, " << a.engine().upstream().device_waits()
                                               << " waits before unmapping");
}
#endif
