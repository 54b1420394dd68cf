// Pinned pool hot path: an allocate/deallocate pair served from the cache, against baselines measured in the same
// run: std::malloc/free and the upstream alone (page-aligned host memory, what the pool saves on the CPU device).
// With a CUDA device it also compares the CUDA pool's pair with cudaHostAlloc/cudaFreeHost.
#include <gpukit/gpukit.hpp>

#include "run_status.hpp"

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

gpukit::pinned_pool& cpu_pool() {
  static gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  return pool;
}

void BM_pool_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& pool = cpu_pool();
  pool.deallocate(pool.allocate(bytes));  // warm-up: one block of the class
  for (auto _ : state) {
    void* p = pool.allocate(bytes);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p);
  }
}

// The usual way in transfers: freed with an event on a stream (the CPU's default stream: complete at once).
void BM_pool_pair_with_event(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& pool = cpu_pool();
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  pool.deallocate(pool.allocate(bytes), s);
  for (auto _ : state) {
    void* p = pool.allocate(bytes);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p, s);
  }
}

void BM_malloc_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}

void BM_upstream_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  gpukit::pinned_upstream upstream(gpukit::device::kind::cpu);
  for (auto _ : state) {
    void* p = upstream.allocate(bytes);
    benchmark::DoNotOptimize(p);
    upstream.deallocate(p, bytes);
  }
}

BENCHMARK(BM_pool_pair)->Arg(4 * KiB)->Arg(MiB)->Arg(64 * MiB);
BENCHMARK(BM_pool_pair_with_event)->Arg(4 * KiB)->Arg(MiB)->Arg(64 * MiB);
BENCHMARK(BM_malloc_pair)->Arg(4 * KiB)->Arg(MiB)->Arg(64 * MiB);
BENCHMARK(BM_upstream_pair)->Arg(4 * KiB)->Arg(MiB)->Arg(64 * MiB);

void BM_gpu_pool_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& pool = gpukit::default_pinned_pool(gpukit::device::cuda(0));
  pool.deallocate(pool.allocate(bytes));
  for (auto _ : state) {
    void* p = pool.allocate(bytes);
    benchmark::DoNotOptimize(p);
    pool.deallocate(p);
  }
}

void BM_gpu_cuda_host_alloc_pair(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
      state.SkipWithError("cudaHostAlloc failed");
      break;
    }
    cudaFreeHost(p);
  }
}

class ratio_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (!gpukit_bench::run_failed(r)) ns_[r.benchmark_name()] = r.GetAdjustedRealTime();
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nPinned pool alloc/free pair (ns) against baselines of this run:\n");
    std::printf("%10s %10s %12s %10s %14s %10s %10s\n", "size", "pool", "pool+event", "malloc", "upstream alone",
                "vs malloc", "vs upstream");
    for (std::size_t bytes : {4 * KiB, MiB, 64 * MiB}) {
      const std::string arg = "/" + std::to_string(bytes);
      const double pool = get("BM_pool_pair" + arg);
      const double event = get("BM_pool_pair_with_event" + arg);
      const double malloc_ns = get("BM_malloc_pair" + arg);
      const double upstream = get("BM_upstream_pair" + arg);
      if (pool <= 0) continue;
      std::printf("%10s %10.1f %12.1f %10.1f %14.1f %9.2fx %9.1fx\n", gpukit::detail::format_bytes(bytes).c_str(), pool,
                  event, malloc_ns, upstream, malloc_ns / pool, upstream / pool);
    }
    if (!gpu_) {
      std::printf("\nGPU benchmarks skipped: no CUDA device is usable on this machine.\n");
      return;
    }
    for (std::size_t bytes : {4 * KiB, MiB, 64 * MiB}) {
      const std::string arg = "/" + std::to_string(bytes);
      const double pool = get("BM_gpu_pool_pair" + arg);
      const double raw = get("BM_gpu_cuda_host_alloc_pair" + arg);
      if (pool > 0 && raw > 0) {
        std::printf("CUDA %10s: pool pair %.1f ns, cudaHostAlloc+cudaFreeHost %.0f ns (%.0fx)\n",
                    gpukit::detail::format_bytes(bytes).c_str(), pool, raw, raw / pool);
      }
    }
  }
  bool gpu_ = false;

 private:
  double get(const std::string& name) const {
    auto it = ns_.find(name);
    return it == ns_.end() ? 0.0 : it->second;
  }
  std::map<std::string, double> ns_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ratio_reporter reporter;
  reporter.gpu_ = gpukit::device_count() > 0;
  if (reporter.gpu_) {
    benchmark::RegisterBenchmark("BM_gpu_pool_pair", BM_gpu_pool_pair)->Arg(4 * KiB)->Arg(MiB)->Arg(64 * MiB);
    benchmark::RegisterBenchmark("BM_gpu_cuda_host_alloc_pair", BM_gpu_cuda_host_alloc_pair)
        ->Arg(4 * KiB)
        ->Arg(MiB)
        ->Arg(64 * MiB);
  }
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
