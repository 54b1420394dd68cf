// Helpers shared by gpukit's tests.
#pragma once

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/warning.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

/// In a GPU test: when no CUDA device is usable, print the marker that ctest maps to "Skipped" and return.
#define GPUKIT_REQUIRE_GPU()                                                          \
  do {                                                                                \
    if (::gpukit::device_count() == 0) {                                              \
      std::printf("GPUKIT_TEST_SKIPPED: no CUDA device is usable on this machine\n"); \
      std::fflush(stdout);                                                            \
      return;                                                                         \
    }                                                                                 \
  } while (false)

namespace gpukit_test {

/// The default memory pool of `d` (cudaMallocAsync's). Throws std::runtime_error if CUDA refuses.
inline cudaMemPool_t default_pool(gpukit::device d) {
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&pool, d.ordinal()) != cudaSuccess) {
    throw std::runtime_error("cudaDeviceGetDefaultMemPool failed");
  }
  return pool;
}

/// Bytes live in the default pool of `d` (cudaMemPoolAttrUsedMemCurrent): 0 once every cudaMallocAsync is freed. Its
/// reserved memory may stay, since gpukit raises the pool's release threshold to keep everything.
inline std::size_t pool_bytes_in_use(gpukit::device d) {
  cuuint64_t used = 0;
  if (cudaMemPoolGetAttribute(default_pool(d), cudaMemPoolAttrUsedMemCurrent, &used) != cudaSuccess) {
    throw std::runtime_error("cudaMemPoolGetAttribute(cudaMemPoolAttrUsedMemCurrent) failed");
  }
  return static_cast<std::size_t>(used);
}

/// True in a sanitizer build (GPUKIT_SANITIZE, which defines GPUKIT_TEST_SANITIZED). Tests whose cost is checking
/// or filling memory, not running gpukit's code, do less of it there: the sanitizers instrument every byte, and the
/// plain build still does it all.
#if defined(GPUKIT_TEST_SANITIZED)
inline constexpr bool sanitized_build = true;
#else
inline constexpr bool sanitized_build = false;
#endif

/// True when the CUDA runtime is the simulated one (tests/cudasim): its devices say so in their names. Performance
/// checks, which only a real GPU can answer, are skipped there.
inline bool on_simulator() {
  cudaDeviceProp p{};
  return gpukit::device_count() > 0 && cudaGetDeviceProperties(&p, 0) == cudaSuccess &&
         std::string(p.name).find("(cudasim)") != std::string::npos;
}

/// Sets (or, with nullopt, unsets) an environment variable for a scope, restoring the previous value.
class scoped_env {
 public:
  scoped_env(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = std::string(old);
    apply(value);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() { apply(previous_); }

 private:
  void apply(const std::optional<std::string>& value) {
    if (value) {
      setenv(name_, value->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  const char* name_;
  std::optional<std::string> previous_;
};

/// A gate host tasks wait on, to hold a stream's work back while a test looks at the state in between. Destroyed
/// unopened (a failed REQUIRE, an exception), it opens: the held work must not wait for good, since on a GPU every
/// host function waits behind it and the test's teardown waits for the device (a hang, not a failure). Its state
/// is shared with the held host functions, which may run after it is gone.
class gate {
 public:
  gate() = default;
  gate(const gate&) = delete;
  gate& operator=(const gate&) = delete;
  ~gate() { open(); }

  void open() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->open = true;
    state_->cv.notify_all();
  }
  void wait() {
    const std::shared_ptr<shared_state> state = state_;  // the gate may be destroyed meanwhile
    wait_for(*state);
  }
  /// Enqueues a wait for this gate on `s`: everything enqueued after it is held until open().
  void hold(gpukit::stream_view s) {
    s.enqueue_host([state = state_] { wait_for(*state); });
  }
  /// Runs call() while the gate is closed. If it has not returned after `limit`, a watchdog opens the gate, so that a
  /// call that waits for the held work (a regression) returns and the test fails instead of hanging. True when the
  /// gate had to be opened. If call() throws, the gate is opened as well, so that the held work does not wait on a
  /// gate the unwinding may destroy.
  template <class Call>
  bool opened_to_return(Call&& call, std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::mutex m;
    std::condition_variable returned_cv;
    bool returned = false;
    bool opened = false;
    std::thread watchdog([&] {
      std::unique_lock<std::mutex> lock(m);
      if (!returned_cv.wait_for(lock, limit, [&] { return returned; })) {
        opened = true;
        open();
      }
    });
    struct stop_watchdog {
      gate& g;
      std::mutex& m;
      std::condition_variable& cv;
      bool& returned;
      std::thread& watchdog;
      int exceptions = std::uncaught_exceptions();
      ~stop_watchdog() {
        {
          std::lock_guard<std::mutex> lock(m);
          returned = true;
        }
        cv.notify_all();
        watchdog.join();
        if (std::uncaught_exceptions() > exceptions) g.open();  // call threw: let the held work go
      }
    };
    {
      stop_watchdog stop{*this, m, returned_cv, returned, watchdog};  // also when call throws
      call();
    }
    return opened;
  }

 private:
  struct shared_state {
    std::mutex mutex;
    std::condition_variable cv;
    bool open = false;
  };
  static void wait_for(shared_state& st) {
    std::unique_lock<std::mutex> lock(st.mutex);
    st.cv.wait(lock, [&] { return st.open; });
  }
  std::shared_ptr<shared_state> state_ = std::make_shared<shared_state>();
};

/// Runs calls on threads of their own and waits a bounded time for each. A call that would wait for a lock its
/// caller holds (a regression) then fails a check instead of hanging the test. A late call finishes once the caller
/// lets go, and the destructor joins it: declare the object after everything the calls touch, outside the region
/// that holds the lock.
class bounded_calls {
 public:
  bounded_calls() = default;
  bounded_calls(const bounded_calls&) = delete;
  bounded_calls& operator=(const bounded_calls&) = delete;
  ~bounded_calls() {
    for (std::thread& t : late_) t.join();
  }

  /// True when call() returned within `limit`.
  template <class Call>
  bool returned_within(Call call, std::chrono::seconds limit = std::chrono::seconds(20)) {
    std::packaged_task<void()> task(std::move(call));
    std::future<void> returned = task.get_future();
    std::thread worker(std::move(task));
    if (returned.wait_for(limit) == std::future_status::ready) {
      worker.join();
      returned.get();  // its exception, if any
      return true;
    }
    late_.push_back(std::move(worker));
    return false;
  }

 private:
  std::vector<std::thread> late_;
};

/// Captures gpukit warnings for a scope (the handler is process-wide: do not nest across threads).
class captured_warnings {
 public:
  captured_warnings() {
    previous_ = gpukit::set_warning_handler([this](std::string_view message) {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_.emplace_back(message);
    });
  }
  captured_warnings(const captured_warnings&) = delete;
  captured_warnings& operator=(const captured_warnings&) = delete;
  ~captured_warnings() { gpukit::set_warning_handler(previous_); }

  std::vector<std::string> messages() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }
  /// True if some warning contains `text`.
  bool contains(std::string_view text) const {
    for (const auto& m : messages()) {
      if (m.find(text) != std::string::npos) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
  gpukit::warning_handler previous_;
};

/// For a scope, records at each gpukit warning whether `mutex` was free then, asked from another thread (the warning's
/// thread may hold it): gpukit raises warnings outside its locks, so a handler may call gpukit. Warnings go on to the
/// handler installed before.
template <class Mutex>
class lock_at_warnings {
 public:
  explicit lock_at_warnings(Mutex& mutex) : watched_(mutex) {
    previous_ = gpukit::set_warning_handler([this](std::string_view message) {
      const bool free = std::async(std::launch::async, [this] {
                          const bool locked = watched_.try_lock();
                          if (locked) watched_.unlock();
                          return locked;
                        }).get();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        free_.push_back(free);
      }
      if (previous_) previous_(message);
    });
  }
  lock_at_warnings(const lock_at_warnings&) = delete;
  lock_at_warnings& operator=(const lock_at_warnings&) = delete;
  ~lock_at_warnings() { gpukit::set_warning_handler(previous_); }

  /// For each warning so far, whether the mutex was free.
  std::vector<bool> free_at_each() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return free_;
  }

 private:
  Mutex& watched_;
  mutable std::mutex mutex_;
  std::vector<bool> free_;
  gpukit::warning_handler previous_;
};

/// What a child run of this test executable did.
struct child_result {
  int status = -1;          ///< exit status, or 128 + the signal that ended it
  std::string stderr_text;  ///< everything it wrote to stderr
};

/// Runs this test executable again with the environment assignment `env` ("NAME=value"), only its test case
/// `test_case` (a case marked doctest::skip(), run with --no-skip), and returns its exit status and stderr. For what
/// happens at process exit, which a test cannot see in its own process.
inline child_result run_test_case_in_child(const std::string& env, const std::string& test_case) {
  std::vector<char> self(4096, '\0');
  // Not REQUIRE: the fuzz targets include this header with doctest disabled.
  if (readlink("/proc/self/exe", self.data(), self.size() - 1) <= 0) throw std::runtime_error("readlink failed");
  const std::string command =
      env + " '" + std::string(self.data()) + "' --no-skip '--test-case=" + test_case + "' 2>&1 >/dev/null";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed: " + command);
  child_result result;
  char chunk[512];
  while (const std::size_t got = std::fread(chunk, 1, sizeof chunk, pipe)) result.stderr_text.append(chunk, got);
  const int status = pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return result;
}

}  // namespace gpukit_test
