// cudasim — a strict simulated CUDA runtime for gpukit's tests (see README.md beside this file).
//
// The shared library libgpukit_cudasim exports the CUDA Runtime functions gpukit calls, compiled against the
// toolkit's own cuda_runtime_api.h, so a test executable linked with it instead of libcudart runs every CUDA code
// path of gpukit on a machine without a GPU. This header is the control interface tests use: the simulated
// machine, the rule violations the simulator saw, primary-context bookkeeping, call counts and fault injection.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__GNUC__)
#define CUDASIM_API __attribute__((visibility("default")))
#else
#define CUDASIM_API
#endif

namespace cudasim {

/// One simulated GPU (a physical device: CUDA_VISIBLE_DEVICES chooses which become ordinals).
struct device_config {
  std::string name = "NVIDIA H100 80GB HBM3 (cudasim)";
  unsigned char uuid[16] = {};
  int pci_domain = 0;
  int pci_bus = 0;
  int pci_device = 0;
  std::size_t total_memory = std::size_t{80} << 30;
  int major = 9;
  int minor = 0;
  int multiprocessors = 132;
  int copy_engines = 3;
  int priority_least = 0;      ///< cudaDeviceGetStreamPriorityRange's first value
  int priority_greatest = -5;  ///< and its second
  int clock_rate_khz = 1980000;
  int memory_clock_rate_khz = 2619000;
  int memory_bus_width_bits = 5120;
  bool virtual_memory = true;  ///< cudaDevAttrVirtualMemoryManagementSupported (cuMemCreate and friends)
  /// cudaDevAttrComputeMode, a cudaComputeMode value (the simulator does not refuse contexts on a prohibited device).
  int compute_mode = cudaComputeModeDefault;
};

/// The simulated machine. Default: two devices; environment CUDASIM_DEVICES=N (0..8) changes the count.
struct machine_config {
  std::vector<device_config> devices;
  /// Device memory a primary context takes when it is created (cudaMemGetInfo shows it as used).
  std::size_t context_bytes = std::size_t{300} << 20;
  /// The topology: peer_access[i][j] says whether physical device i can access the memory of physical device j
  /// (cudaDeviceCanAccessPeer). Empty: every pair can, as on an NVLink-connected box. Otherwise devices.size() rows
  /// of devices.size() entries (configure throws std::invalid_argument else); the diagonal is ignored (a device is
  /// never its own peer).
  std::vector<std::vector<bool>> peer_access;
};

/// The physical device `index` of the default machine: distinct UUIDs (GPU-c0da51d0-0000-4000-8000-00000000000N
/// style) and PCI bus ids (0000:1N:00.0).
CUDASIM_API device_config default_device(int index);
/// A machine of `count` default devices.
CUDASIM_API machine_config default_machine(int count);

/// Replaces the machine. Only before the first CUDA call of the process (the runtime reads its configuration, and
/// CUDA_VISIBLE_DEVICES, once); afterwards it throws std::logic_error. A malformed peer_access matrix throws
/// std::invalid_argument.
CUDASIM_API void configure(const machine_config& machine);

/// For a test that needs another machine than the default: configures `machine` and returns true, or, when an
/// earlier test of the process initialised the runtime, prints the marker that makes the test Skipped and returns
/// false. A malformed machine still throws std::invalid_argument.
inline bool configure_or_skip(const machine_config& machine) {
  try {
    configure(machine);
    return true;
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::logic_error&) {
    std::printf("GPUKIT_TEST_SKIPPED: the simulated runtime was initialised by an earlier test in this process\n");
    return false;
  }
}

/// The physical indices CUDA_VISIBLE_DEVICES=`value` makes visible, in ordinal order, on `machine` — the
/// simulator's own implementation of the runtime's rules (unset: pass nullptr). `emptied_by_repeat`, when given, says
/// whether a device named twice hid every one (the runtime then answers cudaErrorInvalidDevice, not ...NoDevice).
CUDASIM_API std::vector<int> visible_physical_devices(const char* value, const machine_config& machine,
                                                      bool* emptied_by_repeat = nullptr);

/// A rule of the CUDA programming model the program broke: the call, the error the runtime returned, and why.
struct violation {
  std::string call;
  cudaError_t error = cudaSuccess;
  std::string message;
};
/// Every violation recorded so far (the sim test main fails a test that leaves any).
CUDASIM_API std::vector<violation> violations();
/// Returns the violations recorded so far and forgets them (for tests that break a rule on purpose).
CUDASIM_API std::vector<violation> take_violations();

/// How many times the primary context of visible ordinal `device` was created (0 or 1 in this simulator).
CUDASIM_API int context_creations(int device);
/// Whether the primary context of `device` is active (cuDevicePrimaryCtxGetState).
CUDASIM_API bool context_active(int device);
/// Whether access from visible ordinal `device`'s context to the memory of `peer` is enabled
/// (cudaDeviceEnablePeerAccess from `device`, not disabled since).
CUDASIM_API bool peer_access_enabled(int device, int peer);
/// Whether a kernel on visible ordinal `device` may dereference `address`: its own cudaMalloc memory, a peer's once
/// peer access is enabled (cudaDeviceEnablePeerAccess), pool memory (cudaMallocAsync) of its own device or of a pool
/// that granted it access (cudaMemPoolSetAccess), a mapped page of a reserved range that cuMemSetAccess granted it,
/// and pinned host memory. False for anything else, including addresses the simulator does not know.
CUDASIM_API bool accessible_from(int device, const void* address);
/// Creating a primary context on any device not in `devices` becomes a violation ("a context on a device the program
/// never named"). An empty list allows every device (the default).
CUDASIM_API void allow_contexts_only_on(const std::vector<int>& devices);

/// Makes the `nth` next call of `function` (1: the very next) return `error`. A sticky error (cudaErrorIllegalAddress,
/// cudaErrorLaunchFailure, ...) then corrupts the process's CUDA state: every later call returns it, as on a GPU.
CUDASIM_API void fail_call(const std::string& function, int nth, cudaError_t error);
/// Runs `action` on the calling thread just before the `nth` next call of `function` (1: the very next) does anything,
/// outside the simulator's lock, so it may call CUDA and gpukit itself: what another thread could do in the middle of
/// a sequence of calls, made deterministic. For runtime functions and the driver's cuMemCreate, cuMemMap and
/// cuMemSetAccess. clear_faults() forgets pending actions.
CUDASIM_API void before_call(const std::string& function, int nth, std::function<void()> action);
/// Forgets pending injected failures, pending before_call actions and a sticky error (tests that inject a sticky error
/// clean up with this), and undoes unload().
CUDASIM_API void clear_faults();
/// Makes every later runtime call return `result` without effect, as the real runtime does once it is unloaded at
/// process exit (cudaErrorCudartUnloading, the value of the driver's CUDA_ERROR_DEINITIALIZED) or once the primary
/// context is torn down (cudaErrorContextIsDestroyed): for tests of destructors that run after main returns. Not a
/// violation; the control functions here keep working. clear_faults() undoes it.
CUDASIM_API void unload(cudaError_t result = cudaErrorCudartUnloading);

/// Whether this thread is inside a simulated CUDA call: a test that makes the host heap fail counts only the
/// allocations of the code under test, not the simulator's.
CUDASIM_API bool inside_call() noexcept;

/// How many times `function` was called (successful or not).
CUDASIM_API std::size_t calls(const std::string& function);
/// Device memory in use on `device` (allocations plus active contexts).
CUDASIM_API std::size_t device_memory_used(int device);
/// Streams created and not yet destroyed on `device` (legacy and per-thread streams excluded).
CUDASIM_API int live_streams(int device);
/// Waits until every stream of every device is idle (a test helper: never blocks on work that cannot progress).
CUDASIM_API void drain_all();
/// From now on (`on`), a cudaMallocAsync served by a default pool returns, if it can, the address of that pool's most
/// recently freed block of the same rounded size, as a real pool may; off (the default), every allocation gets a new
/// address.
CUDASIM_API void reuse_pool_addresses(bool on);

}  // namespace cudasim
