// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The process-wide record of peer access (which directions gpukit holds) and of the virtual-memory pages gpukit has
/// mapped on each device. Both live under one mutex because they meet: a page mapped while `from -> to` is held must
/// be made accessible to `from` (cuMemSetAccess; cudaDeviceEnablePeerAccess does not cover virtual memory), and
/// enabling `from -> to` must grant `from` the pages already mapped on `to`. peer_access.hpp and cuda_upstream use it.

#include <gpukit/detail/config.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

// One registry per process, outside the per-mode namespace that gives each default-stream mode its own copy of gpukit
// (detail/config.hpp): access is the driver's process-wide state, and a count per mode would let one mode disable
// access the other still holds. Nothing in it depends on the mode.
namespace gpukit {
namespace mode_independent {

/// One enabled direction: how many peer_access objects hold it, and whether gpukit enabled it (else it was enabled
/// outside gpukit and stays enabled after the last holder).
struct peer_access_entry {
  int holders = 0;                 ///< live peer_access objects holding this direction
  bool enabled_by_gpukit = false;  ///< gpukit enabled it, so the last holder disables it
  bool pool_granted_by_gpukit =
      false;  ///< gpukit granted `from` the default pool of `to`, so the last holder revokes it
};

/// The process-wide holders of peer access, by (from, to) ordinal, and gpukit's mapped virtual-memory pages. The
/// mutex also serializes enabling and disabling, so that a release never disables what another thread is enabling,
/// and mapping pages, so that a page is never mapped between a grant and its record.
struct peer_access_registry {
  std::mutex mutex;                                        ///< guards everything here and enabling/disabling
  std::map<std::pair<int, int>, peer_access_entry> pairs;  ///< held directions, keyed by (from, to) ordinal
  /// Pages of virtual memory mapped by gpukit (cuda_upstream::map), per device ordinal: page start -> page bytes.
  std::map<int, std::map<std::uintptr_t, std::size_t>> mapped_pages;
  /// Changes whenever a direction is first held or last released: a mapping that read the peers before it can tell
  /// whether they changed while it mapped.
  std::uint64_t generation = 0;

  /// The devices holding access to `to` (callers hold `mutex`).
  std::vector<int> peers_of(int to) const;
};

/// The process's peer_access_registry. Never destroyed: a peer_access at namespace scope is released after main
/// returns, and memory is unmapped by allocators destroyed then. The name carries the registry's layout version:
/// shared libraries built with gpukit versions whose registries differ each get their own, never a mismatched one.
GPUKIT_EXPORT GPUKIT_INLINE peer_access_registry& peer_access_holders_v2();

}  // namespace mode_independent
}  // namespace gpukit

#if GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS
namespace gpukit {
namespace mode_independent {

GPUKIT_INLINE std::vector<int> peer_access_registry::peers_of(int to) const {
  std::vector<int> from;
  for (const auto& entry : pairs) {
    if (entry.first.second == to && entry.second.holders > 0) from.push_back(entry.first.first);
  }
  return from;
}

GPUKIT_INLINE peer_access_registry& peer_access_holders_v2() {
  static peer_access_registry* registry = new peer_access_registry();
  return *registry;
}

}  // namespace mode_independent
}  // namespace gpukit
#endif  // GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS
