// Fragmentation: allocation traces replayed through the caching allocator over the address-space upstream (no
// memory is touched, so traces of tens of GiB run anywhere). Baselines in the same run: PyTorch's constants as a
// configuration of the same engine (allocator_options::pytorch()), an independent model of PyTorch's algorithm
// (pytorch_allocator_model.hpp), a power-of-two bin cache and cub::CachingDeviceAllocator's default bins.
//
// A plain run prints, before one benchmark per (family's first trace, allocator) whose counters repeat the figures:
// 1. peak reserved / peak requested (the overhead a user pays in device memory) with unlimited capacity, and the
//    number of upstream calls, mean and worst over each family's seeds;
// 2. the smallest capacity on which the whole trace runs without out-of-memory, / peak requested (binary search in
//    steps of 2 MiB, exact for the allocators whose segments or pages are multiples of it), and the upstream frees
//    after the warm-up (the first training step, the first 10 % of random operations), which a steady workload should
//    not make;
// 3. upstream calls per 1000 allocations for churn (one stream, little memory live) and an inference server on
//    three CPU streams;
// 4. memory pressure: upstream frees over 40 variable-length training steps, and in the three-stream server, on a
//    device 1.2, 1.5 and 2 x their peak (gpukit's defaults, reuse_before_release, expandable segments, the PyTorch
//    model), then the operations during which they happened (each a wait for the device on a GPU), and the minimum
//    capacity reuse_before_release needs on every family;
// 5. stream churn: peak reserved on the server with its streams kept, or replaced as a stream-per-request server does.
// `--explore` prints tables 1 and 2 for the candidate constants from which gpukit's defaults were chosen
// (evaluate() measures any allocator_options on every family). `--seeds N` sets the seeds per family (default 5);
// `--no-tables` skips to the benchmarks. The tables take about 30 s in Release and 10 min in Debug; CI's smoke run
// (Debug) prints them for one seed (`--seeds 1`, about 2.5 min).
#include "alloc_traces.hpp"
#include "pytorch_allocator_model.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace gpukit_bench;

namespace {

using engine = gpukit::basic_caching_allocator<gpukit::address_space_upstream>;

/// Capacity of the "unlimited" runs: far above any trace's footprint.
constexpr std::size_t unlimited_capacity = std::size_t{1} << 45;

/// The engine with the allocate(bytes)/deallocate(p, bytes) interface the replays use, on the CPU default stream;
/// allocate returns nullptr when the engine reports out of memory.
class engine_adapter {
 public:
  engine_adapter(const gpukit::allocator_options& o, std::size_t capacity) : a_(gpukit::device::cpu(), o, capacity) {}
  void* allocate(std::size_t bytes) {
    try {
      return a_.allocate(bytes, stream_);
    } catch (const gpukit::out_of_memory_error&) {
      return nullptr;
    }
  }
  void deallocate(void* p, std::size_t) { a_.deallocate(p); }
  std::size_t peak_reserved() const { return a_.max_memory_reserved(); }
  std::size_t upstream_allocs() const { return static_cast<std::size_t>(a_.stats().num_device_alloc); }
  std::size_t upstream_frees() const { return static_cast<std::size_t>(a_.stats().num_device_free); }

 private:
  engine a_;
  gpukit::stream_view stream_ = gpukit::stream_view::default_stream(gpukit::device::cpu());
};

/// What one replay measured.
struct run_result {
  bool completed = true;  // false: an allocation failed (out of memory) and the replay stopped there
  std::size_t peak_reserved = 0;
  std::size_t upstream_allocs = 0;
  std::size_t upstream_frees = 0;
  std::size_t frees_after_warmup = 0;  // upstream frees from t.warmup_ops on
  std::size_t releasing_ops = 0;       // operations from t.warmup_ops on that freed upstream memory at least once
  std::size_t upstream_calls() const { return upstream_allocs + upstream_frees; }
};

/// Counts upstream frees from a trace's warm-up on: `look(i, frees)` before operation i, `after(frees, completed)` at
/// the end (0 for a replay that ran out of memory, or that never reached the warm-up). `releasing_ops` counts the
/// operations during which they happened: on a GPU each waits for the device at least once (a cudaFree, or the
/// wait before pages are unmapped), however many segments or pages it gives back.
class warmup_frees {
 public:
  explicit warmup_frees(const trace& t) : warmup_ops_(t.warmup_ops) {}
  void look(std::size_t i, std::size_t frees) {
    if (reached_ && frees != before_last_op_) ++releasing_ops_;
    before_last_op_ = frees;
    if (i != warmup_ops_) return;
    at_warmup_ = frees;
    reached_ = true;
  }
  std::size_t after(std::size_t frees, bool completed) const { return completed && reached_ ? frees - at_warmup_ : 0; }
  std::size_t releasing_ops(std::size_t frees, bool completed) const {
    if (!completed || !reached_) return 0;
    return releasing_ops_ + (frees != before_last_op_ ? 1 : 0);  // the last operation's
  }

 private:
  std::size_t warmup_ops_;
  std::size_t at_warmup_ = 0;
  bool reached_ = false;
  std::size_t before_last_op_ = 0;  // upstream frees before the last operation looked at
  std::size_t releasing_ops_ = 0;
};

/// Replays a single-stream trace through `a` (allocate(bytes) gives nullptr when out of memory), stopping at the
/// first failure; what is still live is freed afterwards, outside the measurement.
template <class Allocator>
run_result replay_measured(const trace& t, Allocator& a) {
  std::vector<void*> pointers(t.ids, nullptr);
  std::vector<std::size_t> sizes(t.ids, 0);
  run_result r;
  warmup_frees after_warmup(t);
  for (std::size_t i = 0; i < t.ops.size(); ++i) {
    after_warmup.look(i, a.upstream_frees());
    const trace_op& op = t.ops[i];
    if (op.allocate) {
      void* p = a.allocate(op.bytes);
      if (p == nullptr) {
        r.completed = false;
        break;
      }
      pointers[op.id] = p;
      sizes[op.id] = op.bytes;
    } else {
      a.deallocate(pointers[op.id], op.bytes);
      pointers[op.id] = nullptr;
    }
  }
  r.peak_reserved = a.peak_reserved();
  r.upstream_allocs = a.upstream_allocs();
  r.upstream_frees = a.upstream_frees();
  r.frees_after_warmup = after_warmup.after(r.upstream_frees, r.completed);
  r.releasing_ops = after_warmup.releasing_ops(r.upstream_frees, r.completed);
  for (std::size_t id = 0; id < t.ids; ++id) {
    if (pointers[id] != nullptr) a.deallocate(pointers[id], sizes[id]);
  }
  return r;
}

/// An allocator under test: replays a trace on an upstream of `capacity` bytes.
struct variant {
  std::string name;
  std::function<run_result(const trace&, std::size_t capacity)> run;
  std::string label = name;  // short name for narrow columns
};

variant engine_variant(std::string name, gpukit::allocator_options o) {
  return {std::move(name), [o](const trace& t, std::size_t capacity) {
            engine_adapter a(o, capacity);
            return replay_measured(t, a);
          }};
}

variant model_variant(std::string name, std::size_t max_split_size = pytorch_allocator_model::unlimited) {
  return {std::move(name), [max_split_size](const trace& t, std::size_t capacity) {
            pytorch_allocator_model a(capacity, max_split_size);
            return replay_measured(t, a);
          }};
}

variant bins_variant(std::string name, std::size_t growth, std::size_t min_bin, std::size_t max_bin,
                     std::size_t max_cached) {
  return {std::move(name), [=](const trace& t, std::size_t capacity) {
            bin_allocator_model a(growth, min_bin, max_bin, max_cached, capacity);
            return replay_measured(t, a);
          }};
}

/// Capacities are searched in steps of this: the segments and pages of gpukit, of the PyTorch model and of
/// expandable segments are multiples of 2 MiB, so whether they run depends only on how many such steps fit, and the
/// search is exact for them (the bin caches' blocks are not: for them it is to 2 MiB).
constexpr std::size_t capacity_step = 2 * MiB;

/// The smallest multiple of capacity_step on which the whole trace runs: a binary search between peak requested
/// (where it must fail: the bytes live at the peak do not fit) and the peak reserved of the unlimited run (where it
/// must run, nothing differing until an upstream allocation fails; checked). Success need not be monotonic in the
/// capacity: the result runs, and one step below it did not.
std::size_t min_capacity(const trace& t, const variant& v, std::size_t unlimited_peak) {
  const auto runs_on = [&](std::size_t steps) { return v.run(t, steps * capacity_step).completed; };
  std::size_t fails = (t.peak_requested - 1) / capacity_step;  // in steps: below peak requested
  std::size_t runs = (std::max(unlimited_peak, t.peak_requested) + capacity_step - 1) / capacity_step;
  while (!runs_on(runs)) {
    fails = runs;
    runs += std::max<std::size_t>(runs / 2, 1);
  }
  while (runs - fails > 1) {
    const std::size_t mid = fails + (runs - fails) / 2;
    if (runs_on(mid)) {
      runs = mid;
    } else {
      fails = mid;
    }
  }
  return runs * capacity_step;
}

/// One allocator's figures on one trace family: mean and worst over its seeds.
struct family_figures {
  double peak_ratio = 0, peak_ratio_worst = 0;      // peak reserved / peak requested, unlimited capacity
  double calls = 0;                                 // mean upstream allocations + frees, unlimited capacity
  double min_capacity = 0, min_capacity_worst = 0;  // min capacity / peak requested (0: not measured)
  double frees_after_warmup = 0;                    // mean, unlimited capacity
  std::size_t frees_after_warmup_worst = 0;
  std::vector<double> peak_ratio_by_seed, min_capacity_by_seed;  // each seed's, in the family's order
};

struct family {
  std::string name;
  std::vector<trace> traces;
};

family_figures measure(const family& f, const variant& v, bool with_min_capacity) {
  family_figures x;
  for (const trace& t : f.traces) {
    const run_result r = v.run(t, unlimited_capacity);
    const double ratio = static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_requested);
    x.peak_ratio += ratio;
    x.peak_ratio_worst = std::max(x.peak_ratio_worst, ratio);
    x.peak_ratio_by_seed.push_back(ratio);
    x.calls += static_cast<double>(r.upstream_calls());
    x.frees_after_warmup += static_cast<double>(r.frees_after_warmup);
    x.frees_after_warmup_worst = std::max(x.frees_after_warmup_worst, r.frees_after_warmup);
    if (with_min_capacity) {
      const double c = static_cast<double>(min_capacity(t, v, r.peak_reserved)) / static_cast<double>(t.peak_requested);
      x.min_capacity += c;
      x.min_capacity_worst = std::max(x.min_capacity_worst, c);
      x.min_capacity_by_seed.push_back(c);
    }
  }
  const double n = static_cast<double>(f.traces.size());
  x.peak_ratio /= n;
  x.calls /= n;
  x.frees_after_warmup /= n;
  x.min_capacity /= n;
  return x;
}

/// `seeds` traces of one shape, seeds 100, 101, ...
std::vector<trace> seeded(transformer_shape shape, int seeds) {
  std::vector<trace> ts;
  for (int i = 0; i < seeds; ++i) {
    shape.seed = static_cast<std::uint64_t>(100 + i);
    ts.push_back(transformer_training(shape));
  }
  return ts;
}

/// A training shape whose sequence length changes every step (drawn from [seq/2, seq]).
transformer_shape variable_length(int layers, std::size_t hidden, std::size_t seq, std::size_t batch, int steps,
                                  std::size_t vocab = transformer_shape{}.vocab) {
  transformer_shape s;
  s.layers = layers;
  s.hidden = hidden;
  s.seq = seq;
  s.batch = batch;
  s.steps = steps;
  s.vocab = vocab;
  s.variable_seq = true;
  return s;
}

/// The two variable-length families whose huge tensors change size every step (also in the pressure table).
transformer_shape l12_h768_variable() { return variable_length(12, 768, 1024, 8, 6); }
transformer_shape l6_h512_variable() { return variable_length(6, 512, 512, 4, 6); }

/// Trace families with several seeds each: single traces swing either way with small changes (where exactly the
/// peak falls is chaotic), so candidates are compared on the mean and the worst case of each family.
std::vector<family> families(int seeds) {
  std::vector<family> list;
  for (const transformer_shape& shape :
       {transformer_shape{}, l12_h768_variable(), variable_length(4, 4096, 2048, 2, 5, 32000), l6_h512_variable(),
        variable_length(2, 256, 256, 2, 6, 8000)}) {
    list.push_back({describe(shape), seeded(shape, seeds)});
  }
  for (std::size_t max_size : {1 * MiB, 64 * MiB}) {
    family f{"random 73/27, sizes <= " + std::to_string(max_size >> 20) + " MiB", {}};
    for (int i = 0; i < seeds; ++i)
      f.traces.push_back(random_allocations(10000, max_size, static_cast<std::uint64_t>(i + 1)));
    list.push_back(std::move(f));
  }
  return list;
}

/// Any allocator_options on every family: peak reserved, minimum capacity and frees after warm-up (for choosing
/// defaults; --explore prints these for candidates()).
std::vector<family_figures> evaluate(const gpukit::allocator_options& o, const std::vector<family>& fs) {
  std::vector<family_figures> result;
  const variant v = engine_variant("", o);
  for (const family& f : fs) result.push_back(measure(f, v, true));
  return result;
}

/// gpukit's defaults and the baselines: PyTorch's constants in the same engine, the model of PyTorch's algorithm,
/// a power-of-two bin cache (all sizes cached), and cub::CachingDeviceAllocator's defaults (growth 8, bins
/// 512 B..2 MiB, 6 MB cache cap). `min_capacity` says which get a minimum-capacity search.
struct allocator_entry {
  variant v;
  bool min_capacity;
};
/// gpukit's defaults with expandable segments (pages of 2 MiB mapped into one virtual range per pool).
gpukit::allocator_options expandable() {
  gpukit::allocator_options o;
  o.expandable_segments = true;
  return o;
}

/// gpukit's defaults with allocator_options::reuse_before_release (cached blocks kept whole serve requests, and only
/// what a new segment needs is given back, before the whole cache is).
gpukit::allocator_options reuse_before_release() {
  gpukit::allocator_options o;
  o.reuse_before_release = true;
  return o;
}

/// gpukit's defaults with allocator_options::front_cache_large: large blocks cached per stream from the start (the
/// defaults do so only once threads wait for the device lock, which a single-threaded replay never does).
gpukit::allocator_options large_front() {
  gpukit::allocator_options o;
  o.front_cache_large = true;
  return o;
}

std::vector<allocator_entry> allocators() {
  std::vector<allocator_entry> list = {
      {engine_variant("gpukit defaults", gpukit::allocator_options{}), true},
      {engine_variant("PyTorch constants", gpukit::allocator_options::pytorch()), true},
      {model_variant("PyTorch model"), true},
      {bins_variant("power-of-two bins", 2, 512, ~std::size_t{0}, ~std::size_t{0}), true},
      {bins_variant("CUB default bins", 8, 512, 2 * MiB, 6 * MiB - 1), false},
      {engine_variant("gpukit expandable segments", expandable()), true},
      {engine_variant("gpukit, large blocks in front", large_front()), true}};
  const char* labels[] = {"gpukit", "pytorch()", "PT model", "pow2", "CUB", "expandable", "large front"};
  for (std::size_t i = 0; i < list.size(); ++i) list[i].v.label = labels[i];
  return list;
}

/// How the defaults were chosen: PyTorch's constants, each of gpukit's changes alone, and combinations.
std::vector<std::pair<std::string, gpukit::allocator_options>> candidates() {
  const auto pt = gpukit::allocator_options::pytorch();
  std::vector<std::pair<std::string, gpukit::allocator_options>> list;
  list.emplace_back("PyTorch", pt);
  auto with = [&](std::string name, auto change) {
    auto o = pt;
    change(o);
    list.emplace_back(std::move(name), o);
  };
  with("split always", [](gpukit::allocator_options& o) { o.large_split_threshold = 0; });
  with("rounding 256", [](gpukit::allocator_options& o) { o.rounding = 256; });
  with("max_split 256M", [](gpukit::allocator_options& o) { o.max_split_size = 256 * MiB; });
  with("release<grow", [](gpukit::allocator_options& o) { o.release_before_grow = true; });
  with("<64M growing", [](gpukit::allocator_options& o) {
    o.medium_size = 64 * MiB;
    o.medium_segment_growth = 8;
  });
  with("<64M in 256M", [](gpukit::allocator_options& o) {
    o.medium_size = 64 * MiB;
    o.medium_segment_size = 256 * MiB;
    o.release_before_grow = true;
  });
  with("rel+<64M grow", [](gpukit::allocator_options& o) {
    o.release_before_grow = true;
    o.medium_size = 64 * MiB;
    o.medium_segment_growth = 8;
  });
  with("rel+grow/4+ms", [](gpukit::allocator_options& o) {
    o.release_before_grow = true;
    o.medium_size = 64 * MiB;
    o.medium_segment_growth = 4;
    o.max_split_size = 256 * MiB;
  });
  with("rel+grow/16+ms", [](gpukit::allocator_options& o) {
    o.release_before_grow = true;
    o.medium_size = 64 * MiB;
    o.medium_segment_growth = 16;
    o.max_split_size = 256 * MiB;
  });
  list.emplace_back("gpukit", gpukit::allocator_options{});
  return list;
}

using figure_table = std::vector<std::vector<family_figures>>;  // [family][variant]

figure_table measure_all(const std::vector<family>& fs, const std::vector<variant>& vs,
                         const std::vector<bool>& with_min_capacity) {
  figure_table table(fs.size());
  for (std::size_t i = 0; i < fs.size(); ++i) {
    for (std::size_t j = 0; j < vs.size(); ++j) table[i].push_back(measure(fs[i], vs[j], with_min_capacity[j]));
  }
  return table;
}

std::size_t seeds_of(const std::vector<family>& fs) { return fs.empty() ? 0 : fs.front().traces.size(); }

void print_peak_table(const std::vector<family>& fs, const std::vector<variant>& vs, const figure_table& x) {
  std::printf(
      "\nFragmentation: peak reserved / peak requested (1.000 = no overhead), mean and worst over %zu seeds,\n"
      "and the mean number of upstream calls (cudaMalloc + cudaFree; a bin cache that does not cache a size calls\n"
      "the upstream for every allocation and free of it)\n%-34s",
      seeds_of(fs), "trace family");
  for (const auto& v : vs) std::printf(" | %17.17s", v.name.c_str());
  std::printf("\n");
  for (std::size_t i = 0; i < fs.size(); ++i) {
    std::printf("%-34.34s", fs[i].name.c_str());
    for (const family_figures& f : x[i]) std::printf(" | %5.3f %5.3f %5.0f", f.peak_ratio, f.peak_ratio_worst, f.calls);
    std::printf("\n");
  }
  std::fflush(stdout);
}

/// Minimum capacity of the variants in `capacity` (mean, worst), peak reserved of those in `peak` (mean) and
/// upstream frees after warm-up of those in `frees` (mean), all indices into vs.
void print_capacity_table(const std::vector<family>& fs, const std::vector<variant>& vs, const figure_table& x,
                          const std::vector<std::size_t>& capacity, const std::vector<std::size_t>& peak,
                          const std::vector<std::size_t>& frees) {
  std::printf(
      "\nMinimum capacity: the smallest upstream capacity on which the whole trace runs without out-of-memory,\n"
      "/ peak requested (in 2 MiB steps), mean and worst over %zu seeds; peak reserved / peak requested with\n"
      "unlimited capacity (mean); upstream frees after the warm-up (first training step, first 10 %% of random\n"
      "operations; mean over seeds, unlimited capacity)\n%-34s",
      seeds_of(fs), "");
  auto group = [&](const char* title, std::size_t n, int width) {
    const int w = static_cast<int>(n) * (width + 3) - 3;
    std::printf(" || %-*.*s", w, w, title);
  };
  group("min capacity / peak requested", capacity.size(), 11);
  group("peak reserved", peak.size(), 9);
  group("frees after warm-up", frees.size(), 9);
  std::printf("\n%-34s", "trace family");
  auto names = [&](const std::vector<std::size_t>& list, int width) {
    for (std::size_t k = 0; k < list.size(); ++k) {
      std::printf(k == 0 ? " || %*.*s" : " | %*.*s", width, width, vs[list[k]].label.c_str());
    }
  };
  names(capacity, 11);
  names(peak, 9);
  names(frees, 9);
  std::printf("\n");
  for (std::size_t i = 0; i < fs.size(); ++i) {
    std::printf("%-34.34s", fs[i].name.c_str());
    for (std::size_t k = 0; k < capacity.size(); ++k) {
      const family_figures& f = x[i][capacity[k]];
      std::printf(k == 0 ? " || %5.3f %5.3f" : " | %5.3f %5.3f", f.min_capacity, f.min_capacity_worst);
    }
    for (std::size_t k = 0; k < peak.size(); ++k)
      std::printf(k == 0 ? " || %9.3f" : " | %9.3f", x[i][peak[k]].peak_ratio);
    for (std::size_t k = 0; k < frees.size(); ++k) {
      std::printf(k == 0 ? " || %9.1f" : " | %9.1f", x[i][frees[k]].frees_after_warmup);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

/// Each seed's minimum capacity and peak reserved (both / peak requested) for the variants in `list`: the means and
/// worsts above hide which traces decide them.
void print_seed_table(const std::vector<family>& fs, const std::vector<variant>& vs, const figure_table& x,
                      const std::vector<std::size_t>& list) {
  std::printf("\nEach seed: minimum capacity / peak requested, then peak reserved / peak requested (unlimited)\n%-39s",
              "trace family, seed");
  for (std::size_t k : list) std::printf(" | %13.13s", vs[k].label.c_str());
  std::printf("\n");
  for (std::size_t i = 0; i < fs.size(); ++i) {
    for (std::size_t seed = 0; seed < fs[i].traces.size(); ++seed) {
      std::printf("%-34.34s %4zu", fs[i].name.c_str(), seed);
      for (std::size_t k : list) {
        const family_figures& f = x[i][k];
        const double capacity = seed < f.min_capacity_by_seed.size() ? f.min_capacity_by_seed[seed] : 0.0;
        std::printf(" | %6.3f %6.3f", capacity, f.peak_ratio_by_seed[seed]);
      }
      std::printf("\n");
    }
  }
  std::fflush(stdout);
}

/// For --explore: each candidate's minimum capacity (mean, worst) and mean upstream frees after warm-up.
void print_candidate_capacity(const std::vector<family>& fs, const std::vector<variant>& vs, const figure_table& x) {
  std::printf(
      "\nMinimum capacity / peak requested (mean, worst over %zu seeds) and mean upstream frees after warm-up\n%-34s",
      seeds_of(fs), "trace family");
  for (const auto& v : vs) std::printf(" | %17.17s", v.name.c_str());
  std::printf("\n");
  for (std::size_t i = 0; i < fs.size(); ++i) {
    std::printf("%-34.34s", fs[i].name.c_str());
    for (const family_figures& f : x[i]) {
      std::printf(" | %5.3f %5.3f %5.0f", f.min_capacity, f.min_capacity_worst, f.frees_after_warmup);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

// --- churn and the inference server (section 3) ---

struct call_counts {
  bool completed = true;  // false: an allocation failed (out of memory) and the replay stopped there
  std::size_t allocs = 0, frees = 0, frees_after_warmup = 0;
  std::size_t releasing_ops = 0;  // operations after warm-up that freed upstream memory (see warmup_frees)
  std::size_t unforced_frees = 0, sync_all_streams = 0;  // gpukit's statistics (0 for the model)
  std::size_t peak_reserved = 0;                         // gpukit's
};

/// The engine on one gpukit CPU stream per stream of the trace (blocks cached for one stream serve only it), on an
/// upstream of `capacity` bytes; stops at the first out-of-memory error. With `replace_every` n > 0, a stream is
/// destroyed and a new one made in its place every n-th time it has no allocation left (a server's stream per
/// request, or per few).
call_counts streams_engine(const trace& t, const gpukit::allocator_options& o,
                           std::size_t capacity = unlimited_capacity, int replace_every = 0) {
  const gpukit::device cpu = gpukit::device::cpu();
  engine a(cpu, o, capacity);
  std::vector<std::unique_ptr<gpukit::stream>> streams;
  for (int s = 0; s < t.streams; ++s) streams.push_back(std::make_unique<gpukit::stream>(cpu));
  std::vector<int> live_on(static_cast<std::size_t>(t.streams), 0), idle(static_cast<std::size_t>(t.streams), 0);
  std::vector<void*> pointers(t.ids, nullptr);
  std::vector<int> stream_of(t.ids, 0);
  call_counts c;
  warmup_frees after_warmup(t);
  for (std::size_t i = 0; i < t.ops.size(); ++i) {
    after_warmup.look(i, static_cast<std::size_t>(a.stats().num_device_free));
    const trace_op& op = t.ops[i];
    if (op.allocate) {
      try {
        pointers[op.id] = a.allocate(op.bytes, streams[static_cast<std::size_t>(op.stream)]->view());
      } catch (const gpukit::out_of_memory_error&) {
        c.completed = false;
        break;
      }
      stream_of[op.id] = op.stream;
      ++live_on[static_cast<std::size_t>(op.stream)];
    } else {
      a.deallocate(pointers[op.id]);
      pointers[op.id] = nullptr;
      const auto s = static_cast<std::size_t>(stream_of[op.id]);
      if (--live_on[s] == 0 && replace_every > 0 && ++idle[s] % replace_every == 0) {
        streams[s] = std::make_unique<gpukit::stream>(cpu);  // the old one destroyed (its work has completed)
      }
    }
  }
  c.peak_reserved = static_cast<std::size_t>(a.stats().reserved_bytes.all().peak);
  c.allocs = static_cast<std::size_t>(a.stats().num_device_alloc);
  c.frees = static_cast<std::size_t>(a.stats().num_device_free);
  c.frees_after_warmup = after_warmup.after(c.frees, c.completed);
  c.releasing_ops = after_warmup.releasing_ops(c.frees, c.completed);
  c.unforced_frees = static_cast<std::size_t>(a.stats().num_device_free_unforced);
  c.sync_all_streams = static_cast<std::size_t>(a.stats().num_sync_all_streams);
  for (void* p : pointers) {
    if (p != nullptr) a.deallocate(p);
  }
  return c;
}

/// The PyTorch model with the trace's streams as its stream keys (a block freed on one stream serves only that
/// stream; a refused cudaMalloc releases every stream's free segments), on `capacity` bytes.
call_counts streams_model(const trace& t, std::size_t capacity = pytorch_allocator_model::unlimited) {
  pytorch_allocator_model model(capacity);
  std::vector<void*> pointers(t.ids, nullptr);
  call_counts c;
  warmup_frees after_warmup(t);
  for (std::size_t i = 0; i < t.ops.size(); ++i) {
    after_warmup.look(i, model.upstream_frees());
    const trace_op& op = t.ops[i];
    if (op.allocate) {
      pointers[op.id] = model.allocate(op.bytes, op.stream);
      if (pointers[op.id] == nullptr) {
        c.completed = false;
        break;
      }
    } else {
      model.deallocate(pointers[op.id]);
    }
  }
  c.allocs = model.upstream_allocs();
  c.frees = model.upstream_frees();
  c.frees_after_warmup = after_warmup.after(c.frees, c.completed);
  c.releasing_ops = after_warmup.releasing_ops(c.frees, c.completed);
  return c;
}

/// Prints the churn and server cases; returns gpukit's upstream frees after warm-up over all of them.
std::size_t print_churn_table() {
  // Churn as asked in issue 9 (at most 4 MiB live), and with 2 MiB live, where the footprint sits at its high-water
  // mark; the server: 3000 requests on 3 CPU streams, 2-5 buffers of 4 KiB..64 MiB each.
  const trace cases[] = {churn(4000, 4 * MiB, 1 * KiB, 2 * MiB, 1), churn(4000, 2 * MiB, 1 * KiB, 2 * MiB, 1),
                         inference_server(3000, 3, 4 * KiB, 64 * MiB, 1)};
  std::printf(
      "\nUpstream calls: cudaMalloc / cudaFree per 1000 allocations [counts: mallocs, frees, frees after the "
      "first 10 %%]\n(the PyTorch model: free blocks keyed by stream)\n%-48s | %-30s | %-30s | %-30s\n",
      "case", "gpukit defaults", "PyTorch constants", "PyTorch model");
  std::size_t gpukit_frees = 0, unforced = 0, syncs = 0;
  for (const trace& t : cases) {
    const call_counts counts[] = {streams_engine(t, gpukit::allocator_options{}),
                                  streams_engine(t, gpukit::allocator_options::pytorch()), streams_model(t)};
    char name[64];
    std::snprintf(name, sizeof name, "%s (%zu allocations)", t.name.c_str(), t.allocations);
    std::printf("%-48s", name);
    const double per = 1000.0 / static_cast<double>(t.allocations);
    gpukit_frees += counts[0].frees_after_warmup;
    unforced += counts[0].unforced_frees;
    syncs += counts[0].sync_all_streams;
    for (const call_counts& c : counts) {
      char cell[64];
      std::snprintf(cell, sizeof cell, "%5.1f / %5.1f [%zu, %zu, %zu]", static_cast<double>(c.allocs) * per,
                    static_cast<double>(c.frees) * per, c.allocs, c.frees, c.frees_after_warmup);
      std::printf(" | %-30s", cell);
    }
    std::printf("\n");
  }
  // Issue 9 asks for both counts: frees no limit, failure or release forced, and PyTorch's host waits for all streams.
  std::printf(
      "gpukit defaults, the three cases together: %zu upstream frees not forced (num_device_free_unforced), %zu "
      "host waits for every stream (num_sync_all_streams)\n",
      unforced, syncs);
  std::fflush(stdout);
  return gpukit_frees;
}

/// Issue 9's targets, each beside what was measured above: variant `gpukit` against the reference model `model`.
void print_targets(const std::vector<family>& fs, const figure_table& x, std::size_t gpukit, std::size_t model,
                   std::size_t churn_frees) {
  std::size_t capacity_met = 0, frees_met = 0, traces = 0, traces_met = 0;
  std::string misses, seed_misses;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    const family_figures& g = x[i][gpukit];
    const family_figures& m = x[i][model];
    if (g.min_capacity <= m.min_capacity && g.min_capacity_worst <= m.min_capacity_worst) {
      ++capacity_met;
    } else {
      char miss[160];
      std::snprintf(miss, sizeof miss, "%s%s: %.3f %.3f against %.3f %.3f", misses.empty() ? "" : "; ",
                    fs[i].name.c_str(), g.min_capacity, g.min_capacity_worst, m.min_capacity, m.min_capacity_worst);
      misses += miss;
    }
    if (g.frees_after_warmup == 0) ++frees_met;
    for (std::size_t seed = 0; seed < g.min_capacity_by_seed.size() && seed < m.min_capacity_by_seed.size(); ++seed) {
      ++traces;
      const double mine = g.min_capacity_by_seed[seed], theirs = m.min_capacity_by_seed[seed];
      if (mine <= theirs) {
        ++traces_met;
        continue;
      }
      // How many capacity steps more gpukit needed: both are whole steps.
      const double steps =
          (mine - theirs) * static_cast<double>(fs[i].traces[seed].peak_requested) / static_cast<double>(capacity_step);
      char miss[200];
      std::snprintf(miss, sizeof miss, "%s%s seed %zu: %.4f against %.4f, %.0f x 2 MiB more",
                    seed_misses.empty() ? "" : "; ", fs[i].name.c_str(), seed, mine, theirs, steps);
      seed_misses += miss;
    }
  }
  std::printf(
      "\nTargets (issue 9), gpukit defaults against the PyTorch model in this run:\n"
      "  minimum capacity <= the model's, mean and worst, on every family: %zu of %zu families%s%s%s\n"
      "  minimum capacity <= the model's on the same trace, each seed: %zu of %zu traces%s%s%s\n"
      "  no upstream free after warm-up on every family: %zu of %zu families\n"
      "  no upstream free after warm-up in the churn and server cases: %s (%zu frees)\n",
      capacity_met, fs.size(), misses.empty() ? "" : " (missed: ", misses.c_str(), misses.empty() ? "" : ")",
      traces_met, traces, seed_misses.empty() ? "" : " (missed: ", seed_misses.c_str(), seed_misses.empty() ? "" : ")",
      frees_met, fs.size(), churn_frees == 0 ? "met" : "NOT met", churn_frees);
  std::fflush(stdout);
}

/// What front_cache_large costs a single-threaded job: its minimum capacity against the defaults' (which turn it on
/// only under contention, so never here). What a multi-threaded job pays once contention turns it on.
void print_large_front_cost(const std::vector<family>& fs, const figure_table& x, std::size_t large, std::size_t base) {
  double worst_mean = 0, worst_worst = 0;
  std::string where;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    const double mean = x[i][large].min_capacity / x[i][base].min_capacity;
    const double worst = x[i][large].min_capacity_worst / x[i][base].min_capacity_worst;
    if (mean > worst_mean) where = fs[i].name;
    worst_mean = std::max(worst_mean, mean);
    worst_worst = std::max(worst_worst, worst);
  }
  std::printf(
      "  front_cache_large (large blocks cached per stream; on from the start, or once threads contend by default): "
      "minimum capacity "
      "%.3fx the defaults' at most (mean, on %s), %.3fx on the worst seed\n",
      worst_mean, where.c_str(), worst_worst);
  std::fflush(stdout);
}

/// The least memory any placement needs to run trace `t` with expandable segments, / peak requested: each stream
/// has a small and a large range (requests rounded as gpukit's defaults round them, small up to small_size), and a
/// range needs at least ceil(its live bytes / page) pages mapped at every moment, whatever the blocks' addresses.
/// The maximum over the trace of the sum over ranges is a floor no allocator of this design can go below.
double expandable_page_floor(const trace& t, std::size_t page = 2 * MiB) {
  const gpukit::allocator_options o;
  std::vector<std::size_t> sizes(t.ids, 0);
  std::vector<std::size_t> live(2 * static_cast<std::size_t>(t.streams), 0);  // [stream * 2 + small]
  std::size_t floor_pages = 0;
  for (const trace_op& op : t.ops) {
    if (op.allocate) sizes[op.id] = (op.bytes + o.rounding - 1) / o.rounding * o.rounding;
    const std::size_t range = std::size_t{op.stream} * 2 + (sizes[op.id] <= o.small_size ? 1 : 0);
    live[range] = op.allocate ? live[range] + sizes[op.id] : live[range] - sizes[op.id];
    std::size_t pages = 0;
    for (std::size_t bytes : live) pages += (bytes + page - 1) / page;
    floor_pages = std::max(floor_pages, pages);
  }
  return static_cast<double>(floor_pages * page) / static_cast<double>(t.peak_requested);
}

/// Issue 9, section 3: with expandable segments, minimum capacity <= 1.02 x peak requested on every family and
/// seed (the worst seed is what is checked). A miss is printed with the highest page floor of its traces
/// (expandable_page_floor): when the floor itself is above 1.02, no placement meets the target with these pages.
void print_expandable_target(const std::vector<family>& fs, const figure_table& x, std::size_t expandable,
                             std::size_t model) {
  std::size_t met = 0;
  std::string misses;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    const family_figures& e = x[i][expandable];
    if (e.min_capacity_worst <= 1.02) {
      ++met;
    } else {
      double floor_worst = 0;
      for (const trace& t : fs[i].traces) floor_worst = std::max(floor_worst, expandable_page_floor(t));
      char miss[240];
      std::snprintf(miss, sizeof miss,
                    "%s%s: %.3f worst (PyTorch model %.3f; page floor %.3f: 2 MiB pages, a small and a large range "
                    "per stream)",
                    misses.empty() ? "" : "; ", fs[i].name.c_str(), e.min_capacity_worst,
                    x[i][model].min_capacity_worst, floor_worst);
      misses += miss;
    }
  }
  std::printf(
      "  expandable segments: minimum capacity <= 1.02 x peak requested on every family and seed: %zu of %zu "
      "families%s%s%s\n",
      met, fs.size(), misses.empty() ? "" : " (missed: ", misses.c_str(), misses.empty() ? "" : ")");
  std::fflush(stdout);
}

/// What a replay under pressure counted after its warm-up (see warmup_frees).
struct pressure_count {
  bool completed = true;
  std::size_t frees = 0;          // upstream frees: cudaFree calls, or pages unmapped
  std::size_t releasing_ops = 0;  // operations that freed at least once: each waits for the device on a GPU
};

/// One cell of each pressure table: the mean upstream frees and releasing operations after warm-up on capacities of
/// 1.2, 1.5 and 2 x each trace's peak requested, over the traces that ran ("a / b / c", "[n]" after a figure only n
/// traces gave, "-[0]" where none ran).
std::pair<std::string, std::string> pressure_cells(
    const std::vector<trace>& traces, const std::function<pressure_count(const trace&, std::size_t)>& run) {
  std::string frees_cell, ops_cell;
  for (const double factor : {1.2, 1.5, 2.0}) {
    double frees = 0, ops = 0;
    std::size_t ran = 0;
    for (const trace& t : traces) {
      const pressure_count c = run(t, static_cast<std::size_t>(factor * static_cast<double>(t.peak_requested)));
      if (!c.completed) continue;
      frees += static_cast<double>(c.frees);
      ops += static_cast<double>(c.releasing_ops);
      ++ran;
    }
    for (auto [cell, sum] : {std::make_pair(&frees_cell, frees), std::make_pair(&ops_cell, ops)}) {
      if (!cell->empty()) *cell += " / ";
      if (ran == 0) {
        *cell += "-";  // no trace ran
      } else {
        char figure[32];
        std::snprintf(figure, sizeof figure, "%.0f", sum / static_cast<double>(ran));
        *cell += figure;
      }
      if (ran != traces.size()) *cell += "[" + std::to_string(ran) + "]";
    }
  }
  return {frees_cell, ops_cell};
}

/// Memory pressure: a long training run or a server whose device is somewhat larger than its peak, where what
/// matters is how often the allocator gives memory back (each cudaFree drains the device) rather than whether the job
/// fits. Two variable-length families, 40 steps each, and the 3-stream inference server (3000 requests), on
/// capacities of 1.2, 1.5 and 2 x peak requested: upstream frees after the warm-up (the first step, the first 10 % of
/// requests), mean over the seeds that ran (how many did, in brackets), then the operations during which they
/// happened (the waits for the device: a burst of frees or unmapped pages counts once). Then the minimum capacity
/// reuse_before_release pays for it, beside the defaults' and the PyTorch model's from table 2.
void print_pressure_table(int seeds, const std::vector<family>& fs, const figure_table& x, std::size_t gpukit,
                          std::size_t model) {
  const std::vector<variant> vs = {engine_variant("gpukit defaults", gpukit::allocator_options{}),
                                   engine_variant("reuse_before_release", reuse_before_release()),
                                   engine_variant("expandable segments", expandable()), model_variant("PyTorch model")};
  struct row {
    std::string name;
    std::vector<std::pair<std::string, std::string>> cells;  // per variant: frees, releasing operations
  };
  std::vector<row> rows;
  for (transformer_shape s : {l12_h768_variable(), l6_h512_variable()}) {
    s.steps = 40;
    const std::vector<trace> traces = seeded(s, seeds);
    row r{describe(s), {}};
    for (const variant& v : vs) {
      r.cells.push_back(pressure_cells(traces, [&v](const trace& t, std::size_t capacity) {
        const run_result result = v.run(t, capacity);
        return pressure_count{result.completed, result.frees_after_warmup, result.releasing_ops};
      }));
    }
    rows.push_back(std::move(r));
  }
  // The same four on the server's streams: each stream's free blocks serve only that stream, so a stream short of
  // memory makes the others give theirs back.
  std::vector<trace> servers;
  for (int seed = 1; seed <= seeds; ++seed) {
    servers.push_back(inference_server(3000, 3, 4 * KiB, 64 * MiB, static_cast<std::uint64_t>(seed)));
  }
  const auto counted = [](const call_counts& c) {
    return pressure_count{c.completed, c.frees_after_warmup, c.releasing_ops};
  };
  row server{"inference server, 3 streams", {}};
  for (const gpukit::allocator_options& o : {gpukit::allocator_options{}, reuse_before_release(), expandable()}) {
    server.cells.push_back(pressure_cells(
        servers, [&](const trace& t, std::size_t capacity) { return counted(streams_engine(t, o, capacity)); }));
  }
  server.cells.push_back(pressure_cells(
      servers, [&](const trace& t, std::size_t capacity) { return counted(streams_model(t, capacity)); }));
  rows.push_back(std::move(server));
  for (const bool ops : {false, true}) {
    std::printf(ops ? "\nMemory pressure: operations that gave memory back after the warm-up (each waits for the "
                      "device once or more), same runs\n%-34s"
                    : "\nMemory pressure: upstream frees after the warm-up on a capacity of 1.2 / 1.5 / 2 x peak "
                      "requested\n(mean over the seeds that ran; [seeds that ran])\n%-34s",
                "trace family, 40 steps");
    for (const variant& v : vs) std::printf(" | %-32.32s", v.name.c_str());
    std::printf("\n");
    for (const row& r : rows) {
      std::printf("%-34.34s", r.name.c_str());
      for (const auto& [frees, releasing] : r.cells) std::printf(" | %-32s", (ops ? releasing : frees).c_str());
      std::printf("\n");
    }
  }
  std::printf("(the server: 3000 requests, its warm-up the first 10 %%)\n");
  const std::vector<family_figures> reuse = evaluate(reuse_before_release(), fs);
  std::printf(
      "\nMinimum capacity / peak requested (mean, worst) with reuse_before_release, beside the defaults and the "
      "PyTorch model\n%-34s | %-13s | %-20s | %-13s\n",
      "trace family", "defaults", "reuse_before_release", "PyTorch model");
  std::size_t met = 0;
  for (std::size_t i = 0; i < fs.size(); ++i) {
    const family_figures& g = x[i][gpukit];
    const family_figures& m = x[i][model];
    std::printf("%-34.34s | %5.3f %5.3f   | %5.3f %5.3f          | %5.3f %5.3f\n", fs[i].name.c_str(), g.min_capacity,
                g.min_capacity_worst, reuse[i].min_capacity, reuse[i].min_capacity_worst, m.min_capacity,
                m.min_capacity_worst);
    if (reuse[i].min_capacity <= m.min_capacity && reuse[i].min_capacity_worst <= m.min_capacity_worst) ++met;
  }
  std::printf("reuse_before_release: minimum capacity <= the PyTorch model's, mean and worst: %zu of %zu families\n",
              met, fs.size());
  std::fflush(stdout);
}

/// Stream churn: the 3-stream server with its streams kept, and replaced every 1st / 4th / 16th time one has no
/// allocation left; peak reserved (MiB, mean and worst over the seeds) with the defaults and with expandable segments.
/// Replacing streams should cost no more than keeping them: a new stream continues with a destroyed one's memory.
void print_stream_churn_table(int seeds) {
  std::vector<trace> servers;
  for (int seed = 1; seed <= seeds; ++seed) {
    servers.push_back(inference_server(3000, 3, 4 * KiB, 64 * MiB, static_cast<std::uint64_t>(seed)));
  }
  const int replace_every[] = {0, 1, 4, 16};
  std::printf(
      "\nStream churn: peak reserved (MiB, mean / worst) on the 3-stream server, streams kept or replaced every n-th "
      "time one is idle\n%-34s | %-13s | %-13s | %-13s | %-13s\n",
      "allocator", "kept", "every 1st", "every 4th", "every 16th");
  const std::pair<const char*, gpukit::allocator_options> rows[] = {{"gpukit defaults", gpukit::allocator_options{}},
                                                                    {"expandable segments", expandable()}};
  for (const auto& [name, o] : rows) {
    std::printf("%-34s", name);
    for (const int every : replace_every) {
      double sum = 0, worst = 0;
      for (const trace& t : servers) {
        const double peak = static_cast<double>(streams_engine(t, o, unlimited_capacity, every).peak_reserved) /
                            static_cast<double>(MiB);
        sum += peak;
        worst = std::max(worst, peak);
      }
      std::printf(" | %5.0f / %5.0f", sum / static_cast<double>(servers.size()), worst);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

void BM_fragmentation(benchmark::State& state, const trace* t, variant v) {
  run_result r;
  for (auto _ : state) r = v.run(*t, unlimited_capacity);
  state.counters["ratio"] = static_cast<double>(r.peak_reserved) / static_cast<double>(t->peak_requested);
  state.counters["peak_reserved_GiB"] = static_cast<double>(r.peak_reserved) / static_cast<double>(GiB);
  state.counters["peak_requested_GiB"] = static_cast<double>(t->peak_requested) / static_cast<double>(GiB);
  if (r.upstream_calls() != 0) state.counters["upstream_calls"] = static_cast<double>(r.upstream_calls());
  state.counters["ops"] = static_cast<double>(t->ops.size());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  bool exploring = false;
  bool tables = true;
  int seeds = 5;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--explore") == 0) {
      exploring = true;
    } else if (std::strcmp(argv[i], "--no-tables") == 0) {
      tables = false;
    } else if (std::strcmp(argv[i], "--seeds") == 0 && i + 1 < argc) {
      seeds = std::max(1, std::atoi(argv[++i]));
    } else {
      args.push_back(argv[i]);
    }
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  static const std::vector<family> fs = families(seeds);
  const auto start = std::chrono::steady_clock::now();
  if (exploring) {
    std::vector<variant> vs;
    figure_table x(fs.size());
    for (const auto& [name, options] : candidates()) {
      vs.push_back(engine_variant(name, options));
      const std::vector<family_figures> figures = evaluate(options, fs);
      for (std::size_t i = 0; i < fs.size(); ++i) x[i].push_back(figures[i]);
    }
    print_peak_table(fs, vs, x);
    print_candidate_capacity(fs, vs, x);
    std::printf("\n(tables: %.1f s)\n", seconds_since(start));
    return 0;
  }
  const auto entries = allocators();
  std::vector<variant> vs;
  std::vector<bool> with_min_capacity;
  for (const auto& e : entries) {
    vs.push_back(e.v);
    with_min_capacity.push_back(e.min_capacity);
  }
  if (tables) {
    const figure_table x = measure_all(fs, vs, with_min_capacity);
    print_peak_table(fs, vs, x);
    // gpukit defaults, PyTorch constants, PyTorch model, power-of-two bins, expandable (indices into allocators()).
    print_capacity_table(fs, vs, x, {0, 1, 2, 3, 5, 6}, {0, 2, 5}, {0, 1, 2, 5, 6});
    print_seed_table(fs, vs, x, {0, 2, 5});
    const std::size_t churn_frees = print_churn_table();
    print_targets(fs, x, 0, 2, churn_frees);
    print_expandable_target(fs, x, 5, 2);
    print_large_front_cost(fs, x, 6, 0);
    print_pressure_table(seeds, fs, x, 0, 2);
    print_stream_churn_table(seeds);
    std::printf("\n(tables: %.1f s)\n\n", seconds_since(start));
  }
  for (const auto& f : fs) {
    for (const auto& v : vs) {
      benchmark::RegisterBenchmark(("fragmentation/" + f.name + "/" + v.name).c_str(), BM_fragmentation,
                                   &f.traces.front(), v)
          ->Unit(benchmark::kMillisecond)
          ->Iterations(1);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
