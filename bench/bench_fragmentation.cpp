// Fragmentation: allocation traces replayed through the caching allocator over the address-space upstream (no
// memory is touched, so traces of tens of GiB run anywhere), reporting peak reserved / peak requested — the
// overhead a user pays in device memory. Baselines in the same run: PyTorch's constants as a configuration of the
// same engine, a power-of-two bin cache and cub::CachingDeviceAllocator's default bins.
//
// A plain run prints the table first (each trace family with 5 seeds: mean and worst ratio), then runs one
// benchmark per (family's first trace, allocator) whose counters repeat the figures. `--explore` prints the table
// of candidate constants from which gpukit's defaults were chosen.
#include "alloc_traces.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

using namespace gpukit_bench;

namespace {

using engine = gpukit::basic_caching_allocator<gpukit::address_space_upstream>;

/// The engine with the allocate(bytes)/deallocate(p, bytes) interface replay() uses, on the CPU default stream.
class engine_adapter {
 public:
  explicit engine_adapter(const gpukit::allocator_options& o) : a_(gpukit::device::cpu(), o, std::size_t{1} << 45) {}
  void* allocate(std::size_t bytes) { return a_.allocate(bytes, stream_); }
  void deallocate(void* p, std::size_t) { a_.deallocate(p); }
  std::size_t peak_reserved() const { return a_.max_memory_reserved(); }
  std::size_t upstream_calls() const {
    const auto s = a_.stats();
    return static_cast<std::size_t>(s.num_device_alloc + s.num_device_free);
  }

 private:
  engine a_;
  gpukit::stream_view stream_ = gpukit::stream_view::default_stream(gpukit::device::cpu());
};

struct result {
  std::size_t peak_reserved = 0;
  std::size_t upstream_calls = 0;
  double ratio = 0;
};

result run_engine(const trace& t, const gpukit::allocator_options& o) {
  engine_adapter a(o);
  std::vector<void*> pointers;
  replay(t, a, pointers);
  for (void* p : pointers) {
    if (p != nullptr) a.deallocate(p, 0);
  }
  result r;
  r.peak_reserved = a.peak_reserved();
  r.upstream_calls = a.upstream_calls();
  r.ratio = static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_requested);
  return r;
}

result run_bins(const trace& t, std::size_t growth, std::size_t min_bin, std::size_t max_bin, std::size_t max_cached) {
  bin_allocator_model a(growth, min_bin, max_bin, max_cached);
  std::vector<void*> pointers;
  replay(t, a, pointers);
  result r;
  r.peak_reserved = a.peak_reserved();
  r.upstream_calls = a.upstream_calls();
  r.ratio = static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_requested);
  return r;
}

/// Trace families with several seeds each: single traces swing either way with small changes (where exactly the
/// peak falls is chaotic), so candidates are compared on the mean and the worst case of each family.
struct family {
  std::string name;
  std::vector<trace> traces;
};

std::vector<family> families(int seeds) {
  std::vector<family> list;
  auto shapes = [seeds](transformer_shape base) {
    std::vector<trace> ts;
    for (int i = 0; i < seeds; ++i) {
      base.seed = static_cast<std::uint64_t>(100 + i);
      ts.push_back(transformer_training(base));
    }
    return ts;
  };
  transformer_shape a;
  list.push_back({describe(a), shapes(a)});
  transformer_shape b;
  b.layers = 12;
  b.hidden = 768;
  b.variable_seq = true;
  b.steps = 6;
  list.push_back({describe(b), shapes(b)});
  transformer_shape c;
  c.layers = 4;
  c.hidden = 4096;
  c.seq = 2048;
  c.batch = 2;
  c.vocab = 32000;
  c.variable_seq = true;
  c.steps = 5;
  list.push_back({describe(c), shapes(c)});
  transformer_shape d;
  d.layers = 6;
  d.hidden = 512;
  d.seq = 512;
  d.batch = 4;
  d.variable_seq = true;
  d.steps = 6;
  list.push_back({describe(d), shapes(d)});
  transformer_shape e;
  e.layers = 2;
  e.hidden = 256;
  e.seq = 256;
  e.batch = 2;
  e.vocab = 8000;
  e.variable_seq = true;
  e.steps = 6;
  list.push_back({describe(e), shapes(e)});
  for (std::size_t max_size : {1 * MiB, 64 * MiB}) {
    family f{"random 73/27, sizes <= " + std::to_string(max_size >> 20) + " MiB", {}};
    for (int i = 0; i < seeds; ++i) f.traces.push_back(random_allocations(10000, max_size, static_cast<std::uint64_t>(i + 1)));
    list.push_back(std::move(f));
  }
  return list;
}

struct variant {
  std::string name;
  std::function<result(const trace&)> run;
};

variant engine_variant(std::string name, gpukit::allocator_options o) {
  return {std::move(name), [o](const trace& t) { return run_engine(t, o); }};
}

/// gpukit's defaults and the baselines: PyTorch's constants in the same engine, a power-of-two bin cache (all
/// sizes cached), and cub::CachingDeviceAllocator's defaults (growth 8, bins 512 B..2 MiB, 6 MB cache cap).
std::vector<variant> allocators() {
  std::vector<variant> list;
  list.push_back(engine_variant("gpukit defaults", gpukit::allocator_options{}));
  list.push_back(engine_variant("PyTorch constants", gpukit::allocator_options::pytorch()));
  list.push_back({"power-of-two bins", [](const trace& t) { return run_bins(t, 2, 512, ~std::size_t{0}, ~std::size_t{0}); }});
  list.push_back({"CUB default bins", [](const trace& t) { return run_bins(t, 8, 512, 2 * MiB, 6 * MiB - 1); }});
  return list;
}

/// How the defaults were chosen: PyTorch's constants, each of gpukit's changes alone, and combinations.
std::vector<variant> candidates() {
  const auto pt = gpukit::allocator_options::pytorch();
  std::vector<variant> list;
  list.push_back(engine_variant("PyTorch", pt));
  auto with = [&](std::string name, auto change) {
    auto o = pt;
    change(o);
    list.push_back(engine_variant(std::move(name), o));
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
  list.push_back(engine_variant("gpukit", gpukit::allocator_options{}));
  return list;
}

void print_table(const std::vector<family>& fs, const std::vector<variant>& vs) {
  std::printf("\nFragmentation: peak reserved / peak requested (1.000 = no overhead), mean and worst over %zu seeds,\n"
              "and the mean number of upstream calls (cudaMalloc + cudaFree; a bin cache that does not cache a size calls\n"
              "the upstream for every allocation and free of it)\n%-34s",
              fs.empty() ? std::size_t{0} : fs.front().traces.size(), "trace family");
  for (const auto& v : vs) std::printf(" | %17.17s", v.name.c_str());
  std::printf("\n");
  for (const auto& f : fs) {
    std::printf("%-34.34s", f.name.c_str());
    for (const auto& v : vs) {
      double sum = 0;
      double worst = 0;
      double calls = 0;
      for (const auto& t : f.traces) {
        const result r = v.run(t);
        sum += r.ratio;
        worst = std::max(worst, r.ratio);
        calls += static_cast<double>(r.upstream_calls);
      }
      const double n = static_cast<double>(f.traces.size());
      if (calls > 0) {
        std::printf(" | %5.3f %5.3f %5.0f", sum / n, worst, calls / n);
      } else {
        std::printf(" | %5.3f %5.3f      ", sum / n, worst);
      }
    }
    std::printf("\n");
  }
  std::printf("\n");
  std::fflush(stdout);
}

void BM_fragmentation(benchmark::State& state, const trace* t, variant v) {
  result r;
  for (auto _ : state) r = v.run(*t);
  state.counters["ratio"] = r.ratio;
  state.counters["peak_reserved_GiB"] = static_cast<double>(r.peak_reserved) / static_cast<double>(GiB);
  state.counters["peak_requested_GiB"] = static_cast<double>(t->peak_requested) / static_cast<double>(GiB);
  if (r.upstream_calls != 0) state.counters["upstream_calls"] = static_cast<double>(r.upstream_calls);
  state.counters["ops"] = static_cast<double>(t->ops.size());
}

}  // namespace

int main(int argc, char** argv) {
  bool exploring = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--explore") == 0) {
      exploring = true;
    } else {
      args.push_back(argv[i]);
    }
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  static const std::vector<family> fs = families(5);
  if (exploring) {
    print_table(fs, candidates());
    return 0;
  }
  const auto vs = allocators();
  print_table(fs, vs);
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
