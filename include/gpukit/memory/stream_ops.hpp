// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The stream and event operations the caching allocator needs, as a policy type, so the engine does not depend on
/// CUDA: gpukit::stream_ops uses gpukit::stream_view and gpukit::event, which work for CUDA devices and for the CPU
/// (whose streams are real asynchronous queues). Tests may plug in a deterministic fake with the same members:
///
///     using stream_type = ...;   // copyable handle; the allocator keeps a copy per stream it has seen
///     using event_type = ...;    // movable; the allocator pools them
///     std::uintptr_t key(const stream_type&) const noexcept;     // identity of a stream (equal views, equal keys)
///     gpukit::device device_of(const stream_type&) const;        // checked once per stream, on first use
///     event_type create_event(gpukit::device) const;
///     void record(event_type&, const stream_type&) const;        // captures the work enqueued so far
///     bool ready(const event_type&) const;                       // polled at allocation
///     void synchronize(const event_type&) const;                 // host wait (release paths only)
///     void wait(const event_type&, const stream_type&) const;    // stream wait, no host wait (cross-stream reuse)
///     bool may_have_pending_work(const stream_type&) const;      // false lets the allocator skip an event

#include <gpukit/device/device.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstdint>

namespace gpukit {

/// gpukit's streams and events (CUDA and CPU).
struct stream_ops {
  using stream_type = stream_view;
  using event_type = event;

  /// A CUDA stream is identified by its handle, a CPU stream by its queue; default streams have key 0 (an
  /// allocator serves one device, so that is unambiguous).
  std::uintptr_t key(const stream_view& s) const noexcept {
    if (s.cpu_queue() != nullptr) return reinterpret_cast<std::uintptr_t>(s.cpu_queue());
    return reinterpret_cast<std::uintptr_t>(s.native_handle());
  }
  gpukit::device device_of(const stream_view& s) const { return s.device(); }
  /// Without timing: cheaper to record and query.
  event create_event(gpukit::device d) const { return event(d, event_options{}); }
  void record(event& e, const stream_view& s) const { e.record(s); }
  bool ready(const event& e) const { return e.ready(); }
  void synchronize(const event& e) const { e.synchronize(); }
  void wait(const event& e, const stream_view& s) const { e.wait(s); }
  /// The CPU's default stream runs work synchronously and an idle CPU queue has none left, so memory freed on them
  /// is unused at once; a CUDA stream cannot be asked cheaply, so it is assumed busy.
  bool may_have_pending_work(const stream_view& s) const {
    if (s.is_cpu()) return s.cpu_queue() != nullptr && !s.cpu_queue()->idle();
    return true;
  }
};

}  // namespace gpukit
