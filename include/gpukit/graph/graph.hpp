// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// CUDA graphs: capture the work a function enqueues on a stream, instantiate it, launch it again and again.
///
///     auto pool = gpukit::graph_pool::create(d, 64 << 20);        // the graph's memory, reserved now
///     gpukit::graph step = gpukit::capture(s, [&] {
///       gpukit::device_buffer<float> tmp(n, s);                    // from the pool: no cudaMalloc in the capture
///       kernel<<<blocks, threads, 0, s.cuda_handle()>>>(tmp.data(), out.data());
///     }, pool);
///     for (int i = 0; i < steps; ++i) step.launch(s);
///
/// A capture without a pool refuses the caching allocators' allocations on the captured streams
/// (caching_allocator.hpp says why); async_allocator's become graph memory nodes. Such memory is the graph's: each
/// launch allocates it again at the same address, and a launch fails (cudaErrorInvalidValue) while the previous
/// launch's is unfreed. Free it in the capture (a free node), or after each launch with cudaFreeAsync; async_allocator
/// tracks only the pointer the capture returned, freed once. For an output kept past the capture, use a graph_pool. The
/// capture mode is the calling thread's business: capture_mode::thread_local_ (the default) lets other threads make
/// unsafe calls (cudaMalloc) meanwhile; capture_mode::global refuses them in every thread whose own mode is global
/// (gpukit's own such calls run relaxed), as CUDA defines.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/capture_pools.hpp>
#include <gpukit/memory/graph_pool.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

/// How a capture treats unsafe calls (cudaMalloc, synchronization) from other threads (cudaStreamCaptureMode).
enum class capture_mode {
  /// refused in the capturing thread (unless it or the capture is relaxed) and in other threads whose own mode is
  /// global
  global = cudaStreamCaptureModeGlobal,
  thread_local_ = cudaStreamCaptureModeThreadLocal,  ///< refused in the capturing thread only
  relaxed = cudaStreamCaptureModeRelaxed,            ///< not refused (the caller takes care)
};

/// A CUDA graph (cudaGraph_t) and its executable graph (cudaGraphExec_t; none until instantiate() for one made by
/// capture_for_update), move-only, with the pool its memory came from.
/// Not thread-safe: calls on one graph (launch, update, destruction) must not run at once from several threads, since
/// CUDA requires the calls on one graph or executable graph to be serialized.
class graph {
 public:
  /// An empty graph: launch() and update() throw invalid_argument_error until a captured graph is assigned.
  graph() noexcept = default;
  /// Takes over `other`'s graph and pool; `other` becomes empty.
  graph(graph&& other) noexcept
      : device_(other.device_),
        graph_(std::exchange(other.graph_, nullptr)),
        exec_(std::exchange(other.exec_, nullptr)),
        pool_(std::move(other.pool_)) {}
  /// Destroys the graph held (as ~graph does), then takes over `other`'s; `other` becomes empty.
  graph& operator=(graph&& other) noexcept {
    if (this != &other) {
      destroy();
      device_ = other.device_;
      graph_ = std::exchange(other.graph_, nullptr);
      exec_ = std::exchange(other.exec_, nullptr);
      pool_ = std::move(other.pool_);
    }
    return *this;
  }
  graph(const graph&) = delete;
  graph& operator=(const graph&) = delete;
  /// Destroys the executable graph (work already launched completes). The pool lives on while other graphs or
  /// allocations use it.
  ~graph() { destroy(); }

  /// Launches the graph on `s` (a stream of its device). Throws invalid_argument_error for an empty graph, a
  /// stream of another device, another thread's per-thread default stream, the legacy default stream while a gpukit
  /// capture of a blocking stream of the device runs (as stream_view::enqueue_host), or a stream being captured:
  /// CUDA refuses cudaGraphLaunch into a capturing stream (cudaErrorStreamCaptureUnsupported) and invalidates that
  /// capture, so the launch is refused before it is made and the capture goes on (launch the graph outside the
  /// capture or on a stream not captured, or capture its work into the outer graph; for a graph with a pool, the
  /// outer graph could besides run after the pool's memory went back); cuda_error if the launch fails. For a graph with
  /// a pool, a cuda_error naming "cudaEventRecord (after a graph launch)" means the graph was launched but the pool
  /// could not record when it ends (the host then waited for `s`, or, if even that failed, the pool keeps its reserve
  /// when released): do not launch it again to make up for it. On the legacy stream, a capture that begins while the
  /// pool orders the launch makes it refused, after the host has waited for any destroyed stream's work the pool could
  /// not order on the device.
  void launch(stream_view s) const {
    if (exec_ == nullptr) {
      throw invalid_argument_error(graph_ != nullptr ? "gpukit::graph::launch: the graph is not instantiated "
                                                       "(gpukit::capture_for_update: call instantiate() first)"
                                                     : "gpukit::graph::launch: the graph is empty (moved from?)");
    }
    if (s.is_cpu() || s.device() != device_) {
      throw invalid_argument_error("gpukit::graph::launch: a stream of " +
                                   (s.is_cpu() ? std::string("cpu") : s.device().to_string()) + " for a graph of " +
                                   device_.to_string());
    }
    if (s.is_other_threads_stream()) detail::throw_other_threads_stream("graph::launch");
    device_guard guard(device_);
    std::optional<detail::legacy_stream_hold> hold;
    cudaError_t result = cudaSuccess;
    // Refused before any call (the pool's too, which then leave nothing behind), so that the capture stays intact.
    hold_legacy_stream(s, hold);
    refuse_captured_stream(s);
    if (!pool_) {
      GPUKIT_CUDA_TRY_DESCRIBED(result = cudaGraphLaunch(exec_, s.cuda_handle()), launch_failed(result),
                                device_.ordinal());
      return;
    }
    // Held again below, as the pool's calls may wait on the host (for a destroyed stream's work, for `s` when the
    // record fails) or for the pool's lock, which a host wait may hold.
    hold.reset();
    const stream_view on = s.resolved();  // its id looked up once: the pool's calls below then make no lookup
    const cudaEvent_t launched = pool_->prepare_launch(on);  // recorded after the launch, for the pool's release
    cudaError_t recorded = cudaSuccess;
    try {
      try {
        pool_->order_launch(on);
      } catch (const invalid_argument_error&) {
        // Its waits on the legacy stream are refused (event::wait's) once a capture began meanwhile: refused as
        // graph::launch, with the message the launch documents. Any other refusal passes through.
        hold_legacy_stream(s, hold);
        throw;
      }
      hold_legacy_stream(s, hold);  // a capture may have begun meanwhile
      GPUKIT_CUDA_TRY_DESCRIBED(result = cudaGraphLaunch(exec_, on.cuda_handle()), launch_failed(result),
                                device_.ordinal());
      recorded = pool_->record_launch(on, launched);
      hold.reset();
    } catch (...) {
      hold.reset();
      pool_->abandon_launch(on);
      throw;
    }
    pool_->note_launch(on, recorded);  // throws if it could not be recorded (the release then waits for all)
  }

  /// Replaces this graph's work by `recaptured`'s where CUDA can update the executable graph in place
  /// (cudaGraphExecUpdate: same topology, new parameters); returns false, changing nothing, where it cannot, and then
  /// sets `*why_not` (if given) to CUDA's reason (cudaGraphExecUpdateErrorTopologyChanged, ...NodeTypeChanged,
  /// ...ParametersChanged, ...). `recaptured` is left empty on success. Only its cudaGraph_t is used: capture it with
  /// capture_for_update, which does not instantiate it (instantiate() it if the update is refused, to launch it
  /// instead).
  bool update(graph& recaptured, cudaGraphExecUpdateResult* why_not = nullptr) {
    if (&recaptured == this) {
      throw invalid_argument_error(
          "gpukit::graph::update: a graph cannot be updated from itself (it would be emptied)");
    }
    if (exec_ == nullptr || recaptured.graph_ == nullptr) {
      throw invalid_argument_error(exec_ == nullptr && graph_ != nullptr
                                       ? "gpukit::graph::update: the graph updated is not instantiated (instantiate() "
                                         "it first)"
                                       : "gpukit::graph::update: an empty graph (moved from?)");
    }
    if (recaptured.device_ != device_) {
      throw invalid_argument_error("gpukit::graph::update: a graph of " + recaptured.device_.to_string() +
                                   " for a graph of " + device_.to_string());
    }
    device_guard guard(device_);
    cudaGraphExecUpdateResultInfo info{};
    cudaError_t result = cudaSuccess;
    {
      const detail::relaxed_capture_mode relaxed;  // as cudaGraphInstantiate (not measured for the update itself)
      result = cudaGraphExecUpdate(exec_, recaptured.graph_, &info);
    }
    if (result == cudaErrorGraphExecUpdateFailure) {
      (void)cudaGetLastError();
      if (why_not != nullptr) *why_not = info.result;
      return false;
    }
    GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaGraphExecUpdate", device_.ordinal());
    std::swap(graph_, recaptured.graph_);  // the old topology goes with `recaptured`
    std::swap(pool_, recaptured.pool_);    // ...and so does its pool's share, once `recaptured` is destroyed
    recaptured.destroy();
    return true;
  }

  /// Adopts handles made elsewhere (destroyed with the graph); `pool` is kept alive as long as the graph.
  graph(gpukit::device d, cudaGraph_t g, cudaGraphExec_t e, std::shared_ptr<graph_pool> pool = nullptr) noexcept
      : device_(d), graph_(g), exec_(e), pool_(std::move(pool)) {}

  /// Instantiates a graph made by capture_for_update (cudaGraphInstantiate), so that it can be launched; nothing for
  /// one that is already. Throws invalid_argument_error for an empty graph, cuda_error if CUDA refuses (the graph is
  /// left as it was).
  void instantiate() {
    if (exec_ != nullptr) return;
    if (graph_ == nullptr) throw invalid_argument_error("gpukit::graph::instantiate: the graph is empty (moved from?)");
    device_guard guard(device_);
    cudaGraphExec_t exec = nullptr;
    cudaError_t result = cudaSuccess;
    {
      // Refused in global mode while any other thread captures, and invalidates that capture (measured on an H200).
      const detail::relaxed_capture_mode relaxed;
      result = cudaGraphInstantiate(&exec, graph_, 0);
    }
    GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaGraphInstantiate", device_.ordinal());
    exec_ = exec;
  }

  /// True when the graph can be launched; false when empty (default-constructed or moved from) or not instantiated.
  explicit operator bool() const noexcept { return exec_ != nullptr; }
  /// The device the graph runs on (the CPU for a default-constructed graph).
  gpukit::device device() const noexcept { return device_; }
  /// The cudaGraph_t, still owned by this object; nullptr when empty.
  cudaGraph_t native_graph() const noexcept { return graph_; }
  /// The cudaGraphExec_t, still owned by this object; nullptr when empty or not instantiated.
  cudaGraphExec_t native_exec() const noexcept { return exec_; }
  /// The pool the graph's allocations came from (nullptr: captured without one).
  const std::shared_ptr<graph_pool>& pool() const noexcept { return pool_; }

 private:
  /// On the legacy stream, CUDA would join another thread's gpukit capture of a blocking stream of the device and
  /// invalidate it: takes `hold`, which keeps such a capture from beginning until it is let go, and throws
  /// invalid_argument_error (as stream_view::enqueue_host) if one is underway. Held only to enqueue: never through a
  /// host wait or a lock, since that capture waits for it. Other streams: nothing.
  void hold_legacy_stream(const stream_view& s, std::optional<detail::legacy_stream_hold>& hold) const {
    if (!s.is_default() || s.is_per_thread()) return;
    hold.emplace(device_.ordinal());
    detail::refuse_legacy_stream_join("graph::launch", s, hold->refused());
  }

  /// CUDA refuses cudaGraphLaunch into a stream being captured (cudaErrorStreamCaptureUnsupported, in every capture
  /// mode) and invalidates that capture: throws invalid_argument_error first, which leaves the capture intact. No CUDA
  /// release up to 13.0 captures a launch as a child graph node. A capture status that cannot be asked is the
  /// launch's to report (cudaStreamIsCapturing is permitted on a captured stream and never invalidates it).
  void refuse_captured_stream(const stream_view& s) const {
    const cudaStreamCaptureStatus status = detail::capture_status(s);
    if (status == cudaStreamCaptureStatusNone) return;
    std::string message =
        "gpukit::graph::launch: " + detail::describe_stream(s.native_handle(), device_) + " is being captured" +
        (status == cudaStreamCaptureStatusInvalidated ? " (its capture is invalidated already)" : "") +
        ": CUDA refuses cudaGraphLaunch into a stream being captured "
        "(cudaErrorStreamCaptureUnsupported) and would invalidate the capture";
    if (pool_) {
      message +=
          "; for a graph with a graph pool, the outer graph could besides run after the pool's memory is released";
    }
    message +=
        ". Launch the graph before or after the capture, or on a stream not being captured, or capture its work into "
        "the outer graph instead (nothing was launched; the capture goes on)";
    throw invalid_argument_error(message, cudaSuccess, "cudaGraphLaunch", device_.ordinal());
  }

  /// What a failed cudaGraphLaunch names; CUDA says only cudaErrorInvalidValue for an unfreed graph allocation.
  static std::string launch_failed(cudaError_t result) {
    if (result != cudaErrorInvalidValue) return "cudaGraphLaunch";
    return "cudaGraphLaunch (if the graph allocates memory, e.g. async_allocator in its capture: an allocation of its "
           "previous launch is not freed yet; free it in the capture or after each launch, or capture with a "
           "graph_pool)";
  }

  void destroy() noexcept {
    if (exec_ == nullptr && graph_ == nullptr) return;
    try {
      device_guard guard(device_);
      // cudaGraphExecDestroy is refused in global mode while any thread captures, and invalidates that capture.
      const detail::relaxed_capture_mode relaxed;
      if (exec_ != nullptr)
        detail::report_cuda_failure(cudaGraphExecDestroy(exec_), "cudaGraphExecDestroy", device_.ordinal());
      if (graph_ != nullptr)
        detail::report_cuda_failure(cudaGraphDestroy(graph_), "cudaGraphDestroy", device_.ordinal());
    } catch (const error& e) {  // at process exit (the runtime gone) the graph went with it
      if (!detail::is_teardown_result(e.cuda_result()))
        detail::warn_parts("gpukit::graph: could not make its device current to destroy it: ", e.what());
    } catch (const std::exception& e) {
      detail::warn_parts("gpukit::graph: could not make its device current to destroy it: ", e.what());
    }
    exec_ = nullptr;
    graph_ = nullptr;
    pool_.reset();
  }

  gpukit::device device_ = gpukit::device::cpu();
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::shared_ptr<graph_pool> pool_;
};

namespace detail {

/// The name of a capture mode, for messages.
inline const char* capture_mode_name(capture_mode mode) noexcept {
  switch (mode) {
    case capture_mode::global:
      return "cudaStreamCaptureModeGlobal";
    case capture_mode::thread_local_:
      return "cudaStreamCaptureModeThreadLocal";
    case capture_mode::relaxed:
      return "cudaStreamCaptureModeRelaxed";
  }
  return "an unknown cudaStreamCaptureMode";
}

/// What an end-of-capture failure means, for its message.
inline const char* why_capture_failed(cudaError_t result) noexcept {
  switch (result) {
    case cudaErrorStreamCaptureInvalidated:
      return "the capture was invalidated, e.g. by an unsafe call while it ran";
    case cudaErrorStreamCaptureUnjoined:
      return "a stream forked into the capture was not joined back to the captured stream";
    case cudaErrorStreamCaptureWrongThread:
      return "the capture was begun on another thread";
    default:
      return "the capture could not be ended";
  }
}

/// capture and capture_for_update: the graph captured, and instantiated if `instantiate`.
template <class F>
graph capture_graph(stream_view s, F&& work, std::shared_ptr<graph_pool> pool, capture_mode mode, bool instantiate) {
  // CUDA captures created streams and the per-thread default stream (handle 0 in that mode), never the legacy one.
  if (s.is_cpu() || (s.is_default() && !s.is_per_thread())) {
    throw invalid_argument_error(
        "gpukit::capture: only a created CUDA stream or the per-thread default stream can "
        "be captured, not " +
        std::string(s.is_cpu() ? "a CPU stream" : "the legacy default stream"));
  }
  // A view made from a raw handle carries no record: the handle's owner, if a gpukit::stream (of either mode), has one.
  bool shared_by_pool = false;
  if (const auto life = s.lifetime()) {
    shared_by_pool = life->shared_by_pool();
  } else if (!s.is_default()) {
    const detail::stream_owner owner = detail::find_stream_owner(s.native_handle());
    shared_by_pool = owner.life != nullptr && owner.shared_by_pool(owner.life.get());
  }
  if (shared_by_pool) {
    throw invalid_argument_error(
        "gpukit::capture: a stream of stream_pool::next() on " + s.device().to_string() +
        ", which other users of the pool share: their work on it would go into the graph, and a synchronize of it "
        "would invalidate the capture (capture a stream of stream_pool::acquire_exclusive(), or one of your own; "
        "nothing was captured)");
  }
  const gpukit::device d = s.device();
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("capture");
  if (pool && pool->device() != d) {
    throw invalid_argument_error("gpukit::capture: a graph pool of " + pool->device().to_string() +
                                 " for a stream of " + d.to_string());
  }
  device_guard guard(d);
  const cudaStream_t handle = s.cuda_handle();
  // Counted from before the capture begins until after it ends (allocators in capture_checks::gpukit_captures
  // mode look only while a capture is counted), not during the instantiation (other threads' allocators would refuse
  // or defer work for no capture); outlives `scope` below, which ends the capture. Work already being put on the
  // legacy stream under a detail::capture_hold is waited for: it would invalidate the capture.
  struct counted_capture {
    counted_capture(int device_ordinal, bool blocking_stream) noexcept
        : ordinal(device_ordinal), blocking(blocking_stream) {
      // A blocking stream is counted apart first, then waits for the legacy-stream queries and records being made
      // (stream_view::ready and synchronize on it): they would join the capture. Later ones see the count and refuse.
      if (blocking) {
        mode_independent::gpukit_blocking_captures_underway(ordinal).fetch_add(1, std::memory_order_seq_cst);
        ++mode_independent::gpukit_blocking_captures_on_this_thread(ordinal);
      }
      mode_independent::gpukit_captures_underway().fetch_add(1, std::memory_order_seq_cst);
      ++mode_independent::gpukit_captures_on_this_thread();
      detail::wait_for_capture_holds();
      if (blocking) {
        // Only now: event records on the legacy stream made under a capture hold, which was just waited for, go
        // ahead (detail::legacy_stream_hold for event work); later ones are refused.
        mode_independent::gpukit_blocking_captures_begun(ordinal).fetch_add(1, std::memory_order_seq_cst);
        detail::wait_for_legacy_stream_holds(ordinal);
      }
    }
    ~counted_capture() { end(); }
    // Once the capture has begun: event::wait counts its forks into blocking streams (detail::count_blocking_fork).
    void track(unsigned long long capture_id) {
      detail::register_gpukit_capture(capture_id);
      id = capture_id;
    }
    void end() noexcept {
      if (!counting) return;
      counting = false;
      if (id != 0) detail::forget_gpukit_capture(id);
      // In the reverse order of the constructor's counts: a capture_hold granted once the capture is uncounted
      // (gpukit_captures_underway) must find it no longer begun, else the event records under that hold were refused
      // (a pinned block was lost in test_sim_capture's "pinned blocks freed after the legacy stream" race).
      if (blocking) {
        --mode_independent::gpukit_blocking_captures_on_this_thread(ordinal);
        mode_independent::gpukit_blocking_captures_begun(ordinal).fetch_sub(1, std::memory_order_acq_rel);
        mode_independent::gpukit_blocking_captures_underway(ordinal).fetch_sub(1, std::memory_order_acq_rel);
      }
      --mode_independent::gpukit_captures_on_this_thread();
      mode_independent::gpukit_captures_underway().fetch_sub(1, std::memory_order_acq_rel);
    }
    int ordinal;
    bool blocking;
    bool counting = true;
    unsigned long long id = 0;  // tracked: the capture's
    counted_capture(const counted_capture&) = delete;
    counted_capture& operator=(const counted_capture&) = delete;
  };
  // The per-thread default stream synchronizes with the legacy one, as a stream created without
  // cudaStreamNonBlocking does.
  counted_capture counted(d.ordinal(), s.is_default() || detail::cuda_backend::may_block_on_legacy_stream(handle));
  const cudaError_t begun = cudaStreamBeginCapture(handle, static_cast<cudaStreamCaptureMode>(mode));
  if (begun != cudaSuccess) {
    // CUDA says only cudaErrorIllegalState for a stream that takes part in a capture already.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const bool captured = detail::cuda_backend::stream_capture_status({handle, d.ordinal()}, status) == cudaSuccess &&
                          status != cudaStreamCaptureStatusNone;
    GPUKIT_CUDA_TRY_DESCRIBED(begun,
                              std::string("cudaStreamBeginCapture(") + detail::capture_mode_name(mode) + ")" +
                                  (captured ? " (the stream is already being captured: a capture was begun on it "
                                              "elsewhere, or it was forked into another capture by waiting for an "
                                              "event recorded there)"
                                            : ""),
                              d.ordinal());
  }
  // Ends the capture however what follows ends; the graph it yields is destroyed unless kept.
  struct capture_scope {
    cudaStream_t stream;  // 0 is a capturable stream too: the per-thread default stream in that mode
    int device;
    graph_pool* pool;
    unsigned long long id;
    bool active = true;
    cudaGraph_t end() noexcept {
      // 0 and cudaStreamPerThread name the per-thread stream of the current device, which the work may have changed.
      if (stream == nullptr || stream == cudaStreamPerThread) (void)cudaSetDevice(device);
      cudaGraph_t g = nullptr;
      const cudaError_t result = cudaStreamEndCapture(stream, &g);
      if (pool != nullptr) pool->end_capture(id);
      active = false;
      if (result != cudaSuccess) {
        last_error = result;
        (void)cudaGetLastError();
        return nullptr;
      }
      return g;
    }
    ~capture_scope() {
      if (!active) return;
      if (cudaGraph_t g = end()) (void)cudaGraphDestroy(g);
    }
    cudaError_t last_error = cudaSuccess;
  } scope{handle, d.ordinal(), nullptr, 0};
  {
    // The id of the capture just begun on `handle` (never 0 for an active one): its forks are counted under it, and
    // the pool serves it.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetCaptureInfo(handle, &status, &scope.id, nullptr, nullptr, nullptr, nullptr),
                              "cudaStreamGetCaptureInfo", d.ordinal());
    if (status != cudaStreamCaptureStatusActive || scope.id == 0) {
      GPUKIT_CUDA_TRY_DESCRIBED(cudaErrorStreamCaptureInvalidated, "cudaStreamGetCaptureInfo (the capture just begun)",
                                d.ordinal());
    }
    counted.track(scope.id);
  }
  if (pool) {
    pool->begin_capture(scope.id);
    scope.pool = pool.get();
  }
  std::forward<F>(work)();
  cudaGraph_t g = scope.end();
  counted.end();
  if (g == nullptr) {
    const cudaError_t ended = scope.last_error == cudaSuccess ? cudaErrorStreamCaptureInvalidated : scope.last_error;
    GPUKIT_CUDA_TRY_DESCRIBED(ended, std::string("cudaStreamEndCapture (") + detail::why_capture_failed(ended) + ")",
                              d.ordinal());
  }
  graph captured(d, g, nullptr, std::move(pool));  // destroys `g` if the instantiation throws
  if (instantiate) captured.instantiate();
  return captured;
}

}  // namespace detail

/// Captures the work `work()` enqueues on `s` (and on streams it forks into the capture) into a graph and
/// instantiates it. While it runs, gpukit's caching allocators serve allocations on the captured streams from
/// `pool` (nullptr: refuse them). If `work` throws, the capture is ended and discarded and the exception passes
/// through. Throws invalid_argument_error for a CPU stream or the legacy default stream (0 outside the per-thread
/// default stream mode), or a pool of another device; cuda_error when CUDA refuses the capture (for instance one
/// invalidated by an unsafe call, or a stream already being captured, which its message says). While a capture of
/// a stream that synchronizes with the legacy default stream runs (created without non_blocking, a per-thread default
/// stream, or one such stream it forked into with event::wait), gpukit's calls on that device's legacy stream are
/// refused (invalid_argument_error): CUDA would join them to the capture and invalidate it.
template <class F>
graph capture(stream_view s, F&& work, std::shared_ptr<graph_pool> pool = nullptr,
              capture_mode mode = capture_mode::thread_local_) {
  return detail::capture_graph(s, std::forward<F>(work), std::move(pool), mode, true);
}

/// As capture, without instantiating the graph: for graph::update, which needs only the cudaGraph_t, so that an
/// update that succeeds makes no cudaGraphInstantiate. launch() refuses the graph until instantiate() (say, after an
/// update that CUDA refused, to launch the new graph instead).
template <class F>
graph capture_for_update(stream_view s, F&& work, std::shared_ptr<graph_pool> pool = nullptr,
                         capture_mode mode = capture_mode::thread_local_) {
  return detail::capture_graph(s, std::forward<F>(work), std::move(pool), mode, false);
}

GPUKIT_END_NAMESPACE
