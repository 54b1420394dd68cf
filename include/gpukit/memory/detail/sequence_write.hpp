// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The writer's side of a seqlock: data that readers load without a lock is guarded by a sequence count, odd while
/// a writer (holding its own lock) changes the data. A reader that sees the same even count before and after its
/// loads has read one moment's data, else it tries again. Writers store the data with release and readers load it
/// with acquire (plain moves on x86): a reader that sees a new value then also sees the odd count stored before it,
/// and its last look at the count cannot move before its loads. No fences, which GCC's TSan cannot check.
/// Used by the pointer map (lookups without a lock) and the front caches (statistics read without a lock).

#include <gpukit/detail/config.hpp>

#include <atomic>
#include <cstdint>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Makes `count` odd for as long as it lives (the writer's lock held; scopes on one count do not nest).
class sequence_write {
 public:
  explicit sequence_write(std::atomic<std::uint32_t>& count) noexcept : count_(count) {
    count_.store(count_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  sequence_write(const sequence_write&) = delete;
  sequence_write& operator=(const sequence_write&) = delete;
  ~sequence_write() { count_.store(count_.load(std::memory_order_relaxed) + 1, std::memory_order_release); }

 private:
  std::atomic<std::uint32_t>& count_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
