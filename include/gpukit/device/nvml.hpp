// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Optional NVML access, loaded at run time with dlopen("libnvidia-ml.so.1") through gpukit's own minimal
/// declarations (the toolkit ships no nvml.h, and linking NVML would make it a hard dependency). NVML reads free
/// memory and utilisation without creating a CUDA context. NVML ignores CUDA_VISIBLE_DEVICES and its indices are
/// not CUDA ordinals, so gpukit maps a CUDA device to NVML by its full UUID (as `GPU-<uuid>`, then, for a MIG
/// instance, as `MIG-<uuid>`), then by PCI bus id; never by index. A PCI bus id naming a GPU in MIG mode is no match
/// (it names the parent of the instance CUDA sees), so such an instance is unknown rather than the whole GPU.
///
/// The environment variable GPUKIT_NVML_LIBRARY overrides the library path (tests load a fake NVML this way).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/device/visible_devices.hpp>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace nvml {

/// Free, used and total memory of a GPU as NVML reports it (bytes).
struct gpu_memory {
  unsigned long long total = 0;  ///< installed memory
  unsigned long long free = 0;   ///< memory not allocated by any process
  unsigned long long used = 0;   ///< memory allocated by processes, as nvidia-smi shows it (drivers before 510,
                                 ///< without NVML's v2 query, count the memory the driver reserves in as well)
};

/// Why clocks are held below their maximum: a bit mask of NVML's clocks event (formerly "throttle") reasons.
namespace clock_limit {
constexpr std::uint64_t idle = 0x1;                   ///< nothing runs: clocks idle by design
constexpr std::uint64_t applications_clocks = 0x2;    ///< capped by the applications clocks setting
constexpr std::uint64_t software_power_cap = 0x4;     ///< the power limit holds clocks down
constexpr std::uint64_t hardware_slowdown = 0x8;      ///< hardware slowdown (temperature or power brake)
constexpr std::uint64_t sync_boost = 0x10;            ///< held to match other GPUs in a sync-boost group
constexpr std::uint64_t software_thermal = 0x20;      ///< the driver slows down for temperature
constexpr std::uint64_t hardware_thermal = 0x40;      ///< the hardware slows down for temperature
constexpr std::uint64_t hardware_power_brake = 0x80;  ///< an external power brake signal
constexpr std::uint64_t display_clocks = 0x100;       ///< held by the display clock setting
}  // namespace clock_limit

/// The reasons in `mask` in words, comma-separated ("none" for 0): what nvidia-smi -q prints as "Clocks Event Reasons".
GPUKIT_INLINE std::string describe_clock_limits(std::uint64_t mask);

/// One reading of a GPU's state, as nvidia-smi shows it. Every figure is optional: NVML leaves out what the device,
/// driver or permissions do not support (utilisation on MIG, power on some boards, per-process memory in a container
/// whose PID namespace hides the host's PIDs).
struct gpu_sample {
  std::optional<gpu_memory> memory;                  ///< all processes
  std::optional<unsigned long long> process_memory;  ///< this process (NVML's per-process figure, context included)
  std::optional<unsigned>
      gpu_utilization_percent;  ///< time a kernel ran, over NVML's last period (nvidia-smi GPU-Util)
  std::optional<unsigned> memory_utilization_percent;  ///< time device memory was read or written
  std::optional<unsigned> temperature_c;               ///< GPU core temperature
  std::optional<double> power_w;                       ///< power drawn now
  std::optional<double> power_limit_w;                 ///< enforced power limit
  std::optional<unsigned> sm_clock_mhz;                ///< current SM clock
  std::optional<unsigned> memory_clock_mhz;            ///< current memory clock
  std::optional<std::uint64_t> clock_limits;           ///< a clock_limit:: mask
  std::optional<unsigned> pcie_tx_kib_per_s;           ///< PCIe bytes sent by the GPU (KiB/s over NVML's 20 ms window)
  std::optional<unsigned> pcie_rx_kib_per_s;           ///< PCIe bytes received by the GPU
};

/// NVML, when it can be loaded and initialised. Obtain the process-wide instance with nvml::instance(). Every query
/// returns nullopt when NVML is unavailable or does not support it for that device (e.g. utilisation on MIG).
class library {
 public:
  /// Loads the library at `path` and initialises it. Never throws: failure is reported by available()/status().
  explicit library(const char* path);

  library(const library&) = delete;
  library& operator=(const library&) = delete;

  ~library();

  /// NVML is loaded and initialised.
  bool available() const noexcept;
  /// Where NVML came from, or why it is unavailable, in one sentence.
  const std::string& status() const noexcept;

  /// Free/used/total memory of the CUDA device described by `p` (mapped by UUID, then PCI bus id).
  std::optional<gpu_memory> memory(const device_properties& p) const;

  /// Percent of time over the last sample period during which a kernel ran on the device.
  std::optional<unsigned> utilization_percent(const device_properties& p) const;

  /// NVML is available and finds the CUDA device described by `p` (by UUID, a MIG UUID, then PCI bus id).
  bool knows(const device_properties& p) const;

  /// Everything NVML reports about the CUDA device described by `p`, or nullopt when NVML is unavailable or does not
  /// know the device. Takes about 40 ms when the PCIe counters are read (NVML samples each over 20 ms): call it from
  /// a monitoring thread (gpu_monitor), not from a hot path.
  std::optional<gpu_sample> sample(const device_properties& p, bool read_pcie = true) const;

  /// How GPU `a` reaches GPU `b`, in nvidia-smi topo -m's words: "NV<n>" (n NVLinks; through an NVSwitch, n is
  /// a's active links), else the closest common PCIe ancestor: "PIX" (one PCIe switch), "PXB" (several switches),
  /// "PHB" (a host bridge), "NODE" (the same NUMA node), "SYS" (across NUMA nodes), "X" for the same GPU. nullopt
  /// when NVML does not know either GPU or cannot tell.
  std::optional<std::string> link(const device_properties& a, const device_properties& b) const;

  /// Every installed GPU (NVML ignores CUDA_VISIBLE_DEVICES): their count and UUIDs.
  std::optional<installed_gpus> installed() const;

 private:
  template <class F>
  bool bind(F& function, const char* name) {
    void* symbol = dlsym(handle_, name);
    static_assert(sizeof(F) == sizeof(symbol), "function and object pointers differ in size");
    std::memcpy(&function, &symbol, sizeof symbol);  // POSIX guarantees this round trip; a cast would be -Wpedantic
    if (function == nullptr && missing_.empty()) missing_ = name;
    return function != nullptr;
  }

  template <class F>
  bool bind_optional(F& function, const char* name) {
    void* symbol = dlsym(handle_, name);
    std::memcpy(&function, &symbol, sizeof symbol);
    return function != nullptr;
  }

  // NVLinks from `from` that reach `to`: links whose remote end is `to`'s PCI address; where NVML reports NVLink
  // peer-to-peer but no link ends at `to` (an NVSwitch in between), every active link of `from` counts.
  int nvlinks(void* from, void* to, const device_properties& to_properties) const;

  // This process's entry in the device's compute-process list. NVML reports host PIDs: in a container with its own
  // PID namespace the process is not found and the figure stays unknown rather than wrong.
  std::optional<unsigned long long> process_memory(void* dev) const;

  std::string describe(int result) const;

  void* find(const device_properties& p) const;
  /// nvmlDeviceGetMemoryInfo_v2 where the driver has it (used without the memory the driver reserves, as nvidia-smi
  /// shows it), else the v1 query (used with it). Returns NVML's result.
  int read_memory(void* dev, gpu_memory& m) const;

  void* handle_ = nullptr;
  bool initialised_ = false;
  std::string status_;
  std::string missing_;
  // Minimal declarations; nvmlDevice_t is an opaque pointer, nvmlReturn_t an int-sized enum (0: success).
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  const char* (*error_string_)(int) = nullptr;
  int (*count_)(unsigned*) = nullptr;
  int (*by_index_)(unsigned, void**) = nullptr;
  int (*by_uuid_)(const char*, void**) = nullptr;
  int (*by_pci_)(const char*, void**) = nullptr;
  int (*uuid_)(void*, char*, unsigned) = nullptr;
  int (*memory_)(void*, gpu_memory*) = nullptr;                 // nvmlMemory_t (v1): total, free, used
  int (*memory_v2_)(void*, void*) = nullptr;                    // nvmlMemory_v2_t: version, total, reserved, free, used
  int (*utilization_)(void*, void*) = nullptr;                  // nvmlUtilization_t: gpu, memory
  int (*temperature_)(void*, int, unsigned*) = nullptr;         // sensor 0: the GPU, degrees C
  int (*power_)(void*, unsigned*) = nullptr;                    // milliwatts
  int (*power_limit_)(void*, unsigned*) = nullptr;              // milliwatts
  int (*clock_)(void*, int, unsigned*) = nullptr;               // nvmlClockType_t (1: SM, 2: memory), MHz
  int (*clock_limits_)(void*, unsigned long long*) = nullptr;   // clock_limit:: mask
  int (*pcie_)(void*, int, unsigned*) = nullptr;                // counter 0: TX, 1: RX; KB/s
  int (*processes_)(void*, unsigned*, void*) = nullptr;         // count in/out, nvmlProcessInfo_t array
  int (*common_ancestor_)(void*, void*, int*) = nullptr;        // nvmlGpuTopologyLevel_t
  int (*p2p_status_)(void*, void*, int, int*) = nullptr;        // caps index, nvmlGpuP2PStatus_t (0: OK)
  int (*nvlink_state_)(void*, unsigned, int*) = nullptr;        // link, nvmlEnableState_t
  int (*nvlink_remote_pci_)(void*, unsigned, void*) = nullptr;  // link, nvmlPciInfo_t
  int (*mig_mode_)(void*, unsigned*, unsigned*) = nullptr;      // current, pending (1: NVML_DEVICE_MIG_ENABLE)
};

/// The process-wide NVML, loaded on first use (never at static-initialisation time) from GPUKIT_NVML_LIBRARY or
/// "libnvidia-ml.so.1". Never unloaded, so queries stay valid until the process ends, from any thread.
GPUKIT_EXPORT GPUKIT_INLINE const library& instance();

}  // namespace nvml
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace nvml {

GPUKIT_INLINE std::string describe_clock_limits(std::uint64_t mask) {
  static constexpr struct {
    std::uint64_t bit;
    const char* name;
  } names[] = {{clock_limit::idle, "idle"},
               {clock_limit::applications_clocks, "applications clocks"},
               {clock_limit::software_power_cap, "power cap"},
               {clock_limit::hardware_slowdown, "hw slowdown"},
               {clock_limit::sync_boost, "sync boost"},
               {clock_limit::software_thermal, "sw thermal"},
               {clock_limit::hardware_thermal, "hw thermal"},
               {clock_limit::hardware_power_brake, "power brake"},
               {clock_limit::display_clocks, "display clocks"}};
  std::string text;
  for (const auto& n : names) {
    if ((mask & n.bit) == 0) continue;
    if (!text.empty()) text += ", ";
    text += n.name;
    mask &= ~n.bit;
  }
  if (mask != 0) text += (text.empty() ? "" : ", ") + std::string("other");
  return text.empty() ? "none" : text;
}

GPUKIT_INLINE library::library(const char* path) {
  handle_ = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    const char* why = dlerror();
    status_ = std::string("NVML not loaded: ") + (why ? why : path);
    return;
  }
  bool complete = bind(init_, "nvmlInit_v2") && bind(shutdown_, "nvmlShutdown") &&
                  bind(error_string_, "nvmlErrorString") && bind(count_, "nvmlDeviceGetCount_v2") &&
                  bind(by_index_, "nvmlDeviceGetHandleByIndex_v2") && bind(by_uuid_, "nvmlDeviceGetHandleByUUID") &&
                  bind(by_pci_, "nvmlDeviceGetHandleByPciBusId_v2") && bind(uuid_, "nvmlDeviceGetUUID") &&
                  bind(memory_, "nvmlDeviceGetMemoryInfo") && bind(utilization_, "nvmlDeviceGetUtilizationRates");
  if (!complete) {
    status_ = std::string("NVML at ") + path + " lacks " + missing_;
    return;
  }
  // Optional: older drivers lack some, and each only fills one field of a sample.
  bind_optional(temperature_, "nvmlDeviceGetTemperature");
  bind_optional(power_, "nvmlDeviceGetPowerUsage");
  bind_optional(power_limit_, "nvmlDeviceGetEnforcedPowerLimit");
  bind_optional(clock_, "nvmlDeviceGetClockInfo");
  if (!bind_optional(clock_limits_, "nvmlDeviceGetCurrentClocksEventReasons"))
    bind_optional(clock_limits_, "nvmlDeviceGetCurrentClocksThrottleReasons");  // its name before CUDA 12.2
  bind_optional(pcie_, "nvmlDeviceGetPcieThroughput");
  bind_optional(common_ancestor_, "nvmlDeviceGetTopologyCommonAncestor");
  bind_optional(p2p_status_, "nvmlDeviceGetP2PStatus");
  bind_optional(nvlink_state_, "nvmlDeviceGetNvLinkState");
  bind_optional(nvlink_remote_pci_, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  bind_optional(mig_mode_, "nvmlDeviceGetMigMode");  // without it, a PCI bus id match is taken as before
  // _v2 first: its entry is 24 bytes on every driver, while the _v3 of drivers 535.43 to 535.86 writes 32-byte
  // entries (an extra field). Entries are read at 24 bytes into room for 32 (process_memory), so neither overflows.
  bind_optional(memory_v2_, "nvmlDeviceGetMemoryInfo_v2");
  if (!bind_optional(processes_, "nvmlDeviceGetComputeRunningProcesses_v2"))
    bind_optional(processes_, "nvmlDeviceGetComputeRunningProcesses_v3");
  const int result = init_();
  if (result != 0) {
    status_ = std::string("nvmlInit_v2 failed: ") + describe(result);
    return;
  }
  initialised_ = true;
  status_ = std::string("NVML loaded from ") + path;
}

GPUKIT_INLINE library::~library() {
  if (initialised_) (void)shutdown_();
  if (handle_ != nullptr) dlclose(handle_);
}

GPUKIT_INLINE bool library::available() const noexcept { return initialised_; }

GPUKIT_INLINE const std::string& library::status() const noexcept { return status_; }

GPUKIT_INLINE int library::read_memory(void* dev, gpu_memory& m) const {
  if (memory_v2_ != nullptr) {
    struct {
      unsigned version;
      unsigned long long total, reserved, free, used;
    } v2{};
    static_assert(sizeof v2 == 40, "nvmlMemory_v2_t");
    v2.version = sizeof v2 | (2u << 24);  // nvmlMemory_v2: 0x02000028
    if (memory_v2_(dev, &v2) == 0) {
      m = gpu_memory{v2.total, v2.free, v2.used};
      return 0;
    }
  }
  return memory_(dev, &m);
}

GPUKIT_INLINE std::optional<gpu_memory> library::memory(const device_properties& p) const {
  void* dev = find(p);
  if (dev == nullptr) return std::nullopt;
  gpu_memory m;
  if (read_memory(dev, m) != 0) return std::nullopt;
  return m;
}

GPUKIT_INLINE std::optional<unsigned> library::utilization_percent(const device_properties& p) const {
  void* dev = find(p);
  if (dev == nullptr) return std::nullopt;
  struct {
    unsigned gpu;
    unsigned memory;
  } rates{0, 0};
  if (utilization_(dev, &rates) != 0) return std::nullopt;
  return rates.gpu;
}

GPUKIT_INLINE bool library::knows(const device_properties& p) const { return find(p) != nullptr; }

GPUKIT_INLINE std::optional<gpu_sample> library::sample(const device_properties& p, bool read_pcie) const {
  void* dev = find(p);
  if (dev == nullptr) return std::nullopt;
  gpu_sample s;
  gpu_memory m;
  if (read_memory(dev, m) == 0) s.memory = m;
  struct {
    unsigned gpu;
    unsigned memory;
  } rates{0, 0};
  if (utilization_(dev, &rates) == 0) {
    s.gpu_utilization_percent = rates.gpu;
    s.memory_utilization_percent = rates.memory;
  }
  unsigned value = 0;
  constexpr int gpu_sensor = 0, sm_clock = 1, memory_clock = 2, pcie_tx = 0, pcie_rx = 1;
  if (temperature_ && temperature_(dev, gpu_sensor, &value) == 0) s.temperature_c = value;
  if (power_ && power_(dev, &value) == 0) s.power_w = value / 1000.0;  // milliwatts
  if (power_limit_ && power_limit_(dev, &value) == 0) s.power_limit_w = value / 1000.0;
  if (clock_ && clock_(dev, sm_clock, &value) == 0) s.sm_clock_mhz = value;
  if (clock_ && clock_(dev, memory_clock, &value) == 0) s.memory_clock_mhz = value;
  unsigned long long reasons = 0;
  if (clock_limits_ && clock_limits_(dev, &reasons) == 0) s.clock_limits = reasons;
  if (read_pcie && pcie_ && pcie_(dev, pcie_tx, &value) == 0) s.pcie_tx_kib_per_s = value;
  if (read_pcie && pcie_ && pcie_(dev, pcie_rx, &value) == 0) s.pcie_rx_kib_per_s = value;
  s.process_memory = process_memory(dev);
  return s;
}

GPUKIT_INLINE std::optional<std::string> library::link(const device_properties& a, const device_properties& b) const {
  void* first = find(a);
  void* second = find(b);
  if (first == nullptr || second == nullptr) return std::nullopt;
  if (first == second) return std::string("X");
  if (const int links = nvlinks(first, second, b); links > 0) return "NV" + std::to_string(links);
  if (!common_ancestor_) return std::nullopt;
  int level = 0;
  if (common_ancestor_(first, second, &level) != 0) return std::nullopt;
  // nvmlGpuTopologyLevel_t: 0 the same board, 10 one switch, 20 several, 30 a host bridge, 40 a node, 50 the system
  switch (level) {
    case 0:
      return std::string("PIX");  // a multi-GPU board: its GPUs share an on-board PCIe switch
    case 10:
      return std::string("PIX");
    case 20:
      return std::string("PXB");
    case 30:
      return std::string("PHB");
    case 40:
      return std::string("NODE");
    case 50:
      return std::string("SYS");
    default:
      return std::nullopt;
  }
}

GPUKIT_INLINE std::optional<installed_gpus> library::installed() const {
  if (!initialised_) return std::nullopt;
  unsigned count = 0;
  if (count_(&count) != 0) return std::nullopt;
  installed_gpus gpus;
  gpus.count = static_cast<int>(count);
  for (unsigned i = 0; i < count; ++i) {
    void* dev = nullptr;
    char text[96] = {};
    if (by_index_(i, &dev) != 0 || uuid_(dev, text, sizeof text) != 0) {
      gpus.uuids.clear();  // partial UUID lists would make prefix checks wrong
      break;
    }
    gpus.uuids.emplace_back(text);
  }
  return gpus;
}

GPUKIT_INLINE int library::nvlinks(void* from, void* to, const device_properties& to_properties) const {
  if (!p2p_status_ || !nvlink_state_) return 0;
  constexpr int nvlink_caps = 2;  // NVML_P2P_CAPS_INDEX_NVLINK
  int status = -1;
  if (p2p_status_(from, to, nvlink_caps, &status) != 0 || status != 0) return 0;
  struct pci_info {  // nvmlPciInfo_t
    char bus_id_legacy[16];
    unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
    char bus_id[32];
  };
  constexpr unsigned max_links = 18;  // NVML_NVLINK_MAX_LINKS
  int active = 0, direct = 0;
  for (unsigned link = 0; link < max_links; ++link) {
    int enabled = 0;
    if (nvlink_state_(from, link, &enabled) != 0 || enabled == 0) continue;
    ++active;
    pci_info remote{};
    if (nvlink_remote_pci_ && nvlink_remote_pci_(from, link, &remote) == 0 &&
        static_cast<int>(remote.domain) == to_properties.pci_domain &&
        static_cast<int>(remote.bus) == to_properties.pci_bus &&
        static_cast<int>(remote.device) == to_properties.pci_device) {
      ++direct;
    }
  }
  return direct > 0 ? direct : active;
}

GPUKIT_INLINE std::optional<unsigned long long> library::process_memory(void* dev) const {
  if (!processes_) return std::nullopt;
  struct process_info {  // nvmlProcessInfo_v2_t: what _v2 (and a correct _v3) writes per process
    unsigned pid;
    unsigned long long used_bytes;
    unsigned gpu_instance;
    unsigned compute_instance;
  };
  struct room {  // one entry's room: 32 bytes, as much as any driver's _v3 writes
    process_info info;
    unsigned long long spare;
  };
  static_assert(sizeof(process_info) == 24 && sizeof(room) == 32, "nvmlProcessInfo_t layouts");
  std::vector<room> storage(8);
  std::vector<process_info> list;
  for (int attempt = 0; attempt < 4; ++attempt) {
    // As many entries as there are 32-byte rooms: a driver writing 32-byte entries stays inside the storage, and
    // the usual 24-byte entries are read back packed.
    auto count = static_cast<unsigned>(storage.size());
    const int result = processes_(dev, &count, storage.data());
    constexpr int insufficient_size = 7;  // NVML_ERROR_INSUFFICIENT_SIZE: count now holds the number needed
    if (result == insufficient_size) {
      storage.resize(static_cast<std::size_t>(count) + 8);  // processes may start between the two calls
      continue;
    }
    if (result != 0) return std::nullopt;
    const std::size_t entries = std::min<std::size_t>(count, storage.size());
    list.resize(entries);
    std::memcpy(list.data(), storage.data(), entries * sizeof(process_info));  // 24-byte entries, packed
    const auto self = static_cast<unsigned>(getpid());
    constexpr unsigned long long not_available = ~0ull;  // NVML_VALUE_NOT_AVAILABLE
    for (const process_info& p : list) {
      if (p.pid == self) {
        if (p.used_bytes == not_available) return std::nullopt;
        return p.used_bytes;
      }
    }
    return std::nullopt;
  }
  return std::nullopt;
}

GPUKIT_INLINE std::string library::describe(int result) const {
  const char* text = error_string_ ? error_string_(result) : nullptr;
  return (text ? std::string(text) : std::string("error")) + " (" + std::to_string(result) + ")";
}

GPUKIT_INLINE void* library::find(const device_properties& p) const {
  if (!initialised_) return nullptr;
  void* dev = nullptr;
  if (!p.uuid.empty() && by_uuid_(p.uuid.c_str(), &dev) == 0) return dev;
  // A MIG instance: CUDA reports its MIG UUID's bytes (properties() prints them as GPU-...), NVML knows it as
  // MIG-<uuid>. Tried before the PCI bus id, which names the parent GPU (its memory is not the instance's).
  constexpr std::size_t prefix = 4;  // "GPU-" / "MIG-"
  if (p.uuid.size() > prefix && p.uuid.compare(0, prefix, "GPU-") == 0) {
    const std::string mig = "MIG-" + p.uuid.substr(prefix);
    if (by_uuid_(mig.c_str(), &dev) == 0) return dev;
  }
  // NVML writes an 8-digit domain, CUDA a 4-digit one; NVML parses the text numerically, so both forms work.
  if (p.pci_bus_id.empty() || by_pci_(p.pci_bus_id.c_str(), &dev) != 0) return nullptr;
  // CUDA sees a GPU with MIG enabled only as its MIG instances: this device is one NVML did not find by its MIG
  // UUID, and the whole GPU's memory and utilisation are not its own.
  constexpr unsigned mig_enabled = 1;  // NVML_DEVICE_MIG_ENABLE
  unsigned current = 0, pending = 0;
  if (mig_mode_ && mig_mode_(dev, &current, &pending) == 0 && current == mig_enabled) return nullptr;
  return dev;
}

GPUKIT_INLINE const library& instance() {
  // Never destroyed: a gpu_monitor still sampling at exit (one owned by a static, or never deleted) would call into
  // a library its destruction had unloaded. The driver cleans up after the process as it does after a crash.
  static const library* const nvml_library = new library([] {
    const char* override_path = std::getenv("GPUKIT_NVML_LIBRARY");
    return (override_path != nullptr && *override_path != '\0') ? override_path : "libnvidia-ml.so.1";
  }());
  return *nvml_library;
}

}  // namespace nvml
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
