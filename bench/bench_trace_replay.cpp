// A transformer training trace (bench_fragmentation's "L12 h768 s<=1024 b8" family: 6 steps, a different sequence
// length each step) replayed on a CUDA device, to choose the default of expandable segments (issue 9, section 3:
// off by default until measured on a GPU). Its figures, each from the same run:
// - the first step, which grows the cache from nothing: cudaMalloc per segment, or for expandable segments three
//   driver calls per 2 MiB page (cuMemCreate, cuMemMap, cuMemSetAccess);
// - a later step, served from the cache (the variable sequence length makes some requests new);
// - the release of everything cached (empty_cache: cudaFree per segment, or a device wait and cuMemUnmap and
//   cuMemRelease per page);
// - peak reserved / peak requested.
// Beside gpukit's two variants: the driver's stream-ordered pool (cudaMallocAsync with its release threshold raised,
// what RMM's cuda_async_memory_resource uses) and cudaMalloc/cudaFree per request (no cache). No kernel runs: the
// figures are the allocators' own host-side cost, driver calls included.
//
// Without a CUDA device it says so and exits 0. On the simulated runtime (bench_trace_replay_sim, in CI's smoke
// run) every path runs and is checked, but the times are the simulator's, not a GPU's.
#include "alloc_traces.hpp"

#include <gpukit/device/device.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/stream/stream.hpp>

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using gpukit_bench::trace;
using gpukit_bench::trace_op;
using clock_type = std::chrono::steady_clock;

constexpr int trace_steps = 6;

const trace& training_trace() {
  static const trace t = [] {
    gpukit_bench::transformer_shape s;
    s.layers = 12;
    s.hidden = 768;
    s.variable_seq = true;
    s.steps = trace_steps;
    s.seed = 100;
    return gpukit_bench::transformer_training(s);
  }();
  return t;
}

enum variant : int { segments, expandable, driver_pool, no_cache, variant_count };
const char* const variant_names[variant_count] = {"gpukit, segments (default)", "gpukit, expandable segments",
                                                  "cudaMallocAsync pool", "cudaMalloc/cudaFree"};

/// What one replay measured.
struct replay_times {
  double first_step = 0;  // seconds
  double later_steps = 0;
  double release = 0;
  double peak_reserved = 0;  // bytes; 0 when the variant cannot say
};

/// allocate(bytes) / deallocate(p) / release() / peak_reserved() on one stream: the four variants.
class gpukit_variant {
 public:
  gpukit_variant(const gpukit::stream& s, bool expandable_segments) : stream_(s) {
    gpukit::allocator_options o;
    o.expandable_segments = expandable_segments;
    allocator_ = std::make_unique<gpukit::caching_allocator>(s.device(), o);
  }
  void* allocate(std::size_t bytes) { return allocator_->allocate(bytes, stream_.view()); }
  void deallocate(void* p) { allocator_->deallocate(p); }
  void release() { allocator_->empty_cache(); }
  double peak_reserved() const { return static_cast<double>(allocator_->stats().reserved_bytes.all().peak); }

 private:
  const gpukit::stream& stream_;
  std::unique_ptr<gpukit::caching_allocator> allocator_;
};

void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}

class driver_pool_variant {
 public:
  explicit driver_pool_variant(const gpukit::stream& s) : stream_(s.cuda_handle()) {
    check(cudaDeviceGetDefaultMemPool(&pool_, s.device().ordinal()), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep_all = ~std::uint64_t{0};  // the default, 0, gives freed memory back at every synchronization
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all), "cudaMemPoolSetAttribute");
    std::uint64_t zero = 0;
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero), "cudaMemPoolSetAttribute");
  }
  void* allocate(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p) { check(cudaFreeAsync(p, stream_), "cudaFreeAsync"); }
  void release() {
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }
  double peak_reserved() const {
    std::uint64_t high = 0;
    check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high), "cudaMemPoolGetAttribute");
    return static_cast<double>(high);
  }

 private:
  cudaStream_t stream_;
  cudaMemPool_t pool_ = nullptr;
};

class no_cache_variant {
 public:
  void* allocate(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void deallocate(void* p) { check(cudaFree(p), "cudaFree"); }
  void release() {}
  double peak_reserved() const { return 0; }
};

/// Replays the trace: its first step (the warm-up), then the others; frees what is still live (untimed), then
/// releases the cache.
template <class Variant>
replay_times replay(Variant& v) {
  const trace& t = training_trace();
  std::vector<void*> pointers(t.ids, nullptr);
  auto run = [&](std::size_t from, std::size_t to) {
    const auto start = clock_type::now();
    for (std::size_t i = from; i < to; ++i) {
      const trace_op& op = t.ops[i];
      if (op.allocate) {
        pointers[op.id] = v.allocate(op.bytes);
      } else {
        v.deallocate(pointers[op.id]);
        pointers[op.id] = nullptr;
      }
    }
    return std::chrono::duration<double>(clock_type::now() - start).count();
  };
  auto free_live = [&] {
    for (void*& p : pointers) {
      if (p != nullptr) v.deallocate(p);
      p = nullptr;
    }
  };
  replay_times r;
  try {
    r.first_step = run(0, t.warmup_ops);
    r.later_steps = run(t.warmup_ops, t.ops.size());
  } catch (...) {
    free_live();  // a failed call (out of memory) leaves nothing allocated for the variants after it
    throw;
  }
  free_live();
  const auto start = clock_type::now();
  v.release();
  r.release = std::chrono::duration<double>(clock_type::now() - start).count();
  r.peak_reserved = v.peak_reserved();
  return r;
}

replay_times replay_variant(variant which, const gpukit::stream& s) {
  switch (which) {
    case segments:
    case expandable: {
      gpukit_variant v(s, which == expandable);
      return replay(v);
    }
    case driver_pool: {
      driver_pool_variant v(s);
      return replay(v);
    }
    default: {
      no_cache_variant v;
      return replay(v);
    }
  }
}

/// One replay per iteration, each with a fresh allocator (or the pool trimmed to nothing), so that every first
/// step grows from nothing. Manual time: the three timed phases.
void BM_trace(benchmark::State& state) {
  const auto which = static_cast<variant>(state.range(0));
  gpukit::stream s(gpukit::device::cuda(0));
  replay_times sum;
  try {
    for (auto _ : state) {
      const replay_times r = replay_variant(which, s);
      state.SetIterationTime(r.first_step + r.later_steps + r.release);
      sum.first_step += r.first_step;
      sum.later_steps += r.later_steps;
      sum.release += r.release;
      sum.peak_reserved = std::max(sum.peak_reserved, r.peak_reserved);
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["first_step_ms"] = 1e3 * sum.first_step / n;
  state.counters["later_step_ms"] = 1e3 * sum.later_steps / n / (trace_steps - 1);
  if (which != no_cache) state.counters["release_ms"] = 1e3 * sum.release / n;  // it caches nothing
  state.counters["reserved_per_requested"] = sum.peak_reserved / static_cast<double>(training_trace().peak_requested);
}

/// Keeps each run's counters (the last repetition's, or the median when repeated) for the table.
class collecting_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred) {
        errors_.push_back(run.run_name.str() + ": " + run.error_message);
        continue;
      }
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type != Run::RT_Iteration && !median) continue;
      for (const auto& [counter, value] : run.counters) figures_[run.run_name.str() + ":" + counter] = value.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  /// Counter `counter` of variant `v`; -1 when it did not run.
  double figure(int v, const std::string& counter) const {
    const auto it = figures_.find("BM_trace/" + std::to_string(v) + "/manual_time:" + counter);
    return it == figures_.end() ? -1.0 : it->second;
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::map<std::string, double> figures_;
  std::vector<std::string> errors_;
};

void print_table(const collecting_reporter& r, const std::string& device_name) {
  const trace& t = training_trace();
  std::printf("\n%s, %zu operations (%zu in the first step), peak requested %.0f MiB, on %s\n", t.name.c_str(),
              t.ops.size(), t.warmup_ops, static_cast<double>(t.peak_requested) / (1 << 20), device_name.c_str());
  std::printf("%-28s %15s %15s %15s %12s | %s\n", "allocator", "first step ms", "later step ms", "release ms",
              "reserved/req", "ratios to segments (first, later, release)");
  const char* counters[] = {"first_step_ms", "later_step_ms", "release_ms"};
  for (int v = 0; v < variant_count; ++v) {
    if (r.figure(v, counters[0]) < 0) continue;
    std::printf("%-28s", variant_names[v]);
    for (const char* c : counters) {
      if (r.figure(v, c) >= 0) {
        std::printf(" %15.3f", r.figure(v, c));
      } else {
        std::printf(" %15s", "-");
      }
    }
    const double reserved = r.figure(v, "reserved_per_requested");
    if (reserved > 0) {
      std::printf(" %12.3f |", reserved);
    } else {
      std::printf(" %12s |", "-");
    }
    for (const char* c : counters) {
      const double base = r.figure(segments, c);
      if (v == segments || base <= 0) continue;
      if (r.figure(v, c) >= 0) {
        std::printf(" %.2fx", r.figure(v, c) / base);
      } else {
        std::printf(" -");
      }
    }
    std::printf("\n");
  }
  std::printf(
      "Expandable segments stay off by default until a GPU's figures here show what their page mapping costs in the "
      "first step and the release against the memory they save (issue 9, section 3)%s\n",
      device_name.find("cudasim") != std::string::npos ? "; these are the simulator's times, not a GPU's" : "");
  for (const std::string& e : r.errors()) std::printf("failed: %s\n", e.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (gpukit::device_count() == 0) {
    std::printf("bench_trace_replay: skipped, no CUDA device is usable on this machine\n");
    return 0;
  }
  cudaDeviceProp properties{};
  const std::string device_name =
      cudaGetDeviceProperties(&properties, 0) == cudaSuccess ? properties.name : std::string("device 0");
  for (int v = 0; v < variant_count; ++v) {
    benchmark::RegisterBenchmark("BM_trace", BM_trace)->Arg(v)->UseManualTime()->Unit(benchmark::kMillisecond);
  }
  collecting_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table(reporter, device_name);
  benchmark::Shutdown();
  return reporter.errors().empty() ? 0 : 1;
}
