// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A per-device pool of streams, so a program need not create and destroy streams in its hot paths.
///
/// - next(): round-robin over `size()` streams created lazily, one per slot on first use. The pool is shared:
///   the (size+1)-th call returns the first stream again, so two users may get the same stream (aliasing). That is
///   always correct, only less concurrent; with the default 32 streams it matches PyTorch's pool.
/// - acquire_exclusive(): a stream nobody else gets from this pool until its lease ends; leases are recycled, and
///   new streams are created when none is free. The stream may still have work in flight when the lease ends; the
///   next holder's work is simply ordered after it.
///
/// default_stream_pool(device, priority) gives the process-wide pools, created on first use.

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/stream.hpp>

#include <atomic>
#include <climits>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace gpukit {

/// A pool of streams of one device (see the file comment for round-robin and exclusive use).
class stream_pool {
 public:
  static constexpr std::size_t default_size = 32;

  /// A pool of `size` shared streams of `d`, created with `options` (priority, non-blocking) when first used.
  explicit stream_pool(gpukit::device d, std::size_t size = default_size, stream_options options = {})
      : device_(d), options_(options), slots_(size) {
    if (size == 0) throw invalid_argument_error("gpukit::stream_pool: the size must be at least 1");
  }

  stream_pool(const stream_pool&) = delete;
  stream_pool& operator=(const stream_pool&) = delete;

  /// The next shared stream, round-robin.
  stream_view next() {
    const std::size_t index = counter_.fetch_add(1, std::memory_order_relaxed) % slots_.size();
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = slots_[index];
    if (!slot) slot = std::make_unique<stream>(device_, options_);
    return slot->view();
  }

  /// Exclusive use of a stream for the lifetime of the lease (move-only).
  class lease {
   public:
    lease(lease&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)), stream_(std::move(other.stream_)) {}
    lease& operator=(lease&& other) noexcept {
      if (this != &other) {
        give_back();
        pool_ = std::exchange(other.pool_, nullptr);
        stream_ = std::move(other.stream_);
      }
      return *this;
    }
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    ~lease() { give_back(); }

    /// The leased stream. Throws invalid_argument_error on a moved-from lease.
    stream_view view() const {
      if (!stream_) throw invalid_argument_error("gpukit::stream_pool::lease: use of a moved-from lease");
      return stream_->view();
    }
    operator stream_view() const { return view(); }  // NOLINT(google-explicit-constructor)

   private:
    friend class stream_pool;
    lease(stream_pool* pool, std::unique_ptr<stream> s) noexcept : pool_(pool), stream_(std::move(s)) {}
    void give_back() noexcept {
      if (pool_ != nullptr && stream_) pool_->return_exclusive(std::move(stream_));
      pool_ = nullptr;
    }
    stream_pool* pool_ = nullptr;
    std::unique_ptr<stream> stream_;
  };

  /// A stream for exclusive use; recycled from ended leases, or created. The pool must outlive the lease.
  lease acquire_exclusive() {
    std::unique_ptr<stream> s;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!exclusive_free_.empty()) {
        s = std::move(exclusive_free_.back());
        exclusive_free_.pop_back();
      }
    }
    if (!s) s = std::make_unique<stream>(device_, options_);
    return lease(this, std::move(s));
  }

  gpukit::device device() const noexcept { return device_; }
  /// The number of shared (round-robin) streams.
  std::size_t size() const noexcept { return slots_.size(); }
  /// Shared streams created so far (they are created on first use).
  std::size_t created() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t n = 0;
    for (const auto& slot : slots_) n += slot ? 1 : 0;
    return n;
  }
  /// Streams waiting in the exclusive reserve.
  std::size_t exclusive_available() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return exclusive_free_.size();
  }

 private:
  void return_exclusive(std::unique_ptr<stream> s) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      exclusive_free_.push_back(std::move(s));
    } catch (...) {
      // Out of memory growing the reserve: the stream is destroyed instead of recycled.
    }
  }

  gpukit::device device_;
  stream_options options_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<stream>> slots_;
  std::vector<std::unique_ptr<stream>> exclusive_free_;
  std::atomic<std::size_t> counter_{0};
};

/// Priority classes of the process-wide pools.
enum class stream_priority { normal, high };

/// The process-wide pool of `d` for a priority class, created on first use with stream_pool::default_size
/// non-blocking streams (high: the device's greatest priority). Thread-safe; lives until the process exits.
inline stream_pool& default_stream_pool(gpukit::device d, stream_priority priority = stream_priority::normal) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<stream_pool>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  auto& pool = pools[{d.ordinal(), static_cast<int>(priority)}];
  if (!pool) {
    stream_options options;
    options.priority = priority == stream_priority::high ? INT_MIN : 0;  // clamped to the device's greatest
    pool = std::make_unique<stream_pool>(d, stream_pool::default_size, options);
  }
  return *pool;
}

}  // namespace gpukit
