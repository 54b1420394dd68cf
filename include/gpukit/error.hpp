// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The error model: one exception hierarchy rooted in gpukit::error (a std::runtime_error), a macro that turns a
/// failed CUDA runtime call into an exception whose message a user can act on, and the warning channel used where
/// throwing is not allowed (destructors, host callbacks) or not wanted (diagnostics).
///
/// | CUDA result                                                  | thrown type            |
/// |--------------------------------------------------------------|------------------------|
/// | cudaErrorInsufficientDriver (35), cudaErrorStubLibrary (34)  | no_device_error        |
/// | cudaErrorNoDevice (100), cudaErrorDevicesUnavailable (46)    | no_device_error        |
/// | cudaErrorMemoryAllocation (2)                                | out_of_memory_error    |
/// | cudaErrorInvalidValue (1), cudaErrorInvalidDevice (101)      | invalid_argument_error |
/// | anything else                                                | cuda_error             |

#include <gpukit/detail/config.hpp>

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

/// What kind of failure an error reports; every gpukit exception has exactly one.
enum class errc : int {
  cuda = 1,          ///< a CUDA runtime call failed for a reason not listed below
  no_device,         ///< no usable device: no driver, no GPU, or none that satisfies a requirement
  out_of_memory,     ///< an allocation could not be satisfied
  invalid_argument,  ///< bad input or misuse of the API (double free, moved-from object, wrong device, ...)
};

/// Root of every exception gpukit throws. Carries the failing CUDA call, its result and the device where known.
/// Copying never throws (the details are shared), as std::exception requires.
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
        int device = -1, const char* file = nullptr, int line = 0)
      : std::runtime_error(message),
        code_(code),
        details_(std::make_shared<const details>(details{cuda_result, std::move(call), device, file, line})) {}

  /// The category of the failure.
  errc code() const noexcept { return code_; }
  /// The CUDA result that caused the error, or cudaSuccess when the error did not come from a CUDA call.
  cudaError_t cuda_result() const noexcept { return details_->cuda_result; }
  /// cudaGetErrorName of cuda_result(), e.g. "cudaErrorInvalidDevice"; "cudaSuccess" when not a CUDA failure.
  const char* cuda_error_name() const noexcept { return cudaGetErrorName(details_->cuda_result); }
  /// The call that failed, with its arguments where known; empty when not a CUDA failure.
  const std::string& call() const noexcept { return details_->call; }
  /// The CUDA device ordinal concerned, or -1.
  int device() const noexcept { return details_->device; }
  /// Source file of the failing call inside gpukit (or the user's GPUKIT_CUDA_TRY), or nullptr.
  const char* file() const noexcept { return details_->file; }
  /// Source line of the failing call, or 0.
  int line() const noexcept { return details_->line; }

 private:
  struct details {
    cudaError_t cuda_result;
    std::string call;
    int device;
    const char* file;
    int line;
  };
  errc code_;
  std::shared_ptr<const details> details_;
};

/// A CUDA runtime call failed (for a reason not covered by the more specific types below).
class cuda_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::cuda).
  cuda_error(const std::string& message, cudaError_t cuda_result, std::string call = {}, int device = -1,
             const char* file = nullptr, int line = 0)
      : error(errc::cuda, message, cuda_result, std::move(call), device, file, line) {}
};

/// No usable device: no driver, no GPU, or no device satisfying a selection requirement.
class no_device_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::no_device).
  explicit no_device_error(const std::string& message, cudaError_t cuda_result = cudaSuccess, std::string call = {},
                           int device = -1, const char* file = nullptr, int line = 0)
      : error(errc::no_device, message, cuda_result, std::move(call), device, file, line) {}
};

/// An allocation could not be satisfied (by CUDA, the host, or a gpukit allocator's limit).
class out_of_memory_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::out_of_memory).
  explicit out_of_memory_error(const std::string& message, cudaError_t cuda_result = cudaSuccess, std::string call = {},
                               int device = -1, const char* file = nullptr, int line = 0)
      : error(errc::out_of_memory, message, cuda_result, std::move(call), device, file, line) {}
};

/// Bad input or misuse: an invalid ordinal, a malformed string, a moved-from object, a double free, ...
class invalid_argument_error : public error {
 public:
  /// Takes the same arguments as error's constructor, less the code (always errc::invalid_argument).
  explicit invalid_argument_error(const std::string& message, cudaError_t cuda_result = cudaSuccess,
                                  std::string call = {}, int device = -1, const char* file = nullptr, int line = 0)
      : error(errc::invalid_argument, message, cuda_result, std::move(call), device, file, line) {}
};

// ---------------------------------------------------------------------------------------------------------------
// Warnings
// ---------------------------------------------------------------------------------------------------------------

/// Receives gpukit's warnings: errors that cannot be thrown (inside destructors and host callbacks) and diagnostics
/// (e.g. CUDA_VISIBLE_DEVICES changed after CUDA was initialised). Called from any thread, possibly from several at
/// once (calls are not serialized); must not throw.
///
/// A handler may call warn() and set_warning_handler() itself. A warning raised on a thread that is already inside
/// the handler is not handed to the handler again (that could recurse forever): it goes to the default sink,
/// stderr, as "gpukit warning (raised inside the warning handler): <message>". A handler that replaces itself
/// finishes the call in progress; the new handler receives the warnings after it.
using warning_handler = std::function<void(std::string_view message)>;

namespace detail {
/// One installed handler, with the number of calls of it in progress (guarded by warning_state::mutex).
struct installed_warning_handler {
  explicit installed_warning_handler(warning_handler h) : handler(std::move(h)) {}
  warning_handler handler;
  std::size_t calls_in_progress = 0;
};

struct warning_state {
  std::mutex mutex;
  std::condition_variable call_finished;
  std::shared_ptr<installed_warning_handler> current;  // null: print to stderr
};
// Constructed on first use (never at static initialisation) and never destroyed: destructors that run after main
// returns (objects at namespace scope, singletons) may still warn, after a destroyed static would be gone.
GPUKIT_EXPORT inline warning_state& warnings() {
  static warning_state* state = new warning_state();
  return *state;
}
/// The handler the calling thread is running now, or nullptr. Exported like warnings(): a handler that warns
/// through another shared library's copy of gpukit is still recognised as re-entrant.
GPUKIT_EXPORT inline const installed_warning_handler*& warning_handler_running_on_this_thread() {
  thread_local const installed_warning_handler* running = nullptr;
  return running;
}

inline void print_warning_to_stderr(std::string_view message, bool from_inside_handler) noexcept {
  std::fprintf(stderr, "gpukit warning%s: %.*s\n", from_inside_handler ? " (raised inside the warning handler)" : "",
               static_cast<int>(message.size()), message.data());
}
}  // namespace detail

/// Replaces the warning handler and returns the previous one. An empty handler restores the default, which writes
/// "gpukit warning: <message>" to stderr. When it returns, no other thread is still running the previous handler
/// (so whatever it refers to may be destroyed); a call of it in progress on the calling thread (a handler replacing
/// itself) is not waited for, and completes.
inline warning_handler set_warning_handler(warning_handler handler) {
  auto& state = detail::warnings();
  std::shared_ptr<detail::installed_warning_handler> replacement;
  if (handler) replacement = std::make_shared<detail::installed_warning_handler>(std::move(handler));
  std::unique_lock<std::mutex> lock(state.mutex);
  std::shared_ptr<detail::installed_warning_handler> previous = std::exchange(state.current, std::move(replacement));
  if (!previous) return {};
  const bool running_here = detail::warning_handler_running_on_this_thread() == previous.get();
  const std::size_t own_calls = running_here ? 1 : 0;
  state.call_finished.wait(lock, [&] { return previous->calls_in_progress == own_calls; });
  // The calling thread's own call is still running the target: hand back a copy, not the object itself.
  if (running_here) return previous->handler;
  return std::move(previous->handler);
}

/// Delivers a warning to the current handler, outside any gpukit lock. Never throws: a throwing handler is ignored.
inline void warn(std::string_view message) noexcept {
  try {
    auto& state = detail::warnings();
    const detail::installed_warning_handler*& running = detail::warning_handler_running_on_this_thread();
    if (running != nullptr) {  // raised from inside the handler: not back into it
      detail::print_warning_to_stderr(message, true);
      return;
    }
    std::shared_ptr<detail::installed_warning_handler> target;
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      target = state.current;
      if (target) ++target->calls_in_progress;
    }
    if (!target) {
      detail::print_warning_to_stderr(message, false);
      return;
    }
    // Counted while it runs, so set_warning_handler on another thread waits for the call to end.
    struct call_in_progress {
      detail::warning_state& state;
      detail::installed_warning_handler& target;
      const detail::installed_warning_handler*& running;
      ~call_in_progress() {
        running = nullptr;
        {
          std::lock_guard<std::mutex> lock(state.mutex);
          --target.calls_in_progress;
        }
        state.call_finished.notify_all();
      }
    } guard{state, *target, running};
    running = target.get();
    try {
      target->handler(message);
    } catch (...) {
    }
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Building CUDA error messages
// ---------------------------------------------------------------------------------------------------------------

namespace detail {

/// `"value"` or `unset` for an environment variable, for messages.
inline std::string describe_environment_variable(const char* name) {
  const char* value = std::getenv(name);
  std::string text = name;
  if (value == nullptr) return text + " unset";
  return text + "=\"" + value + "\"";
}

/// One sentence on what a CUDA result usually means, for the results users meet most on misconfigured machines.
inline const char* cuda_result_hint(cudaError_t result) noexcept {
  switch (result) {
    case cudaErrorInsufficientDriver:
      return "no NVIDIA driver is loaded, or it is older than this CUDA runtime; select_device() falls back to the "
             "CPU";
    case cudaErrorStubLibrary:
      return "the toolkit's stub libcuda.so is on the library path instead of the driver's";
    case cudaErrorNoDevice:
      return "no CUDA-capable GPU is visible (check CUDA_VISIBLE_DEVICES)";
    case cudaErrorInvalidDevice:
      return "the ordinal is not below the number of visible devices";
    default:
      return nullptr;
  }
}

/// "<call> failed[ on cuda:N]: <description> (<name>); <k> device(s) visible; CUDA_VISIBLE_DEVICES=...; <hint>"
inline std::string cuda_failure_message(cudaError_t result, std::string_view call, int device) {
  int visible = 0;  // stays 0 without a driver: out-parameters are not written on error
  if (cudaGetDeviceCount(&visible) != cudaSuccess) visible = 0;
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
  message += describe_environment_variable("CUDA_VISIBLE_DEVICES");
  if (const char* hint = cuda_result_hint(result)) {
    message += "; ";
    message += hint;
  }
  return message;
}

/// Throws the gpukit exception that corresponds to a failed CUDA call (see the table at the top of this file).
/// Also clears CUDA's last-error state so the failure is not reported again by an unrelated call.
[[noreturn]] inline void throw_cuda_error(cudaError_t result, std::string_view call, int device, const char* file,
                                          int line) {
  (void)cudaGetLastError();
  std::string message = cuda_failure_message(result, call, device);
  std::string call_text(call);
  switch (result) {
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
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

/// True for the results of a CUDA runtime or driver that is already torn down, as at process exit:
/// cudaErrorCudartUnloading (the runtime is unloading; also what the driver's CUDA_ERROR_DEINITIALIZED, the same
/// value 4, becomes; the runtime has no cudaErrorDeinitialized) and cudaErrorContextIsDestroyed (the primary context
/// is gone). The resources of the process went with them: there is nothing left to release or report.
constexpr bool is_teardown_result(cudaError_t result) noexcept {
  return result == cudaErrorCudartUnloading || result == cudaErrorContextIsDestroyed;
}

/// For destructors and other places that must not throw: reports a failed CUDA call as a warning. Teardown results
/// (is_teardown_result: destructors running after main returned) are not reported.
inline void report_cuda_failure(cudaError_t result, std::string_view call, int device) noexcept {
  if (result == cudaSuccess) return;
  if (is_teardown_result(result)) {
    (void)cudaGetLastError();
    return;
  }
  try {
    (void)cudaGetLastError();
    warn(cuda_failure_message(result, call, device));
  } catch (...) {
  }
}

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
