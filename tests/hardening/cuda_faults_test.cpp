// CUDA fault injection for the caching allocator (issue 12), on the simulated runtime (test_fault_cuda_sim): every
// CUDA function the allocator calls in a scenario (two streams and the legacy default stream of cuda:0, record_stream,
// frees on other streams, cross-stream reuse, empty_cache, trim, a limit, a genuine out of memory) is made to fail at
// its N-th call, for every N. After each step the statistics equal a recomputation from the blocks and nothing the
// test holds was lost. Out of memory (cudaErrorMemoryAllocation) must surface as out_of_memory_error, or be absorbed by
// the allocator's retry, and leave it usable; other failures surface as cuda_error with the injected result; a sticky
// error (cudaErrorIllegalAddress) makes every step that calls CUDA fail clearly as cuda_error. Nothing leaks: after
// each run the simulator holds exactly the device memory and streams it held before.
//
// The real-runtime build (test_fault_cuda) cannot choose which call fails: it reports itself skipped.
#include "cudasim/cudasim.hpp"
#include "memory/allocator_support.hpp"
#include "support.hpp"

#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

// The simulator's control functions, weak: null in the real-runtime build, which does not link the simulator.
namespace cudasim {
__attribute__((weak)) void fail_call(const std::string& function, int nth, cudaError_t error);
__attribute__((weak)) void clear_faults();
__attribute__((weak)) std::size_t calls(const std::string& function);
__attribute__((weak)) std::size_t device_memory_used(int device);
__attribute__((weak)) int live_streams(int device);
__attribute__((weak)) void drain_all();
__attribute__((weak)) std::vector<violation> violations();
}  // namespace cudasim

using namespace gpukit_test;

namespace {

const gpukit::device cuda0 = gpukit::device::cuda(0);

bool simulator_linked() { return cudasim::fail_call != nullptr; }

#define REQUIRE_SIMULATOR()                                                                         \
  GPUKIT_REQUIRE_GPU();                                                                             \
  do {                                                                                              \
    if (!simulator_linked()) {                                                                      \
      std::printf(                                                                                  \
          "GPUKIT_TEST_NOT_APPLICABLE: choosing which CUDA call fails needs the simulated runtime " \
          "(test_fault_cuda_sim)\n");                                                               \
      std::fflush(stdout);                                                                          \
      return;                                                                                       \
    }                                                                                               \
  } while (false)

/// The CUDA functions a caching allocator on cuda:0 may call (those the scenario does not call are skipped).
const char* const candidate_functions[] = {"cudaMalloc",
                                           "cudaFree",
                                           "cudaEventCreateWithFlags",
                                           "cudaEventDestroy",
                                           "cudaEventRecord",
                                           "cudaEventQuery",
                                           "cudaEventSynchronize",
                                           "cudaStreamWaitEvent",
                                           "cudaStreamSynchronize",
                                           "cudaStreamQuery",
                                           "cudaStreamGetId",
                                           "cudaStreamGetDevice",
                                           "cudaStreamIsCapturing",
                                           "cudaSetDevice",
                                           "cudaGetDevice",
                                           "cudaMemGetInfo",
                                           "cudaThreadExchangeStreamCaptureMode",
                                           "cudaLaunchHostFunc"};

struct tally {
  std::uint64_t runs = 0;
  std::uint64_t functions = 0;
  std::uint64_t surfaced_cuda_error = 0;
  std::uint64_t surfaced_out_of_memory = 0;
  std::uint64_t warnings = 0;
  std::uint64_t sticky_leaked_bytes = 0;    // segments whose cudaFree failed under a sticky error (context lost)
  std::uint64_t reported_leaked_bytes = 0;  // segments whose cudaFree failed otherwise, each reported by a warning
  std::map<std::string, std::uint64_t> runs_per_function;
};

struct options_case {
  const char* name;
  gpukit::allocator_options options;
};

/// gpukit's defaults with the medium pool scaled down (requests of 4 MiB or more get a segment of their own), so the
/// scenario moves little memory: the simulator's device memory is host memory, slow to map under sanitizers.
std::vector<options_case> option_cases() {
  gpukit::allocator_options base;
  base.medium_size = 4 * MiB;
  base.medium_segment_size = 4 * MiB;
  gpukit::allocator_options cross = base;
  cross.cross_stream_reuse = true;
  return {{"gpukit defaults, 4 MiB medium pool", base}, {"cross-stream reuse", cross}};
}

/// One run of the scenario; the fault (if any) is armed by the caller after construction.
class run {
 public:
  run(const gpukit::allocator_options& options, cudaError_t injected, tally& counts, const captured_warnings& warnings)
      : injected_(injected), counts_(counts), warnings_(warnings), a_(cuda0, options) {}
  run(const run&) = delete;
  run& operator=(const run&) = delete;

  void scenario() {
    const auto legacy = gpukit::stream_view::default_stream(cuda0);
    const std::uintptr_t x = alloc(s1_, 1000);
    const std::uintptr_t y = alloc(s1_, 3 * MiB);
    const std::uintptr_t z = alloc(s2_, 6 * MiB);
    const std::uintptr_t h = alloc(legacy, 8 * MiB);
    record(x, s2_);
    record(y, legacy);
    free(x);                                     // pending on an event of s2
    const std::uintptr_t x2 = alloc(s1_, 1000);  // polls it (cudaEventQuery)
    free_on(y, s2_);
    step("empty_cache", [&] { a_.empty_cache(); });  // waits for y's events (cudaEventSynchronize)
    step("synchronize", [&] { s2_.synchronize(); });
    const std::uintptr_t y2 = alloc(s1_, 2 * MiB);
    free(z);
    const std::uintptr_t z2 = alloc(s1_, 6 * MiB);  // with cross-stream reuse: s2's block, s1 waiting on the device
    step("empty_cache", [&] { a_.empty_cache(); });
    const std::uintptr_t big = alloc(s1_, std::size_t{100} << 30);  // more than the device has
    step("set_reserved_limit", [&] { a_.set_reserved_limit(a_.memory_reserved() + 10 * MiB); });
    const std::uintptr_t over = alloc(s2_, 20 * MiB);  // over the limit
    const std::uintptr_t fits = alloc(s2_, 3 * MiB);
    step("set_reserved_limit", [&] { a_.set_reserved_limit(gpukit::allocator_options::unlimited); });
    free(h);
    step("trim", [&] { (void)a_.trim(64 * MiB); });
    for (std::uintptr_t p : {x2, y2, z2, big, over, fits}) free(p);
    step("empty_cache", [&] { a_.empty_cache(); });
  }

  /// With the faults cleared: the allocator serves every stream, and once everything is freed holds nothing.
  void finish() {
    cudasim::clear_faults();
    for (gpukit::stream* s : {&s1_, &s2_}) {
      try {
        s->synchronize();
      } catch (const std::exception& e) {
        note(std::string("a stream is unusable after the fault: ") + e.what());
      }
    }
    for (gpukit::stream* s : {&s1_, &s2_}) {
      for (std::size_t bytes : {std::size_t{512}, 2 * MiB, 8 * MiB}) {
        try {
          void* p = a_.allocate(bytes, *s);
          live_.push_back(live_allocation{reinterpret_cast<std::uintptr_t>(p), bytes});
        } catch (const std::exception& e) {
          note("the allocator is unusable after the fault: allocate(" + std::to_string(bytes) + ") threw " + e.what());
        }
      }
    }
    check("allocations after the fault");
    while (!live_.empty()) {
      try {
        a_.deallocate(reinterpret_cast<void*>(live_.back().address));
      } catch (const std::exception& e) {
        note(std::string("the allocator is unusable after the fault: deallocate threw ") + e.what());
      }
      live_.pop_back();
    }
    try {
      s1_.synchronize();
      s2_.synchronize();
      a_.empty_cache();
    } catch (const std::exception& e) {
      note(std::string("the allocator is unusable after the fault: empty_cache threw ") + e.what());
    }
    check("after freeing everything");
    if (a_.memory_reserved() != 0) note("memory still reserved after freeing everything and empty_cache");
    // Failures on paths that cannot throw (cudaFree, waits before a release) are reported, and only those.
    for (const std::string& m : warnings_.messages()) {
      if (m.find(cudaGetErrorName(injected_)) == std::string::npos) note("an unexpected warning: " + m);
    }
  }

  const std::string& problem() const { return problem_; }

 private:
  void note(const std::string& what) {
    if (problem_.empty()) problem_ = what;
  }

  void check(const char* after) {
    const std::string problem = check_invariants(a_.snapshot(), live_, a_.engine().options().rounding);
    if (!problem.empty()) note(std::string("after ") + after + ": " + problem);
  }

  /// Runs a step: it succeeds, or fails with out_of_memory_error or with the injected result as cuda_error. The
  /// device's work is drained afterwards, so events poll the same way in every run (the fault loop is deterministic).
  template <class Step>
  void step(const char* name, Step&& body) {
    try {
      body();
    } catch (const gpukit::out_of_memory_error& e) {
      ++counts_.surfaced_out_of_memory;
      if (e.cuda_result() != cudaErrorMemoryAllocation && e.cuda_result() != cudaSuccess) {
        note(std::string(name) + ": out_of_memory_error with result " + e.cuda_error_name());
      }
    } catch (const gpukit::cuda_error& e) {
      ++counts_.surfaced_cuda_error;
      if (e.cuda_result() != injected_) {
        note(std::string(name) + ": cuda_error with " + e.cuda_error_name() + ", not the injected " +
             cudaGetErrorName(injected_) + ": " + e.what());
      }
    } catch (const std::exception& e) {
      note(std::string(name) + " threw an undocumented exception: " + e.what());
    }
    cudasim::drain_all();
    check(name);
  }

  std::uintptr_t alloc(gpukit::stream_view s, std::size_t bytes) {
    void* p = nullptr;
    step("allocate", [&] {
      p = a_.allocate(bytes, s);
      live_.push_back(live_allocation{reinterpret_cast<std::uintptr_t>(p), bytes});
      // Work that uses the memory on its stream: the simulator reports work touching freed memory (a reuse too early).
      GPUKIT_CUDA_TRY(cudaMemsetAsync(p, 0, std::min(bytes, 64 * KiB), s.cuda_handle()));
    });
    return reinterpret_cast<std::uintptr_t>(p);
  }

  void forget(std::uintptr_t p) {
    live_.erase(std::remove_if(live_.begin(), live_.end(), [p](const live_allocation& l) { return l.address == p; }),
                live_.end());
  }
  void free(std::uintptr_t p) {
    if (p == 0) return;
    step("deallocate", [&] {
      a_.deallocate(reinterpret_cast<void*>(p));
      forget(p);
    });
  }
  void free_on(std::uintptr_t p, gpukit::stream_view s) {
    if (p == 0) return;
    step("deallocate(p, stream)", [&] {
      a_.deallocate(reinterpret_cast<void*>(p), s);
      forget(p);
    });
  }
  void record(std::uintptr_t p, gpukit::stream_view s) {
    if (p == 0) return;
    step("record_stream", [&] { a_.record_stream(reinterpret_cast<void*>(p), s); });
  }

  cudaError_t injected_;
  tally& counts_;
  const captured_warnings& warnings_;
  gpukit::stream s1_{cuda0};
  gpukit::stream s2_{cuda0};
  gpukit::caching_allocator a_;  // destroyed before the streams its events were recorded on
  std::vector<live_allocation> live_;
  std::string problem_;
};

/// Fails every CUDA function the scenario calls at its N-th call with `error`, for every N and both option sets.
tally inject_everywhere(cudaError_t error) {
  tally counts;
  const bool sticky = error == cudaErrorIllegalAddress;
  {
    // Warm-up without faults: cuda:0's context (and the runtime's own state) exist before memory is compared.
    captured_warnings warnings;
    run r(option_cases().front().options, error, counts, warnings);
    r.scenario();
    r.finish();
    REQUIRE(r.problem() == "");
  }
  for (const options_case& oc : option_cases()) {
    for (const char* function : candidate_functions) {
      bool called = false;
      for (int n = 1;; ++n) {
        cudasim::drain_all();
        const std::size_t memory_before = cudasim::device_memory_used(0);
        const int streams_before = cudasim::live_streams(0);
        std::string problem;
        std::size_t made = 0;
        captured_warnings warnings;  // outlives the run: the allocator's destructor may still warn
        {
          run r(oc.options, error, counts, warnings);
          const std::size_t calls_before = cudasim::calls(function);
          cudasim::fail_call(function, n, error);
          r.scenario();
          made = cudasim::calls(function) - calls_before;
          r.finish();  // clears the fault first
          problem = r.problem();
        }
        cudasim::drain_all();
        if (made < static_cast<std::size_t>(n)) break;  // no N-th call: every N is covered
        called = true;
        ++counts.runs;
        ++counts.runs_per_function[function];
        const std::string where = std::string(oc.name) + ": " + function + " fails at call " + std::to_string(n) +
                                  " with " + cudaGetErrorName(error);
        INFO(where);
        CHECK(problem == "");
        CHECK(cudasim::live_streams(0) == streams_before);
        const std::size_t memory_after = cudasim::device_memory_used(0);
        counts.warnings += warnings.messages().size();
        if (sticky) {
          // cudaFree fails while the error is sticky: on a GPU the context is lost with its memory. Counted only.
          if (memory_after > memory_before) counts.sticky_leaked_bytes += memory_after - memory_before;
        } else if (memory_after != memory_before) {
          // A segment whose cudaFree (or the device switch before it) failed cannot be kept: the upstream's
          // deallocate cannot fail. It must be reported, never lost silently.
          CHECK(memory_after > memory_before);
          CHECK(warnings.contains("segment"));
          counts.reported_leaked_bytes += memory_after - memory_before;
        }
        CHECK(cudasim::violations().empty());
      }
      if (called) ++counts.functions;
    }
  }
  return counts;
}

void report(cudaError_t error, const tally& t) {
  MESSAGE(std::string(cudaGetErrorName(error))
          << ": " << t.runs << " runs (one fault each) over " << t.functions
          << " (option set, CUDA function) pairs; surfaced as cuda_error " << t.surfaced_cuda_error
          << ", as out_of_memory_error " << t.surfaced_out_of_memory << "; " << t.warnings << " warnings; "
          << t.reported_leaked_bytes << " bytes not freed after a failed cudaFree (reported); " << t.sticky_leaked_bytes
          << " bytes left with the lost context");
  std::string functions;
  for (const auto& entry : t.runs_per_function) {
    functions += (functions.empty() ? "" : ", ") + entry.first + " " + std::to_string(entry.second);
  }
  MESSAGE("runs per CUDA function (both option sets): " << functions);
}

}  // namespace

TEST_CASE("cuda faults: out of memory at the N-th call of every CUDA function the allocator calls") {
  REQUIRE_SIMULATOR();
  const tally t = inject_everywhere(cudaErrorMemoryAllocation);
  report(cudaErrorMemoryAllocation, t);
  CHECK(t.runs > 0);
  CHECK(t.surfaced_out_of_memory > 0);
}

TEST_CASE("cuda faults: a failure at the N-th call of every CUDA function the allocator calls") {
  REQUIRE_SIMULATOR();
  const tally t = inject_everywhere(cudaErrorUnknown);
  report(cudaErrorUnknown, t);
  CHECK(t.runs > 0);
  CHECK(t.surfaced_cuda_error > 0);
}

TEST_CASE("cuda faults: a sticky error at the N-th call of every CUDA function the allocator calls") {
  REQUIRE_SIMULATOR();
  const tally t = inject_everywhere(cudaErrorIllegalAddress);
  report(cudaErrorIllegalAddress, t);
  CHECK(t.runs > 0);
  CHECK(t.surfaced_cuda_error > 0);
}
