// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CPU device's streams: an in-order asynchronous queue served by one worker thread, and markers that complete
/// when the work enqueued before them has completed. They give CPU streams and events the semantics of CUDA's, so
/// the ordering logic built on streams (the allocator's stream-ordered reuse, the transfer ring) is exercised by
/// tests on machines without a GPU. Users reach them through gpukit::stream and gpukit::event, which use them
/// through the CPU backend (cpu_backend.hpp).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/error.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// A move-only `void()` callable (std::function requires copyable targets; tasks often own buffers).
class host_task {
 public:
  host_task() noexcept = default;
  template <class F, class = std::enable_if_t<!std::is_same<std::decay_t<F>, host_task>::value>>
  host_task(F&& f) : callable_(std::make_unique<model<std::decay_t<F>>>(std::forward<F>(f))) {}  // NOLINT: implicit
  void operator()();
  explicit operator bool() const noexcept;

 private:
  struct concept_base {
    virtual ~concept_base() = default;
    virtual void call() = 0;
  };
  template <class F>
  struct model final : concept_base {
    explicit model(F&& f) : function(std::move(f)) {}
    explicit model(const F& f) : function(f) {}
    void call() override { function(); }
    F function;
  };
  std::unique_ptr<concept_base> callable_;
};

/// Calls a host function, turning an escaping exception into a warning: a stream cannot deliver it to anyone (CUDA
/// host functions cannot either), and the queue must go on.
template <class F>
void call_reporting_exceptions(F& function) noexcept {
  try {
    function();
  } catch (const std::exception& e) {
    warn_parts("a host function enqueued on a stream threw, and was abandoned: ", e.what());
  } catch (...) {
    warn("a host function enqueued on a stream threw a non-standard exception, and was abandoned");
  }
}

/// Per thread: whether a host function runs inline on it now (the CPU default stream's, or a CUDA host function's
/// trampoline), and the host functions enqueued inline from inside it, which run after it returns.
struct inline_host_functions {
  bool running = false;
  // Those from `next` on wait to run, in order. A vector, not a deque: it allocates nothing until a host function is
  // deferred (a deque allocates when made, here inside a noexcept function) and reuses its room afterwards.
  std::vector<host_task> deferred;
  std::size_t next = 0;
};
/// This thread's inline_host_functions; nullptr once this thread's thread_local objects are destroyed (code that runs
/// after: at exit, a static's destructor or an atexit handler on the main thread).
GPUKIT_EXPORT GPUKIT_INLINE inline_host_functions* inline_host_functions_state() noexcept;
/// After that: the state of the outermost host function running inline on this thread (on its call's stack), or
/// nullptr. A trivially destructible pointer, usable until the thread ends.
GPUKIT_EXPORT GPUKIT_INLINE inline_host_functions*& inline_host_functions_after_teardown() noexcept;

/// run_host_function with this thread's state.
template <class F>
void run_host_function_in(inline_host_functions& state, F& function) noexcept {
  if (state.running) {
    if constexpr (std::is_move_constructible<F>::value) {
      // Room first, then the task: whichever allocation fails (std::bad_alloc), `function` has not been moved from.
      bool room = false;
      try {
        state.deferred.emplace_back();
        room = true;
        state.deferred.back() = host_task(std::move(function));
        return;
      } catch (...) {
        if (room) state.deferred.pop_back();
        // Out of memory for the deferred task: run it nested, as before (it is not lost).
      }
    }
    call_reporting_exceptions(function);
    return;
  }
  state.running = true;
  call_reporting_exceptions(function);
  while (state.next < state.deferred.size()) {
    host_task task = std::move(state.deferred[state.next++]);
    call_reporting_exceptions(task);
    if (state.next >= 1024 && 2 * state.next >= state.deferred.size()) {  // a long chain: drop what has run
      state.deferred.erase(state.deferred.begin(), state.deferred.begin() + static_cast<std::ptrdiff_t>(state.next));
      state.next = 0;
    }
  }
  state.deferred.clear();  // keeps its room for the next time
  state.next = 0;
  state.running = false;
}

/// Runs a host function inline, on the calling thread (the CPU default stream, CUDA host-function trampolines),
/// reporting an escaping exception through gpukit::warn.
///
/// One enqueued from inside another one running inline on this thread does not run nested: it runs after the
/// enclosing one returns, in enqueue order, before the outermost call returns. That is the stream order (work
/// enqueued by a host function comes after it), and it runs a chain of host functions that enqueue each other, any
/// number deep, iteratively instead of exhausting the stack. (A task of a CPU stream's worker is not inline: the CPU
/// default stream still runs work at once inside it.)
template <class F>
void run_host_function(F& function) noexcept {
  if (inline_host_functions* state = inline_host_functions_state()) return run_host_function_in(*state, function);
  // At exit, after this thread's state was destroyed: the outermost call keeps one on its stack for those nested in it.
  inline_host_functions*& after = inline_host_functions_after_teardown();
  if (after != nullptr) return run_host_function_in(*after, function);
  inline_host_functions outermost;
  after = &outermost;
  run_host_function_in(outermost, function);
  after = nullptr;
}

/// Completion of one recorded point in a CPU queue: done once every task enqueued before it has finished.
class cpu_marker {
 public:
  /// A marker that the thread `worker` completes (its queue's worker; none for one completed at once).
  explicit cpu_marker(std::thread::id worker = {}) noexcept : worker_(worker) {}
  /// Marks completion and wakes waiters; records the completion time for event timing.
  void complete() noexcept;
  bool done() const noexcept;
  /// Blocks the calling thread until the marker completes. Called from a task of the queue the marker was recorded on
  /// (before the marker: it would wait forever), throws invalid_argument_error instead, as cpu_queue::synchronize does.
  void wait() const;
  /// When the marker completed; meaningful once done().
  std::chrono::steady_clock::time_point completed_at() const;
  /// A marker that is already complete (work recorded on the CPU's synchronous default stream).
  static std::shared_ptr<cpu_marker> completed();

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::chrono::steady_clock::time_point completed_at_{};
  const std::thread::id worker_;
};

/// An in-order queue of host tasks run by one worker thread. Thread-safe: any number of threads may enqueue.
class cpu_queue {
 public:
  cpu_queue();

  /// stop(), if it was not called before.
  ~cpu_queue();

  cpu_queue(const cpu_queue&) = delete;
  cpu_queue& operator=(const cpu_queue&) = delete;

  /// Runs every task still queued, then stops the worker: destroying a stream with pending work is defined and
  /// waits for that work. Called by one of its own tasks (one that held the last reference to its stream), it runs
  /// the tasks queued after that one itself, and the worker ends once the task returns (after any task enqueued
  /// meanwhile). Later calls do nothing.
  /// Once the worker has ended the queue answers idle(), and record() gives a marker already complete (all the work
  /// has run): one who still holds the destroyed stream's record (an allocator's free that saw it alive) may ask.
  /// Other work is refused then (enqueue).
  void stop() noexcept;

  /// Appends a task; it runs after every task enqueued before it. Throws invalid_argument_error once the worker has
  /// ended (stop(): its stream was destroyed), since nothing would run it.
  void enqueue(host_task task);

  /// Appends a marker that completes when the tasks enqueued so far have finished; once the worker has ended, a
  /// marker already complete.
  std::shared_ptr<cpu_marker> record();

  /// Blocks until every task enqueued before the call has finished. Calling it from one of this queue's own tasks
  /// would wait forever, so that throws invalid_argument_error.
  void synchronize();

  /// True when every enqueued task has finished. Lock-free (allocators ask on every free): reading `finished`
  /// before `enqueued` makes a true answer exact, because `finished` only grows.
  bool idle() const noexcept;

  /// Tasks enqueued but not finished.
  std::uint64_t pending() const;

 private:
  /// What the worker uses: shared with it, so that it outlives a queue destroyed by one of its own tasks.
  struct state {
    mutable std::mutex mutex;
    std::condition_variable work_cv;
    std::condition_variable idle_cv;
    std::deque<host_task> tasks;
    // Written under mutex; atomic so idle() can read them without it.
    std::atomic<std::uint64_t> enqueued{0};
    std::atomic<std::uint64_t> finished{0};
    bool stopping = false;
    bool closed = false;  // the worker has ended (stopping, and drained): nothing runs tasks any more
  };

  static void serve(const std::shared_ptr<state>& st);
  /// Runs the next task, if any, with `lock` (on st.mutex) held on entry and exit: false when there was none.
  static bool run_next(state& st, std::unique_lock<std::mutex>& lock);
  /// Appends `task`, or leaves it and returns false once the worker has ended.
  bool try_enqueue(host_task& task);

  std::shared_ptr<state> state_ = std::make_shared<state>();
  bool stopped_ = false;  // stop() ran (it is called by the stream's owner, then by the destructor)
  std::thread worker_;    // started after the state is made
  // The worker's id, never written again: synchronize() may run on another thread while stop() joins or detaches
  // worker_ (a free that saw the stream alive, racing its destruction), so it must not read worker_.
  const std::thread::id worker_id_ = worker_.get_id();
};

}  // namespace detail
GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE void host_task::operator()() { callable_->call(); }

GPUKIT_INLINE host_task::operator bool() const noexcept { return static_cast<bool>(callable_); }

GPUKIT_INLINE inline_host_functions* inline_host_functions_state() noexcept {
  thread_local bool torn_down = false;  // trivially destructible: readable after the state's destruction
  if (torn_down) return nullptr;
  struct owner {
    bool& torn_down;
    inline_host_functions state;
    ~owner() { torn_down = true; }
  };
  thread_local owner kept{torn_down, {}};
  return &kept.state;
}

GPUKIT_INLINE inline_host_functions*& inline_host_functions_after_teardown() noexcept {
  thread_local inline_host_functions* state = nullptr;
  return state;
}

GPUKIT_INLINE void cpu_marker::complete() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_at_ = std::chrono::steady_clock::now();
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

GPUKIT_INLINE bool cpu_marker::done() const noexcept { return done_.load(std::memory_order_acquire); }

GPUKIT_INLINE void cpu_marker::wait() const {
  if (done()) return;
  // Not done: the worker has not run the marker yet, so it is alive and no other thread has its id.
  if (std::this_thread::get_id() == worker_) {
    throw invalid_argument_error(
        "gpukit: a CPU event was waited for (event::synchronize, elapsed_time, or event::wait on the CPU default "
        "stream) from a host function of the CPU stream it was later recorded on, which would wait forever");
  }
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done(); });
}

GPUKIT_INLINE std::chrono::steady_clock::time_point cpu_marker::completed_at() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_at_;
}

GPUKIT_INLINE std::shared_ptr<cpu_marker> cpu_marker::completed() {
  auto marker = std::make_shared<cpu_marker>();
  marker->complete();
  return marker;
}

GPUKIT_INLINE cpu_queue::cpu_queue() : worker_([st = state_] { serve(st); }) {}

GPUKIT_INLINE cpu_queue::~cpu_queue() { stop(); }

GPUKIT_INLINE void cpu_queue::stop() noexcept {
  if (std::exchange(stopped_, true)) return;
  state& st = *state_;
  const bool from_own_task = std::this_thread::get_id() == worker_id_;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    st.stopping = true;
  }
  st.work_cv.notify_one();
  if (!from_own_task) {
    if (worker_.joinable()) worker_.join();
    return;
  }
  // Stopped by the task the worker runs now (a join would wait for itself): the tasks queued after it run here,
  // in order, as the worker would have run them; the worker then finds nothing left and ends.
  {
    std::unique_lock<std::mutex> lock(st.mutex);
    while (run_next(st, lock)) {
    }
  }
  worker_.detach();
}

GPUKIT_INLINE bool cpu_queue::try_enqueue(host_task& task) {
  state& st = *state_;
  {
    std::lock_guard<std::mutex> lock(st.mutex);
    if (st.closed) return false;
    st.tasks.push_back(std::move(task));
    st.enqueued.fetch_add(1, std::memory_order_release);
  }
  st.work_cv.notify_one();
  return true;
}

GPUKIT_INLINE void cpu_queue::enqueue(host_task task) {
  if (!try_enqueue(task)) {
    throw invalid_argument_error("gpukit: work enqueued on a destroyed CPU stream (nothing would run it)");
  }
}

GPUKIT_INLINE std::shared_ptr<cpu_marker> cpu_queue::record() {
  auto marker = std::make_shared<cpu_marker>(worker_id_);
  host_task completes([marker] { marker->complete(); });
  if (!try_enqueue(completes)) marker->complete();  // the worker ended: every task has run
  return marker;
}

GPUKIT_INLINE void cpu_queue::synchronize() {
  state& st = *state_;
  std::unique_lock<std::mutex> lock(st.mutex);
  // Once the worker has ended its id may be another thread's (ids of ended threads are reused), and nothing is left
  // to wait for.
  if (!st.closed && std::this_thread::get_id() == worker_id_) {
    lock.unlock();
    throw invalid_argument_error(
        "gpukit: a CPU stream was synchronized from one of its own host functions, which would wait forever");
  }
  const std::uint64_t target = st.enqueued.load(std::memory_order_relaxed);
  st.idle_cv.wait(lock, [&] { return st.finished.load(std::memory_order_relaxed) >= target; });
}

GPUKIT_INLINE bool cpu_queue::idle() const noexcept {
  const std::uint64_t finished = state_->finished.load(std::memory_order_acquire);
  return finished == state_->enqueued.load(std::memory_order_acquire);
}

GPUKIT_INLINE std::uint64_t cpu_queue::pending() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->enqueued.load(std::memory_order_relaxed) - state_->finished.load(std::memory_order_relaxed);
}

GPUKIT_INLINE void cpu_queue::serve(const std::shared_ptr<state>& shared) {
  state& st = *shared;
  std::unique_lock<std::mutex> lock(st.mutex);
  for (;;) {
    st.work_cv.wait(lock, [&st] { return st.stopping || !st.tasks.empty(); });
    if (!run_next(st, lock)) {  // stopping, and drained
      st.closed = true;
      return;
    }
  }
}

GPUKIT_INLINE bool cpu_queue::run_next(state& st, std::unique_lock<std::mutex>& lock) {
  if (st.tasks.empty()) return false;
  host_task task = std::move(st.tasks.front());
  st.tasks.pop_front();
  lock.unlock();
  call_reporting_exceptions(task);  // not inline: the CPU default stream runs at once inside a queue task
  task = host_task();               // release what the task owns before it counts as finished (may end the queue)
  lock.lock();
  st.finished.fetch_add(1, std::memory_order_release);
  st.idle_cv.notify_all();
  return true;
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
