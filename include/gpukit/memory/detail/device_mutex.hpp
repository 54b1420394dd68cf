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
  void lock() noexcept {
    mutex_.lock();
    ++warnings_held_on_this_thread().depth;
  }
  bool try_lock() noexcept {
    if (!mutex_.try_lock()) return false;
    ++warnings_held_on_this_thread().depth;
    return true;
  }
  void unlock() noexcept {
    held_warnings& held = warnings_held_on_this_thread();
    --held.depth;
    mutex_.unlock();
    if (held.depth == 0 && held.pending != nullptr) deliver_held_warnings();
  }

 private:
  spin_mutex mutex_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
