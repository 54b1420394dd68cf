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
///     std::uintptr_t key(const stream_type&) const;              // identity: no other stream, live or destroyed,
///                                                                // of any device, has the same key; any value
///                                                                // (0 too) but ~0, which means "no stream"
///     gpukit::device device_of(const stream_type&) const;        // checked on every call, before key()
///                                                                // (record_stream accepts other CUDA devices)
///     event_type create_event(gpukit::device) const;             // with that device current
///     void record(event_type&, const stream_type&) const;        // captures the work enqueued so far
///     bool ready(const event_type&) const;                       // polled at allocation
///     void synchronize(const event_type&) const;                 // host wait (release paths only)
///     void wait(const event_type&, const stream_type&) const;    // stream wait, no host wait (cross-stream reuse)
///     bool may_have_pending_work(const stream_type&) const;      // false lets the allocator skip an event
///
/// Optional (a fake without it is never captured):
///
///     bool capturing(const stream_type&) const;                  // being captured into a CUDA graph
///
/// Optional (without it no stream needs one): whether recording or waiting on a stream is work that a gpukit capture
/// begun meanwhile would not survive (the legacy default stream), so that it is done under a detail::capture_hold,
/// and deferred while a gpukit capture is underway:
///
///     bool needs_capture_hold(const stream_type&) const noexcept;
///
/// Optional, all or none (without them every stream is assumed to outlive the memory it is used with):
///
///     using tracker_type = ...;                                  // copyable; kept while the allocator knows a stream
///     tracker_type track(const stream_type&) const;              // at registration (may be empty: not tracked)
///     bool expired(const tracker_type&) const noexcept;          // the stream was destroyed
///     bool finished(const tracker_type&) const;                  // ... and its work has completed (polled)
///     void wait_finished(const tracker_type&) const;             // host wait for that (release paths only)
///     std::uint64_t expirations() const noexcept;                // changes whenever some stream may have expired
///
/// Optional: `stream_type resolve(const stream_type&) const` (the copy the allocator keeps) and
/// `std::string describe(const stream_type&) const` (for messages).

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

// ---------------------------------------------------------------------------------------------------------------
// CUDA graph capture. Memory handed out, freed or recorded on a stream that is being captured would belong to the
// graph (its launches reuse the addresses long after the allocator has given them to others), cudaMalloc/cudaFree
// are prohibited during a capture (and invalidate it), and an event recorded in a capture cannot be queried later
// (cudaErrorCapturedEvent). The engines refuse such operations before changing anything; captures given a graph
// pool (graph/graph.hpp, memory/graph_pool.hpp) are served by the pool instead.
// ---------------------------------------------------------------------------------------------------------------

namespace detail {

/// The capture status of `s` (cudaStreamIsCapturing; an invalidated capture is not None). CPU streams are never
/// captured and cost no CUDA call. Neither is the legacy default stream asked: it cannot be captured, and asking
/// about it while a blocking stream of its device is captured fails (cudaErrorStreamCaptureImplicit). A runtime that
/// is torn down (process exit) captures nothing. Other failures throw the matching gpukit exception.
GPUKIT_INLINE cudaStreamCaptureStatus capture_status(const stream_view& s);

/// Whether `s` (whose record is `life`, or nullptr) is being captured, asked while it is kept from destruction
/// (stream_life::keep_alive): another thread could destroy it after a look at expired(), and its handle be invalid
/// or a new stream's. A destroyed stream captures nothing. Never call it while another stream is kept: two threads
/// with their streams swapped would deadlock.
GPUKIT_INLINE bool captured_while_kept(const stream_view& s, const stream_life* life);

/// True when an event recorded on `s`, or a wait enqueued there, from this thread goes to the legacy default stream:
/// `s` is it, or another thread's per-thread default stream, for which it stands in (record_from_any_thread). Work on
/// the legacy stream while a blocking stream of its device is captured invalidates that capture
/// (cudaErrorStreamCaptureImplicit), so such work is enqueued under a capture_hold, or waits.
GPUKIT_INLINE bool uses_legacy_stream(const stream_view& s);
/// uses_legacy_stream(s), or true where that cannot be told (the first look-up of this thread's stream id failed).
GPUKIT_INLINE bool may_use_legacy_stream(const stream_view& s) noexcept;

/// Keeps gpukit captures (gpukit::capture, in any thread) from beginning while it lives, unless one is underway
/// already: refuses() then says which streams must not be used. Work on the legacy default stream is enqueued under
/// a hold that did not refuse it, since checking for captures and then enqueueing would let a capture begin in
/// between, and the work would invalidate it. Conservative: any gpukit capture counts, on any device and of any
/// stream, blocking or not. Two atomic operations, none when not `needed`. Held only around the enqueueing: never
/// through a host wait, a lock that such a wait may hold, or a user callback (gpukit::warn), since gpukit::capture
/// waits for the holds (wait_for_capture_holds) and the capturing thread may be what the wait waits for; release()
/// ends a hold before such a step.
class capture_hold {
 public:
  /// Holds captures off if `needed` (some stream the caller will use is the legacy one) and none is underway.
  explicit capture_hold(bool needed) noexcept {
    if (needed) take();
  }
  ~capture_hold() { release(); }
  capture_hold(const capture_hold&) = delete;
  capture_hold& operator=(const capture_hold&) = delete;

  /// True when a gpukit capture is underway and `s` uses the legacy stream (uses_legacy_stream): work for `s` must
  /// wait until the captures end, or be refused.
  bool refuses(const stream_view& s) const { return refused_ && uses_legacy_stream(s); }
  /// refuses(s), or `s` may use the legacy stream while a capture of a blocking stream of its device begun with the
  /// raw runtime holds it (legacy_stream_captured: one cudaStreamIsCapturing), which no hold keeps off: an event or
  /// wait for `s` must wait until the capture ends. For paths that can defer such work.
  bool refuses_or_raw_captured(const stream_view& s) const {
    return refuses(s) || (may_use_legacy_stream(s) && legacy_stream_captured(s.device()));
  }
  /// True when the hold was needed and a gpukit capture is underway.
  bool refused() const noexcept { return refused_; }
  /// True while captures wait for this hold (needed, not refused, not released).
  bool held() const noexcept { return held_; }
  /// Lets captures begin again, before a step that may wait (after the work it covers is enqueued).
  void release() noexcept {
    if (!held_) return;
    held_ = false;
    mode_independent::capture_holds().fetch_sub(1, std::memory_order_release);  // after the enqueueing
  }
  /// After release() (a host wait), before more work that may use the legacy stream if `needed`: holds captures off
  /// again, or is refused (refused() and refuses() say so) if a gpukit capture began meanwhile. True when the work
  /// may go on: held, or not needed.
  bool retake(bool needed) noexcept {
    if (held_ || !needed) return true;
    take();
    return held_;
  }

 private:
  void take() noexcept {
    std::atomic<std::int64_t>& holds = mode_independent::capture_holds();
    // Both sides use sequentially consistent operations, so that of this increment then load and the capture's
    // increment then load (wait_for_capture_holds), one at least sees the other's increment.
    holds.fetch_add(1, std::memory_order_seq_cst);
    refused_ = mode_independent::gpukit_captures_underway().load(std::memory_order_seq_cst) != 0;
    if (!refused_) {
      held_ = true;
      return;
    }
    holds.fetch_sub(1, std::memory_order_release);
  }

  bool held_ = false;
  bool refused_ = false;
};

/// Called by gpukit::capture once it counts itself (mode_independent::gpukit_captures_underway), before the capture
/// begins: waits for the capture_holds taken before, whose work on the legacy stream would invalidate it. Later holds
/// see the count and refuse, so the wait ends once the holders have enqueued their work.
GPUKIT_INLINE void wait_for_capture_holds() noexcept;

/// Called by gpukit::capture of a blocking stream of device `ordinal`, once counted
/// (gpukit_blocking_captures_underway), before the capture begins: waits for the legacy_stream_holds taken before (a
/// query of the device's legacy stream, or an event record on it, being made). Later ones are refused, so the wait
/// ends.
GPUKIT_INLINE void wait_for_legacy_stream_holds(int ordinal) noexcept;

/// A stream an engine keeps to order a later free, maybe from another thread and after the stream was destroyed: a
/// gpukit::stream is kept with its record (whether it was destroyed, and the event of its last work), since its
/// handle goes to the next stream created; a per-thread default stream with the calling thread's stream id
/// (stream_view::resolved), so that another thread can tell it is not its own.
struct kept_stream {
  stream_view view;
  std::shared_ptr<const stream_life> life;  // null for raw handles and default streams

  /// Keeps `s` (may look its id up, and throw).
  static kept_stream of(const stream_view& s);
  /// True once the gpukit::stream it was made from is destroyed: its handle may name another stream now.
  bool destroyed() const noexcept;
  /// The handle that names the stream in calls from this thread. Another thread's per-thread default stream cannot
  /// be named from this one (cudaStreamPerThread is the caller's own): the legacy default stream stands in for it,
  /// since its work waits for all earlier work of the blocking streams, per-thread ones included (and later work of
  /// theirs waits for it).
  cudaStream_t handle_here() const;
};

/// Records `e` (of the stream's device) on `s`, from any thread. Another thread's per-thread default stream cannot be
/// named from this one (cudaStreamPerThread is the caller's own; a view resolved there carries that thread's id): the
/// event is recorded on the device's legacy default stream instead, whose work waits for all earlier work of the
/// blocking streams, per-thread ones included.
GPUKIT_INLINE void record_from_any_thread(event& e, const stream_view& s);

/// Makes `s` wait for `e` on the device, from any thread: another thread's per-thread default stream through the
/// legacy default stream (as record_from_any_thread), whose work the later work of blocking streams waits for.
GPUKIT_INLINE void wait_from_any_thread(const event& e, const stream_view& s);

/// "stream 0x7f3a5c000b20 of cuda:0", for messages; without the device where it is not known.
GPUKIT_INLINE std::string describe_stream(const void* handle, std::optional<gpukit::device> d);

/// Throws the invalid_argument_error for `operation` on `stream` (described) while it is captured.
[[noreturn]] GPUKIT_INLINE void throw_captured(std::string_view operation, const std::string& stream, gpukit::device d,
                                               std::string_view advice);

/// What to do instead, for the allocators.
inline constexpr std::string_view capture_advice_allocator =
    "capture with gpukit::capture(stream, work, graph_pool) to allocate from a graph pool, or allocate the memory a "
    "graph uses before cudaStreamBeginCapture and free it after the graph's last launch (nothing was allocated, "
    "freed or recorded, and the capture is intact)";

/// Whether a StreamOps policy can tell that a stream is being captured (the member is optional: a fake without it
/// is never captured).
template <class Ops, class = void>
struct has_capture_query : std::false_type {};
template <class Ops>
struct has_capture_query<
    Ops, std::void_t<decltype(std::declval<const Ops&>().capturing(std::declval<const typename Ops::stream_type&>()))>>
    : std::true_type {};

/// Whether a StreamOps policy says which streams need a capture hold (the member is optional).
template <class Ops, class = void>
struct has_capture_hold_query : std::false_type {};
template <class Ops>
struct has_capture_hold_query<Ops, std::void_t<decltype(std::declval<const Ops&>().needs_capture_hold(
                                       std::declval<const typename Ops::stream_type&>()))>> : std::true_type {};

}  // namespace detail

/// gpukit's streams and events (CUDA and CPU).
struct stream_ops {
  /// The stream the allocator keeps a copy of: a non-owning view.
  using stream_type = stream_view;
  /// The event the allocator records and pools: owning and move-only.
  using event_type = event;

  /// What the allocator keeps of a gpukit::stream to learn of its destruction (empty for other streams).
  using tracker_type = std::shared_ptr<const detail::stream_life>;

  /// stream_view::id(): cudaStreamGetId, never the handle, which CUDA gives to the next stream created once a stream
  /// is destroyed (RMM #649). Views of gpukit streams carry it and default streams' ids are cached per thread: no CUDA
  /// call then; a raw cudaStream_t is looked up (stream_view::id()). For cudaStreamPerThread, the calling thread's
  /// stream.
  std::uintptr_t key(const stream_view& s) const;
  /// The stream's device (stream_view::device(): looked up for a raw handle, else no CUDA call).
  gpukit::device device_of(const stream_view& s) const;
  /// The view with its device and id bound (stream_view::resolved()): the allocator uses it later from any thread.
  stream_view resolve(const stream_view& s) const;
  /// "stream 0x7f3a5c000b20 (id 42) of cuda:0", for messages.
  std::string describe(const stream_view& s) const;

  /// Streams of gpukit::stream are tracked: the allocator learns when one is destroyed and when its last work has
  /// completed (detail::stream_life). Raw handles are not: they must outlive the memory they are used with.
  tracker_type track(const stream_view& s) const;
  /// The stream was destroyed.
  bool expired(const tracker_type& t) const noexcept;
  /// ... and the work it had enqueued has completed (one cudaEventQuery while it has not).
  bool finished(const tracker_type& t) const;
  /// Waits on the host for that work (release paths only).
  void wait_finished(const tracker_type& t) const;
  /// Changes whenever a tracked stream is destroyed: one relaxed load per allocation tells whether to look.
  std::uint64_t expirations() const noexcept;
  /// Without timing: cheaper to record and query.
  event create_event(gpukit::device d) const;
  /// Refuses a stream that is being captured (the allocator records only when freeing): the event would be part of
  /// the graph, and querying it later fails with cudaErrorCapturedEvent.
  ///
  /// Another thread's per-thread default stream is recorded through the legacy default stream
  /// (detail::record_from_any_thread).
  void record(event& e, const stream_view& s) const;
  /// A torn-down runtime (process exit) has no work left: its events count as complete.
  bool ready(const event& e) const;
  /// As ready(): nothing to wait for once the runtime is torn down.
  void synchronize(const event& e) const;
  /// Makes `s` wait on the device for the work `e` captured (event::wait); the host does not wait.
  void wait(const event& e, const stream_view& s) const;
  /// The CPU's default stream runs work synchronously and an idle CPU queue has none left, so memory freed on them
  /// is unused at once; a CUDA stream cannot be asked cheaply, so it is assumed busy.
  bool may_have_pending_work(const stream_view& s) const;
  /// Whether `s` is being captured into a CUDA graph (see detail::capture_status): the allocator then refuses to
  /// allocate, free or record on it. No CUDA call for CPU streams; one cudaStreamIsCapturing for CUDA streams.
  /// A destroyed stream (which the allocator still remembers) captures nothing and must not be asked.
  bool capturing(const stream_view& s) const;
  /// An event recorded on `s`, or a wait enqueued there, is work on the legacy default stream
  /// (detail::may_use_legacy_stream): the legacy stream itself, or another thread's per-thread stream, which is reached
  /// through it. Such work would invalidate a gpukit capture of a blocking stream, so it is done under a
  /// detail::capture_hold. No CUDA call, but for the first lookup of this thread's per-thread stream id.
  bool needs_capture_hold(const stream_view& s) const noexcept { return detail::may_use_legacy_stream(s); }

 private:
  // Out of line, so that capturing() stays small enough to be inlined into the allocators' fast paths.
  GPUKIT_DETAIL_NOINLINE static bool cuda_capturing(const stream_view& s) {
    return !s.destroyed() && detail::capture_status(s) != cudaStreamCaptureStatusNone;
  }
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE bool captured_while_kept(const stream_view& s, const stream_life* life) {
  std::unique_lock<std::mutex> alive;
  if (life != nullptr) alive = life->keep_alive();
  return !(life != nullptr && life->expired()) && capture_status(s) != cudaStreamCaptureStatusNone;
}

GPUKIT_INLINE cudaStreamCaptureStatus capture_status(const stream_view& s) {
  if (s.is_cpu()) return cudaStreamCaptureStatusNone;
  const cudaStream_t handle = s.native_handle();
  if (handle == cudaStreamLegacy || (handle == nullptr && !per_thread_default_stream_mode())) {
    return cudaStreamCaptureStatusNone;
  }
  // cudaStreamPerThread names the caller's own stream: another thread's (a view resolved there) cannot be asked.
  if (s.is_other_threads_stream()) return cudaStreamCaptureStatusNone;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cuda_stream_target target = s.cuda_target();
  const cudaError_t result = cuda_backend::stream_capture_status(target, status);
  if (result == cudaSuccess) return status;
  if (is_teardown_result(result)) return cudaStreamCaptureStatusNone;
  if (result == cudaErrorStreamCaptureImplicit) return cudaStreamCaptureStatusActive;  // unusable until it ends
  // The ordinal known without asking CUDA (a raw handle's device lookup would likely fail as this call did).
  const int ordinal = target.ordinal;
  const std::optional<gpukit::device> d =
      ordinal >= 0 ? std::optional<gpukit::device>(gpukit::device::cuda(ordinal)) : std::nullopt;
  throw_cuda_error(result, "cudaStreamIsCapturing(" + describe_stream(handle, d) + ")", ordinal, __FILE__, __LINE__);
}

GPUKIT_INLINE bool uses_legacy_stream(const stream_view& s) {
  if (s.is_cpu()) return false;
  const cudaStream_t handle = s.native_handle();
  return handle == cudaStreamLegacy || (handle == nullptr && !per_thread_default_stream_mode()) ||
         s.is_other_threads_stream();
}

GPUKIT_INLINE bool may_use_legacy_stream(const stream_view& s) noexcept {
  try {
    return uses_legacy_stream(s);
  } catch (...) {
    return true;
  }
}

GPUKIT_INLINE void wait_for_capture_holds() noexcept { wait_for_no_holds(mode_independent::capture_holds()); }

GPUKIT_INLINE void wait_for_legacy_stream_holds(int ordinal) noexcept {
  wait_for_no_holds(mode_independent::legacy_stream_holds(ordinal));
}

GPUKIT_INLINE kept_stream kept_stream::of(const stream_view& s) {
  return kept_stream{s.is_per_thread() ? s.resolved() : s, s.lifetime()};
}

GPUKIT_INLINE bool kept_stream::destroyed() const noexcept { return life != nullptr && life->expired(); }

GPUKIT_INLINE cudaStream_t kept_stream::handle_here() const {
  if (view.is_other_threads_stream()) return cudaStreamLegacy;
  return view.cuda_handle();
}

GPUKIT_INLINE void record_from_any_thread(event& e, const stream_view& s) {
  if (s.is_other_threads_stream()) {
    e.record(stream_view(e.device(), cudaStreamLegacy));
    return;
  }
  e.record(s);
}

GPUKIT_INLINE void wait_from_any_thread(const event& e, const stream_view& s) {
  if (s.is_other_threads_stream()) {
    e.wait(stream_view(s.device(), cudaStreamLegacy));
    return;
  }
  e.wait(s);
}

GPUKIT_INLINE std::string describe_stream(const void* handle, std::optional<gpukit::device> d) {
  std::string described =
      cuda_backend::describe_stream_handle(static_cast<cudaStream_t>(const_cast<void*>(handle)), -1);
  if (d) described += " of " + d->to_string();
  return described;
}

GPUKIT_INLINE void throw_captured(std::string_view operation, const std::string& stream, gpukit::device d,
                                  std::string_view advice) {
  std::string message = "gpukit: ";
  message += operation;
  message += " on ";
  message += stream;
  message += ": the stream is being captured into a CUDA graph; ";
  message += advice;
  throw invalid_argument_error(message, cudaSuccess, std::string(operation), d.is_cuda() ? d.ordinal() : -1);
}
}  // namespace detail

GPUKIT_INLINE std::uintptr_t stream_ops::key(const stream_view& s) const {
  static_assert(sizeof(std::uintptr_t) >= sizeof(unsigned long long), "stream ids are 64-bit");
  return static_cast<std::uintptr_t>(s.id());
}

GPUKIT_INLINE gpukit::device stream_ops::device_of(const stream_view& s) const { return s.device(); }

GPUKIT_INLINE stream_view stream_ops::resolve(const stream_view& s) const { return s.resolved(); }

GPUKIT_INLINE std::string stream_ops::describe(const stream_view& s) const {
  std::string text;
  if (s.is_cpu()) {
    text = s.cpu_queue() != nullptr ? "a CPU stream" : "the CPU's default stream";
  } else {
    text = detail::describe_stream(s.native_handle(), s.device());
  }
  return text + " (id " + std::to_string(s.id() & ~detail::cpu_stream_id_bit) + ")";
}

GPUKIT_INLINE stream_ops::tracker_type stream_ops::track(const stream_view& s) const { return s.lifetime(); }

GPUKIT_INLINE bool stream_ops::expired(const tracker_type& t) const noexcept { return t && t->expired(); }

GPUKIT_INLINE bool stream_ops::finished(const tracker_type& t) const { return t && t->finished(); }

GPUKIT_INLINE void stream_ops::wait_finished(const tracker_type& t) const {
  if (t) t->wait_finished();
}

GPUKIT_INLINE std::uint64_t stream_ops::expirations() const noexcept {
  return detail::stream_expirations().load(std::memory_order_relaxed);
}

GPUKIT_INLINE event stream_ops::create_event(gpukit::device d) const { return event(d, event_options{}); }

GPUKIT_INLINE void stream_ops::record(event& e, const stream_view& s) const {
  if (capturing(s)) {
    detail::throw_captured("deallocate (an event on a stream that uses the block)",
                           detail::describe_stream(s.native_handle(), e.device()), e.device(),
                           detail::capture_advice_allocator);
  }
  detail::record_from_any_thread(e, s);
}

GPUKIT_INLINE bool stream_ops::ready(const event& e) const {
  try {
    return e.ready();
  } catch (const error& ex) {
    if (detail::is_teardown_result(ex.cuda_result())) return true;
    throw;
  }
}

GPUKIT_INLINE void stream_ops::synchronize(const event& e) const {
  try {
    e.synchronize();
  } catch (const error& ex) {
    if (!detail::is_teardown_result(ex.cuda_result())) throw;
  }
}

GPUKIT_INLINE void stream_ops::wait(const event& e, const stream_view& s) const { detail::wait_from_any_thread(e, s); }

GPUKIT_INLINE bool stream_ops::may_have_pending_work(const stream_view& s) const {
  if (s.is_cpu()) return s.cpu_queue() != nullptr && !s.cpu_queue()->idle();
  return true;
}

GPUKIT_INLINE bool stream_ops::capturing(const stream_view& s) const {
  if (s.is_cpu()) return false;  // inline: the CPU's cache-hit path makes no call for it
  return cuda_capturing(s);
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
