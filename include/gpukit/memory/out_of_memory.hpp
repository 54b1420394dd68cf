// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Out-of-memory observers: what an allocator tells them (out_of_memory_info) just before it throws
/// out_of_memory_error, and the registry the allocators keep them in.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/error.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// Outside the per-mode namespace (detail/config.hpp) and exported: one of each per process, whichever shared library
// or default-stream mode registers or calls an observer.
namespace gpukit {
namespace mode_independent {

/// The last out-of-memory observer id handed out in this process. One counter for every allocator, so that an id
/// names one observer: a stale one (e.g. of a default allocator since replaced) matches no other allocator's.
GPUKIT_EXPORT inline std::atomic<std::uint64_t>& out_of_memory_observer_ids() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last;
}

/// One observer's calls under way, for removals to wait on. Shared by every copy of gpukit in the process (a
/// thread inside one copy's observer may remove another's), so its layout is versioned with the accessor below.
struct out_of_memory_observer_state {
  std::mutex mutex;                 ///< guards the members below
  std::condition_variable changed;  ///< notified when a call ends or a caller starts waiting in a removal
  std::size_t calls = 0;            ///< calls under way, on every thread
  std::size_t callers_waiting = 0;  ///< of those, the calls whose thread waits in a removal meanwhile
  bool removed = false;             ///< no call starts once set
};

/// An observer call under way on a thread, in the caller's stack frame: the registry calling it, the observer's
/// state, and the call it runs inside (nullptr for the outermost).
struct out_of_memory_observer_call {
  const void* registry;                      ///< the out_of_memory_observers calling
  out_of_memory_observer_state* observer;    ///< the state of the observer called
  const out_of_memory_observer_call* outer;  ///< the call this one runs inside, or nullptr
};

/// The innermost observer call under way on the calling thread, or nullptr. A pointer, never destroyed: an error
/// raised by a destructor of static storage, after the thread's objects are gone, still reads it. Exported: an
/// observer of one shared library that removes itself through another's copy of gpukit is still seen inside its
/// call (it waited for itself). The name carries the version of both structures' layout.
GPUKIT_EXPORT inline const out_of_memory_observer_call*& out_of_memory_observer_calls_v3() noexcept {
  thread_local const out_of_memory_observer_call* innermost = nullptr;
  return innermost;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

/// What an out-of-memory observer is told, just before an allocator throws out_of_memory_error.
struct out_of_memory_info {
  int device = -1;            ///< the CUDA ordinal, or -1 for the CPU
  std::size_t requested = 0;  ///< the bytes asked for
  std::size_t rounded = 0;    ///< the request rounded as the allocator serves it
  /// the last segment size asked of the upstream for it; with expandable segments, the bytes of the pages it lacked
  std::size_t segment_bytes = 0;
  std::size_t allocated = 0;           ///< bytes allocated by this allocator
  std::size_t reserved = 0;            ///< bytes this allocator holds from the upstream
  std::size_t free_cached = 0;         ///< reserved bytes in free blocks (after releasing what could be released)
  std::size_t largest_free_block = 0;  ///< bytes of the largest free block, where the allocator knows it (else 0)
  std::size_t reserved_limit = std::numeric_limits<std::size_t>::max();  ///< max() when none
  bool limit_hit = false;            ///< the reserved limit refused, not the upstream
  bool device_memory_known = false;  ///< device_total and device_free hold the upstream's numbers
  std::size_t device_total = 0;      ///< the upstream's (device's) total memory, where known
  std::size_t device_free = 0;       ///< its free memory when the error was raised, where known
  std::string message;               ///< the text of the error about to be thrown
};

/// Called with the numbers of an out-of-memory error just before it is thrown.
using out_of_memory_observer = std::function<void(const out_of_memory_info&)>;

namespace detail {

/// The message of a caching allocator's out_of_memory_error, from its numbers (`info`, whose `message` is ignored):
/// what was asked and what it needs (a new segment, or, where `page_bytes` is not 0, pages of that size mapped into
/// an expandable segment: info.segment_bytes of them), the device's memory, this allocator's, and the likely cause
/// with what to do about it. A `cause` given replaces what it needs and the advice: ", but <cause>. ".
GPUKIT_INLINE std::string out_of_memory_message(const out_of_memory_info& info, std::string_view device_name,
                                                std::size_t page_bytes, std::string_view cause = {});

/// The observers of one allocator. Thread-safe; notify() calls them without holding its lock, so an observer may
/// use the allocator and add or remove observers.
class out_of_memory_observers {
 public:
  /// Ids come from one counter for the process (mode_independent::out_of_memory_observer_ids).
  std::uint64_t add(out_of_memory_observer observer);
  /// Once it returns true the observer is not called again and no call of it is under way on another thread, except:
  /// its calls on this thread (an observer removing itself) are not waited for, and, called from inside an
  /// observer, neither is a call whose thread is itself waiting in remove() (whatever for) when it looks: the wait
  /// could be a cycle (two observers removing each other on two threads). Other threads' calls of it are waited for.
  /// In a cycle every removal returns, once the others have marked their calls or those calls have ended, so an
  /// observer must not wait, after its removal returns, for another removal of the cycle. noexcept: a lock that
  /// fails (std::system_error) terminates, as in notify(), rather than leave the marks or the observer half removed.
  bool remove(std::uint64_t id) noexcept;
  /// Calls each observer; one that throws is reported through gpukit::warn, naming `device`. Does nothing on a
  /// thread already inside one of these observers: an observer whose own allocation from this allocator fails gets
  /// the error, not another call of itself (which would recurse without end). Other allocators' observers are called.
  void notify(const out_of_memory_info& info, const std::string& device) const noexcept;

 private:
  /// One observer, with the calls of it under way, so that remove() can wait for them.
  struct entry {
    explicit entry(out_of_memory_observer f) : observer(std::move(f)) {}
    const out_of_memory_observer observer;
    mode_independent::out_of_memory_observer_state state;
  };

  mutable std::mutex mutex_;
  std::vector<std::pair<std::uint64_t, std::shared_ptr<entry>>> observers_;
};

}  // namespace detail

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::string out_of_memory_message(const out_of_memory_info& info, std::string_view device_name,
                                                std::size_t page_bytes, std::string_view cause) {
  const bool pages = page_bytes != 0;
  const std::size_t page_count = pages ? info.segment_bytes / page_bytes : 0;
  std::string m = "gpukit: out of memory on " + std::string(device_name) + ": tried to allocate " +
                  format_bytes_exact(info.requested) + ", rounded to " + format_bytes_exact(info.rounded);
  if (!cause.empty()) {
    m += ", but " + std::string(cause) + ". ";
  } else {
    m += ", which needs " +
         (pages ? format_bytes(info.segment_bytes) + " more mapped into its expandable segment (" +
                      std::to_string(page_count) + (page_count == 1 ? " page" : " pages") + " of " +
                      format_bytes(page_bytes) + ")"
                : "a new segment of " + format_bytes(info.segment_bytes)) +
         ". ";
  }
  if (info.device_memory_known) {
    m += "Device: " + format_bytes(info.device_total) + " total, " + format_bytes(info.device_free) + " free. ";
  } else {
    m += "Device: total and free memory unknown. ";
  }
  const double fragmentation = info.free_cached == 0 ? 0.0
                                                     : 1.0 - static_cast<double>(info.largest_free_block) /
                                                                 static_cast<double>(info.free_cached);
  char fragmentation_text[32];
  std::snprintf(fragmentation_text, sizeof fragmentation_text, "%.2f", fragmentation);
  const std::size_t unallocated = info.reserved > info.allocated ? info.reserved - info.allocated : 0;
  m += "This allocator: " + format_bytes(info.allocated) + " allocated, " + format_bytes(unallocated) +
       " reserved but unallocated (largest free block " + format_bytes(info.largest_free_block) + ", fragmentation " +
       fragmentation_text + " = 1 - largest free block / free), reserved limit " +
       (info.reserved_limit == std::numeric_limits<std::size_t>::max() ? std::string("none")
                                                                       : format_bytes(info.reserved_limit)) +
       ".";
  // What the device holds that this allocator does not (other processes, libraries, the context).
  const std::size_t elsewhere = info.device_memory_known && info.device_total > info.device_free + info.reserved
                                    ? info.device_total - info.device_free - info.reserved
                                    : 0;
  if (!cause.empty()) {  // the cause says what failed: no other advice
  } else if (info.limit_hit) {
    m += " The reserved limit would be exceeded: raise it (set_reserved_limit / set_memory_fraction) or free memory.";
  } else if (info.device_memory_known && info.rounded > info.device_total) {
    m += " The request is larger than the device's memory.";
  } else if (info.free_cached >= info.rounded && info.largest_free_block < info.rounded) {
    m += " Enough memory is cached, but in pieces smaller than the request (fragmentation): a smaller "
         "max_split_size or fewer long-lived small allocations among large ones may help.";
  } else if (info.largest_free_block >= info.rounded) {
    m += " A cached free block is large enough, but this request may not take it: a block serves the stream that "
         "freed it unless cross_stream_reuse is on, small and large requests have pools of their own, and "
         "max_split_size keeps large blocks whole.";
  } else if (elsewhere >= info.device_total / 2) {
    m += " Most of the device is used outside this allocator (other processes or libraries).";
  }
  return m;
}

GPUKIT_INLINE std::uint64_t out_of_memory_observers::add(out_of_memory_observer observer) {
  if (!observer) throw invalid_argument_error("gpukit: add_out_of_memory_observer needs a callable, not an empty one");
  auto made = std::make_shared<entry>(std::move(observer));
  const std::uint64_t id = mode_independent::out_of_memory_observer_ids().fetch_add(1, std::memory_order_relaxed) + 1;
  std::lock_guard<std::mutex> lock(mutex_);
  observers_.emplace_back(id, std::move(made));
  return id;
}

GPUKIT_INLINE bool out_of_memory_observers::remove(std::uint64_t id) noexcept {
  std::shared_ptr<entry> removed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = std::find_if(observers_.begin(), observers_.end(), [id](const auto& o) { return o.first == id; });
    if (it == observers_.end()) return false;
    removed = std::move(it->second);
    observers_.erase(it);
  }
  // notify() may have copied the entry before the erase: it checks `removed` before each call. Calls already under
  // way on other threads are waited for, so that what the observer uses may be destroyed once this returns (the
  // usual pattern: an object's destructor removes the observer that captured it), also from inside another
  // observer. Calls on this thread cannot end first: they are not waited for. From inside an observer, neither are
  // the calls of threads that are themselves waiting in a removal: the wait could be a cycle (two observers removing
  // each other on two threads). Each waiter marks the calls it is inside before it waits, and a mark wakes the
  // waiters on that observer: in a cycle, a wait ends once the next thread has marked (or its call has ended).
  using mode_independent::out_of_memory_observer_call;
  mode_independent::out_of_memory_observer_state& state = removed->state;
  const out_of_memory_observer_call* const innermost = mode_independent::out_of_memory_observer_calls_v3();
  std::size_t own_calls = 0;
  for (const out_of_memory_observer_call* c = innermost; c != nullptr; c = c->outer) {
    if (c->observer == &state) ++own_calls;
  }
  std::unique_lock<std::mutex> lock(state.mutex);
  state.removed = true;
  if (state.calls == own_calls) return true;
  if (innermost == nullptr) {  // outside every observer this thread cannot be in a cycle: it waits for every call
    state.changed.wait(lock, [&] { return state.calls == 0; });
    return true;
  }
  lock.unlock();  // one observer's lock at a time: the calls this thread is inside may include the removed one
  auto mark = [innermost](bool waiting) {
    for (const out_of_memory_observer_call* c = innermost; c != nullptr; c = c->outer) {
      {
        const std::lock_guard<std::mutex> guard(c->observer->mutex);
        if (waiting) {
          ++c->observer->callers_waiting;
        } else {
          --c->observer->callers_waiting;
        }
      }
      if (waiting) c->observer->changed.notify_all();
    }
  };
  mark(true);
  lock.lock();
  // Every call left is one whose thread waits in a removal (this thread's own calls among them: it marked them).
  state.changed.wait(lock, [&] { return state.calls == state.callers_waiting; });
  lock.unlock();
  mark(false);
  return true;
}

GPUKIT_INLINE void out_of_memory_observers::notify(const out_of_memory_info& info,
                                                   const std::string& device) const noexcept {
  using mode_independent::out_of_memory_observer_call;
  const out_of_memory_observer_call*& innermost = mode_independent::out_of_memory_observer_calls_v3();
  for (const out_of_memory_observer_call* c = innermost; c != nullptr; c = c->outer) {
    if (c->registry == this) return;  // an observer's own error
  }
  std::vector<std::shared_ptr<entry>> observers;
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& o : observers_) observers.push_back(o.second);
  } catch (...) {
    return;  // no memory to copy the list: the error about to be thrown says why
  }
  for (const auto& observer : observers) {
    mode_independent::out_of_memory_observer_state& state = observer->state;
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      if (state.removed) continue;
      ++state.calls;
    }
    const out_of_memory_observer_call call{this, &state, innermost};
    innermost = &call;
    try {
      observer->observer(info);
    } catch (const std::exception& e) {
      warn_parts("gpukit: an out-of-memory observer of ", device, " threw: ", e.what());
    } catch (...) {
      warn_parts("gpukit: an out-of-memory observer of ", device, " threw a non-standard exception");
    }
    innermost = call.outer;
    {
      std::lock_guard<std::mutex> lock(state.mutex);
      --state.calls;
    }
    state.changed.notify_all();
  }
}

}  // namespace detail
GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
