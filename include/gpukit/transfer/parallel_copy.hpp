// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A host memcpy split across threads, for staging pageable memory: one core's memcpy (about 10–20 GB/s on servers)
/// is below what PCIe Gen5 moves (about 55 GB/s), so large chunks are copied by several threads. The caller copies
/// a part itself and helper threads from a small process-wide pool take the rest; parts nobody has started are
/// taken by the caller, so a copy never waits for a busy helper. A copy may use non-temporal (streaming) stores:
/// into a staging slot that only the DMA engine reads next, they skip reading the destination into the cache first
/// and leave the caches to the program.

#include <gpukit/detail/config.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if !defined(_WIN32)
#include <pthread.h>  // pthread_atfork
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// std::memcpy with non-temporal stores where the CPU has them (x86-64: SSE2; elsewhere plain memcpy), ending with a
/// store fence so the data is visible to other threads and to DMA once the copy is reported done.
GPUKIT_INLINE void streaming_copy(void* dst, const void* src, std::size_t bytes) noexcept;

/// One part of a copy, with plain or streaming stores.
GPUKIT_INLINE void copy_part(void* dst, const void* src, std::size_t bytes, bool streaming) noexcept;

/// The helper threads of parallel_copy (defined with the functions: only their bodies use it).
class copy_workers;

}  // namespace detail

/// std::memcpy over up to `threads` threads (1 = plain memcpy). Copies below 128 KiB always use one thread: waking a
/// helper costs more than it saves. The ranges must not overlap. `streaming`: non-temporal stores (see the file
/// comment), for a destination that is not read again soon from this CPU.
GPUKIT_INLINE void parallel_copy(void* dst, const void* src, std::size_t bytes, unsigned threads,
                                 bool streaming = false);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The helper threads of parallel_copy. Created lazily (never at static-initialisation time), grown on demand up to
/// `max_helpers`, and never destroyed: copies may run in host callbacks and static destructors until the process
/// ends, and idle helpers only wait on a condition variable.
class copy_workers {
 public:
  static constexpr unsigned max_helpers = 15;

  GPUKIT_EXPORT static copy_workers& instance();

  /// Whether a copy of `bytes` in `parts` pieces is worth helpers; else it is one memcpy on the calling thread.
  static bool worth_helpers(std::size_t bytes, unsigned parts) noexcept {
    return parts > 1 && bytes >= 2 * min_part_bytes;
  }

  /// Copies `bytes` from `src` to `dst` (which must not overlap) in `parts` pieces, the caller doing one or more.
  void copy(void* dst, const void* src, std::size_t bytes, unsigned parts, bool streaming);

 private:
  static constexpr std::size_t min_part_bytes = 64 * 1024;

  struct job {
    char* dst = nullptr;
    const char* src = nullptr;
    std::size_t bytes = 0;
    std::size_t part_bytes = 0;
    unsigned parts = 0;
    bool streaming = false;
    std::atomic<unsigned> next{0};
    std::atomic<unsigned> done{0};
    std::mutex mutex;
    std::condition_variable cv;
  };

  static void run_parts(job& j);

  /// Queues up to `helpers` tickets for `j` and starts helper threads for them. Never throws: a ticket or thread it
  /// has no memory for is a part the caller copies itself (a throw would leave queued tickets copying after the
  /// caller returned).
  void post(const std::shared_ptr<job>& j, unsigned helpers) noexcept;

  void serve();

  copy_workers() = default;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<job>> queue_;
  std::vector<std::thread> threads_;
  std::size_t busy_ = 0;
};

GPUKIT_INLINE void streaming_copy(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16;  // to 16-byte aligned stores
  if (bytes < head + 64) {
    std::memcpy(d, s, bytes);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  for (; bytes >= 64; d += 64, s += 64, bytes -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, bytes);
  _mm_sfence();  // streaming stores are weakly ordered: complete them before the copy counts as done
#else
  std::memcpy(dst, src, bytes);
#endif
}

GPUKIT_INLINE void copy_part(void* dst, const void* src, std::size_t bytes, bool streaming) noexcept {
  if (streaming) {
    streaming_copy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

GPUKIT_INLINE copy_workers& copy_workers::instance() {
  // Leaked on purpose: see the class comment. A child of fork() inherits a pool whose threads it does not have and
  // whose mutex a helper may have held at the fork: it gets a pool of its own, the old one left untouched. The fork
  // is seen by a handler that forgets the pool in the child (pthread_atfork, registered before the first pool), so
  // that a copy costs one atomic load here rather than a getpid system call. A child made without fork() (a raw
  // clone or fork system call) runs no handler and must not copy in parallel; vfork and posix_spawn children exec.
  static std::atomic<copy_workers*> workers{nullptr};
  copy_workers* w = workers.load(std::memory_order_acquire);
  if (w != nullptr) return *w;
#if !defined(_WIN32)
  // Registered before any pool is installed, so a fork that sees a pool runs the handler. A flag rather than a
  // static initialized by a call: a fork during such an initialization leaves the child waiting forever on its guard.
  // Threads that race here may each register a handler (idempotent); a failure (ENOMEM, the only one) is retried.
  static std::atomic<bool> fork_handler{false};
  if (!fork_handler.load(std::memory_order_acquire)) {
    // The child runs it alone, on the thread that forked.
    if (::pthread_atfork(nullptr, nullptr, [] { workers.store(nullptr, std::memory_order_relaxed); }) != 0) {
      throw std::bad_alloc();
    }
    fork_handler.store(true, std::memory_order_release);
  }
#endif
  while (w == nullptr) {
    auto* fresh = new copy_workers();
    if (workers.compare_exchange_strong(w, fresh, std::memory_order_acq_rel, std::memory_order_acquire)) {
      return *fresh;
    }
    delete fresh;  // another thread installed one (no thread started yet)
  }
  return *w;
}

GPUKIT_INLINE void copy_workers::copy(void* dst, const void* src, std::size_t bytes, unsigned parts, bool streaming) {
  if (!worth_helpers(bytes, parts)) {
    copy_part(dst, src, bytes, streaming);
    return;
  }
  parts = std::min<unsigned>(parts, max_helpers + 1);
  auto j = std::make_shared<job>();
  j->dst = static_cast<char*>(dst);
  j->src = static_cast<const char*>(src);
  j->bytes = bytes;
  j->parts = parts;
  j->streaming = streaming;
  // Parts of whole cache lines: neighbours never share one.
  j->part_bytes = ((bytes + parts - 1) / parts + 63) / 64 * 64;
  post(j, parts - 1);
  run_parts(*j);
  std::unique_lock<std::mutex> lock(j->mutex);
  j->cv.wait(lock, [&] { return j->done.load(std::memory_order_acquire) == j->parts; });
}

GPUKIT_INLINE void copy_workers::run_parts(job& j) {
  for (;;) {
    const unsigned i = j.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= j.parts) return;
    const std::size_t begin = std::min(j.bytes, static_cast<std::size_t>(i) * j.part_bytes);
    const std::size_t end = std::min(j.bytes, begin + j.part_bytes);
    if (end > begin) copy_part(j.dst + begin, j.src + begin, end - begin, j.streaming);
    if (j.done.fetch_add(1, std::memory_order_acq_rel) + 1 == j.parts) {
      std::lock_guard<std::mutex> lock(j.mutex);
      j.cv.notify_all();
    }
  }
}

GPUKIT_INLINE void copy_workers::post(const std::shared_ptr<job>& j, unsigned helpers) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      for (unsigned i = 0; i < helpers; ++i) queue_.push_back(j);
    } catch (...) {  // no memory for more tickets: the tickets queued are served, the caller takes the rest
    }
    // One thread per outstanding ticket, up to the limit; idle threads are reused.
    while (threads_.size() < max_helpers && threads_.size() < busy_ + queue_.size()) {
      try {
        threads_.emplace_back([this] { serve(); });
      } catch (...) {
        break;  // cannot start a thread: the caller takes the parts itself
      }
    }
  } catch (...) {  // the lock refused: nothing queued, the caller copies every part
    return;
  }
  cv_.notify_all();
}

GPUKIT_INLINE void copy_workers::serve() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return !queue_.empty(); });
    std::shared_ptr<job> j = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    run_parts(*j);
    j.reset();
    lock.lock();
    --busy_;
  }
}
}  // namespace detail

GPUKIT_INLINE void parallel_copy(void* dst, const void* src, std::size_t bytes, unsigned threads, bool streaming) {
  if (bytes == 0) return;
  // A copy without helpers needs no pool.
  if (!detail::copy_workers::worth_helpers(bytes, threads)) return detail::copy_part(dst, src, bytes, streaming);
  detail::copy_workers::instance().copy(dst, src, bytes, threads, streaming);
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
