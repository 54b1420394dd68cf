// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Where warnings go: set_warning_handler() installs a handler that receives every warn() (error.hpp), in place of
/// stderr. Kept apart from error.hpp, which every header includes, so that only the programs that set a handler
/// pull in std::function and the mutexes.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

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
  explicit installed_warning_handler(warning_handler h);
  warning_handler handler;
  std::size_t calls_in_progress = 0;
};

struct warning_state;
// Constructed on first use (never at static initialisation) and never destroyed: destructors that run after main
// returns (objects at namespace scope, singletons) may still warn, after a destroyed static would be gone.
GPUKIT_EXPORT GPUKIT_INLINE warning_state& warnings();
/// The handler the calling thread is running now, or nullptr. Exported like warnings(): a handler that warns
/// through another shared library's copy of gpukit is still recognised as re-entrant.
GPUKIT_EXPORT GPUKIT_INLINE const installed_warning_handler*& warning_handler_running_on_this_thread();

}  // namespace detail

namespace detail {
/// The warning sink once a handler has been set: delivers `message` to the current handler (or stderr when it was
/// reset), outside any gpukit lock. Never throws: a throwing handler is ignored.
GPUKIT_EXPORT GPUKIT_INLINE void deliver_warning_to_handler(std::string_view message) noexcept;
}  // namespace detail

/// Replaces the warning handler and returns the previous one. An empty handler restores the default, which writes
/// "gpukit warning: <message>" to stderr. When it returns, no other thread is still running the previous handler
/// (so whatever it refers to may be destroyed); a call of it in progress on the calling thread (a handler replacing
/// itself) is not waited for, and completes.
GPUKIT_INLINE warning_handler set_warning_handler(warning_handler handler);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

struct warning_state {
  std::mutex mutex;
  std::condition_variable call_finished;
  std::shared_ptr<installed_warning_handler> current;  // null: print to stderr
};

GPUKIT_INLINE installed_warning_handler::installed_warning_handler(warning_handler h) : handler(std::move(h)) {}

GPUKIT_INLINE warning_state& warnings() {
  static warning_state* state = new warning_state();
  return *state;
}

GPUKIT_INLINE const installed_warning_handler*& warning_handler_running_on_this_thread() {
  thread_local const installed_warning_handler* running = nullptr;
  return running;
}

GPUKIT_INLINE void deliver_warning_to_handler(std::string_view message) noexcept {
  try {
    auto& state = warnings();
    const installed_warning_handler*& running = warning_handler_running_on_this_thread();
    if (running != nullptr) {  // raised from inside the handler: not back into it
      print_warning_to_stderr(message, true);
      return;
    }
    std::shared_ptr<installed_warning_handler> target;
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      target = state.current;
      if (target) ++target->calls_in_progress;
    }
    if (!target) {
      print_warning_to_stderr(message, false);
      return;
    }
    // Counted while it runs, so set_warning_handler on another thread waits for the call to end.
    struct call_in_progress {
      warning_state& state;
      installed_warning_handler& target;
      const installed_warning_handler*& running;
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
}  // namespace detail

GPUKIT_INLINE warning_handler set_warning_handler(warning_handler handler) {
  auto& state = detail::warnings();
  std::shared_ptr<detail::installed_warning_handler> replacement;
  if (handler) replacement = std::make_shared<detail::installed_warning_handler>(std::move(handler));
  std::unique_lock<std::mutex> lock(state.mutex);
  // From the first handler on, warn() goes through the handler's bookkeeping (error.hpp's sink prints until then).
  detail::warning_sink_slot().store(&detail::deliver_warning_to_handler, std::memory_order_release);
  std::shared_ptr<detail::installed_warning_handler> previous = std::exchange(state.current, std::move(replacement));
  if (!previous) return {};
  const bool running_here = detail::warning_handler_running_on_this_thread() == previous.get();
  const std::size_t own_calls = running_here ? 1 : 0;
  state.call_finished.wait(lock, [&] { return previous->calls_in_progress == own_calls; });
  // The calling thread's own call is still running the target: hand back a copy, not the object itself.
  if (running_here) return previous->handler;
  return std::move(previous->handler);
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
