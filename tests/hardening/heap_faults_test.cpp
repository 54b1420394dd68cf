// Host memory running out inside the pinned pool and the staging engine, on CPU streams: this executable replaces
// operator new (failing_heap.hpp) so that the N-th allocation of a call under test throws std::bad_alloc, for every
// N. A call that fails must change nothing the caller can see (a free leaves its block allocated, to be freed again)
// and the engine must go on: every block back at the end, every stream served.
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/staging.hpp>
#include <gpukit/memory/pinned_pool_impl.hpp>
#include <gpukit/transfer/staging_impl.hpp>

#include "failing_heap.hpp"
#include "support.hpp"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <future>
#include <string>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using gpukit_test::heap_run;

namespace {

const gpukit::device cpu = gpukit::device::cpu();
constexpr std::size_t KiB = 1024;

gpukit::pinned_pool make_pool() { return gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu)); }

/// The pool's events, whose own allocations never fail here: an event that cannot be recorded takes its block out
/// of use (documented, and covered by pinned_pool_faults_test), which this test tells from a lost block.
struct quiet_sync : gpukit::pinned_pool_sync {
  static inline thread_local int depth = 0;
  struct inside {
    inside() noexcept { ++depth; }
    ~inside() { --depth; }
    inside(const inside&) = delete;
    inside& operator=(const inside&) = delete;
  };
  static bool in_call() noexcept { return depth != 0; }

  marker record(gpukit::stream_view s) {
    const inside scope;
    return pinned_pool_sync::record(s);
  }
  bool ready(const marker& m) {
    const inside scope;
    return pinned_pool_sync::ready(m);
  }
  void wait(const marker& m) {
    const inside scope;
    pinned_pool_sync::wait(m);
  }
  void recycle(marker&& m) noexcept {
    const inside scope;
    pinned_pool_sync::recycle(std::move(m));
  }
};
using quiet_pool = gpukit::basic_pinned_pool<gpukit::pinned_upstream, quiet_sync>;

}  // namespace

TEST_CASE("heap faults: a pinned pool whose host allocation fails at its N-th, for every N, loses no block") {
  gpukit::stream s0(cpu);
  gpukit::stream s1(cpu);
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    heap_run run(n, quiet_sync::in_call);
    quiet_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
    std::vector<void*>& held = run.held();
    const auto allocate = [&](std::size_t bytes) {
      void* p = nullptr;
      if (run.armed([&] { p = pool.allocate(bytes); })) held.push_back(p);
      return p;
    };
    const auto release = [&](void* p, const gpukit::stream* on) {
      if (p == nullptr) return;
      const bool done = run.armed([&] {
        if (on != nullptr) {
          pool.deallocate(p, *on);
        } else {
          pool.deallocate(p);
        }
      });
      for (auto it = held.begin(); done && it != held.end(); ++it) {
        if (*it == p) {
          held.erase(it);
          break;
        }
      }
    };
    void* a = allocate(64 * KiB);
    void* b = allocate(KiB);
    void* c = allocate(256 * KiB);
    if (b != nullptr) run.armed([&] { pool.record_stream(b, s1); });
    release(a, &s0);      // waits for s0's work
    release(b, nullptr);  // waits for s1's work
    void* d = allocate(64 * KiB);
    release(c, &s1);
    release(d, &s0);
    // Whatever failed is freed now, with nothing armed; then every block is free again.
    while (!held.empty()) {
      pool.deallocate(held.back());
      held.pop_back();
    }
    s0.synchronize();
    s1.synchronize();
    (void)pool.empty_cache();
    const gpukit::pinned_pool_stats st = pool.stats();
    INFO("fault at host allocation " << n);
    CHECK(run.unexpected() == "");
    CHECK(st.lost_blocks == 0);  // a free that failed left its block allocated: freed above
    CHECK(st.active_blocks == 0);
    CHECK(st.reserved_bytes == 0);
    CHECK(st.upstream_allocations == st.upstream_frees);
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("pinned pool: " << runs << " runs, " << failures << " calls failed with std::bad_alloc");
  CHECK(runs > 5);
  CHECK(failures >= runs);
}

TEST_CASE(
    "heap faults: the staging engine's release_idle failing at its N-th host allocation leaves every stream served") {
  gpukit::staging_options options;
  options.chunk_bytes = 64 * KiB;
  options.min_chunk_bytes = 16 * KiB;
  options.slots = 2;
  options.threads = 1;
  gpukit::stream streams[3] = {gpukit::stream(cpu), gpukit::stream(cpu), gpukit::stream(cpu)};
  const std::vector<unsigned char> source(100 * KiB, 0x5a);
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    gpukit::pinned_pool pool = make_pool();
    heap_run run(n);
    {
      gpukit::staging_engine engine(pool, options);
      std::vector<unsigned char> targets[3];
      for (int i = 0; i < 3; ++i) {
        targets[i].resize(source.size());
        engine.to_device(targets[i].data(), source.data(), source.size(), streams[i]);
      }
      for (gpukit::stream& s : streams) s.synchronize();
      // A ring that cannot give its slots back (the pool out of memory) stays; one that cannot be forgotten must not
      // be released.
      run.armed([&] { (void)engine.release_idle(); });
      // Each stream is served again. A ring released but still listed would make this spin for ever: a watchdog
      // (not a measurement) turns that into a failure, then a release_idle() that succeeds lets the copy go on.
      std::vector<unsigned char> again(source.size());
      auto copy = std::async(std::launch::async, [&] {
        for (gpukit::stream& s : streams) {
          engine.to_device(again.data(), source.data(), source.size(), s);
          s.synchronize();
        }
      });
      const bool served = copy.wait_for(60s) == std::future_status::ready;
      INFO("fault at host allocation " << n);
      CHECK_MESSAGE(served, "to_device after the failed release_idle did not return");
      if (!served) (void)engine.release_idle();
      copy.get();
      CHECK(again == source);
      CHECK(run.unexpected() == "");
    }
    CHECK(pool.stats().active_blocks == 0);  // the engine gave every slot back
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("staging engine: " << runs << " runs, " << failures << " release_idle calls threw std::bad_alloc");
  CHECK(runs > 1);
  CHECK(failures >= 1);  // the list of released rings; the pool's failures leave their ring in use, unreported
}
