// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The process-wide registry of graph-private pools (graph_pool.hpp): which pool serves the allocations of which
/// stream capture, and which pools are alive (their memory may be freed through any device_allocator). The
/// caching allocators consult it only while such a pool exists: one relaxed atomic load otherwise.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

class device_allocator;

namespace detail {

/// A graph_pool that holds memory, with the question its reserve answers: whether an address lies inside it (a
/// freed block's address included, so that a double free reaches the pool, not the allocator the reserve came from).
struct live_capture_pool {
  device_allocator* pool;
  bool (*in_reserve)(const device_allocator& pool, const void* p) noexcept;
};

struct capture_pool_registry {
  std::mutex mutex;
  std::map<unsigned long long, device_allocator*> capturing;  // capture id -> the pool serving it
  std::vector<live_capture_pool> live;                        // every graph_pool that holds memory
  std::atomic<int> live_count{0};
};

/// Never destroyed: pools may outlive static destruction order.
GPUKIT_EXPORT GPUKIT_INLINE capture_pool_registry& capture_pools();

/// True while any graph pool exists (the caching allocators then look further).
GPUKIT_INLINE bool any_capture_pool() noexcept;

/// The pool serving the capture `s` takes part in, or nullptr.
GPUKIT_INLINE device_allocator* pool_for_capture(const stream_view& s);

}  // namespace detail

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE capture_pool_registry& capture_pools() {
  static capture_pool_registry* registry = new capture_pool_registry();
  return *registry;
}

GPUKIT_INLINE bool any_capture_pool() noexcept {
  return capture_pools().live_count.load(std::memory_order_relaxed) != 0;
}

GPUKIT_INLINE device_allocator* pool_for_capture(const stream_view& s) {
  const unsigned long long id = capture_id(s);
  if (id == 0) return nullptr;
  auto& registry = capture_pools();
  std::lock_guard<std::mutex> lock(registry.mutex);
  const auto it = registry.capturing.find(id);
  return it == registry.capturing.end() ? nullptr : it->second;
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
