// A stand-in for libnvidia-ml.so.1 with two GPUs (and a MIG instance of the first), so gpukit's NVML loader and its
// UUID / PCI-bus-id mapping are tested on machines without a driver. Only the entry points gpukit declares are
// provided; built with FAKE_NVML_MINIMAL, only the ones gpukit requires (an old driver's NVML, as gpukit sees it).
//
// FAKE_NVML_MACHINE=cudasim (read by nvmlInit_v2) swaps the two GPUs for the simulated CUDA runtime's default pair
// (found by PCI bus id 0000:18:00.0 and 0000:28:00.0), so gpu_monitor is tested on the simulator's devices.
// fake_nvml_set() changes a figure at run time (mig_mode: the GPU's current MIG mode, read by nvmlDeviceGetMigMode);
// fake_nvml_calls() counts sampling calls; fake_nvml_initialised() the nvmlInit_v2 calls not yet shut down.
#include <gpukit/device/nvml.hpp>  // for gpukit::nvml::gpu_memory: signatures must match gpukit's declarations

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {
struct fake_gpu {
  const char* uuid;
  const char* pci_bus_id;  // NVML's form: 8-digit domain
  unsigned long long total, free, used;
  int utilization;  // -1: not supported (as on MIG); memory utilisation is utilization / 7
  int temperature_c = 41;
  unsigned power_mw = 123456, power_limit_mw = 700000;
  unsigned sm_mhz = 1980, memory_mhz = 2619;
  unsigned long long clock_limits = 0x1;  // idle
  unsigned pcie_tx_kb = 2048, pcie_rx_kb = 1024;
  long long self_bytes = 3ll << 30;  // this process's memory; -1: not in the list; -2: NVML_VALUE_NOT_AVAILABLE
  unsigned other_processes = 10;     // more than gpukit's first guess of 8, so it must ask again
  unsigned nvlinks_active = 4;       // NVLinks up; 0: none (peer-to-peer over NVLink then "not supported")
  unsigned nvlinks_to_peer = 2;      // of those, the first n end at the other GPU; the rest at an NVSwitch
  int common_ancestor = 40;          // nvmlGpuTopologyLevel_t between the two GPUs (40: the same NUMA node)
  bool lost = false;                 // fallen off the bus: handle lookups no longer find it
  unsigned long long driver_reserved = 512ull << 20;  // in `used` as the v1 query reports it; apart in v2's
  bool memory_v2 = true;                              // false: the v2 query says NVML_ERROR_NOT_SUPPORTED
  int mig_mode = 0;  // current MIG mode (1: enabled); -1: nvmlDeviceGetMigMode says NVML_ERROR_NOT_SUPPORTED
};
const fake_gpu installed_gpus[2] = {
    {"GPU-11111111-2222-3333-4444-555555555555", "00000000:1A:00.0", 80ull << 30, 60ull << 30, 20ull << 30, 35},
    {"GPU-99999999-8888-7777-6666-555555555555", "00000000:3B:00.0", 40ull << 30, 1ull << 30, 39ull << 30, -1},
};
// A MIG instance of the first GPU: NVML finds it only by its MIG UUID (not counted, not found by PCI bus id, which
// names the parent GPU); CUDA reports the same 16 bytes as the device's UUID.
fake_gpu migs[1] = {
    {"MIG-abcdef01-2345-5678-9abc-def012345678", "00000000:1A:00.0", 10ull << 30, 9ull << 30, 1ull << 30, -1},
};
fake_gpu gpus[2] = {installed_gpus[0], installed_gpus[1]};
int initialised = 0;
std::atomic<long> sampling_calls{0};

// Every nvmlInit_v2 starts from the chosen machine's figures, so tests do not see each other's fake_nvml_set().
void choose_machine() {
  const char* machine = std::getenv("FAKE_NVML_MACHINE");
  if (machine == nullptr || std::strcmp(machine, "cudasim") != 0) {
    gpus[0] = installed_gpus[0];
    gpus[1] = installed_gpus[1];
    return;
  }
  gpus[0] = fake_gpu{
      "GPU-0000c0da-0000-0000-0000-000000000000", "00000000:18:00.0", 80ull << 30, 70ull << 30, 10ull << 30, 12};
  gpus[1] = fake_gpu{"GPU-0001c0da-0000-0000-0000-000000000000", "00000000:28:00.0", 80ull << 30, 80ull << 30, 0, 0};
  gpus[1].self_bytes = -1;
  for (auto& g : gpus) {
    g.nvlinks_active = 0;   // a PCIe pair: the link comes from the common ancestor
    g.driver_reserved = 0;  // round figures for the monitor's lines
  }
  gpus[0].common_ancestor = gpus[1].common_ancestor = 30;
  gpus[1].clock_limits = 0x4 | 0x40;  // power cap and hardware thermal slowdown
}

unsigned long long parse_hex(const char*& p) {
  unsigned long long v = 0;
  for (;; ++p) {
    const char c = *p;
    if (c >= '0' && c <= '9')
      v = v * 16 + static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f')
      v = v * 16 + static_cast<unsigned>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      v = v * 16 + static_cast<unsigned>(c - 'A' + 10);
    else
      return v;
  }
}
// Compares bus ids numerically, as NVML does: "0000:1a:00.0" equals "00000000:1A:00.0".
bool same_bus(const char* a, const char* b) {
  for (int part = 0; part < 4; ++part) {
    if (parse_hex(a) != parse_hex(b)) return false;
    if (*a != *b) return false;
    if (*a == '\0') return true;
    ++a;
    ++b;
  }
  return true;
}
}  // namespace

extern "C" {
int nvmlInit_v2() {
  choose_machine();
  ++initialised;  // counted, as NVML counts them: the last nvmlShutdown shuts down
  return 0;
}
int nvmlShutdown() {
  if (initialised == 0) return 1;  // NVML_ERROR_UNINITIALIZED
  --initialised;
  return 0;
}
const char* nvmlErrorString(int) { return "fake error"; }
int nvmlDeviceGetCount_v2(unsigned* count) {
  *count = 2;
  return initialised ? 0 : 1;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** device) {
  if (index >= 2) return 2;
  *device = &gpus[index];
  return 0;
}
int nvmlDeviceGetHandleByUUID(const char* uuid, void** device) {
  for (auto& g : gpus) {
    if (!g.lost && std::strcmp(g.uuid, uuid) == 0) {
      *device = &g;
      return 0;
    }
  }
  for (auto& m : migs) {
    if (std::strcmp(m.uuid, uuid) == 0) {
      *device = &m;
      return 0;
    }
  }
  return 6;  // NVML_ERROR_NOT_FOUND
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  for (auto& g : gpus) {
    if (!g.lost && same_bus(g.pci_bus_id, bus_id)) {
      *device = &g;
      return 0;
    }
  }
  return 6;
}
int nvmlDeviceGetUUID(void* device, char* text, unsigned length) {
  std::strncpy(text, static_cast<fake_gpu*>(device)->uuid, length);
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* device, gpukit::nvml::gpu_memory* memory) {
  const auto* g = static_cast<fake_gpu*>(device);
  memory->total = g->total;
  memory->free = g->free;
  memory->used = g->used;
  return 0;
}
#if !defined(FAKE_NVML_MINIMAL)
struct fake_memory_v2 {
  unsigned version;
  unsigned long long total, reserved, free, used;
};
// void* as gpukit declares it: a call through another function type is undefined (UBSan's function check).
int nvmlDeviceGetMemoryInfo_v2(void* device, void* out) {
  auto* memory = static_cast<fake_memory_v2*>(out);
  if (memory->version != 0x02000028u) return 25;  // NVML_ERROR_ARGUMENT_VERSION_MISMATCH
  const auto* g = static_cast<fake_gpu*>(device);
  if (!g->memory_v2) return 3;  // NVML_ERROR_NOT_SUPPORTED
  memory->total = g->total;
  memory->reserved = g->driver_reserved < g->used ? g->driver_reserved : g->used;
  memory->free = g->free;
  memory->used = g->used - memory->reserved;
  return 0;
}
#endif
int nvmlDeviceGetUtilizationRates(void* device, void* rates) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (g->utilization < 0) return 3;  // NVML_ERROR_NOT_SUPPORTED
  unsigned* gpu_and_memory = static_cast<unsigned*>(rates);
  gpu_and_memory[0] = static_cast<unsigned>(g->utilization);
  gpu_and_memory[1] = static_cast<unsigned>(g->utilization / 7);
  return 0;
}

// Test controls (not NVML functions).
void fake_nvml_set(unsigned index, const char* field, long long value) {
  fake_gpu& g = gpus[index % 2];
  if (std::strcmp(field, "temperature_c") == 0) g.temperature_c = static_cast<int>(value);
  if (std::strcmp(field, "utilization") == 0) g.utilization = static_cast<int>(value);
  if (std::strcmp(field, "self_bytes") == 0) g.self_bytes = value;
  if (std::strcmp(field, "other_processes") == 0) g.other_processes = static_cast<unsigned>(value);
  if (std::strcmp(field, "clock_limits") == 0) g.clock_limits = static_cast<unsigned long long>(value);
  if (std::strcmp(field, "nvlinks_active") == 0) g.nvlinks_active = static_cast<unsigned>(value);
  if (std::strcmp(field, "nvlinks_to_peer") == 0) g.nvlinks_to_peer = static_cast<unsigned>(value);
  if (std::strcmp(field, "common_ancestor") == 0) g.common_ancestor = static_cast<int>(value);
  if (std::strcmp(field, "lost") == 0) g.lost = value != 0;
  if (std::strcmp(field, "memory_v2") == 0) g.memory_v2 = value != 0;
  if (std::strcmp(field, "mig_mode") == 0) g.mig_mode = static_cast<int>(value);
}
long fake_nvml_calls() { return sampling_calls.load(); }
int fake_nvml_initialised() { return initialised; }

#if !defined(FAKE_NVML_MINIMAL)
int nvmlDeviceGetTemperature(void* device, int sensor, unsigned* celsius) {
  ++sampling_calls;
  const auto* g = static_cast<fake_gpu*>(device);
  if (sensor != 0 || g->temperature_c < 0) return 3;
  *celsius = static_cast<unsigned>(g->temperature_c);
  return 0;
}
int nvmlDeviceGetPowerUsage(void* device, unsigned* milliwatts) {
  *milliwatts = static_cast<fake_gpu*>(device)->power_mw;
  return 0;
}
int nvmlDeviceGetEnforcedPowerLimit(void* device, unsigned* milliwatts) {
  *milliwatts = static_cast<fake_gpu*>(device)->power_limit_mw;
  return 0;
}
int nvmlDeviceGetClockInfo(void* device, int type, unsigned* mhz) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (type == 1)
    *mhz = g->sm_mhz;
  else if (type == 2)
    *mhz = g->memory_mhz;
  else
    return 2;  // NVML_ERROR_INVALID_ARGUMENT
  return 0;
}
// Only the pre-12.2 name, so gpukit's fallback to it is what binds.
int nvmlDeviceGetCurrentClocksThrottleReasons(void* device, unsigned long long* reasons) {
  *reasons = static_cast<fake_gpu*>(device)->clock_limits;
  return 0;
}
int nvmlDeviceGetPcieThroughput(void* device, int counter, unsigned* kb_per_s) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (counter == 0)
    *kb_per_s = g->pcie_tx_kb;
  else if (counter == 1)
    *kb_per_s = g->pcie_rx_kb;
  else
    return 2;
  return 0;
}
struct process_info {
  unsigned pid;
  unsigned long long used_bytes;
  unsigned gpu_instance, compute_instance;
};
// The process list: _v2 writes 24-byte entries; _v3 too, except as drivers 535.43 to 535.86 wrote it (32 bytes:
// an extra field), which FAKE_NVML_DRIVER=535 imitates. gpukit must prefer _v2.
extern "C++" {
template <class Entry>
int list_processes(void* device, unsigned* count, void* list) {
  auto* infos = static_cast<Entry*>(list);
  const auto* g = static_cast<fake_gpu*>(device);
  const unsigned needed = g->other_processes + (g->self_bytes == -1 ? 0 : 1);
  if (*count < needed) {
    *count = needed;
    return 7;  // NVML_ERROR_INSUFFICIENT_SIZE
  }
  for (unsigned i = 0; i < g->other_processes; ++i) {
    infos[i] = Entry{};
    infos[i].pid = 1000000 + i;
    infos[i].used_bytes = 1ull << 20;
  }
  if (g->self_bytes != -1) {
    infos[g->other_processes] = Entry{};
    infos[g->other_processes].pid = static_cast<unsigned>(getpid());
    infos[g->other_processes].used_bytes = g->self_bytes == -2 ? ~0ull : static_cast<unsigned long long>(g->self_bytes);
  }
  *count = needed;
  return 0;
}
struct process_info_535 {
  unsigned pid;
  unsigned long long used_bytes;
  unsigned gpu_instance, compute_instance;
  unsigned long long cc_protected_bytes;
};
}  // extern "C++"
int nvmlDeviceGetComputeRunningProcesses_v2(void* device, unsigned* count, void* list) {  // gpukit's exact type
  return list_processes<process_info>(device, count, list);
}
int nvmlDeviceGetComputeRunningProcesses_v3(void* device, unsigned* count, void* list) {
  const char* driver = std::getenv("FAKE_NVML_DRIVER");
  if (driver != nullptr && std::strcmp(driver, "535") == 0)
    return list_processes<process_info_535>(device, count, list);
  return list_processes<process_info>(device, count, list);
}
int nvmlDeviceGetMigMode(void* device, unsigned* current, unsigned* pending) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (g->mig_mode < 0) return 3;  // NVML_ERROR_NOT_SUPPORTED: a GPU without MIG
  *current = *pending = static_cast<unsigned>(g->mig_mode);
  return 0;
}
int nvmlDeviceGetTopologyCommonAncestor(void* a, void* b, int* level) {
  if (a == b) return 2;
  *level = static_cast<fake_gpu*>(a)->common_ancestor;
  return 0;
}
int nvmlDeviceGetP2PStatus(void* a, void* b, int caps, int* status) {
  if (caps != 2) return 2;  // only NVML_P2P_CAPS_INDEX_NVLINK is modelled
  const bool linked = a != b && static_cast<fake_gpu*>(a)->nvlinks_active > 0;
  *status = linked ? 0 : 5;  // NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED
  return 0;
}
int nvmlDeviceGetNvLinkState(void* device, unsigned link, int* active) {
  if (link >= 18) return 2;
  *active = link < static_cast<fake_gpu*>(device)->nvlinks_active ? 1 : 0;
  return 0;
}
struct pci_info {
  char bus_id_legacy[16];
  unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void* device, unsigned link, void* out) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (link >= g->nvlinks_active) return 2;
  auto* pci = static_cast<pci_info*>(out);
  *pci = pci_info{};
  // The first nvlinks_to_peer links end at the other GPU, the rest at an NVSwitch (bus 0xF0).
  const fake_gpu& peer = (g == &gpus[0]) ? gpus[1] : gpus[0];
  const char* text = link < g->nvlinks_to_peer ? peer.pci_bus_id : "00000000:F0:00.0";
  std::strncpy(pci->bus_id, text, sizeof pci->bus_id - 1);
  const char* p = text;
  pci->domain = static_cast<unsigned>(parse_hex(p));
  ++p;
  pci->bus = static_cast<unsigned>(parse_hex(p));
  ++p;
  pci->device = static_cast<unsigned>(parse_hex(p));
  return 0;
}
#endif
}
