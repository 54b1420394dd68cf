// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Peer access between CUDA devices: whether one device can read and write another's memory directly
/// (can_access_peer, peer_matrix), and an RAII handle that enables it (peer_access). Peer copies need none of this
/// (cudaMemcpyPeerAsync and device-to-device copy_async work between any two devices, through the host where there is
/// no direct path); kernels that dereference another device's pointers need access enabled.
///
/// Nothing here creates a context on a device the caller did not name: the queries create none, and peer_access
/// creates the primary contexts of its two devices only.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/detail/peer_registry.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/device/nvml.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {

/// "cuda:0 -> cuda:1", for messages.
inline std::string describe_peer_pair(device from, device to) { return from.to_string() + " -> " + to.to_string(); }

}  // namespace detail

/// Whether device `from` can directly access memory on device `to` (cudaDeviceCanAccessPeer). False for the CPU on
/// either side and for from == to (a device reaches its own memory without peer access). Creates no context. Throws
/// the gpukit error of the failed call (invalid_argument_error for an ordinal that is not visible), naming both
/// devices.
inline bool can_access_peer(device from, device to) {
  if (!from.is_cuda() || !to.is_cuda() || from == to) return false;
  detail::note_cuda_use();
  int can = 0;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceCanAccessPeer(&can, from.ordinal(), to.ordinal()),
                            "cudaDeviceCanAccessPeer(" + detail::describe_peer_pair(from, to) + ")", from.ordinal());
  return can != 0;
}

/// Which visible CUDA devices can access which (query_peer_matrix), printable like `nvidia-smi topo -m`.
struct peer_matrix {
  /// cuda:0 ... cuda:(n-1).
  std::vector<device> devices;
  /// can_access[i][j]: devices[i] can access the memory of devices[j]; false on the diagonal.
  std::vector<std::vector<bool>> can_access;
  /// How each pair is connected, in nvidia-smi topo -m's words ("NV18", "PIX", "PXB", "PHB", "NODE", "SYS"; see
  /// nvml::library::link): n x n when NVML knows the devices (an empty string for a pair it cannot tell), empty
  /// without NVML.
  std::vector<std::vector<std::string>> links;

  /// The number of devices (n).
  std::size_t size() const noexcept { return devices.size(); }

  /// A table with a row and a column per device: "X" on the diagonal, "OK" where the row's device can access the
  /// column's, "--" where not; each cell followed by its link when `links` is filled in. Then a legend.
  std::string to_string() const {
    const std::size_t n = devices.size();
    if (n == 0) return "no CUDA devices\n";
    const bool with_links = links.size() == n;
    auto cell = [&](std::size_t i, std::size_t j) {
      const bool can = i < can_access.size() && j < can_access[i].size() && can_access[i][j];  // a hand-made matrix
      std::string text = i == j ? "X" : (can ? "OK" : "--");
      if (with_links && i != j && j < links[i].size() && !links[i][j].empty()) text += " " + links[i][j];
      return text;
    };
    std::size_t width = 0;
    for (std::size_t i = 0; i < n; ++i) {
      width = std::max(width, devices[i].to_string().size());
      for (std::size_t j = 0; j < n; ++j) width = std::max(width, cell(i, j).size());
    }
    auto pad = [&](std::string text) {
      text.resize(width + 2, ' ');
      return text;
    };
    std::string out = pad("");
    for (std::size_t j = 0; j < n; ++j) out += pad(devices[j].to_string());
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += '\n';
    for (std::size_t i = 0; i < n; ++i) {
      std::string row = pad(devices[i].to_string());
      for (std::size_t j = 0; j < n; ++j) row += pad(cell(i, j));
      while (!row.empty() && row.back() == ' ') row.pop_back();
      out += row + '\n';
    }
    out +=
        "\nOK = the row's device can access the column's memory directly (peer access can be enabled)\n"
        "-- = it cannot (copies still work, through the host)\n";
    if (with_links) {
      out +=
          "NV# = # NVLinks; PIX = one PCIe switch, PXB = several, PHB = a PCIe host bridge, NODE = the same NUMA "
          "node, SYS = across NUMA nodes\n";
    }
    return out;
  }
};

/// The peer matrix of every visible CUDA device (cudaDeviceCanAccessPeer for each ordered pair), with the link of
/// each pair from `nvml` where it knows the devices. Empty without a usable device. Creates no context. Throws the
/// gpukit error of a failed query.
inline peer_matrix query_peer_matrix(const nvml::library& nvml = nvml::instance()) {
  peer_matrix m;
  const int n = device_count();
  for (int i = 0; i < n; ++i) m.devices.push_back(device::cuda(i));
  m.can_access.assign(static_cast<std::size_t>(n), std::vector<bool>(static_cast<std::size_t>(n), false));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      m.can_access[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] =
          can_access_peer(device::cuda(i), device::cuda(j));
    }
  }
  if (!nvml.available() || n == 0) return m;
  std::vector<std::vector<std::string>> links(static_cast<std::size_t>(n),
                                              std::vector<std::string>(static_cast<std::size_t>(n)));
  bool any = false;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (auto link = nvml.link(properties(device::cuda(i)), properties(device::cuda(j)))) {
        links[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] = *link;
        any = any || i != j;
      }
    }
  }
  if (any) m.links = std::move(links);
  return m;
}

namespace detail {

/// A failed CUDA call: its result (cudaSuccess: none failed) and its name.
using access_failure = std::pair<cudaError_t, std::string>;

/// Sets `from`'s access (read/write, or none) to the pages of virtual memory gpukit mapped on `to`, one
/// cuMemSetAccess per run of contiguous pages; goes on past a failure. Returns the first failure. The caller holds
/// the registry's mutex.
inline access_failure set_mapped_pages_access(mode_independent::peer_access_registry& registry, device from, device to,
                                              bool grant) {
  access_failure first{cudaSuccess, {}};
  const auto pages = registry.mapped_pages.find(to.ordinal());
  if (pages == registry.mapped_pages.end()) return first;
  const CUmemAccessDesc access = device_access_desc(from.ordinal(), grant);
  for (auto it = pages->second.begin(); it != pages->second.end();) {
    const std::uintptr_t start = it->first;
    std::uintptr_t end = it->first + it->second;
    for (++it; it != pages->second.end() && it->first == end; ++it) end += it->second;
    const CUresult r = driver().mem_set_access(static_cast<CUdeviceptr>(start), end - start, &access, 1);
    if (r != CUDA_SUCCESS && first.first == cudaSuccess) {
      first = {runtime_error_of(r), "cuMemSetAccess (CUresult " + std::to_string(static_cast<int>(r)) + ")"};
    }
  }
  return first;
}

/// Sets `from`'s access to `to`'s default memory pool (cudaMemPoolSetAccess). Granting reports in `changed` whether
/// the access was not there before (so that only what gpukit granted is taken back). A device without memory pools
/// is skipped. Returns the failure, if any, with the call that failed.
inline access_failure set_default_pool_access(device from, device to, bool grant, bool& changed) {
  changed = false;
  auto failed = [](cudaError_t result, const char* call) {
    forget_failure(result);
    return access_failure{result, call};
  };
  cudaMemPool_t pool = nullptr;
  cudaError_t result = cudaDeviceGetDefaultMemPool(&pool, to.ordinal());
  if (result == cudaErrorNotSupported) {  // no pools: nothing to grant, and the refusal is not the caller's error
    forget_failure(cudaErrorNotSupported);
    return {cudaSuccess, {}};
  }
  if (result != cudaSuccess) return failed(result, "cudaDeviceGetDefaultMemPool");
  cudaMemLocation location{};
  location.type = cudaMemLocationTypeDevice;
  location.id = from.ordinal();
  if (grant) {
    cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
    result = cudaMemPoolGetAccess(&flags, pool, &location);
    if (result != cudaSuccess) return failed(result, "cudaMemPoolGetAccess");
    if (flags == cudaMemAccessFlagsProtReadWrite) return {cudaSuccess, {}};  // granted outside gpukit: left alone
  }
  cudaMemAccessDesc access{};
  access.location = location;
  access.flags = grant ? cudaMemAccessFlagsProtReadWrite : cudaMemAccessFlagsProtNone;
  result = cudaMemPoolSetAccess(pool, &access, 1);
  if (result != cudaSuccess) return failed(result, "cudaMemPoolSetAccess");
  changed = grant;
  return {cudaSuccess, {}};
}

/// Reports a failure to grant or take back access to memory that peer access does not cover (nothing at exit).
inline void warn_memory_access_failure(const access_failure& failure, device from, device to,
                                       const char* what) noexcept {
  if (failure.first == cudaSuccess || is_teardown_result(failure.first)) return;
  warn_parts("gpukit::peer_access(", from, " -> ", to, "): ", failure.second, " failed (",
             cudaGetErrorName(failure.first), ") ", what);
}

/// Takes one hold on from -> to, enabling it if it is the first: peer access (cudaDeviceEnablePeerAccess, whose
/// failure is thrown), then access to the memory it does not cover, best effort: a failure to grant gpukit's
/// virtual-memory pages or the default pool is a warning (kernels on `from` touching that memory would fault), and
/// the cudaMalloc memory stays reachable.
inline void acquire_peer_access(device from, device to) {
  access_failure pages{cudaSuccess, {}};
  access_failure pool{cudaSuccess, {}};
  std::optional<device_guard> guard;  // outlives the lock: warnings (the guard's too) are raised outside it
  auto& registry = mode_independent::peer_access_holders_v2();
  std::unique_lock<std::mutex> lock(registry.mutex);
  const auto key = std::make_pair(from.ordinal(), to.ordinal());
  const auto found = registry.pairs.find(key);
  if (found != registry.pairs.end()) {
    ++found->second.holders;
    return;
  }
  // Asked first: it creates no context, and a pair that cannot be peers gets one message (CUDA's documented
  // cudaErrorInvalidDevice would read as a bad ordinal), with no context made on `from` for nothing.
  if (!can_access_peer(from, to)) {
    throw cuda_error("gpukit::peer_access(" + describe_peer_pair(from, to) + "): " + from.to_string() +
                         " cannot access the memory of " + to.to_string() +
                         " directly (cudaDeviceCanAccessPeer says no; cudaErrorPeerAccessUnsupported): the driver "
                         "reports no peer path (see query_peer_matrix); copies between them still work, through the "
                         "host",
                     cudaErrorPeerAccessUnsupported, "cudaDeviceEnablePeerAccess(" + describe_peer_pair(from, to) + ")",
                     from.ordinal(), __FILE__, __LINE__);
  }
  // Recorded before access is enabled, with no holder yet (invisible: the lock is held until it has one), so that
  // running out of memory cannot leave access enabled and unrecorded, which no release would then disable.
  const auto slot = registry.pairs.emplace(key, mode_independent::peer_access_entry{0, true, false}).first;
  try {
    guard.emplace(from);  // access is enabled from the current device's context
    const cudaError_t result = cudaDeviceEnablePeerAccess(to.ordinal(), 0);
    if (result == cudaErrorPeerAccessAlreadyEnabled) {
      // Enabled outside gpukit: not ours to disable. The runtime recorded the result as the last error.
      forget_failure(cudaErrorPeerAccessAlreadyEnabled);
      slot->second.enabled_by_gpukit = false;
    } else if (result != cudaSuccess) {
      throw_cuda_error(result, "cudaDeviceEnablePeerAccess(" + describe_peer_pair(from, to) + ")", from.ordinal(),
                       __FILE__, __LINE__);
    }
  } catch (...) {
    registry.pairs.erase(slot);
    throw;
  }
  mode_independent::peer_access_entry& held = slot->second;
  held.holders = 1;
  ++registry.generation;  // before the grants: pages mapped from now on include `from`
  try {
    pages = set_mapped_pages_access(registry, from, to, true);
    pool = set_default_pool_access(from, to, true, held.pool_granted_by_gpukit);
    lock.unlock();  // the warning handler runs outside any gpukit lock
    warn_memory_access_failure(pages, from, to, "while granting access to gpukit's virtual-memory pages");
    warn_memory_access_failure(pool, from, to, "while granting access to the default memory pool");
  } catch (...) {  // no memory for a message: the grants are best effort, the hold stands
  }
}

/// Drops one hold on from -> to; the last takes back the access gpukit granted (virtual-memory pages, and the default
/// pool where gpukit granted it) and disables peer access if gpukit enabled it. Never throws: failures are warnings,
/// and nothing is reported once the runtime is unloading (process exit). Work still running on `from` must not touch
/// `to`'s memory any more, as for cudaDeviceDisablePeerAccess.
inline void release_peer_access(device from, device to) noexcept {
  cudaError_t result = cudaSuccess;
  const char* call = "";  // not a std::string: assigned in a handler, where std::bad_alloc would terminate
  access_failure pages{cudaSuccess, {}};
  access_failure pool{cudaSuccess, {}};
  std::optional<device_guard> guard;  // outlives the lock: warnings (the guard's too) are raised outside it
  {
    auto& registry = mode_independent::peer_access_holders_v2();
    std::lock_guard<std::mutex> lock(registry.mutex);
    const auto found = registry.pairs.find(std::make_pair(from.ordinal(), to.ordinal()));
    if (found == registry.pairs.end() || --found->second.holders > 0) return;
    const mode_independent::peer_access_entry entry = found->second;
    registry.pairs.erase(found);
    ++registry.generation;
    try {
      guard.emplace(from);
      pages = set_mapped_pages_access(registry, from, to, false);
      if (entry.pool_granted_by_gpukit) {
        bool unused = false;
        pool = set_default_pool_access(from, to, false, unused);
      }
      if (entry.enabled_by_gpukit) {
        result = cudaDeviceDisablePeerAccess(to.ordinal());
        call = "cudaDeviceDisablePeerAccess";
      }
    } catch (const error& e) {  // the guard could not make `from` current (at exit: the runtime is unloading)
      result = e.cuda_result() != cudaSuccess ? e.cuda_result() : cudaErrorUnknown;
      call = "cudaSetDevice";
    } catch (...) {
      result = cudaErrorUnknown;
    }
  }
  try {  // the warning handler runs outside any gpukit lock
    warn_memory_access_failure(pages, from, to, "while taking back access to gpukit's virtual-memory pages");
    warn_memory_access_failure(pool, from, to, "while taking back access to the default memory pool");
  } catch (...) {
  }
  if (result == cudaSuccess) return;
  try {
    report_cuda_failure(result, std::string(call) + "(" + describe_peer_pair(from, to) + ") in ~peer_access",
                        from.ordinal());
  } catch (...) {
  }
}

}  // namespace detail

/// RAII: direct access from device `from` to the memory of device `to` while the object lives: kernels on `from` may
/// then dereference pointers to `to`'s memory from cudaMalloc (the caching allocator's default), from gpukit's
/// expandable segments (virtual memory, which peer access does not cover: gpukit grants `from` each page mapped on
/// `to` with cuMemSetAccess, now and as pages are mapped later) and from `to`'s default memory pool (cudaMallocAsync,
/// async_allocator, async_pool_upstream: cudaMemPoolSetAccess, which other users of that pool share; access granted
/// outside gpukit is left as it is). Those two grants are best effort: a failure is a warning, and peer access to
/// cudaMalloc memory stands. Access is one-directional; take two objects for both directions. Virtual memory mapped
/// outside gpukit, and pools other than the default one, stay the caller's to grant.
///
/// Holds are counted process-wide per direction (one count for both default-stream modes and every shared library):
/// the first peer_access enables access (cudaDeviceEnablePeerAccess with `from` current, restoring the thread's
/// device afterwards), the last one destroyed disables it. Access that was already enabled outside gpukit is used as
/// it is and left enabled. Thread-safe. Movable, not copyable.
///
/// Access lives in the primary context of `from`, or in a context of `from` itself that the user made current with
/// the driver API (no switch is made then). A driver-API context of another device is not kept: the constructor and
/// destructor make `from` current with cudaSetDevice, which binds its primary context, and leave the thread in a
/// primary context, not in the user's one. cudaDeviceReset of either device ends access while the object still
/// holds it: destroy peer_access objects before a reset.
///
/// The constructor creates the primary contexts of `from` and `to` (the driver needs both) and no other. from == to
/// is a no-op (active() is false). Throws invalid_argument_error for a CPU device or an ordinal that is not visible,
/// cuda_error (cudaErrorPeerAccessUnsupported) naming both devices when the pair cannot be peers (can_access_peer is
/// false), before any context is made, and the gpukit error of a call that fails.
/// The destructor never throws: a failure is a warning (gpukit::warn), and at process exit, when the runtime is
/// unloading, nothing is done or reported.
class peer_access {
 public:
  /// Holds nothing.
  peer_access() noexcept = default;

  /// Enables access from `from` to `to` (or takes another hold on it); see the class comment for contexts and errors.
  peer_access(device from, device to) : from_(from), to_(to) {
    if (!from.is_cuda() || !to.is_cuda()) {
      throw invalid_argument_error("gpukit::peer_access(" + detail::describe_peer_pair(from, to) +
                                   "): peer access is between two CUDA devices");
    }
    if (from == to) {  // nothing to enable, but the ordinal must exist, as for two devices
      detail::note_cuda_use();
      int visible = 0;
      // No driver or no GPU: the error of two devices (no_device_error), not "not visible (0 CUDA devices)".
      GPUKIT_CUDA_TRY_DESCRIBED(cudaGetDeviceCount(&visible), "cudaGetDeviceCount", -1);
      if (from.ordinal() >= visible) {
        throw invalid_argument_error("gpukit::peer_access(" + detail::describe_peer_pair(from, to) +
                                     "): " + from.to_string() + " is not visible (" + std::to_string(visible) +
                                     " CUDA devices)");
      }
      return;
    }
    detail::note_cuda_use();
    detail::acquire_peer_access(from, to);
    active_ = true;
  }

  peer_access(const peer_access&) = delete;
  peer_access& operator=(const peer_access&) = delete;

  /// Takes over `other`'s hold; `other` holds nothing afterwards.
  peer_access(peer_access&& other) noexcept
      : from_(other.from_), to_(other.to_), active_(std::exchange(other.active_, false)) {}

  /// Drops this object's hold (as reset()), then takes over `other`'s.
  peer_access& operator=(peer_access&& other) noexcept {
    if (this != &other) {
      reset();
      from_ = other.from_;
      to_ = other.to_;
      active_ = std::exchange(other.active_, false);
    }
    return *this;
  }

  ~peer_access() { reset(); }

  /// Drops the hold now (the destructor then does nothing).
  void reset() noexcept {
    if (std::exchange(active_, false)) detail::release_peer_access(from_, to_);
  }

  /// True while the object holds access (false for from == to, default-constructed, moved-from or reset objects).
  bool active() const noexcept { return active_; }
  /// The device that accesses.
  device from() const noexcept { return from_; }
  /// The device whose memory is accessed.
  device to() const noexcept { return to_; }

 private:
  device from_{};
  device to_{};
  bool active_ = false;
};

GPUKIT_END_NAMESPACE
