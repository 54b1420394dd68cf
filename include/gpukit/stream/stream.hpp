// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Streams: stream_view (non-owning, cheap to copy, converts from cudaStream_t) and stream (owning, move-only).
/// A stream belongs to a device. On a CUDA device it is a cudaStream_t. On the CPU device a stream is an in-order
/// asynchronous queue served by a worker thread, and the CPU's default stream runs work synchronously on the
/// calling thread; both behave like CUDA streams, so code written against streams runs on either. Each operation
/// chooses its backend once: detail/cpu_backend.hpp (queues and markers) or detail/cuda_backend.hpp (every CUDA
/// runtime call); this file makes none of its own.
///
/// Destroying a stream with pending work is defined: a CUDA stream's destructor returns at once and the work still
/// completes (cudaStreamDestroy semantics); a CPU stream's destructor waits for its work to finish.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/detail/cpu_backend.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>
#include <gpukit/version.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

// Outside the per-mode namespace (detail/config.hpp): a capture begun in code built in one default-stream mode must
// be seen by allocators built in the other, since both use the same CUDA streams.
namespace gpukit {
namespace mode_independent {

/// Captures begun by gpukit::capture that have not ended yet, in this process. With capture_checks::gpukit_captures
/// an allocator asks CUDA whether a stream is captured only while this is not zero (one load instead of a
/// cudaStreamIsCapturing per call).
GPUKIT_EXPORT inline std::atomic<std::int64_t>& gpukit_captures_underway() noexcept {
  static std::atomic<std::int64_t> count{0};
  return count;
}

/// gpukit::capture calls underway on the calling thread (the work they capture runs on it): what waits for the
/// captures to end cannot be waited for on this thread.
GPUKIT_EXPORT inline int& gpukit_captures_on_this_thread() noexcept {
  thread_local int count = 0;
  return count;
}

/// Device ordinals with counters of their own below; higher ones share the last (conservative).
inline constexpr int per_device_counters = 64;
/// The counter of device `ordinal` among per_device_counters.
constexpr int counter_of(int ordinal) noexcept {
  return ordinal < 0 || ordinal >= per_device_counters ? per_device_counters - 1 : ordinal;
}

/// Of gpukit_captures_underway, those of a blocking stream of device `ordinal` (one that synchronizes with the legacy
/// default stream: created without cudaStreamNonBlocking, or a per-thread default stream). A query of or a wait for
/// that device's legacy stream would join such a capture implicitly, and invalidate it. Counted before the capture
/// waits for legacy_stream_holds, and uncounted after it ends.
GPUKIT_EXPORT inline std::atomic<std::int64_t>& gpukit_blocking_captures_underway(int ordinal) noexcept {
  static std::atomic<std::int64_t> counts[per_device_counters];  // static: zero before any use
  return counts[counter_of(ordinal)];
}

/// Of gpukit_blocking_captures_underway(ordinal), those on the calling thread: a wait there for the captures to end
/// would wait for itself.
GPUKIT_EXPORT inline int& gpukit_blocking_captures_on_this_thread(int ordinal) noexcept {
  thread_local int counts[per_device_counters] = {};
  return counts[counter_of(ordinal)];
}

/// Of gpukit_blocking_captures_underway(ordinal), those past their wait for the capture holds (begun, or about to
/// begin: they wait for the legacy_stream_holds next), with the forks event::wait counted. event::record and
/// event::wait on the device's legacy stream are refused only once this is not zero: work enqueued under a
/// capture_hold (which a counted capture waits for before it is counted here) must not be refused.
GPUKIT_EXPORT inline std::atomic<std::int64_t>& gpukit_blocking_captures_begun(int ordinal) noexcept {
  static std::atomic<std::int64_t> counts[per_device_counters];  // static: zero before any use
  return counts[counter_of(ordinal)];
}

/// Queries of, and event records on, device `ordinal`'s legacy default stream being made (detail::legacy_stream_hold):
/// a gpukit capture of a blocking stream of the device begins only once this is zero.
GPUKIT_EXPORT inline std::atomic<std::int64_t>& legacy_stream_holds(int ordinal) noexcept {
  static std::atomic<std::int64_t> counts[per_device_counters];
  return counts[counter_of(ordinal)];
}

/// Threads enqueueing work that a gpukit capture begun meanwhile would break (detail::capture_hold), counted while
/// they do: gpukit::capture begins a capture only once this is zero.
GPUKIT_EXPORT inline std::atomic<std::int64_t>& capture_holds() noexcept {
  static std::atomic<std::int64_t> count{0};
  return count;
}

/// A stream given up by stream::release(): its record (a stream_life of the mode named `mode`, kept type-erased; never
/// expired, so dropping it makes no CUDA call) and its id.
struct released_stream {
  std::shared_ptr<void> life;   ///< the stream_life the views made before the release point at
  std::array<char, 32> mode{};  ///< GPUKIT_ABI_NAMESPACE of the code that released it (its stream_life's type)
  unsigned long long id = 0;    ///< cudaStreamGetId of the stream
  /// Marks `life` destroyed (stream_life::expire, no CUDA call) when the record is dropped: its stream is gone, and
  /// those who hold the record (allocators, a current stream) learn it. Code of the mode that made the record.
  void (*expire)(void* life) noexcept = nullptr;
};

/// The records of CUDA streams given up by stream::release(), by handle: one per default-stream mode that released
/// the stream, plus one per release of it made with an id that cannot be compared (detail::keep_released_stream)
/// (exported: one per process, shared by the modes as the handles are; never destroyed: streams may be created and
/// wrapped during exit). The views made before a release point at its record, and the stream lives on after its
/// gpukit::stream object.
struct released_stream_table {
  std::mutex mutex;                                                ///< guards records
  std::unordered_multimap<cudaStream_t, released_stream> records;  ///< by handle
  std::atomic<std::size_t> count{0};  ///< records.size(), read without the lock by stream creation and destruction
};

/// The process's released_stream_table; made as stream_table_v1 is.
GPUKIT_EXPORT inline released_stream_table& released_stream_table_v1() noexcept {
  alignas(released_stream_table) static unsigned char storage[sizeof(released_stream_table)];
  static released_stream_table* const table = ::new (static_cast<void*>(storage)) released_stream_table;
  return *table;
}

/// The record of a CUDA stream a gpukit::stream owns now: its stream_life (type-erased, of the mode named `mode`),
/// which the views made from its raw handle have not got.
struct owned_stream_record {
  std::weak_ptr<void> life;     ///< the owner's stream_life
  std::array<char, 32> mode{};  ///< GPUKIT_ABI_NAMESPACE of the owner's code (its stream_life's type)
  /// Code of the owner's mode, so that either mode may ask of `life` (held): whether the stream was destroyed, and
  /// whether it is a stream of stream_pool::next().
  bool (*expired)(const void* life) noexcept = nullptr;
  bool (*shared_by_pool)(const void* life) noexcept = nullptr;  ///< see `expired`
};

/// The records of the CUDA streams gpukit::stream objects own, by handle (exported: one per process, shared by the
/// modes; never destroyed, made as stream_table_v1 is). A view made from a raw handle finds its stream's record
/// here where it matters: gpukit::capture refuses a pool's shared stream, and current_stream notices the
/// destruction of a stream made current through its handle. Entered best effort (out of memory: not entered, and
/// such a view is unknown, as any raw handle's), removed before the stream is destroyed or released.
struct owned_stream_records {
  std::shared_mutex mutex;                                          ///< guards by_handle
  std::unordered_map<cudaStream_t, owned_stream_record> by_handle;  ///< by handle
  std::atomic<std::size_t> count{0};  ///< by_handle.size(), read without the lock to skip an empty table
};

/// The process's owned_stream_records; made as stream_table_v1 is.
GPUKIT_EXPORT inline owned_stream_records& owned_stream_records_v1() noexcept {
  alignas(owned_stream_records) static unsigned char storage[sizeof(owned_stream_records)];
  static owned_stream_records* const table = ::new (static_cast<void*>(storage)) owned_stream_records;
  return *table;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Callables that can be empty (a null function pointer, an empty std::function): enqueueing one is refused at once
/// rather than failing later on the stream's thread.
template <class F>
struct may_be_empty : std::is_pointer<F> {};
template <class Signature>
struct may_be_empty<std::function<Signature>> : std::true_type {};
}  // namespace detail

class stream;

namespace detail {
/// Held around a query of, or an event record on, device `ordinal`'s legacy default stream, unless refused: a gpukit
/// capture of a blocking stream of the device then waits before it begins (wait_for_legacy_stream_holds). Refused
/// while such a capture is counted, so that polling threads cannot keep one from beginning: their holds drain.
/// Never held through a wait. Also held around the legacy stream's id question (default_stream_id). Event records and
/// waits of gpukit::event on the legacy stream (`event_work`) are refused only once such a capture has waited for the
/// capture holds (gpukit_blocking_captures_begun): an allocator's record made under a capture_hold, which the capture
/// waits for first, must go ahead.
class legacy_stream_hold {
 public:
  explicit legacy_stream_hold(int ordinal, bool event_work = false) noexcept
      : ordinal_(ordinal),
        captures_(event_work ? mode_independent::gpukit_blocking_captures_begun(ordinal)
                             : mode_independent::gpukit_blocking_captures_underway(ordinal)) {
    // A capture already counted: refused without touching the holds, which it waits to see at zero.
    if (captures_.load(std::memory_order_seq_cst) != 0) {
      refused_ = true;
      return;
    }
    // Sequentially consistent on both sides (this increment then load, the capture's increment then load): either
    // the capture sees this hold and waits, or this sees the capture and is refused.
    mode_independent::legacy_stream_holds(ordinal_).fetch_add(1, std::memory_order_seq_cst);
    if (captures_.load(std::memory_order_seq_cst) == 0) return;
    refused_ = true;
    mode_independent::legacy_stream_holds(ordinal_).fetch_sub(1, std::memory_order_release);
  }
  ~legacy_stream_hold() {
    // Release: the query or record made under the hold happens before the capture that waited for it begins.
    if (!refused_) mode_independent::legacy_stream_holds(ordinal_).fetch_sub(1, std::memory_order_release);
  }
  legacy_stream_hold(const legacy_stream_hold&) = delete;
  legacy_stream_hold& operator=(const legacy_stream_hold&) = delete;

  /// True when a gpukit capture of a blocking stream of the device had begun, or was about to: nothing is held.
  bool refused() const noexcept { return refused_; }

 private:
  int ordinal_;
  const std::atomic<std::int64_t>& captures_;  // the count that refuses this hold
  bool refused_ = false;
};

/// Waits until `holds` is zero. Holds are short (an event record, a wait enqueued, a query): yields first, then
/// sleeps.
inline void wait_for_no_holds(const std::atomic<std::int64_t>& holds) noexcept {
  for (int round = 0; holds.load(std::memory_order_seq_cst) != 0; ++round) {
    if (round < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

/// Whether a gpukit capture runs now, on any thread: a hint (one may begin at once, and a capture begun with the raw
/// runtime is never seen; only a capture_hold tells for sure).
inline bool gpukit_capture_underway() noexcept {
  return mode_independent::gpukit_captures_underway().load(std::memory_order_acquire) != 0;
}

/// Whether a blocking stream of `d` is being captured, raw captures included: the legacy stream's capture status then
/// answers cudaErrorStreamCaptureImplicit, leaving the capture intact (the header's way to ask first), and work on the
/// legacy stream would join that capture and invalidate it. One cudaStreamIsCapturing with `d` current; false for the
/// CPU and where the question fails. A capture may begin right after: only gpukit's can be held off (capture_hold).
inline bool legacy_stream_captured(gpukit::device d) noexcept {
  if (!d.is_cuda()) return false;
  try {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    return cuda_backend::stream_capture_status({cudaStreamLegacy, d.ordinal()}, status) ==
           cudaErrorStreamCaptureImplicit;
  } catch (...) {
    (void)cudaGetLastError();  // the guard's failure: the call that follows says what is wrong
    return false;
  }
}

/// Whether a device-wide wait on `d` (cudaDeviceSynchronize) would meet a capture gpukit can see, which it would
/// invalidate, in any mode (measured on an H100): a gpukit capture on any thread and device, or a capture of a
/// blocking stream of `d`, raw ones included (legacy_stream_captured). A raw capture of a non-blocking stream is not
/// seen. One atomic load, then one cudaStreamIsCapturing with `d` current: for release paths, not hot ones.
inline bool capture_in_sight(gpukit::device d) noexcept {
  if (!d.is_cuda()) return false;
  return gpukit_capture_underway() || legacy_stream_captured(d);
}

/// True for cuda::stream_ref once <gpukit/stream/stream_ref.hpp> is included (which needs the toolkit's CCCL). A
/// trait rather than a direct mention keeps this header free of CCCL and identical in every translation unit.
template <class T>
struct is_cuda_stream_ref : std::false_type {};

/// Counts gpukit streams destroyed in this process, so an allocator notices with one relaxed load that some stream it
/// knows may be gone.
GPUKIT_EXPORT GPUKIT_INLINE std::atomic<std::uint64_t>& stream_expirations() noexcept;

/// CPU streams have no CUDA id: they get numbers with the top bit set (CUDA's ids count up from small numbers), so no
/// CPU stream is ever mistaken for a CUDA stream. The CPU's default stream is the first of them.
constexpr unsigned long long cpu_stream_id_bit = 1ull << 63;
GPUKIT_EXPORT GPUKIT_INLINE unsigned long long next_cpu_stream_id() noexcept;

/// cudaStreamGetId of device `ordinal`'s legacy default stream, or of the calling thread's per-thread default stream
/// of that device, looked up once per thread and device (the ids never change) with the device current.
GPUKIT_EXPORT GPUKIT_INLINE unsigned long long default_stream_id(int ordinal, bool per_thread);

/// Throws invalid_argument_error for `operation` on another thread's per-thread default stream (a view resolved there).
[[noreturn]] GPUKIT_INLINE void throw_other_threads_stream(const char* operation);

/// What outlives a gpukit::stream for those that remember it (allocators, pinned pools): its id, whether it was
/// destroyed, and whether the work enqueued before that has completed. A CUDA stream destroyed while remembered
/// records a final event first (cudaStreamDestroy returns while work is pending, and the handle goes to the next
/// stream created, so afterwards nothing else can tell); a CPU stream waits for its work when destroyed.
class stream_life : public std::enable_shared_from_this<stream_life> {
 public:
  /// `held` lives as long as this record: a CPU stream's queue, which the views of the stream point to, so that one
  /// who remembers the stream may still ask whether it is idle after it was destroyed (an allocator's free racing
  /// the destruction, between its look at expired() and its question).
  stream_life(unsigned long long id, int ordinal, std::shared_ptr<const void> held = nullptr) noexcept;
  stream_life(const stream_life&) = delete;
  stream_life& operator=(const stream_life&) = delete;
  ~stream_life();

  /// cudaStreamGetId, or a CPU stream's number (with cpu_stream_id_bit).
  unsigned long long id() const noexcept;
  /// The CUDA ordinal, or -1 for the CPU.
  int ordinal() const noexcept;
  /// True once the stream was destroyed.
  bool expired() const noexcept;

  /// After expired(): true once the work enqueued before the destruction has completed (cudaEventQuery of the final
  /// event; never blocks). Without a final event (its creation failed, or the stream was destroyed while captured)
  /// the answer stays false until wait_finished() has synchronized the device.
  bool finished() const noexcept;

  /// After expired(): the event recorded at the destruction, for device-side waits (nullptr before, when its
  /// creation failed, or when the stream was destroyed while captured). It lives as long as this record.
  cudaEvent_t final_event() const noexcept;

  /// After expired(): blocks until that work has completed (the whole device's, without a final event: a device
  /// synchronize, after which finished() is true).
  void wait_finished() const;

  /// Called by ~stream just before cudaStreamDestroy of `handle` (nullptr for a CPU stream, whose work is done).
  /// `remembered`: someone else holds this record, so a final event is worth recording and the destruction worth
  /// announcing (stream_expirations). Never throws. Waits while keep_alive() is held; a failure to record the final
  /// event is reported once the stream counts as destroyed (expired()) and nothing is held.
  void expire(cudaStream_t handle, bool remembered) noexcept;

  /// Keeps the stream from being destroyed while held: its ~stream (expire) waits. For a caller that enqueues work on
  /// the stream's handle after seeing !expired() (an allocator's free): otherwise another thread could destroy the
  /// stream in between, and a new stream get its handle and that work. Held only while enqueueing: let go before a
  /// host wait, a lock or a user callback.
  std::unique_lock<std::mutex> keep_alive() const;

  /// Marks the stream as one stream_pool::next() hands out, which users of the pool share: gpukit::capture refuses
  /// it. Set once, when the pool creates it.
  void mark_shared_by_pool() const noexcept { shared_by_pool_.store(true, std::memory_order_release); }
  /// Whether mark_shared_by_pool() was called.
  bool shared_by_pool() const noexcept { return shared_by_pool_.load(std::memory_order_acquire); }

 private:
  unsigned long long id_;
  int ordinal_;
  std::shared_ptr<const void> held_;
  mutable std::mutex in_use_;    // held by keep_alive(), and by expire() before the destruction
  cudaEvent_t final_ = nullptr;  // written before expired_ is set, read after it is seen
  std::atomic<bool> expired_{false};
  mutable std::atomic<bool> synchronized_{false};  // without final_: a device synchronize began after the expiry
  mutable std::atomic<bool> shared_by_pool_{false};
};

/// This mode's ABI namespace by name: a released stream's record is taken back only by code of the same mode, whose
/// stream_life it is (mode_independent::released_stream_table).
inline constexpr const char* abi_namespace_name = GPUKIT_DETAIL_STRINGIFY(GPUKIT_ABI_NAMESPACE);
/// This mode's name as the exported tables keep it with a record (cut to 31 characters, padded with '\0').
GPUKIT_INLINE std::array<char, 32> this_mode_tag() noexcept;
/// Whether `tag` (this_mode_tag() of the code that made a record) names this mode.
GPUKIT_INLINE bool is_this_mode(const std::array<char, 32>& tag) noexcept;
/// Keeps `life`, the record of released stream `handle`, in mode_independent::released_stream_table, and drops the
/// records of other streams that had the handle (ids that differ; an id of gpukit's, own_stream_id_bit, given while
/// a stream was captured, compares with none: such a record is kept). A record goes back to a gpukit::stream of this
/// mode that wraps the same stream with ownership; all are dropped when a gpukit::stream of either mode that owns the
/// handle is destroyed, or when one is created with it (CUDA reused it: the released stream was destroyed). A
/// released stream destroyed outside gpukit leaves its records there until then. Throws std::bad_alloc (nothing kept).
GPUKIT_INLINE void keep_released_stream(cudaStream_t handle, const std::shared_ptr<stream_life>& life);
/// For a stream with id `id` that `handle` names and a gpukit::stream now owns: returns this mode's record of it
/// (removed from the table), or nullptr; drops the records of other streams that had the handle. Another mode's
/// record of the same stream stays with that mode's views; records whose id cannot be compared stay.
GPUKIT_INLINE std::shared_ptr<stream_life> reclaim_released_stream(cudaStream_t handle, unsigned long long id) noexcept;
/// Drops every record of `handle`: the stream that has it is being destroyed by its gpukit::stream.
GPUKIT_INLINE void drop_released_streams(cudaStream_t handle) noexcept;
/// Enters `life`, the record of CUDA stream `handle`, which a gpukit::stream of this mode now owns, in
/// mode_independent::owned_stream_records (best effort: out of memory, it is not entered).
GPUKIT_INLINE void enter_owned_stream(cudaStream_t handle, const std::shared_ptr<stream_life>& life) noexcept;
/// Removes the record of `handle`: its owner destroys or releases it.
GPUKIT_INLINE void remove_owned_stream(cudaStream_t handle) noexcept;
/// What a view made from a raw handle learns of the gpukit::stream that owns the handle, of either mode
/// (mode_independent::owned_stream_records): its record, held, and the owner's mode's questions about it. `life` is
/// null when none owns it (or its record could not be entered).
struct stream_owner {
  std::shared_ptr<const void> life;
  bool (*expired)(const void* life) noexcept = nullptr;
  bool (*shared_by_pool)(const void* life) noexcept = nullptr;
  bool this_mode = false;  ///< `life` is a stream_life of this mode
};
/// The owner of stream `handle`, for views made from raw handles, which carry no record.
GPUKIT_INLINE stream_owner find_stream_owner(cudaStream_t handle) noexcept;
/// stream_life::expired and shared_by_pool of a record of this mode, as owned_stream_record keeps them.
GPUKIT_INLINE bool stream_life_expired(const void* life) noexcept;
GPUKIT_INLINE bool stream_life_shared_by_pool(const void* life) noexcept;
}  // namespace detail

/// A non-owning reference to a stream of some device. It must not outlive the stream it refers to.
///
/// A default-constructed view, or one converted from a raw cudaStream_t, refers to a CUDA stream whose device is
/// looked up when needed (cudaStreamGetDevice; for the default streams, the current device).
///
/// Special handles: 0 is CUDA's default stream, the legacy one (cudaStreamLegacy), or in code built with per-thread
/// default streams (nvcc --default-stream per-thread, CUDA_API_PER_THREAD_DEFAULT_STREAM) the calling thread's own
/// (cudaStreamPerThread). Both belong to the current device: a view of a known device makes that device current
/// around each use. cudaStreamPerThread is a different stream in each host thread.
class stream_view {
 public:
  /// CUDA's default stream (handle 0) of the calling thread's current device.
  constexpr stream_view() noexcept = default;

  /// A raw CUDA stream handle; implicit so that APIs taking a stream_view accept cudaStream_t.
  constexpr stream_view(cudaStream_t handle) noexcept : cuda_(handle) {}  // NOLINT(google-explicit-constructor)

  /// From cuda::stream_ref (include <gpukit/stream/stream_ref.hpp>).
  template <class StreamRef, std::enable_if_t<detail::is_cuda_stream_ref<StreamRef>::value, int> = 0>
  stream_view(StreamRef ref) noexcept : cuda_(ref.get()) {}  // NOLINT(google-explicit-constructor)

  /// To cuda::stream_ref (include <gpukit/stream/stream_ref.hpp>). Throws invalid_argument_error for a CPU stream,
  /// and for a default stream of a device other than the current one, or of another thread: a stream_ref holds only
  /// the handle, and a default stream's handle names the calling thread's stream of the current device.
  template <class StreamRef, std::enable_if_t<detail::is_cuda_stream_ref<StreamRef>::value, int> = 0>
  operator StreamRef() const {  // NOLINT(google-explicit-constructor)
    return StreamRef(stream_ref_handle());
  }

  /// A raw CUDA stream handle of a known device (for cudaStreamLegacy and cudaStreamPerThread: that device's).
  /// Throws invalid_argument_error, naming both devices, for the handle of a gpukit::stream (created, or wrapped with
  /// ownership) of another device: looked up in gpukit's table of its streams, with no CUDA call. The device of a
  /// handle gpukit does not own is not checked (that would cost driver calls on every view).
  stream_view(gpukit::device d, cudaStream_t handle);

  /// The default stream of a device: CUDA's default stream (handle 0: legacy, or per-thread in code built that way),
  /// or for the CPU a stream that runs each task synchronously on the calling thread.
  static stream_view default_stream(gpukit::device d) noexcept;

  /// The device the stream belongs to. For a view made from a raw handle this looks it up: a handle a gpukit::stream
  /// owns in memory, another with the driver (cuStreamGetCtx, cuCtxGetDevice: a capture of the stream permits them,
  /// where cudaStreamGetDevice would invalidate it), a default stream with cudaGetDevice.
  gpukit::device device() const;

  /// True for streams of the CPU device.
  bool is_cpu() const noexcept;
  /// True for a device's default stream: CUDA's legacy one (0, cudaStreamLegacy), its per-thread one
  /// (cudaStreamPerThread, or 0 in code built with per-thread default streams), or the CPU's synchronous one.
  bool is_default() const noexcept;
  /// True for CUDA's per-thread default stream, which is a different stream in each host thread.
  bool is_per_thread() const noexcept;

  /// The CUDA handle. Throws invalid_argument_error for a CPU stream.
  cudaStream_t cuda_handle() const;
  /// The CUDA handle, or nullptr for the CPU. Never throws; for comparisons and logging.
  cudaStream_t native_handle() const noexcept;
  /// The CPU queue, or nullptr (CUDA streams and the CPU's synchronous default stream).
  detail::cpu_queue* cpu_queue() const noexcept;

  /// A number no other stream has, even after this one is destroyed (its handle may be reused at once):
  /// cudaStreamGetId for CUDA streams, a number of gpukit's for CPU streams. Views of a gpukit::stream carry it, and
  /// default streams' ids are cached per thread, so those cost no CUDA call; a raw handle a gpukit::stream owns is
  /// looked up in memory, another costs a cudaStreamGetCaptureInfo and a cudaStreamGetId. CUDA refuses the id of a
  /// stream being captured (and invalidates the capture): such a raw handle gets one of gpukit's for the rest of the
  /// capture, and a per-thread default stream first named during its capture one for the thread.
  /// For cudaStreamPerThread, the calling thread's stream's id (or the id recorded by resolved()).
  unsigned long long id() const;

  /// This view with its device and id looked up now, so that later uses need no lookup and mean the same stream
  /// when made from another thread or with another device current (for cudaStreamPerThread: the calling thread's
  /// stream, whose work other threads can then only order after through the legacy default stream).
  stream_view resolved() const;

  /// True for another thread's per-thread default stream: a view of cudaStreamPerThread resolved() on another thread.
  /// The handle names the calling thread's own stream, so this one cannot be named from here: gpukit's calls on it
  /// (synchronize, ready, enqueue_host, event::record, event::wait, a copy_async enqueued on it) throw
  /// invalid_argument_error. A view that was not resolved is always the calling thread's own (false, at no cost);
  /// for a resolved one, the first call on a thread looks this thread's stream id up (cudaStreamGetId).
  bool is_other_threads_stream() const;

  /// The record of the gpukit::stream this view was made from, which outlives it: whether it was destroyed and
  /// whether its last work completed (nullptr for raw handles, borrowed wrapped handles and default streams). Call it
  /// while the stream exists, like every use of a view.
  std::shared_ptr<const detail::stream_life> lifetime() const;

  /// True when the view was made from a gpukit::stream that has been destroyed since. Only for views whose
  /// lifetime() someone holds (allocators do); otherwise a view must not outlive its stream at all.
  bool destroyed() const noexcept;

  /// Blocks until all work enqueued on the stream has completed. Throws invalid_argument_error, waiting for nothing,
  /// on a stream being captured: CUDA would refuse the wait and invalidate the capture (its work runs when the graph
  /// is launched). On the legacy default stream, which synchronizes with every blocking stream of its device, it
  /// throws as well while one of them is captured (by gpukit::capture, or with the raw runtime): the wait would join
  /// that capture. There it waits for an event recorded on the stream.
  void synchronize() const;

  /// True when all work enqueued on the stream has completed (cudaStreamQuery). A pending CUDA error of the
  /// program stays pending: cudaErrorNotReady is a status, not an error, and is cleared only if the runtime recorded
  /// it as the last error (detail::forget_not_ready). While a gpukit::capture runs, a stream being captured is refused
  /// (invalid_argument_error) rather than let the query invalidate its capture; so is the legacy default stream while
  /// a blocking stream is captured, as for synchronize().
  [[nodiscard]] bool ready() const;

  /// Enqueues a host function that runs once the work before it has completed, and delays the work after it
  /// (cudaLaunchHostFunc on CUDA). It must not call CUDA or synchronize this stream. An exception escaping it is
  /// reported through gpukit::warn. The callable is moved to the heap until it runs, and destroyed right after, on
  /// the thread that ran it (on a GPU, CUDA's host-function thread): what it owns must not call CUDA when destroyed
  /// either (a gpukit::event, buffer or stream captured by value would; keep those alive elsewhere, or use
  /// record_stream). An empty callable (a null function pointer, an empty std::function) throws
  /// invalid_argument_error at once, and so does a stream being captured: a graph calls its host functions at every
  /// launch, and the callable is freed after its first call (add a host node with cudaLaunchHostFunc and data that
  /// outlives the graph instead). On the legacy default stream it is refused (invalid_argument_error) while another
  /// thread's gpukit capture of a blocking stream of its device runs, as event::record is: it would join that capture
  /// and invalidate it. On the CPU default stream, which runs work at once, a host function enqueued from inside a
  /// running one runs after it returns.
  template <class F>
  void enqueue_host(F&& function) const {
    using callable = std::decay_t<F>;
    if constexpr (detail::may_be_empty<callable>::value) {
      if (!function) throw invalid_argument_error("gpukit::stream_view::enqueue_host: the function is empty");
    }
    if (is_cpu()) return detail::cpu_backend::enqueue_host(cpu_, std::forward<F>(function));
    refuse_other_threads_stream("stream_view::enqueue_host");
    refuse_in_capture("stream_view::enqueue_host",
                      "a graph calls its host functions at every launch, and gpukit frees the callable after its "
                      "first call (enqueue it outside the capture, or add a host node with cudaLaunchHostFunc and data "
                      "that outlives the graph; nothing was enqueued)");
    auto owned = std::make_unique<callable>(std::forward<F>(function));
    const cudaHostFn_t trampoline = [](void* data) {
      std::unique_ptr<callable> f(static_cast<callable*>(data));
      detail::run_host_function(*f);
    };
    // On the legacy stream, work another thread's gpukit capture of a blocking stream would join (and CUDA then
    // invalidates): refused, under the hold that keeps such a capture from beginning before the launch.
    std::optional<detail::legacy_stream_hold> hold;
    if (is_default() && !is_per_thread()) {
      hold.emplace(device().ordinal());
      refuse_implicit_join("stream_view::enqueue_host", *hold);
    }
    detail::cuda_backend::launch_host_function(cuda_target(), trampoline, owned.get());
    (void)owned.release();  // now owned by the trampoline
  }

  /// Makes, in `guard`, the device current that a CUDA call on this (CUDA) stream needs. The default streams are the
  /// current device's: for a view of a known device, that device, always. Any context serves a call on another
  /// stream, but the call runs in the thread's current one, and on a thread with none the runtime would first create
  /// cuda:0's: only then is the stream's device made current. With a context current this costs one cuCtxGetCurrent
  /// (detail::thread_context_state) and no runtime call.
  void enter_context(std::optional<device_guard>& guard) const;

  /// The handle and, when known, the device's ordinal: what the CUDA backend's calls on this stream take.
  detail::cuda_stream_target cuda_target() const noexcept;

  /// Views are equal when they refer to the same stream: by id when both know it (a handle may have belonged to a
  /// destroyed stream), else by handle (0 and cudaStreamLegacy, or 0 and cudaStreamPerThread in per-thread code,
  /// are the same); default streams compare by device.
  friend bool operator==(const stream_view& a, const stream_view& b) noexcept {
    if (a.cpu_ != b.cpu_) return false;
    if (a.id_ != 0 && b.id_ != 0) return a.id_ == b.id_;
    if (canonical(a.cuda_) != canonical(b.cuda_)) return false;
    if (!a.is_default()) return true;
    return a.device_known_ == b.device_known_ && a.device_ == b.device_;
  }
  /// True when the views refer to different streams: the negation of operator==.
  friend bool operator!=(const stream_view& a, const stream_view& b) noexcept { return !(a == b); }

 private:
  friend class stream;
  stream_view(gpukit::device d, cudaStream_t handle, detail::cpu_queue* queue, detail::stream_life* life) noexcept;

  static bool is_special(cudaStream_t h) noexcept;
  // Throws invalid_argument_error naming `operation` for another thread's per-thread default stream.
  void refuse_other_threads_stream(const char* operation) const;
  // The handle for a cuda::stream_ref, which cannot name a default stream of another device or thread.
  cudaStream_t stream_ref_handle() const;
  // Throws invalid_argument_error naming `operation` and saying `why` on a stream being captured.
  void refuse_in_capture(const char* operation, const char* why) const;
  // For the legacy default stream, under `hold`, which keeps gpukit captures from beginning: throws
  // invalid_argument_error naming `operation` if a blocking stream is being captured, which a query of or a wait for
  // the legacy stream would join implicitly, and invalidate.
  void refuse_implicit_join(const char* operation, const detail::legacy_stream_hold& hold) const;
  // synchronize() for the legacy default stream: an event recorded under such a hold, then waited for.
  void synchronize_legacy() const;
  // What handle 0 means in this translation unit's default-stream mode.
  static cudaStream_t canonical(cudaStream_t h) noexcept;

  int known_ordinal() const noexcept;
  // The CUDA lookups of device() and id(), out of line so that the calls that need none stay inline.
  GPUKIT_DETAIL_NOINLINE gpukit::device lookup_device() const {
    return gpukit::device::cuda(detail::cuda_backend::stream_device(cuda_));
  }
  GPUKIT_DETAIL_NOINLINE unsigned long long lookup_id() const {
    if (is_special(cuda_)) return detail::default_stream_id(device().ordinal(), is_per_thread());
    return detail::cuda_backend::stream_id_of(cuda_, known_ordinal());
  }

  gpukit::device device_{};
  bool device_known_ = false;
  cudaStream_t cuda_ = nullptr;
  detail::cpu_queue* cpu_ = nullptr;
  unsigned long long id_ = 0;            // 0: not known (raw handles and default streams look it up)
  detail::stream_life* life_ = nullptr;  // the gpukit::stream's, which owns it
};

/// How to create a stream.
struct stream_options {
  /// Do not synchronize with CUDA's legacy default stream (cudaStreamNonBlocking). Ignored on the CPU.
  bool non_blocking = true;
  /// CUDA priority: lower numbers run first. Clamped to the device's range (stream_priority_range, typically
  /// [-5, 0]); pass a very negative value for "highest". Ignored on the CPU.
  int priority = 0;
};

namespace detail {
/// For work on the legacy default stream `legacy`, under a hold (`refused`: the hold's refused()): throws
/// invalid_argument_error naming `operation` if a blocking stream of its device is being captured, as
/// stream_view::synchronize does.
GPUKIT_INLINE void refuse_legacy_stream_join(const char* operation, const stream_view& legacy, bool refused);

/// Throws invalid_argument_error naming `operation` and saying `why` if `s` (a CUDA stream) is being captured.
GPUKIT_INLINE void refuse_captured_stream(const char* operation, const stream_view& s, const char* why);

/// The id of the capture `s` takes part in, or 0 (not captured, a CPU stream, the legacy default stream). Handle 0
/// is the per-thread default stream in that mode, which can be captured (as in capture_status).
GPUKIT_INLINE unsigned long long capture_id(const stream_view& s);
}  // namespace detail

/// An owning stream: creates a CUDA stream (or a CPU queue) and destroys it. Move-only; a moved-from stream throws
/// invalid_argument_error on use.
class stream {
 public:
  /// Creates a stream on `d` (a CUDA stream, or a CPU queue with its worker thread).
  explicit stream(gpukit::device d, stream_options options = {});

  /// Wraps an existing CUDA stream of device `d`. With `take_ownership`, the wrapper destroys it, and allocators
  /// that remember it learn of its destruction as for a stream created here. Throws invalid_argument_error, naming
  /// both devices, when the handle belongs to another device (as stream_view::device() finds it), and for an owned
  /// default stream (0, cudaStreamLegacy, cudaStreamPerThread: CUDA's, never destroyed), and, naming the handle and
  /// its device, for an owned handle another gpukit::stream owns (two owners would both destroy it, the second time
  /// perhaps another stream given the handle since); nothing is taken over then. Borrowing such a handle is fine.
  static stream wrap(cudaStream_t handle, gpukit::device d, bool take_ownership);

  /// Takes over `other`'s stream; `other` becomes moved-from.
  stream(stream&& other) noexcept;
  /// Destroys the stream held (as ~stream does), then takes over `other`'s; `other` becomes moved-from.
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  /// Destroys an owned stream (see the file comment for pending work). Never throws: a failure goes to gpukit::warn,
  /// except the results of a runtime torn down at process exit (detail::is_teardown_result), which are expected. An
  /// allocator's free that another thread is enqueueing on the stream is let finish first (async_allocator), so that
  /// it cannot land on a new stream given this one's handle.
  ~stream();

  /// A non-owning view. Throws invalid_argument_error if this stream was moved from.
  stream_view view() const;
  /// Same as view(); implicit so that a stream can be passed where a stream_view is expected.
  operator stream_view() const;  // NOLINT(google-explicit-constructor)
  /// To cuda::stream_ref (include <gpukit/stream/stream_ref.hpp>; see stream_view's conversion). Throws
  /// invalid_argument_error for a CPU stream.
  template <class StreamRef, std::enable_if_t<detail::is_cuda_stream_ref<StreamRef>::value, int> = 0>
  operator StreamRef() const {  // NOLINT(google-explicit-constructor)
    return StreamRef(view().stream_ref_handle());
  }

  /// The device the stream belongs to. Throws invalid_argument_error if this stream was moved from.
  gpukit::device device() const;
  /// The priority in effect after clamping (0 on the CPU).
  int priority() const noexcept;
  /// True when destroying this object destroys the stream: created here, or wrapped with `take_ownership`. False for
  /// a borrowed handle, after release() and once moved from.
  bool owns_handle() const noexcept;
  /// False once moved from.
  bool valid() const noexcept;
  /// The CUDA handle, still owned by this stream. Throws invalid_argument_error for a CPU stream or a moved-from one.
  cudaStream_t cuda_handle() const;

  /// Blocks until all work enqueued on the stream has completed (see stream_view::synchronize).
  void synchronize() const;
  /// True when all work enqueued on the stream has completed; never blocks (see stream_view::ready).
  [[nodiscard]] bool ready() const;
  /// Enqueues a host function to run after the work enqueued so far (see stream_view::enqueue_host for its rules).
  template <class F>
  void enqueue_host(F&& function) const {
    view().enqueue_host(std::forward<F>(function));
  }

  /// Gives up ownership of the CUDA handle and returns it; the stream becomes moved-from. Allocators that remember
  /// the stream then treat it like a raw handle: it must outlive the memory allocated on it. Views made from this
  /// stream before the call, and a current stream set from it (set_current_stream), stay valid while the CUDA
  /// stream lives: its record is kept by handle, and goes to a gpukit::stream of the same default-stream mode that
  /// wraps the handle with ownership again outside a capture (whose destruction they then see); a gpukit::stream that
  /// destroys the stream otherwise, or is created with its handle later, marks the record destroyed and drops it.
  /// Throws std::bad_alloc (nothing changed) if the record cannot be kept.
  [[nodiscard]] cudaStream_t release();

 private:
  stream(gpukit::device d, cudaStream_t handle, bool owns, int priority) noexcept;

  void check_valid(const char* what) const;

  void take(stream& other) noexcept;

  // Those that remember the stream (use_count > 1: allocators, pinned pools) learn that it is gone, and when its
  // last work completes, from life_; after a release() or for a borrowed handle the stream lives on elsewhere.
  void destroy() noexcept;

  gpukit::device device_{};
  cudaStream_t cuda_ = nullptr;
  std::shared_ptr<detail::cpu_queue> cpu_;     // also kept by life_ (see stream_life's constructor)
  std::shared_ptr<detail::stream_life> life_;  // null for borrowed (wrapped, not owned) handles
  int priority_ = 0;
  bool owns_ = false;
  bool valid_ = false;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::atomic<std::uint64_t>& stream_expirations() noexcept {
  static std::atomic<std::uint64_t> count{0};
  return count;
}

GPUKIT_INLINE unsigned long long next_cpu_stream_id() noexcept {
  static std::atomic<unsigned long long> next{1};
  return cpu_stream_id_bit | next.fetch_add(1, std::memory_order_relaxed);
}

GPUKIT_INLINE unsigned long long default_stream_id(int ordinal, bool per_thread) {
  // [2 * ordinal + per_thread]; 0: not looked up yet. A fixed array (devices beyond it are asked each time): trivially
  // destructible, so code that runs after this thread's thread_local objects are destroyed (at exit) can use it.
  thread_local std::array<unsigned long long, 64> cache{};
  const std::size_t slot = 2 * static_cast<std::size_t>(ordinal) + (per_thread ? 1 : 0);
  if (slot < cache.size() && cache[slot] != 0) return cache[slot];
  unsigned long long id = 0;
  if (per_thread) {
    id = cuda_backend::default_stream_id_now(ordinal, true);
  } else {
    // The legacy stream's id question would join a blocking capture: no gpukit capture of a blocking stream of the
    // device begins between default_stream_id_now's check and its question, and while one is underway it is not
    // asked (the id is gpukit's, kept for the process).
    const legacy_stream_hold hold(ordinal);
    id = cuda_backend::default_stream_id_now(ordinal, false, hold.refused());
  }
  if (slot < cache.size()) cache[slot] = id;
  return id;
}

GPUKIT_INLINE std::array<char, 32> this_mode_tag() noexcept {
  std::array<char, 32> tag{};  // the rest stays '\0'
  std::memcpy(tag.data(), abi_namespace_name, std::min(std::strlen(abi_namespace_name), tag.size() - 1));
  return tag;
}

GPUKIT_INLINE bool is_this_mode(const std::array<char, 32>& tag) noexcept {
  return std::strncmp(tag.data(), abi_namespace_name, tag.size()) == 0;
}

GPUKIT_INLINE bool made_by_this_mode(const mode_independent::released_stream& record) noexcept {
  return is_this_mode(record.mode);
}

/// Whether ids `a` and `b` are known to be of different streams: CUDA's ids are unique for the process, but one of
/// gpukit's (own_stream_id_bit, given while the stream was captured) may stand for any stream.
constexpr bool other_stream(unsigned long long a, unsigned long long b) noexcept {
  return a != b && ((a | b) & cuda_backend::own_stream_id_bit) == 0;
}

/// Erases `at`, the record of a stream that is gone, marking it destroyed first.
GPUKIT_INLINE auto drop_released_record(mode_independent::released_stream_table& released,
                                        decltype(released.records)::iterator at) noexcept {
  if (at->second.expire != nullptr) at->second.expire(at->second.life.get());
  return released.records.erase(at);
}

GPUKIT_INLINE void expire_released_record(void* life) noexcept {
  static_cast<stream_life*>(life)->expire(nullptr, true);
}

GPUKIT_INLINE void keep_released_stream(cudaStream_t handle, const std::shared_ptr<stream_life>& life) {
  mode_independent::released_stream record{life, this_mode_tag(), life->id(), expire_released_record};
  mode_independent::released_stream_table& released = mode_independent::released_stream_table_v1();
  const std::lock_guard<std::mutex> lock(released.mutex);
  const auto kept = released.records.emplace(handle, std::move(record));  // may throw: nothing changed
  // Only the records of streams known to be others (gone: this one has the handle) are dropped; a record of this
  // stream may still be pointed at by views. Dropped under the lock: expiring a record makes no CUDA call.
  const auto range = released.records.equal_range(handle);
  for (auto it = range.first; it != range.second;) {
    it = other_stream(it->second.id, kept->second.id) ? drop_released_record(released, it) : std::next(it);
  }
  released.count.store(released.records.size(), std::memory_order_relaxed);
}

GPUKIT_INLINE std::shared_ptr<stream_life> reclaim_released_stream(cudaStream_t handle,
                                                                   unsigned long long id) noexcept {
  mode_independent::released_stream_table& released = mode_independent::released_stream_table_v1();
  if (released.count.load(std::memory_order_relaxed) == 0) return nullptr;
  std::shared_ptr<void> taken;
  try {
    const std::lock_guard<std::mutex> lock(released.mutex);
    const auto range = released.records.equal_range(handle);
    for (auto it = range.first; it != range.second;) {
      if (other_stream(it->second.id, id)) {
        it = drop_released_record(released, it);  // a stream that had the handle before: gone
      } else if (it->second.id == id && made_by_this_mode(it->second) && taken == nullptr) {
        taken = std::move(it->second.life);
        it = released.records.erase(it);
      } else {
        ++it;  // another mode's record of this stream (its views'), or one that cannot be compared
      }
    }
    released.count.store(released.records.size(), std::memory_order_relaxed);
  } catch (...) {  // the lock failed: the records stay
    return nullptr;
  }
  return std::static_pointer_cast<stream_life>(taken);
}

GPUKIT_INLINE void drop_released_streams(cudaStream_t handle) noexcept {
  mode_independent::released_stream_table& released = mode_independent::released_stream_table_v1();
  if (released.count.load(std::memory_order_relaxed) == 0) return;
  try {
    const std::lock_guard<std::mutex> lock(released.mutex);
    for (auto [it, end] = released.records.equal_range(handle); it != end;) it = drop_released_record(released, it);
    released.count.store(released.records.size(), std::memory_order_relaxed);
  } catch (...) {  // the lock failed: the records stay until the handle's next stream
  }
}

GPUKIT_INLINE void enter_owned_stream(cudaStream_t handle, const std::shared_ptr<stream_life>& life) noexcept {
  mode_independent::owned_stream_record record{life, this_mode_tag(), stream_life_expired, stream_life_shared_by_pool};
  mode_independent::owned_stream_records& owned = mode_independent::owned_stream_records_v1();
  try {
    const std::unique_lock<std::shared_mutex> lock(owned.mutex);
    owned.by_handle[handle] = std::move(record);
    owned.count.store(owned.by_handle.size(), std::memory_order_relaxed);
  } catch (...) {  // out of memory, or the lock failed: a view made from the handle is not recognised
  }
}

GPUKIT_INLINE void remove_owned_stream(cudaStream_t handle) noexcept {
  mode_independent::owned_stream_records& owned = mode_independent::owned_stream_records_v1();
  if (owned.count.load(std::memory_order_relaxed) == 0) return;
  try {
    const std::unique_lock<std::shared_mutex> lock(owned.mutex);
    owned.by_handle.erase(handle);
    owned.count.store(owned.by_handle.size(), std::memory_order_relaxed);
  } catch (...) {  // the lock failed: the record stays, expired once its stream is destroyed
  }
}

GPUKIT_INLINE stream_owner find_stream_owner(cudaStream_t handle) noexcept {
  mode_independent::owned_stream_records& owned = mode_independent::owned_stream_records_v1();
  if (owned.count.load(std::memory_order_relaxed) == 0) return {};
  try {
    const std::shared_lock<std::shared_mutex> lock(owned.mutex);
    const auto found = owned.by_handle.find(handle);
    if (found == owned.by_handle.end()) return {};
    const mode_independent::owned_stream_record& record = found->second;
    std::shared_ptr<const void> life = record.life.lock();
    if (life == nullptr || record.expired == nullptr || record.shared_by_pool == nullptr) return {};
    return {std::move(life), record.expired, record.shared_by_pool, is_this_mode(record.mode)};
  } catch (...) {  // the lock failed: not known
    return {};
  }
}

GPUKIT_INLINE bool stream_life_expired(const void* life) noexcept {
  return static_cast<const stream_life*>(life)->expired();
}

GPUKIT_INLINE bool stream_life_shared_by_pool(const void* life) noexcept {
  return static_cast<const stream_life*>(life)->shared_by_pool();
}

GPUKIT_INLINE stream_life::stream_life(unsigned long long id, int ordinal, std::shared_ptr<const void> held) noexcept
    : id_(id), ordinal_(ordinal), held_(std::move(held)) {}

GPUKIT_INLINE stream_life::~stream_life() {
  if (final_ != nullptr) {
    cuda_backend::destroy_event(final_, ordinal_, "cudaEventDestroy (a destroyed stream's final event)");
  }
}

GPUKIT_INLINE unsigned long long stream_life::id() const noexcept { return id_; }

GPUKIT_INLINE int stream_life::ordinal() const noexcept { return ordinal_; }

GPUKIT_INLINE bool stream_life::expired() const noexcept { return expired_.load(std::memory_order_acquire); }

GPUKIT_INLINE bool stream_life::finished() const noexcept {
  if (!expired()) return false;
  if (ordinal_ < 0) return true;
  if (final_ == nullptr) return synchronized_.load(std::memory_order_acquire);
  return cuda_backend::query_event(final_) == cudaSuccess;
}

GPUKIT_INLINE cudaEvent_t stream_life::final_event() const noexcept { return expired() ? final_ : nullptr; }

GPUKIT_INLINE void stream_life::wait_finished() const {
  if (!expired() || ordinal_ < 0) return;
  if (final_ != nullptr) {
    cuda_backend::synchronize_event(final_, ordinal_, "cudaEventSynchronize (a destroyed stream's final event)");
    return;
  }
  cuda_backend::synchronize_device(ordinal_, "cudaDeviceSynchronize (a destroyed stream's work)");
  synchronized_.store(true, std::memory_order_release);
}

GPUKIT_INLINE std::unique_lock<std::mutex> stream_life::keep_alive() const {
  return std::unique_lock<std::mutex>(in_use_);
}

GPUKIT_INLINE void stream_life::expire(cudaStream_t handle, bool remembered) noexcept {
  // Not while a caller enqueues work on the handle (keep_alive): the final event follows that work, and a caller
  // that locks later sees expired(). Warnings come after the lock: a warning handler may free memory on this stream.
  std::unique_lock<std::mutex> no_work_underway(in_use_, std::defer_lock);
  try {
    no_work_underway.lock();
  } catch (...) {  // never seen: destroyed at once
  }
  // A stream destroyed while captured would record its final event in the capture: an event no query can ever see
  // complete (cudaErrorCapturedEvent). Without it, its memory waits for a device synchronize (wait_finished).
  bool captured = false;
  if (handle != nullptr && remembered) {
    try {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      captured = cuda_backend::stream_capture_status({handle, ordinal_}, status) == cudaSuccess &&
                 status != cudaStreamCaptureStatusNone;
    } catch (...) {  // its device could not be made current: the record below reports that
    }
  }
  cudaError_t result = cudaSuccess;
  std::exception_ptr failure;
  if (handle != nullptr && remembered && !captured) {
    try {
      // Without it, memory the stream used is reused only after the device was synchronized (wait_finished) or
      // released to it (cudaFree synchronizes).
      final_ = cuda_backend::record_new_event(handle, ordinal_, result);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // The count first: an allocator that sees expired() may have read the count before it changed, and then learns
  // of the destruction only through expired() on its free path (it marks the stream dead there).
  if (remembered) stream_expirations().fetch_add(1, std::memory_order_relaxed);  // else no one has to look
  expired_.store(true, std::memory_order_release);
  if (no_work_underway.owns_lock()) no_work_underway.unlock();
  report_cuda_failure(result, "recording a destroyed stream's final event (in ~stream)", ordinal_);
  if (!failure) return;
  try {
    std::rethrow_exception(failure);
  } catch (const error& ex) {
    if (!is_teardown_result(ex.cuda_result())) {
      warn_parts("gpukit: recording the final event of a destroyed stream failed: ", ex.what());
    }
  } catch (const std::exception& ex) {
    warn_parts("gpukit: recording the final event of a destroyed stream failed: ", ex.what());
  } catch (...) {
  }
}
}  // namespace detail

GPUKIT_INLINE stream_view::stream_view(gpukit::device d, cudaStream_t handle)
    : device_(d), device_known_(true), cuda_(handle) {
  if (d.is_cpu() && handle != nullptr) {
    throw invalid_argument_error("gpukit::stream_view: a CUDA stream handle cannot belong to the CPU device");
  }
  // A wrong device would surface later as a bare failure far from here (cudaEventRecord refuses an event of the
  // given device on the stream), or go unseen where a call takes any context. Checked here because it is cheap.
  if (d.is_cpu() || is_special(handle)) return;
  const std::optional<detail::cuda_backend::created_stream> known = detail::cuda_backend::find_created_stream(handle);
  if (known && known->ordinal != d.ordinal()) {
    throw invalid_argument_error("gpukit::stream_view: " + detail::cuda_backend::describe_stream_handle(handle, -1) +
                                     " belongs to cuda:" + std::to_string(known->ordinal) +
                                     " (a gpukit::stream of that device owns it), not to " + d.to_string() +
                                     " as given: name it with its own device, or view it through its gpukit::stream",
                                 cudaSuccess, {}, d.ordinal());
  }
}

GPUKIT_INLINE stream_view stream_view::default_stream(gpukit::device d) noexcept {
  stream_view view;
  view.device_ = d;
  view.device_known_ = true;
  return view;
}

GPUKIT_INLINE gpukit::device stream_view::device() const {
  if (device_known_) return device_;
  return lookup_device();
}

GPUKIT_INLINE bool stream_view::is_cpu() const noexcept { return device_known_ && device_.is_cpu(); }

GPUKIT_INLINE bool stream_view::is_default() const noexcept { return cpu_ == nullptr && is_special(cuda_); }

GPUKIT_INLINE bool stream_view::is_per_thread() const noexcept {
  return !is_cpu() && cpu_ == nullptr && canonical(cuda_) == cudaStreamPerThread;
}

GPUKIT_INLINE cudaStream_t stream_view::cuda_handle() const {
  if (is_cpu()) throw invalid_argument_error("gpukit::stream_view::cuda_handle: this is a stream of the CPU");
  return cuda_;
}

GPUKIT_INLINE cudaStream_t stream_view::stream_ref_handle() const {
  const cudaStream_t handle = cuda_handle();
  if (!is_default()) return handle;
  refuse_other_threads_stream("stream_view (to cuda::stream_ref)");
  if (device_known_) {
    const gpukit::device current = current_device();
    if (current != device_) {
      throw invalid_argument_error("gpukit::stream_view (to cuda::stream_ref): the default stream of " +
                                   device_.to_string() + " while " + current.to_string() +
                                   " is current: a cuda::stream_ref of a default stream names the current device's "
                                   "(make " +
                                   device_.to_string() + " current first, with a device_guard)");
    }
  }
  return handle;
}

GPUKIT_INLINE cudaStream_t stream_view::native_handle() const noexcept { return cuda_; }

GPUKIT_INLINE detail::cpu_queue* stream_view::cpu_queue() const noexcept { return cpu_; }

GPUKIT_INLINE unsigned long long stream_view::id() const {
  if (id_ != 0) return id_;
  if (is_cpu()) return detail::cpu_stream_id_bit;  // the CPU's default stream (CPU queues always carry an id)
  return lookup_id();
}

GPUKIT_INLINE stream_view stream_view::resolved() const {
  stream_view view = *this;
  if (!view.device_known_) {
    view.device_ = device();
    view.device_known_ = true;
  }
  view.id_ = view.id();
  return view;
}

GPUKIT_INLINE std::shared_ptr<const detail::stream_life> stream_view::lifetime() const {
  return life_ != nullptr ? life_->shared_from_this() : nullptr;
}

GPUKIT_INLINE bool stream_view::destroyed() const noexcept { return life_ != nullptr && life_->expired(); }

GPUKIT_INLINE bool stream_view::is_other_threads_stream() const {
  if (!is_per_thread() || id_ == 0) return false;  // not resolved: the calling thread's own
  return id_ != detail::default_stream_id(device().ordinal(), true);
}

namespace detail {
GPUKIT_INLINE void throw_other_threads_stream(const char* operation) {
  throw invalid_argument_error(std::string("gpukit::") + operation +
                               ": the per-thread default stream of another thread (a view resolved there) cannot be "
                               "named from this one: cudaStreamPerThread is the calling thread's own (call it from "
                               "that thread; nothing was done)");
}
}  // namespace detail

GPUKIT_INLINE void stream_view::refuse_other_threads_stream(const char* operation) const {
  if (is_other_threads_stream()) detail::throw_other_threads_stream(operation);
}

GPUKIT_INLINE void stream_view::refuse_in_capture(const char* operation, const char* why) const {
  detail::refuse_captured_stream(operation, *this, why);
}

GPUKIT_INLINE void stream_view::refuse_implicit_join(const char* operation,
                                                     const detail::legacy_stream_hold& hold) const {
  detail::refuse_legacy_stream_join(operation, *this, hold.refused());
}

namespace detail {
GPUKIT_INLINE void refuse_legacy_stream_join(const char* operation, const stream_view& legacy, bool refused) {
  const auto refuse = [&](const std::string& what) {
    throw invalid_argument_error(std::string("gpukit::") + operation + ": " + what +
                                 ": the legacy default stream synchronizes with every blocking stream, so CUDA would "
                                 "join the capture implicitly and invalidate it (cudaErrorStreamCaptureImplicit; "
                                 "nothing was done). Wait for the capture to end, or use a non-blocking stream");
  };
  if (refused) refuse("a gpukit capture of a blocking stream of " + legacy.device().to_string() + " is underway");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  // The header documents this answer, which leaves the capture intact; a capture begun with the raw runtime counts.
  if (cuda_backend::stream_capture_status(legacy.cuda_target(), status) == cudaErrorStreamCaptureImplicit) {
    refuse("a blocking stream of " + legacy.device().to_string() + " is being captured");
  }
}

GPUKIT_INLINE void refuse_captured_stream(const char* operation, const stream_view& s, const char* why) {
  if (s.is_default() && !s.is_per_thread()) return;  // CUDA never captures the legacy default stream
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cuda_backend::stream_capture_status(s.cuda_target(), status) != cudaSuccess) return;  // the call says
  if (status == cudaStreamCaptureStatusNone) return;
  throw invalid_argument_error(
      std::string("gpukit::") + operation + ": the stream is being captured on " + s.device().to_string() +
      (status == cudaStreamCaptureStatusInvalidated ? " (the capture is invalidated already)" : "") + ": " + why);
}

GPUKIT_INLINE unsigned long long capture_id(const stream_view& s) {
  if (s.is_cpu()) return 0;
  const cudaStream_t handle = s.native_handle();
  if (handle == cudaStreamLegacy || (handle == nullptr && !per_thread_default_stream_mode())) return 0;
  // cudaStreamPerThread names the caller's own stream: another thread's (a view resolved there) cannot be asked.
  if ((handle == nullptr || handle == cudaStreamPerThread) && s.id() != default_stream_id(s.device().ordinal(), true)) {
    return 0;
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  device_guard guard(s.device());
  GPUKIT_CUDA_TRY_DESCRIBED(
      cudaStreamGetCaptureInfo(s.native_handle(), &status, &id, nullptr, nullptr, nullptr, nullptr),
      "cudaStreamGetCaptureInfo", s.device().ordinal());
  return status == cudaStreamCaptureStatusActive ? id : 0;
}
}  // namespace detail

GPUKIT_INLINE void stream_view::synchronize_legacy() const {
  const int ordinal = device().ordinal();
  struct marker_event {
    cudaEvent_t handle;
    int ordinal;
    ~marker_event() { detail::cuda_backend::destroy_event(handle, ordinal, "stream_view::synchronize"); }
  };
  const marker_event marker{detail::cuda_backend::create_event(ordinal, cudaEventDisableTiming), ordinal};
  {
    // The record is work on the legacy stream: made under the hold, so no gpukit capture begins before it. The wait
    // is not: a capture may begin during it, and an event's wait joins no capture.
    const detail::legacy_stream_hold hold(ordinal);
    refuse_implicit_join("stream_view::synchronize", hold);
    detail::cuda_backend::record_event(marker.handle, ordinal, cuda_);
  }
  detail::cuda_backend::synchronize_event(marker.handle, ordinal, "cudaEventSynchronize (the legacy default stream)");
}

GPUKIT_INLINE void stream_view::synchronize() const {
  if (is_cpu()) return detail::cpu_backend::synchronize(cpu_);
  refuse_other_threads_stream("stream_view::synchronize");
  if (is_default() && !is_per_thread()) return synchronize_legacy();
  refuse_in_capture("stream_view::synchronize",
                    "CUDA refuses a wait for captured work and invalidates the capture (that work runs when the graph "
                    "is launched: synchronize after the launch; nothing was waited for)");
  detail::cuda_backend::synchronize(cuda_target());
}

GPUKIT_INLINE bool stream_view::ready() const {
  if (is_cpu()) return detail::cpu_backend::ready(cpu_);
  refuse_other_threads_stream("stream_view::ready");
  if (is_default() && !is_per_thread()) {
    const detail::legacy_stream_hold hold(device().ordinal());  // until the query is made
    refuse_implicit_join("stream_view::ready", hold);
    return detail::cuda_backend::ready(cuda_target());
  }
  if (detail::gpukit_capture_underway()) {  // else one atomic load: ready() is polled
    refuse_in_capture("stream_view::ready",
                      "CUDA refuses a query of captured work and invalidates the capture (that work runs when the "
                      "graph is launched; nothing was asked)");
  }
  return detail::cuda_backend::ready(cuda_target());
}

GPUKIT_INLINE void stream_view::enter_context(std::optional<device_guard>& guard) const {
  detail::cuda_backend::enter_stream_context(cuda_target(), guard);
}

GPUKIT_INLINE detail::cuda_stream_target stream_view::cuda_target() const noexcept { return {cuda_, known_ordinal()}; }

GPUKIT_INLINE stream_view::stream_view(gpukit::device d, cudaStream_t handle, detail::cpu_queue* queue,
                                       detail::stream_life* life) noexcept
    : device_(d), device_known_(true), cuda_(handle), cpu_(queue), id_(life != nullptr ? life->id() : 0), life_(life) {}

GPUKIT_INLINE bool stream_view::is_special(cudaStream_t h) noexcept { return detail::is_default_stream_handle(h); }

GPUKIT_INLINE cudaStream_t stream_view::canonical(cudaStream_t h) noexcept {
  if (h != nullptr) return h;
  return detail::per_thread_default_stream_mode() ? cudaStreamPerThread : cudaStreamLegacy;
}

GPUKIT_INLINE int stream_view::known_ordinal() const noexcept { return device_known_ ? device_.ordinal() : -1; }

GPUKIT_INLINE stream::stream(gpukit::device d, stream_options options) : device_(d), owns_(true), valid_(true) {
  if (d.is_cpu()) {
    cpu_ = std::make_shared<detail::cpu_queue>();
    life_ = std::make_shared<detail::stream_life>(detail::next_cpu_stream_id(), -1, cpu_);
    return;
  }
  priority_ = stream_priority_range(d).clamp(options.priority);  // asked once per device
  cuda_ = detail::cuda_backend::create_stream(d.ordinal(), options.non_blocking, priority_);
  // The id (unique for the life of the program, unlike the handle) is looked up once, so views carry it.
  try {
    const unsigned long long id = detail::cuda_backend::stream_id(cuda_, d.ordinal());
    life_ = std::make_shared<detail::stream_life>(id, d.ordinal());
    detail::cuda_backend::remember_created_stream(cuda_, {d.ordinal(), id, !options.non_blocking});
    detail::drop_released_streams(cuda_);  // a released stream had this handle: it was destroyed
    detail::enter_owned_stream(cuda_, life_);
  } catch (...) {
    detail::cuda_backend::destroy_stream(std::exchange(cuda_, nullptr), d.ordinal(),
                                         "cudaStreamDestroy (a stream whose id could not be read)");
    throw;
  }
}

namespace detail {
/// stream::wrap's refusal to own stream `handle` of device `ordinal`, which a gpukit::stream owns already.
[[noreturn]] GPUKIT_INLINE void throw_owned_already(cudaStream_t handle, int ordinal) {
  throw invalid_argument_error("gpukit::stream::wrap: " + cuda_backend::describe_stream_handle(handle, ordinal) +
                                   " is owned by a gpukit::stream already (created or wrapped with ownership): a "
                                   "second owner would destroy it again, perhaps after CUDA gave the handle to a new "
                                   "stream; wrap it without ownership, or release() it from its owner first",
                               cudaSuccess, {}, ordinal);
}
}  // namespace detail

GPUKIT_INLINE stream stream::wrap(cudaStream_t handle, gpukit::device d, bool take_ownership) {
  if (!d.is_cuda()) throw invalid_argument_error("gpukit::stream::wrap: a CUDA handle needs a CUDA device");
  // The special handles (legacy, per-thread) mean "of the current device": they have no device of their own.
  const bool special = stream_view::is_special(handle);
  if (special && take_ownership) {
    throw invalid_argument_error(
        "gpukit::stream::wrap: a default stream (0, cudaStreamLegacy or "
        "cudaStreamPerThread) cannot be owned");
  }
  int priority = 0;
  std::shared_ptr<detail::stream_life> life;
  if (!special) {
    const int ordinal = detail::cuda_backend::stream_device(handle, d.ordinal());
    if (ordinal != d.ordinal()) {
      throw invalid_argument_error("gpukit::stream::wrap: the stream belongs to cuda:" + std::to_string(ordinal) +
                                   " (its device), not to " + d.to_string() + " as given");
    }
    // Owned by another gpukit::stream: refused before more is asked (checked again when recorded below).
    if (take_ownership && detail::cuda_backend::find_created_stream(handle)) {
      detail::throw_owned_already(handle, ordinal);
    }
    priority = detail::cuda_backend::stream_priority(handle, d.ordinal());
    if (take_ownership) {  // its destruction is ours to announce (a borrowed handle lives on elsewhere)
      life =
          std::make_shared<detail::stream_life>(detail::cuda_backend::stream_id_of(handle, d.ordinal()), d.ordinal());
    }
  }
  // Owned from here on: known by its handle until destroyed (a borrowed one may be destroyed behind our back).
  if (take_ownership &&
      !detail::cuda_backend::remember_adopted_stream(
          handle, {d.ordinal(), life->id(), detail::cuda_backend::may_block_on_legacy_stream(handle)})) {
    detail::throw_owned_already(handle, d.ordinal());  // another thread wrapped it meanwhile
  }
  if (take_ownership) {
    // Released by a gpukit::stream earlier: its record comes back, so the views made before the release see this
    // owner's destruction.
    if (std::shared_ptr<detail::stream_life> released = detail::reclaim_released_stream(handle, life->id())) {
      life = std::move(released);
    }
  }
  if (take_ownership) detail::enter_owned_stream(handle, life);
  stream wrapped(d, handle, take_ownership, priority);
  wrapped.life_ = std::move(life);
  return wrapped;
}

GPUKIT_INLINE stream::stream(stream&& other) noexcept { take(other); }

GPUKIT_INLINE stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    destroy();
    take(other);
  }
  return *this;
}

GPUKIT_INLINE stream::~stream() { destroy(); }

GPUKIT_INLINE stream_view stream::view() const {
  check_valid("view");
  return stream_view(device_, cuda_, cpu_.get(), life_.get());
}

GPUKIT_INLINE stream::operator stream_view() const { return view(); }

GPUKIT_INLINE gpukit::device stream::device() const {
  check_valid("device");
  return device_;
}

GPUKIT_INLINE int stream::priority() const noexcept { return priority_; }

GPUKIT_INLINE bool stream::owns_handle() const noexcept { return owns_; }

GPUKIT_INLINE bool stream::valid() const noexcept { return valid_; }

GPUKIT_INLINE cudaStream_t stream::cuda_handle() const { return view().cuda_handle(); }

GPUKIT_INLINE void stream::synchronize() const { view().synchronize(); }

GPUKIT_INLINE bool stream::ready() const { return view().ready(); }

GPUKIT_INLINE cudaStream_t stream::release() {
  check_valid("release");
  if (cpu_) throw invalid_argument_error("gpukit::stream::release: a CPU stream has no handle to release");
  cudaStream_t handle = cuda_;
  // The record outlives this object: views made before the call point at it (first: it may throw, nothing changed).
  if (owns_ && life_) detail::keep_released_stream(handle, life_);
  if (owns_) detail::remove_owned_stream(handle);
  if (owns_) detail::cuda_backend::forget_created_stream(handle);  // the caller may destroy it, and CUDA reuse it
  life_.reset();
  cuda_ = nullptr;
  owns_ = false;
  valid_ = false;
  return handle;
}

GPUKIT_INLINE stream::stream(gpukit::device d, cudaStream_t handle, bool owns, int priority) noexcept
    : device_(d), cuda_(handle), priority_(priority), owns_(owns), valid_(true) {}

GPUKIT_INLINE void stream::check_valid(const char* what) const {
  if (!valid_) {
    throw invalid_argument_error(std::string("gpukit::stream::") + what + ": use of a moved-from stream");
  }
}

GPUKIT_INLINE void stream::take(stream& other) noexcept {
  device_ = other.device_;
  cuda_ = std::exchange(other.cuda_, nullptr);
  cpu_ = std::move(other.cpu_);
  life_ = std::move(other.life_);
  priority_ = other.priority_;
  owns_ = std::exchange(other.owns_, false);
  valid_ = std::exchange(other.valid_, false);
}

GPUKIT_INLINE void stream::destroy() noexcept {
  if (owns_ && cuda_ != nullptr) {
    if (life_) life_->expire(cuda_, life_.use_count() > 1);
    detail::remove_owned_stream(cuda_);
    detail::cuda_backend::forget_created_stream(cuda_);  // first: the handle may be a new stream's at once
    detail::drop_released_streams(cuda_);                // another mode's record of it (released there, owned here)
    detail::cuda_backend::destroy_stream(cuda_, device_.ordinal(), "cudaStreamDestroy (in ~stream)");
  }
  cuda_ = nullptr;
  if (cpu_) {
    cpu_->stop();  // runs the queue's pending work, then ends its worker (detached if this is one of its tasks)
    if (life_) life_->expire(nullptr, life_.use_count() > 1);
    cpu_.reset();  // the queue itself lives on with life_ while someone remembers the stream
  }
  life_.reset();
  owns_ = false;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
