// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The per-thread current stream of each device (as in PyTorch): the stream gpukit uses when a call is not given
/// one. Until set, it is the device's default stream. stream_guard sets it for a scope together with the current
/// device, and restores both.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// A device's current stream on one thread, with the record of the gpukit::stream it was made from (if any), so that
/// its destruction is noticed.
struct current_stream_entry {
  gpukit::device device;
  stream_view stream;
  std::weak_ptr<const void> life;                        // the stream_life of the owner's mode
  bool (*expired)(const void* life) noexcept = nullptr;  // the owner's mode's stream_life::expired
  bool has_life = false;                                 // made from a gpukit::stream (life was set)
  bool foreign = false;           // owned in the other mode, whose destructions stream_expirations() does not count
  std::uint64_t expirations = 0;  // stream_expirations() when the stream was last seen alive
};
/// This thread's current streams, one entry per device that has one set (a handful at most); nullptr once this
/// thread's table has been destroyed (code that runs after, at thread or process exit: a static's destructor, an
/// atexit handler), when the default streams are current again.
GPUKIT_EXPORT GPUKIT_INLINE std::vector<current_stream_entry>* current_streams() noexcept;
}  // namespace detail

/// The calling thread's current stream of `d`: the last one set, else the device's default stream. Throws
/// invalid_argument_error if the gpukit::stream set was destroyed since (a stream must outlive its time as the
/// current one; set another, or use a stream_guard, whose scope ends first).
GPUKIT_INLINE stream_view current_stream(device d);

/// Makes `s` the calling thread's current stream of its device (a default stream's view made without a device, such
/// as stream_view{} or a cuda::stream_ref's, is taken as the current device's and keeps naming it). `s` must stay
/// alive while it is current: current_stream() refuses a gpukit::stream destroyed since (made current by its view,
/// or by its raw handle: that handle's owner is looked up). Throws
/// invalid_argument_error, changing nothing, for another thread's per-thread default stream
/// (stream_view::is_other_threads_stream): this thread cannot name it.
GPUKIT_INLINE void set_current_stream(stream_view s);

/// RAII: for its scope, makes `s` the current stream of its device and that device the current CUDA device (for a
/// CUDA stream); restores both afterwards. Not copyable or movable.
class stream_guard {
 public:
  /// Makes `s` and its device current until the guard is destroyed. Throws if the device cannot be found or made
  /// current, or, as set_current_stream, for another thread's per-thread default stream.
  explicit stream_guard(stream_view s);
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard();

 private:
  device_guard device_guard_;  // first: restored last
  device device_;
  std::optional<detail::current_stream_entry> previous_;  // none: the default stream was current
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::vector<current_stream_entry>* current_streams() noexcept {
  // Trivially destructible: still readable after the table's destruction, until the thread ends. (On the main
  // thread, thread_local objects are destroyed before statics and before earlier atexit handlers run.)
  thread_local bool torn_down = false;
  if (torn_down) return nullptr;
  struct table {
    bool& torn_down;
    std::vector<current_stream_entry> entries;
    ~table() { torn_down = true; }
  };
  thread_local table streams{torn_down, {}};
  return &streams.entries;
}

/// This thread's entry for `d`, or nullptr.
inline current_stream_entry* current_stream_entry_of(gpukit::device d) noexcept {
  std::vector<current_stream_entry>* entries = current_streams();
  if (entries == nullptr) return nullptr;
  for (auto& entry : *entries) {
    if (entry.device == d) return &entry;
  }
  return nullptr;
}
}  // namespace detail

GPUKIT_INLINE stream_view current_stream(device d) {
  detail::current_stream_entry* entry = detail::current_stream_entry_of(d);
  if (entry == nullptr) return stream_view::default_stream(d);
  if (!entry->has_life) return entry->stream;
  // A destroyed stream's record is gone unless someone else holds it, and then its destruction counted in
  // stream_expirations(): while neither says so (two loads), the stream is alive. Otherwise the record is held for
  // the look (its holder, an allocator, may let go on another thread).
  const std::uint64_t expirations = detail::stream_expirations().load(std::memory_order_acquire);
  // A stream of the other mode is looked at every time: its destructions are counted there.
  if (!entry->foreign && !entry->life.expired() && expirations == entry->expirations) return entry->stream;
  const std::shared_ptr<const void> life = entry->life.lock();
  if (life == nullptr || entry->expired(life.get())) {
    throw invalid_argument_error("gpukit::current_stream: the current stream of " + d.to_string() +
                                 " on this thread was destroyed while current (or released with stream::release, "
                                 "destroyed, and its handle given to a new gpukit::stream); set_current_stream keeps "
                                 "a view: set another stream first, or use a stream_guard");
  }
  entry->expirations = expirations;  // alive after those: no need to look again until another goes
  return entry->stream;
}

GPUKIT_INLINE void set_current_stream(stream_view s) {
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("set_current_stream");
  const device d = s.device();
  // A default-stream view made without a device means the current device's when used: stored with `d`, the one it
  // is filed under, so that it keeps naming d's stream whichever device is current later. (A view that knows its
  // device compares equal to this one and is kept as it is, with its id.)
  stream_view stored = s;
  if (s.is_default() && !s.is_cpu()) {
    const stream_view of_d(d, s.native_handle());
    if (of_d != s) stored = of_d;
  }
  const std::uint64_t expirations = detail::stream_expirations().load(std::memory_order_acquire);
  detail::current_stream_entry made{d, stored, s.lifetime(), detail::stream_life_expired, false, false, expirations};
  if (made.life.expired() && !s.is_cpu() && !s.is_default()) {
    // A view made from a raw handle carries no record: its owner's (a gpukit::stream of either mode) tells its
    // destruction.
    detail::stream_owner owner = detail::find_stream_owner(s.native_handle());
    made.life = owner.life;
    made.expired = owner.expired;
    made.foreign = !owner.this_mode;
  }
  made.has_life = !made.life.expired();
  if (detail::current_stream_entry* entry = detail::current_stream_entry_of(d)) {
    *entry = std::move(made);
    return;
  }
  if (std::vector<detail::current_stream_entry>* entries = detail::current_streams()) {
    entries->push_back(std::move(made));
  }  // else at exit, after this thread's table went: the default streams stay current
}

GPUKIT_INLINE stream_guard::stream_guard(stream_view s) : device_guard_(s.device()), device_(s.device()) {
  if (const detail::current_stream_entry* entry = detail::current_stream_entry_of(device_)) previous_ = *entry;
  set_current_stream(s);
}

GPUKIT_INLINE stream_guard::~stream_guard() {
  // The entry the constructor made or found is restored as it was, with no lookup of the previous stream (which
  // may have been destroyed meanwhile: current_stream() then says so): nothing here can fail.
  std::vector<detail::current_stream_entry>* table = detail::current_streams();
  if (table == nullptr) return;  // at exit, after this thread's table went
  std::vector<detail::current_stream_entry>& entries = *table;
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it->device != device_) continue;
    if (previous_) {
      *it = std::move(*previous_);
    } else {
      entries.erase(it);
    }
    return;
  }
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
