// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Everything in gpukit. Each header below also compiles on its own; include only what you use to save compile
/// time. Layers, from the bottom: error → device → stream/event → memory → transfer.

#include <gpukit/version.hpp>

#include <gpukit/error.hpp>
#include <gpukit/span.hpp>

#include <gpukit/device/device.hpp>
#include <gpukit/device/nvml.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/device/select.hpp>
#include <gpukit/device/visible_devices.hpp>

#include <gpukit/stream/cpu_queue.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/stream/stream_pool.hpp>

// memory (caching allocator, device buffers, pinned memory)
// GPUKIT-MEMORY-INCLUDES

// transfer (copies, staging, prefetcher)
// GPUKIT-TRANSFER-INCLUDES
