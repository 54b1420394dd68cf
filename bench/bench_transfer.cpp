// Transfer benchmarks.
//
// CPU (always): the staging pipeline's own CPU-side ceiling — how fast pageable data goes into the pinned ring (and
// out of it, for device-to-host) when the device copy costs nothing — with 1 and 2 host threads, against a plain
// single-threaded memcpy of the same sizes in the same run. The ratio says what staging costs on the host; on a GPU
// the transfer runs at min(this ceiling, the PCIe rate).
//
// GPU (registered only with a usable CUDA device): host-to-device and device-to-host GB/s for raw cudaMemcpyAsync
// (pinned and pageable) and gpukit (pinned: one DMA; pageable: staged), with the ratios the targets are stated in.
#include <gpukit/gpukit.hpp>
#include <gpukit/transfer/staging_impl.hpp>

#include "run_status.hpp"

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

/// The device copy step of an infinitely fast device: nothing to do, so only the host side is measured.
struct null_copier {
  void operator()(void*, const void*, std::size_t, gpukit::copy_direction, gpukit::stream_view) const {}
};

using ceiling_engine = gpukit::basic_staging_engine<null_copier>;

ceiling_engine& engine_with_threads(unsigned threads, bool streaming = false) {
  static gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  static std::map<std::pair<unsigned, bool>, std::unique_ptr<ceiling_engine>> engines;
  auto& e = engines[{threads, streaming}];
  if (!e) {
    gpukit::staging_options options;
    options.threads = threads;
    options.bytes_per_thread = options.chunk_bytes / threads;
    options.streaming_stores = streaming;
    e = std::make_unique<ceiling_engine>(pool, options);
  }
  return *e;
}

/// Touched pageable buffers, reused across benchmarks of the same size (no page faults in the timed loop).
struct buffers {
  std::vector<char> src;
  std::vector<char> dst;
};
buffers& buffers_of(std::size_t bytes) {
  static std::map<std::size_t, buffers> all;
  auto& b = all[bytes];
  if (b.src.size() != bytes) {
    b.src.assign(bytes, 1);
    b.dst.assign(bytes, 2);
  }
  return b;
}

void BM_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& b = buffers_of(bytes);
  for (auto _ : state) {
    std::memcpy(b.dst.data(), b.src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// Pageable → pinned ring → (null device copy), the default stream of the CPU: each slot is free again at once.
void BM_staging_to_ring(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& engine = engine_with_threads(static_cast<unsigned>(state.range(1)));
  auto& b = buffers_of(bytes);
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  engine.to_device(b.dst.data(), b.src.data(), bytes, s);  // warm the ring
  for (auto _ : state) {
    engine.to_device(b.dst.data(), b.src.data(), bytes, s);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// 256 MiB into the ring by host threads per chunk (range 1), with plain or streaming stores (range 2): the CPU-side
// ceiling of staged uploads, which a GPU's staged rate is compared with.
void BM_staging_to_ring_threads(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& engine = engine_with_threads(static_cast<unsigned>(state.range(1)), state.range(2) != 0);
  auto& b = buffers_of(bytes);
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  engine.to_device(b.dst.data(), b.src.data(), bytes, s);
  for (auto _ : state) {
    engine.to_device(b.dst.data(), b.src.data(), bytes, s);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// (null device copy) → pinned ring → pageable: the calling thread copies each slot out once its event completed.
void BM_staging_from_ring(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& engine = engine_with_threads(static_cast<unsigned>(state.range(1)));
  auto& b = buffers_of(bytes);
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  engine.to_host(b.dst.data(), b.src.data(), bytes, s);
  for (auto _ : state) {
    engine.to_host(b.dst.data(), b.src.data(), bytes, s);  // returns once the host copies are done
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

BENCHMARK(BM_memcpy)->Arg(64 * KiB)->Arg(MiB)->Arg(8 * MiB)->Arg(64 * MiB)->Arg(256 * MiB)->UseRealTime();
BENCHMARK(BM_staging_to_ring)->ArgsProduct({{64 * KiB, MiB, 8 * MiB, 64 * MiB, 256 * MiB}, {1, 2}})->UseRealTime();
BENCHMARK(BM_staging_to_ring_threads)->ArgsProduct({{256 * MiB}, {1, 2, 4, 8}, {0, 1}})->UseRealTime();
BENCHMARK(BM_staging_from_ring)->ArgsProduct({{MiB, 64 * MiB, 256 * MiB}, {1, 2}})->UseRealTime();

// ---- GPU ------------------------------------------------------------------------------------------------------

struct gpu_fixture {
  gpukit::stream s{gpukit::device::cuda(0)};
  std::map<std::size_t, gpukit::device_buffer<char>> device;
  std::map<std::size_t, gpukit::pinned_buffer<char>> pinned;
  gpukit::device_buffer<char>& dev(std::size_t bytes) {
    auto it = device.find(bytes);
    if (it == device.end()) it = device.emplace(bytes, gpukit::device_buffer<char>(bytes, s)).first;
    return it->second;
  }
  gpukit::pinned_buffer<char>& pin(std::size_t bytes) {
    auto it = pinned.find(bytes);
    if (it == pinned.end()) {
      it = pinned.emplace(bytes, gpukit::pinned_buffer<char>(bytes, gpukit::device::cuda(0))).first;
      std::memset(it->second.data(), 3, bytes);
    }
    return it->second;
  }
};
gpu_fixture& gpu() {
  static gpu_fixture* f = new gpu_fixture();
  return *f;
}

enum class path { raw_pinned, gpukit_pinned, raw_pageable, gpukit_pageable };

void BM_gpu(benchmark::State& state, bool to_device, path p) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto& f = gpu();
  auto& dev = f.dev(bytes);
  auto& pin = f.pin(bytes);
  auto& pageable = buffers_of(bytes).src;
  const cudaStream_t h = f.s.cuda_handle();
  auto once = [&] {
    switch (p) {
      case path::raw_pinned:
        if (to_device)
          cudaMemcpyAsync(dev.data(), pin.data(), bytes, cudaMemcpyHostToDevice, h);
        else
          cudaMemcpyAsync(pin.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, h);
        break;
      case path::raw_pageable:
        if (to_device)
          cudaMemcpyAsync(dev.data(), pageable.data(), bytes, cudaMemcpyHostToDevice, h);
        else
          cudaMemcpyAsync(pageable.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, h);
        break;
      case path::gpukit_pinned:
        if (to_device)
          gpukit::copy_async(dev, pin, f.s);
        else
          gpukit::copy_async(pin, dev, f.s);
        break;
      case path::gpukit_pageable:
        if (to_device)
          gpukit::copy_async(dev, pageable, f.s);
        else
          gpukit::copy_async(pageable, dev, f.s);
        break;
    }
  };
  once();
  f.s.synchronize();
  for (auto _ : state) {
    once();
    f.s.synchronize();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

/// Staged pageable copies of 256 MiB through an engine of its own with `threads` host copy threads per chunk (each
/// thread copies chunk_bytes / threads of a chunk): the figures the default of staging_options::threads comes from.
void BM_gpu_staged_threads(benchmark::State& state, bool to_device) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<unsigned>(state.range(1));
  const bool streaming = state.range(2) != 0;
  // Leaked, as the default engine: destroying one waits for its streams (CUDA calls) at exit.
  static auto* engines = new std::map<std::pair<unsigned, bool>, std::unique_ptr<gpukit::staging_engine>>();
  auto& engine = (*engines)[{threads, streaming}];
  if (!engine) {
    gpukit::staging_options options;
    options.threads = threads;
    options.bytes_per_thread = options.chunk_bytes / threads;
    options.streaming_stores = streaming;
    engine = std::make_unique<gpukit::staging_engine>(gpukit::default_pinned_pool(gpukit::device::cuda(0)), options);
  }
  auto& f = gpu();
  auto& dev = f.dev(bytes);
  auto& pageable = buffers_of(bytes).src;
  auto once = [&] {
    if (to_device) {
      engine->to_device(dev.data(), pageable.data(), bytes, f.s);
    } else {
      engine->to_host(pageable.data(), dev.data(), bytes, f.s);
    }
  };
  once();
  f.s.synchronize();
  for (auto _ : state) {
    once();
    f.s.synchronize();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

constexpr int staged_thread_counts[] = {1, 2, 4, 8, 12};

void register_gpu_benchmarks() {
  const char* names[] = {"raw_pinned", "gpukit_pinned", "raw_pageable", "gpukit_pageable"};
  for (bool h2d : {true, false}) {
    for (int p = 0; p < 4; ++p) {
      const std::string name = std::string("BM_gpu_") + (h2d ? "h2d_" : "d2h_") + names[p];
      auto run = [h2d, p](benchmark::State& st) { BM_gpu(st, h2d, static_cast<path>(p)); };
      benchmark::RegisterBenchmark(name.c_str(), run)->Arg(MiB)->Arg(64 * MiB)->Arg(256 * MiB)->UseRealTime();
    }
    const std::string name = std::string("BM_gpu_") + (h2d ? "h2d" : "d2h") + "_staged_threads";
    auto* b =
        benchmark::RegisterBenchmark(name.c_str(), [h2d](benchmark::State& st) { BM_gpu_staged_threads(st, h2d); });
    for (int streaming : {0, 1}) {
      for (int t : staged_thread_counts) b->Args({static_cast<std::int64_t>(256 * MiB), t, streaming});
    }
    b->UseRealTime();
  }
}

// ---- ratios ---------------------------------------------------------------------------------------------------

/// The console reporter, plus a table of ratios between runs of this process at the end.
class ratio_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      auto it = r.counters.find("bytes_per_second");
      if (!gpukit_bench::run_failed(r) && it != r.counters.end()) rate_[r.benchmark_name()] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nStaging, CPU side (GB/s into / out of the ring; memcpy: single-threaded, same run):\n");
    std::printf("%10s %9s %13s %13s %13s %13s\n", "size", "memcpy", "in 1 thread", "in 2 threads", "out 1 thread",
                "out 2 threads");
    for (std::size_t bytes : {64 * KiB, MiB, 8 * MiB, 64 * MiB, 256 * MiB}) {
      const std::string size = std::to_string(bytes);
      const double base = get("BM_memcpy/" + size);
      if (base <= 0) continue;
      std::printf("%10s %9.2f", gpukit::detail::format_bytes(bytes).c_str(), base / 1e9);
      for (const char* dir : {"to", "from"}) {
        for (int t : {1, 2}) {
          const double r = get(std::string("BM_staging_") + dir + "_ring/" + size + "/" + std::to_string(t));
          if (r > 0) {
            std::printf(" %6.2f (%3.0f%%)", r / 1e9, 100 * r / base);
          } else {
            std::printf(" %13s", "-");
          }
        }
      }
      std::printf("\n");
    }
    std::printf("\nStaging 256 MiB into the ring by host threads (GB/s; plain stores / streaming stores):\n");
    for (int t : {1, 2, 4, 8}) {
      const std::string prefix =
          "BM_staging_to_ring_threads/" + std::to_string(256 * MiB) + "/" + std::to_string(t) + "/";
      const double plain = get(prefix + "0");
      const double streaming = get(prefix + "1");
      if (plain > 0 && streaming > 0) {
        std::printf("  %d threads: %6.2f / %6.2f (%.2fx)\n", t, plain / 1e9, streaming / 1e9, streaming / plain);
      }
    }
    if (!gpu_) {
      std::printf("\nGPU benchmarks skipped: no CUDA device is usable on this machine.\n");
      return;
    }
    std::printf("\nGPU (GB/s; %% of raw pinned cudaMemcpyAsync):\n");
    for (const char* dir : {"h2d", "d2h"}) {
      for (std::size_t bytes : {MiB, 64 * MiB, 256 * MiB}) {
        const std::string suffix = "/" + std::to_string(bytes) + "/real_time";
        const double pinned = get(std::string("BM_gpu_") + dir + "_raw_pinned" + suffix);
        if (pinned <= 0) continue;
        std::printf("%s %10s raw pinned %6.2f", dir, gpukit::detail::format_bytes(bytes).c_str(), pinned / 1e9);
        for (const char* p : {"gpukit_pinned", "raw_pageable", "gpukit_pageable"}) {
          const double r = get(std::string("BM_gpu_") + dir + "_" + p + suffix);
          std::printf(" | %s %6.2f (%3.0f%%)", p, r / 1e9, 100 * r / pinned);
        }
        std::printf("\n");
      }
    }
    std::printf("\nStaged pageable 256 MiB by host copy threads per chunk (GB/s; %% of raw pinned; default %u here):\n",
                gpukit::default_staging_engine(gpukit::device::cuda(0)).options().threads);
    for (const char* dir : {"h2d", "d2h"}) {
      const double pinned =
          get(std::string("BM_gpu_") + dir + "_raw_pinned/" + std::to_string(256 * MiB) + "/real_time");
      for (int streaming : {0, 1}) {
        if (streaming != 0 && std::string(dir) == "d2h") continue;  // streaming stores only fill upload slots
        std::printf("%s%s", dir, streaming != 0 ? ", streaming stores" : "");
        for (int t : staged_thread_counts) {
          const double r = get(std::string("BM_gpu_") + dir + "_staged_threads/" + std::to_string(256 * MiB) + "/" +
                               std::to_string(t) + "/" + std::to_string(streaming));
          if (r > 0 && pinned > 0) std::printf(" | %2d: %6.2f (%3.0f%%)", t, r / 1e9, 100 * r / pinned);
        }
        std::printf("\n");
      }
    }
  }
  bool gpu_ = false;

 private:
  double get(const std::string& name) const {
    auto it = rate_.find(name);
    if (it == rate_.end()) it = rate_.find(name + "/real_time");
    return it == rate_.end() ? 0.0 : it->second;
  }
  std::map<std::string, double> rate_;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  ratio_reporter reporter;
  reporter.gpu_ = gpukit::device_count() > 0;
  if (reporter.gpu_) register_gpu_benchmarks();
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
