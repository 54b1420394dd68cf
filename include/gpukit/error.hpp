// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The error model: one exception hierarchy rooted in gpukit::error (a std::runtime_error) and a macro that turns a
/// failed CUDA runtime call into an exception whose message a user can act on (file output that fails throws
/// std::system_error instead, with the system's reason). The warning channel, used where
/// throwing is not allowed, is in warning.hpp. This header is included everywhere, so it pulls in only
/// `<stdexcept>`, `<string>` and the CUDA runtime's declarations.
///
/// | CUDA result                                                  | thrown type            |
/// |--------------------------------------------------------------|------------------------|
/// | cudaErrorInsufficientDriver (35), cudaErrorStubLibrary (34)  | no_device_error        |
/// | cudaErrorNoDevice (100), cudaErrorDevicesUnavailable (46)    | no_device_error        |
/// | cudaErrorInitializationError (3), cudaErrorSystemNotReady    | no_device_error        |
/// | (802), cudaErrorSystemDriverMismatch (803),                  |                        |
/// | cudaErrorCompatNotSupportedOnDevice (804): CUDA cannot start |                        |
/// | cudaErrorMemoryAllocation (2)                                | out_of_memory_error    |
/// | cudaErrorInvalidDevice (101) while cudaGetDeviceCount fails  | no_device_error        |
/// | with it too: CUDA_VISIBLE_DEVICES named a device twice       |                        |
/// | cudaErrorInvalidValue (1), cudaErrorInvalidDevice (101)      | invalid_argument_error |
/// | anything else                                                | cuda_error             |

#include <gpukit/detail/config.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

// Outside the per-mode namespace (detail/config.hpp): CUDA reads CUDA_VISIBLE_DEVICES once per process, so code built
// in either default-stream mode must compare against the same snapshot.
namespace gpukit {
namespace mode_independent {

/// The CUDA_VISIBLE_DEVICES value in effect when gpukit first touched CUDA in this process. CUDA reads the
/// variable once, at initialisation, so later changes have no effect; diagnostics compare against this.
struct cuda_environment_snapshot {
  bool set = false;   ///< whether the variable was set
  std::string value;  ///< its value (empty when unset)
};

/// CUDA_VISIBLE_DEVICES now.
inline cuda_environment_snapshot read_cuda_environment() {
  cuda_environment_snapshot now;
  if (const char* value = std::getenv("CUDA_VISIBLE_DEVICES")) {
    now.set = true;
    now.value = value;
  }
  return now;
}

/// The process's snapshot, taken at the first call (exported: one per process). Never destroyed: error messages
/// built by other statics' destructors read it. The name carries the layout's version, as upstream_streams_v1's does.
GPUKIT_EXPORT GPUKIT_INLINE const cuda_environment_snapshot& cuda_environment_at_init_v1();

/// Whether the snapshot above was taken (detail::cuda_environment_at_init, when gpukit first uses CUDA). Until then
/// diagnostics describe the variable as it is now, which CUDA will read if it initialises before it changes: taking
/// the snapshot for a message (select_device's on a given system_snapshot, say) would fix a value CUDA never read.
GPUKIT_EXPORT GPUKIT_INLINE std::atomic<bool>& cuda_environment_taken_v1() noexcept;

#if GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS
GPUKIT_INLINE const cuda_environment_snapshot& cuda_environment_at_init_v1() {
  static const auto* snapshot = new cuda_environment_snapshot(read_cuda_environment());
  return *snapshot;
}
GPUKIT_INLINE std::atomic<bool>& cuda_environment_taken_v1() noexcept {
  static std::atomic<bool> taken{false};
  return taken;
}
#endif  // GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

/// What kind of failure an error reports; every gpukit exception has exactly one.
enum class errc : int {
  cuda = 1,          ///< a CUDA runtime call failed for a reason not listed below
  no_device,         ///< no usable device: no driver, no GPU, or none that satisfies a requirement
  out_of_memory,     ///< an allocation could not be satisfied
  invalid_argument,  ///< bad input or misuse of the API (double free, moved-from object, wrong device, ...)
};

/// Root of every exception gpukit throws. Carries the failing CUDA call, its result and the device where known.
/// Copying never throws, as std::exception requires (the call's text is kept in a std::runtime_error, whose copies
/// share their string).
class error : public std::runtime_error {
 public:
  /// \param code        the category of the failure
  /// \param message     the full, human-readable message returned by what()
  /// \param cuda_result the CUDA result that caused it, or cudaSuccess when no CUDA call was involved
  /// \param call        the call that failed, with its arguments where known (e.g. "cudaSetDevice(3)")
  /// \param device      the CUDA ordinal concerned, or -1 when none or unknown
  /// \param file        the source file of the failing call, or nullptr; not copied, so it must outlive the
  ///                    exception (a string literal such as `__FILE__`)
  /// \param line        the source line of the failing call, or 0
  error(errc code, const std::string& message, cudaError_t cuda_result = cudaSuccess, std::string call = {},
        int device = -1, const char* file = nullptr, int line = 0);

  /// The category of the failure.
  errc code() const noexcept;
  /// The CUDA result that caused the error, or cudaSuccess when the error did not come from a CUDA call.
  cudaError_t cuda_result() const noexcept;
  /// cudaGetErrorName of cuda_result(), e.g. "cudaErrorInvalidDevice"; "cudaSuccess" when not a CUDA failure.
  const char* cuda_error_name() const noexcept;
  /// The call that failed, with its arguments where known; empty when not a CUDA failure. Valid as long as the
  /// exception (or a copy of it) lives.
  std::string_view call() const noexcept;
  /// The CUDA device ordinal concerned, or -1.
  int device() const noexcept;
  /// Source file of the failing call inside gpukit (or the user's GPUKIT_CUDA_TRY), or nullptr.
  const char* file() const noexcept;
  /// Source line of the failing call, or 0.
  int line() const noexcept;

 private:
  errc code_;
  cudaError_t cuda_result_;
  int device_;
  int line_;
  const char* file_;
  std::runtime_error call_;  // a nothrow-copyable string (what(): the call's text)
};

/// A CUDA runtime call failed (for a reason not covered by the more specific types below).
class cuda_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::cuda).
  cuda_error(const std::string& message, cudaError_t cuda_result, std::string call = {}, int device = -1,
             const char* file = nullptr, int line = 0);
};

/// No usable device: no driver, no GPU, or no device satisfying a selection requirement.
class no_device_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::no_device).
  explicit no_device_error(const std::string& message, cudaError_t cuda_result = cudaSuccess, std::string call = {},
                           int device = -1, const char* file = nullptr, int line = 0);
};

/// An allocation could not be satisfied (by CUDA, the host, or a gpukit allocator's limit).
class out_of_memory_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::out_of_memory).
  explicit out_of_memory_error(const std::string& message, cudaError_t cuda_result = cudaSuccess, std::string call = {},
                               int device = -1, const char* file = nullptr, int line = 0);
};

/// Bad input or misuse: an invalid ordinal, a malformed string, a moved-from object, a double free, ...
class invalid_argument_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::invalid_argument).
  explicit invalid_argument_error(const std::string& message, cudaError_t cuda_result = cudaSuccess,
                                  std::string call = {}, int device = -1, const char* file = nullptr, int line = 0);
};

// ---------------------------------------------------------------------------------------------------------------
// Warnings
// ---------------------------------------------------------------------------------------------------------------

namespace detail {
GPUKIT_INLINE void print_warning_to_stderr(std::string_view message, bool from_inside_handler) noexcept;
GPUKIT_INLINE void print_warning(std::string_view message) noexcept;

/// Where warn() sends a message: stderr until set_warning_handler (warning.hpp) installs its dispatcher. Exported,
/// one per process; constant-initialised, so usable at any time, including static destruction.
using warning_sink = void (*)(std::string_view message) noexcept;
GPUKIT_EXPORT GPUKIT_INLINE std::atomic<warning_sink>& warning_sink_slot() noexcept;

/// The warnings of a thread that holds a lock a warning handler may need (the caching allocator's device lock:
/// memory/detail/device_mutex.hpp; a lock_guard with a hold_warnings declared before it): warn() keeps them while
/// `depth` is not 0, and the end of the last hold delivers them in the order they were raised, so that handlers run
/// outside gpukit's locks, as set_warning_handler promises, and may call gpukit (what a handler raises goes to stderr
/// at once, as warning.hpp says, held or not). Trivially destructible (no thread-exit destructor, so warn() works in
/// any destructor): `pending` lives only while a hold lasts or its warnings are being delivered.
struct held_warnings {
  unsigned depth = 0;              // holds this thread has
  bool delivering = false;         // deliver_held_warnings is running (the handler's own warnings are not kept)
  std::string* pending = nullptr;  // each warning: its length (sizeof(std::size_t) bytes), then its text
};
/// This thread's; exported, so that every shared library's gpukit sees the same.
GPUKIT_EXPORT GPUKIT_INLINE held_warnings& warnings_held_on_this_thread() noexcept;
/// Delivers (to the sink) and forgets the warnings this thread kept; call once `depth` is 0 again.
GPUKIT_INLINE void deliver_held_warnings() noexcept;

/// Ends one hold of `held` (the calling thread's); the end of the last delivers what the holds kept.
inline void end_hold(held_warnings& held) noexcept {
  if (--held.depth == 0 && held.pending != nullptr) deliver_held_warnings();
}

/// RAII hold: declared before a lock_guard, its warnings reach the handler once the lock is released.
class hold_warnings {
 public:
  hold_warnings() noexcept : held_(warnings_held_on_this_thread()) { ++held_.depth; }
  ~hold_warnings() { end_hold(held_); }
  hold_warnings(const hold_warnings&) = delete;
  hold_warnings& operator=(const hold_warnings&) = delete;

 private:
  held_warnings& held_;
};
}  // namespace detail

/// Reports what cannot be thrown (inside destructors and host callbacks) or is only a diagnostic (e.g.
/// CUDA_VISIBLE_DEVICES changed after CUDA was initialised): to stderr as "gpukit warning: <message>", or to the
/// handler set with set_warning_handler (warning.hpp). Never throws.
GPUKIT_INLINE void warn(std::string_view message) noexcept;

// ---------------------------------------------------------------------------------------------------------------
// Building CUDA error messages
// ---------------------------------------------------------------------------------------------------------------

namespace detail {

using mode_independent::cuda_environment_snapshot;

/// mode_independent::cuda_environment_at_init_v1: one snapshot for both default-stream modes. Taking it marks it taken
/// (mode_independent::cuda_environment_taken_v1), from which on diagnostics compare against it.
inline const cuda_environment_snapshot& cuda_environment_at_init() {
  const cuda_environment_snapshot& snapshot = mode_independent::cuda_environment_at_init_v1();
  std::atomic<bool>& taken = mode_independent::cuda_environment_taken_v1();
  if (!taken.load(std::memory_order_relaxed)) taken.store(true, std::memory_order_release);
  return snapshot;
}

/// Called by gpukit before its first CUDA call in a code path, so the snapshot above is taken no later than CUDA's
/// own initialisation triggered by gpukit.
GPUKIT_INLINE void note_cuda_use();

/// Whether CUDA_VISIBLE_DEVICES differs now from its value at cuda_environment_at_init (CUDA ignores the change);
/// false until that snapshot is taken (gpukit has not used CUDA: nothing was read yet).
GPUKIT_INLINE bool visible_devices_variable_changed();

/// The value of CUDA_VISIBLE_DEVICES that CUDA reads, as far as gpukit can tell: cuda_environment_at_init once taken,
/// else the value now (without taking the snapshot).
GPUKIT_INLINE cuda_environment_snapshot visible_devices_variable_in_effect();

/// A value of CUDA_VISIBLE_DEVICES for messages: `"0,1"` (quoted) or `unset`.
GPUKIT_INLINE std::string show_variable_value(const cuda_environment_snapshot& v);

/// CUDA_VISIBLE_DEVICES as CUDA read it (cuda_environment_at_init), for messages: `CUDA_VISIBLE_DEVICES="0,1"` or
/// `CUDA_VISIBLE_DEVICES unset`, followed by the value now where the process changed it since (CUDA ignores that).
GPUKIT_INLINE std::string describe_visible_devices_variable();

/// One sentence on what a CUDA result usually means, for the results users meet most on misconfigured machines.
GPUKIT_INLINE const char* cuda_result_hint(cudaError_t result) noexcept;

/// "<call> failed[ on cuda:N]: <description> (<name>); <k> device(s) visible; CUDA_VISIBLE_DEVICES=...; <hint>".
/// Counting the devices leaves no CUDA error behind (without a driver that count fails too); `counted`, when given,
/// receives what cudaGetDeviceCount returned.
GPUKIT_INLINE std::string cuda_failure_message(cudaError_t result, std::string_view call, int device,
                                               cudaError_t* counted = nullptr);

/// Throws the gpukit exception that corresponds to a failed CUDA call (see the table at the top of this file).
/// Also clears CUDA's last-error state so the failure is not reported again by an unrelated call.
[[noreturn]] GPUKIT_INLINE void throw_cuda_error(cudaError_t result, std::string_view call, int device,
                                                 const char* file, int line);

/// True for the results of a CUDA runtime or driver that is already torn down, as at process exit:
/// cudaErrorCudartUnloading (the runtime is unloading; also what the driver's CUDA_ERROR_DEINITIALIZED, the same
/// value 4, becomes; the runtime has no cudaErrorDeinitialized) and cudaErrorContextIsDestroyed (the primary context
/// is gone). The resources of the process went with them: there is nothing left to release or report.
constexpr bool is_teardown_result(cudaError_t result) noexcept {
  return result == cudaErrorCudartUnloading || result == cudaErrorContextIsDestroyed;
}

/// Forgets the failure `result` of a call gpukit made for itself (a probe, or a status such as cudaErrorNotReady),
/// if the runtime recorded it as the last error: a CUDA error the program had pending stays.
inline void forget_failure(cudaError_t result) noexcept {
  if (result != cudaSuccess && cudaPeekAtLastError() == result) (void)cudaGetLastError();
}

/// For destructors and other places that must not throw: reports a failed CUDA call as a warning. Teardown results
/// (is_teardown_result: destructors running after main returned) are not reported.
GPUKIT_INLINE void report_cuda_failure(cudaError_t result, std::string_view call, int device) noexcept;

}  // namespace detail
GPUKIT_END_NAMESPACE

/// Evaluates a CUDA runtime call and throws the matching gpukit exception if it fails. The message names the call as
/// written, e.g. `GPUKIT_CUDA_TRY(cudaDeviceSynchronize());`.
#define GPUKIT_CUDA_TRY(call_expression) GPUKIT_CUDA_TRY_DESCRIBED(call_expression, #call_expression, -1)

/// Like GPUKIT_CUDA_TRY, but with a description of the call (evaluated only on failure, so it may build a string
/// with the argument values) and the device ordinal concerned (-1 when none).
#define GPUKIT_CUDA_TRY_DESCRIBED(call_expression, description, device_ordinal)                                     \
  do {                                                                                                              \
    const cudaError_t gpukit_cuda_result_ = (call_expression);                                                      \
    if (gpukit_cuda_result_ != cudaSuccess) {                                                                       \
      ::gpukit::detail::throw_cuda_error(gpukit_cuda_result_, (description), (device_ordinal), __FILE__, __LINE__); \
    }                                                                                                               \
  } while (false)

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE error::error(errc code, const std::string& message, cudaError_t cuda_result, std::string call, int device,
                           const char* file, int line)
    : std::runtime_error(message),
      code_(code),
      cuda_result_(cuda_result),
      device_(device),
      line_(line),
      file_(file),
      call_(call) {}

GPUKIT_INLINE errc error::code() const noexcept { return code_; }

GPUKIT_INLINE cudaError_t error::cuda_result() const noexcept { return cuda_result_; }

GPUKIT_INLINE const char* error::cuda_error_name() const noexcept { return cudaGetErrorName(cuda_result_); }

GPUKIT_INLINE std::string_view error::call() const noexcept { return call_.what(); }

GPUKIT_INLINE int error::device() const noexcept { return device_; }

GPUKIT_INLINE const char* error::file() const noexcept { return file_; }

GPUKIT_INLINE int error::line() const noexcept { return line_; }

GPUKIT_INLINE cuda_error::cuda_error(const std::string& message, cudaError_t cuda_result, std::string call, int device,
                                     const char* file, int line)
    : error(errc::cuda, message, cuda_result, std::move(call), device, file, line) {}

GPUKIT_INLINE no_device_error::no_device_error(const std::string& message, cudaError_t cuda_result, std::string call,
                                               int device, const char* file, int line)
    : error(errc::no_device, message, cuda_result, std::move(call), device, file, line) {}

GPUKIT_INLINE out_of_memory_error::out_of_memory_error(const std::string& message, cudaError_t cuda_result,
                                                       std::string call, int device, const char* file, int line)
    : error(errc::out_of_memory, message, cuda_result, std::move(call), device, file, line) {}

GPUKIT_INLINE invalid_argument_error::invalid_argument_error(const std::string& message, cudaError_t cuda_result,
                                                             std::string call, int device, const char* file, int line)
    : error(errc::invalid_argument, message, cuda_result, std::move(call), device, file, line) {}
namespace detail {

GPUKIT_INLINE void print_warning_to_stderr(std::string_view message, bool from_inside_handler) noexcept {
  std::fprintf(stderr, "gpukit warning%s: %.*s\n", from_inside_handler ? " (raised inside the warning handler)" : "",
               static_cast<int>(message.size()), message.data());
}

GPUKIT_INLINE void print_warning(std::string_view message) noexcept { print_warning_to_stderr(message, false); }

GPUKIT_INLINE std::atomic<warning_sink>& warning_sink_slot() noexcept {
  static std::atomic<warning_sink> sink{&print_warning};
  return sink;
}
}  // namespace detail

GPUKIT_INLINE void warn(std::string_view message) noexcept {
  detail::held_warnings& held = detail::warnings_held_on_this_thread();
  // Not while held warnings are being delivered: one raised then is the handler's own, which goes to stderr at once
  // (marked as raised inside the handler) as any other it raises, rather than back into it later.
  if (held.depth != 0 && !held.delivering) {
    try {
      if (held.pending == nullptr) held.pending = new std::string();
      const std::size_t size = message.size();
      held.pending->reserve(held.pending->size() + sizeof size + size);  // the record goes in whole, or not at all
      held.pending->append(reinterpret_cast<const char*>(&size), sizeof size);
      held.pending->append(message.data(), size);
      return;
    } catch (...) {  // no memory to keep it: delivered now, under the lock (before those kept), rather than lost
    }
  }
  detail::warning_sink_slot().load(std::memory_order_acquire)(message);
}
namespace detail {

GPUKIT_INLINE held_warnings& warnings_held_on_this_thread() noexcept {
  static thread_local held_warnings held;
  return held;
}

GPUKIT_INLINE void deliver_held_warnings() noexcept {
  held_warnings& held = warnings_held_on_this_thread();
  std::string* const batch = std::exchange(held.pending, nullptr);
  if (batch == nullptr) return;
  // Nothing is kept while the handler runs (warn): a lock it takes and releases has nothing to deliver, and the batch
  // is complete.
  held.delivering = true;
  const warning_sink sink = warning_sink_slot().load(std::memory_order_acquire);
  for (std::size_t at = 0; at + sizeof(std::size_t) <= batch->size();) {
    std::size_t size = 0;
    batch->copy(reinterpret_cast<char*>(&size), sizeof size, at);
    at += sizeof size;
    sink(std::string_view(batch->data() + at, size));
    at += size;
  }
  held.delivering = false;
  delete batch;
}
}  // namespace detail
namespace detail {

GPUKIT_INLINE void note_cuda_use() { (void)cuda_environment_at_init(); }

GPUKIT_INLINE bool visible_devices_variable_changed() {
  if (!mode_independent::cuda_environment_taken_v1().load(std::memory_order_acquire)) return false;
  const cuda_environment_snapshot& at_init = cuda_environment_at_init();
  const cuda_environment_snapshot now = mode_independent::read_cuda_environment();
  return now.set != at_init.set || now.value != at_init.value;
}

GPUKIT_INLINE cuda_environment_snapshot visible_devices_variable_in_effect() {
  if (!mode_independent::cuda_environment_taken_v1().load(std::memory_order_acquire)) {
    return mode_independent::read_cuda_environment();
  }
  return cuda_environment_at_init();
}

GPUKIT_INLINE std::string show_variable_value(const cuda_environment_snapshot& v) {
  return v.set ? "\"" + v.value + "\"" : std::string("unset");
}

GPUKIT_INLINE std::string describe_visible_devices_variable() {
  const cuda_environment_snapshot at_init = visible_devices_variable_in_effect();
  std::string text = "CUDA_VISIBLE_DEVICES" + (at_init.set ? "=" + show_variable_value(at_init) : " unset");
  if (visible_devices_variable_changed()) {
    text += " when CUDA read it (" + show_variable_value(mode_independent::read_cuda_environment()) +
            " now, which CUDA does not read again)";
  }
  return text;
}

GPUKIT_INLINE const char* cuda_result_hint(cudaError_t result) noexcept {
  switch (result) {
    case cudaErrorInsufficientDriver:
      return "no NVIDIA driver is loaded, or it is older than this CUDA runtime; select_device() falls back to the "
             "CPU";
    case cudaErrorStubLibrary:
      return "the toolkit's stub libcuda.so is on the library path instead of the driver's";
    case cudaErrorNoDevice:
      return "no CUDA-capable GPU is visible (check CUDA_VISIBLE_DEVICES)";
    case cudaErrorSystemDriverMismatch:
      return "the NVIDIA kernel module and its user-space driver library differ in version, usually after a driver "
             "upgrade without a reboot: reboot (or reload the nvidia kernel module)";
    case cudaErrorInitializationError:
      return "CUDA could not start: in a process forked after its parent used CUDA, CUDA is unusable (start workers "
             "with spawn, or make the parent's first CUDA call after the fork); otherwise check the driver "
             "(nvidia-smi)";
    case cudaErrorInvalidDevice:
      return "the ordinal is not below the number of visible devices";
    case cudaErrorTooManyPeers:
      return "a device can have peer access enabled to at most about 8 others (over PCIe): release peer_access "
             "objects no longer needed, or copy device to device with copy_async, which needs no peer access";
    // Stream capture: what the error names rarely says which rule the program broke.
    case cudaErrorCapturedEvent:
      return "the event was last recorded inside a stream capture, where it belongs to the graph being built: the "
             "host cannot query or wait for it (record it after the graph's launch instead)";
    case cudaErrorStreamCaptureUnsupported:
      return "the call is not permitted while a stream capture is underway (a synchronize or query of the captured "
             "stream, or a device-wide wait, in any mode; other unsafe calls from the capturing thread unless it or "
             "the "
             "capture is relaxed and, during a capture in global mode, from threads whose own mode is global), or the "
             "legacy default stream was to be "
             "captured, which CUDA never allows: make the call before or after the capture";
    case cudaErrorStreamCaptureImplicit:
      return "work on the legacy default stream would join the capture of a blocking stream of its device: capture "
             "non-blocking streams (gpukit::stream's default), or keep the default stream idle meanwhile";
    case cudaErrorStreamCaptureInvalidated:
      return "an earlier error during the capture (often a call not permitted while capturing) invalidated it; "
             "cudaStreamEndCapture ends it, returning this error and no graph, and the stream is usable again";
    case cudaErrorStreamCaptureUnjoined:
      return "a stream forked into the capture (it waited for an event recorded there) was not joined back into the "
             "stream that began it before the capture ended";
    case cudaErrorStreamCaptureWrongThread:
      return "a capture in global or thread-local mode must be ended by the thread that began it";
    case cudaErrorStreamCaptureIsolation:
      return "a wait crossed a capture's boundary: a stream being captured waited for an event recorded outside the "
             "capture, or a stream waited for an event last recorded in a capture that has ended (it belongs to that "
             "graph: record it again outside a capture)";
    case cudaErrorStreamCaptureMerge:
      return "a stream of one capture waited for an event recorded in another capture: two captures cannot be merged";
    default:
      return nullptr;
  }
}

GPUKIT_INLINE std::string cuda_failure_message(cudaError_t result, std::string_view call, int device,
                                               cudaError_t* counted) {
  int visible = 0;  // stays 0 without a driver: out-parameters are not written on error
  const cudaError_t count_result = cudaGetDeviceCount(&visible);
  if (counted != nullptr) *counted = count_result;
  if (count_result != cudaSuccess) {
    visible = 0;
    // The count is only for the text: its failure (35 without a driver) must not become the program's last error,
    // which throw_cuda_error and report_cuda_failure have just cleared.
    forget_failure(count_result);
  }
  std::string message(call);
  message += " failed";
  if (device >= 0) message += " on cuda:" + std::to_string(device);
  message += ": ";
  message += cudaGetErrorString(result);
  message += " (";
  message += cudaGetErrorName(result);
  message += "); ";
  message += std::to_string(visible);
  message += visible == 1 ? " device visible; " : " devices visible; ";
  message += describe_visible_devices_variable();
  if (result == cudaErrorInvalidDevice && count_result == cudaErrorInvalidDevice) {
    // cudaGetDeviceCount takes no ordinal: an H100 answered it so for CUDA_VISIBLE_DEVICES="0,0" (a repeat).
    message += "; CUDA hides every device, as it does when CUDA_VISIBLE_DEVICES names a device twice";
  } else if (const char* hint = cuda_result_hint(result)) {
    message += "; ";
    message += hint;
  }
  return message;
}

GPUKIT_INLINE void throw_cuda_error(cudaError_t result, std::string_view call, int device, const char* file, int line) {
  (void)cudaGetLastError();
  cudaError_t counted = cudaSuccess;
  std::string message = cuda_failure_message(result, call, device, &counted);
  std::string call_text(call);
  if (result == cudaErrorInvalidDevice && counted == cudaErrorInvalidDevice) {  // every device hidden: no GPU
    throw no_device_error(message, result, std::move(call_text), device, file, line);
  }
  switch (result) {
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
    // CUDA failed to initialise: no GPU is usable, as device_count() (0) and select_device() (the CPU) take it.
    case cudaErrorInitializationError:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      throw no_device_error(message, result, std::move(call_text), device, file, line);
    case cudaErrorMemoryAllocation:
      throw out_of_memory_error(message, result, std::move(call_text), device, file, line);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
      throw invalid_argument_error(message, result, std::move(call_text), device, file, line);
    default:
      throw cuda_error(message, result, std::move(call_text), device, file, line);
  }
}

GPUKIT_INLINE void report_cuda_failure(cudaError_t result, std::string_view call, int device) noexcept {
  if (result == cudaSuccess) return;
  (void)cudaGetLastError();
  if (is_teardown_result(result)) return;
  try {
    warn(cuda_failure_message(result, call, device));
  } catch (...) {  // std::bad_alloc: the essentials, formatted on the stack
    char text[256];
    const int call_length = static_cast<int>(call.size() < 128 ? call.size() : 128);
    const int length = device >= 0
                           ? std::snprintf(text, sizeof text, "%.*s failed on cuda:%d: %s (%s)", call_length,
                                           call.data(), device, cudaGetErrorString(result), cudaGetErrorName(result))
                           : std::snprintf(text, sizeof text, "%.*s failed: %s (%s)", call_length, call.data(),
                                           cudaGetErrorString(result), cudaGetErrorName(result));
    const std::size_t written = length < 0 ? 0 : static_cast<std::size_t>(length);
    warn(std::string_view(text, written < sizeof text ? written : sizeof text - 1));
  }
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
