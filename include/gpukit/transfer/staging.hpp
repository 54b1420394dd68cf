// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The staging engine: copies between pageable host memory and a device through small rings of pinned slots, so
/// pageable transfers run at close to the pinned rate instead of the 18–31% the driver's own staging reaches.
///
/// Host to device (to_device): the calling thread copies a chunk of the source into a free slot of the stream's
/// upload ring (with several threads for large chunks), enqueues the DMA from the slot on the stream, records the
/// slot's event, and goes on with the next slot; a slot is refilled once its event has completed. **When to_device
/// returns, the source may be reused or freed.** The destination is written in stream order.
///
/// Device to host (to_host), like CUDA's own cudaMemcpyAsync into pageable memory: **it returns once the destination
/// holds the data**, so it waits for the stream's earlier work. The DMAs of the chunks into the slots of the stream's
/// download ring are enqueued on the stream, and the calling thread waits for each one's event and copies the slot
/// out itself while the DMAs of the next chunks run. No host function is involved: CUDA may run the host functions of
/// all streams of a device one at a time, so a copy that needed one could wait behind any other stream's.
///
/// **Never a deadlock.** When to_device finds the stream's next slot still busy, it waits for that slot at most
/// `patience` (20 ms by default). Each slot wait gets the whole patience (it is not a deadline for the call), so a
/// long transfer whose DMAs merely run slower than the host copies stays on the slots however long it takes. If no
/// slot has come free for `patience` — the stream may be held by work that only a later host action releases (a host
/// function waiting on a gate, an event not yet recorded) — the rest of the transfer is copied into ordinary heap
/// memory and the call returns. A gpukit thread (one per such stream, while it has such work) then stages the rest
/// through the same ring, on a side stream that starts after the stream's earlier work (an event), as the slots come
/// free; one host function on the stream holds the stream's later work until those copies have completed. Later
/// to_device calls on the stream queue behind it while it has work, so the data lands in call order. The thread waits
/// only for the stream's own earlier work and for its copies; the host function exists only for transfers that
/// outlasted their patience and, like any host function, may start only after host functions of other streams. The
/// thread never calls into the pinned pool: cudaFreeHost (which the pool calls to release cached blocks) waits for the
/// device's work, the host function included, which waits for the thread. The calling thread gives the slots their
/// size before it hands over; the thread itself makes only calls that wait for nothing (cudaMemcpyAsync from pinned
/// memory and cudaStreamWaitEvent on its side stream, cudaEventRecord, cudaEventQuery; see stage_in_background).
///
/// **Pinned memory.** Staging holds at most `(slots + download_slots) × chunk_bytes` (each slot rounded up to the
/// pool's size class) per stream that stages — its two rings, 48 MiB by default — whatever the size of the transfers
/// and however far behind the stream is (max_pinned_bytes_per_stream()). The rest of a transfer that could not wait
/// is held in pageable heap memory, as many bytes as that rest, until it has been staged.
///
/// Rings are per stream, told apart by cudaStreamGetId (never by the handle, which CUDA may give to the next stream
/// created once a stream is destroyed) or by the CPU stream's queue: a stream's copies recycle only their own slots,
/// so a stream held back never delays another. When a ring is created while `max_rings` exist, idle ones (those of
/// destroyed streams among them) are released, least recently used first. Slots come from a pinned_pool (chunk-sized
/// blocks, cached after warm-up) and grow on demand to the chunk size, always on a calling thread.
///
/// The engine knows nothing of CUDA beyond gpukit's streams and events: the "device copy" step is a template
/// parameter (device_copier: cudaMemcpyAsync, or a memcpy enqueued on a CPU stream), so tests on CPU streams
/// exercise slot recycling, ordering and the no-deadlock rule for real, under threads.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/detail/cpu_backend.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/parallel_copy.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Throws invalid_argument_error naming `operation` when `s` (of device `sd`) is being captured into a CUDA graph
/// (stream_ops.hpp), with `advice`: what to do instead.
inline void refuse_capture(stream_view s, gpukit::device sd, std::string_view operation, std::string_view advice) {
  if (capture_status(s) == cudaStreamCaptureStatusNone) return;
  throw_captured(operation, describe_stream(s.native_handle(), sd), sd, advice);
}

/// The std::bad_alloc of a staging transfer that ran out of host memory: still a std::bad_alloc (what callers and the
/// fault-injection tests catch), its what() naming the call, the chunk, the transfer and what of it may still land, as
/// throw_chunk_failure's messages do. The text lives in the exception itself: the heap has just run out. Kept small
/// (the reason met cut to 64 characters): thrown from the C++ runtime's emergency reserve, which is 512 bytes in
/// libc++abi, exception header included.
class staging_bad_alloc : public std::bad_alloc {
 public:
  /// What failed: a chunk, the rest of the transfer from an offset (handed to the background thread), or setting up
  /// the stream's staging slots (before anything was enqueued).
  enum class part { chunk, rest, setup };
  /// `reason`: the what() of the std::bad_alloc met; the rest as throw_chunk_failure's arguments.
  staging_bad_alloc(const char* reason, std::string_view operation, gpukit::device d, std::size_t offset,
                    std::size_t length, std::size_t total, std::size_t done, part failed = part::chunk) noexcept {
    const bool upload = operation != "to_host";
    char chunk[48];
    char whole[48];
    (void)format_bytes_exact_into(chunk, length);
    (void)format_bytes_exact_into(whole, total);
    char where[16];
    if (d.is_cuda()) {
      std::snprintf(where, sizeof where, "cuda:%d", static_cast<int>(d.ordinal()));
    } else {
      std::snprintf(where, sizeof where, "cpu");
    }
    char what[96];
    if (failed == part::setup) {
      std::snprintf(what, sizeof what, "setting up the stream's staging slots for");
    } else {
      std::snprintf(what, sizeof what, "%s %s at byte offset %zu of",
                    failed == part::rest ? "the rest," : "the chunk of", chunk, offset);
    }
    const int head =
        std::snprintf(message_, sizeof message_,
                      "gpukit::staging_engine::%.*s: %s a %s transfer %s %s failed: out of host memory (%.64s); ",
                      static_cast<int>(operation.size()), operation.data(), what, whole, upload ? "to" : "from", where,
                      reason != nullptr ? reason : "std::bad_alloc");
    if (head < 0 || static_cast<std::size_t>(head) >= sizeof message_) return;  // cut short: still terminated
    char* tail = message_ + head;
    const std::size_t room = sizeof message_ - static_cast<std::size_t>(head);
    if (!upload) {
      std::snprintf(tail, room, "the first %zu bytes of the destination were written; nothing more will be", done);
    } else if (done == 0) {
      std::snprintf(tail, room, "nothing of this transfer was enqueued");
    } else {
      std::snprintf(tail, room,
                    "its first %zu bytes were enqueued before and may still be written to the destination, in stream "
                    "order",
                    done);
    }
  }
  const char* what() const noexcept override { return message_; }

 private:
  char message_[352] = {};
};

/// Rethrows `e`, met by the staging engine's `operation` ("to_device" or "to_host") on the chunk of `length` bytes at
/// `offset` of a `total`-byte transfer on device `d` (or on `failed`: the rest of it from `offset`, handed to the
/// background thread), as the same gpukit exception type with the same CUDA result, call, device, file and line; the
/// message adds where the transfer stopped and what of it may still land: `done` is the bytes enqueued before the
/// failure (to_device: they may still be written) or the bytes of the destination written (to_host: nothing more
/// will be). Called inside the handler of `e`: out of host memory for the message, `e` is rethrown as it was.
[[noreturn]] GPUKIT_INLINE void throw_chunk_failure(const error& e, std::string_view operation, gpukit::device d,
                                                    std::size_t offset, std::size_t length, std::size_t total,
                                                    std::size_t done,
                                                    staging_bad_alloc::part failed = staging_bad_alloc::part::chunk);

/// What to do instead of staging in a capture.
inline constexpr std::string_view capture_advice_staging =
    "pageable host memory is staged through pinned slots and events, which a graph cannot replay; during a capture "
    "copy between pinned memory (pinned_buffer) and device memory, which is captured as one copy node (nothing was "
    "enqueued)";
}  // namespace detail

/// The direction of a copy, for the device copy step (and for instrumented steps in tests).
enum class copy_direction : unsigned char { host_to_device, device_to_host, device_to_device };

/// The default device copy step: one cudaMemcpyAsync (cudaMemcpyDefault) on a CUDA stream; a memcpy enqueued on a CPU
/// stream (run at once on the CPU's synchronous default stream), so CPU copies are asynchronous and ordered like a
/// GPU's. Throws like any gpukit CUDA call, and invalid_argument_error for another thread's per-thread default stream
/// (cudaStreamPerThread would name this thread's) and, on the legacy default stream, while a gpukit capture of a
/// blocking stream of its device is underway (the copy would join that capture and invalidate it; the same guard as
/// event::record and stream_view::synchronize).
///
/// A device copy step is any callable `(void* dst, const void* src, std::size_t bytes, copy_direction, stream_view)`
/// that enqueues the copy on the stream, or throws having enqueued nothing.
struct device_copier {
  /// Enqueues a copy of `bytes` bytes from `src` to `dst` on `s`. The direction is unused: cudaMemcpyDefault infers
  /// it from the pointers.
  void operator()(void* dst, const void* src, std::size_t bytes, copy_direction /*direction*/, stream_view s) const;
};

/// Tuning of a staging engine. The defaults keep at most (4 + 2) × 8 MiB = 48 MiB pinned per stream that stages.
struct staging_options {
  /// Largest slot. 8 MiB DMAs amortise the per-copy launch cost (a few µs) to under 5% at 55 GB/s.
  std::size_t chunk_bytes = std::size_t{8} << 20;
  /// Transfers up to this size are one chunk; larger ones are split into at least `slots` chunks of at least this
  /// size, so even a few-MiB transfer overlaps its CPU copy with its DMA.
  std::size_t min_chunk_bytes = std::size_t{1} << 20;
  /// Slots of a stream's upload ring (to_device): 4 leave two DMAs queued while the CPU fills the next slot.
  std::size_t slots = 4;
  /// Threads that copy one chunk on the host (0: min(8, hardware threads)). On an H100 host (16 cores), staged
  /// 256 MiB uploads ran at 6–9, 12–14, 18–19, 25–35 and 25–36 GB/s with 1, 2, 4, 8 and 12 threads in two runs
  /// (bench_transfer, bench/results): 8 gets nearly all of it.
  unsigned threads = 0;
  /// A chunk gets one thread per this many bytes, up to `threads` (8 for an 8 MiB chunk): waking a helper costs
  /// ~10 µs, copying 1 MiB ~50–100 µs.
  std::size_t bytes_per_thread = std::size_t{1} << 20;
  /// How long to_device waits for one slot the stream has not released before handing the rest of the transfer to
  /// the stream's background thread (see the file comment). Each slot wait gets its own patience: the rest is handed
  /// over only when no slot has come free for this long, never because the call as a whole ran longer (a transfer
  /// of many chunks that waits for slow DMAs stays on the slots). A stream held back hands over after one patience.
  std::chrono::microseconds patience{20000};
  /// Rings kept for distinct streams: when a ring is created while this many exist, idle ones are released (least
  /// recently used first).
  std::size_t max_rings = 16;
  /// Slots of a stream's download ring (to_host): 2 let the DMA of one chunk run while the host copies the other out.
  std::size_t download_slots = 2;
  /// Fill upload slots with non-temporal (streaming) stores: only the DMA engine reads a slot next, so the CPU need
  /// not read it into its caches first (see parallel_copy.hpp). Off by default until
  /// measured on a GPU host (bench_transfer prints both).
  bool streaming_stores = false;
};

/// Counters of a staging engine.
struct staging_stats {
  std::uint64_t to_device_calls = 0;  ///< staged host-to-device copies (non-empty)
  std::uint64_t to_host_calls = 0;    ///< staged device-to-host copies (non-empty)
  std::uint64_t chunks = 0;           ///< chunks moved through slots
  std::uint64_t bytes = 0;            ///< bytes staged, either way
  std::uint64_t slot_waits = 0;       ///< times to_device found its next slot busy and waited
  std::uint64_t overflows = 0;        ///< to_device calls that handed (the rest of) their transfer to the background
  std::uint64_t overflow_bytes = 0;   ///< bytes handed over that way (held in heap memory until staged)
  std::uint64_t background_failures = 0;       ///< handed-over transfers that failed (reported through gpukit::warn)
  std::uint64_t rings_created = 0;             ///< rings created, one per stream on first use (again after a release)
  std::uint64_t rings_released = 0;            ///< idle rings released, by release_idle() or to stay within max_rings
  std::size_t rings = 0;                       ///< rings alive
  std::chrono::nanoseconds wait_time{0};       ///< time to_device spent waiting for slots
  std::chrono::nanoseconds host_copy_time{0};  ///< time to_device spent copying into slots
};

/// The staging engine (see the file comment). Thread-safe; calls in one direction on the same stream are serialised
/// (they would be by the stream anyway), other calls run concurrently.
template <class Copier = device_copier>
class basic_staging_engine {
 public:
  /// An engine taking its slots from `pool` (which must outlive it).
  explicit basic_staging_engine(pinned_pool& pool, staging_options options = {}, Copier copier = Copier());

  basic_staging_engine(const basic_staging_engine&) = delete;
  basic_staging_engine& operator=(const basic_staging_engine&) = delete;

  /// Waits for the transfers still queued for background threads and for every ring's work (the slots' events), then
  /// returns the slots to the pool. Destroy an engine only when its streams can finish their work.
  ~basic_staging_engine();

  /// Copies `bytes` of pageable host memory at `src` to device memory at `dst`, in the order of stream `s`. When it
  /// returns the source has been read in full (reuse it at once); the destination is written in stream order. Waits
  /// at most `patience` for each busy slot, then hands the rest over (see the file comment). If it throws, the
  /// chunks already enqueued may still be written to the destination in stream order; a gpukit exception met while
  /// staging a chunk is rethrown as the same type (same cuda_result()), its message naming the chunk's offset and
  /// size. Throws invalid_argument_error, enqueueing nothing, while `s` is being captured (a graph cannot replay
  /// staging) or for another thread's per-thread default stream. Out of host memory for a slot, it throws
  /// out_of_memory_error without emptying the pinned pool's cache (that would wait for the device's work, which may
  /// be waiting for this call). Out of host memory elsewhere (the heap), it throws a std::bad_alloc whose what()
  /// names the chunk, its offset and size, and what may still land.
  void to_device(void* dst, const void* src, std::size_t bytes, stream_view s);

  /// Copies `bytes` of device memory at `src` to pageable host memory at `dst`, in the order of stream `s`, and
  /// returns once `dst` holds the data: it waits for the stream's earlier work, as CUDA's cudaMemcpyAsync into
  /// pageable memory does. If it throws, part of the destination may have been written, and nothing more will be; a
  /// gpukit exception met while staging a chunk is rethrown as the same type, naming the chunk and how much of the
  /// destination was written. Throws invalid_argument_error, enqueueing nothing, while `s` is being captured or for
  /// another thread's per-thread default stream; out_of_memory_error and std::bad_alloc as to_device.
  void to_host(void* dst, const void* src, std::size_t bytes, stream_view s);

  /// Returns the slots of rings whose work has completed to the pool and forgets those rings (e.g. after a phase that
  /// used many streams). Returns the number of rings released.
  std::size_t release_idle();

  /// The chunk size used for a transfer of `bytes` (see staging_options).
  std::size_t chunk_for(std::size_t bytes) const noexcept;

  /// The most pinned memory the engine holds for one stream, whatever the transfers and the stream's backlog: its
  /// upload and download rings, (slots + download_slots) blocks of chunk_bytes rounded up to the pool's size class.
  std::size_t max_pinned_bytes_per_stream() const;

  /// A copy of the counters.
  staging_stats stats() const;

  /// The options in effect, after the constructor's adjustments (e.g. `threads` 0 resolved to a count).
  const staging_options& options() const noexcept;
  /// The device copy step.
  Copier& copier() noexcept;
  /// The pinned pool the slots come from.
  pinned_pool& pool() noexcept;

 private:
  struct slot {
    explicit slot(device d) : done(d) {}
    void forget_block() noexcept {  // the block is no longer the slot's (given back, or lost)
      ptr = nullptr;
      capacity = 0;
      used = false;
    }
    void* ptr = nullptr;
    std::size_t capacity = 0;
    bool used = false;  // `done` has been recorded
    event done;         // completes when the slot's last DMA (out of it, or into it) has
  };

  // One direction's slots. Its mutex is held by a call for its whole length: one call per stream and direction.
  struct lane {
    lane(device d, std::size_t count) {
      slots.reserve(count);
      for (std::size_t i = 0; i < count; ++i) slots.emplace_back(d);
    }
    std::mutex mutex;
    std::vector<slot> slots;
    std::size_t next = 0;
  };

  // Set by a background thread once a handed-over transfer has landed; the stream's host function waits for it.
  // Apart from what a host function may touch (no CUDA), so the host function never destroys an event.
  struct completion {
    void set() noexcept {
      {
        std::lock_guard<std::mutex> lock(mutex);
        done = true;
      }
      cv.notify_all();
    }
    void wait() {
      std::unique_lock<std::mutex> lock(mutex);
      cv.wait(lock, [this] { return done; });
    }
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };

  // The rest of a transfer, in heap memory, waiting for a background thread.
  struct job {
    job(device d, char* destination, std::size_t n, std::size_t chunk_size, bool behind_earlier)
        : dst(destination),
          data(new (std::nothrow) char[n]),
          bytes(n),
          chunk(chunk_size),
          queued(behind_earlier),
          after(detail::acquire_recycled_event(d)),
          done(std::make_shared<completion>()) {
      if (!data) {
        throw out_of_memory_error("gpukit::staging_engine::to_device: cannot allocate " +
                                  detail::format_bytes_exact(n) + " of host memory for " + why() + " (to " +
                                  d.to_string() + ")");
      }
    }
    job(const job&) = delete;
    job& operator=(const job&) = delete;
    ~job() { detail::give_recycled_event(std::move(after)); }

    // Why it is staged in the background, for messages.
    const char* why() const noexcept {
      return queued ? "a transfer queued behind the rest of an earlier one still staged in the background"
                    : "the rest of a transfer that its stream did not take within the patience";
    }

    char* dst;
    std::unique_ptr<char[]> data;
    std::size_t bytes;
    std::size_t chunk;
    bool queued;  // handed over at once, behind an earlier transfer's rest (not out of patience)
    event after;  // the stream's work before the hand-over; then the end of the side stream's copies
    std::shared_ptr<completion> done;
  };

  // Identifies a stream: the CUDA stream id (handles are reused once a stream is destroyed), or the CPU queue (a CPU
  // stream's destructor waits for its work, so a queue address used again never inherits pending work).
  struct stream_key {
    device dev;
    unsigned long long id = 0;
    const void* queue = nullptr;
    friend bool operator==(const stream_key& a, const stream_key& b) noexcept {
      return a.dev == b.dev && a.id == b.id && a.queue == b.queue;
    }
  };

  struct ring {
    ring(const stream_key& k, std::size_t up_slots, std::size_t down_slots)
        : key(k), dev(k.dev), up(k.dev, up_slots), down(k.dev, down_slots) {
      orphans.reserve(up_slots);  // so that the background thread never allocates to orphan a slot's block
    }
    stream_key key;
    device dev;
    lane up;                // to_device, and the background thread while it owns it
    lane down;              // to_host
    std::mutex jobs_mutex;  // jobs, background_owns_up
    std::condition_variable jobs_changed;
    std::deque<std::shared_ptr<job>> jobs;
    bool background_owns_up = false;  // a background thread, not the lane's mutex holder, uses `up`
    std::unique_ptr<stream> side;     // the background thread's copies
    // Upload blocks the background thread took out of their slots (their event could not be recorded, so a copy on
    // `side` may still read them), kept for a caller to give back to the pool: the background thread never calls into
    // the pool. Owned like `up`; at most one per slot, since a caller that refills a slot disposes of them first.
    std::vector<void*> orphans;
    std::uint64_t last_used = 0;
    bool retired = false;  // written with both lanes locked
  };

  struct lane_lease {
    std::shared_ptr<ring> r;
    std::unique_lock<std::mutex> lock;
  };

  unsigned threads_for(std::size_t length) const noexcept;

  static stream_key key_of(stream_view s, device d);

  // One lane of stream `s`'s ring, locked. Creates the ring on first use, first releasing idle rings (least recently
  // used first) while there are max_rings or more.
  lane_lease acquire(stream_view s, lane ring::*which);
  // acquire for `operation`, a transfer of `bytes`: out of host memory, a staging_bad_alloc saying that setting up
  // the stream's slots failed, nothing enqueued.
  lane_lease acquire_for(stream_view s, lane ring::*which, std::string_view operation, std::size_t bytes);

  // Under mutex_: retires the ring if no call holds it, no transfer waits for its background thread and all its
  // work has completed. Its blocks stay: the caller gives them back with give_back_retired once mutex_ is let go.
  bool try_retire_locked(ring& r);

  // A ring try_retire_locked retired (out of rings_): gives its slots' and orphaned blocks back to the pool. Not
  // under mutex_: the pool may call cudaFreeHost, which waits for all the device's work. If the pool refuses some
  // (out of host memory), the ring keeps them and is listed again: false.
  bool give_back_retired(const std::shared_ptr<ring>& r) noexcept;

  void drain_and_free_locked(ring& r) noexcept;

  // At the engine's destruction: gives back block `p`, whose work is done if `idle`; one the pool refuses (or one
  // not `idle`) stays allocated in the pool, reported.
  void give_back_at_teardown(void* p, bool idle) noexcept;

  // Polls `e` until it completes or the deadline passes. Spins briefly (a DMA of a chunk takes ~150 µs), then sleeps.
  static bool wait_until(const event& e, std::chrono::steady_clock::time_point deadline);
  // Polls `ready()` the same way.
  template <class Ready>
  static bool poll_until(Ready&& ready, std::chrono::steady_clock::time_point deadline);

  // The background thread's wait: polling with sleeps, since a CUDA event's synchronize spins a core for as long as
  // the stream is held.
  static void poll_until_ready(const event& e);

  // Gives the slot's block (if any) back to the pool, with an event on `*s` unless it is null; the slot is empty
  // afterwards. If the pool throws, the slot keeps the block when the pool refused it and is empty when the pool
  // lost it.
  void give_slot_block_back(slot& sl, const stream_view* s);

  // A slot whose previous use has completed: replace its block with a bigger one if needed. The old block goes first,
  // so the slots never hold more than their bound. Calling threads only (never the background thread).
  void grow_idle_slot(slot& sl, std::size_t bytes);

  // to_host: a slot whose previous DMA may still be in flight on `s`: the old block goes back to the pool with an
  // event on `s`, so the pool reuses it only after that DMA.
  void grow_slot_stream_ordered(slot& sl, std::size_t bytes, stream_view s);

  // Records the slot's completion event after its use was enqueued on `s`. If recording fails, the slot's block may
  // still be in use with nothing to wait for, so it leaves the ring.
  void record_done(slot& sl, stream_view s);

  // Takes a slot whose block may be in use by work its event does not capture out of the ring: the block goes back
  // to the pool with an event recorded now on `s`, which does capture it; if even that fails, the pool keeps the
  // block out of use for good. The slot is empty afterwards and gets a new block when next used. If the pool refuses
  // the block (out of host memory), the slot keeps it if `s` finishes within the patience (polled; a captured stream
  // is not waited for); otherwise the block stays allocated in the pool, reported.
  void abandon_slot(slot& sl, stream_view s) noexcept;

  // hand_over, with the upload lane locked and the background idle: gives every upload slot at least `bytes` (the
  // old block goes first, so the bound holds). A slot's last DMA may still be pending, on `s` or (after a failed
  // background run) on the side stream: its old block goes back in the order of `s`, behind the slot's event. So does
  // the block of an idle slot: given back at once it could go to cudaFreeHost (the pool's cap), which waits for the
  // device's work, that of `s` included, which this call must not wait for.
  void grow_upload_slots(ring& r, stream_view s, std::size_t bytes);

  // Gives the blocks the background thread orphaned back to the pool, each with an event on the side stream (which
  // captures the copy that may still read it; if recording fails, the pool keeps the block out of use for good). For a
  // caller holding the upload lane while the background is idle. Blocks the pool refuses (out of host memory) stay
  // orphans, for the next call.
  void dispose_orphans(ring& r) noexcept;

  bool background_idle(ring& r);

  // to_device out of patience (or queued behind such a transfer), with the upload lane locked: the rest goes into
  // heap memory and to the ring's background thread; one host function holds the stream's later work until it has
  // landed.
  void hand_over(ring& r, stream_view s, char* dst, const char* src, std::size_t bytes, std::size_t chunk,
                 bool behind_earlier);

  void start_background(ring& r, std::shared_ptr<job> j);

  // The background thread of a ring: stages the queued jobs in order, then gives the upload lane back and ends. The
  // lane is given back before the last job's stream goes on, so the stream's next to_device finds it free.
  void run_background(ring& r) noexcept;

  // Stages a job through the upload slots. The stream's host function waits for this, and anything that waits for the
  // device's work (cudaFreeHost, cudaFree, cudaDeviceSynchronize, cudaStreamSynchronize of the stream, and so any
  // pinned-pool call, which may free cached blocks or retry an allocation after emptying its cache) would wait for that
  // host function: a deadlock. So the CUDA calls made on this thread are only device guards' (cudaGetDevice,
  // cudaSetDevice, context queries), cudaStreamWaitEvent and cudaMemcpyAsync from pinned memory on the side stream,
  // cudaEventRecord on it, cudaEventQuery and, when the job's event leaves the full recycled-event cache,
  // cudaEventDestroy: none of them waits for other work. The rest is host memcpy. The slots were sized by hand_over
  // on the calling thread; a slot whose event cannot be recorded goes to `orphans`, not to the pool.
  void stage_in_background(ring& r, job& j) noexcept;

  // The background thread's record_done: a slot whose event cannot be recorded may still be read by the copy just
  // enqueued, so its block leaves the ring; it waits in `orphans` (room reserved) for a caller, not for the pool.
  static void record_done_in_background(ring& r, slot& sl, stream_view side);

  // Waits until the ring's background thread has emptied its queue (and so no longer touches the ring).
  static void finish_background(ring& r) noexcept;

  pinned_pool* pool_;
  staging_options options_;
  Copier copier_;
  mutable std::mutex mutex_;  // rings_ and tick_
  std::vector<std::shared_ptr<ring>> rings_;
  std::uint64_t tick_ = 0;
  mutable std::mutex stats_mutex_;
  staging_stats stats_;
};

/// The staging engine with the default device copy step.
using staging_engine = basic_staging_engine<device_copier>;

/// The process-wide staging engine for a device kind, using default_pinned_pool(d): one for all CUDA devices (rings
/// are per stream, hence per device) and one for the CPU device. Created on first use; never destroyed (see
/// default_pinned_pool).
GPUKIT_EXPORT GPUKIT_INLINE staging_engine& default_staging_engine(device d);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Throws an `Exception` like `e` (its CUDA result, call, device, file and line) with `message`; inside the handler of
/// `e`, which is rethrown as it was should the new exception not fit in host memory.
template <class Exception>
[[noreturn]] void throw_like(const error& e, const std::string& message) {
  std::optional<Exception> adorned;
  try {
    adorned.emplace(message, e.cuda_result(), std::string(e.call()), e.device(), e.file(), e.line());
  } catch (...) {
  }
  if (!adorned) throw;
  throw *adorned;  // copying a gpukit exception never throws
}

GPUKIT_INLINE void throw_chunk_failure(const error& e, std::string_view operation, gpukit::device d, std::size_t offset,
                                       std::size_t length, std::size_t total, std::size_t done,
                                       staging_bad_alloc::part failed) {
  const bool upload = operation != "to_host";
  std::string message;
  try {
    message = "gpukit::staging_engine::" + std::string(operation) + ": " +
              (failed == staging_bad_alloc::part::rest ? "the rest, " : "the chunk of ") + format_bytes_exact(length) +
              " at byte offset " + std::to_string(offset) + " of a " + format_bytes_exact(total) + " transfer " +
              (upload ? "to " : "from ") + d.to_string() + " failed: " + e.what() + "; ";
    if (!upload) {
      message += "the first " + std::to_string(done) + " bytes of the destination were written; nothing more will be";
    } else if (done == 0) {
      message += "nothing of this transfer was enqueued";
    } else {
      message += "its first " + std::to_string(done) +
                 " bytes were enqueued before and may still be written to the destination, in stream order";
    }
  } catch (...) {
    message.clear();
  }
  if (message.empty()) throw;  // out of host memory: `e` as it was, rather than std::bad_alloc
  switch (e.code()) {
    case errc::no_device:
      throw_like<no_device_error>(e, message);
    case errc::out_of_memory:
      throw_like<out_of_memory_error>(e, message);
    case errc::invalid_argument:
      throw_like<invalid_argument_error>(e, message);
    case errc::cuda:
      break;
  }
  throw_like<cuda_error>(e, message);
}
}  // namespace detail

GPUKIT_INLINE void device_copier::operator()(void* dst, const void* src, std::size_t bytes,
                                             copy_direction /*direction*/, stream_view s) const {
  if (s.is_cpu()) return detail::cpu_backend::copy_async(dst, src, bytes, s.cpu_queue());
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("device_copier");
  const int ordinal = s.device().ordinal();
  if (s.is_default() && !s.is_per_thread()) {
    // A copy on the legacy stream joins a gpukit capture of a blocking stream begun meanwhile and invalidates it:
    // enqueued under the hold that capture waits for, or refused (capture_status cannot tell: CUDA never captures
    // the legacy stream itself).
    const detail::legacy_stream_hold hold(ordinal);
    detail::refuse_legacy_stream_join("device_copier (cudaMemcpyAsync on the legacy default stream)", s,
                                      hold.refused());
    return detail::cuda_backend::copy_async(dst, src, bytes, s.native_handle(), ordinal);
  }
  detail::cuda_backend::copy_async(dst, src, bytes, s.native_handle(), ordinal);
}

GPUKIT_INLINE staging_engine& default_staging_engine(device d) {
  if (d.is_cpu()) {
    static staging_engine* cpu_engine = new staging_engine(default_pinned_pool(device::cpu()));
    return *cpu_engine;
  }
  static staging_engine* cuda_engine = new staging_engine(default_pinned_pool(d));
  return *cuda_engine;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS

// The engine's member functions. The compiled mode leaves them out: gpukit::compiled holds the instantiation gpukit
// uses, and staging_impl.hpp is there for other template arguments.
#if GPUKIT_DETAIL_DEFINITIONS
#include <gpukit/transfer/staging_impl.hpp>
#endif
