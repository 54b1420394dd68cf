// Allocation traces replayed on a CUDA device, which chose the default of expandable segments (issue 9, section 3:
// off, from the H200 runs of 2026-12-04; README, "Expandable segments") and compare gpukit with the driver's pool
// where users choose between them. Two traces from alloc_traces.hpp:
// - training: bench_fragmentation's "L12 h768 s<=1024 b8" family (6 steps, a different sequence length each step),
//   one stream; its warm-up is the first step;
// - server: bench_fragmentation's inference server (3000 requests round robin over 3 streams, 2 to 5 buffers of
//   4 KiB to 64 MiB each, freed at the stream's next request); its warm-up is the first 10 % of the requests.
// Figures for each, from the same run:
// - the warm-up, which grows the cache from nothing: cudaMalloc per segment, or for expandable segments three
//   driver calls per 2 MiB page (cuMemCreate, cuMemMap, cuMemSetAccess);
// - the operations after it, mostly served from the cache (new sizes still come);
// - the release of everything cached (empty_cache: cudaFree per segment, or a device wait and cuMemUnmap and
//   cuMemRelease per page);
// - peak reserved / peak requested.
// - for gpukit, the upstream allocations after the warm-up (segments, or pages mapped): later steps of the training
//   trace have longer sequences than the first, so the cache still grows there; and the upstream frees after it.
// gpukit also runs with its reserved limit at 1.5x the trace's peak requested, with the defaults and with
// allocator_options::reuse_before_release: bench_fragmentation counts the defaults' segments given back and regrown
// under such a limit (its pressure table); these rows give that churn's cost on a GPU, where each cudaFree waits for
// the device. Such a row refused by its limit is reported ("did not fit"), not a failed run; the device's memory
// running out (an out-of-memory observer says which) fails the run, limit or not.
// Beside gpukit's two variants: the driver's stream-ordered allocator on the device's default pool (cudaMallocAsync
// with its release threshold raised; RMM's cuda_async_memory_resource uses the same allocator with a pool of its
// own) and cudaMalloc/cudaFree per request (no cache). Every variant replays once untimed first. No kernel runs, so
// the figures are the allocators' own host-side cost, driver calls included, on an idle device: a wait for the
// device (each cudaFree, a release of expandable segments' pages) costs here what it costs when nothing is queued,
// and on a busy GPU it also waits for the queued work.
//
// Without a CUDA device it says so and exits 0. On the simulated runtime (bench_trace_replay_sim, in CI's smoke
// run) every path runs and a failed call fails the run, but the times are the simulator's, not a GPU's.
#include "alloc_traces.hpp"
#include "figure_reporter.hpp"

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/stream/stream.hpp>

#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using gpukit_bench::trace;
using gpukit_bench::trace_op;
using clock_type = std::chrono::steady_clock;

enum trace_kind : int { training, server, trace_count };

const trace& trace_of(trace_kind kind) {
  static const trace training_trace = [] {
    gpukit_bench::transformer_shape s;
    s.layers = 12;
    s.hidden = 768;
    s.variable_seq = true;
    s.steps = 6;
    s.seed = 100;
    return gpukit_bench::transformer_training(s);
  }();
  static const trace server_trace =
      gpukit_bench::inference_server(3000, 3, 4 * gpukit_bench::KiB, 64 * gpukit_bench::MiB, 1);
  return kind == training ? training_trace : server_trace;
}

enum variant : int {
  segments,
  expandable,
  driver_pool,
  no_cache,
  segments_limited,  // the defaults with reserved_limit at limited_factor x the trace's peak requested
  reuse_limited,     // the same limit with allocator_options::reuse_before_release
  variant_count
};
/// The variants that run under a reserved limit.
constexpr bool is_limited(variant v) { return v == segments_limited || v == reuse_limited; }
/// The reserved limit of the limited variants, over the trace's peak requested: a device somewhat larger than the
/// job, where bench_fragmentation's pressure table finds the defaults giving segments back and regrowing them.
constexpr double limited_factor = 1.5;
/// A variant's row name (the limited ones say limited_factor).
std::string variant_name(variant v) {
  static const char* const names[variant_count] = {"gpukit, segments (default)",
                                                   "gpukit, expandable segments",
                                                   "cudaMallocAsync pool",
                                                   "cudaMalloc/cudaFree",
                                                   "gpukit, limit",
                                                   "gpukit, limit"};
  if (!is_limited(v)) return names[v];
  char name[64];
  std::snprintf(name, sizeof name, "%s %.1fx%s", names[v], limited_factor, v == reuse_limited ? ", reuse" : "");
  return name;
}
/// Begins the message of a limited variant that ran out of memory under its limit: a figure (the trace needs more
/// than the limit with that allocator), not a failure of the run.
const char* const limited_refusal = "out of memory under the limit: ";

/// What one replay measured.
struct replay_times {
  double warmup = 0;  // seconds
  double later = 0;
  double release = 0;
  double peak_reserved = 0;                // bytes; 0 when the variant cannot say
  double later_upstream_allocations = -1;  // after the warm-up; -1 when the variant cannot say
  double later_upstream_frees = -1;        // after the warm-up (each cudaFree waits for the device); -1 likewise
};

/// The streams a trace's operations name (trace_op::stream), one gpukit::stream each.
using stream_list = std::vector<std::unique_ptr<gpukit::stream>>;

/// Each variant: allocate(bytes, stream), deallocate(p, stream), release(), peak_reserved() and
/// upstream_allocations() (-1 where it does not count them).
class gpukit_variant {
 public:
  gpukit_variant(const stream_list& streams, const gpukit::allocator_options& options) : streams_(streams) {
    allocator_ = std::make_unique<gpukit::caching_allocator>(gpukit::device::cuda(0), options);
    allocator_->add_out_of_memory_observer(
        [this](const gpukit::out_of_memory_info& info) { last_refusal_by_limit_ = info.limit_hit; });
  }
  gpukit_variant(const gpukit_variant&) = delete;  // its allocator's observer holds `this`
  gpukit_variant& operator=(const gpukit_variant&) = delete;
  /// Whether the last out-of-memory error was the reserved limit's refusal (not the device's).
  bool last_refusal_by_limit() const { return last_refusal_by_limit_; }
  void* allocate(std::size_t bytes, int stream) { return allocator_->allocate(bytes, streams_[stream]->view()); }
  void deallocate(void* p, int) { allocator_->deallocate(p); }
  void release() { allocator_->empty_cache(); }
  double peak_reserved() const { return static_cast<double>(allocator_->stats().reserved_bytes.all().peak); }
  /// Segments obtained, or pages mapped for expandable segments.
  double upstream_allocations() const { return static_cast<double>(allocator_->stats().num_device_alloc); }
  /// Segments given back, or pages unmapped.
  double upstream_frees() const { return static_cast<double>(allocator_->stats().num_device_free); }

 private:
  const stream_list& streams_;
  bool last_refusal_by_limit_ = false;  // before allocator_: its observer writes here until the allocator is gone
  std::unique_ptr<gpukit::caching_allocator> allocator_;
};

/// A limited variant's replay that the reserved limit refused (the device had the memory).
struct limit_refusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}

class driver_pool_variant {
 public:
  explicit driver_pool_variant(const stream_list& streams) : streams_(streams) {
    check(cudaDeviceGetDefaultMemPool(&pool_, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep_all = ~std::uint64_t{0};  // the default, 0, gives freed memory back at every synchronization
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all), "cudaMemPoolSetAttribute");
    std::uint64_t zero = 0;
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero), "cudaMemPoolSetAttribute");
  }
  /// Gives back what a failed replay left (release() was not reached): the variants after it start from an empty pool.
  ~driver_pool_variant() {
    for (const auto& s : streams_) (void)cudaStreamSynchronize(s->cuda_handle());
    (void)cudaMemPoolTrimTo(pool_, 0);
  }
  driver_pool_variant(const driver_pool_variant&) = delete;
  driver_pool_variant& operator=(const driver_pool_variant&) = delete;
  void* allocate(std::size_t bytes, int stream) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, bytes, streams_[stream]->cuda_handle()), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, int stream) { check(cudaFreeAsync(p, streams_[stream]->cuda_handle()), "cudaFreeAsync"); }
  void release() {
    for (const auto& s : streams_) check(cudaStreamSynchronize(s->cuda_handle()), "cudaStreamSynchronize");
    check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }
  double peak_reserved() const {
    std::uint64_t high = 0;
    check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high), "cudaMemPoolGetAttribute");
    return static_cast<double>(high);
  }
  double upstream_allocations() const { return -1; }  // the driver's own
  double upstream_frees() const { return -1; }

 private:
  const stream_list& streams_;
  cudaMemPool_t pool_ = nullptr;
};

class no_cache_variant {
 public:
  void* allocate(std::size_t bytes, int) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void deallocate(void* p, int) { check(cudaFree(p), "cudaFree"); }
  void release() {}
  double peak_reserved() const { return 0; }
  double upstream_allocations() const { return -1; }  // one per request
  double upstream_frees() const { return -1; }
};

/// Replays trace `t`: its warm-up, then the rest; frees what is still live (untimed), then releases the cache.
template <class Variant>
replay_times replay(const trace& t, Variant& v) {
  std::vector<void*> pointers(t.ids, nullptr);
  auto run = [&](std::size_t from, std::size_t to) {
    const auto start = clock_type::now();
    for (std::size_t i = from; i < to; ++i) {
      const trace_op& op = t.ops[i];
      if (op.allocate) {
        pointers[op.id] = v.allocate(op.bytes, op.stream);
      } else {
        v.deallocate(pointers[op.id], op.stream);
        pointers[op.id] = nullptr;
      }
    }
    return std::chrono::duration<double>(clock_type::now() - start).count();
  };
  // The stream a live pointer was allocated on, to free it there.
  std::vector<std::uint8_t> stream_of(t.ids, 0);
  for (const trace_op& op : t.ops) stream_of[op.id] = op.stream;
  auto free_live = [&] {
    for (std::size_t id = 0; id < pointers.size(); ++id) {
      if (pointers[id] != nullptr) v.deallocate(pointers[id], stream_of[id]);
      pointers[id] = nullptr;
    }
  };
  replay_times r;
  try {
    r.warmup = run(0, t.warmup_ops);
    const double grown = v.upstream_allocations();
    const double freed = v.upstream_frees();
    r.later = run(t.warmup_ops, t.ops.size());
    if (grown >= 0) r.later_upstream_allocations = v.upstream_allocations() - grown;
    if (freed >= 0) r.later_upstream_frees = v.upstream_frees() - freed;
  } catch (...) {
    // A failed call (out of memory) leaves nothing allocated for the variants after it; the first error is reported.
    try {
      free_live();
    } catch (...) {
    }
    throw;
  }
  free_live();
  const auto start = clock_type::now();
  v.release();
  r.release = std::chrono::duration<double>(clock_type::now() - start).count();
  r.peak_reserved = v.peak_reserved();
  return r;
}

replay_times replay_variant(const trace& t, variant which, const stream_list& streams) {
  switch (which) {
    case segments:
    case expandable:
    case segments_limited:
    case reuse_limited: {
      gpukit::allocator_options o;
      o.expandable_segments = which == expandable;
      if (is_limited(which)) {
        o.reserved_limit = static_cast<std::size_t>(limited_factor * static_cast<double>(t.peak_requested));
        o.reuse_before_release = which == reuse_limited;
      }
      gpukit_variant v(streams, o);
      try {
        return replay(t, v);
      } catch (const gpukit::out_of_memory_error& e) {
        if (v.last_refusal_by_limit()) throw limit_refusal(e.what());
        throw;  // the device's memory ran out: a failure, limit or not
      }
    }
    case driver_pool: {
      driver_pool_variant v(streams);
      return replay(t, v);
    }
    default: {
      no_cache_variant v;
      return replay(t, v);
    }
  }
}

/// Trace range(0), variant range(1): one replay per iteration, each with a fresh allocator (or the pool trimmed to
/// nothing), so that every warm-up grows from nothing. Manual time: the three timed phases.
void BM_trace(benchmark::State& state) {
  const trace& t = trace_of(static_cast<trace_kind>(state.range(0)));
  const auto which = static_cast<variant>(state.range(1));
  stream_list streams;
  for (int i = 0; i < t.streams; ++i) streams.push_back(std::make_unique<gpukit::stream>(gpukit::device::cuda(0)));
  replay_times sum;
  try {
    (void)replay_variant(t, which, streams);  // untimed: one-off costs (the driver's first calls) stay out
    for (auto _ : state) {
      const replay_times r = replay_variant(t, which, streams);
      state.SetIterationTime(r.warmup + r.later + r.release);
      sum.warmup += r.warmup;
      sum.later += r.later;
      sum.release += r.release;
      sum.peak_reserved = std::max(sum.peak_reserved, r.peak_reserved);
      sum.later_upstream_allocations = r.later_upstream_allocations;  // the same each time
      sum.later_upstream_frees = r.later_upstream_frees;
    }
  } catch (const limit_refusal& e) {
    state.SkipWithError((std::string(limited_refusal) + e.what()).c_str());
    return;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["warmup_ms"] = 1e3 * sum.warmup / n;
  state.counters["later_us_per_op"] = 1e6 * sum.later / n / static_cast<double>(t.ops.size() - t.warmup_ops);
  if (which != no_cache) state.counters["release_ms"] = 1e3 * sum.release / n;  // it caches nothing
  state.counters["reserved_per_requested"] = sum.peak_reserved / static_cast<double>(t.peak_requested);
  if (sum.later_upstream_allocations >= 0) state.counters["later_upstream_allocs"] = sum.later_upstream_allocations;
  if (sum.later_upstream_frees >= 0) state.counters["later_upstream_frees"] = sum.later_upstream_frees;
}

/// Whether a reporter's error ("<run>: <message>") is a limited variant running out of memory under its limit.
bool is_limited_refusal(const std::string& error) { return error.find(limited_refusal) != std::string::npos; }

/// Counter `counter` of trace `k` through variant `v`; -1 when it did not run.
double figure(const gpukit_bench::figure_reporter& r, int k, int v, const std::string& counter) {
  return r.figure("BM_trace/" + std::to_string(k) + "/" + std::to_string(v) + "/manual_time", counter);
}

void print_table(const gpukit_bench::figure_reporter& r, const std::string& device_name) {
  std::printf("\nTraces replayed on %s; ratios are to gpukit with segments, same run\n", device_name.c_str());
  const char* counters[] = {"warmup_ms", "later_us_per_op", "release_ms"};
  const int widths[] = {12, 14, 12};
  // A figure, or "-" where the variant has none.
  auto cell = [](bool shown, double value, int width, int decimals) {
    if (shown) {
      std::printf(" %*.*f", width, decimals, value);
    } else {
      std::printf(" %*s", width, "-");
    }
  };
  for (int k = 0; k < trace_count; ++k) {
    const trace& t = trace_of(static_cast<trace_kind>(k));
    std::printf("\n%s: %zu operations (%zu in the warm-up), %d stream%s, peak requested %.0f MiB\n", t.name.c_str(),
                t.ops.size(), t.warmup_ops, t.streams, t.streams == 1 ? "" : "s",
                static_cast<double>(t.peak_requested) / (1 << 20));
    std::printf("%-28s %12s %14s %12s %12s %13s %13s | %s\n", "allocator", "warm-up ms", "after: us/op", "release ms",
                "reserved/req", "grown after", "freed after", "ratios (warm-up, after, release)");
    for (int v = 0; v < variant_count; ++v) {
      if (figure(r, k, v, counters[0]) < 0) continue;
      std::printf("%-28s", variant_name(static_cast<variant>(v)).c_str());
      for (int c = 0; c < 3; ++c) {
        const double value = figure(r, k, v, counters[c]);
        cell(value >= 0, value, widths[c], 3);
      }
      const double reserved = figure(r, k, v, "reserved_per_requested");
      cell(reserved > 0, reserved, 12, 3);  // 0: the variant cannot say
      const double grown = figure(r, k, v, "later_upstream_allocs");
      cell(grown >= 0, grown, 13, 0);
      const double freed = figure(r, k, v, "later_upstream_frees");
      cell(freed >= 0, freed, 13, 0);
      std::printf(" |");
      for (const char* c : counters) {
        const double base = figure(r, k, segments, c);
        if (v == segments || base <= 0) continue;
        const double value = figure(r, k, v, c);
        if (value >= 0) {
          std::printf(" %.2fx", value / base);
        } else {
          std::printf(" -");
        }
      }
      std::printf("\n");
    }
  }
  std::printf(
      "(grown / freed after: gpukit's upstream allocations and frees after the warm-up, segments or 2 MiB pages; no "
      "kernel runs, so each wait for the device costs what it costs on an idle GPU; the limit rows cap reserved "
      "memory at %.1fx the peak requested, as on a device somewhat larger than the job)\n",
      limited_factor);
  std::printf(
      "\nExpandable segments are off by default: on an H200 (README, \"Expandable segments\") they kept 2.0-3.1x "
      "less reserved memory on these traces but cost 1.2-3.2x per operation after the warm-up and 7-14x per release, "
      "while the capacity a job needs differs by 1-6%% on average, 10%% on the worst seed (the default gives cached "
      "segments back and retries before failing)%s\n",
      device_name.find("cudasim") != std::string::npos ? "; these are the simulator's times, not a GPU's" : "");
  for (const std::string& e : r.errors()) {
    std::printf("%s: %s\n", is_limited_refusal(e) ? "did not fit" : "failed", e.c_str());
  }
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
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) free_bytes = 0;
  for (int k = 0; k < trace_count; ++k) {
    // gpukit with segments and unlimited memory keeps up to about 3.8x the trace's peak requested (the cache keeps
    // what each step needed); a GPU with less free memory would fail the run with out-of-memory errors.
    const trace& t = trace_of(static_cast<trace_kind>(k));
    if (free_bytes < 4 * t.peak_requested) {
      std::printf("%s: skipped, it needs %zu MiB free on device 0 and %zu MiB are\n", t.name.c_str(),
                  4 * t.peak_requested >> 20, free_bytes >> 20);
      continue;
    }
    for (int v = 0; v < variant_count; ++v) {
      benchmark::RegisterBenchmark("BM_trace", BM_trace)->Args({k, v})->UseManualTime()->Unit(benchmark::kMillisecond);
    }
  }
  gpukit_bench::figure_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table(reporter, device_name);
  benchmark::Shutdown();
  const auto& errors = reporter.errors();
  return std::all_of(errors.begin(), errors.end(), is_limited_refusal) ? 0 : 1;
}
