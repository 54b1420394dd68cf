// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Events: a point in a stream's work that can be queried, waited for on the host, waited for by another stream,
/// and timed. An event belongs to a device and is recorded on streams of that device. On the CPU device an event
/// completes when the work enqueued before its record has completed, exactly like a CUDA event.
///
/// Like CUDA events, the state that query/synchronize/wait observe is that of the most recent record(); an event
/// never recorded counts as complete. Each operation chooses its backend once (detail/cpu_backend.hpp or
/// detail/cuda_backend.hpp); this file makes no CUDA call of its own.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/detail/cpu_backend.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Outside the per-mode namespace (detail/config.hpp), as stream.hpp's counters: a capture begun in code built in one
// default-stream mode may be forked by events of code built in the other.
namespace gpukit {
namespace mode_independent {

/// The gpukit::capture calls underway, by capture id (cudaStreamGetCaptureInfo), with the devices into whose blocking
/// streams each was forked by event::wait: a capture of a non-blocking stream forked into a blocking one is joined by
/// any work on the legacy default stream of that stream's device, so that device counts in
/// gpukit_blocking_captures_underway until the capture ends, as for a capture of a blocking stream.
struct gpukit_capture_table {
  /// A capture underway (ordinal -1), or a device counted for one of its forks.
  struct entry {
    unsigned long long capture;  ///< the capture's id
    int ordinal;                 ///< -1: the capture itself; else a device counted for a fork into it
    std::thread::id thread;      ///< the capturing thread (whose gpukit_blocking_captures_on_this_thread a fork
                                 ///< made there also counts in)
  };
  std::mutex mutex;            ///< guards entries
  std::vector<entry> entries;  ///< the captures underway and their counted forks
};

/// The process's gpukit_capture_table (exported: one per process). Never destroyed, like stream_table_v1.
GPUKIT_EXPORT inline gpukit_capture_table& gpukit_capture_table_v1() noexcept {
  alignas(gpukit_capture_table) static unsigned char storage[sizeof(gpukit_capture_table)];
  static gpukit_capture_table* const table = ::new (static_cast<void*>(storage)) gpukit_capture_table;
  return *table;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

/// How to create an event.
struct event_options {
  bool timing = false;         ///< record timestamps (needed by elapsed_time); off makes record/query cheaper
  bool blocking_sync = false;  ///< synchronize() sleeps instead of spinning (cudaEventBlockingSync)
  bool interprocess = false;   ///< shareable with other processes (cudaEventInterprocess; CUDA only, no timing)
};

/// Milliseconds, as CUDA reports elapsed time between events.
using milliseconds = std::chrono::duration<float, std::milli>;

namespace detail {
/// Called by gpukit::capture once capture `id` has begun on the calling thread, so that event::wait can count its
/// forks into blocking streams (count_blocking_fork). Throws std::bad_alloc.
GPUKIT_INLINE void register_gpukit_capture(unsigned long long id);

/// Called by gpukit::capture once capture `id` has ended: uncounts the devices its forks counted.
GPUKIT_INLINE void forget_gpukit_capture(unsigned long long id) noexcept;

/// Before `s` waits for an event recorded in capture `capture` (a fork, unless `s` takes part already): if that is a
/// gpukit capture and `s` synchronizes with the legacy default stream, counts s's device as having a blocking capture
/// (once per capture and device) and waits for the legacy-stream holds taken before, as gpukit::capture does for a
/// blocking stream: a query of or a record on that legacy stream would join the capture and invalidate it.
GPUKIT_INLINE void count_blocking_fork(unsigned long long capture, const stream_view& s);

/// Whether capture `id` is a gpukit::capture still underway (registered and not yet forgotten).
GPUKIT_INLINE bool gpukit_capture_active(unsigned long long id);

}  // namespace detail

/// An owning, move-only event. A moved-from event throws invalid_argument_error on use.
class event {
 public:
  /// Creates an event on `d`. Throws invalid_argument_error for interprocess events with timing or on the CPU.
  explicit event(gpukit::device d, event_options options = {});

  /// Takes over `other`'s event; `other` becomes moved-from.
  event(event&& other) noexcept;
  /// Destroys the event held (as ~event does), then takes over `other`'s; `other` becomes moved-from.
  event& operator=(event&& other) noexcept;
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  /// Never throws: a failure goes to gpukit::warn, except the results of a runtime torn down at process exit
  /// (detail::is_teardown_result), which are expected.
  ~event();

  /// Captures the work enqueued on `s` so far. `s` must belong to this event's device (invalid_argument_error
  /// otherwise, naming both devices). On a stream being captured into a CUDA graph the record becomes part of the
  /// capture: that is how captured work forks to another stream (which then waits for the event) and joins back.
  /// Such an event has completed only inside the graph: ready() and synchronize() then fail with
  /// cudaErrorCapturedEvent until it is recorded again outside a capture. Record timing events outside captures.
  /// On the legacy default stream it throws invalid_argument_error, recording nothing, while a blocking stream of its
  /// device is captured (the record would join that capture and invalidate it), as stream_view::synchronize does.
  void record(stream_view s);

  /// True when the work captured by the most recent record() has completed (or the event was never recorded). A
  /// pending CUDA error of the program stays pending: cudaErrorNotReady is a status, not an error, and is cleared
  /// only if the runtime recorded it as the last error (detail::forget_not_ready).
  [[nodiscard]] bool ready() const;

  /// Blocks the calling thread until the captured work has completed.
  void synchronize() const;

  /// Makes all work enqueued on `s` after this call wait until the captured work has completed, without blocking
  /// the host (cudaStreamWaitEvent). `s` may belong to another CUDA device; a CPU event can only be waited for by
  /// CPU streams (and a CUDA event only by CUDA streams). On the legacy default stream it throws as record() does,
  /// and also (invalid_argument_error, waiting for nothing) when the event was last recorded in a gpukit::capture
  /// still underway: CUDA never captures the legacy stream, so it cannot join the capture as a fork (the wait would
  /// fail and invalidate the capture). An event recorded in a capture begun without gpukit::capture is not known:
  /// CUDA refuses that wait (gpukit throws its cuda_error).
  ///
  /// Captures: while a capture runs, a stream outside it that waits for an event last recorded in it joins it (a
  /// fork; join it back before the capture ends). Once that capture has ended the event belongs to its graph: a
  /// wait fails with cudaErrorStreamCaptureIsolation (the simulator's model, not yet measured on a GPU) until the
  /// event is recorded again outside a capture, and so
  /// does a wait by a stream being captured for an event recorded outside its capture (which is invalidated). A fork
  /// of a gpukit::capture into a stream that synchronizes with the legacy default stream (created without
  /// non_blocking, or a per-thread default stream) makes the capture a blocking one from then on: gpukit's calls on
  /// that device's legacy stream are refused until it ends, as for a capture of such a stream. A fork made with
  /// cudaStreamWaitEvent directly, or of a capture begun without gpukit::capture, is not seen.
  void wait(stream_view s) const;

  /// The device the event belongs to. Throws invalid_argument_error if this event was moved from.
  gpukit::device device() const;
  /// The options the event was created with.
  const event_options& options() const noexcept;
  /// False once moved from.
  bool valid() const noexcept;

  /// The CUDA handle. Throws invalid_argument_error for a CPU event.
  cudaEvent_t cuda_handle() const;

  /// A handle another process can open with cudaIpcOpenEventHandle. Throws invalid_argument_error for an event not
  /// created with interprocess, and for a moved-from one.
  cudaIpcEventHandle_t ipc_handle() const;

  /// Time between the completion of `start`'s and `end`'s most recent records. Waits for both to complete. Both
  /// must have been created with timing, recorded, and belong to the same device (invalid_argument_error otherwise).
  friend milliseconds elapsed_time(const event& start, const event& end) {
    start.check_valid("elapsed_time");
    end.check_valid("elapsed_time");
    if (!start.options_.timing || !end.options_.timing) {
      const char* which = !start.options_.timing
                              ? (!end.options_.timing ? "neither event was" : "the start event was not")
                              : "the end event was not";
      throw invalid_argument_error(std::string("gpukit::elapsed_time: ") + which +
                                   " created with event_options::timing (both must be)");
    }
    if (start.device_ != end.device_) {
      throw invalid_argument_error("gpukit::elapsed_time: the events belong to different devices (" +
                                   start.device_.to_string() + ", " + end.device_.to_string() + ")");
    }
    if (start.cpu_) return std::chrono::duration_cast<milliseconds>(elapsed(*start.cpu_, *end.cpu_));
    start.synchronize();
    end.synchronize();
    return milliseconds(detail::cuda_backend::elapsed_ms(start.cuda_, end.cuda_, start.device_.ordinal()));
  }

 private:
  void check_valid(const char* what) const;

  void take(event& other) noexcept;

  void destroy() noexcept;

  gpukit::device device_{};
  event_options options_{};
  cudaEvent_t cuda_ = nullptr;
  std::unique_ptr<detail::cpu_backend::event_state> cpu_;
  // The capture the last record() was made in (its id; 0: none, or no gpukit capture was underway): wait() counts a
  // fork of it into a blocking stream. Atomic: one thread may record while another waits.
  std::atomic<unsigned long long> capture_{0};
  bool valid_ = false;
};

/// Time between two events' most recent records (see event's friend of the same name; declared here so that
/// `gpukit::elapsed_time(a, b)` finds it).
milliseconds elapsed_time(const event& start, const event& end);

/// Times a region of work on a stream: records a start event when constructed and an end event at stop().
/// `elapsed()` waits for the end and returns the time between them (the stream's time, not the host's).
///
///     gpukit::stream_timer timer(s);
///     launch_work(s);
///     std::printf("%.3f ms\n", timer.elapsed().count());
class stream_timer {
 public:
  /// Creates two timing events on `s`'s device and records the start on `s`. The stream must outlive the timer. The
  /// view is resolved (stream_view::resolved): a timer on the calling thread's per-thread default stream times that
  /// stream even when stopped from another thread, which is refused (invalid_argument_error) since that thread
  /// cannot name it. A stream being captured is refused too (invalid_argument_error): events recorded in a capture
  /// belong to the graph, and elapsed() could never read them (time the graph's launch instead).
  explicit stream_timer(stream_view s);

  /// Marks the end of the region (again, if called twice: the later call wins). Refused, as at construction, while
  /// the stream is being captured.
  void stop();

  /// Stops the timer if needed, waits for the region to finish, and returns its duration.
  milliseconds elapsed();

 private:
  stream_view stream_;
  event start_;
  event end_;
  bool stopped_ = false;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE event::event(gpukit::device d, event_options options) : device_(d), options_(options), valid_(true) {
  if (options.interprocess && options.timing) {
    throw invalid_argument_error(
        "gpukit::event: an interprocess event cannot record timing (CUDA requires "
        "cudaEventDisableTiming with cudaEventInterprocess)");
  }
  if (d.is_cpu()) {
    if (options.interprocess) {
      throw invalid_argument_error("gpukit::event: interprocess events exist only on CUDA devices");
    }
    cpu_ = std::make_unique<detail::cpu_backend::event_state>();
    return;
  }
  unsigned flags = cudaEventDefault;
  if (!options.timing) flags |= cudaEventDisableTiming;
  if (options.blocking_sync) flags |= cudaEventBlockingSync;
  if (options.interprocess) flags |= cudaEventInterprocess;
  cuda_ = detail::cuda_backend::create_event(d.ordinal(), flags);
}

GPUKIT_INLINE event::event(event&& other) noexcept { take(other); }

GPUKIT_INLINE event& event::operator=(event&& other) noexcept {
  if (this != &other) {
    destroy();
    take(other);
  }
  return *this;
}

GPUKIT_INLINE event::~event() { destroy(); }

GPUKIT_INLINE void event::record(stream_view s) {
  check_valid("record");
  const gpukit::device stream_device = s.device();
  if (stream_device != device_) {
    throw invalid_argument_error("gpukit::event::record: the event belongs to " + device_.to_string() +
                                 " but the stream to " + stream_device.to_string());
  }
  if (cpu_) return cpu_->record(s.cpu_queue());
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("event::record");
  if (s.is_default() && !s.is_per_thread()) {
    // Under the hold, as stream_view::synchronize's record: no gpukit capture of a blocking stream begins meanwhile.
    const detail::legacy_stream_hold hold(device_.ordinal(), true);
    detail::refuse_legacy_stream_join("event::record", s, hold.refused());
    detail::cuda_backend::record_event(cuda_, device_.ordinal(), s.native_handle());
    capture_.store(0, std::memory_order_relaxed);  // CUDA never captures the legacy stream
    return;
  }
  detail::cuda_backend::record_event(cuda_, device_.ordinal(), s.native_handle());
  unsigned long long capture = 0;
  if (detail::gpukit_capture_underway()) {  // else one atomic load: only a gpukit capture's forks are counted
    try {
      capture = detail::capture_id(s);
    } catch (const std::exception&) {  // recorded: a fork of it then goes uncounted, as a raw capture's
    }
  }
  capture_.store(capture, std::memory_order_relaxed);
}

GPUKIT_INLINE bool event::ready() const {
  check_valid("ready");
  if (cpu_) return cpu_->ready();
  return detail::cuda_backend::event_ready(cuda_, device_.ordinal());
}

GPUKIT_INLINE void event::synchronize() const {
  check_valid("synchronize");
  if (cpu_) return cpu_->synchronize();
  detail::cuda_backend::synchronize_event(cuda_, device_.ordinal());
}

GPUKIT_INLINE void event::wait(stream_view s) const {
  check_valid("wait");
  if (cpu_) {
    if (!s.is_cpu()) {
      throw invalid_argument_error("gpukit::event::wait: a CUDA stream cannot wait for an event of the CPU");
    }
    return cpu_->wait(s.cpu_queue());
  }
  if (s.is_cpu()) {
    throw invalid_argument_error("gpukit::event::wait: a CPU stream cannot wait for an event of " +
                                 device_.to_string() + "; synchronize() the event instead");
  }
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("event::wait");
  if (s.is_default() && !s.is_per_thread()) {
    const unsigned long long recorded_in = capture_.load(std::memory_order_relaxed);
    if (recorded_in != 0 && detail::gpukit_capture_active(recorded_in)) {
      throw invalid_argument_error(
          "gpukit::event::wait: the legacy default stream of " + s.device().to_string() +
          " cannot wait for an event last recorded in a capture still underway (capture " +
          std::to_string(recorded_in) +
          "): CUDA never captures the legacy default stream, so it cannot join the capture as a fork, and the wait "
          "would invalidate it (nothing was done). Wait on another stream, which joins the capture, or record the "
          "event again outside a capture");
    }
    const detail::legacy_stream_hold hold(s.device().ordinal(), true);  // as record()
    detail::refuse_legacy_stream_join("event::wait", s, hold.refused());
    detail::cuda_backend::wait_event(s.cuda_target(), cuda_, device_.ordinal());
    return;
  }
  const unsigned long long capture = capture_.load(std::memory_order_relaxed);
  if (capture != 0) detail::count_blocking_fork(capture, s);  // before the wait that forks
  detail::cuda_backend::wait_event(s.cuda_target(), cuda_, device_.ordinal());
}

GPUKIT_INLINE gpukit::device event::device() const {
  check_valid("device");
  return device_;
}

GPUKIT_INLINE const event_options& event::options() const noexcept { return options_; }

GPUKIT_INLINE bool event::valid() const noexcept { return valid_; }

GPUKIT_INLINE cudaEvent_t event::cuda_handle() const {
  check_valid("cuda_handle");
  if (cpu_) throw invalid_argument_error("gpukit::event::cuda_handle: this is an event of the CPU");
  return cuda_;
}

GPUKIT_INLINE cudaIpcEventHandle_t event::ipc_handle() const {
  check_valid("ipc_handle");  // first: a moved-from event keeps its options
  if (!options_.interprocess) {
    throw invalid_argument_error("gpukit::event::ipc_handle: the event was not created with interprocess = true");
  }
  return detail::cuda_backend::ipc_event_handle(cuda_, device_.ordinal());  // never a CPU event: refused at creation
}

GPUKIT_INLINE void event::check_valid(const char* what) const {
  if (!valid_) throw invalid_argument_error(std::string("gpukit::event::") + what + ": use of a moved-from event");
}

GPUKIT_INLINE void event::take(event& other) noexcept {
  device_ = other.device_;
  options_ = other.options_;
  cuda_ = std::exchange(other.cuda_, nullptr);
  cpu_ = std::move(other.cpu_);
  capture_.store(other.capture_.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
  valid_ = std::exchange(other.valid_, false);
}

GPUKIT_INLINE void event::destroy() noexcept {
  if (cuda_ != nullptr) {
    detail::cuda_backend::destroy_event(cuda_, device_.ordinal(), "cudaEventDestroy (in ~event)");
    cuda_ = nullptr;
  }
  cpu_.reset();
}

namespace detail {
/// Why stream_timer refuses a stream being captured.
inline constexpr const char* timer_in_capture =
    "events recorded in a capture belong to the graph, and the host can never read their times (elapsed() would fail "
    "with cudaErrorCapturedEvent): time the graph's launch instead (nothing was recorded)";
}  // namespace detail

GPUKIT_INLINE stream_timer::stream_timer(stream_view s)
    : stream_(s.resolved()),
      start_(stream_.device(), event_options{true, false, false}),
      end_(stream_.device(), event_options{true, false, false}) {
  if (!stream_.is_cpu()) detail::refuse_captured_stream("stream_timer", stream_, detail::timer_in_capture);
  start_.record(stream_);
}

GPUKIT_INLINE void stream_timer::stop() {
  // First: another thread's per-thread stream cannot be asked about (the question would name this thread's own).
  if (stream_.is_other_threads_stream()) detail::throw_other_threads_stream("stream_timer::stop");
  if (!stream_.is_cpu()) detail::refuse_captured_stream("stream_timer::stop", stream_, detail::timer_in_capture);
  end_.record(stream_);
  stopped_ = true;
}

GPUKIT_INLINE milliseconds stream_timer::elapsed() {
  if (!stopped_) stop();
  return elapsed_time(start_, end_);
}

namespace detail {

GPUKIT_INLINE void register_gpukit_capture(unsigned long long id) {
  mode_independent::gpukit_capture_table& table = mode_independent::gpukit_capture_table_v1();
  const std::lock_guard<std::mutex> lock(table.mutex);
  table.entries.push_back({id, -1, std::this_thread::get_id()});
}

GPUKIT_INLINE bool gpukit_capture_active(unsigned long long id) {
  mode_independent::gpukit_capture_table& table = mode_independent::gpukit_capture_table_v1();
  const std::lock_guard<std::mutex> lock(table.mutex);
  for (const auto& e : table.entries) {
    if (e.capture == id && e.ordinal < 0) return true;
  }
  return false;
}

GPUKIT_INLINE void forget_gpukit_capture(unsigned long long id) noexcept {
  mode_independent::gpukit_capture_table& table = mode_independent::gpukit_capture_table_v1();
  std::unique_lock<std::mutex> lock(table.mutex, std::defer_lock);
  try {
    lock.lock();
  } catch (...) {  // never seen; the entries stay (their counts refuse legacy-stream work: safe, not fatal)
    return;
  }
  auto& entries = table.entries;
  for (std::size_t i = 0; i < entries.size();) {
    const mode_independent::gpukit_capture_table::entry e = entries[i];
    if (e.capture != id) {
      ++i;
      continue;
    }
    if (e.ordinal >= 0) {
      // Called on the capturing thread (gpukit::capture's), whose count a fork made there raised.
      if (e.thread == std::this_thread::get_id())
        --mode_independent::gpukit_blocking_captures_on_this_thread(e.ordinal);
      mode_independent::gpukit_blocking_captures_begun(e.ordinal).fetch_sub(1, std::memory_order_acq_rel);
      mode_independent::gpukit_blocking_captures_underway(e.ordinal).fetch_sub(1, std::memory_order_acq_rel);
    }
    entries[i] = entries.back();
    entries.pop_back();
  }
}

GPUKIT_INLINE void count_blocking_fork(unsigned long long capture, const stream_view& s) {
  if (!gpukit_capture_underway()) return;
  if (!s.is_per_thread() && !cuda_backend::may_block_on_legacy_stream(s.native_handle())) return;
  try {
    // Already in this capture (a join back, a second wait): no fork. A raw stream being captured counts as blocking
    // above, since its flags cannot be asked then, and would keep the legacy stream refused for nothing.
    if (capture_id(s) == capture) return;
  } catch (const std::exception&) {  // cannot tell: counted, which refuses more than needed, never less
  }
  const int ordinal = s.device().ordinal();
  {
    mode_independent::gpukit_capture_table& table = mode_independent::gpukit_capture_table_v1();
    const std::lock_guard<std::mutex> lock(table.mutex);
    const mode_independent::gpukit_capture_table::entry* begun = nullptr;
    bool counted = false;  // by an earlier fork, whose wait below may still be under way
    for (const auto& e : table.entries) {
      if (e.capture != capture) continue;
      if (e.ordinal == ordinal) counted = true;
      if (e.ordinal < 0) begun = &e;
    }
    if (begun == nullptr) return;  // not a gpukit capture, or it ended
    if (!counted) {
      const bool capturing_thread = begun->thread == std::this_thread::get_id();
      table.entries.push_back({capture, ordinal, capturing_thread ? std::this_thread::get_id() : std::thread::id()});
      // Sequentially consistent, as gpukit::capture's counts: either a hold sees them, or this the hold. The capture
      // has begun: no capture hold to wait for.
      mode_independent::gpukit_blocking_captures_underway(ordinal).fetch_add(1, std::memory_order_seq_cst);
      mode_independent::gpukit_blocking_captures_begun(ordinal).fetch_add(1, std::memory_order_seq_cst);
      if (capturing_thread) ++mode_independent::gpukit_blocking_captures_on_this_thread(ordinal);
    }
  }
  // The holds taken before the count (this fork's or an earlier one's): a query already inside CUDA would join the
  // fork. Every fork waits, since the first may still be waiting.
  wait_for_no_holds(mode_independent::legacy_stream_holds(ordinal));
}

}  // namespace detail

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
