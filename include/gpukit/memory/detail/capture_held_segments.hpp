// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// detail::capture_held_segments: the segments an upstream holds back while a capture it can see runs. An upstream
/// whose fallback release waits for the whole device (cudaDeviceSynchronize) cannot run it then: the wait is refused
/// during any capture, in any mode and from any thread (measured on an H100), and invalidates that capture. Such an
/// upstream holds the segment here instead and gives it back with the next one after the captures end: while a
/// capture is in sight (detail::capture_in_sight: a gpukit capture, or a capture of a blocking stream of the
/// upstream's device, raw ones included). Used by async_pool_upstream and resource_upstream.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/memory/upstream.hpp>  // detail::wait_before_release
#include <gpukit/span.hpp>
#include <gpukit/stream/stream.hpp>  // detail::gpukit_capture_underway, detail::capture_in_sight

#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// A segment held back: its address and size, as the upstream's deallocate got them.
struct held_segment {
  void* pointer = nullptr;
  std::size_t bytes = 0;
};

/// The segments an upstream holds back during gpukit captures (see the file comment). Thread-safe. A copy holds
/// nothing (the segments stay with the upstream that holds them); a move takes them along.
class capture_held_segments {
 public:
  capture_held_segments() = default;
  capture_held_segments(const capture_held_segments&) noexcept {}
  capture_held_segments(capture_held_segments&& other) {
    std::lock_guard<std::mutex> lock(other.mutex_);
    held_.swap(other.held_);
  }
  capture_held_segments& operator=(const capture_held_segments&) = delete;
  capture_held_segments& operator=(capture_held_segments&&) = delete;

  /// An upstream's free of `segment`: held back if a capture in sight on `d` runs now (never when `may_hold` is
  /// false: the CPU), else given back now through `give_back` (called with a span of segments) together with the
  /// segments held so far. With no memory to hold it, given back too; with none to list them together, the held ones
  /// first, then it alone.
  template <class GiveBack>
  void hold_or_give_back(held_segment segment, gpukit::device d, bool may_hold, GiveBack&& give_back) noexcept {
    std::vector<held_segment> taken;
    if (may_hold) {
      const bool capturing = capture_in_sight(d);  // a CUDA call: not under the lock
      try {
        std::lock_guard<std::mutex> lock(mutex_);
        if (capturing) {
          held_.push_back(segment);
          return;
        }
        held_.swap(taken);
      } catch (...) {  // no lock or no room: given back now
      }
    }
    try {
      taken.push_back(segment);
    } catch (...) {
      give_back(span<const held_segment>(taken));
      give_back(span<const held_segment>(&segment, 1));
      return;
    }
    give_back(span<const held_segment>(taken));
  }

  /// The segments held, to give back now; none while a capture in sight on `d` runs.
  std::vector<held_segment> take_unless_capturing(gpukit::device d) noexcept {
    std::vector<held_segment> taken;
    try {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (held_.empty()) return taken;  // the common case: no CUDA call
      }
      if (capture_in_sight(d)) return taken;
      std::lock_guard<std::mutex> lock(mutex_);
      held_.swap(taken);
    } catch (...) {
    }
    return taken;
  }

  /// Holds `segments` back again: their release's device-wide wait met a capture (release_wait::kept_for_capture).
  /// Given back with the next segment after it. At the owner's destruction (`owner` not null) nothing can be held:
  /// the warning says that they stay allocated.
  void hold_again(span<const held_segment> segments, const char* owner = nullptr) noexcept {
    if (segments.empty()) return;
    if (owner == nullptr) {
      try {
        std::lock_guard<std::mutex> lock(mutex_);
        held_.insert(held_.end(), segments.begin(), segments.end());
        return;
      } catch (...) {  // no room: reported below
      }
    }
    warn_parts(owner != nullptr ? owner : "gpukit: an upstream", ": ", segments.size(),
               " segment(s) could not be given back during a capture (a device-wide wait would invalidate it); they "
               "stay allocated");
  }

  /// Waits for `d`'s work before `segments` go back (wait_before_release; `what` names the release): true when they
  /// may go back now. When the wait meets a capture they are held back again (hold_again, `owner` as there); when it
  /// fails otherwise they stay allocated (leaked), since the device may still use them.
  bool wait_before_giving_back(gpukit::device d, const char* what, span<const held_segment> segments,
                               const char* owner = nullptr) noexcept {
    const release_wait waited = wait_before_release(d, what);
    if (waited == release_wait::kept_for_capture) hold_again(segments, owner);
    return waited == release_wait::idle;
  }

  /// For the owner's destructor: the segments held, to give back now; none while a capture runs, when `owner`'s
  /// warning says that they stay allocated (a device-wide wait would invalidate the capture).
  std::vector<held_segment> take_at_destruction(const char* owner) noexcept {
    std::vector<held_segment> taken;
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      held_.swap(taken);
    } catch (...) {
    }
    if (taken.empty() || !gpukit_capture_underway()) return taken;
    warn_parts(owner, ": destroyed during a gpukit capture with ", taken.size(),
               " segment(s) held back since an earlier capture; they stay allocated");
    return {};
  }

 private:
  std::mutex mutex_;
  std::vector<held_segment> held_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
