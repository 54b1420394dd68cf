// The process-wide objects of gpukit that tests/visibility compares between two shared libraries and the executable.
// Only objects that need no GPU: each is created on first use, here through its accessor.
#pragma once

#include <gpukit/gpukit.hpp>
#include <gpukit/device/peer_access.hpp>

#include <cstddef>

namespace gpukit_visibility {

inline constexpr const char* singleton_names[] = {
    "detail::warnings()",
    "detail::warning_sink_slot()",
    "detail::warning_handler_running_on_this_thread() (this thread's)",
    "detail::warnings_held_on_this_thread() (this thread's)",
    "detail::cuda_environment_at_init()",
    "mode_independent::cuda_environment_taken_v1()",
    "detail::visible_devices_warned()",
    "detail::device_properties_cache()",
    "nvml::instance()",
    "detail::current_streams() (this thread's)",
    "detail::inline_host_functions_state() (this thread's)",
    "detail::inline_host_functions_after_teardown() (this thread's)",
    "detail::default_stream_pools()",
    "default_stream_pool(cpu)",
    "detail::default_allocators()",
    "default_allocator(cpu)",
    "detail::shared_recycled_events()",
    "default_pinned_pool(cpu)",
    "default_staging_engine(cpu)",
    "detail::copy_workers::instance()",
    "detail::pointer_query_override()",
    "detail::capture_pools()",
    "detail::driver()",
    "mode_independent::peer_access_holders_v2()",
    "detail::over_aligned_addresses()",
    "mode_independent::gpukit_captures_underway()",
    "mode_independent::capture_holds()",
    "mode_independent::out_of_memory_observer_ids()",
    "mode_independent::out_of_memory_observer_calls_v3() (this thread's)",
    "mode_independent::gpukit_captures_on_this_thread() (this thread's)",
    "mode_independent::gpukit_blocking_captures_underway(0)",
    "mode_independent::gpukit_blocking_captures_on_this_thread(0) (this thread's)",
    "mode_independent::gpukit_blocking_captures_begun(0)",
    "mode_independent::legacy_stream_holds(0)",
    "mode_independent::gpukit_capture_table_v1()",
    "detail::stream_expirations()",
    "mode_independent::stream_table_v1()",
    "mode_independent::released_stream_table_v1()",
    "mode_independent::owned_stream_records_v1()",
};
inline constexpr std::size_t singleton_count = sizeof(singleton_names) / sizeof(singleton_names[0]);

struct singleton_addresses {
  const void* at[singleton_count];
};

namespace {
// Internal linkage: the executable and each library run their own copy, so the addresses are the ones that module's
// inline gpukit functions return.
singleton_addresses collect_singleton_addresses() {
  const auto cpu = gpukit::device::cpu();
  return singleton_addresses{{
      &gpukit::detail::warnings(),
      &gpukit::detail::warning_sink_slot(),
      &gpukit::detail::warning_handler_running_on_this_thread(),
      &gpukit::detail::warnings_held_on_this_thread(),
      &gpukit::detail::cuda_environment_at_init(),
      &gpukit::mode_independent::cuda_environment_taken_v1(),
      &gpukit::detail::visible_devices_warned(),
      &gpukit::detail::device_properties_cache(),
      &gpukit::nvml::instance(),
      gpukit::detail::current_streams(),
      gpukit::detail::inline_host_functions_state(),
      &gpukit::detail::inline_host_functions_after_teardown(),
      &gpukit::detail::default_stream_pools(),
      &gpukit::default_stream_pool(cpu),
      &gpukit::detail::default_allocators(),
      &gpukit::default_allocator(cpu),
      &gpukit::detail::shared_recycled_events(),
      &gpukit::default_pinned_pool(cpu),
      &gpukit::default_staging_engine(cpu),
      &gpukit::detail::copy_workers::instance(),
      &gpukit::detail::pointer_query_override(),
      &gpukit::detail::capture_pools(),
      &gpukit::detail::driver(),
      &gpukit::mode_independent::peer_access_holders_v2(),
      &gpukit::detail::over_aligned_addresses(),
      &gpukit::mode_independent::gpukit_captures_underway(),
      &gpukit::mode_independent::capture_holds(),
      &gpukit::mode_independent::out_of_memory_observer_ids(),
      &gpukit::mode_independent::out_of_memory_observer_calls_v3(),
      &gpukit::mode_independent::gpukit_captures_on_this_thread(),
      &gpukit::mode_independent::gpukit_blocking_captures_underway(0),
      &gpukit::mode_independent::gpukit_blocking_captures_on_this_thread(0),
      &gpukit::mode_independent::gpukit_blocking_captures_begun(0),
      &gpukit::mode_independent::legacy_stream_holds(0),
      &gpukit::mode_independent::gpukit_capture_table_v1(),
      &gpukit::detail::stream_expirations(),
      &gpukit::mode_independent::stream_table_v1(),
      &gpukit::mode_independent::released_stream_table_v1(),
      &gpukit::mode_independent::owned_stream_records_v1(),
  }};
}
}  // namespace

}  // namespace gpukit_visibility
