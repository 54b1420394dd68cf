// gpukit_replay: replays a recorded allocation history and says whether it fits on a GPU.
//
//   gpukit_replay FILE [--context-mib N] [--gpu NAME=MIB]...
//
// FILE is RMM's CSV log (Thread,Time,Action,Pointer,Size,Stream; gpukit::rmm_log_csv writes it), gpukit's history
// JSON (gpukit::history_json), or a PyTorch memory snapshot pickle with its traces (torch.cuda.memory._dump_snapshot
// after _record_memory_history, or gpukit::dump_pytorch_snapshot; the device with the most events is replayed). A
// history recorded on the CPU device is valid input: the same allocation calls, so a job can be sized before a GPU is
// bought or rented. Prints the peak requested, the peak reserved under gpukit's defaults with the upstream calls,
// memory over time, the minimum capacity on which the whole history runs (gpukit's defaults, with expandable segments,
// and under PyTorch's rules), and a fit table for common GPUs: usable memory is the GPU's total minus what a CUDA
// context takes (--context-mib, 512 by default; it varies with GPU and driver).
#include "replay.hpp"

#include <gpukit/detail/format.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

using gpukit::detail::format_bytes;
using namespace gpukit_replay;

int usage() {
  std::fprintf(stderr,
               "usage: gpukit_replay FILE [--context-mib N] [--gpu NAME=MIB]...\n"
               "FILE: RMM's CSV log (gpukit::rmm_log_csv), gpukit's history JSON (gpukit::history_json) or a\n"
               "PyTorch memory snapshot pickle (torch.cuda.memory._dump_snapshot, gpukit::dump_pytorch_snapshot)\n");
  return 2;
}

std::string headroom(std::size_t usable, std::size_t needed) {
  if (needed > usable) return "no (short by " + format_bytes(needed - usable) + ")";
  return "yes (" + format_bytes(usable - needed) + " spare)";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  std::size_t context_mib = 512;
  std::vector<gpu_model> gpus = common_gpus();
  bool custom_gpus = false;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--context-mib") == 0 && i + 1 < argc) {
      context_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--gpu") == 0 && i + 1 < argc) {
      const std::string spec = argv[++i];
      const std::size_t eq = spec.find('=');
      if (eq == std::string::npos) return usage();
      if (!custom_gpus) gpus.clear();
      custom_gpus = true;
      gpus.push_back({spec.substr(0, eq), std::strtoull(spec.c_str() + eq + 1, nullptr, 10)});
    } else {
      return usage();
    }
  }
  try {
    const recorded_trace r = read_trace_file(argv[1]);
    const trace& t = r.ops;
    std::printf("history %s: %zu allocations, %zu operations, %d stream(s)", t.name.c_str(), t.allocations,
                t.ops.size(), t.streams);
    if (r.unknown_frees != 0) std::printf(", %zu frees of allocations made before it began (skipped)", r.unknown_frees);
    if (r.failures != 0) std::printf(", %zu failed allocations (out of memory) in the recorded run", r.failures);
    std::printf("\npeak requested: %s\n", format_bytes(t.peak_requested).c_str());
    if (t.peak_requested == 0) {
      std::printf("nothing to replay\n");
      return 0;
    }

    const gpukit::allocator_options defaults;
    const replay_result unlimited = replay_gpukit(t, defaults, max_capacity, true);
    std::printf(
        "gpukit's defaults, unlimited memory: peak reserved %s (%.3f x peak requested), %zu upstream "
        "allocations, %zu upstream frees\n\n",
        format_bytes(unlimited.peak_reserved).c_str(),
        static_cast<double>(unlimited.peak_reserved) / static_cast<double>(t.peak_requested), unlimited.upstream_allocs,
        unlimited.upstream_frees);
    std::printf("memory over time (gpukit's defaults):\n%12s %12s %12s %14s %14s\n", "operation", "requested",
                "reserved", "largest free", "fragmentation");
    for (const auto& s : unlimited.timeline) {
      const std::size_t free = s.reserved > s.requested ? s.reserved - s.requested : 0;
      std::printf("%12zu %12s %12s %14s %14.2f\n", s.op, format_bytes(s.requested).c_str(),
                  format_bytes(s.reserved).c_str(), format_bytes(s.largest_free).c_str(),
                  free == 0 ? 0.0 : 1.0 - static_cast<double>(s.largest_free) / static_cast<double>(free));
    }

    gpukit::allocator_options expandable = defaults;
    expandable.expandable_segments = true;
    const std::size_t gpukit_min =
        minimum_capacity(t, [&](std::size_t c) { return replay_gpukit(t, defaults, c).completed; });
    const std::size_t expandable_min =
        minimum_capacity(t, [&](std::size_t c) { return replay_gpukit(t, expandable, c).completed; });
    const std::size_t pytorch_min = minimum_capacity(t, [&](std::size_t c) { return runs_under_pytorch(t, c); });
    const auto ratio = [&](std::size_t c) { return static_cast<double>(c) / static_cast<double>(t.peak_requested); };
    std::printf("\nminimum device memory on which the whole history runs (binary search, to 64 KiB or 0.1 %%):\n");
    std::printf("  gpukit defaults      %12s (%.3f x peak requested)\n", format_bytes(gpukit_min).c_str(),
                ratio(gpukit_min));
    std::printf("  gpukit expandable    %12s (%.3f x)\n", format_bytes(expandable_min).c_str(), ratio(expandable_min));
    std::printf("  PyTorch's rules      %12s (%.3f x; one stream)\n", format_bytes(pytorch_min).c_str(),
                ratio(pytorch_min));

    std::printf("\nwill it fit? usable = total - %zu MiB for the CUDA context\n", context_mib);
    std::printf("  %-14s %10s | %-28s | %-28s | %-28s\n", "GPU", "usable", "gpukit defaults", "gpukit expandable",
                "PyTorch's rules");
    for (const gpu_model& g : gpus) {
      const std::size_t total = g.total_mib * MiB;
      const std::size_t usable = total > context_mib * MiB ? total - context_mib * MiB : 0;
      std::printf("  %-14s %10s | %-28s | %-28s | %-28s\n", g.name.c_str(), format_bytes(usable).c_str(),
                  headroom(usable, gpukit_min).c_str(), headroom(usable, expandable_min).c_str(),
                  headroom(usable, pytorch_min).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpukit_replay: %s\n", e.what());
    return 1;
  }
}
