// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The per-thread current stream of each device (as in PyTorch): the stream gpukit uses when a call is not given
/// one. Until set, it is the device's default stream. stream_guard sets it for a scope together with the current
/// device, and restores both.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/stream/stream.hpp>

#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
struct current_stream_entry;
/// This thread's current streams, one entry per device that has one set (a handful at most).
GPUKIT_EXPORT GPUKIT_INLINE std::vector<current_stream_entry>& current_streams();
}  // namespace detail

/// The calling thread's current stream of `d`: the last one set, else the device's default stream.
GPUKIT_INLINE stream_view current_stream(device d);

/// Makes `s` the calling thread's current stream of its device.
GPUKIT_INLINE void set_current_stream(stream_view s);

/// RAII: for its scope, makes `s` the current stream of its device and that device the current CUDA device (for a
/// CUDA stream); restores both afterwards. Not copyable or movable.
class stream_guard {
 public:
  /// Makes `s` and its device current until the guard is destroyed. Throws if the device cannot be found or made
  /// current.
  explicit stream_guard(stream_view s);
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard();

 private:
  device_guard device_guard_;  // first: restored last
  device device_;
  stream_view previous_;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

struct current_stream_entry {
  gpukit::device device;
  stream_view stream;
};

GPUKIT_INLINE std::vector<current_stream_entry>& current_streams() {
  thread_local std::vector<current_stream_entry> streams;
  return streams;
}
}  // namespace detail

GPUKIT_INLINE stream_view current_stream(device d) {
  for (const auto& entry : detail::current_streams()) {
    if (entry.device == d) return entry.stream;
  }
  return stream_view::default_stream(d);
}

GPUKIT_INLINE void set_current_stream(stream_view s) {
  const device d = s.device();
  for (auto& entry : detail::current_streams()) {
    if (entry.device == d) {
      entry.stream = s;
      return;
    }
  }
  detail::current_streams().push_back({d, s});
}

GPUKIT_INLINE stream_guard::stream_guard(stream_view s)
    : device_guard_(s.device()), device_(s.device()), previous_(current_stream(device_)) {
  set_current_stream(s);
}

GPUKIT_INLINE stream_guard::~stream_guard() {
  try {
    set_current_stream(previous_);
  } catch (...) {
    // set_current_stream can only fail allocating a new entry, and ours already exists.
  }
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
