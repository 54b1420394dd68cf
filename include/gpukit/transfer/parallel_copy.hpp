// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A host memcpy split across threads, for staging pageable memory: one core's memcpy (about 10–20 GB/s on servers)
/// is below what PCIe Gen5 moves (about 55 GB/s), so large chunks are copied by several threads. The caller copies
/// a part itself and helper threads from a small process-wide pool take the rest; parts nobody has started are
/// taken by the caller, so a copy never waits for a busy helper.

#include <gpukit/detail/config.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The helper threads of parallel_copy. Created lazily (never at static-initialisation time), grown on demand up to
/// `max_helpers`, and never destroyed: copies may run in host callbacks and static destructors until the process
/// ends, and idle helpers only wait on a condition variable.
class copy_workers {
 public:
  static constexpr unsigned max_helpers = 15;

  GPUKIT_EXPORT static copy_workers& instance() {
    static copy_workers* workers = new copy_workers();  // leaked on purpose: see the class comment
    return *workers;
  }

  /// Copies `bytes` from `src` to `dst` (which must not overlap) in `parts` pieces, the caller doing one or more.
  void copy(void* dst, const void* src, std::size_t bytes, unsigned parts) {
    if (parts <= 1 || bytes < 2 * min_part_bytes) {
      std::memcpy(dst, src, bytes);
      return;
    }
    parts = std::min<unsigned>(parts, max_helpers + 1);
    auto j = std::make_shared<job>();
    j->dst = static_cast<char*>(dst);
    j->src = static_cast<const char*>(src);
    j->bytes = bytes;
    j->parts = parts;
    // Parts of whole cache lines: neighbours never share one.
    j->part_bytes = ((bytes + parts - 1) / parts + 63) / 64 * 64;
    post(j, parts - 1);
    run_parts(*j);
    std::unique_lock<std::mutex> lock(j->mutex);
    j->cv.wait(lock, [&] { return j->done.load(std::memory_order_acquire) == j->parts; });
  }

 private:
  static constexpr std::size_t min_part_bytes = 64 * 1024;

  struct job {
    char* dst = nullptr;
    const char* src = nullptr;
    std::size_t bytes = 0;
    std::size_t part_bytes = 0;
    unsigned parts = 0;
    std::atomic<unsigned> next{0};
    std::atomic<unsigned> done{0};
    std::mutex mutex;
    std::condition_variable cv;
  };

  static void run_parts(job& j) {
    for (;;) {
      const unsigned i = j.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= j.parts) return;
      const std::size_t begin = std::min(j.bytes, static_cast<std::size_t>(i) * j.part_bytes);
      const std::size_t end = std::min(j.bytes, begin + j.part_bytes);
      if (end > begin) std::memcpy(j.dst + begin, j.src + begin, end - begin);
      if (j.done.fetch_add(1, std::memory_order_acq_rel) + 1 == j.parts) {
        std::lock_guard<std::mutex> lock(j.mutex);
        j.cv.notify_all();
      }
    }
  }

  void post(const std::shared_ptr<job>& j, unsigned helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (unsigned i = 0; i < helpers; ++i) queue_.push_back(j);
      // One thread per outstanding ticket, up to the limit; idle threads are reused.
      while (threads_.size() < max_helpers && threads_.size() < busy_ + queue_.size()) {
        try {
          threads_.emplace_back([this] { serve(); });
        } catch (...) {
          break;  // cannot start a thread: the caller takes the parts itself
        }
      }
    }
    cv_.notify_all();
  }

  void serve() {
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

  copy_workers() = default;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<job>> queue_;
  std::vector<std::thread> threads_;
  std::size_t busy_ = 0;
};

}  // namespace detail

/// std::memcpy over up to `threads` threads (1 = plain memcpy). Copies below 128 KiB always use one thread: waking a
/// helper costs more than it saves. The ranges must not overlap.
inline void parallel_copy(void* dst, const void* src, std::size_t bytes, unsigned threads) {
  if (bytes == 0) return;
  detail::copy_workers::instance().copy(dst, src, bytes, threads);
}

GPUKIT_END_NAMESPACE
