// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// memory_history: a bounded record of what a caching allocator did (like torch.cuda.memory._record_memory_history):
/// allocations, frees requested and completed, segments obtained from and returned to the upstream, pages mapped
/// and unmapped, out-of-memory errors and snapshots, each with a timestamp, the stream, the size and the thread's
/// memory_tag. A ring buffer: once max_entries events are held, each new one replaces the oldest.
///
///     auto history = std::make_shared<gpukit::memory_history>(100000);
///     allocator.set_memory_history(history);        // off by default; one branch per call while off
///     {
///       gpukit::memory_tag tag("kv-cache");         // allocations of this thread carry the tag
///       auto cache = gpukit::device_buffer<float>(n, s, allocator);
///     }
///     std::vector<gpukit::memory_event> events = history->events();
///
/// memory/history_export.hpp writes it as JSON, as an RMM log (CSV) and as a PyTorch snapshot (pickle).

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// What happened (the names PyTorch's snapshots use; memory_action_name gives them).
enum class memory_action : std::uint8_t {
  alloc,           ///< an allocation was handed out (size: the bytes requested)
  free_requested,  ///< the user freed it (size: the bytes requested)
  free_completed,  ///< its memory is reusable: at once, or once the streams recorded for it were done
  segment_alloc,   ///< memory obtained from the upstream (cudaMalloc)
  segment_free,    ///< memory returned to the upstream (cudaFree)
  segment_map,     ///< pages mapped into an expandable segment
  segment_unmap,   ///< pages unmapped from an expandable segment
  snapshot,        ///< a snapshot was taken
  oom,             ///< an allocation failed with out_of_memory_error (size: the bytes requested)
};

/// PyTorch's name of an action: "alloc", "free_requested", ..., "oom".
GPUKIT_INLINE const char* memory_action_name(memory_action a) noexcept;

/// One recorded event.
struct memory_event {
  memory_action action = memory_action::alloc;  ///< what happened; the meaning of `address` and `size` follows it
  std::uintptr_t address = 0;                   ///< the allocation, segment or pages (0 for oom and snapshot)
  std::size_t size = 0;                         ///< bytes (see memory_action)
  std::uintptr_t stream = 0;                    ///< the stream's key in the allocator (0 when not tied to a stream)
  std::int64_t time_ns = 0;                     ///< std::chrono::steady_clock, nanoseconds since its epoch
  std::uint64_t thread = 0;                     ///< a number for the calling thread (std::hash of its id)
  std::uint32_t tag = 0;                        ///< the thread's memory_tag (0: none); memory_tag_name gives the name
  std::size_t device_free = 0;                  ///< oom: the device's free bytes when known, else 0
};

namespace detail {

/// Process-wide tag names: id 0 is "", ids never change once given.
struct memory_tag_registry;

// Never destroyed: tags are named during exit too (report_leaks_at_exit, objects destroyed after main returns).
GPUKIT_EXPORT GPUKIT_INLINE memory_tag_registry& memory_tags();

/// The tag of the calling thread's allocations (0: none).
GPUKIT_EXPORT GPUKIT_INLINE std::uint32_t& current_memory_tag() noexcept;

GPUKIT_INLINE std::uint64_t this_thread_number() noexcept;

/// A new history id (memory_history::id): 1, 2, ... in the process.
GPUKIT_EXPORT GPUKIT_INLINE std::uint64_t new_memory_history_id() noexcept;

/// An allocation the history saw made: its tag and the bytes requested.
struct traced_allocation {
  std::uint32_t tag = 0;
  std::size_t requested = 0;
};

/// The allocations whose alloc `events` (memory_history::events()) hold and whose memory is not reusable at their
/// end (no free_completed yet: allocated, or freed and waiting for other streams), by address.
GPUKIT_INLINE std::unordered_map<std::uintptr_t, traced_allocation> active_allocations(
    const std::vector<memory_event>& events);

}  // namespace detail

/// The id of a tag name (the same for every call with that name in the process); "" is 0.
GPUKIT_INLINE std::uint32_t memory_tag_id(std::string_view name);

/// The name of a tag id ("" for 0 or an unknown id).
GPUKIT_INLINE std::string memory_tag_name(std::uint32_t id);

/// Tags the calling thread's allocations while it lives (nested tags restore the outer one). Costs nothing unless
/// an allocator records a history.
class memory_tag {
 public:
  /// Makes `name` the calling thread's tag (an empty name: none) until destroyed, on the same thread.
  explicit memory_tag(std::string_view name);
  memory_tag(const memory_tag&) = delete;
  memory_tag& operator=(const memory_tag&) = delete;
  ~memory_tag();

 private:
  std::uint32_t previous_;
};

/// A history's events with the counts that describe them, read at one moment (recorded - dropped == events.size()).
struct memory_history_contents {
  std::vector<memory_event> events;  ///< the events held, oldest first
  std::size_t recorded = 0;          ///< events recorded since construction (or clear())
  std::size_t dropped = 0;           ///< events recorded and no longer held
  std::uint64_t history_id = 0;      ///< the history's id (memory_history::id) when read
};

/// Where one event stands in a history: the history's id and the number of events it had recorded, that one
/// included (events are numbered 1, 2, ... from construction or clear(); the held ones are dropped + 1 to recorded).
/// allocator_snapshot::history_position says where a snapshot's own `snapshot` event is.
struct memory_history_position {
  std::uint64_t history_id = 0;  ///< memory_history::id of the history; 0: none (no history was attached)
  std::size_t recorded = 0;      ///< the event's number
};

/// A bounded history of allocator events (see the file comment). Thread-safe; record() never throws.
class memory_history {
 public:
  /// Keeps the latest `max_entries` events. Throws invalid_argument_error for 0.
  explicit memory_history(std::size_t max_entries = 100000);

  memory_history(const memory_history&) = delete;
  memory_history& operator=(const memory_history&) = delete;

  /// Appends an event stamped with the time, the calling thread and its memory_tag (the allocator calls this).
  void record(memory_action action, std::uintptr_t address, std::size_t size, std::uintptr_t stream,
              std::size_t device_free = 0) noexcept;
  /// Records a `snapshot` event (as record) and says where it stands: the allocator stores it in the snapshot it
  /// takes (allocator_snapshot::history_position), so that exports end the trace at exactly that event. Its
  /// `recorded` is 0 when the event could not be held (no memory for it).
  memory_history_position record_snapshot() noexcept;

  /// The events held, oldest first.
  std::vector<memory_event> events() const;
  /// The events held and the counts, under one lock: while others record, separate calls to events(), recorded()
  /// and dropped() may each see a different moment.
  memory_history_contents contents() const;

  /// Events recorded since construction (or clear()), including those the ring no longer holds.
  std::size_t recorded() const;
  /// Events the ring no longer holds: the oldest, dropped to make room, or one it had no memory for (so recorded()
  /// minus dropped() is the number of events held).
  std::size_t dropped() const;
  /// The most events the ring holds: the constructor's `max_entries`, or fewer once an allocation failure stopped
  /// its growth (until clear()).
  std::size_t max_entries() const;

  /// Forgets every event; the history gets a new id.
  void clear();

  /// A number for this history, unique in the process and renewed by clear(): positions (memory_history_position)
  /// taken before a clear() or in another history do not match it.
  std::uint64_t id() const;

  /// An event's time as microseconds since the Unix epoch (the system clock at construction, plus the steady time
  /// since then), as PyTorch's time_us.
  std::int64_t unix_time_us(const memory_event& e) const noexcept;

 private:
  memory_history_position append(memory_action action, std::uintptr_t address, std::size_t size, std::uintptr_t stream,
                                 std::size_t device_free) noexcept;

  mutable std::mutex mutex_;
  std::vector<memory_event> ring_;
  std::size_t next_ = 0;  // the oldest event once the ring is full
  std::size_t max_entries_ = 0;
  std::size_t requested_entries_ = 0;
  std::size_t recorded_ = 0;
  std::size_t dropped_ = 0;
  std::uint64_t id_ = 0;
  std::chrono::steady_clock::time_point steady_origin_;
  std::chrono::system_clock::time_point system_origin_;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE const char* memory_action_name(memory_action a) noexcept {
  switch (a) {
    case memory_action::alloc:
      return "alloc";
    case memory_action::free_requested:
      return "free_requested";
    case memory_action::free_completed:
      return "free_completed";
    case memory_action::segment_alloc:
      return "segment_alloc";
    case memory_action::segment_free:
      return "segment_free";
    case memory_action::segment_map:
      return "segment_map";
    case memory_action::segment_unmap:
      return "segment_unmap";
    case memory_action::snapshot:
      return "snapshot";
    case memory_action::oom:
      return "oom";
  }
  return "unknown";
}
namespace detail {

/// Process-wide tag names: id 0 is "", ids never change once given.
struct memory_tag_registry {
  std::mutex mutex;
  std::vector<std::string> names{std::string()};
  std::unordered_map<std::string, std::uint32_t> ids;
};

GPUKIT_INLINE memory_tag_registry& memory_tags() {
  static memory_tag_registry* registry = new memory_tag_registry();
  return *registry;
}

GPUKIT_INLINE std::uint32_t& current_memory_tag() noexcept {
  thread_local std::uint32_t id = 0;
  return id;
}

GPUKIT_INLINE std::uint64_t new_memory_history_id() noexcept {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

GPUKIT_INLINE std::uint64_t this_thread_number() noexcept {
  thread_local const std::uint64_t number = std::hash<std::thread::id>()(std::this_thread::get_id());
  return number;
}

GPUKIT_INLINE std::unordered_map<std::uintptr_t, traced_allocation> active_allocations(
    const std::vector<memory_event>& events) {
  std::unordered_map<std::uintptr_t, traced_allocation> active;
  for (const memory_event& e : events) {
    if (e.action == memory_action::alloc) active[e.address] = traced_allocation{e.tag, e.size};
    if (e.action == memory_action::free_completed) active.erase(e.address);
  }
  return active;
}
}  // namespace detail

GPUKIT_INLINE std::uint32_t memory_tag_id(std::string_view name) {
  if (name.empty()) return 0;
  detail::memory_tag_registry& r = detail::memory_tags();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto found = r.ids.find(std::string(name));
  if (found != r.ids.end()) return found->second;
  const auto id = static_cast<std::uint32_t>(r.names.size());
  r.names.emplace_back(name);
  r.ids.emplace(std::string(name), id);
  return id;
}

GPUKIT_INLINE std::string memory_tag_name(std::uint32_t id) {
  detail::memory_tag_registry& r = detail::memory_tags();
  std::lock_guard<std::mutex> lock(r.mutex);
  return id < r.names.size() ? r.names[id] : std::string();
}

GPUKIT_INLINE memory_tag::memory_tag(std::string_view name) : previous_(detail::current_memory_tag()) {
  detail::current_memory_tag() = memory_tag_id(name);
}

GPUKIT_INLINE memory_tag::~memory_tag() { detail::current_memory_tag() = previous_; }

GPUKIT_INLINE memory_history::memory_history(std::size_t max_entries)
    : id_(detail::new_memory_history_id()),
      steady_origin_(std::chrono::steady_clock::now()),
      system_origin_(std::chrono::system_clock::now()) {
  if (max_entries == 0) throw invalid_argument_error("gpukit::memory_history: max_entries must be positive");
  ring_.reserve(max_entries < 4096 ? max_entries : 4096);
  max_entries_ = max_entries;
  requested_entries_ = max_entries;
}

GPUKIT_INLINE void memory_history::record(memory_action action, std::uintptr_t address, std::size_t size,
                                          std::uintptr_t stream, std::size_t device_free) noexcept {
  (void)append(action, address, size, stream, device_free);
}

GPUKIT_INLINE memory_history_position memory_history::record_snapshot() noexcept {
  return append(memory_action::snapshot, 0, 0, 0, 0);
}

GPUKIT_INLINE memory_history_position memory_history::append(memory_action action, std::uintptr_t address,
                                                             std::size_t size, std::uintptr_t stream,
                                                             std::size_t device_free) noexcept {
  memory_event e;
  e.action = action;
  e.address = address;
  e.size = size;
  e.stream = stream;
  e.thread = detail::this_thread_number();
  e.tag = detail::current_memory_tag();
  e.device_free = device_free;
  std::lock_guard<std::mutex> lock(mutex_);
  // Stamped under the lock: times never go back in the ring's order.
  e.time_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (ring_.size() < max_entries_) {
    try {
      // Grows up to max_entries, reserved in steps (not all at once), never past it: the vector's own growth
      // would double past max_entries.
      const std::size_t capacity = ring_.capacity();
      if (ring_.size() == capacity) {
        ring_.reserve(capacity > max_entries_ / 2 ? max_entries_ : capacity == 0 ? 1 : 2 * capacity);
      }
      ring_.push_back(e);
      ++recorded_;
      return memory_history_position{id_, recorded_};
    } catch (...) {
      if (ring_.empty()) {  // no memory for even one event: this one is lost, and counted as recorded and dropped
        ++recorded_;
        ++dropped_;
        return memory_history_position{id_, 0};
      }
      max_entries_ = ring_.size();  // out of memory: keep the ring at the size it has
    }
  }
  ring_[next_] = e;
  next_ = (next_ + 1) % ring_.size();
  ++recorded_;
  ++dropped_;
  return memory_history_position{id_, recorded_};
}

GPUKIT_INLINE std::vector<memory_event> memory_history::events() const { return contents().events; }

GPUKIT_INLINE memory_history_contents memory_history::contents() const {
  memory_history_contents out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.events.reserve(ring_.size());
  out.events.insert(out.events.end(), ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
  out.events.insert(out.events.end(), ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_));
  out.recorded = recorded_;
  out.dropped = dropped_;
  out.history_id = id_;
  return out;
}

GPUKIT_INLINE std::size_t memory_history::recorded() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recorded_;
}

GPUKIT_INLINE std::size_t memory_history::dropped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return dropped_;
}

GPUKIT_INLINE std::size_t memory_history::max_entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_entries_;
}

GPUKIT_INLINE void memory_history::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ring_.clear();
  next_ = 0;
  max_entries_ = requested_entries_;  // undoes a shrink after an allocation failure
  recorded_ = 0;
  dropped_ = 0;
  id_ = detail::new_memory_history_id();  // positions taken before no longer match
}

GPUKIT_INLINE std::uint64_t memory_history::id() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return id_;
}

GPUKIT_INLINE std::int64_t memory_history::unix_time_us(const memory_event& e) const noexcept {
  const auto since_origin = std::chrono::nanoseconds(e.time_ns) - steady_origin_.time_since_epoch();
  return std::chrono::duration_cast<std::chrono::microseconds>(system_origin_.time_since_epoch() + since_origin)
      .count();
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
