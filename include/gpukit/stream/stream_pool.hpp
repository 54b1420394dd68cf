// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A per-device pool of streams, so a program need not create and destroy streams in its hot paths.
///
/// - next(): round-robin over `size()` streams created lazily, one per slot on first use. The pool is shared:
///   the (size+1)-th call returns the first stream again, so two users may get the same stream (aliasing). That is
///   correct for ordinary work, only less concurrent; with the default 32 streams it matches PyTorch's pool. Never
///   capture a stream from next(): another user's work on it would go into the graph (and a synchronize of it
///   would invalidate the capture); capture a stream from acquire_exclusive() instead. gpukit::capture refuses a
///   stream of next() (invalid_argument_error); a capture begun with the raw runtime is not checked.
/// - A process that mixes code built with per-thread default streams and code built without has a set of default
///   pools (and of current streams, stream/current_stream.hpp) for each of the two builds.
/// - acquire_exclusive(): a stream nobody else gets from this pool until its lease ends. Exclusive streams are
///   separate from the shared ones, created lazily up to the pool's exclusive capacity (a constructor argument,
///   by default the pool's size) and recycled when leases end. With all of them leased, acquire_exclusive() throws
///   invalid_argument_error and try_acquire_exclusive() returns std::nullopt: a pool never hands out more streams
///   than it was sized for. The stream may still have work in flight when the lease ends; the next holder's work is
///   simply ordered after it. A stream given back while it is still part of a capture (forked into one and joined
///   back, as a lease inside gpukit::capture's work is: CUDA keeps it in the capture until the capture ends) is
///   leased again only once it no longer is: the next holder's work would go into that graph. Until then it counts
///   against the exclusive capacity (a capture begun on a leased stream and never ended keeps its slot); one whose
///   capture state cannot be read is destroyed, with a warning. A pool must outlive the captures its leases joined.
///
/// default_stream_pool(device, priority) gives the process-wide pools, created on first use.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/stream.hpp>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// A pool of streams of one device (see the file comment for round-robin and exclusive use).
class stream_pool {
 public:
  /// The number of shared streams when none is given, as in PyTorch's pool; also default_stream_pool's size.
  static constexpr std::size_t default_size = 32;
  /// The default exclusive capacity: as many exclusive streams as shared ones (`size`).
  static constexpr std::size_t same_as_size = static_cast<std::size_t>(-1);

  /// A pool of `size` shared streams of `d`, created with `options` (priority, non-blocking) when first used, and
  /// of up to `exclusive_capacity` streams for exclusive leases (same_as_size: `size`; 0: none), also created when
  /// first leased.
  explicit stream_pool(gpukit::device d, std::size_t size = default_size, stream_options options = {},
                       std::size_t exclusive_capacity = same_as_size);

  stream_pool(const stream_pool&) = delete;
  stream_pool& operator=(const stream_pool&) = delete;
  /// Destroys the streams (their pending work still runs, as with cudaStreamDestroy). Every lease must have ended:
  /// one still out is reported through gpukit::warn, and destroys its stream when it ends (unless that stream is then
  /// part of a capture: left to CUDA, with a warning). A stream given back while its capture runs is not destroyed,
  /// which would break that capture: it is left to CUDA, with a warning.
  ~stream_pool();

  /// The next shared stream, round-robin.
  stream_view next();

 private:
  // What the leases know of their pool: the pool until its destructor detaches them. Held while a lease gives its
  // stream back and while the pool detaches, so that a lease never gives back to a destroyed pool.
  struct lease_link {
    std::mutex mutex;
    stream_pool* pool = nullptr;
  };

 public:
  /// Exclusive use of a stream for the lifetime of the lease (move-only).
  class lease {
   public:
    /// Takes over `other`'s stream; `other` becomes moved-from.
    lease(lease&& other) noexcept;
    /// Gives the stream held back to its pool, then takes over `other`'s; `other` becomes moved-from.
    lease& operator=(lease&& other) noexcept;
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    ~lease();

    /// The leased stream. Throws invalid_argument_error on a moved-from lease.
    stream_view view() const;
    /// Same as view(); implicit so that a lease can be passed where a stream_view is expected.
    operator stream_view() const;  // NOLINT(google-explicit-constructor)

   private:
    friend class stream_pool;
    lease(std::shared_ptr<lease_link> link, std::unique_ptr<stream> s) noexcept;
    void give_back() noexcept;
    std::shared_ptr<lease_link> link_;  // null once moved from or ended
    std::unique_ptr<stream> stream_;
  };

  /// A stream for exclusive use: recycled from ended leases, or created while fewer than exclusive_capacity()
  /// exist. Throws invalid_argument_error, naming the device, the capacity and the leases out, when all are leased
  /// (see try_acquire_exclusive). The pool must outlive the lease (a lease that ends later is warned about when the
  /// pool goes, and destroys its stream).
  lease acquire_exclusive();

  /// Like acquire_exclusive(), but std::nullopt when all exclusive streams are leased. Still throws if creating a
  /// stream fails.
  std::optional<lease> try_acquire_exclusive();

  /// The device whose streams the pool holds.
  gpukit::device device() const noexcept;
  /// The number of shared (round-robin) streams.
  std::size_t size() const noexcept;
  /// Shared streams created so far (they are created on first use).
  std::size_t created() const;
  /// The most exclusive streams leased at once.
  std::size_t exclusive_capacity() const noexcept;
  /// Exclusive leases currently out.
  std::size_t exclusive_in_use() const;
  /// Created exclusive streams waiting in the reserve for the next lease (streams not yet created are not counted,
  /// nor streams given back inside a capture, which count against the capacity until the next acquire finds their
  /// capture ended).
  std::size_t exclusive_available() const;

 private:
  // A recycled or new exclusive stream, counted as leased; nullptr (with the leases out) at capacity.
  std::unique_ptr<stream> take_exclusive(std::size_t& in_use);

  void return_exclusive(std::unique_ptr<stream> s) noexcept;
  // Moves the streams given back during a capture whose capture has ended since to the free list (mutex_ held; asks
  // CUDA, which does not block); those whose state cannot be read go to `unreadable`, to be destroyed after the lock.
  void recycle_captured_returns_locked(std::vector<std::unique_ptr<stream>>& unreadable);

  gpukit::device device_;
  stream_options options_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<stream>> slots_;
  std::vector<std::unique_ptr<stream>> exclusive_free_;
  std::size_t exclusive_capacity_;
  std::vector<std::unique_ptr<stream>> exclusive_captured_;  // given back while captured: not leased until it ends
  std::size_t exclusive_in_use_ = 0;  // leases out; streams created = this + exclusive_free_ + exclusive_captured_
  std::atomic<std::size_t> counter_{0};
  std::shared_ptr<lease_link> link_;  // shared with the leases out
};

/// Priority classes of the process-wide pools.
enum class stream_priority { normal, high };

namespace detail {
/// The process-wide pools of default_stream_pool, by (ordinal, priority).
struct default_stream_pool_registry;
GPUKIT_EXPORT GPUKIT_INLINE default_stream_pool_registry& default_stream_pools();
/// Keeps `s` for the process, undestroyed: a stream a pool leaves to its capture whose release() ran out of host
/// memory for its record (its CUDA stream must not be destroyed, and the views made of it stay valid). Held in a
/// fixed table (exported: one per process), so that it stays reachable; past 64 such streams, the rest are leaked.
GPUKIT_EXPORT GPUKIT_INLINE void keep_undestroyed(std::unique_ptr<stream> s) noexcept;
}  // namespace detail

/// The process-wide pool of `d` for a priority class, created on first use with stream_pool::default_size
/// non-blocking streams (high: the device's greatest priority) and as many exclusive ones. Thread-safe; never
/// destroyed, so that it serves code that runs at exit (its streams go with the process).
GPUKIT_INLINE stream_pool& default_stream_pool(gpukit::device d, stream_priority priority = stream_priority::normal);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE void detail::keep_undestroyed(std::unique_ptr<stream> s) noexcept {
  static std::atomic<stream*> kept[64];  // zero before any use; never destroyed
  stream* const undestroyed = s.release();
  for (std::atomic<stream*>& slot : kept) {
    stream* empty = nullptr;
    if (slot.compare_exchange_strong(empty, undestroyed)) return;
  }
}

GPUKIT_INLINE stream_pool::stream_pool(gpukit::device d, std::size_t size, stream_options options,
                                       std::size_t exclusive_capacity)
    : device_(d),
      options_(options),
      slots_(size),
      exclusive_capacity_(exclusive_capacity == same_as_size ? size : exclusive_capacity),
      link_(std::make_shared<lease_link>()) {
  if (size == 0) throw invalid_argument_error("gpukit::stream_pool: the size must be at least 1");
  link_->pool = this;
}

GPUKIT_INLINE stream_view stream_pool::next() {
  const std::size_t index = counter_.fetch_add(1, std::memory_order_relaxed) % slots_.size();
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = slots_[index];
  if (!slot) {
    auto created = std::make_unique<stream>(device_, options_);
    if (const auto life = created->view().lifetime()) life->mark_shared_by_pool();  // gpukit::capture refuses it
    slot = std::move(created);
  }
  return slot->view();
}

GPUKIT_INLINE stream_pool::lease::lease(lease&& other) noexcept
    : link_(std::move(other.link_)), stream_(std::move(other.stream_)) {}

GPUKIT_INLINE stream_pool::lease& stream_pool::lease::operator=(lease&& other) noexcept {
  if (this != &other) {
    give_back();
    link_ = std::move(other.link_);
    stream_ = std::move(other.stream_);
  }
  return *this;
}

GPUKIT_INLINE stream_pool::lease::~lease() { give_back(); }

GPUKIT_INLINE stream_view stream_pool::lease::view() const {
  if (!stream_) throw invalid_argument_error("gpukit::stream_pool::lease: use of a moved-from lease");
  return stream_->view();
}

GPUKIT_INLINE stream_pool::lease::operator stream_view() const { return view(); }

GPUKIT_INLINE stream_pool::lease::lease(std::shared_ptr<lease_link> link, std::unique_ptr<stream> s) noexcept
    : link_(std::move(link)), stream_(std::move(s)) {}

GPUKIT_INLINE stream_pool::lease stream_pool::acquire_exclusive() {
  std::size_t in_use = 0;
  if (std::unique_ptr<stream> s = take_exclusive(in_use)) return lease(link_, std::move(s));
  throw invalid_argument_error(
      "gpukit::stream_pool::acquire_exclusive: all exclusive streams of the " + device_.to_string() +
          " pool are leased (" + std::to_string(in_use) +
          " leases out or given back inside a capture that has not ended, exclusive capacity " +
          std::to_string(exclusive_capacity_) +
          "); end a lease first, use try_acquire_exclusive(), or give the pool a larger exclusive capacity",
      cudaSuccess, {}, device_.is_cuda() ? device_.ordinal() : -1);
}

GPUKIT_INLINE std::optional<stream_pool::lease> stream_pool::try_acquire_exclusive() {
  std::size_t in_use = 0;
  if (std::unique_ptr<stream> s = take_exclusive(in_use)) return lease(link_, std::move(s));
  return std::nullopt;
}

GPUKIT_INLINE gpukit::device stream_pool::device() const noexcept { return device_; }

GPUKIT_INLINE std::size_t stream_pool::size() const noexcept { return slots_.size(); }

GPUKIT_INLINE std::size_t stream_pool::created() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t n = 0;
  for (const auto& slot : slots_) n += slot ? std::size_t{1} : std::size_t{0};
  return n;
}

GPUKIT_INLINE std::size_t stream_pool::exclusive_capacity() const noexcept { return exclusive_capacity_; }

GPUKIT_INLINE std::size_t stream_pool::exclusive_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exclusive_in_use_;
}

GPUKIT_INLINE std::size_t stream_pool::exclusive_available() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exclusive_free_.size();
}

namespace detail {
/// Where an exclusive stream given back stands with captures.
enum class returned_stream { free, captured, unreadable };

/// Whether exclusive stream `s` is still part of a capture, or whether it is cannot be told. Never throws.
GPUKIT_INLINE returned_stream returned_stream_state(const stream& s) noexcept {
  if (!s.device().is_cuda()) return returned_stream::free;
  try {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cuda_backend::stream_capture_status({s.cuda_handle(), s.device().ordinal()}, status) != cudaSuccess) {
      return returned_stream::unreadable;
    }
    return status == cudaStreamCaptureStatusNone ? returned_stream::free : returned_stream::captured;
  } catch (...) {
    return returned_stream::unreadable;
  }
}

/// Warns that exclusive streams whose capture state cannot be read are destroyed rather than leased again.
GPUKIT_INLINE void warn_unreadable_returns(std::size_t count, gpukit::device d) noexcept {
  if (count == 0) return;
  warn_parts("gpukit::stream_pool: ", count, " exclusive stream(s) of ", d,
             " given back could not be asked whether they are being captured (cudaStreamIsCapturing failed); "
             "destroyed rather than leased again");
}
}  // namespace detail

GPUKIT_INLINE void stream_pool::lease::give_back() noexcept {
  if (!link_) return;
  if (stream_) {
    const std::lock_guard<std::mutex> lock(link_->mutex);
    if (link_->pool != nullptr) link_->pool->return_exclusive(std::move(stream_));
  }
  link_.reset();
  if (!stream_) return;
  // The pool was destroyed first (and warned): the stream is destroyed, unless a capture still holds it.
  if (detail::returned_stream_state(*stream_) == detail::returned_stream::captured) {
    const gpukit::device d = stream_->device();
    try {
      (void)stream_->release();  // the handle is given up, not destroyed
    } catch (...) {
      detail::keep_undestroyed(std::move(stream_));  // out of host memory to keep its record: the object is kept
    }
    detail::warn_parts("gpukit::stream_pool::lease of ", d,
                       " ended after its pool while its stream is still being captured: left undestroyed (destroying "
                       "a captured stream breaks its capture)");
  }
  stream_.reset();
}

GPUKIT_INLINE std::unique_ptr<stream> stream_pool::take_exclusive(std::size_t& in_use) {
  std::vector<std::unique_ptr<stream>> unreadable;  // destroyed after the lock, with a warning
  std::unique_ptr<stream> recycled;
  bool create = false;  // a slot reserved for a stream created outside the lock
  {
    std::lock_guard<std::mutex> lock(mutex_);
    recycle_captured_returns_locked(unreadable);
    if (!exclusive_free_.empty()) {
      recycled = std::move(exclusive_free_.back());
      exclusive_free_.pop_back();
      ++exclusive_in_use_;
    } else if (exclusive_in_use_ + exclusive_captured_.size() >= exclusive_capacity_) {
      in_use = exclusive_in_use_ + exclusive_captured_.size();
    } else {
      ++exclusive_in_use_;
      create = true;
    }
  }
  detail::warn_unreadable_returns(unreadable.size(), device_);
  unreadable.clear();            // destroyed before one is created in their place: never over capacity
  if (!create) return recycled;  // nullptr at capacity
  try {
    return std::make_unique<stream>(device_, options_);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    --exclusive_in_use_;
    throw;
  }
}

GPUKIT_INLINE void stream_pool::return_exclusive(std::unique_ptr<stream> s) noexcept {
  const detail::returned_stream state = detail::returned_stream_state(*s);
  if (state == detail::returned_stream::unreadable) detail::warn_unreadable_returns(1, device_);
  std::lock_guard<std::mutex> lock(mutex_);
  --exclusive_in_use_;
  if (state == detail::returned_stream::unreadable) return;  // `s` is destroyed after the lock
  try {
    (state == detail::returned_stream::captured ? exclusive_captured_ : exclusive_free_).push_back(std::move(s));
  } catch (...) {
    // Out of memory growing the list: the stream is destroyed instead of recycled (created again when needed).
  }
}

GPUKIT_INLINE void stream_pool::recycle_captured_returns_locked(std::vector<std::unique_ptr<stream>>& unreadable) {
  if (exclusive_captured_.empty() || !exclusive_free_.empty()) return;
  // Nothing is allocated while the streams stay captured. A stream that cannot be moved (out of memory growing a
  // list; the strong guarantee leaves it intact) stays for the next acquire.
  for (auto it = exclusive_captured_.begin(); it != exclusive_captured_.end();) {
    const detail::returned_stream state = detail::returned_stream_state(**it);
    if (state == detail::returned_stream::captured) {
      ++it;
      continue;
    }
    try {
      (state == detail::returned_stream::free ? exclusive_free_ : unreadable).push_back(std::move(*it));
    } catch (...) {
      ++it;
      continue;
    }
    it = exclusive_captured_.erase(it);
  }
}

GPUKIT_INLINE stream_pool::~stream_pool() {
  {
    const std::lock_guard<std::mutex> lock(link_->mutex);  // waits for the give-backs underway
    link_->pool = nullptr;
  }
  if (exclusive_in_use_ != 0) {
    detail::warn_parts("gpukit::stream_pool of ", device_, " destroyed with ", exclusive_in_use_,
                       " exclusive lease(s) still out: each lease must end before its pool (one that ends later "
                       "destroys its stream)");
  }
  std::size_t left = 0;
  for (std::unique_ptr<stream>& s : exclusive_captured_) {
    if (detail::returned_stream_state(*s) != detail::returned_stream::captured) continue;
    try {
      (void)s->release();  // the handle is given up, not destroyed
    } catch (...) {
      detail::keep_undestroyed(std::move(s));  // out of host memory to keep its record: the object is kept
    }
    ++left;
  }
  if (left != 0) {
    detail::warn_parts("gpukit::stream_pool of ", device_, " destroyed while ", left,
                       " stream(s) given back to it are still being captured: left undestroyed (destroying a captured "
                       "stream breaks its capture); the pool must outlive the captures its leases joined");
  }
}

namespace detail {

/// The process-wide pools of default_stream_pool, by (ordinal, priority).
struct default_stream_pool_registry {
  std::mutex mutex;
  std::map<std::pair<int, int>, std::unique_ptr<stream_pool>> pools;
};

GPUKIT_INLINE default_stream_pool_registry& default_stream_pools() {
  // Never destroyed: leases and at-exit code may use the pools after static destruction began, and destroying the
  // streams then would be CUDA calls at exit.
  static auto* registry = new default_stream_pool_registry();
  return *registry;
}
}  // namespace detail

GPUKIT_INLINE stream_pool& default_stream_pool(gpukit::device d, stream_priority priority) {
  auto& registry = detail::default_stream_pools();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& pool = registry.pools[{d.ordinal(), static_cast<int>(priority)}];
  if (!pool) {
    stream_options options;
    options.priority = priority == stream_priority::high ? INT_MIN : 0;  // clamped to the device's greatest
    pool = std::make_unique<stream_pool>(d, stream_pool::default_size, options);
  }
  return *pool;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
