// A host heap that fails on demand: included by one translation unit of a test executable, it replaces the global
// operator new and delete there, and every allocation asks gpukit_test::heap_fails() (when set) whether to throw
// std::bad_alloc. Tests of host out-of-memory paths set it to fail the N-th allocation of the call under test.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <vector>

namespace gpukit_test {

/// Asked before each allocation, on the allocating thread: true makes it throw std::bad_alloc. Null: never.
inline std::atomic<bool (*)()> heap_fails{nullptr};

/// Throws std::bad_alloc when heap_fails says so.
inline void fail_if_asked() {
  if (bool (*fails)() = heap_fails.load(std::memory_order_relaxed); fails != nullptr && fails()) {
    throw std::bad_alloc();
  }
}

inline void* heap_allocate(std::size_t bytes) {
  fail_if_asked();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}

/// One run of a scenario whose calls fail at the host allocation `fail_at` counted from the run's start: only the
/// arming thread's allocations inside armed() count, less those `ignored` says true for (a simulator's own). With a
/// `burst` above 1, that many allocations in a row fail from there (a handler's too): a double fault. A burst ends
/// with the armed() call whose std::bad_alloc it raised; it never carries over into the next armed() call.
class heap_run {
 public:
  explicit heap_run(long fail_at, bool (*ignored)() = nullptr, int burst = 1) : fail_at_(fail_at) {
    seen_ = 0;
    burst_ = burst;
    ignored_.store(ignored, std::memory_order_relaxed);
    at_failure_.store(nullptr, std::memory_order_relaxed);
    heap_fails.store(&counted_failure, std::memory_order_relaxed);
    held_.reserve(64);  // the test's own bookkeeping never allocates while armed
  }
  heap_run(const heap_run&) = delete;
  heap_run& operator=(const heap_run&) = delete;

  /// Has `hook` run once, on the arming thread, just before the first injected failure: something that happens at that
  /// very moment (another thread destroying a stream). It must not allocate.
  void at_failure(void (*hook)()) noexcept { at_failure_.store(hook, std::memory_order_relaxed); }

  /// Runs `call` with the heap armed: true when it returned, false when it threw std::bad_alloc (another exception is
  /// kept for unexpected()).
  template <class Call>
  bool armed(Call&& call) {
    left_ = seen_ < fail_at_ ? fail_at_ - 1 - seen_ : -1;
    bool done = false;
    try {
      call();
      done = true;
    } catch (const std::bad_alloc&) {
      left_ = -1;
      ++failures_;
    } catch (const std::exception& e) {
      left_ = -1;  // before the copy below allocates
      if (unexpected_.empty()) unexpected_ = e.what();
    }
    left_ = -1;
    return done;
  }
  /// Allocations the armed calls made: when fewer than fail_at, every allocation of the scenario has failed once.
  long seen() const noexcept { return seen_; }
  int failures() const noexcept { return failures_; }
  /// The first exception other than std::bad_alloc ("" when none).
  const std::string& unexpected() const noexcept { return unexpected_; }
  /// What the test holds (room for 64 reserved).
  std::vector<void*>& held() noexcept { return held_; }

 private:
  static bool counted_failure() {
    if (left_ < 0) return false;
    if (bool (*ignored)() = ignored_.load(std::memory_order_relaxed); ignored != nullptr && ignored()) return false;
    ++seen_;
    if (left_ == 0) {
      if (void (*hook)() = at_failure_.exchange(nullptr, std::memory_order_relaxed); hook != nullptr) hook();
      if (--burst_ <= 0) left_ = -1;  // one failure (or burst) per run: what a handler does next may allocate
      return true;
    }
    --left_;
    return false;
  }
  static inline thread_local long left_ = -1;
  static inline thread_local long seen_ = 0;
  static inline thread_local int burst_ = 1;
  static inline std::atomic<bool (*)()> ignored_{nullptr};
  static inline std::atomic<void (*)()> at_failure_{nullptr};
  long fail_at_;
  int failures_ = 0;
  std::string unexpected_;
  std::vector<void*> held_;
};

/// Host memory exhausted for the constructing thread while this lives: every allocation it makes throws
/// std::bad_alloc, those of the handlers that catch one included. Other threads allocate as usual.
class exhausted_heap {
 public:
  exhausted_heap() {
    exhausted_ = true;
    heap_fails.store(&fails_here, std::memory_order_relaxed);
  }
  ~exhausted_heap() { exhausted_ = false; }
  exhausted_heap(const exhausted_heap&) = delete;
  exhausted_heap& operator=(const exhausted_heap&) = delete;

 private:
  static bool fails_here() { return exhausted_; }
  static inline thread_local bool exhausted_ = false;
};

/// The over-aligned forms (alignas above the default, e.g. cache-line-aligned blocks), under the same rule.
inline void* heap_allocate_aligned(std::size_t bytes, std::align_val_t alignment) {
  fail_if_asked();
  const auto align = static_cast<std::size_t>(alignment);
  const std::size_t size = bytes == 0 ? align : (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
  if (void* p = std::aligned_alloc(align, size)) return p;
  throw std::bad_alloc();
}

/// Frees what heap_allocate or heap_allocate_aligned returned. Not inlined: GCC's -Wmismatched-new-delete, seeing
/// free() inlined where the pointer came from operator new (an optimized build), does not know that these
/// replacements pair them.
[[gnu::noinline]] inline void heap_release(void* p) noexcept { std::free(p); }

}  // namespace gpukit_test

// Every form, so that each pair ends in malloc (or aligned_alloc) and free whatever a sanitizer's runtime defines.
void* operator new(std::size_t bytes) { return gpukit_test::heap_allocate(bytes); }
void* operator new[](std::size_t bytes) { return gpukit_test::heap_allocate(bytes); }
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return gpukit_test::heap_allocate(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return gpukit_test::heap_allocate(bytes);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p) noexcept { gpukit_test::heap_release(p); }
void operator delete(void* p, std::size_t) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p, std::size_t) noexcept { gpukit_test::heap_release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { gpukit_test::heap_release(p); }
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return gpukit_test::heap_allocate_aligned(bytes, alignment);
}
void* operator new[](std::size_t bytes, std::align_val_t alignment) {
  return gpukit_test::heap_allocate_aligned(bytes, alignment);
}
void* operator new(std::size_t bytes, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return gpukit_test::heap_allocate_aligned(bytes, alignment);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  try {
    return gpukit_test::heap_allocate_aligned(bytes, alignment);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p, std::align_val_t) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { gpukit_test::heap_release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { gpukit_test::heap_release(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { gpukit_test::heap_release(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { gpukit_test::heap_release(p); }
