// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CPU backend of streams and events: what gpukit::stream_view, gpukit::stream and gpukit::event do on the CPU
/// device, over the queues and markers of cpu_queue.hpp. A CPU stream is a queue (a worker thread runs its tasks in
/// order); the CPU's default stream has no queue (nullptr here) and runs each task at once on the calling thread.
/// A CPU event holds the marker of its latest record, so it completes when the work enqueued before that record has,
/// as a CUDA event does. stream.hpp and event.hpp choose between this backend and CUDA's (cuda_backend.hpp) once per
/// operation.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/detail/cpu_queue.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE
namespace detail {
namespace cpu_backend {

// --- streams (`queue`: the stream's queue, or nullptr for the CPU's default stream) ---

/// Blocks until the work enqueued on the stream has completed (the default stream never has any left).
GPUKIT_INLINE void synchronize(cpu_queue* queue);

/// Whether the work enqueued on the stream has completed. Never blocks.
GPUKIT_INLINE bool ready(const cpu_queue* queue) noexcept;

/// Runs `function` after the work enqueued so far: queued, or on the default stream at once (run_host_function says
/// what happens to a host function enqueued from inside one running inline).
template <class F>
void enqueue_host(cpu_queue* queue, F&& function) {
  if (queue != nullptr) {
    queue->enqueue(host_task(std::forward<F>(function)));
    return;
  }
  std::decay_t<F> f(std::forward<F>(function));
  run_host_function(f);
}

/// Enqueues a copy of `bytes` bytes (host memory on both sides): a task that copies, or on the default stream a copy
/// now.
GPUKIT_INLINE void copy_async(void* dst, const void* src, std::size_t bytes, cpu_queue* queue);

// --- events ---

/// A CPU event: the marker of its latest record (none until recorded, which counts as complete). Thread-safe.
class event_state {
 public:
  /// Captures the work enqueued on the stream so far.
  void record(cpu_queue* queue);
  /// Whether the captured work has completed. Never blocks.
  bool ready() const;
  /// Blocks until the captured work has completed. From a task of the stream recorded on, which that work includes,
  /// throws invalid_argument_error instead of waiting forever (cpu_marker::wait).
  void synchronize() const;
  /// Makes the work enqueued on the stream after this call wait for the captured work: a task that waits, or on the
  /// default stream (the calling thread) a wait now, refused as synchronize() is.
  void wait(cpu_queue* queue) const;
  /// The time between the completions of `start`'s and `end`'s latest records, once both are complete. Throws
  /// invalid_argument_error when either was never recorded.
  friend std::chrono::steady_clock::duration elapsed(const event_state& start, const event_state& end) {
    start.synchronize();
    end.synchronize();
    auto first = start.latest();
    auto second = end.latest();
    if (!first || !second) throw invalid_argument_error("gpukit::elapsed_time: both events must have been recorded");
    return second->completed_at() - first->completed_at();
  }

 private:
  std::shared_ptr<cpu_marker> latest() const;

  mutable std::mutex mutex_;
  std::shared_ptr<cpu_marker> last_;  // null until first recorded
};

}  // namespace cpu_backend
}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {
namespace cpu_backend {

GPUKIT_INLINE void synchronize(cpu_queue* queue) {
  if (queue != nullptr) queue->synchronize();
}

GPUKIT_INLINE bool ready(const cpu_queue* queue) noexcept { return queue == nullptr || queue->idle(); }

GPUKIT_INLINE void copy_async(void* dst, const void* src, std::size_t bytes, cpu_queue* queue) {
  enqueue_host(queue, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

GPUKIT_INLINE void event_state::record(cpu_queue* queue) {
  auto marker = queue != nullptr ? queue->record() : cpu_marker::completed();
  std::lock_guard<std::mutex> lock(mutex_);
  last_ = std::move(marker);
}

GPUKIT_INLINE bool event_state::ready() const {
  auto marker = latest();
  return !marker || marker->done();
}

GPUKIT_INLINE void event_state::synchronize() const {
  if (auto marker = latest()) marker->wait();
}

GPUKIT_INLINE void event_state::wait(cpu_queue* queue) const {
  auto marker = latest();
  if (!marker || marker->done()) return;
  if (queue != nullptr) {
    queue->enqueue([marker] { marker->wait(); });
  } else {
    marker->wait();
  }
}

GPUKIT_INLINE std::shared_ptr<cpu_marker> event_state::latest() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_;
}

}  // namespace cpu_backend
}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
