// Bounded stress scenarios for ThreadSanitizer (issue 12), on the CPU device: fixed iteration counts, no timing, a
// few seconds each under TSan. They complement tests/memory/allocator_concurrency_test.cpp (threads on their own
// streams with hand-overs, record_stream, statistics, snapshots and empty_cache; a tight reserved limit) with what it
// does not do: one stream shared by several threads, record_stream whose reader is provably still running when the
// block is freed, trim / limits / fractions changed under load, stream pool leases, concurrent copies onto one
// stream, a shared pinned pool under cap changes, and several prefetchers at once. Each scenario also checks a
// result (data intact, statistics consistent at the end), so it fails without TSan too.
#include "memory/allocator_support.hpp"  // check_invariants, KiB/MiB
#include "support.hpp"                   // gate

#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/prefetcher.hpp>
#include <gpukit/transfer/staging.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace gpukit_test;

namespace {

const gpukit::device cpu = gpukit::device::cpu();
using host_allocator = gpukit::caching_device_allocator<gpukit::host_upstream>;

/// An allocation with a tag written at both ends by stream work; a block handed out twice, or reused while a stream
/// still reads it, shows up as a broken tag.
struct tagged {
  unsigned char* p = nullptr;
  std::size_t bytes = 0;
  std::uint64_t tag = 0;
};

std::size_t pick(std::mt19937_64& rng, std::size_t n) {
  return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
}

/// Runs `body(thread index)` on `n` threads and joins them.
template <class F>
void run_threads(int n, F body) {
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) threads.emplace_back(body, t);
  for (auto& t : threads) t.join();
}

/// The end state every allocator scenario must reach: nothing allocated, a consistent snapshot, and after
/// empty_cache nothing reserved and every upstream allocation returned.
void check_allocator_drained(host_allocator& a, std::int64_t allocations) {
  CHECK(a.memory_allocated() == 0);
  CHECK(check_invariants(a.snapshot(), {}, 512) == "");
  CHECK(a.stats().allocation.all().allocated == allocations);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(a.engine().upstream().used() == 0);
  CHECK(a.stats().num_device_alloc == a.stats().num_device_free);
}

}  // namespace

TEST_CASE("stress: threads allocate on one shared CPU stream and on the CPU default stream, freeing each other's") {
  host_allocator a(cpu);
  gpukit::stream shared(cpu);
  const gpukit::stream_view on_shared = shared.view();
  const gpukit::stream_view on_default = gpukit::stream_view::default_stream(cpu);
  std::atomic<int> corrupted{0};
  std::atomic<std::int64_t> allocations{0};
  std::mutex handoff_mutex;
  std::vector<std::pair<tagged, gpukit::stream_view>> handoff;
  auto free_on = [&](const tagged& t, gpukit::stream_view s) {
    s.enqueue_host([t, &corrupted] {
      if (!tag_intact(t)) corrupted.fetch_add(1);
    });
    a.deallocate(t.p);  // stream-ordered: the next user of the block on `s` runs after the check
  };
  run_threads(4, [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 11);
    std::vector<std::pair<tagged, gpukit::stream_view>> live;
    std::uint64_t counter = 0;
    for (int op = 0; op < 2000; ++op) {
      const std::size_t r = pick(rng, 100);
      if (r < 50 || live.empty()) {
        const gpukit::stream_view s = pick(rng, 3) == 0 ? on_default : on_shared;
        tagged t;
        t.bytes = pick(rng, 16) == 0 ? MiB + pick(rng, 2 * MiB) : 64 + pick(rng, 64 * KiB);
        t.p = static_cast<unsigned char*>(a.allocate(t.bytes, s));
        t.tag = (static_cast<std::uint64_t>(id) << 48) | ++counter;
        s.enqueue_host([t] { write_tag(t); });
        allocations.fetch_add(1);
        live.emplace_back(t, s);
      } else if (r < 85) {
        const std::size_t i = pick(rng, live.size());
        free_on(live[i].first, live[i].second);
        live[i] = live.back();
        live.pop_back();
      } else {
        // Another thread frees it (on the stream it was allocated on), or this thread frees one handed over.
        std::lock_guard<std::mutex> lock(handoff_mutex);
        if (r < 93) {
          const std::size_t i = pick(rng, live.size());
          handoff.push_back(live[i]);
          live[i] = live.back();
          live.pop_back();
        } else if (!handoff.empty()) {
          free_on(handoff.back().first, handoff.back().second);
          handoff.pop_back();
        }
      }
    }
    for (const auto& l : live) free_on(l.first, l.second);
  });
  for (const auto& h : handoff) free_on(h.first, h.second);
  shared.synchronize();
  CHECK(corrupted.load() == 0);
  check_allocator_drained(a, allocations.load());
}

TEST_CASE("stress: record_stream from reader threads keeps a block from reuse while their streams still read it") {
  // Owner threads allocate and write; a reader thread per owner enqueues a read behind a closed gate on its own
  // stream and calls record_stream. The owner then frees the block, allocates the same size on its stream and
  // overwrites it before opening the gate: without record_stream's event the block would come back at once.
  host_allocator a(cpu);
  struct item {
    tagged t;
    std::shared_ptr<gpukit::event> written;
    std::shared_ptr<gate> held;
  };
  struct channel {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<item> items;
    int acks = 0;
    bool done = false;
  };
  constexpr int pairs = 2;
  constexpr int rounds = 400;
  std::atomic<int> corrupted{0};
  std::atomic<int> reused_while_read{0};
  std::vector<std::unique_ptr<channel>> channels;
  std::vector<std::unique_ptr<gpukit::stream>> reader_streams;
  for (int i = 0; i < pairs; ++i) {
    channels.push_back(std::make_unique<channel>());
    reader_streams.push_back(std::make_unique<gpukit::stream>(cpu));
  }
  std::vector<std::vector<item>> keep_alive(pairs);  // gates and events outlive the reader streams' work
  run_threads(2 * pairs, [&](int id) {
    channel& ch = *channels[static_cast<std::size_t>(id / 2)];
    if (id % 2 == 1) {  // reader
      const gpukit::stream_view reader = reader_streams[static_cast<std::size_t>(id / 2)]->view();
      for (;;) {
        item it;
        {
          std::unique_lock<std::mutex> lock(ch.mutex);
          ch.cv.wait(lock, [&] { return ch.done || !ch.items.empty(); });
          if (ch.items.empty()) return;
          it = ch.items.front();
          ch.items.pop_front();
        }
        it.held->hold(reader);
        it.written->wait(reader);  // the read runs after the owner's write
        const tagged t = it.t;
        reader.enqueue_host([t, &corrupted] {
          if (!tag_intact(t)) corrupted.fetch_add(1);
        });
        a.record_stream(t.p, reader);
        {
          std::lock_guard<std::mutex> lock(ch.mutex);
          ++ch.acks;
        }
        ch.cv.notify_all();
      }
    }
    gpukit::stream own(cpu);
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 23);
    auto& kept = keep_alive[static_cast<std::size_t>(id / 2)];
    for (int round = 0; round < rounds; ++round) {
      item it;
      it.t.bytes = 1 * KiB + pick(rng, 255 * KiB);
      it.t.p = static_cast<unsigned char*>(a.allocate(it.t.bytes, own));
      it.t.tag = (static_cast<std::uint64_t>(id) << 48) | static_cast<std::uint64_t>(2 * round);
      const tagged t = it.t;
      own.enqueue_host([t] { write_tag(t); });
      it.written = std::make_shared<gpukit::event>(cpu);
      it.written->record(own);
      it.held = std::make_shared<gate>();
      kept.push_back(it);
      {
        std::unique_lock<std::mutex> lock(ch.mutex);
        ch.items.push_back(it);
        ch.cv.notify_all();
        ch.cv.wait(lock, [&] { return ch.acks == round + 1; });
      }
      a.deallocate(t.p);
      tagged again{static_cast<unsigned char*>(a.allocate(t.bytes, own)), t.bytes, t.tag + 1};
      if (again.p == t.p) reused_while_read.fetch_add(1);  // the reader's stream is held: it cannot have passed
      own.enqueue_host([again] { write_tag(again); });
      own.synchronize();  // the overwrite has happened before the reader may read
      it.held->open();
      own.enqueue_host([again, &corrupted] {
        if (!tag_intact(again)) corrupted.fetch_add(1);
      });
      a.deallocate(again.p);
    }
    {
      std::lock_guard<std::mutex> lock(ch.mutex);
      ch.done = true;
    }
    ch.cv.notify_all();
  });
  for (auto& s : reader_streams) s->synchronize();
  CHECK(reused_while_read.load() == 0);
  CHECK(corrupted.load() == 0);
  check_allocator_drained(a, 2 * pairs * rounds);
}

TEST_CASE("stress: empty_cache, trim, reserved limits, memory fractions and peak resets while threads allocate") {
  constexpr std::size_t capacity = 256 * MiB;
  host_allocator a(cpu, gpukit::allocator_options{}, capacity);
  std::atomic<int> corrupted{0};
  std::atomic<std::int64_t> allocations{0};
  std::atomic<std::int64_t> ooms{0};
  std::atomic<int> workers_left{3};
  std::vector<std::string> problems;  // written by the control thread only
  run_threads(4, [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 37);
    if (id == 3) {  // the control thread: until the workers finish, at least 200 rounds
      for (int round = 0; round < 200 || workers_left.load() > 0; ++round) {
        switch (round % 6) {
          case 0:
            a.empty_cache();
            break;
          case 1:
            (void)a.trim(pick(rng, 64) * MiB);
            break;
          case 2:
            a.set_reserved_limit(8 * MiB + pick(rng, 64) * MiB);
            break;
          case 3:
            a.set_memory_fraction(0.05 * static_cast<double>(1 + pick(rng, 6)));
            break;
          case 4:
            a.reset_peak_stats();
            break;
          default: {
            a.set_reserved_limit(gpukit::allocator_options::unlimited);
            (void)a.memory_summary();
            const std::string problem = check_invariants(a.snapshot(), {}, 512, false, false, false);
            if (!problem.empty() && problems.size() < 5) {
              problems.push_back("round " + std::to_string(round) + ": " + problem);
            }
          }
        }
      }
      return;
    }
    gpukit::stream own(cpu);
    std::vector<tagged> live;
    std::uint64_t counter = 0;
    auto free_one = [&](const tagged& t) {
      own.enqueue_host([t, &corrupted] {
        if (!tag_intact(t)) corrupted.fetch_add(1);
      });
      a.deallocate(t.p);
    };
    for (int op = 0; op < 1500; ++op) {
      if (live.size() < 8 && pick(rng, 5) < 3) {
        tagged t;
        t.bytes = pick(rng, 8) == 0 ? MiB + pick(rng, 8 * MiB) : 64 + pick(rng, 64 * KiB);
        try {
          t.p = static_cast<unsigned char*>(a.allocate(t.bytes, own));
        } catch (const gpukit::out_of_memory_error&) {
          ooms.fetch_add(1);
          continue;
        }
        t.tag = (static_cast<std::uint64_t>(id) << 48) | ++counter;
        own.enqueue_host([t] { write_tag(t); });
        allocations.fetch_add(1);
        live.push_back(t);
      } else if (!live.empty()) {
        const std::size_t i = pick(rng, live.size());
        free_one(live[i]);
        live[i] = live.back();
        live.pop_back();
      }
    }
    for (const auto& t : live) free_one(t);
    own.synchronize();
    workers_left.fetch_sub(1);
  });
  for (const auto& p : problems) FAIL_CHECK(p);
  CHECK(corrupted.load() == 0);
  CHECK(a.stats().num_ooms == ooms.load());
  CHECK(a.max_memory_reserved() <= capacity);
  // A limit set when nothing is allocated releases the cache down to it at once.
  a.set_reserved_limit(4 * MiB);
  CHECK(a.memory_reserved() <= 4 * MiB);
  a.set_reserved_limit(gpukit::allocator_options::unlimited);
  MESSAGE(allocations.load() << " allocations, " << ooms.load() << " out-of-memory errors under changing limits");
  check_allocator_drained(a, allocations.load());
}

TEST_CASE("stress: exclusive leases and round-robin streams of one stream pool from many threads") {
  constexpr std::size_t shared_streams = 4;
  constexpr std::size_t exclusive_capacity = 3;
  constexpr int threads = 6;
  constexpr int iterations = 400;
  gpukit::stream_pool pool(cpu, shared_streams, {}, exclusive_capacity);
  std::mutex holders_mutex;
  std::map<unsigned long long, int> holders;  // stream id → leases holding it now
  std::size_t most_leased = 0;
  std::atomic<int> exclusivity_violations{0};
  std::atomic<int> granted{0};
  std::atomic<int> refused{0};
  std::atomic<int> work_done{0};
  std::atomic<int> work_enqueued{0};
  auto note_lease = [&](const gpukit::stream_pool::lease& l, int delta) {
    std::lock_guard<std::mutex> lock(holders_mutex);
    int& n = holders[l.view().id()];
    n += delta;
    if (n > 1) exclusivity_violations.fetch_add(1);
    std::size_t leased = 0;
    for (const auto& h : holders) leased += h.second > 0 ? 1 : 0;
    if (leased > most_leased) most_leased = leased;
  };
  auto enqueue_work = [&](gpukit::stream_view s) {
    work_enqueued.fetch_add(1);
    s.enqueue_host([&work_done] { work_done.fetch_add(1); });
  };
  run_threads(threads, [&](int id) {
    for (int i = 0; i < iterations; ++i) {
      enqueue_work(pool.next());
      std::optional<gpukit::stream_pool::lease> lease;
      if ((i + id) % 2 == 0) {
        lease = pool.try_acquire_exclusive();
      } else {
        try {
          lease.emplace(pool.acquire_exclusive());
        } catch (const gpukit::invalid_argument_error&) {
          // All leased: the documented refusal of the throwing variant.
        }
      }
      if (!lease) {
        refused.fetch_add(1);
        continue;
      }
      granted.fetch_add(1);
      note_lease(*lease, +1);
      enqueue_work(*lease);
      enqueue_work(*lease);
      note_lease(*lease, -1);
    }  // the lease ends here, work possibly still in flight: the next holder's work is ordered after it
  });
  // Every stream has run its work once synchronized: the shared ones through next(), the exclusive ones leased.
  for (std::size_t i = 0; i < pool.size(); ++i) pool.next().synchronize();
  {
    std::vector<gpukit::stream_pool::lease> all;
    while (auto l = pool.try_acquire_exclusive()) all.push_back(std::move(*l));
    CHECK(all.size() == exclusive_capacity);
    for (const auto& l : all) l.view().synchronize();
  }
  CHECK(exclusivity_violations.load() == 0);
  CHECK(most_leased <= exclusive_capacity);
  CHECK(granted.load() + refused.load() == threads * iterations);
  CHECK(granted.load() > 0);
  CHECK(work_done.load() == work_enqueued.load());
  CHECK(pool.exclusive_in_use() == 0);
  CHECK(pool.exclusive_available() == exclusive_capacity);
  CHECK(pool.created() == shared_streams);
  MESSAGE(granted.load() << " leases granted, " << refused.load() << " refused at capacity");
}

TEST_CASE("stress: threads copy_async onto one shared CPU stream, pageable and pinned, every direction") {
  gpukit::stream shared(cpu);
  const gpukit::stream_view s = shared.view();
  const auto staged_before = gpukit::default_staging_engine(cpu).stats();
  const std::size_t allocated_before = gpukit::memory_allocated(cpu);
  std::atomic<int> wrong{0};
  std::atomic<std::uint64_t> staged_to_device{0};
  std::atomic<std::uint64_t> staged_to_host{0};
  run_threads(4, [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 41);
    for (int i = 0; i < 60; ++i) {
      const std::size_t n = 1 + pick(rng, 40000);  // up to 160 KiB: several staging chunks
      std::vector<std::uint32_t> source(n);
      const auto first_value = static_cast<std::uint32_t>(id * 1000003 + i * 7919);
      for (std::size_t k = 0; k < n; ++k) source[k] = first_value + static_cast<std::uint32_t>(k);
      gpukit::device_buffer<std::uint32_t> first(n, s);
      gpukit::device_buffer<std::uint32_t> second(n, s);
      gpukit::pinned_buffer<std::uint32_t> pinned(n, cpu);
      const bool pinned_in = i % 2 == 0;
      const bool pinned_out = i % 3 == 0;
      if (pinned_in) {
        std::memcpy(pinned.data(), source.data(), n * sizeof(std::uint32_t));
        gpukit::copy_async(first, pinned, s);
      } else {
        gpukit::copy_async(first, source, s);  // staged; `source` could be reused at once
        staged_to_device.fetch_add(1);
      }
      gpukit::copy_async(second, first, s);
      if (pinned_out) {
        gpukit::copy_async(pinned, second, s);
        s.synchronize();  // a copy into pinned memory is complete once the stream passed it
        if (std::memcmp(pinned.data(), source.data(), n * sizeof(std::uint32_t)) != 0) wrong.fetch_add(1);
      } else {
        std::vector<std::uint32_t> back(n);
        gpukit::copy_async(back, second, s);  // returns with the data, after the stream's earlier work
        staged_to_host.fetch_add(1);
        if (back != source) wrong.fetch_add(1);
        s.synchronize();  // the pinned source of the first copy is read by then
      }
    }  // the buffers are freed in the shared stream's order
  });
  shared.synchronize();
  CHECK(wrong.load() == 0);
  const auto staged = gpukit::default_staging_engine(cpu).stats();
  CHECK(staged.to_device_calls - staged_before.to_device_calls == staged_to_device.load());
  CHECK(staged.to_host_calls - staged_before.to_host_calls == staged_to_host.load());
  CHECK(staged.background_failures == staged_before.background_failures);
  CHECK(gpukit::memory_allocated(cpu) == allocated_before);
}

TEST_CASE(
    "stress: one pinned pool shared by threads, with record_stream on a shared stream, cap changes and "
    "empty_cache") {
  gpukit::pinned_pool_options options;
  options.max_cached_bytes = MiB;
  gpukit::pinned_pool pool(gpukit::pinned_upstream(gpukit::device::kind::cpu), options);
  gpukit::stream shared(cpu);
  constexpr int workers = 4;
  constexpr int iterations = 600;
  std::atomic<int> corrupted{0};
  std::atomic<int> workers_left{workers};
  std::vector<std::string> problems;  // written by the control thread only
  auto reader = [&corrupted](const unsigned char* p, std::size_t bytes, unsigned char tag) {
    return [p, bytes, tag, &corrupted] {
      for (std::size_t k = 0; k < bytes; k += 512) {
        if (p[k] != tag) {
          corrupted.fetch_add(1);
          return;
        }
      }
    };
  };
  run_threads(workers + 1, [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 53);
    if (id == workers) {  // control: empty the cache and move the cap while blocks are pending and in use
      const std::size_t caps[] = {0, 256 * KiB, MiB, std::numeric_limits<std::size_t>::max()};
      for (int round = 0; round < 150 || workers_left.load() > 0; ++round) {
        if (round % 2 == 0) {
          (void)pool.empty_cache();
        } else {
          pool.set_max_cached_bytes(caps[pick(rng, 4)]);
        }
        const auto st = pool.stats();
        // A wrapped counter (a block released twice) shows as an absurd figure long before anything else.
        if ((st.reserved_bytes > 512 * MiB || st.pending_bytes > st.cached_bytes ||
             st.allocated_bytes > st.reserved_bytes) &&
            problems.size() < 5) {
          problems.push_back("round " + std::to_string(round) + ": reserved " + std::to_string(st.reserved_bytes) +
                             ", allocated " + std::to_string(st.allocated_bytes) + ", cached " +
                             std::to_string(st.cached_bytes) + ", pending " + std::to_string(st.pending_bytes));
        }
      }
      pool.set_max_cached_bytes(MiB);
      return;
    }
    gpukit::stream own(cpu);
    for (int i = 0; i < iterations; ++i) {
      const std::size_t bytes = (1 + pick(rng, 16)) * 4 * KiB;
      auto* p = static_cast<unsigned char*>(pool.allocate(bytes));
      const auto tag = static_cast<unsigned char>(id * 60 + i % 60);
      std::memset(p, tag, bytes);
      own.enqueue_host(reader(p, bytes, tag));
      if (i % 3 == 0) {  // another stream, shared with the other threads, reads it too
        shared.enqueue_host(reader(p, bytes, tag));
        pool.record_stream(p, shared);
      }
      if (i % 5 == 0) {
        gpukit::pooled_pinned_buffer<unsigned char> extra(bytes, pool);
        std::memset(extra.data(), tag, bytes);
        own.enqueue_host(reader(extra.data(), bytes, tag));
        extra.record_stream(own);
      }  // freed stream-ordered
      pool.deallocate(p, own);
    }
    own.synchronize();
    workers_left.fetch_sub(1);
  });
  shared.synchronize();
  for (const auto& p : problems) FAIL_CHECK(p);
  CHECK(corrupted.load() == 0);
  auto st = pool.stats();
  CHECK(st.allocated_bytes == 0);
  CHECK(st.active_blocks == 0);
  CHECK(st.pending_blocks == 0);
  CHECK(st.lost_blocks == 0);
  CHECK(st.allocations == static_cast<std::uint64_t>(workers * (iterations + iterations / 5)));
  CHECK(st.reserved_bytes <= MiB);  // the cap holds once nothing is pending
  (void)pool.empty_cache();
  st = pool.stats();
  CHECK(st.reserved_bytes == 0);
  CHECK(st.cached_bytes == 0);
  CHECK(st.upstream_allocations == st.upstream_frees);
}

TEST_CASE("stress: several prefetchers at once share the default pinned pool and allocator") {
  // A prefetcher's next() is called from one thread (its contract), so concurrency here is several prefetchers, each
  // with its own consumer thread and stream, over the process-wide pinned pool and CPU allocator.
  constexpr int consumers = 3;
  constexpr std::size_t batches = 100;
  constexpr std::size_t capacity = 4096;
  std::atomic<int> wrong{0};
  std::atomic<int> out_of_order{0};
  std::atomic<std::size_t> received{0};
  // Other users of the process-wide pool and allocator (staging rings) keep what they hold.
  const std::size_t pinned_before = gpukit::default_pinned_pool(cpu).stats().allocated_bytes;
  const std::size_t allocated_before = gpukit::memory_allocated(cpu);
  run_threads(consumers, [&](int id) {
    gpukit::stream consumer(cpu);
    const auto value = [id](std::size_t index, std::size_t k) {
      return static_cast<std::uint32_t>(static_cast<std::size_t>(id) * 100000 + index * 1000 + k % 1000);
    };
    {
      gpukit::prefetch_options options;
      options.depth = 2 + static_cast<std::size_t>(id % 2);
      options.producer_threads = 1 + static_cast<std::size_t>(id);  // 1 to 3 threads calling the producer
      gpukit::prefetcher<std::uint32_t> loader(
          consumer, capacity,
          [&value](std::size_t index, gpukit::span<std::uint32_t> out) -> std::size_t {
            if (index == batches) return 0;
            const std::size_t count = 1 + (index * 37) % out.size();
            for (std::size_t k = 0; k < count; ++k) out[k] = value(index, k);
            return count;
          },
          options);
      std::size_t expected = 0;
      while (auto batch = loader.next()) {
        if (batch->index() != expected++) out_of_order.fetch_add(1);
        const std::uint32_t* data = batch->data().data();
        const std::size_t count = batch->size();
        const std::size_t index = batch->index();
        // Consumer work on the batch: runs after its copy, and before the buffer is refilled.
        consumer.enqueue_host([data, count, index, &value, &wrong] {
          for (std::size_t k = 0; k < count; ++k) {
            if (data[k] != value(index, k)) {
              wrong.fetch_add(1);
              return;
            }
          }
        });
        received.fetch_add(1);
      }  // each batch is released at the end of its iteration
      consumer.synchronize();
    }
  });
  CHECK(wrong.load() == 0);
  CHECK(out_of_order.load() == 0);
  CHECK(received.load() == consumers * batches);
  CHECK(gpukit::default_pinned_pool(cpu).stats().allocated_bytes == pinned_before);
  CHECK(gpukit::memory_allocated(cpu) == allocated_before);
}

// The real host out-of-memory path (issue 12, defect 14): a request no machine can satisfy reaches ::operator new
// (nothrow), which returns nullptr and gpukit reports out_of_memory_error. Under ASan and TSan the runtimes' own
// allocators abort on such a request instead unless allocator_may_return_null=1: tests/run_all.sh sets it, and these
// defaults set it for a plain ctest in a sanitizer build too (options in the environment are added to them).
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }
namespace {
constexpr std::size_t beyond_any_host = std::size_t{1} << 50;  // 1 PiB: fails in any allocator, never overflows
}  // namespace

TEST_CASE("stress: a host allocation beyond the machine is out_of_memory_error from the caching allocator") {
  host_allocator a(cpu);  // unlimited: only the host says no
  const gpukit::stream_view s = gpukit::stream_view::default_stream(cpu);
  void* kept = a.allocate(MiB, s);  // a live block: the failed request must neither free nor corrupt it
  std::memset(kept, 7, MiB);
  try {
    (void)a.allocate(beyond_any_host, s);
    FAIL("a 1 PiB host allocation succeeded");
  } catch (const gpukit::out_of_memory_error& e) {
    CHECK(std::string(e.what()).find("tried to allocate 1.00 PiB") != std::string::npos);
  }
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.memory_allocated() == MiB);
  CHECK(static_cast<unsigned char*>(kept)[MiB - 1] == 7);
  void* after = a.allocate(2 * MiB, s);  // still usable
  std::memset(after, 8, 2 * MiB);
  a.deallocate(after);
  a.deallocate(kept);
  check_allocator_drained(a, 2);
}

TEST_CASE(
    "stress: a host allocation beyond the machine is out_of_memory_error from pinned buffers and the pinned "
    "pool") {
  CHECK_THROWS_AS(gpukit::pinned_buffer<unsigned char>(beyond_any_host, cpu), gpukit::out_of_memory_error);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  void* cached = pool.allocate(64 * KiB);
  pool.deallocate(cached);  // a free block the retry empties first
  CHECK_THROWS_AS((void)pool.allocate(beyond_any_host), gpukit::out_of_memory_error);
  auto st = pool.stats();
  CHECK(st.oom_retries == 1);
  CHECK(st.allocated_bytes == 0);
  CHECK(st.reserved_bytes == 0);      // the cache was emptied for the retry
  void* p = pool.allocate(64 * KiB);  // still usable
  std::memset(p, 1, 64 * KiB);
  pool.deallocate(p);
  (void)pool.empty_cache();
  st = pool.stats();
  CHECK(st.upstream_allocations == st.upstream_frees);
}
