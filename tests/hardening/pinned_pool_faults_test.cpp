// Fault injection for the pinned pool (issue 12): an upstream and an event layer (the pool's Upstream and Sync
// parameters) that fail their N-th call, for every N over whole scenarios (allocate, record_stream, deallocate,
// stats, empty_cache, set_max_cached_bytes, reset_peak_stats, block_size, destruction). After each call, faulty or
// not, the pool's books are compared with a recount kept by the test and by the upstream; after each fault the pool
// must serve a block again; at the end every block the upstream handed out is back, except the blocks the pool
// documents as lost (an event that could not be recorded). The number of faults injected is printed (README,
// Reliability).
#include "support.hpp"

#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/pinned_pool_impl.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
const gpukit::device cpu = gpukit::device::cpu();

enum class site { upstream_allocate, event_record, event_query, event_wait };

// Which calls a run counts and which of them fails.
struct fault_plan {
  bool upstream = false;     // count (and fail) the upstream's allocate calls
  bool events = false;       // count (and fail) the event layer's record, query and wait calls
  bool upstream_oom = true;  // an upstream failure is out_of_memory_error (else a cuda_error, not retried)
  long fail_at = 0;          // the counted call that fails, from 1 (0: none)
  long consecutive = 1;      // calls failing from fail_at on (2: the pool's out-of-memory retry fails too)
};

// What both layers share: the fault plan, the upstream's books, and the streams' progress.
struct world {
  fault_plan plan;
  long calls = 0;
  long injected = 0;
  bool paused = false;  // while the test reads the books: checks must not consume faults
  std::map<site, long> injected_at;
  site last_site = site::upstream_allocate;

  // Upstream books.
  std::map<void*, std::size_t> live;  // handed out by the upstream and not given back
  long allocations = 0;
  long frees = 0;
  long oom_injected = 0;
  std::vector<std::string> violations;

  // Simulated streams: work submitted and completed so far, by stream id.
  std::map<unsigned long long, long> submitted;
  std::map<unsigned long long, long> completed;
  // Blocks freed with streams: the work each must wait for (stream id, submitted count at the free).
  std::map<void*, std::vector<std::pair<unsigned long long, long>>> waits_for;
  bool pool_destroying = false;  // the destructor releases pending blocks even when a wait fails (documented)

  bool should_fail(site where, bool counted) {
    if (paused || !counted) return false;
    ++calls;
    if (plan.fail_at == 0 || calls < plan.fail_at || calls >= plan.fail_at + plan.consecutive) return false;
    ++injected;
    ++injected_at[where];
    last_site = where;
    return true;
  }

  bool work_done(void* p) const {
    auto it = waits_for.find(p);
    if (it == waits_for.end()) return true;
    for (const auto& w : it->second) {
      auto c = completed.find(w.first);
      if ((c == completed.end() ? 0 : c->second) < w.second) return false;
    }
    return true;
  }

  ~world() {
    for (const auto& block : live) ::operator delete(block.first, std::align_val_t(256));  // lost blocks
  }
};

struct faulty_upstream {
  std::shared_ptr<world> w;

  void* allocate(std::size_t bytes) {
    if (w->should_fail(site::upstream_allocate, w->plan.upstream)) {
      if (w->plan.upstream_oom) {
        ++w->oom_injected;
        throw gpukit::out_of_memory_error("faulty_upstream: injected out of memory");
      }
      throw gpukit::cuda_error("faulty_upstream: injected failure", cudaErrorInvalidValue, "cudaHostAlloc");
    }
    void* p = ::operator new(bytes, std::align_val_t(256));
    w->live.emplace(p, bytes);
    ++w->allocations;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept {
    auto it = w->live.find(p);
    if (it == w->live.end() || it->second != bytes) {
      w->violations.emplace_back("upstream: a block released twice, or with the wrong size");
      return;
    }
    if (!w->pool_destroying && !w->work_done(p)) {
      w->violations.emplace_back("upstream: a block released while a stream may still use it");
    }
    w->live.erase(it);
    w->waits_for.erase(p);
    ++w->frees;
    ::operator delete(p, std::align_val_t(256));
  }
  bool page_locked() const noexcept { return false; }
};

struct faulty_sync {
  std::shared_ptr<world> w;

  struct marker {
    unsigned long long stream = 0;
    long position = 0;
  };
  marker record(gpukit::stream_view s) {
    if (w->should_fail(site::event_record, w->plan.events)) {
      throw gpukit::cuda_error("faulty_sync: injected failure", cudaErrorLaunchFailure, "cudaEventRecord");
    }
    return {s.id(), w->submitted[s.id()]};
  }
  bool ready(const marker& m) {
    if (w->should_fail(site::event_query, w->plan.events)) {
      throw gpukit::cuda_error("faulty_sync: injected failure", cudaErrorLaunchFailure, "cudaEventQuery");
    }
    return w->completed[m.stream] >= m.position;
  }
  void wait(const marker& m) {
    if (w->should_fail(site::event_wait, w->plan.events)) {
      throw gpukit::cuda_error("faulty_sync: injected failure", cudaErrorLaunchFailure, "cudaEventSynchronize");
    }
    long& done = w->completed[m.stream];
    done = std::max(done, m.position);
  }
  void recycle(marker&&) noexcept {}
};

using faulty_pool = gpukit::basic_pinned_pool<faulty_upstream, faulty_sync>;

// One scenario run against a pool: the calls, the test's own books, and the checks after each call.
class scenario {
 public:
  scenario(std::shared_ptr<world> w, std::size_t cap, const std::vector<gpukit::stream_view>& streams)
      : w_(std::move(w)), cap_(cap), streams_(streams) {}

  void run() {
    gpukit_test::captured_warnings warnings;
    {
      gpukit::pinned_pool_options options;
      options.max_cached_bytes = cap_;
      faulty_pool pool(faulty_upstream{w_}, options, faulty_sync{w_});
      pool_ = &pool;
      play();
      for (auto& h : std::vector<std::pair<void*, held_block>>(held_.begin(), held_.end())) free_block(h.first, -1);
      leave_one_pending();
      w_->pool_destroying = true;
      pool_ = nullptr;
    }
    // Every block is back, but the lost ones: kept out of use for good, as deallocate documents.
    CHECK(w_->allocations == w_->frees + static_cast<long>(lost_.size()));
    std::set<void*> live;
    for (const auto& b : w_->live) live.insert(b.first);
    CHECK(live == lost_);
    CHECK(warnings.contains("destroyed with") == !lost_.empty());
    for (const auto& v : w_->violations) FAIL_CHECK(v);
    lost_blocks = static_cast<long>(lost_.size());
  }

  std::uint64_t cap_releases = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t events_recorded = 0;
  int failed_calls = 0;
  long lost_blocks = 0;  // blocks whose event could not be recorded: never released (documented)

 private:
  struct held_block {
    std::size_t size = 0;
    std::size_t requested = 0;
    std::set<int> streams;
  };

  // Work on a stream that uses a block is submitted before the block is freed: its event must wait for that work.
  void play() {
    void* a = allocate(64 * KiB);
    void* b = allocate(256 * KiB);
    void* c = allocate(MiB);
    void* d = allocate(3 * MiB);
    void* x = allocate(32 * KiB);
    free_block(x, -1);
    void* y = allocate(32 * KiB);  // x again, from the cache
    record(a, 0);
    record(b, 0);
    record(b, 1);
    submit(0);
    submit(1);
    free_block(a, -1);             // pending on stream 0
    free_block(b, -1);             // pending on streams 0 and 1
    free_block(c, -1);             // free
    void* e = allocate(64 * KiB);  // a is pending: a new block
    void* f = allocate(MiB);       // c, from the cache (unless the cap released it)
    complete(0);
    call("stats", [&] { (void)pool_->stats(); });  // a is promoted, b still waits for stream 1
    set_cap(MiB / 2);                              // free blocks above it go
    submit(1);
    free_block(d, 1);  // record_stream + deallocate
    complete(1);
    call("empty_cache", [&] { (void)pool_->empty_cache(); });  // promotes b and d above the cap (issue 12, 1)
    set_cap(cap_);
    void* g = allocate(64 * KiB);
    free_block(e, -1);
    submit(0);
    free_block(f, 0);
    call("reset_peak_stats", [&] { pool_->reset_peak_stats(); });
    if (g != nullptr) call("block_size", [&] { CHECK(pool_->block_size(g) == held_.at(g).size); });
    void* h = allocate(3 * MiB);
    submit(2);
    free_block(g, 2);
    complete(0);
    void* i = allocate(MiB);  // f, once stream 0 has passed
    void* j = allocate(1000);
    free_block(h, -1);
    submit(0);
    free_block(i, 0);
    free_block(j, -1);
    free_block(y, -1);
    set_cap(2 * MiB);
    complete(0);
    complete(2);
    void* k = allocate(3 * MiB);
    call("empty_cache", [&] { (void)pool_->empty_cache(); });
    submit(1);
    free_block(k, 1);
    complete(1);
    call("stats", [&] { (void)pool_->stats(); });
  }

  // A block freed on a stream that has not passed it when the pool is destroyed: the destructor waits for it.
  void leave_one_pending() {
    void* p = allocate(128 * KiB);
    if (p == nullptr) return;
    submit(0);
    free_block(p, 0);
  }

  // Runs one pool call: a failure must be the injected one; after it the pool must still serve a block. The books
  // are checked after every call.
  // `on_failure` applies the documented outcome of a failure to the test's books first.
  template <class Call, class OnFailure>
  bool call(const char* what, Call&& c, OnFailure&& on_failure) {
    const long before = w_->injected;
    bool failed = false;
    try {
      c();
    } catch (const gpukit::error& e) {
      failed = true;
      ++failed_calls;
      const std::string message = e.what();
      if (w_->injected == before || message.find("injected") == std::string::npos) {
        FAIL_CHECK(std::string(what) << " failed without an injected fault: " << message);
      }
      on_failure();
    }
    check_books(what);
    if (failed) check_usable(what);
    return !failed;
  }
  template <class Call>
  bool call(const char* what, Call&& c) {
    return call(what, std::forward<Call>(c), [] {});
  }

  void* allocate(std::size_t bytes) {
    void* p = nullptr;
    const long oom_before = w_->oom_injected;
    const bool ok = call("allocate", [&] {
      p = pool_->allocate(bytes);
      note_allocated(p, bytes);
    });
    if (!ok) return nullptr;                                              // strong guarantee: nothing was handed out
    if (w_->oom_injected > oom_before) CHECK(w_->plan.consecutive == 1);  // served by the retry
    return p;
  }

  void note_allocated(void* p, std::size_t bytes) {
    if (held_.count(p) != 0) FAIL_CHECK("allocate handed out a block twice");
    if (lost_.count(p) != 0) FAIL_CHECK("allocate handed out a lost block");
    if (!w_->work_done(p)) FAIL_CHECK("allocate handed out a block a stream may still use");
    w_->waits_for.erase(p);
    held_block h;
    h.size = gpukit::pinned_size_class(bytes);
    h.requested = bytes;
    held_[p] = h;
  }

  void record(void* p, int stream) {
    if (p == nullptr) return;
    call("record_stream", [&] { pool_->record_stream(p, streams_.at(stream)); });
    held_.at(p).streams.insert(stream);
  }

  // deallocate(p) (stream -1) or deallocate(p, stream). A failure can only be an event that could not be recorded:
  // the block is lost then (documented).
  void free_block(void* p, int stream) {
    if (p == nullptr) return;
    held_block& h = held_.at(p);
    if (stream >= 0) h.streams.insert(stream);
    std::vector<std::pair<unsigned long long, long>> waits;
    for (int s : h.streams) waits.emplace_back(streams_.at(s).id(), w_->submitted[streams_.at(s).id()]);
    const std::size_t size = h.size;
    held_.erase(p);
    if (!waits.empty()) w_->waits_for[p] = waits;
    call(
        "deallocate",
        [&] {
          if (stream >= 0) {
            pool_->deallocate(p, streams_.at(stream));
          } else {
            pool_->deallocate(p);
          }
        },
        [&] {
          CHECK(w_->last_site == site::event_record);
          lost_.insert(p);
          lost_bytes_ += size;
        });
  }

  // The new cap is in force even when polling a pending block fails (documented): the books are checked against it.
  void set_cap(std::size_t bytes) {
    current_cap_ = bytes;
    call("set_max_cached_bytes", [&] { pool_->set_max_cached_bytes(bytes); });
    CHECK(pool_->options().max_cached_bytes == bytes);
  }

  void submit(int stream) { ++w_->submitted[streams_.at(stream).id()]; }
  void complete(int stream) {
    const auto id = streams_.at(stream).id();
    w_->completed[id] = w_->submitted[id];
  }

  // The pool's statistics against a recount from the test's and the upstream's books. stats() polls every pending
  // block (no fault while paused), so a cached block is pending exactly when the work it waits for is not done.
  void check_books(const char* after) {
    INFO("after " << std::string(after));
    w_->paused = true;
    const gpukit::pinned_pool_stats st = pool_->stats();
    w_->paused = false;
    std::size_t held_bytes = 0;
    std::size_t requested = 0;
    for (const auto& h : held_) {
      held_bytes += h.second.size;
      requested += h.second.requested;
    }
    std::size_t reserved = 0;
    std::size_t cached = 0;
    std::size_t cached_blocks = 0;
    std::size_t pending = 0;
    std::size_t pending_blocks = 0;
    for (const auto& b : w_->live) {
      reserved += b.second;
      if (held_.count(b.first) != 0 || lost_.count(b.first) != 0) continue;
      cached += b.second;
      ++cached_blocks;
      if (!w_->work_done(b.first)) {
        pending += b.second;
        ++pending_blocks;
      }
    }
    CHECK(st.allocated_bytes == held_bytes);
    CHECK(st.requested_bytes == requested);
    CHECK(st.active_blocks == held_.size());
    CHECK(st.reserved_bytes == reserved);
    CHECK(st.cached_bytes == cached);
    CHECK(st.cached_bytes == st.reserved_bytes - st.allocated_bytes - lost_bytes_);
    CHECK(st.pending_bytes == pending);
    CHECK(st.pending_blocks == pending_blocks);
    CHECK(st.free_blocks == cached_blocks - pending_blocks);
    CHECK(st.lost_blocks == lost_.size());
    CHECK(st.upstream_allocations == static_cast<std::uint64_t>(w_->allocations));
    CHECK(st.upstream_frees == static_cast<std::uint64_t>(w_->frees));
    CHECK(st.oom_retries == static_cast<std::uint64_t>(w_->oom_injected / w_->plan.consecutive));
    CHECK(st.allocated_bytes <= st.allocated_bytes_peak);
    CHECK(st.reserved_bytes <= st.reserved_bytes_peak);
    if (st.cached_bytes - st.pending_bytes > current_cap_) CHECK(st.free_blocks == 0);  // only free blocks are capped
    cap_releases = st.cap_releases;
    cache_hits = st.cache_hits;
    events_recorded = st.events_recorded;
  }

  // After a fault: a block can be allocated and freed again (no fault is left to inject in this run).
  void check_usable(const char* after) {
    INFO("usable after a fault in " << std::string(after));
    w_->paused = true;
    void* p = nullptr;
    CHECK_NOTHROW(p = pool_->allocate(32 * KiB));
    CHECK(p != nullptr);
    if (p != nullptr) {
      note_allocated(p, 32 * KiB);
      held_.erase(p);
      CHECK_NOTHROW(pool_->deallocate(p));
    }
    w_->paused = false;
    check_books("the usability probe");
  }

  std::shared_ptr<world> w_;
  std::size_t cap_;
  std::size_t current_cap_ = cap_;
  std::vector<gpukit::stream_view> streams_;
  faulty_pool* pool_ = nullptr;
  std::map<void*, held_block> held_;
  std::set<void*> lost_;
  std::size_t lost_bytes_ = 0;
};

struct mode {
  std::string name;
  fault_plan plan;
};

}  // namespace

TEST_CASE("fault injection: every N-th upstream or event call of the pinned pool fails, over whole scenarios") {
  gpukit::stream s0(cpu);
  gpukit::stream s1(cpu);
  const std::vector<gpukit::stream_view> streams{s0, s1, gpukit::stream_view::default_stream(cpu)};

  fault_plan upstream_oom;
  upstream_oom.upstream = true;
  fault_plan upstream_oom_twice = upstream_oom;
  upstream_oom_twice.consecutive = 2;
  fault_plan upstream_error = upstream_oom;
  upstream_error.upstream_oom = false;
  fault_plan events;
  events.events = true;
  fault_plan both = events;
  both.upstream = true;
  const mode modes[] = {{"upstream out of memory (retried)", upstream_oom},
                        {"upstream out of memory twice (retry fails)", upstream_oom_twice},
                        {"upstream error (not retried)", upstream_error},
                        {"event record/query/wait", events},
                        {"either layer, one count", both}};
  const std::size_t caps[] = {std::size_t{2} << 30, MiB};

  long total_faults = 0;
  long total_runs = 0;
  long total_lost = 0;
  std::map<site, long> by_site;
  for (const mode& m : modes) {
    long mode_faults = 0;
    for (std::size_t cap : caps) {
      INFO("mode: " << m.name << ", cap " << cap);
      bool clean_run_seen = false;
      for (long n = 1; n <= 10000 && !clean_run_seen; ++n) {
        INFO("failing call " << n);
        auto w = std::make_shared<world>();
        w->plan = m.plan;
        w->plan.fail_at = n;
        scenario sc(w, cap, streams);
        sc.run();
        ++total_runs;
        total_lost += sc.lost_blocks;
        mode_faults += w->injected;
        for (const auto& s : w->injected_at) by_site[s.first] += s.second;
        if (w->injected == 0) {
          // N is past the scenario's last counted call: a run without faults, which must exercise the paths.
          clean_run_seen = true;
          CHECK(sc.failed_calls == 0);
          CHECK(sc.cache_hits > 0);
          CHECK(sc.events_recorded > 0);
          CHECK(sc.cap_releases > 0);
          CHECK(n > 1);
        } else {
          CHECK(w->injected <= m.plan.consecutive);
        }
      }
      CHECK(clean_run_seen);
    }
    MESSAGE("pinned pool fault injection, " << m.name << ": " << mode_faults << " faults injected");
    CHECK(mode_faults > 0);
    total_faults += mode_faults;
  }
  CHECK(by_site[site::upstream_allocate] > 0);
  CHECK(by_site[site::event_record] > 0);
  CHECK(by_site[site::event_query] > 0);
  CHECK(by_site[site::event_wait] > 0);
  MESSAGE("pinned pool fault injection: " << total_faults << " faults injected in " << total_runs
                                          << " scenario runs (upstream allocate " << by_site[site::upstream_allocate]
                                          << ", event record " << by_site[site::event_record] << ", event query "
                                          << by_site[site::event_query] << ", event wait " << by_site[site::event_wait]
                                          << "); after every run the upstream had "
                                          << "every block back but the " << total_lost
                                          << " lost to failed event records (kept out of use, as documented)");
  CHECK(total_lost == by_site[site::event_record]);  // one lost block per failed record, no more
}
