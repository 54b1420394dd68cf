// device_query: what CUDA sees on this machine, how CUDA_VISIBLE_DEVICES was read, and which device gpukit would
// pick and why. Runs everywhere: without a driver or GPU it says so and selects the CPU. Exits 0 unless an
// argument is wrong.
//
// Where NVML is present it adds an nvidia-smi-like table of every device (gpukit::gpu_monitor); with two or more
// devices, the peer-access matrix with each pair's link (NVLink or the PCIe path, from NVML).
//
//   device_query                  # no CUDA context is created on any device
//   device_query --probe-memory   # also read free memory with cudaMemGetInfo where NVML is unavailable
#include <gpukit/gpukit.hpp>
#include <gpukit/device/gpu_monitor.hpp>  // opt-in: not in gpukit.hpp
#include <gpukit/device/peer_access.hpp>  // opt-in

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

namespace {

void print_versions() {
  int runtime = 0;
  int driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);  // 0 without a driver
  std::printf("gpukit %s, CUDA runtime %d.%d, ", GPUKIT_VERSION_STRING, runtime / 1000, (runtime % 1000) / 10);
  if (driver == 0) {
    std::printf("no CUDA driver\n");
  } else {
    std::printf("driver supports CUDA %d.%d\n", driver / 1000, (driver % 1000) / 10);
  }
}

void print_device(const gpukit::device_properties& p, bool probe_memory) {
  std::printf("%s: %s\n", p.device.to_string().c_str(), p.name.c_str());
  std::printf("  uuid %s, pci %s, compute capability %s, %d SMs, %d copy engines\n", p.uuid.c_str(),
              p.pci_bus_id.c_str(), p.compute_capability().c_str(), p.multiprocessor_count, p.copy_engine_count);
  std::printf("  memory %s total, %d-bit bus, peak %.0f GB/s, L2 %s\n",
              gpukit::detail::format_bytes(p.total_memory).c_str(), p.memory_bus_width_bits,
              p.peak_memory_bandwidth_gb_per_s(), gpukit::detail::format_bytes(p.l2_cache_bytes).c_str());
  const auto& nvml = gpukit::nvml::instance();
  if (auto m = nvml.memory(p)) {
    std::printf("  free %s (NVML)", gpukit::detail::format_bytes(static_cast<std::size_t>(m->free)).c_str());
    if (auto busy = nvml.utilization_percent(p)) std::printf(", %u%% utilised", *busy);
    std::printf("\n");
  } else if (probe_memory) {
    const auto info = gpukit::query_memory_info(p.device);
    std::printf("  free %s (cudaMemGetInfo)\n", gpukit::detail::format_bytes(info.free_bytes).c_str());
  } else {
    std::printf("  free memory: unknown without NVML (--probe-memory reads it, creating a context)\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool probe_memory = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--probe-memory") == 0) {
      probe_memory = true;
    } else {
      std::fprintf(stderr, "usage: %s [--probe-memory]\n", argv[0]);
      return 2;
    }
  }
  try {
    print_versions();
    const auto& nvml = gpukit::nvml::instance();
    std::printf("%s\n", nvml.status().c_str());
    gpukit::installed_gpus installed;
    if (auto gpus = nvml.installed()) installed = *gpus;
    std::printf("%s\n", gpukit::visible_devices_in_effect(installed).describe().c_str());

    const int count = gpukit::device_count();
    if (count == 0) {
      std::string why = gpukit::describe_no_gpu();
      if (!why.empty() && why[0] >= 'a' && why[0] <= 'z') why[0] = static_cast<char>(why[0] - 'a' + 'A');
      std::printf("%s.\n", why.c_str());
    } else {
      std::printf("%d CUDA device%s visible:\n", count, count == 1 ? "" : "s");
      for (gpukit::device d : gpukit::cuda_devices()) print_device(gpukit::properties(d), probe_memory);
      gpukit::gpu_monitor_options sample_once;
      sample_once.period = std::chrono::milliseconds(0);  // one sample, taken here: no background thread
      gpukit::gpu_monitor monitor(sample_once);
      if (monitor.active() && !monitor.sample_now().empty()) std::printf("%s", monitor.table().c_str());
      if (count > 1) {
        std::printf("\npeer access and links (nvidia-smi topo -m):\n%s",
                    gpukit::query_peer_matrix().to_string().c_str());
      }
    }

    const gpukit::device_selection selection = gpukit::select_device();
    std::printf("%s", selection.report().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::printf("device_query: %s\n", e.what());
    return 1;
  }
}
