// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Optional NVML access, loaded at run time with dlopen("libnvidia-ml.so.1") through gpukit's own minimal
/// declarations (the toolkit ships no nvml.h, and linking NVML would make it a hard dependency). NVML reads free
/// memory and utilisation without creating a CUDA context. NVML ignores CUDA_VISIBLE_DEVICES and its indices are
/// not CUDA ordinals, so gpukit maps a CUDA device to NVML by its full UUID (as GPU-<uuid>, then, for a MIG instance,
/// as MIG-<uuid>), then by PCI bus id; never by index.
///
/// The environment variable GPUKIT_NVML_LIBRARY overrides the library path (tests load a fake NVML this way).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/device/visible_devices.hpp>

#include <dlfcn.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

GPUKIT_BEGIN_NAMESPACE
namespace nvml {

/// Free, used and total memory of a GPU as NVML reports it (bytes).
struct gpu_memory {
  unsigned long long total = 0;
  unsigned long long free = 0;
  unsigned long long used = 0;
};

/// NVML, when it can be loaded and initialised. Obtain the process-wide instance with nvml::instance(). Every query
/// returns nullopt when NVML is unavailable or does not support it for that device (e.g. utilisation on MIG).
class library {
 public:
  /// Loads the library at `path` and initialises it. Never throws: failure is reported by available()/status().
  explicit library(const char* path) {
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
                    bind(memory_, "nvmlDeviceGetMemoryInfo") &&
                    bind(utilization_, "nvmlDeviceGetUtilizationRates");
    if (!complete) {
      status_ = std::string("NVML at ") + path + " lacks " + missing_;
      return;
    }
    const int result = init_();
    if (result != 0) {
      status_ = std::string("nvmlInit_v2 failed: ") + describe(result);
      return;
    }
    initialised_ = true;
    status_ = std::string("NVML loaded from ") + path;
  }

  library(const library&) = delete;
  library& operator=(const library&) = delete;

  ~library() {
    if (initialised_) (void)shutdown_();
    if (handle_ != nullptr) dlclose(handle_);
  }

  /// NVML is loaded and initialised.
  bool available() const noexcept { return initialised_; }
  /// Where NVML came from, or why it is unavailable, in one sentence.
  const std::string& status() const noexcept { return status_; }

  /// Free/used/total memory of the CUDA device described by `p` (mapped by UUID, then PCI bus id).
  std::optional<gpu_memory> memory(const device_properties& p) const {
    void* dev = find(p);
    if (dev == nullptr) return std::nullopt;
    gpu_memory m;
    if (memory_(dev, &m) != 0) return std::nullopt;
    return m;
  }

  /// Percent of time over the last sample period during which a kernel ran on the device.
  std::optional<unsigned> utilization_percent(const device_properties& p) const {
    void* dev = find(p);
    if (dev == nullptr) return std::nullopt;
    struct {
      unsigned gpu;
      unsigned memory;
    } rates{0, 0};
    if (utilization_(dev, &rates) != 0) return std::nullopt;
    return rates.gpu;
  }

  /// Every installed GPU (NVML ignores CUDA_VISIBLE_DEVICES): their count and UUIDs.
  std::optional<installed_gpus> installed() const {
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

 private:
  template <class F>
  bool bind(F& function, const char* name) {
    void* symbol = dlsym(handle_, name);
    static_assert(sizeof(F) == sizeof(symbol), "function and object pointers differ in size");
    std::memcpy(&function, &symbol, sizeof symbol);  // POSIX guarantees this round trip; a cast would be -Wpedantic
    if (function == nullptr && missing_.empty()) missing_ = name;
    return function != nullptr;
  }

  std::string describe(int result) const {
    const char* text = error_string_ ? error_string_(result) : nullptr;
    return (text ? std::string(text) : std::string("error")) + " (" + std::to_string(result) + ")";
  }

  void* find(const device_properties& p) const {
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
    if (!p.pci_bus_id.empty() && by_pci_(p.pci_bus_id.c_str(), &dev) == 0) return dev;
    return nullptr;
  }

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
  int (*memory_)(void*, gpu_memory*) = nullptr;  // nvmlMemory_t (v1): total, free, used
  int (*utilization_)(void*, void*) = nullptr;   // nvmlUtilization_t: gpu, memory
};

/// The process-wide NVML, loaded on first use (never at static-initialisation time) from GPUKIT_NVML_LIBRARY or
/// "libnvidia-ml.so.1".
GPUKIT_EXPORT inline const library& instance() {
  static const library nvml_library([] {
    const char* override_path = std::getenv("GPUKIT_NVML_LIBRARY");
    return (override_path != nullptr && *override_path != '\0') ? override_path : "libnvidia-ml.so.1";
  }());
  return nvml_library;
}

}  // namespace nvml
GPUKIT_END_NAMESPACE
