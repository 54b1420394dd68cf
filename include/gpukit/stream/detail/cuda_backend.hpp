// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CUDA backend of streams and events: every CUDA runtime call that gpukit::stream_view, gpukit::stream,
/// gpukit::event, the record of a destroyed stream, the copies on a stream (transfer/) and the engines' capture checks
/// (memory/stream_ops.hpp: a stream's capture status, the thread's capture mode) make, each with the device
/// made current that the call needs and its failure turned into a gpukit exception that names the call and the device.
/// stream.hpp and event.hpp choose between this backend and the CPU's (cpu_backend.hpp) once per operation and keep no
/// CUDA call of their own, so this file is the whole CUDA layer of streams and events, and the simulated runtime of the
/// tests runs every line.
///
/// Contexts: a runtime call on a stream runs in the calling thread's current context. The default streams (0,
/// cudaStreamLegacy, cudaStreamPerThread) are the current device's, so their device is made current around each call.
/// Any context serves a call on another stream, but on a thread with none the runtime would first create cuda:0's
/// primary context: only then is the stream's own device made current (enter_stream_context).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/driver_api.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <initializer_list>
#include <mutex>
#include <new>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>

// What gpukit knows of streams, one table per process, outside the per-mode namespace (detail/config.hpp): a stream
// a gpukit::stream of either default-stream mode owns is the same stream to the other, and gpukit's own stream ids
// must not repeat across the modes.
namespace gpukit {
namespace mode_independent {

/// A stream a gpukit::stream owns, as gpukit knows it.
struct created_stream {
  int ordinal = -1;
  unsigned long long id = 0;
  bool blocking = false;  ///< created without cudaStreamNonBlocking
};

/// The streams gpukit::stream objects own (their handles cannot name another stream meanwhile), the ids gpukit gave
/// raw handles named while captured, and the legacy default streams' ids.
struct stream_table {
  std::shared_mutex mutex;  ///< guards the two maps
  std::unordered_map<cudaStream_t, created_stream> created;
  /// A raw handle named during a capture: that capture's id (cudaStreamGetCaptureInfo) and the id gpukit gave it.
  std::unordered_map<cudaStream_t, std::pair<unsigned long long, unsigned long long>> captured;
  /// The ids gpukit gives streams CUDA will not tell it, counted from 1.
  std::atomic<unsigned long long> next_own_id{1};
  /// cudaStreamGetId of each device's legacy default stream (the same on every thread), 0 until known.
  std::array<std::atomic<unsigned long long>, 64> legacy_ids{};
};

/// The process's stream_table (exported: one per process). Never destroyed: streams may be destroyed during exit.
/// Made in static storage, without allocating, so that the noexcept lookups, which may be the first to ask for it,
/// cannot fail (none of its members' default constructors allocates or throws).
GPUKIT_EXPORT inline stream_table& stream_table_v1() noexcept {
  alignas(stream_table) static unsigned char storage[sizeof(stream_table)];
  static stream_table* const table = ::new (static_cast<void*>(storage)) stream_table;
  return *table;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// 0, cudaStreamLegacy and cudaStreamPerThread: the default streams, which name whatever device is current (the
/// handle does not say which).
GPUKIT_INLINE bool is_default_stream_handle(cudaStream_t h) noexcept;

/// After a query answered cudaErrorNotReady (a status, not an error): clears the thread's last error only if the
/// runtime recorded that status there, so it never surfaces later while an error the program had pending stays.
GPUKIT_INLINE void forget_not_ready() noexcept;

/// A CUDA stream as runtime calls on it need it: its handle and, when known, its device's ordinal (-1: not known,
/// looked up where needed).
struct cuda_stream_target {
  cudaStream_t handle = nullptr;
  int ordinal = -1;
};

/// Relaxes the calling thread's capture mode for a scope (cudaThreadExchangeStreamCaptureMode), around the
/// cudaMalloc/cudaFree/cudaHostAlloc/cudaFreeHost of memory for streams that are not captured, and around every
/// query and host wait of an event (cudaEventQuery, cudaEventSynchronize): in global mode they are refused while any
/// thread captures, and they invalidate that capture (PyTorch's NCCL watchdog and caching allocator met this with
/// their event queries). Such an event was recorded outside the capture (one recorded inside it is refused either way,
/// cudaErrorCapturedEvent), so asking about it cannot disturb the capture. Best effort: without a usable runtime
/// nothing changes.
class relaxed_capture_mode {
 public:
  /// Relaxes the mode when `active` (false: does nothing, e.g. for CPU memory).
  explicit relaxed_capture_mode(bool active = true) noexcept;
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;
  /// Restores the thread's previous mode.
  ~relaxed_capture_mode();

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool exchanged_ = false;
};

/// The scope of a call that frees or unregisters page-locked host memory (cudaFreeHost, cudaHostUnregister), made from
/// destructors (defined with the functions, whose bodies alone use it).
class host_memory_release_scope;

namespace cuda_backend {

// --- streams ---

// CUDA must not be asked about a stream while it is captured: cudaStreamGetDevice, cudaStreamGetId and
// cudaStreamGetFlags of a stream being captured fail and invalidate the capture, in every capture mode (measured on an
// H200, driver 580; cudaStreamGetPriority, cudaStreamIsCapturing and cuStreamGetCtx do not). A raw handle can reach
// gpukit during a capture (a cuda::stream_ref given to a memory resource), so the lookups below ask those questions
// only of a stream known not to be captured.

using mode_independent::created_stream;

/// Records a stream a gpukit::stream created or took over. Throws std::bad_alloc.
GPUKIT_INLINE void remember_created_stream(cudaStream_t handle, created_stream known);
/// Records a stream a gpukit::stream takes over (stream::wrap), unless one owns it already: then false, and what was
/// recorded stays (two owners would both destroy it). Throws std::bad_alloc.
GPUKIT_INLINE bool remember_adopted_stream(cudaStream_t handle, created_stream known);
/// Forgets it, before it is destroyed or released.
GPUKIT_INLINE void forget_created_stream(cudaStream_t handle) noexcept;
/// What was recorded for `handle` while a gpukit::stream owns it.
GPUKIT_INLINE std::optional<created_stream> find_created_stream(cudaStream_t handle) noexcept;

/// Marks the ids gpukit gives streams CUDA will not tell it the id of: a raw handle being captured (one per
/// capture), a per-thread default stream first named while captured (kept for the thread), a legacy default stream
/// first named while a blocking stream is captured (kept for the process). CUDA's ids count up from small numbers,
/// and CPU streams' carry cpu_stream_id_bit.
constexpr unsigned long long own_stream_id_bit = 1ull << 62;
/// A new id with own_stream_id_bit, unique in the process.
GPUKIT_INLINE unsigned long long next_own_stream_id() noexcept;

/// "stream 0x1234", or with a device (`ordinal` >= 0) "stream 0x1234 of cuda:1": a stream as messages name it.
GPUKIT_INLINE std::string describe_stream_handle(cudaStream_t handle, int ordinal);

/// The ordinal of the device stream `handle` belongs to (a default stream: the current device's); a failure names
/// device `described` (-1: none). A stream a gpukit::stream owns is looked up in memory; another is asked of the
/// driver (cuStreamGetCtx and cuCtxGetDevice, which a capture permits), else with cudaStreamGetDevice.
GPUKIT_INLINE int stream_device(cudaStream_t handle, int described = -1);

/// Whether stream `handle` (not a default stream; of device `ordinal`, -1: not known) is being captured, or cannot
/// be asked (true then: the caller must not ask the questions a capture refuses). Never throws.
GPUKIT_INLINE bool captured_or_unknown(cudaStream_t handle, int ordinal) noexcept;

/// The id of stream `handle` (not a default stream) for gpukit's views: a gpukit::stream's; else, when
/// cudaStreamGetCaptureInfo says it is not captured, cudaStreamGetId's; else one of gpukit's, the same for the rest
/// of that capture (a captured stream cannot be destroyed, so its handle names it until the capture ends).
GPUKIT_INLINE unsigned long long stream_id_of(cudaStream_t handle, int ordinal);

/// Makes, in `guard`, the device current that a runtime call on stream `s` needs (see the file comment). With a
/// context current and a stream that is not a default one this costs one cuCtxGetCurrent and no runtime call.
/// Returns the ordinal of the stream's device where it was known or looked up (-1: neither).
GPUKIT_INLINE int enter_stream_context(const cuda_stream_target& s, std::optional<device_guard>& guard);

/// Throws the error of `call` on stream `s`, failed with `result`, naming the stream and its device: `s`'s, else
/// `entered` (what enter_stream_context returned), else the one a gpukit::stream that owns the handle knows. CUDA
/// is not asked: a lookup of a handle a call just refused would likely fail too, and hide this error.
[[noreturn]] GPUKIT_INLINE void throw_stream_call_error(cudaError_t result, const char* call,
                                                        const cuda_stream_target& s, int entered, const char* file,
                                                        int line);

/// cudaStreamGetId of a stream that is not a default stream.
GPUKIT_INLINE unsigned long long stream_id(cudaStream_t handle, int ordinal);

/// cudaStreamGetId of device `ordinal`'s legacy default stream, or of the calling thread's per-thread one, with
/// that device current; one of gpukit's (next_own_stream_id) where CUDA cannot be asked: the per-thread one while
/// it is captured, the legacy one while a blocking stream is (`blocking_capture_counted`: a gpukit capture of a
/// blocking stream of the device is known to be underway, so CUDA is not asked). The legacy one's is kept for the
/// process.
GPUKIT_INLINE unsigned long long default_stream_id_now(int ordinal, bool per_thread,
                                                       bool blocking_capture_counted = false);

/// A new stream of device `ordinal` (cudaStreamCreateWithPriority), its priority already clamped.
GPUKIT_INLINE cudaStream_t create_stream(int ordinal, bool non_blocking, int priority);

/// Whether created stream `s` synchronizes with the legacy default stream (it lacks cudaStreamNonBlocking); true
/// where that cannot be asked (the stream is captured) or cudaStreamGetFlags fails, for callers that must assume the
/// worst.
GPUKIT_INLINE bool may_block_on_legacy_stream(cudaStream_t s) noexcept;

/// cudaStreamDestroy; a failure goes to gpukit::warn (destructors never throw).
GPUKIT_INLINE void destroy_stream(cudaStream_t handle, int ordinal, const char* where) noexcept;

/// cudaStreamGetPriority.
GPUKIT_INLINE int stream_priority(cudaStream_t handle, int ordinal);

/// Blocks until the stream's work has completed (cudaStreamSynchronize).
GPUKIT_INLINE void synchronize(const cuda_stream_target& s);

/// Whether the stream's work has completed (cudaStreamQuery; cudaErrorNotReady is forgotten, see forget_not_ready).
GPUKIT_INLINE bool ready(const cuda_stream_target& s);

/// cudaLaunchHostFunc(s, function, data).
GPUKIT_INLINE void launch_host_function(const cuda_stream_target& s, cudaHostFn_t function, void* data);

/// cudaStreamIsCapturing of stream `s` (its context entered): the result, with the status in `status` on success
/// (a failure is cleared from the thread's last error; the caller decides what it means).
GPUKIT_INLINE cudaError_t stream_capture_status(const cuda_stream_target& s, cudaStreamCaptureStatus& status);

/// Enqueues a copy of `bytes` bytes on stream `s` (cudaMemcpyAsync, the direction inferred from the pointers), with
/// device `ordinal`, the stream's, current.
GPUKIT_INLINE void copy_async(void* dst, const void* src, std::size_t bytes, cudaStream_t s, int ordinal);

/// Enqueues a copy of `bytes` bytes from device memory of `src_ordinal` to device memory of `dst_ordinal` on stream
/// `s` (cudaMemcpyPeerAsync; through the host where peer access is not enabled).
GPUKIT_INLINE void copy_peer_async(void* dst, int dst_ordinal, const void* src, int src_ordinal, std::size_t bytes,
                                   const cuda_stream_target& s);

// --- events ---

/// A new event of device `ordinal` with `flags` (cudaEventCreateWithFlags), with that device current.
GPUKIT_INLINE cudaEvent_t create_event(int ordinal, unsigned flags);

/// cudaEventDestroy; a failure goes to gpukit::warn (destructors never throw).
GPUKIT_INLINE void destroy_event(cudaEvent_t handle, int ordinal, const char* where) noexcept;

/// Records event `e` of device `ordinal` on stream `s` of the same device (cudaEventRecord). The default streams
/// mean "of the current device": the event's device is made current for them, and on a thread without a context.
GPUKIT_INLINE void record_event(cudaEvent_t e, int ordinal, cudaStream_t s);

/// cudaEventQuery's result, with cudaErrorNotReady forgotten (see forget_not_ready). Never throws.
GPUKIT_INLINE cudaError_t query_event(cudaEvent_t e) noexcept;

/// Whether the work event `e` captured has completed (cudaEventQuery); throws for an error.
GPUKIT_INLINE bool event_ready(cudaEvent_t e, int ordinal);

/// A new event without timing of device `ordinal`, recorded on stream `s` of that device, both with the device
/// current; nullptr when either call failed, with its result in `result`. Throws only what making the device current
/// throws.
GPUKIT_INLINE cudaEvent_t record_new_event(cudaStream_t s, int ordinal, cudaError_t& result);

/// Blocks until the work event `e` captured has completed (cudaEventSynchronize).
GPUKIT_INLINE void synchronize_event(cudaEvent_t e, int ordinal, const char* call = "cudaEventSynchronize");

/// Makes stream `s` wait on the device for event `e` of device `event_ordinal` (cudaStreamWaitEvent).
GPUKIT_INLINE void wait_event(const cuda_stream_target& s, cudaEvent_t e, int event_ordinal);

/// Milliseconds between two completed timing events (cudaEventElapsedTime).
GPUKIT_INLINE float elapsed_ms(cudaEvent_t start, cudaEvent_t end, int ordinal);

/// A handle another process can open with cudaIpcOpenEventHandle.
GPUKIT_INLINE cudaIpcEventHandle_t ipc_event_handle(cudaEvent_t e, int ordinal);

/// Blocks until device `ordinal` has completed all its work (cudaDeviceSynchronize, with it current).
GPUKIT_INLINE void synchronize_device(int ordinal, const char* call);

}  // namespace cuda_backend
}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE bool is_default_stream_handle(cudaStream_t h) noexcept {
  return h == nullptr || h == cudaStreamLegacy || h == cudaStreamPerThread;
}

GPUKIT_INLINE void forget_not_ready() noexcept { forget_failure(cudaErrorNotReady); }

GPUKIT_INLINE relaxed_capture_mode::relaxed_capture_mode(bool active) noexcept {
  if (!active) return;
  if (cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess) {
    exchanged_ = true;
  } else {
    (void)cudaGetLastError();
  }
}

GPUKIT_INLINE relaxed_capture_mode::~relaxed_capture_mode() {
  if (exchanged_ && cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) (void)cudaGetLastError();
}

/// The scope of a call that frees or unregisters page-locked host memory (cudaFreeHost, cudaHostUnregister), made from
/// destructors: it runs in relaxed capture mode (relaxed_capture_mode), and in a context that exists, `ordinal`'s
/// preferred (context_scope for any context), since it runs in the current context and on a thread that has none the
/// runtime would create cuda:0's. Never throws: when the device cannot be chosen (e.g. at exit) nothing changes.
class host_memory_release_scope {
 public:
  explicit host_memory_release_scope(int ordinal) noexcept;

 private:
  std::optional<context_scope> context_;  // declared first: restored after the capture mode
  std::optional<relaxed_capture_mode> relaxed_;
};

GPUKIT_INLINE host_memory_release_scope::host_memory_release_scope(int ordinal) noexcept {
  try {
    context_.emplace(ordinal, true);
  } catch (...) {
    (void)cudaGetLastError();
  }
  relaxed_.emplace(true);  // after the context is chosen: no runtime call here may pick cuda:0's for this thread
}
}  // namespace detail
namespace detail {
namespace cuda_backend {

GPUKIT_INLINE void remember_created_stream(cudaStream_t handle, created_stream known) {
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::unique_lock<std::shared_mutex> lock(table.mutex);
  table.created[handle] = known;
}

GPUKIT_INLINE bool remember_adopted_stream(cudaStream_t handle, created_stream known) {
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::unique_lock<std::shared_mutex> lock(table.mutex);
  return table.created.try_emplace(handle, known).second;
}

GPUKIT_INLINE void forget_created_stream(cudaStream_t handle) noexcept {
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::unique_lock<std::shared_mutex> lock(table.mutex);
  table.created.erase(handle);
}

GPUKIT_INLINE std::optional<created_stream> find_created_stream(cudaStream_t handle) noexcept {
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::shared_lock<std::shared_mutex> lock(table.mutex);
  const auto found = table.created.find(handle);
  if (found == table.created.end()) return std::nullopt;
  return found->second;
}

GPUKIT_INLINE unsigned long long next_own_stream_id() noexcept {
  return own_stream_id_bit | mode_independent::stream_table_v1().next_own_id.fetch_add(1, std::memory_order_relaxed);
}

GPUKIT_INLINE std::string describe_stream_handle(cudaStream_t handle, int ordinal) {
  std::string described = "stream " + format_pointer(static_cast<void*>(handle));
  if (ordinal >= 0) described += " of cuda:" + std::to_string(ordinal);
  return described;
}

GPUKIT_INLINE int stream_device(cudaStream_t handle, int described) {
  int ordinal = 0;
  if (is_default_stream_handle(handle)) {
    GPUKIT_CUDA_TRY_DESCRIBED(cudaGetDevice(&ordinal), "cudaGetDevice(&ordinal)", described);
    return ordinal;
  }
  if (const std::optional<created_stream> known = find_created_stream(handle)) return known->ordinal;
  const driver_api& api = driver();
  if (api.stream_get_ctx != nullptr && api.ctx_get_device != nullptr) {
    CUcontext context = nullptr;
    CUdevice device = -1;
    // A CUdevice is the ordinal of the device among the visible ones (what cuDeviceGet maps an ordinal to).
    if (api.stream_get_ctx(reinterpret_cast<CUstream>(handle), &context) == CUDA_SUCCESS &&
        api.ctx_get_device(&device, context) == CUDA_SUCCESS && device >= 0) {
      return static_cast<int>(device);
    }
  }
  // Without the driver's answer: cudaStreamGetDevice, unless the stream is captured (it would invalidate that).
  // Asked in the current context (with none, the runtime would make cuda:0's; a capturing thread has one).
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (thread_context_state() != 0) {
    const cudaError_t asked = cudaStreamIsCapturing(handle, &status);
    if (asked != cudaSuccess) {
      forget_failure(asked);  // cudaStreamGetDevice below says what is wrong with the handle
    } else if (status != cudaStreamCaptureStatusNone) {
      throw invalid_argument_error(
          "gpukit: the device of a stream being captured cannot be asked of CUDA (cudaStreamGetDevice would "
          "invalidate the capture) and the driver did not tell it (cuStreamGetCtx, cuCtxGetDevice): name the stream "
          "with its device (stream_view(device, handle)) or through a gpukit::stream");
    }
  }
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetDevice(handle, &ordinal),
                            "cudaStreamGetDevice(" + describe_stream_handle(handle, -1) + ")", described);
  return ordinal;
}

GPUKIT_INLINE bool captured_or_unknown(cudaStream_t handle, int ordinal) noexcept {
  try {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    return stream_capture_status({handle, ordinal}, status) != cudaSuccess || status != cudaStreamCaptureStatusNone;
  } catch (...) {
    return true;
  }
}

GPUKIT_INLINE unsigned long long stream_id_of(cudaStream_t handle, int ordinal) {
  if (const std::optional<created_stream> known = find_created_stream(handle)) return known->id;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  {
    std::optional<device_guard> guard;
    enter_stream_context({handle, ordinal}, guard);
    GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetCaptureInfo(handle, &status, &capture, nullptr, nullptr, nullptr, nullptr),
                              "cudaStreamGetCaptureInfo", ordinal);
  }
  if (status == cudaStreamCaptureStatusNone) return stream_id(handle, ordinal);
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::unique_lock<std::shared_mutex> lock(table.mutex);
  auto& named = table.captured[handle];  // one entry per handle: bounded by the streams alive at once
  if (named.second == 0 || named.first != capture) named = {capture, next_own_stream_id()};
  return named.second;
}

GPUKIT_INLINE int enter_stream_context(const cuda_stream_target& s, std::optional<device_guard>& guard) {
  if (is_default_stream_handle(s.handle)) {
    if (s.ordinal >= 0) guard.emplace(device::cuda(s.ordinal));
    return s.ordinal;
  }
  if (thread_context_state() != 0) return s.ordinal;
  const int ordinal = s.ordinal >= 0 ? s.ordinal : stream_device(s.handle);
  guard.emplace(device::cuda(ordinal));
  return ordinal;
}

GPUKIT_INLINE void throw_stream_call_error(cudaError_t result, const char* call, const cuda_stream_target& s,
                                           int entered, const char* file, int line) {
  int ordinal = s.ordinal >= 0 ? s.ordinal : entered;
  if (ordinal < 0 && !is_default_stream_handle(s.handle)) {
    if (const std::optional<created_stream> known = find_created_stream(s.handle)) ordinal = known->ordinal;
  }
  throw_cuda_error(result, std::string(call) + "(" + describe_stream_handle(s.handle, ordinal) + ")", ordinal, file,
                   line);
}

GPUKIT_INLINE unsigned long long stream_id(cudaStream_t handle, int ordinal) {
  unsigned long long id = 0;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetId(handle, &id), "cudaStreamGetId", ordinal);
  return id;
}

/// Keeps `id` as the legacy stream's in `*kept` unless another thread kept one first (then that one), and returns
/// the one kept; `id` when there is nowhere to keep it (a device beyond the table).
inline unsigned long long keep_legacy_stream_id(std::atomic<unsigned long long>* kept, unsigned long long id) noexcept {
  if (kept == nullptr) return id;
  unsigned long long expected = 0;
  return kept->compare_exchange_strong(expected, id) ? id : expected;
}

GPUKIT_INLINE unsigned long long default_stream_id_now(int ordinal, bool per_thread, bool blocking_capture_counted) {
  // The legacy stream's id, the same on every thread, is kept for the process: asked once, and not while a blocking
  // stream of the device is captured (cudaStreamIsCapturing of the legacy stream then answers
  // cudaErrorStreamCaptureImplicit; cudaStreamGetId would join the capture and invalidate it, as measured on an H200).
  // A gpukit capture cannot begin between the two calls (default_stream_id holds it off); one begun there with the
  // raw runtime is invalidated by the id's question: that capture's end reports it, and the id is one of gpukit's.
  mode_independent::stream_table& table = mode_independent::stream_table_v1();
  std::atomic<unsigned long long>* kept = nullptr;
  if (!per_thread) {
    if (static_cast<std::size_t>(ordinal) < table.legacy_ids.size()) {
      kept = &table.legacy_ids[static_cast<std::size_t>(ordinal)];
      if (const unsigned long long known = kept->load()) return known;
    }
    if (blocking_capture_counted) return keep_legacy_stream_id(kept, next_own_stream_id());  // no CUDA call
  }
  device_guard guard(device::cuda(ordinal));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(per_thread ? cudaStreamPerThread : cudaStreamLegacy, &status);
  forget_failure(asked);  // another failure: cudaStreamGetId below says what is wrong
  // The per-thread stream being captured: CUDA would refuse the id and invalidate the capture. One of gpukit's (the
  // caller keeps it for this thread and device).
  if (per_thread && asked == cudaSuccess && status != cudaStreamCaptureStatusNone) return next_own_stream_id();
  if (!per_thread && asked == cudaErrorStreamCaptureImplicit) return keep_legacy_stream_id(kept, next_own_stream_id());
  unsigned long long id = 0;
  const cudaError_t result = cudaStreamGetId(per_thread ? cudaStreamPerThread : cudaStreamLegacy, &id);
  if (!per_thread && (result == cudaErrorStreamCaptureImplicit || result == cudaErrorStreamCaptureUnsupported)) {
    forget_failure(result);
    return keep_legacy_stream_id(kept, next_own_stream_id());
  }
  GPUKIT_CUDA_TRY_DESCRIBED(
      result, per_thread ? "cudaStreamGetId(cudaStreamPerThread)" : "cudaStreamGetId(cudaStreamLegacy)", ordinal);
  return per_thread ? id : keep_legacy_stream_id(kept, id);
}

GPUKIT_INLINE bool may_block_on_legacy_stream(cudaStream_t s) noexcept {
  if (const std::optional<created_stream> known = find_created_stream(s)) return known->blocking;
  if (captured_or_unknown(s, -1)) return true;
  unsigned flags = 0;
  if (cudaStreamGetFlags(s, &flags) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return (flags & cudaStreamNonBlocking) == 0;
}

GPUKIT_INLINE cudaStream_t create_stream(int ordinal, bool non_blocking, int priority) {
  device_guard guard(device::cuda(ordinal));
  const unsigned flags = non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
  cudaStream_t handle = nullptr;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamCreateWithPriority(&handle, flags, priority),
                            std::string("cudaStreamCreateWithPriority(") +
                                (non_blocking ? "cudaStreamNonBlocking" : "cudaStreamDefault") + ", " +
                                std::to_string(priority) + ")",
                            ordinal);
  return handle;
}

/// Makes cuda:`ordinal` current in `guard` when no context is current: on such a thread the runtime would first create
/// cuda:0's for the call (PyTorch guards cudaEventDestroy and cudaEventElapsedTime for this). A failure to make it
/// current is left to the call itself.
inline void enter_device_without_context(int ordinal, std::optional<device_guard>& guard) noexcept {
  if (ordinal < 0 || thread_context_state() != 0) return;
  try {
    guard.emplace(device::cuda(ordinal));
  } catch (...) {  // e.g. at exit: the call reports what matters
  }
}

GPUKIT_INLINE void destroy_stream(cudaStream_t handle, int ordinal, const char* where) noexcept {
  std::optional<device_guard> guard;
  enter_device_without_context(ordinal, guard);
  report_cuda_failure(cudaStreamDestroy(handle), where, ordinal);
}

GPUKIT_INLINE int stream_priority(cudaStream_t handle, int ordinal) {
  std::optional<device_guard> guard;
  enter_stream_context({handle, ordinal}, guard);  // as every stream question: no cuda:0 context made on the way
  int priority = 0;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetPriority(handle, &priority), "cudaStreamGetPriority", ordinal);
  return priority;
}

GPUKIT_INLINE void synchronize(const cuda_stream_target& s) {
  std::optional<device_guard> guard;
  const int entered = enter_stream_context(s, guard);
  // A wait for a stream that is not captured is refused in global mode while any thread captures, and invalidates
  // that capture (measured on an H200); relaxed, it is not. On a captured stream it is refused either way.
  const relaxed_capture_mode relaxed;
  const cudaError_t result = cudaStreamSynchronize(s.handle);
  if (result != cudaSuccess) throw_stream_call_error(result, "cudaStreamSynchronize", s, entered, __FILE__, __LINE__);
}

GPUKIT_INLINE bool ready(const cuda_stream_target& s) {
  std::optional<device_guard> guard;
  const int entered = enter_stream_context(s, guard);
  const relaxed_capture_mode relaxed;  // as synchronize
  const cudaError_t result = cudaStreamQuery(s.handle);
  if (result == cudaSuccess) return true;
  if (result == cudaErrorNotReady) {
    forget_not_ready();
    return false;
  }
  throw_stream_call_error(result, "cudaStreamQuery", s, entered, __FILE__, __LINE__);
}

GPUKIT_INLINE void launch_host_function(const cuda_stream_target& s, cudaHostFn_t function, void* data) {
  std::optional<device_guard> guard;
  const int entered = enter_stream_context(s, guard);
  const cudaError_t result = cudaLaunchHostFunc(s.handle, function, data);
  if (result != cudaSuccess) throw_stream_call_error(result, "cudaLaunchHostFunc", s, entered, __FILE__, __LINE__);
}

GPUKIT_INLINE cudaError_t stream_capture_status(const cuda_stream_target& s, cudaStreamCaptureStatus& status) {
  std::optional<device_guard> guard;
  enter_stream_context(s, guard);
  const cudaError_t result = cudaStreamIsCapturing(s.handle, &status);
  if (result != cudaSuccess) (void)cudaGetLastError();
  return result;
}

GPUKIT_INLINE void copy_async(void* dst, const void* src, std::size_t bytes, cudaStream_t s, int ordinal) {
  device_guard guard(device::cuda(ordinal));
  GPUKIT_CUDA_TRY_DESCRIBED(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s),
                            "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes)", ordinal);
}

GPUKIT_INLINE void copy_peer_async(void* dst, int dst_ordinal, const void* src, int src_ordinal, std::size_t bytes,
                                   const cuda_stream_target& s) {
  std::optional<device_guard> guard;
  enter_stream_context(s, guard);
  // cudaMemcpyPeerAsync has no per-thread entry point: handle 0 would be the legacy stream even in per-thread code.
  cudaStream_t handle = s.handle;
  if (handle == nullptr && per_thread_default_stream_mode()) handle = cudaStreamPerThread;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaMemcpyPeerAsync(dst, dst_ordinal, src, src_ordinal, bytes, handle),
                            "cudaMemcpyPeerAsync(" + std::to_string(bytes) + " bytes, cuda:" +
                                std::to_string(src_ordinal) + " -> cuda:" + std::to_string(dst_ordinal) + ")",
                            s.ordinal >= 0 ? s.ordinal : dst_ordinal);  // where the call ran: the stream's device
}

/// "cudaEventDisableTiming | cudaEventInterprocess", for messages (unknown bits as a number).
GPUKIT_INLINE std::string event_flag_names(unsigned flags) {
  std::string names;
  for (const auto& [bit, name] : {std::pair<unsigned, const char*>{cudaEventBlockingSync, "cudaEventBlockingSync"},
                                  {cudaEventDisableTiming, "cudaEventDisableTiming"},
                                  {cudaEventInterprocess, "cudaEventInterprocess"}}) {
    if ((flags & bit) == 0) continue;
    names += (names.empty() ? "" : " | ") + std::string(name);
    flags &= ~bit;
  }
  if (flags != 0) names += (names.empty() ? "" : " | ") + std::to_string(flags);
  return names.empty() ? "cudaEventDefault" : names;
}

GPUKIT_INLINE cudaEvent_t create_event(int ordinal, unsigned flags) {
  device_guard guard(device::cuda(ordinal));
  cudaEvent_t handle = nullptr;
  GPUKIT_CUDA_TRY_DESCRIBED(cudaEventCreateWithFlags(&handle, flags),
                            "cudaEventCreateWithFlags(" + event_flag_names(flags) + ")", ordinal);
  return handle;
}

GPUKIT_INLINE void destroy_event(cudaEvent_t handle, int ordinal, const char* where) noexcept {
  std::optional<device_guard> guard;
  enter_device_without_context(ordinal, guard);
  report_cuda_failure(cudaEventDestroy(handle), where, ordinal);
}

GPUKIT_INLINE void record_event(cudaEvent_t e, int ordinal, cudaStream_t s) {
  std::optional<device_guard> guard;
  if (is_default_stream_handle(s) || thread_context_state() == 0) guard.emplace(device::cuda(ordinal));
  GPUKIT_CUDA_TRY_DESCRIBED(cudaEventRecord(e, s), "cudaEventRecord", ordinal);
}

GPUKIT_INLINE cudaError_t query_event(cudaEvent_t e) noexcept {
  const relaxed_capture_mode relaxed;  // another thread may be capturing in global mode (see relaxed_capture_mode)
  const cudaError_t result = cudaEventQuery(e);
  if (result == cudaErrorNotReady) forget_not_ready();
  return result;
}

GPUKIT_INLINE bool event_ready(cudaEvent_t e, int ordinal) {
  const cudaError_t result = query_event(e);
  if (result == cudaSuccess) return true;
  if (result == cudaErrorNotReady) return false;
  throw_cuda_error(result, "cudaEventQuery", ordinal, __FILE__, __LINE__);
}

GPUKIT_INLINE cudaEvent_t record_new_event(cudaStream_t s, int ordinal, cudaError_t& result) {
  device_guard guard(device::cuda(ordinal));
  cudaEvent_t e = nullptr;
  result = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  if (result != cudaSuccess) return nullptr;
  result = cudaEventRecord(e, s);
  if (result == cudaSuccess) return e;
  (void)cudaEventDestroy(e);
  return nullptr;
}

GPUKIT_INLINE void synchronize_event(cudaEvent_t e, int ordinal, const char* call) {
  const relaxed_capture_mode relaxed;  // as in query_event
  GPUKIT_CUDA_TRY_DESCRIBED(cudaEventSynchronize(e), call, ordinal);
}

GPUKIT_INLINE void wait_event(const cuda_stream_target& s, cudaEvent_t e, int event_ordinal) {
  std::optional<device_guard> guard;
  enter_stream_context(s, guard);
  GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamWaitEvent(s.handle, e, 0),
                            s.ordinal >= 0 && s.ordinal != event_ordinal
                                ? "cudaStreamWaitEvent (a stream of cuda:" + std::to_string(s.ordinal) +
                                      ", an event of cuda:" + std::to_string(event_ordinal) + ")"
                                : std::string("cudaStreamWaitEvent"),
                            event_ordinal);
}

GPUKIT_INLINE float elapsed_ms(cudaEvent_t start, cudaEvent_t end, int ordinal) {
  std::optional<device_guard> guard;  // as in destroy_event, but a failure to enter the device is thrown
  if (ordinal >= 0 && thread_context_state() == 0) guard.emplace(device::cuda(ordinal));
  float ms = 0.0f;
  const cudaError_t result = cudaEventElapsedTime(&ms, start, end);
  if (result == cudaErrorInvalidResourceHandle) {
    // gpukit's timing events are valid handles unless the context went (cudaDeviceReset): most likely, one was never
    // recorded.
    (void)cudaGetLastError();
    throw invalid_argument_error(
        "gpukit::elapsed_time: an event was never recorded, or its handle is no longer valid (cudaDeviceReset "
        "destroys every event of the device): cudaEventElapsedTime returned cudaErrorInvalidResourceHandle on cuda:" +
            std::to_string(ordinal),
        cudaErrorInvalidResourceHandle, "cudaEventElapsedTime", ordinal);
  }
  GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaEventElapsedTime", ordinal);
  return ms;
}

GPUKIT_INLINE cudaIpcEventHandle_t ipc_event_handle(cudaEvent_t e, int ordinal) {
  std::optional<device_guard> guard;
  enter_device_without_context(ordinal, guard);  // as for cudaEventElapsedTime: not cuda:0's context first
  cudaIpcEventHandle_t handle{};
  GPUKIT_CUDA_TRY_DESCRIBED(cudaIpcGetEventHandle(&handle, e), "cudaIpcGetEventHandle", ordinal);
  return handle;
}

GPUKIT_INLINE void synchronize_device(int ordinal, const char* call) {
  device_guard guard(device::cuda(ordinal));
  GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceSynchronize(), call, ordinal);
}

}  // namespace cuda_backend
}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
