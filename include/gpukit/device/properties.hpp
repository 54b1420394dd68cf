// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a CUDA device is: name, UUID, PCI location, memory, compute capability, copy engines and the other figures
/// users look up. Read with cudaGetDeviceProperties and cudaDeviceGetAttribute (CUDA 13 removed several
/// cudaDeviceProp fields), neither of which creates a context. Free memory is read only on request
/// (memory_info), because cudaMemGetInfo creates the device's primary context (~300 MB of device memory).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// Static properties of one CUDA device. Obtained with properties(device); constant for the life of the process.
struct device_properties {
  gpukit::device device;                    ///< the device described
  std::string name;                         ///< e.g. "NVIDIA H100 80GB HBM3"
  std::string uuid;                         ///< "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
  std::string pci_bus_id;                   ///< "dddd:bb:dd.0" (domain:bus:device.function, hex)
  int pci_domain = 0;                       ///< PCI domain (pciDomainID)
  int pci_bus = 0;                          ///< PCI bus (pciBusID)
  int pci_device = 0;                       ///< PCI device (pciDeviceID)
  std::size_t total_memory = 0;             ///< bytes of global memory
  int compute_capability_major = 0;         ///< 9 for sm_90
  int compute_capability_minor = 0;         ///< 0 for sm_90
  int multiprocessor_count = 0;             ///< number of SMs
  int copy_engine_count = 0;                ///< asyncEngineCount: concurrent copy directions (H100: 3)
  int clock_rate_khz = 0;                   ///< peak SM clock
  int memory_clock_rate_khz = 0;            ///< peak memory clock
  int memory_bus_width_bits = 0;            ///< global memory bus width
  std::size_t l2_cache_bytes = 0;           ///< L2 cache size
  int warp_size = 0;                        ///< threads per warp (32)
  int max_threads_per_block = 0;            ///< largest block a kernel may be launched with
  int max_threads_per_multiprocessor = 0;   ///< resident threads per SM
  std::size_t shared_memory_per_block = 0;  ///< bytes of shared memory a block gets without opting in
  std::size_t shared_memory_per_multiprocessor = 0;  ///< bytes of shared memory per SM
  int compute_mode = 0;                    ///< a cudaComputeMode value (0: default, 2: prohibited, 3: exclusive)
  bool integrated = false;                 ///< shares memory with the host (Jetson, Grace-integrated parts)
  bool ecc_enabled = false;                ///< ECC is on for device memory
  bool unified_addressing = false;         ///< host and device share one virtual address space (UVA)
  bool managed_memory = false;             ///< cudaMallocManaged is supported
  bool concurrent_managed_access = false;  ///< the GPU and CPU may access managed memory concurrently
  bool pageable_memory_access = false;     ///< the GPU can read pageable host memory directly (HMM/ATS)
  bool can_map_host_memory = false;        ///< pinned host memory can be mapped (cudaHostGetDevicePointer)
  bool memory_pools_supported = false;     ///< cudaMallocAsync is available
  bool multi_gpu_board = false;            ///< the device is on a multi-GPU board

  /// "9.0"
  std::string compute_capability() const;
  /// Theoretical peak memory bandwidth in GB/s: 2 (double data rate) x memory clock x bus width.
  double peak_memory_bandwidth_gb_per_s() const;
};

namespace detail {

/// "GPU-" followed by the 16 bytes as 8-4-4-4-12 lowercase hex digits.
GPUKIT_INLINE std::string format_gpu_uuid(const unsigned char (&bytes)[16]);

GPUKIT_INLINE int device_attribute(cudaDeviceAttr attribute, int ordinal, const char* attribute_name);

GPUKIT_INLINE device_properties query_properties(device d);

/// The process-wide cache of properties(), indexed by ordinal (exported: one per process; never destroyed).
struct properties_cache;
GPUKIT_EXPORT GPUKIT_INLINE properties_cache& device_properties_cache();

}  // namespace detail

/// The properties of a CUDA device, read once and cached for the life of the process (thread-safe).
/// Throws invalid_argument_error for the CPU or an ordinal that is not visible, no_device_error without a usable
/// driver (as current_device()).
GPUKIT_INLINE const device_properties& properties(device d);

/// The stream priorities a device supports. Lower numbers run first, so `greatest` <= `least` (e.g. -5 and 0).
struct priority_range {
  int least = 0;     ///< numerically greatest value: the lowest priority (also the default, 0)
  int greatest = 0;  ///< numerically lowest value: the highest priority
  /// `priority` clamped into [greatest, least].
  constexpr int clamp(int priority) const noexcept {
    return priority < greatest ? greatest : (priority > least ? least : priority);
  }
};

namespace detail {

/// The process-wide cache of stream_priority_range(), indexed by ordinal (exported: one per process; never
/// destroyed).
struct priority_range_cache;
GPUKIT_EXPORT GPUKIT_INLINE priority_range_cache& stream_priority_ranges();

}  // namespace detail

/// The stream priority range of device `d`, read once per device and cached (thread-safe). For the CPU, {0, 0}.
/// cudaDeviceGetStreamPriorityRange answers for the *current* device and creates its context, so this makes `d`
/// current for the call (device_guard): ask only about a device you are about to create streams on. properties()
/// and select_device() never ask. Throws invalid_argument_error for an ordinal that is not visible, no_device_error
/// without a usable driver (as current_device()).
GPUKIT_INLINE priority_range stream_priority_range(device d);

/// Free and total device memory in bytes, as cudaMemGetInfo reports it.
struct memory_info {
  std::size_t free_bytes = 0;   ///< bytes free now, on the device as a whole (other processes included)
  std::size_t total_bytes = 0;  ///< bytes of device memory, as cudaMemGetInfo counts it
};

/// Reads free and total memory of a device. Note: this creates the device's primary context (hundreds of MB) if it
/// does not exist yet, so call it only for devices you intend to use. The current device is restored afterwards.
GPUKIT_INLINE memory_info query_memory_info(device d);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE std::string device_properties::compute_capability() const {
  return std::to_string(compute_capability_major) + "." + std::to_string(compute_capability_minor);
}

GPUKIT_INLINE double device_properties::peak_memory_bandwidth_gb_per_s() const {
  return 2.0 * memory_clock_rate_khz * 1e3 * (memory_bus_width_bits / 8.0) / 1e9;
}
namespace detail {

/// The process-wide cache of stream_priority_range(), indexed by ordinal.
struct priority_range_cache {
  std::mutex mutex;
  std::vector<std::optional<priority_range>> entries;
};

/// The process-wide cache of properties(), indexed by ordinal.
struct properties_cache {
  std::mutex mutex;
  std::vector<std::unique_ptr<const device_properties>> entries;
};

GPUKIT_INLINE std::string format_gpu_uuid(const unsigned char (&bytes)[16]) {
  char text[4 + 36 + 1];
  std::snprintf(text, sizeof text, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", bytes[0],
                bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7], bytes[8], bytes[9], bytes[10],
                bytes[11], bytes[12], bytes[13], bytes[14], bytes[15]);
  return text;
}

GPUKIT_INLINE int device_attribute(cudaDeviceAttr attribute, int ordinal, const char* attribute_name) {
  int value = 0;
  GPUKIT_CUDA_TRY_DESCRIBED(
      cudaDeviceGetAttribute(&value, attribute, ordinal),
      std::string("cudaDeviceGetAttribute(") + attribute_name + ", " + std::to_string(ordinal) + ")", ordinal);
  return value;
}

GPUKIT_INLINE device_properties query_properties(device d) {
  const int ordinal = d.ordinal();
  cudaDeviceProp prop{};
  GPUKIT_CUDA_TRY_DESCRIBED(cudaGetDeviceProperties(&prop, ordinal),
                            "cudaGetDeviceProperties(" + std::to_string(ordinal) + ")", ordinal);
  device_properties p;
  p.device = d;
  p.name = prop.name;
  unsigned char uuid_bytes[16];
  for (int i = 0; i < 16; ++i) uuid_bytes[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
  p.uuid = format_gpu_uuid(uuid_bytes);
  p.pci_domain = prop.pciDomainID;
  p.pci_bus = prop.pciBusID;
  p.pci_device = prop.pciDeviceID;
  char bus_id[32];
  std::snprintf(bus_id, sizeof bus_id, "%04x:%02x:%02x.0", static_cast<unsigned>(prop.pciDomainID),
                static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
  p.pci_bus_id = bus_id;
  p.total_memory = prop.totalGlobalMem;
  p.compute_capability_major = prop.major;
  p.compute_capability_minor = prop.minor;
  p.multiprocessor_count = prop.multiProcessorCount;
  p.copy_engine_count = prop.asyncEngineCount;
  p.memory_bus_width_bits = prop.memoryBusWidth;
  p.l2_cache_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  p.warp_size = prop.warpSize;
  p.max_threads_per_block = prop.maxThreadsPerBlock;
  p.max_threads_per_multiprocessor = prop.maxThreadsPerMultiProcessor;
  p.shared_memory_per_block = prop.sharedMemPerBlock;
  p.shared_memory_per_multiprocessor = prop.sharedMemPerMultiprocessor;
  p.integrated = prop.integrated != 0;
  p.ecc_enabled = prop.ECCEnabled != 0;
  p.unified_addressing = prop.unifiedAddressing != 0;
  p.managed_memory = prop.managedMemory != 0;
  p.concurrent_managed_access = prop.concurrentManagedAccess != 0;
  p.pageable_memory_access = prop.pageableMemoryAccess != 0;
  p.can_map_host_memory = prop.canMapHostMemory != 0;
  p.multi_gpu_board = prop.isMultiGpuBoard != 0;
  // Fields CUDA 13 removed from cudaDeviceProp come from attributes.
  p.clock_rate_khz = device_attribute(cudaDevAttrClockRate, ordinal, "cudaDevAttrClockRate");
  p.memory_clock_rate_khz = device_attribute(cudaDevAttrMemoryClockRate, ordinal, "cudaDevAttrMemoryClockRate");
  p.compute_mode = device_attribute(cudaDevAttrComputeMode, ordinal, "cudaDevAttrComputeMode");
  p.memory_pools_supported =
      device_attribute(cudaDevAttrMemoryPoolsSupported, ordinal, "cudaDevAttrMemoryPoolsSupported") != 0;
  // No stream priority range here: cudaDeviceGetStreamPriorityRange answers for the current device and creates its
  // context (see stream_priority_range()).
  return p;
}

GPUKIT_INLINE properties_cache& device_properties_cache() {
  // Never destroyed: code that runs at exit (an atexit handler, a static's destructor) may still ask.
  static auto* cache = new properties_cache();
  return *cache;
}
}  // namespace detail

GPUKIT_INLINE const device_properties& properties(device d) {
  if (!d.is_cuda()) {
    throw invalid_argument_error("gpukit::properties(" + d.to_string() + "): only CUDA devices have properties");
  }
  detail::note_cuda_use();
  auto& cache = detail::device_properties_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    const auto index = static_cast<std::size_t>(d.ordinal());
    if (index < cache.entries.size() && cache.entries[index]) return *cache.entries[index];
  }
  // Queried outside the lock: it can take milliseconds. Two threads may both query; the first stored wins.
  auto fresh = std::make_unique<const device_properties>(detail::query_properties(d));
  std::lock_guard<std::mutex> lock(cache.mutex);
  const auto index = static_cast<std::size_t>(d.ordinal());
  if (cache.entries.size() <= index) cache.entries.resize(index + 1);
  if (!cache.entries[index]) cache.entries[index] = std::move(fresh);
  return *cache.entries[index];
}
namespace detail {

GPUKIT_INLINE priority_range_cache& stream_priority_ranges() {
  // Never destroyed: streams are created at exit too (the default stream pools serve code that runs then).
  static auto* cache = new priority_range_cache();
  return *cache;
}
}  // namespace detail

GPUKIT_INLINE priority_range stream_priority_range(device d) {
  if (!d.is_cuda()) return {};
  auto& cache = detail::stream_priority_ranges();
  const auto index = static_cast<std::size_t>(d.ordinal());
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (index < cache.entries.size() && cache.entries[index]) return *cache.entries[index];
  }
  priority_range range;
  {
    device_guard guard(d);
    GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceGetStreamPriorityRange(&range.least, &range.greatest),
                              "cudaDeviceGetStreamPriorityRange", d.ordinal());
  }
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.entries.size() <= index) cache.entries.resize(index + 1);
  cache.entries[index] = range;
  return range;
}

GPUKIT_INLINE memory_info query_memory_info(device d) {
  if (!d.is_cuda()) {
    throw invalid_argument_error("gpukit::query_memory_info(" + d.to_string() +
                                 "): only CUDA devices have device memory");
  }
  device_guard guard(d);
  memory_info info;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo", d.ordinal());
  return info;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
