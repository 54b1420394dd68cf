// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's device lock: a spin_mutex that keeps the warnings raised while it is held (by the
/// allocator, its upstream's page mapping and unmapping, its stream operations) and delivers them once the thread
/// holds no such lock any more. A warning handler may then call the allocator (a snapshot, empty_cache), which would
/// spin for ever on a lock its own thread holds, and runs outside the lock as set_warning_handler promises, wherever
/// in the lock's scope the warning came from.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/spin_mutex.hpp>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

class device_mutex {
 public:
  GPUKIT_DETAIL_ALWAYS_INLINE void lock() noexcept {
    mutex_.lock();
    hold();
  }
  GPUKIT_DETAIL_ALWAYS_INLINE bool try_lock() noexcept {
    if (!mutex_.try_lock()) return false;
    hold();
    return true;
  }
  GPUKIT_DETAIL_ALWAYS_INLINE void unlock() noexcept {
    held_warnings& held = *holder_;  // read while the lock is held: the holder's, without a second thread-local look
    mutex_.unlock();
    end_hold(held);  // after the release: a handler may take the lock
  }

 private:
  GPUKIT_DETAIL_ALWAYS_INLINE void hold() noexcept {
    holder_ = &warnings_held_on_this_thread();
    ++holder_->depth;
  }
  spin_mutex mutex_;
  held_warnings* holder_ = nullptr;  // the holding thread's (written and read under the lock)
};

}  // namespace detail
GPUKIT_END_NAMESPACE
