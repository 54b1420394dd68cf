// Fault injection for the caching allocator (issue 12): an upstream and an event layer that fail their N-th call,
// for every N over whole scenarios (several streams, record_stream, deallocate on another stream, cross-stream reuse,
// empty_cache, trim, limits, a destroyed stream, out of memory). After every step, whether it failed or not: the
// statistics equal a recomputation from the blocks, the pointer map matches, nothing the test holds was lost, a
// failure is either the injected one or the documented out_of_memory_error; at the end of each run the allocator still
// serves every stream and, once everything is freed, gives every byte back to the upstream.
//
// Two worlds: the deterministic fake streams and events of tests/memory (every event call may fail), over a fake
// address space; and gpukit's real CPU streams and events (gpukit::stream_ops behind a front that fails the chosen
// call) over host memory, where a block reused or released while a held stream still writes to it is a
// heap-use-after-free under AddressSanitizer.
#include "memory/allocator_support.hpp"
#include "failing_heap.hpp"
#include "support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

using namespace gpukit_test;

namespace {

/// The failure a faulty layer injects (distinct from anything gpukit throws, so a test sees where a failure came from).
struct injected_fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Which layer fails, how, and at which of its calls. One plan per run; the layers count their calls in it.
struct fault_plan {
  enum class layer { upstream, events, host_heap };
  enum class mode {
    throws,              // the call throws (a CUDA error other than out of memory, a broken event)
    out_of_memory,       // the upstream returns nullptr (its documented out of memory) once
    out_of_memory_burst  // ... for `burst` calls in a row: enough to exhaust the allocator's retries
  };
  layer target = layer::upstream;
  mode how = mode::throws;
  std::uint64_t fail_at = 0;  // 1-based call number of the target layer; 0: never
  std::uint64_t burst = 1;
  std::uint64_t calls = 0;
  std::uint64_t injected = 0;

  bool should_fail(layer l) {
    if (l != target) return false;
    ++calls;
    if (fail_at == 0 || calls < fail_at || calls >= fail_at + burst) return false;
    ++injected;
    return true;
  }
};

/// The plan whose host_heap layer operator new consults: set on the test's thread while an allocator call runs (the
/// fake world is single-threaded, so the N-th allocation is the same one in every run).
thread_local fault_plan* heap_plan = nullptr;

bool heap_fails_now() { return heap_plan != nullptr && heap_plan->should_fail(fault_plan::layer::host_heap); }

/// Arms the host heap's failure for one allocator call, when the plan targets it.
class heap_armed {
 public:
  explicit heap_armed(fault_plan& plan) noexcept {
    gpukit_test::heap_fails = heap_fails_now;
    if (plan.target == fault_plan::layer::host_heap) heap_plan = &plan;
  }
  heap_armed(const heap_armed&) = delete;
  heap_armed& operator=(const heap_armed&) = delete;
  ~heap_armed() { heap_plan = nullptr; }
};

/// A capacity-limited fake address space whose allocate() fails as the plan says.
class faulty_upstream {
 public:
  faulty_upstream(std::size_t capacity, fault_plan* plan, bool synchronizes)
      : space_(capacity), plan_(plan), synchronizes_(synchronizes) {}

  void* allocate(std::size_t bytes) {
    if (plan_->should_fail(fault_plan::layer::upstream)) {
      if (plan_->how == fault_plan::mode::throws) {
        throw injected_fault("injected upstream failure at call " + std::to_string(plan_->calls));
      }
      return nullptr;
    }
    return space_.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept { space_.deallocate(p, bytes); }
  gpukit::upstream_memory_info memory_info() const { return space_.memory_info(); }
  /// false: host-like memory, so the allocator records fences and waits for them before returning segments.
  bool synchronizes_on_free() const noexcept { return synchronizes_; }
  std::size_t used() const { return space_.used(); }

 private:
  gpukit::address_space_upstream space_;
  fault_plan* plan_;
  bool synchronizes_;
};

/// The deterministic fake streams and events, each call of which may fail as the plan says (an event layer whose
/// cudaEventCreate, cudaEventRecord, cudaEventQuery, cudaEventSynchronize or cudaStreamWaitEvent fails).
struct faulty_stream_ops : fake_stream_ops {
  fault_plan* plan = nullptr;

  void maybe_fail(const char* call) const {
    if (plan->should_fail(fault_plan::layer::events)) {
      throw injected_fault(std::string("injected failure of ") + call + " at call " + std::to_string(plan->calls));
    }
  }
  fake_event create_event(gpukit::device d) const {
    maybe_fail("create_event");
    return fake_stream_ops::create_event(d);
  }
  void record(fake_event& e, const fake_stream& s) const {
    maybe_fail("record");
    fake_stream_ops::record(e, s);
  }
  bool ready(const fake_event& e) const {
    maybe_fail("ready");
    return fake_stream_ops::ready(e);
  }
  void synchronize(const fake_event& e) const {
    maybe_fail("synchronize");
    fake_stream_ops::synchronize(e);
  }
  void wait(const fake_event& e, const fake_stream& s) const {
    maybe_fail("wait");
    fake_stream_ops::wait(e, s);
  }
  bool finished(int s) const {
    maybe_fail("finished");
    return fake_stream_ops::finished(s);
  }
  void wait_finished(int s) const {
    maybe_fail("wait_finished");
    fake_stream_ops::wait_finished(s);
  }
};

using faulty_allocator = gpukit::basic_caching_allocator<faulty_upstream, faulty_stream_ops>;

struct configuration {
  const char* name;
  gpukit::allocator_options options;
  bool upstream_synchronizes;
};

std::vector<configuration> configurations() {
  gpukit::allocator_options cross = gpukit::allocator_options::pytorch();
  cross.cross_stream_reuse = true;
  gpukit::allocator_options large_front;
  large_front.front_cache_large = true;  // the scenario's steps run with large blocks in the front slots
  return {{"gpukit defaults, host-like upstream", gpukit::allocator_options{}, false},
          {"gpukit defaults, cudaMalloc-like upstream", gpukit::allocator_options{}, true},
          {"pytorch constants with cross-stream reuse, host-like upstream", cross, false},
          {"gpukit with large blocks in front, cudaMalloc-like upstream", large_front, true}};
}

/// What the runs of one plan saw, over every N.
struct tally {
  std::uint64_t runs = 0;
  std::uint64_t injected = 0;       // faults the layers injected
  std::uint64_t surfaced = 0;       // ... that reached the caller as the injected exception
  std::uint64_t out_of_memory = 0;  // steps that ended in out_of_memory_error
  std::uint64_t steps_checked = 0;  // invariant checks made
  std::uint64_t warnings = 0;       // failures reported through gpukit::warn (destructor-like paths)
};

/// One run of the scenario with one fault plan. Every step is checked; the first problem is kept (empty: none).
class run {
 public:
  run(const configuration& config, fault_plan& plan, tally& counts)
      : plan_(plan),
        counts_(counts),
        a_(gpukit::device::cpu(), config.options, GiB, &plan, config.upstream_synchronizes) {
    a_.stream_operations().world = &world_;
    a_.stream_operations().plan = &plan;
    for (auto& s : s_) s = fake_stream{world_.add_stream()};
    live_.reserve(64);  // the steps' own bookkeeping never allocates while the host heap may fail
  }
  run(const run&) = delete;
  run& operator=(const run&) = delete;

  /// The whole scenario: allocations of every pool on three streams, uses by other streams, frees in and out of
  /// stream order, cache releases, limits, genuine out of memory, a stream destroyed with memory live.
  void scenario() {
    const std::uint64_t x = alloc(0, 1000);       // small pool
    const std::uint64_t y = alloc(0, 3 * MiB);    // a shared (medium) segment
    const std::uint64_t z = alloc(1, 40 * MiB);   // ... another, on stream 1
    const std::uint64_t h = alloc(1, 300 * MiB);  // a huge block with a segment of its own
    const std::uint64_t w = alloc(2, 200 * KiB);
    world_.enqueue(s_[1].id);
    world_.enqueue(s_[2].id);
    record(x, 1);
    record(y, 2);
    world_.enqueue(s_[0].id);  // stream 0 busy: frees on it need a fence when the upstream does not synchronize
    free(x);                   // pending until stream 1's work completes
    free_on(y, 2);             // after stream 2's work too
    const std::uint64_t x2 = alloc(0, 1000);  // polls the pending events
    world_.complete(s_[1].id);
    const std::uint64_t y2 = alloc(0, 2 * MiB);
    free(z);
    world_.enqueue(s_[1].id);
    const std::uint64_t z2 = alloc(0, 30 * MiB);  // with cross-stream reuse: stream 1's block, waited for
    free(w);
    // Many frees pending on one busy stream: its queue of pending events grows past its first node (21 records in
    // libstdc++'s std::deque).
    world_.enqueue(s_[1].id);
    std::uint64_t batch[24] = {};
    for (std::uint64_t& p : batch) {
      p = alloc(0, 1000);
      record(p, 1);
    }
    for (std::uint64_t p : batch) free(p);
    step("empty_cache", [&] { a_.empty_cache(); });
    world_.complete_all();
    const std::uint64_t big = alloc(0, 900 * MiB);  // more than the upstream has left: out of memory
    step("set_reserved_limit", [&] { a_.set_reserved_limit(a_.memory_reserved() + 10 * MiB); });
    const std::uint64_t over = alloc(2, 50 * MiB);  // over the limit: out of memory
    const std::uint64_t fits = alloc(2, 5 * MiB);   // a segment sized to fit under the limit
    step("set_reserved_limit", [&] { a_.set_reserved_limit(gpukit::allocator_options::unlimited); });
    free(h);
    step("trim", [&] { (void)a_.trim(64 * MiB); });
    // Stream 2 is destroyed while memory allocated on it is live (a program bug the allocator reports).
    world_.enqueue(s_[2].id);
    world_.destroy(s_[2].id);
    free(fits);
    free(over);
    s_[2] = fake_stream{world_.add_stream()};
    const std::uint64_t fresh = alloc(2, 4 * MiB);  // blocks of the destroyed stream are retired once its work is done
    world_.complete_all();
    const std::uint64_t again = alloc(2, 4 * MiB);
    for (std::uint64_t p : {x2, y2, z2, big, fresh, again}) free(p);
    step("empty_cache", [&] { a_.empty_cache(); });
  }

  /// After the fault: the allocator serves every stream, and once everything is freed returns every byte.
  void finish() {
    plan_.fail_at = 0;
    world_.complete_all();
    for (int i = 0; i < 3; ++i) {
      for (std::size_t bytes : {std::size_t{512}, 2 * MiB, 70 * MiB}) {
        void* p = nullptr;
        try {
          p = a_.allocate(bytes, s_[i]);
        } catch (const std::exception& e) {
          note(std::string("unusable after the fault: allocate(") + std::to_string(bytes) + ") threw " + e.what());
          continue;
        }
        live_.push_back(held{reinterpret_cast<std::uintptr_t>(p), bytes});
      }
    }
    check("allocations after the fault");
    while (!live_.empty()) {
      const std::uintptr_t p = live_.back().address;
      try {
        a_.deallocate(reinterpret_cast<void*>(p));
      } catch (const std::exception& e) {
        note(std::string("unusable after the fault: deallocate threw ") + e.what());
      }
      live_.pop_back();
    }
    world_.complete_all();
    a_.empty_cache();
    check("after freeing everything");
    if (a_.memory_reserved() != 0 || a_.upstream().used() != 0) {
      note("leaked: " + std::to_string(a_.memory_reserved()) + " bytes reserved, " +
           std::to_string(a_.upstream().used()) + " bytes still out of the upstream");
    }
    const auto s = a_.stats();
    if (s.allocation.all().current != 0 || s.active.all().current != 0 || s.requested_bytes.all().current != 0) {
      note("statistics not back to zero after freeing everything");
    }
    // Only two things may be reported: a free after the allocation's stream was destroyed (the scenario does that on
    // purpose) and an injected failure of a wait on a release path (which cannot throw).
    for (const std::string& m : warnings_.messages()) {
      const bool heap_failure =
          plan_.target == fault_plan::layer::host_heap && m.find("bad_alloc") != std::string::npos;
      if (m.find("was destroyed while the allocation was live") == std::string::npos &&
          m.find("failed: injected failure of") == std::string::npos && !heap_failure) {
        note("an unexpected warning: " + m);
      }
    }
    counts_.warnings += warnings_.messages().size();
  }

  const std::string& problem() const { return problem_; }

 private:
  struct held {
    std::uintptr_t address;
    std::size_t bytes;
  };

  static void* pointer(std::uint64_t p) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)); }

  void note(const std::string& what) {
    if (problem_.empty()) problem_ = what;
  }

  void check(const char* after) {
    ++counts_.steps_checked;
    std::vector<live_allocation> live;
    for (const auto& h : live_) live.push_back(live_allocation{h.address, h.bytes});
    const std::string problem = check_invariants(a_.snapshot(), live, a_.options().rounding);
    if (!problem.empty()) note(std::string("after ") + after + ": " + problem);
  }

  /// Runs one step: it succeeds, or fails with the injected fault or out_of_memory_error (anything else is a
  /// problem); either way the invariants hold afterwards.
  template <class Step>
  void step(const char* name, Step&& body) {
    try {
      const heap_armed armed(plan_);
      body();
    } catch (const injected_fault&) {
      ++counts_.surfaced;
    } catch (const std::bad_alloc&) {
      if (plan_.target != fault_plan::layer::host_heap) note(std::string(name) + " threw std::bad_alloc");
      ++counts_.surfaced;
    } catch (const gpukit::out_of_memory_error& e) {
      ++counts_.out_of_memory;
      if (std::string(e.what()).rfind("gpukit: out of memory on cpu: tried to allocate", 0) != 0) {
        note(std::string(name) + ": an out_of_memory_error without the documented message: " + e.what());
      }
    } catch (const std::exception& e) {
      note(std::string(name) + " threw an undocumented exception: " + e.what());
    }
    check(name);
  }

  /// 0 when the allocation failed (then there is nothing to free).
  std::uint64_t alloc(int stream, std::size_t bytes) {
    void* p = nullptr;
    step("allocate", [&] {
      p = a_.allocate(bytes, s_[stream]);
      live_.push_back(held{reinterpret_cast<std::uintptr_t>(p), bytes});
    });
    return reinterpret_cast<std::uintptr_t>(p);
  }

  void forget(std::uint64_t p) {
    for (std::size_t i = 0; i < live_.size(); ++i) {
      if (live_[i].address == p) {
        live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
  }

  /// A failed free leaves the allocation live (documented): it stays held and is freed in finish().
  void free(std::uint64_t p) {
    if (p == 0) return;
    step("deallocate", [&] {
      a_.deallocate(pointer(p));
      forget(p);
    });
  }
  void free_on(std::uint64_t p, int stream) {
    if (p == 0) return;
    step("deallocate(p, stream)", [&] {
      a_.deallocate(pointer(p), s_[stream]);
      forget(p);
    });
  }
  void record(std::uint64_t p, int stream) {
    if (p == 0) return;
    step("record_stream", [&] { a_.record_stream(pointer(p), s_[stream]); });
  }

  fault_plan& plan_;
  tally& counts_;
  captured_warnings warnings_;  // failures on release paths are reported, not thrown
  fake_world world_;
  faulty_allocator a_;
  fake_stream s_[3];
  std::vector<held> live_;
  std::string problem_;
};

/// Runs the scenario once per N = 1, 2, ... (fault at the N-th call of the target layer) until a run's layer made
/// fewer than N calls, for every configuration. Returns the tally; every run's problem fails the test case.
tally inject_everywhere(fault_plan::layer target, fault_plan::mode how, std::uint64_t burst) {
  tally counts;
  for (const configuration& config : configurations()) {
    for (std::uint64_t n = 1;; ++n) {
      fault_plan plan;
      plan.target = target;
      plan.how = how;
      plan.fail_at = n;
      plan.burst = burst;
      std::string problem;
      {
        run r(config, plan, counts);
        r.scenario();
        const std::uint64_t calls = plan.calls;
        r.finish();
        problem = r.problem();
        if (calls < n) break;  // the layer was never called an N-th time: every N is covered
      }
      ++counts.runs;
      counts.injected += plan.injected;
      INFO(std::string(config.name) << ", fault at call " << n);
      CHECK(problem == "");
      CHECK(plan.injected >= 1);
    }
  }
  return counts;
}

// --- The real CPU backend (gpukit::stream_ops over CPU streams and events) behind a failing front ---

/// gpukit's own stream and event operations, each of which may fail first as the plan says (CPU events cannot be
/// made to fail from outside, so the failure is injected in front of the call, as a failing driver would).
struct faulty_cpu_stream_ops : gpukit::stream_ops {
  fault_plan* plan = nullptr;

  void maybe_fail(const char* call) const {
    if (plan->should_fail(fault_plan::layer::events)) {
      throw injected_fault(std::string("injected failure of ") + call + " at call " + std::to_string(plan->calls));
    }
  }
  gpukit::event create_event(gpukit::device d) const {
    maybe_fail("create_event");
    return gpukit::stream_ops::create_event(d);
  }
  void record(gpukit::event& e, const gpukit::stream_view& s) const {
    maybe_fail("record");
    gpukit::stream_ops::record(e, s);
  }
  bool ready(const gpukit::event& e) const {
    maybe_fail("ready");
    return gpukit::stream_ops::ready(e);
  }
  void synchronize(const gpukit::event& e) const {
    maybe_fail("synchronize");
    gpukit::stream_ops::synchronize(e);
  }
  void wait(const gpukit::event& e, const gpukit::stream_view& s) const {
    maybe_fail("wait");
    gpukit::stream_ops::wait(e, s);
  }
  bool finished(const tracker_type& t) const {
    maybe_fail("finished");
    return gpukit::stream_ops::finished(t);
  }
  void wait_finished(const tracker_type& t) const {
    maybe_fail("wait_finished");
    gpukit::stream_ops::wait_finished(t);
  }
};

/// Host memory with a capacity whose allocate() fails as the plan says. Real memory: a block handed out or released
/// while a CPU stream still writes to it is a heap-use-after-free under AddressSanitizer.
class faulty_host_upstream {
 public:
  faulty_host_upstream(std::size_t capacity, fault_plan* plan) : host_(capacity), plan_(plan) {}
  void* allocate(std::size_t bytes) {
    if (plan_->should_fail(fault_plan::layer::upstream)) {
      if (plan_->how == fault_plan::mode::throws) {
        throw injected_fault("injected upstream failure at call " + std::to_string(plan_->calls));
      }
      return nullptr;
    }
    return host_.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept { host_.deallocate(p, bytes); }
  gpukit::upstream_memory_info memory_info() const { return host_.memory_info(); }
  bool synchronizes_on_free() const noexcept { return false; }
  std::size_t used() const { return host_.used(); }

 private:
  gpukit::host_upstream host_;
  fault_plan* plan_;
};

using faulty_cpu_allocator = gpukit::basic_caching_allocator<faulty_host_upstream, faulty_cpu_stream_ops>;

/// One run over real CPU streams. A gate holds stream `b` while the allocator polls its events, and every other
/// poll happens after the streams were synchronized, so each run makes the same calls (the loop is deterministic).
class cpu_run {
 public:
  cpu_run(const gpukit::allocator_options& options, fault_plan& plan, tally& counts)
      : plan_(plan), counts_(counts), a_(cpu_device, options, 256 * MiB, &plan) {
    a_.stream_operations().plan = &plan;
  }
  cpu_run(const cpu_run&) = delete;
  cpu_run& operator=(const cpu_run&) = delete;
  ~cpu_run() { held_.open(); }  // never leave stream b blocked

  void scenario() {
    held_.hold(b_);
    const std::uintptr_t x = alloc(a_stream_, 1000);
    const std::uintptr_t y = alloc(a_stream_, 3 * MiB);
    if (x != 0) {
      step("record_stream", [&] { a_.record_stream(pointer(x), b_); });
      b_.enqueue_host([x] { std::memset(pointer(x), 0x5a, 1000); });  // b writes x once the gate opens
    }
    free(x);  // pending: b's work has not run
    const std::uintptr_t x2 = alloc(a_stream_, 1000);
    if (x != 0 && x2 == x) note("a block still used by a held stream was handed out again");
    free_on(y, b_);
    held_.open();
    b_.synchronize();
    a_stream_.synchronize();
    const std::uintptr_t x3 = alloc(a_stream_, 1000);  // the pending blocks are back
    step("empty_cache", [&] { a_.empty_cache(); });
    const std::uintptr_t big = alloc(a_stream_, 300 * MiB);  // beyond the capacity: out of memory
    step("set_reserved_limit", [&] { a_.set_reserved_limit(a_.memory_reserved() + 10 * MiB); });
    const std::uintptr_t over = alloc(b_, 50 * MiB);
    const std::uintptr_t fits = alloc(b_, 5 * MiB);
    step("set_reserved_limit", [&] { a_.set_reserved_limit(gpukit::allocator_options::unlimited); });
    step("trim", [&] { (void)a_.trim(0); });
    for (std::uintptr_t p : {x2, x3, big, over, fits}) free(p);
    step("empty_cache", [&] { a_.empty_cache(); });
  }

  void finish() {
    plan_.fail_at = 0;
    held_.open();
    b_.synchronize();
    a_stream_.synchronize();
    for (std::size_t bytes : {std::size_t{512}, 2 * MiB, 70 * MiB}) {
      try {
        void* p = a_.allocate(bytes, b_);
        live_.push_back(live_allocation{reinterpret_cast<std::uintptr_t>(p), bytes});
      } catch (const std::exception& e) {
        note(std::string("unusable after the fault: allocate threw ") + e.what());
      }
    }
    while (!live_.empty()) {
      a_.deallocate(pointer(live_.back().address));
      live_.pop_back();
    }
    a_.empty_cache();
    check("after freeing everything");
    if (a_.memory_reserved() != 0 || a_.upstream().used() != 0) note("leaked host memory");
    for (const std::string& m : warnings_.messages()) {
      if (m.find("failed: injected failure of") == std::string::npos) note("an unexpected warning: " + m);
    }
    counts_.warnings += warnings_.messages().size();
  }

  const std::string& problem() const { return problem_; }

 private:
  static void* pointer(std::uintptr_t p) { return reinterpret_cast<void*>(p); }
  void note(const std::string& what) {
    if (problem_.empty()) problem_ = what;
  }
  void check(const char* after) {
    ++counts_.steps_checked;
    const std::string problem = check_invariants(a_.snapshot(), live_, a_.options().rounding);
    if (!problem.empty()) note(std::string("after ") + after + ": " + problem);
  }
  template <class Step>
  void step(const char* name, Step&& body) {
    try {
      body();
    } catch (const injected_fault&) {
      ++counts_.surfaced;
    } catch (const gpukit::out_of_memory_error&) {
      ++counts_.out_of_memory;
    } catch (const std::exception& e) {
      note(std::string(name) + " threw an undocumented exception: " + e.what());
    }
    check(name);
  }
  std::uintptr_t alloc(const gpukit::stream& s, std::size_t bytes) {
    void* p = nullptr;
    step("allocate", [&] {
      p = a_.allocate(bytes, s);
      live_.push_back(live_allocation{reinterpret_cast<std::uintptr_t>(p), bytes});
    });
    return reinterpret_cast<std::uintptr_t>(p);
  }
  void forget(std::uintptr_t p) {
    for (std::size_t i = 0; i < live_.size(); ++i) {
      if (live_[i].address == p) {
        live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
  }
  void free(std::uintptr_t p) {
    if (p == 0) return;
    step("deallocate", [&] {
      a_.deallocate(pointer(p));
      forget(p);
    });
  }
  void free_on(std::uintptr_t p, const gpukit::stream& s) {
    if (p == 0) return;
    step("deallocate(p, stream)", [&] {
      a_.deallocate(pointer(p), s);
      forget(p);
    });
  }

  static inline const gpukit::device cpu_device = gpukit::device::cpu();
  fault_plan& plan_;
  tally& counts_;
  captured_warnings warnings_;
  gpukit::stream a_stream_{cpu_device};
  gpukit::stream b_{cpu_device};
  gate held_;               // destroyed after the allocator, opened by ~cpu_run first
  faulty_cpu_allocator a_;  // destroyed before the streams
  std::vector<live_allocation> live_;
  std::string problem_;
};

tally inject_everywhere_cpu(fault_plan::layer target, fault_plan::mode how) {
  tally counts;
  gpukit::allocator_options cross;
  cross.cross_stream_reuse = true;
  for (const gpukit::allocator_options& options : {gpukit::allocator_options{}, cross}) {
    for (std::uint64_t n = 1;; ++n) {
      fault_plan plan;
      plan.target = target;
      plan.how = how;
      plan.fail_at = n;
      std::string problem;
      std::uint64_t calls = 0;
      {
        cpu_run r(options, plan, counts);
        r.scenario();
        calls = plan.calls;
        r.finish();
        problem = r.problem();
      }
      if (calls < n) break;
      ++counts.runs;
      counts.injected += plan.injected;
      INFO("fault at call " << n << (options.cross_stream_reuse ? " with cross-stream reuse" : ""));
      CHECK(problem == "");
    }
  }
  return counts;
}

void report(const char* what, const tally& t) {
  MESSAGE(std::string(what) << ": " << t.runs << " runs, " << t.injected << " faults injected, " << t.surfaced
                            << " surfaced as the injected error, " << t.out_of_memory << " out_of_memory_error, "
                            << t.warnings << " warnings, " << t.steps_checked << " invariant checks");
}

}  // namespace

TEST_CASE("fault injection: the upstream throws at its N-th call, for every N") {
  const tally t = inject_everywhere(fault_plan::layer::upstream, fault_plan::mode::throws, 1);
  report("upstream throws", t);
  CHECK(t.surfaced > 0);
}

TEST_CASE("fault injection: the upstream is out of memory at its N-th call, for every N") {
  const tally t = inject_everywhere(fault_plan::layer::upstream, fault_plan::mode::out_of_memory, 1);
  report("upstream out of memory once", t);
  CHECK(t.surfaced == 0);  // nullptr is never an exception of its own
}

TEST_CASE("fault injection: the upstream is out of memory from its N-th call on for a while, for every N") {
  const tally t = inject_everywhere(fault_plan::layer::upstream, fault_plan::mode::out_of_memory_burst, 8);
  report("upstream out of memory for 8 calls", t);
  CHECK(t.surfaced == 0);
}

TEST_CASE("fault injection: the event layer fails at its N-th call, for every N") {
  const tally t = inject_everywhere(fault_plan::layer::events, fault_plan::mode::throws, 1);
  report("event layer throws", t);
  CHECK(t.surfaced > 0);
  CHECK(t.warnings > 0);  // waits on release paths report their failure instead of throwing
}

TEST_CASE("fault injection: the host heap fails at the N-th allocation inside an allocator call, for every N") {
  const tally t = inject_everywhere(fault_plan::layer::host_heap, fault_plan::mode::throws, 1);
  report("host heap throws std::bad_alloc", t);
  CHECK(t.surfaced > 0);
}

TEST_CASE("fault injection: gpukit's CPU streams and events fail at their N-th call, for every N") {
  const tally t = inject_everywhere_cpu(fault_plan::layer::events, fault_plan::mode::throws);
  report("CPU backend events throw", t);
  CHECK(t.runs > 0);
  CHECK(t.surfaced > 0);
}

TEST_CASE("fault injection: host memory with a capacity fails at its N-th call, for every N, under real CPU streams") {
  const tally throws = inject_everywhere_cpu(fault_plan::layer::upstream, fault_plan::mode::throws);
  report("host upstream throws", throws);
  const tally oom = inject_everywhere_cpu(fault_plan::layer::upstream, fault_plan::mode::out_of_memory);
  report("host upstream out of memory once", oom);
  CHECK(throws.surfaced > 0);
  CHECK(oom.surfaced == 0);
}

TEST_CASE(
    "host heap: a snapshot that fails at its N-th host allocation, for every N, leaves no anchor in the history") {
  // memory_picture anchors its levels at the history's last snapshot event: one without a snapshot would shift
  // every level of a picture drawn from the snapshot before it.
  fake_setup setup;
  fake_allocator& a = setup.a;
  const fake_stream s = setup.add_stream();
  auto history = std::make_shared<gpukit::memory_history>(1000);
  a.set_memory_history(history);
  void* p = a.allocate(MiB, s);
  void* q = a.allocate(3 * KiB, s);
  int failures = 0;
  long n = 1;
  for (;; ++n) {
    INFO("fault at host allocation " << n);
    const std::size_t before = history->recorded();
    heap_run run(n);
    const bool done = run.armed([&] { (void)a.snapshot(); });
    CHECK(run.unexpected() == "");
    CHECK(history->recorded() == before + (done ? 1 : 0));
    failures += done ? 0 : 1;
    if (run.seen() < n) break;
  }
  MESSAGE("snapshot: " << n - 1 << " host allocations, each failed once");
  CHECK(failures > 1);
  a.deallocate(p);
  a.deallocate(q);
}

TEST_CASE(
    "host heap: a request that fails at its N-th host allocation, for every N, while abandoned streams' cache "
    "waits to be released, leaves it to the next request") {
  long n = 1;
  int failures = 0;
  for (;; ++n) {
    INFO("fault at host allocation " << n);
    fake_setup setup;
    fake_allocator& a = setup.a;
    // 64 streams each cache a small segment and are not used again: the next stream's registration sweeps, finds
    // them abandoned, and its request releases their segments before growing.
    for (int i = 0; i < 64; ++i) {
      const fake_stream s = setup.add_stream();
      a.deallocate(a.allocate(64 * KiB, s));
    }
    REQUIRE(a.stats().num_device_free == 0);
    heap_run run(n);
    const fake_stream next = setup.add_stream();
    void* p = nullptr;
    const bool done = run.armed([&] { p = a.allocate(64 * KiB, next); });
    CHECK(run.unexpected() == "");
    failures += done ? 0 : 1;
    if (!done) p = a.allocate(64 * KiB, next);  // the next request
    CHECK(a.stats().num_device_free_unforced >= 64);
    a.deallocate(p);
    CHECK(check_invariants(a.snapshot(), {}, a.options().rounding) == "");
    if (run.seen() < n) break;
  }
  MESSAGE("request releasing abandoned streams' cache: " << n - 1 << " host allocations, each failed once");
  CHECK(failures > 1);
}

namespace {
fake_world* doomed_world = nullptr;  // at_failure hooks take no captures
int doomed_stream = -1;
void destroy_doomed_stream() { doomed_world->destroy(doomed_stream); }
}  // namespace

TEST_CASE(
    "host heap: a request whose stream is destroyed at its N-th host allocation, which fails with the next, for every "
    "N, leaves the allocator consistent") {
  // A double fault: a failure the request undoes (the pointer map's room for its block, when N lands there) and the
  // destruction of its stream, noticed while undoing, whose bookkeeping must then not need the heap as well. Before
  // the room was made at registration, the undo failed and "restored" a map entry that had never been made.
  long n = 1;
  int failures = 0;
  for (;; ++n) {
    INFO("fault at host allocation " << n);
    fake_setup setup;
    fake_allocator& a = setup.a;
    fake_world& world = setup.world;
    const fake_stream s = setup.add_stream();
    doomed_world = &world;
    doomed_stream = s.id;
    captured_warnings warnings;  // the block of a destroyed stream, freed
    void* p = nullptr;
    heap_run run(n, nullptr, 2);
    run.at_failure(&destroy_doomed_stream);
    const bool done = run.armed([&] { p = a.allocate(MiB, s); });
    CHECK(run.unexpected() == "");
    failures += done ? 0 : 1;
    CHECK(world.streams[0].destroyed == (run.seen() >= n));
    CHECK(check_invariants(a.snapshot(), {}, a.options().rounding, true, true, false) == "");
    if (done) a.deallocate(p);
    const fake_stream next = setup.add_stream();
    a.deallocate(a.allocate(MiB, next));
    world.complete_all();
    a.empty_cache();
    CHECK(a.memory_reserved() == 0);
    CHECK(a.upstream().used() == 0);
    CHECK(check_invariants(a.snapshot(), {}, a.options().rounding) == "");
    if (run.seen() < n) break;
  }
  MESSAGE("request on a stream destroyed at a failure: " << n - 1 << " host allocations, each failed twice");
  CHECK(failures > 1);
}
