// Host memory running out inside the pinned pool and the staging engine, on CPU streams: this executable replaces
// operator new (failing_heap.hpp) so that the N-th allocation of a call under test throws std::bad_alloc, for every
// N. A call that fails must change nothing the caller can see (a free leaves its block allocated, to be freed again)
// and the engine must go on: every block back at the end, every stream served.
#include <gpukit/memory/detail/device_mutex.hpp>
#include <gpukit/memory/detail/pointer_map.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/parallel_copy.hpp>
#include <gpukit/transfer/staging.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>  // an engine over the tests' fake streams
#include <gpukit/memory/pinned_pool_impl.hpp>
#include <gpukit/transfer/staging_impl.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/warning.hpp>

#include "failing_heap.hpp"
#include "memory/allocator_support.hpp"
#include "support.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// Blocks a pool takes out of use are leaked on purpose (a device may still read them); where a test cannot free them
// itself (the engine and the buffers hold a gpukit::pinned_pool), LeakSanitizer is told to ignore that thread's
// allocations for the test's length.
#if defined(__SANITIZE_ADDRESS__)
#define GPUKIT_TEST_LEAK_CHECKED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(leak_sanitizer)
#define GPUKIT_TEST_LEAK_CHECKED 1
#endif
#endif
#ifdef GPUKIT_TEST_LEAK_CHECKED
#include <sanitizer/lsan_interface.h>
#endif

using namespace std::chrono_literals;
using gpukit_test::exhausted_heap;
using gpukit_test::heap_run;

namespace {

const gpukit::device cpu = gpukit::device::cpu();
constexpr std::size_t KiB = 1024;

gpukit::pinned_pool make_pool() { return gpukit::pinned_pool(gpukit::pinned_upstream(gpukit::device::kind::cpu)); }

/// A staging engine with two slots per direction of `chunk` bytes (down to 16 KiB) and one copy thread.
gpukit::staging_options two_slots(std::size_t chunk) {
  gpukit::staging_options options;
  options.chunk_bytes = chunk;
  options.min_chunk_bytes = 16 * KiB;
  options.slots = 2;
  options.threads = 1;
  return options;
}

/// The CPU pinned upstream, keeping a list of the blocks out (room reserved by the test), so that the test can free
/// those the pool takes out of use: it leaks them on purpose (a device may still read them).
struct tracked_upstream {
  gpukit::pinned_upstream host{gpukit::device::kind::cpu};
  std::vector<std::pair<void*, std::size_t>>* out = nullptr;

  void* allocate(std::size_t bytes) {
    void* p = host.allocate(bytes);
    out->emplace_back(p, bytes);
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept {
    host.deallocate(p, bytes);
    out->erase(std::find(out->begin(), out->end(), std::make_pair(p, bytes)));
  }
};
using tracked_pool = gpukit::basic_pinned_pool<tracked_upstream, gpukit::pinned_pool_sync>;

struct lost_blocks_not_reported {
#ifdef GPUKIT_TEST_LEAK_CHECKED
  lost_blocks_not_reported() { __lsan_disable(); }
  ~lost_blocks_not_reported() { __lsan_enable(); }
#else
  lost_blocks_not_reported() {}   // NOLINT(modernize-use-equals-default): user-provided, so it is not "unused"
  ~lost_blocks_not_reported() {}  // NOLINT(modernize-use-equals-default)
#endif
  lost_blocks_not_reported(const lost_blocks_not_reported&) = delete;
  lost_blocks_not_reported& operator=(const lost_blocks_not_reported&) = delete;
};

/// Keeps the last warning in a fixed buffer: the handler allocates nothing, so it works with the heap exhausted.
struct last_warning {
  static inline std::array<char, 1024> text{};
  static inline std::size_t length = 0;
  static inline int count = 0;
  static void keep(std::string_view message) noexcept {
    length = message.copy(text.data(), text.size());
    ++count;
  }
  static std::string_view get() { return {text.data(), length}; }
};

/// Installs last_warning as the handler while it lives (installing allocates: do it before exhausting the heap).
struct warnings_kept {
  warnings_kept() : previous(gpukit::set_warning_handler(&last_warning::keep)) { last_warning::count = 0; }
  ~warnings_kept() { (void)gpukit::set_warning_handler(std::move(previous)); }
  gpukit::warning_handler previous;
};

}  // namespace

TEST_CASE("heap faults: a pinned pool whose host allocation fails at its N-th, for every N, keeps its books") {
  gpukit::stream s0(cpu);
  gpukit::stream s1(cpu);
  long runs = 0;
  int failures = 0;
  std::size_t losses = 0;
  for (long n = 1;; ++n) {
    std::vector<std::pair<void*, std::size_t>> out;
    out.reserve(64);
    heap_run run(n);
    {
      tracked_pool pool{tracked_upstream{gpukit::pinned_upstream(gpukit::device::kind::cpu), &out}};
      std::vector<void*>& held = run.held();
      // The streams' work done first, so that each run makes the same allocations.
      const auto settled = [&] {
        s0.synchronize();
        s1.synchronize();
      };
      const auto allocate = [&](std::size_t bytes) {
        void* p = nullptr;
        settled();
        if (run.armed([&] { p = pool.allocate(bytes); })) held.push_back(p);
        return p;
      };
      // A free that fails leaves its block allocated, or takes it out of use (no memory to keep its events).
      const auto release = [&](void* p, const gpukit::stream* on) {
        if (p == nullptr) return;
        settled();
        const std::size_t lost_before = pool.stats().lost_blocks;
        const bool done = run.armed([&] {
          if (on != nullptr) {
            pool.deallocate(p, *on);
          } else {
            pool.deallocate(p);
          }
        });
        const bool lost = pool.stats().lost_blocks > lost_before;
        losses += lost ? 1 : 0;
        if (done || lost) held.erase(std::find(held.begin(), held.end(), p));
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
      settled();
      (void)pool.empty_cache();
      const gpukit::pinned_pool_stats st = pool.stats();
      INFO("fault at host allocation " << n);
      CHECK(run.unexpected() == "");
      CHECK(st.active_blocks == 0);
      CHECK(st.free_blocks == 0);
      CHECK(st.pending_blocks == 0);
      std::size_t out_bytes = 0;
      for (const auto& block : out) out_bytes += block.second;
      CHECK(out.size() == st.lost_blocks);  // every other block went back to the upstream
      CHECK(st.reserved_bytes == out_bytes);
      CHECK(st.upstream_allocations == st.upstream_frees + st.lost_blocks);
    }
    for (const auto& [p, bytes] : out) gpukit::pinned_upstream(gpukit::device::kind::cpu).deallocate(p, bytes);
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("pinned pool: " << runs << " runs, " << failures << " calls failed with std::bad_alloc, " << losses
                          << " blocks taken out of use");
  CHECK(runs > 5);
  CHECK(failures > 0);  // some failures are absorbed (a cache trimmed later), the books checked all the same
}

TEST_CASE(
    "heap faults: the staging engine's release_idle failing at its N-th host allocation leaves every stream served") {
  const gpukit::staging_options options = two_slots(64 * KiB);
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

TEST_CASE(
    "heap faults: a staging slot that grows while host allocation N fails, for every N, keeps its block or loses "
    "it to the pool, never drops it") {
  const lost_blocks_not_reported lost_blocks;  // the pool keeps a block whose event it could not record out of use
  const gpukit::staging_options options = two_slots(64 * KiB);
  gpukit::stream s(cpu);
  std::vector<unsigned char> small(8 * KiB);
  std::vector<unsigned char> big(100 * KiB);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<unsigned char>(i * 7);
  long runs = 0;
  int failures = 0;
  int refused_in_transfer = 0;
  for (long n = 1;; ++n) {
    INFO("fault at host allocation " << n);
    gpukit::pinned_pool pool = make_pool();
    heap_run run(n);
    {
      gpukit::staging_engine engine(pool, options);
      std::vector<unsigned char> device_side(big.size());
      std::vector<unsigned char> host_side(big.size());
      // Slots of 8 KiB in both directions, which the transfers below grow to 64 KiB (in to_device while the slot is
      // idle; in to_host behind the slot's event on the stream).
      engine.to_device(device_side.data(), small.data(), small.size(), s);
      engine.to_host(host_side.data(), small.data(), small.size(), s);
      s.synchronize();
      // A failure of the grown slot's pinned block itself is out_of_memory_error: inside a transfer the pool does
      // not empty its cache to retry (cudaFreeHost could wait for the transfer's stream).
      const auto kept_cache_or = [&](auto&& transfer) {
        try {
          transfer();
        } catch (const gpukit::out_of_memory_error& e) {
          if (std::strstr(e.what(), "was not emptied") == nullptr) throw;
          ++refused_in_transfer;
        }
      };
      run.armed([&] { kept_cache_or([&] { engine.to_device(device_side.data(), big.data(), big.size(), s); }); });
      run.armed([&] { kept_cache_or([&] { engine.to_host(host_side.data(), big.data(), big.size(), s); }); });
      s.synchronize();
      CHECK(run.unexpected() == "");
      // The engine goes on, at the new size.
      engine.to_device(device_side.data(), big.data(), big.size(), s);
      engine.to_host(host_side.data(), device_side.data(), big.size(), s);
      s.synchronize();
      CHECK(host_side == big);
    }
    // A slot that dropped a block the pool refused would leave it allocated, held by nobody.
    CHECK(pool.stats().active_blocks == 0);
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("staging engine, growing slots: " << runs << " runs, " << failures << " calls threw std::bad_alloc, "
                                            << refused_in_transfer << " out_of_memory_error (cache kept)");
  CHECK(runs > 5);
  CHECK(refused_in_transfer > 0);
  CHECK(failures > 0);
}

TEST_CASE(
    "heap faults: staging transfers when host allocations N and N+1 both fail, for every N, keep every block a "
    "slot or the pool accounts for") {
  // A double fault: a slot's completion event cannot be recorded (the first failure), then the pool cannot take the
  // block back (the second). The slot then keeps its block once the stream has been waited for; dropping it left it
  // allocated in the pool, held by nobody.
  const lost_blocks_not_reported lost_blocks;  // the pool keeps a block whose event it could not record out of use
  const gpukit::staging_options options = two_slots(16 * KiB);
  gpukit::stream s(cpu);
  std::vector<unsigned char> data(64 * KiB);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 13);
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    INFO("faults at host allocations " << n << " and " << n + 1);
    gpukit::pinned_pool pool = make_pool();
    heap_run run(n, nullptr, 2);
    {
      gpukit::staging_engine engine(pool, options);
      std::vector<unsigned char> device_side(data.size());
      std::vector<unsigned char> host_side(data.size());
      engine.to_device(device_side.data(), data.data(), data.size(), s);  // the slots at their size, then faults
      s.synchronize();
      run.armed([&] { engine.to_device(device_side.data(), data.data(), data.size(), s); });
      run.armed([&] { engine.to_host(host_side.data(), data.data(), data.size(), s); });
      s.synchronize();
      CHECK(run.unexpected() == "");
      engine.to_device(device_side.data(), data.data(), data.size(), s);  // the engine goes on
      engine.to_host(host_side.data(), device_side.data(), data.size(), s);
      s.synchronize();
      CHECK(host_side == data);
    }
    CHECK(pool.stats().active_blocks == 0);
    failures += run.failures();
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("staging engine, double faults: " << runs << " runs, " << failures << " calls threw std::bad_alloc");
  CHECK(runs > 5);
  CHECK(failures > 0);
}

TEST_CASE(
    "heap faults: a staging block refused after a failed record on a held stream is reported after the patience, "
    "not waited for") {
  // to_device never waits for its stream longer than the patience: the stream may wait for this very thread.
  const lost_blocks_not_reported lost_blocks;  // a block the pool refused stays allocated in it, reported
  gpukit::staging_options options = two_slots(16 * KiB);
  options.patience = std::chrono::milliseconds(5);
  std::vector<unsigned char> data(32 * KiB, 0x3c);  // two chunks: one per slot, no slot waited for
  long runs = 0;
  int reported = 0;
  for (long n = 1;; ++n) {
    INFO("faults at host allocations " << n << " and " << n + 1);
    gpukit::pinned_pool pool = make_pool();
    gpukit::stream s(cpu);
    heap_run run(n, nullptr, 2);
    bool was_reported = false;
    {
      gpukit::staging_engine engine(pool, options);
      std::vector<unsigned char> device_side(data.size());
      gpukit_test::gate held;
      held.hold(s);
      const warnings_kept kept;
      // A watchdog opens the gate if to_device waits for the held stream (then the check fails).
      CHECK_FALSE(held.opened_to_return(
          [&] { run.armed([&] { engine.to_device(device_side.data(), data.data(), data.size(), s); }); },
          std::chrono::seconds(30)));
      was_reported = last_warning::count > 0 && last_warning::get().find(
                                                    "nor waited for (its stream did not finish "
                                                    "within the patience)") != std::string::npos;
      held.open();
      s.synchronize();
      CHECK(run.unexpected() == "");
    }
    CHECK(pool.stats().active_blocks == (was_reported ? 1U : 0U));  // only the reported block stays allocated
    reported += was_reported ? 1 : 0;
    if (run.seen() < n) break;
    ++runs;
  }
  MESSAGE("staging engine, double faults on a held stream: " << runs << " runs, " << reported << " reported");
  CHECK(reported >= 1);
}

TEST_CASE(
    "heap faults: an allocation whose pointer map cannot grow at host allocation N, for every N, gives its block "
    "back fenced") {
  // A block freed on s0 while s0's work still used it, taken again on s0 (no wait needed: its fence is dropped); the
  // pointer map's insert then fails (its shard grows). Given back unfenced, another stream took it without waiting
  // for that work. The shard is filled to its load factor first.
  const auto shard_of = [](const void* p) {
    return gpukit::detail::sharded_pointer_map<void>::shard_of(reinterpret_cast<std::uintptr_t>(p));
  };
  long runs = 0;
  int failures = 0;
  for (long n = 1;; ++n) {
    INFO("fault at host allocation " << n);
    gpukit::allocator_options o;
    o.cross_stream_reuse = true;
    gpukit_test::fake_setup f(o);
    const gpukit_test::fake_stream s0 = f.add_stream();
    const gpukit_test::fake_stream s1 = f.add_stream();
    const gpukit_test::fake_stream s2 = f.add_stream();
    void* p = f.a.allocate(1000, s0);
    void* q = f.a.allocate(1000, s0);  // p's block stays whole when taken again
    f.world.enqueue(s0.id);            // s0's work uses p
    f.a.deallocate(p);                 // fenced
    std::vector<void*> filling;
    std::vector<void*> others;
    for (unsigned in_shard = shard_of(q) == shard_of(p) ? 1 : 0; in_shard < 16;) {  // 16 of a 32-entry table
      void* x = f.a.allocate(3000, s2);
      (shard_of(x) == shard_of(p) ? filling : others).push_back(x);
      if (shard_of(x) == shard_of(p)) ++in_shard;
    }
    for (void* x : others) f.a.deallocate(x);
    bool taken_on_s0 = false;
    {
      heap_run run(n);
      taken_on_s0 = run.armed([&] { f.a.deallocate(f.a.allocate(1000, s0), s0); });
      CHECK(run.unexpected() == "");
      failures += run.failures();
      if (run.seen() < n) {
        for (void* x : filling) f.a.deallocate(x);
        f.a.deallocate(q);
        f.world.complete_all();
        break;
      }
    }
    ++runs;
    if (!taken_on_s0) {
      const std::size_t waits = f.world.waits.size();
      void* r = f.a.allocate(1000, s1);  // s0's work has not completed
      CHECK(r == p);
      CHECK(f.world.waits.size() == waits + 1);  // for s0's work
      f.a.deallocate(r);
    }
    for (void* x : filling) f.a.deallocate(x);
    f.a.deallocate(q);
    f.world.complete_all();
    CHECK(f.a.memory_allocated() == 0);
  }
  MESSAGE("caching allocator, pointer map growth: " << runs << " runs, " << failures << " threw std::bad_alloc");
  CHECK(failures > 0);
}

TEST_CASE("heap faults: a staging engine destroyed with no host memory left reports the blocks the pool refused") {
  const lost_blocks_not_reported lost_blocks;  // the refused blocks stay allocated in the pool, reported
  gpukit::pinned_pool pool = make_pool();
  gpukit::stream s(cpu);
  auto engine = std::make_unique<gpukit::staging_engine>(pool, two_slots(16 * KiB));
  std::vector<unsigned char> data(32 * KiB, 0x5a);
  std::vector<unsigned char> device_side(data.size());
  engine->to_device(device_side.data(), data.data(), data.size(), s);
  s.synchronize();
  const std::size_t blocks = pool.stats().active_blocks;
  REQUIRE(blocks >= 2);  // both upload slots hold one
  const warnings_kept kept;
  {
    const exhausted_heap exhausted;
    engine.reset();  // each slot's block would go to the free lists, which have no room for it
  }
  CHECK(last_warning::count == static_cast<int>(blocks));  // one warning per block, and no other
  CHECK(last_warning::get().find("destroyed with a staging block the pinned pool refused to take back") !=
        std::string::npos);
  CHECK(pool.stats().active_blocks == blocks);  // each refused, none dropped
}

TEST_CASE("heap faults: a warning built with no host memory left is delivered, cut short on the stack") {
  const warnings_kept kept;
  const std::string long_part(700, 'x');
  {
    const exhausted_heap exhausted;
    gpukit::detail::warn_parts("gpukit test: ", gpukit::detail::bytes_part{3 * 1024 * 1024, true}, " after ", -12,
                               " tries: ", "short");
  }
  REQUIRE(last_warning::count == 1);
  CHECK(last_warning::get() == "gpukit test: 3.00 MiB (3145728 bytes) after -12 tries: short");
  {
    const exhausted_heap exhausted;
    gpukit::detail::warn_parts("gpukit test: ", long_part, "; the end");
  }
  REQUIRE(last_warning::count == 2);
  const std::string_view marker = " [cut short: out of host memory]";
  CHECK(last_warning::get().size() == gpukit::detail::warning_fallback_capacity);
  CHECK(last_warning::get().substr(0, 20) == "gpukit test: xxxxxxx");
  CHECK(last_warning::get().substr(last_warning::get().size() - marker.size()) == marker);
  // With memory, the same parts are joined whole.
  gpukit::detail::warn_parts("gpukit test: ", long_part, "; the end");
  CHECK(last_warning::get().size() == 13 + long_part.size() + 9);
  {
    const exhausted_heap exhausted;
    gpukit::detail::report_cuda_failure(cudaErrorInvalidValue, "cudaFree(p)", 3);
  }
  REQUIRE(last_warning::count == 4);
  CHECK(last_warning::get().substr(0, 39) == "cudaFree(p) failed on cuda:3: invalid a");
  CHECK(last_warning::get().find("(cudaErrorInvalidValue)") != std::string_view::npos);
}

TEST_CASE("heap faults: a pooled pinned buffer destroyed with no host memory left warns instead of terminating") {
  const lost_blocks_not_reported lost_blocks;  // the pool cannot keep the block's event: it takes the block out of use
  const warnings_kept kept;
  gpukit::stream s(cpu);
  gpukit::pinned_pool pool = make_pool();
  gpukit::pooled_pinned_buffer<int> buffer(256, pool);
  buffer.record_stream(s);
  {
    const exhausted_heap exhausted;
    // The free needs room for an event: std::bad_alloc, and the warning about it cannot be built on the heap.
    buffer.reset();
  }
  CHECK(buffer.data() == nullptr);
  REQUIRE(last_warning::count == 1);
  CHECK(last_warning::get().substr(0, 56) == "gpukit::pooled_pinned_buffer: returning the block failed");
  CHECK(pool.stats().active_blocks == 0);
  CHECK(pool.stats().lost_blocks == 1);
}

TEST_CASE("heap faults: a pooled pinned buffer whose block the pool refuses with no host memory left says so") {
  const warnings_kept kept;
  gpukit::pinned_pool pool = make_pool();
  gpukit::pooled_pinned_buffer<int> buffer(256, pool);
  void* block = buffer.data();
  {
    const exhausted_heap exhausted;
    buffer.reset();  // no stream to wait for: the block would go to the free lists, which have no room for it
  }
  CHECK(buffer.data() == nullptr);
  REQUIRE(last_warning::count == 1);
  CHECK(last_warning::get().find("the block stays allocated in the pool, unused, until the pool is destroyed") !=
        std::string::npos);
  CHECK(pool.is_allocated(block));
  pool.deallocate(block);  // the test gives it back, so that the pool is destroyed whole
  CHECK(pool.stats().active_blocks == 0);
}

TEST_CASE(
    "heap faults: host functions a host function enqueues on the CPU default stream run once each, with their "
    "captures, when host allocation N fails, for every N") {
  // They wait in a per-thread queue until the enclosing one returns; a queue out of memory runs one nested instead,
  // which must still hold what it captured.
  const gpukit::stream_view s = gpukit::stream_view::default_stream(cpu);
  constexpr int nested = 100;  // more than a std::deque node holds
  long n = 1;
  int failures = 0;
  for (;; ++n) {
    INFO("fault at host allocation " << n);
    std::vector<int> ran;
    ran.reserve(nested);  // the test's own pushes never allocate
    const auto payload = std::make_shared<int>(7);
    heap_run run(n);
    const bool done = run.armed([&] {
      s.enqueue_host([&] {
        for (int i = 0; i < nested; ++i) {
          s.enqueue_host([&ran, payload, i] { ran.push_back(*payload - 7 + i); });
        }
      });
    });
    failures += done ? 0 : 1;
    CHECK(run.unexpected() == "");
    std::sort(ran.begin(), ran.end());
    std::vector<int> expected(nested);
    for (int i = 0; i < nested; ++i) expected[static_cast<std::size_t>(i)] = i;
    CHECK(ran == expected);  // a host function never throws out of the stream: nested or deferred, each ran
    if (run.seen() < n) break;
  }
  MESSAGE("nested host functions: " << n - 1 << " host allocations, each failed once");
  CHECK(n > nested);
  CHECK(failures == 0);  // the failures are absorbed: the host function runs nested
}

TEST_CASE("heap faults: parallel_copy throws only before it hands out parts, and otherwise completes the copy") {
  // A copy that threw after queueing tickets for its helpers would return while they still write the destination.
  // Each run fails one host allocation of 40 copies (the job, a ticket's queue node, a helper thread): only the
  // job's, the call's first allocation, may throw, and every other copy completes.
  std::vector<unsigned char> source(256 * KiB);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 7 + 1);
  bool every_allocation_failed = false;
  for (long n = 1; !every_allocation_failed; ++n) {
    INFO("fault at host allocation " << n);
    heap_run run(n);
    for (int copy = 0; copy < 40; ++copy) {
      std::vector<unsigned char> destination(source.size(), 0);
      const long before = run.seen();
      if (run.armed([&] { gpukit::parallel_copy(destination.data(), source.data(), source.size(), 4); })) {
        CHECK(destination == source);
      } else {
        CHECK(run.seen() - before == 1);  // the job itself: nothing was handed out
      }
    }
    CHECK(run.unexpected() == "");
    every_allocation_failed = run.seen() < n;
  }
}

TEST_CASE("heap faults: a warning held under the device lock that cannot be kept is delivered once and whole") {
  // The record's length went in and its text did not: the warning was delivered at once, then again at the release as
  // its length's bytes followed by what lay past them in the heap (helper-176).
  gpukit::detail::device_mutex m;
  struct seen {
    std::size_t size;
    char first;
    bool whole;
  };
  std::vector<seen> received;
  received.reserve(16);  // the handler allocates nothing
  const auto previous = gpukit::set_warning_handler([&received](std::string_view message) {
    const bool whole = message.find_first_not_of(message.empty() ? ' ' : message[0]) == std::string_view::npos;
    received.push_back({message.size(), message.empty() ? ' ' : message[0], whole});
  });
  const std::string a(5, 'a'), b(600, 'b'), c(40, 'c');
  long n = 1;
  for (;; ++n) {
    CAPTURE(n);
    received.clear();
    heap_run run(n);
    (void)run.armed([&] {
      const std::lock_guard<gpukit::detail::device_mutex> lock(m);
      gpukit::warn(a);
      gpukit::warn(b);
      gpukit::warn(c);
    });
    REQUIRE(received.size() == 3);
    for (const std::string* sent : {&a, &b, &c}) {
      const auto count = std::count_if(received.begin(), received.end(), [&](const seen& s) {
        return s.size == sent->size() && s.first == (*sent)[0] && s.whole;
      });
      CHECK(count == 1);
    }
    CHECK(gpukit::detail::warnings_held_on_this_thread().pending == nullptr);
    if (run.seen() < n) break;  // every allocation of the scenario has failed once
  }
  CHECK(n > 2);
  gpukit::set_warning_handler(previous);
}
