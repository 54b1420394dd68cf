// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The per-device default allocators and the PyTorch-style free functions that act on them:
///
///     gpukit::memory_allocated(d); gpukit::memory_reserved(d); gpukit::max_memory_allocated(d);
///     gpukit::empty_cache(d); std::puts(gpukit::memory_summary(d).c_str());
///
/// A default allocator is created on first use (never during static initialisation, and without any CUDA call
/// until it allocates), lives until the process exits (so buffers in static storage can still free into it), and
/// can be replaced with set_default_allocator().
///
/// The functions that may create a default allocator are templates with one defaulted parameter
/// (`template <int Deferred = 0>`) and are called as plain functions: the caching engine they create is then compiled
/// only in the translation units that call one of them, not in every one that includes this header (parsing
/// gpukit.hpp costs about 40 % less; see "Compile time" in the README).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_config.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/out_of_memory.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

namespace detail {

struct default_allocator_registry;

/// Never destroyed: allocators must outlive every buffer, including those destroyed during static destruction.
GPUKIT_EXPORT GPUKIT_INLINE default_allocator_registry& default_allocators();

GPUKIT_INLINE int default_allocator_slot(device d) noexcept;

}  // namespace detail

namespace detail {
/// The default allocator of `d` when it exists (the lock-free read), else nullptr.
GPUKIT_INLINE device_allocator* existing_default_allocator(device d) noexcept;

/// Publishes the allocator of `d` for lock-free reads (the registry's lock held).
GPUKIT_INLINE void publish_default_allocator(default_allocator_registry& registry, device d,
                                             device_allocator* a) noexcept;

/// Creates the default allocator of `d` (a caching_allocator with the options set for `d`, else those of the
/// environment) unless another thread did first; default_allocator's slow path. A template, so that header-only
/// translation units compile the engine only where they call it.
template <int Deferred>
device_allocator& create_default_allocator(device d);
#if defined(GPUKIT_SEPARATE_COMPILATION)
/// The same, compiled into gpukit::compiled: compiled-mode translation units neither parse nor instantiate it.
GPUKIT_INLINE device_allocator& create_default_allocator_compiled(device d);
#endif
}  // namespace detail

/// The default allocator of `d` (a caching_allocator unless replaced), created on first use. Called as
/// `default_allocator(d)`; `Deferred` only defers compiling the engine (see the top of this header). Throws
/// invalid_argument_error for a GPU that is not visible (so do the free functions below that use it).
template <int Deferred = 0>
device_allocator& default_allocator(device d) {
  if (device_allocator* a = detail::existing_default_allocator(d)) return *a;
#if GPUKIT_DETAIL_DEFINITIONS
  return detail::create_default_allocator<Deferred>(d);
#else
  return detail::create_default_allocator_compiled(d);  // the engine is not even named here
#endif
}

/// Makes `allocator` the default of `d` and returns the previous one (nullptr if none was created yet). Buffers,
/// resources and thrust allocators made from the previous allocator still use it, so keep it alive until they are
/// gone (and until no other thread may still be using it as the default): dropping the result destroys it. Its
/// out-of-memory observers stay with it, called on its own errors: remove them through the result (the free
/// remove_out_of_memory_observer(id, d) asks the new default, where their ids match nothing), and add them to the
/// new allocator if they should follow. Passing nullptr makes the next use create a fresh caching_allocator. Throws
/// invalid_argument_error if `allocator` serves another device.
[[nodiscard]] GPUKIT_INLINE std::shared_ptr<device_allocator> set_default_allocator(
    device d, std::shared_ptr<device_allocator> allocator);

/// Sets the options the default allocator of `d` is created with (e.g. from a configuration file), in place of
/// those of GPUKIT_ALLOC_CONF (which the others are created with; see allocator_config.hpp). Takes effect only if
/// that allocator has not been created yet; returns whether it did.
GPUKIT_INLINE bool set_default_allocator_options(device d, const allocator_options& options);

/// Bytes handed out by the default allocator of `d` (torch.cuda.memory_allocated).
template <int Deferred = 0>
std::size_t memory_allocated(device d) {
  return default_allocator(d).memory_allocated();
}
/// Bytes the default allocator of `d` holds from the device (torch.cuda.memory_reserved).
template <int Deferred = 0>
std::size_t memory_reserved(device d) {
  return default_allocator(d).memory_reserved();
}
/// Peak of memory_allocated(d) since the last reset_peak_memory_stats(d).
template <int Deferred = 0>
std::size_t max_memory_allocated(device d) {
  return default_allocator(d).max_memory_allocated();
}
/// Peak of memory_reserved(d) since the last reset_peak_memory_stats(d).
template <int Deferred = 0>
std::size_t max_memory_reserved(device d) {
  return default_allocator(d).max_memory_reserved();
}
/// The statistics as torch.cuda.memory_stats() returns them: a flat map, sorted by key, from
/// "<statistic>.<pool>.<metric>" (statistic: allocation, segment, active, inactive_split, allocated_bytes,
/// reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes; pool: all, small_pool, large_pool; metric:
/// current, peak, allocated, freed) and the counters num_alloc_retries, num_ooms, num_sync_all_streams,
/// num_device_alloc and num_device_free to values, so code and dashboards written for PyTorch read gpukit's
/// numbers unchanged. gpukit adds num_device_free_unforced and num_lock_waits; PyTorch's oversize_* keys are not kept.
GPUKIT_INLINE std::map<std::string, std::int64_t> flat_memory_stats(const allocator_stats& s);

/// Every statistic of the default allocator of `d` (torch.cuda.memory_stats).
template <int Deferred = 0>
allocator_stats memory_stats(device d) {
  return default_allocator(d).stats();
}
/// The same as torch.cuda.memory_stats()'s flat key → value map ("allocated_bytes.all.current", …).
template <int Deferred = 0>
std::map<std::string, std::int64_t> memory_stats_map(device d) {
  return flat_memory_stats(memory_stats(d));
}
/// Segments and blocks of the default allocator of `d` (torch.cuda.memory_snapshot).
template <int Deferred = 0>
allocator_snapshot memory_snapshot(device d) {
  return default_allocator(d).snapshot();
}
/// The statistics table of the default allocator of `d` (torch.cuda.memory_summary), with fragmentation.
template <int Deferred = 0>
std::string memory_summary(device d) {
  return default_allocator(d).memory_summary();
}
/// Returns the free cached memory of `d`'s default allocator to the device (torch.cuda.empty_cache).
template <int Deferred = 0>
void empty_cache(device d) {
  default_allocator(d).empty_cache();
}
/// Starts new peaks for `d`'s default allocator.
template <int Deferred = 0>
void reset_peak_memory_stats(device d) {
  default_allocator(d).reset_peak_stats();
}
/// Zeroes the cumulative totals and counters of `d`'s default allocator.
template <int Deferred = 0>
void reset_accumulated_memory_stats(device d) {
  default_allocator(d).reset_accumulated_stats();
}
/// Caps the memory `d`'s default allocator may reserve, as a fraction of the device's total memory.
template <int Deferred = 0>
void set_per_device_memory_fraction(double fraction, device d) {
  default_allocator(d).set_memory_fraction(fraction);
}
/// Calls `observer` before every out-of-memory error of `d`'s default allocator (see
/// basic_caching_allocator::add_out_of_memory_observer); returns an id for remove_out_of_memory_observer.
template <int Deferred = 0>
std::uint64_t add_out_of_memory_observer(out_of_memory_observer observer, device d) {
  return default_allocator(d).add_out_of_memory_observer(std::move(observer));
}
/// Removes an observer of `d`'s default allocator; false when none has that id.
template <int Deferred = 0>
bool remove_out_of_memory_observer(std::uint64_t id, device d) {
  return default_allocator(d).remove_out_of_memory_observer(id);
}
/// Caps the memory `d`'s default allocator may reserve, in bytes.
template <int Deferred = 0>
void set_reserved_memory_limit(std::size_t bytes, device d) {
  default_allocator(d).set_reserved_limit(bytes);
}
/// Starts recording what `d`'s default allocator does into a new history of at most `max_entries` events (like
/// torch.cuda.memory._record_memory_history) and returns it; stop_memory_history(d) stops. The allocator keeps every
/// history it was given alive for as long as it lives (the process, for a default allocator: a call on another
/// thread may still be recording into one): to record step after step, keep one history and clear() it rather than
/// making a new one each time.
template <int Deferred = 0>
std::shared_ptr<memory_history> record_memory_history(device d, std::size_t max_entries = 100000) {
  auto history = std::make_shared<memory_history>(max_entries);
  default_allocator(d).set_memory_history(history);
  return history;
}
/// Stops recording the history of `d`'s default allocator (the history keeps what it holds).
template <int Deferred = 0>
void stop_memory_history(device d) {
  default_allocator(d).set_memory_history(nullptr);
}

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// What default_allocator and set_default_allocator share, behind default_allocators().
struct default_allocator_registry {
  static constexpr int fast_slots = 65;  // cpu, cuda:0 .. cuda:63 without a lock
  std::mutex mutex;
  std::array<std::atomic<device_allocator*>, fast_slots> fast{};
  std::map<device, std::shared_ptr<device_allocator>> owners;
  std::map<device, allocator_options> options;
};

template <int Deferred>
device_allocator& create_default_allocator(device d) {
  auto& registry = default_allocators();
  std::lock_guard<std::mutex> lock(registry.mutex);
  // A GPU that is not visible is refused before anything is made for it: its statistics would read 0 and its limits
  // apply nowhere (torch.cuda.memory_allocated(5) on two GPUs raises too).
  detail::require_visible(d, "gpukit::default_allocator");
  auto& owner = registry.owners[d];
  if (!owner) {
    const auto configured = registry.options.find(d);
    allocator_options o;
    if (configured != registry.options.end()) {
      o = configured->second;
    } else {
      o = allocator_options_from_environment();
      if (!d.is_cuda()) {
        // GPUKIT_ALLOC_CONF's expandable segments are the GPUs' (as PYTORCH_CUDA_ALLOC_CONF's): host memory has none.
        o.expandable_segments = false;
        o.expandable_segments_required = false;
      }
    }
    owner = std::make_shared<caching_allocator>(d, o);
  }
  publish_default_allocator(registry, d, owner.get());
  return *owner;
}

#if defined(GPUKIT_SEPARATE_COMPILATION)
GPUKIT_INLINE device_allocator& create_default_allocator_compiled(device d) { return create_default_allocator<0>(d); }
#endif

GPUKIT_INLINE default_allocator_registry& default_allocators() {
  static default_allocator_registry* registry = new default_allocator_registry();
  return *registry;
}

/// The fast slot of `d`: 0 for the CPU, ordinal + 1 for a GPU, fast_slots (none) for ordinals past them (up to
/// INT_MAX, which device::cuda accepts: no `ordinal + 1` overflow).
GPUKIT_INLINE int default_allocator_slot(device d) noexcept {
  if (d.is_cpu()) return 0;
  return d.ordinal() < default_allocator_registry::fast_slots - 1 ? d.ordinal() + 1
                                                                  : default_allocator_registry::fast_slots;
}

GPUKIT_INLINE device_allocator* existing_default_allocator(device d) noexcept {
  const int slot = default_allocator_slot(d);
  if (slot >= default_allocator_registry::fast_slots) return nullptr;
  return default_allocators().fast[static_cast<std::size_t>(slot)].load(std::memory_order_acquire);
}

GPUKIT_INLINE void publish_default_allocator(default_allocator_registry& registry, device d,
                                             device_allocator* a) noexcept {
  const int slot = default_allocator_slot(d);
  if (slot < default_allocator_registry::fast_slots) {
    registry.fast[static_cast<std::size_t>(slot)].store(a, std::memory_order_release);
  }
}
}  // namespace detail

GPUKIT_INLINE std::shared_ptr<device_allocator> set_default_allocator(device d,
                                                                      std::shared_ptr<device_allocator> allocator) {
  if (allocator && allocator->device() != d) {
    throw invalid_argument_error("gpukit::set_default_allocator: the allocator serves " +
                                 allocator->device().to_string() + ", not " + d.to_string());
  }
  auto& registry = detail::default_allocators();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& owner = registry.owners[d];
  std::swap(owner, allocator);
  detail::publish_default_allocator(registry, d, owner.get());
  return allocator;
}

GPUKIT_INLINE bool set_default_allocator_options(device d, const allocator_options& options) {
  options.validate();
  auto& registry = detail::default_allocators();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.options[d] = options;
  const auto existing = registry.owners.find(d);
  return existing == registry.owners.end() || !existing->second;
}

GPUKIT_INLINE std::map<std::string, std::int64_t> flat_memory_stats(const allocator_stats& s) {
  std::map<std::string, std::int64_t> flat;
  const std::pair<const char*, const pool_stats*> groups[] = {{"allocation", &s.allocation},
                                                              {"segment", &s.segment},
                                                              {"active", &s.active},
                                                              {"inactive_split", &s.inactive_split},
                                                              {"allocated_bytes", &s.allocated_bytes},
                                                              {"reserved_bytes", &s.reserved_bytes},
                                                              {"active_bytes", &s.active_bytes},
                                                              {"inactive_split_bytes", &s.inactive_split_bytes},
                                                              {"requested_bytes", &s.requested_bytes}};
  const char* const pools[] = {"all", "small_pool", "large_pool"};
  for (const auto& [name, group] : groups) {
    for (std::size_t pool = 0; pool < 3; ++pool) {
      detail::add_flat_stat(flat, std::string(name) + "." + pools[pool] + ".", group->pools[pool]);
    }
  }
  flat["num_alloc_retries"] = s.num_alloc_retries;
  flat["num_ooms"] = s.num_ooms;
  flat["num_sync_all_streams"] = s.num_sync_all_streams;
  flat["num_device_alloc"] = s.num_device_alloc;
  flat["num_device_free"] = s.num_device_free;
  flat["num_device_free_unforced"] = s.num_device_free_unforced;
  flat["num_lock_waits"] = s.num_lock_waits;
  return flat;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
