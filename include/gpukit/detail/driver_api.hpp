// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The few CUDA driver functions gpukit needs, obtained at run time with cudaGetDriverEntryPointByVersion, so gpukit
/// never links libcuda (a program built with it must start on a machine without a driver). The runtime can say which
/// device is current but not whether a context is current on the thread (cudaGetDevice says 0 on a thread that never
/// chose a device), nor whether a device has a primary context; both are needed so that gpukit never creates a
/// context (hundreds of MB of device memory) on a device the program did not use.
///
/// Loaded once per process, on first use (thread-safe; never at static initialisation). Without a driver, or with a
/// driver that lacks an entry point, the functions are null and the queries below answer "unknown": callers then
/// behave as with the runtime alone.

#include <gpukit/detail/config.hpp>

#include <cuda.h>  // the driver's types only: no function of it is linked
#include <cuda_runtime_api.h>

#include <cstring>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The runtime error a driver result stands for. The runtime's enum gives every result it shares with the driver the
/// driver's number (cuda.h vs driver_types.h, CUDA 13: 700 illegal address, 719 launch failure, 800, 801, 401, ...;
/// CUDA_ERROR_DEINITIALIZED, 4, is cudaErrorCudartUnloading), so those keep their number and a caller can tell a
/// sticky error; the few driver results without a runtime counterpart (202, 916, newer ones) are cudaErrorUnknown.
inline cudaError_t runtime_error_of(CUresult r) noexcept {
  // The values both enums define, as closed ranges (CUDA 13.0).
  static constexpr int shared[][2] = {{0, 8},     {34, 34},   {36, 36},   {46, 46},   {100, 102},
                                      {200, 201}, {205, 226}, {300, 304}, {400, 402}, {500, 500},
                                      {600, 600}, {700, 705}, {708, 721}, {800, 812}, {900, 915}};
  const int value = static_cast<int>(r);
  for (const auto& range : shared) {
    if (value >= range[0] && value <= range[1]) return static_cast<cudaError_t>(value);
  }
  return cudaErrorUnknown;
}

/// The driver entry points gpukit uses, or null where unavailable. Declared with cuda.h's exact types: calling
/// through a pointer of another function type is undefined (UBSan's -fsanitize=function reports it).
struct driver_api {
  /// cuCtxGetCurrent: the calling thread's current context, or null.
  CUresult(CUDAAPI* ctx_get_current)(CUcontext* context) = nullptr;
  /// cuDeviceGet: the driver's handle of a (visible) ordinal.
  CUresult(CUDAAPI* device_get)(CUdevice* device, int ordinal) = nullptr;
  /// cuDevicePrimaryCtxGetState: whether the device's primary context is active.
  CUresult(CUDAAPI* primary_ctx_get_state)(CUdevice device, unsigned* flags, int* active) = nullptr;

  /// cuStreamGetCtx (CUDA 9.2's form): the context a stream belongs to. Unlike cudaStreamGetDevice, it may be asked
  /// of a stream being captured (cudaStreamGetDevice, GetId and GetFlags invalidate the capture; measured on an H200).
  CUresult(CUDAAPI* stream_get_ctx)(CUstream stream, CUcontext* context) = nullptr;
  /// cuCtxGetDevice (CUDA 13.0's form, of a given context): with stream_get_ctx, the device of a stream.
  CUresult(CUDAAPI* ctx_get_device)(CUdevice* device, CUcontext context) = nullptr;

  /// cuDeviceGetAttribute (for CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, which the runtime lacks).
  CUresult(CUDAAPI* device_get_attribute)(int* value, CUdevice_attribute attribute, CUdevice device) = nullptr;

  // Virtual memory management (expandable segments): reserve an address range, back its pages with physical
  // allocations, give them back.
  CUresult(CUDAAPI* mem_get_allocation_granularity)(size_t* granularity, const CUmemAllocationProp* prop,
                                                    CUmemAllocationGranularity_flags option) = nullptr;
  CUresult(CUDAAPI* mem_address_reserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) = nullptr;
  CUresult(CUDAAPI* mem_address_free)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult(CUDAAPI* mem_create)(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                                unsigned long long flags) = nullptr;
  CUresult(CUDAAPI* mem_release)(CUmemGenericAllocationHandle handle) = nullptr;
  CUresult(CUDAAPI* mem_map)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags) = nullptr;
  CUresult(CUDAAPI* mem_unmap)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult(CUDAAPI* mem_set_access)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) = nullptr;

  bool has_virtual_memory() const noexcept;
};

/// The ABI version requested from the driver: these functions have not changed since CUDA 7 (cuStreamGetCtx since
/// 9.2; cuCtxGetDevice is asked in its CUDA 13.0 form, which names the context), and a driver that runs this runtime
/// provides CUDA 12.0's.
inline constexpr unsigned driver_api_version = 12000;

/// Looks up the entry points (see driver()). Never throws.
GPUKIT_INLINE driver_api load_driver_api() noexcept;

/// A cuMemSetAccess descriptor for device `ordinal`: read/write, or none (access taken back).
GPUKIT_INLINE CUmemAccessDesc device_access_desc(int ordinal, bool read_write) noexcept;

/// True for the results of a driver already torn down, as at process exit (CUDA_ERROR_DEINITIALIZED,
/// CUDA_ERROR_CONTEXT_IS_DESTROYED): what it held went with it, so there is nothing left to release or report.
constexpr bool is_teardown_result(CUresult result) noexcept {
  return result == CUDA_ERROR_DEINITIALIZED || result == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

/// The process-wide driver entry points, looked up on first use.
GPUKIT_EXPORT GPUKIT_INLINE const driver_api& driver() noexcept;

/// Whether a CUDA context is current on the calling thread: 1 yes, 0 no (the thread never chose a device, so
/// cudaGetDevice's 0 is only a default), -1 unknown (no driver entry point). Never throws; creates nothing.
GPUKIT_INLINE int thread_context_state() noexcept;

/// Whether the primary context of visible device `ordinal` is active (exists): 1 yes, 0 no, -1 unknown. Never
/// throws; creates nothing.
GPUKIT_INLINE int primary_context_state(int ordinal) noexcept;

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE bool driver_api::has_virtual_memory() const noexcept {
  return device_get != nullptr && device_get_attribute != nullptr && mem_get_allocation_granularity != nullptr &&
         mem_address_reserve != nullptr && mem_address_free != nullptr && mem_create != nullptr &&
         mem_release != nullptr && mem_map != nullptr && mem_unmap != nullptr && mem_set_access != nullptr;
}

GPUKIT_INLINE driver_api load_driver_api() noexcept {
  driver_api api;
  // Initialises the runtime and the driver (cuInit), which cuDeviceGet needs; creates no context.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return api;
  }
  auto load = [](const char* symbol, auto& function, unsigned version = driver_api_version) {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(symbol, &address, version, cudaEnableDefault, &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (status != cudaDriverEntryPointSuccess || address == nullptr) return;
    static_assert(sizeof(function) == sizeof(address), "function and object pointers differ in size");
    std::memcpy(&function, &address, sizeof address);  // POSIX guarantees this round trip
  };
  load("cuCtxGetCurrent", api.ctx_get_current);
  load("cuDeviceGet", api.device_get);
  load("cuDevicePrimaryCtxGetState", api.primary_ctx_get_state);
  load("cuStreamGetCtx", api.stream_get_ctx, 12000);  // 12.0: the two-argument form (12.5 added a third)
  load("cuCtxGetDevice", api.ctx_get_device, 13000);  // the form that takes a context
  load("cuDeviceGetAttribute", api.device_get_attribute);
  load("cuMemGetAllocationGranularity", api.mem_get_allocation_granularity);
  load("cuMemAddressReserve", api.mem_address_reserve);
  load("cuMemAddressFree", api.mem_address_free);
  load("cuMemCreate", api.mem_create);
  load("cuMemRelease", api.mem_release);
  load("cuMemMap", api.mem_map);
  load("cuMemUnmap", api.mem_unmap);
  load("cuMemSetAccess", api.mem_set_access);
  return api;
}

GPUKIT_INLINE CUmemAccessDesc device_access_desc(int ordinal, bool read_write) noexcept {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = read_write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return access;
}

GPUKIT_INLINE const driver_api& driver() noexcept {
  static const driver_api api = load_driver_api();
  return api;
}

GPUKIT_INLINE int thread_context_state() noexcept {
  const driver_api& api = driver();
  CUcontext context = nullptr;
  if (api.ctx_get_current == nullptr || api.ctx_get_current(&context) != CUDA_SUCCESS) return -1;
  return context != nullptr ? 1 : 0;
}

GPUKIT_INLINE int primary_context_state(int ordinal) noexcept {
  const driver_api& api = driver();
  if (api.device_get == nullptr || api.primary_ctx_get_state == nullptr || ordinal < 0) return -1;
  CUdevice device = 0;
  if (api.device_get(&device, ordinal) != CUDA_SUCCESS) return -1;
  unsigned flags = 0;
  int active = 0;
  if (api.primary_ctx_get_state(device, &flags, &active) != CUDA_SUCCESS) return -1;
  return active != 0 ? 1 : 0;
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
