// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Everything in gpukit but the opt-in headers. Each header below also compiles on its own; include only what you use
/// to save compile time. Layers, from the bottom: error → device → stream/event → memory → transfer → graph.
/// Opt-in (about 0.5 s of parsing together, g++ -O0): <gpukit/graph/graph.hpp> (CUDA graphs and graph pools) and
/// <gpukit/memory/async_allocator.hpp> (cudaMallocAsync); also <gpukit/stream/stream_ref.hpp> (CCCL interop),
/// <gpukit/memory/history_export.hpp> and <gpukit/memory/memory_picture.hpp> (memory history exports and picture),
/// <gpukit/device/gpu_monitor.hpp> (NVML monitoring) and <gpukit/device/peer_access.hpp> (peer access, topology):
/// together those two cost about 0.12 s of parsing (6 %) that most translation units do not need.

#include <gpukit/version.hpp>

#include <gpukit/error.hpp>
#include <gpukit/warning.hpp>
#include <gpukit/span.hpp>

#include <gpukit/device/device.hpp>
#include <gpukit/device/nvml.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/device/select.hpp>
#include <gpukit/device/visible_devices.hpp>

#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>

// memory (caching allocator, device buffers, pinned memory)
#include <gpukit/memory/allocator_config.hpp>
#include <gpukit/memory/allocator_options.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/allocator_stats.hpp>
#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/out_of_memory.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/memory/upstream.hpp>
// GPUKIT-MEMORY-INCLUDES

// transfer (copies, staging, prefetcher)
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/pinned_registration.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/parallel_copy.hpp>
#include <gpukit/transfer/pointer_query.hpp>
#include <gpukit/transfer/prefetcher.hpp>
#include <gpukit/transfer/spans.hpp>
#include <gpukit/transfer/staging.hpp>
#include <gpukit/transfer/to_device.hpp>
// GPUKIT-TRANSFER-INCLUDES
