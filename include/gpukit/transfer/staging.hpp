// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The staging engine: copies between pageable host memory and a device through a small ring of pinned slots, so
/// pageable transfers run at close to the pinned rate instead of the 18–31% the driver's own staging reaches.
///
/// Host to device (to_device): the calling thread copies a chunk of the source into a free slot (with several threads
/// for large chunks), enqueues the DMA from the slot on the stream, records the slot's event, and goes on with the
/// next slot; a slot is refilled once its event has completed. The source is read entirely during the call: **when
/// to_device returns, the source may be reused or freed.** The destination is written in stream order.
///
/// Device to host (to_host), the mirror: the DMA of each chunk into a slot is enqueued on the stream, and a host
/// function on a side stream (one per stream, created on first use) copies the slot to the destination once the DMA
/// has completed; the stream's later work waits for those host functions. Slot reuse is ordered on the streams
/// themselves, so the call never waits on the host. **The destination is written in stream order: it may be read,
/// reused or freed once the stream has passed the copy** (stream.synchronize(), or an event recorded after it), as
/// for a copy into pinned memory. The source (device memory) likewise must stay valid until then.
///
/// Never a deadlock: to_device waits for a slot only while the stream makes progress. Each call gives the stream
/// `patience` (20 ms by default) in total; if a slot is still busy after that — the stream may be held by work that
/// only a later host action releases (a host function waiting on a gate, an event not yet recorded) — the rest of
/// the transfer is copied into one block from the pinned pool at once (freed stream-ordered), and the call returns.
/// So in the worst case staging pins as much memory as it transfers; it never waits forever. to_host never waits.
///
/// Rings are per stream: a stream's copies recycle only their own slots, so a stream held back never delays another.
/// Slots come from a pinned_pool (chunk-sized blocks, cached after warm-up) and grow on demand to the chunk size.
///
/// The engine knows nothing of CUDA beyond gpukit's streams and events: the "device copy" step is a template
/// parameter (device_copier: cudaMemcpyAsync, or a memcpy enqueued on a CPU stream), so tests on CPU streams
/// exercise slot recycling, ordering and the no-deadlock rule for real, under threads.

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/parallel_copy.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace gpukit {

/// The direction of a copy, for the device copy step (and for instrumented steps in tests).
enum class copy_direction : unsigned char { host_to_device, device_to_host, device_to_device };

/// The default device copy step: one cudaMemcpyAsync (cudaMemcpyDefault) on a CUDA stream; a memcpy enqueued on a CPU
/// stream (run at once on the CPU's synchronous default stream), so CPU copies are asynchronous and ordered like a
/// GPU's. Throws like any gpukit CUDA call.
///
/// A device copy step is any callable `(void* dst, const void* src, std::size_t bytes, copy_direction, stream_view)`
/// that enqueues the copy on the stream, or throws having enqueued nothing.
struct device_copier {
  void operator()(void* dst, const void* src, std::size_t bytes, copy_direction /*direction*/, stream_view s) const {
    if (s.is_cpu()) {
      s.enqueue_host([dst, src, bytes] { std::memcpy(dst, src, bytes); });
      return;
    }
    device_guard guard(s.device());
    GPUKIT_CUDA_TRY_DESCRIBED(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.native_handle()),
                              "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes)", -1);
  }
};

/// Tuning of a staging engine. The defaults keep 4 × 8 MiB = 32 MiB pinned per stream that stages.
struct staging_options {
  /// Largest slot. 8 MiB DMAs amortise the per-copy launch cost (a few µs) to under 5% at 55 GB/s.
  std::size_t chunk_bytes = std::size_t{8} << 20;
  /// Transfers up to this size are one chunk; larger ones are split into at least `slots` chunks of at least this
  /// size, so even a few-MiB transfer overlaps its CPU copy with its DMA.
  std::size_t min_chunk_bytes = std::size_t{1} << 20;
  /// Slots per stream's ring: 4 leaves two DMAs queued while the CPU fills the next slot.
  std::size_t slots = 4;
  /// Threads that copy one chunk on the host (0: min(4, hardware threads)).
  unsigned threads = 0;
  /// A chunk gets one thread per this many bytes, up to `threads`: waking a helper costs ~10 µs, copying 2 MiB
  /// ~100–200 µs.
  std::size_t bytes_per_thread = std::size_t{2} << 20;
  /// How long to_device waits, in total per call, for slots the stream has not released before staging the rest in
  /// one pool block (see the file comment).
  std::chrono::microseconds patience{20000};
  /// Rings kept for distinct streams; idle rings beyond this are released (least recently used first).
  std::size_t max_rings = 16;
};

/// Counters of a staging engine.
struct staging_stats {
  std::uint64_t to_device_calls = 0;   ///< staged host-to-device copies (non-empty)
  std::uint64_t to_host_calls = 0;     ///< staged device-to-host copies (non-empty)
  std::uint64_t chunks = 0;            ///< chunks moved through slots
  std::uint64_t bytes = 0;             ///< bytes moved through slots or overflow blocks
  std::uint64_t slot_waits = 0;        ///< times to_device found its next slot busy and waited
  std::uint64_t overflows = 0;         ///< calls that ran out of patience and staged the rest in one block
  std::uint64_t overflow_bytes = 0;    ///< bytes staged that way
  std::uint64_t rings_created = 0;
  std::uint64_t rings_released = 0;
  std::size_t rings = 0;               ///< rings alive
  std::chrono::nanoseconds wait_time{0};   ///< time to_device spent waiting for slots
  std::chrono::nanoseconds host_copy_time{0};  ///< time to_device spent copying into slots
};

/// The staging engine (see the file comment). Thread-safe; calls on the same stream are serialised (they would be by
/// the stream anyway), calls on different streams run concurrently.
template <class Copier = device_copier>
class basic_staging_engine {
 public:
  /// An engine taking its slots from `pool` (which must outlive it).
  explicit basic_staging_engine(pinned_pool& pool, staging_options options = {}, Copier copier = Copier())
      : pool_(&pool), options_(options), copier_(std::move(copier)) {
    if (options_.chunk_bytes == 0 || options_.slots == 0) {
      throw invalid_argument_error("gpukit::staging_engine: chunk_bytes and slots must be positive");
    }
    if (options_.min_chunk_bytes == 0 || options_.min_chunk_bytes > options_.chunk_bytes) {
      options_.min_chunk_bytes = options_.chunk_bytes;
    }
    if (options_.bytes_per_thread == 0) options_.bytes_per_thread = 1;
    if (options_.threads == 0) {
      const unsigned hardware = std::thread::hardware_concurrency();
      options_.threads = std::max(1u, std::min(4u, hardware));
    }
    if (options_.max_rings == 0) options_.max_rings = 1;
  }

  basic_staging_engine(const basic_staging_engine&) = delete;
  basic_staging_engine& operator=(const basic_staging_engine&) = delete;

  /// Waits for every ring's work (the slots' events), then returns the slots to the pool. Destroy an engine only
  /// when its streams can finish their work.
  ~basic_staging_engine() {
    for (auto& r : rings_) {
      std::lock_guard<std::mutex> lock(r->mutex);
      drain_and_free_locked(*r);
    }
  }

  /// Copies `bytes` of pageable host memory at `src` to device memory at `dst`, in the order of stream `s`. When it
  /// returns the source has been read in full (reuse it at once); the destination is written in stream order. If it
  /// throws, the chunks already enqueued may still be written to the destination in stream order.
  void to_device(void* dst, const void* src, std::size_t bytes, stream_view s) {
    if (bytes == 0) return;
    ring_lease lease = acquire_ring(s);
    ring& r = *lease.r;
    const std::size_t chunk = chunk_for(bytes);
    const auto deadline = std::chrono::steady_clock::now() + options_.patience;
    std::chrono::steady_clock::duration waited{};
    std::chrono::steady_clock::duration copying{};
    std::uint64_t waits = 0;
    std::uint64_t chunks = 0;
    std::size_t offset = 0;
    bool overflowed = false;
    auto* out = static_cast<char*>(dst);
    const auto* in = static_cast<const char*>(src);
    while (offset < bytes) {
      const std::size_t length = std::min(chunk, bytes - offset);
      slot& sl = r.slots[r.next];
      if (sl.used && !sl.done.ready()) {
        ++waits;
        const auto start = std::chrono::steady_clock::now();
        const bool freed = wait_until(sl.done, deadline);
        waited += std::chrono::steady_clock::now() - start;
        if (!freed) {
          overflow_to_device(out + offset, in + offset, bytes - offset, s);
          overflowed = true;
          break;
        }
      }
      grow_idle_slot(sl, chunk);
      const auto copy_start = std::chrono::steady_clock::now();
      parallel_copy(sl.ptr, in + offset, length, threads_for(length));
      copying += std::chrono::steady_clock::now() - copy_start;
      copier_(out + offset, sl.ptr, length, copy_direction::host_to_device, s);
      record_done(sl, s);
      r.next = (r.next + 1) % r.slots.size();
      offset += length;
      ++chunks;
    }
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.to_device_calls;
    stats_.chunks += chunks;
    stats_.bytes += bytes;
    stats_.slot_waits += waits;
    stats_.wait_time += std::chrono::duration_cast<std::chrono::nanoseconds>(waited);
    stats_.host_copy_time += std::chrono::duration_cast<std::chrono::nanoseconds>(copying);
    if (overflowed) {
      ++stats_.overflows;
      stats_.overflow_bytes += bytes - offset;
    }
  }

  /// Copies `bytes` of device memory at `src` to pageable host memory at `dst`, in the order of stream `s`, without
  /// waiting on the host. The destination is complete once `s` has passed the copy (synchronize `s`, or wait for an
  /// event recorded on it after the call); until then neither `dst` nor `src` may be freed. If it throws, the
  /// chunks already enqueued may still be written to the destination until `s` passes them.
  void to_host(void* dst, const void* src, std::size_t bytes, stream_view s) {
    if (bytes == 0) return;
    ring_lease lease = acquire_ring(s);
    ring& r = *lease.r;
    if (!r.side) r.side = std::make_unique<stream>(r.dev);
    const stream_view side = r.side->view();
    const std::size_t chunk = chunk_for(bytes);
    auto* out = static_cast<char*>(dst);
    const auto* in = static_cast<const char*>(src);
    std::size_t offset = 0;
    std::uint64_t chunks = 0;
    bool enqueued_any = false;
    slot* in_flight = nullptr;  // a slot whose DMA is enqueued but whose `done` does not capture it yet
    try {
      while (offset < bytes) {
        const std::size_t length = std::min(chunk, bytes - offset);
        slot& sl = r.slots[r.next];
        if (sl.used) sl.done.wait(s);  // the stream, not the host, waits for the slot's previous use
        grow_slot_stream_ordered(sl, chunk, s, side);
        copier_(sl.ptr, in + offset, length, copy_direction::device_to_host, s);
        enqueued_any = true;
        in_flight = &sl;
        sl.filled.record(s);
        sl.filled.wait(side);
        side.enqueue_host([to = out + offset, from = sl.ptr, length, parts = threads_for(length)] {
          parallel_copy(to, from, length, parts);
        });
        sl.done.record(side);
        sl.used = true;
        in_flight = nullptr;
        r.next = (r.next + 1) % r.slots.size();
        offset += length;
        ++chunks;
      }
    } catch (...) {
      if (in_flight != nullptr) abandon_slot(*in_flight, s, &side);
      if (enqueued_any) join_side_noexcept(r, s);
      throw;
    }
    // The stream's later work runs after the host copies, so "the stream has passed the copy" means dst is complete.
    r.tail.record(side);
    r.tail.wait(s);
    std::lock_guard<std::mutex> lock(stats_mutex_);
    ++stats_.to_host_calls;
    stats_.chunks += chunks;
    stats_.bytes += bytes;
  }

  /// Returns the slots of rings whose work has completed to the pool and forgets those rings (e.g. after a phase that
  /// used many streams). Returns the number of rings released.
  std::size_t release_idle() {
    std::vector<std::shared_ptr<ring>> idle;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (std::size_t i = 0; i < rings_.size();) {
        if (try_retire_locked(*rings_[i])) {
          idle.push_back(std::move(rings_[i]));
          rings_.erase(rings_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    }
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.rings_released += idle.size();
    return idle.size();
  }

  /// The chunk size used for a transfer of `bytes` (see staging_options).
  std::size_t chunk_for(std::size_t bytes) const noexcept {
    if (bytes <= options_.min_chunk_bytes) return std::min(bytes, options_.chunk_bytes);
    constexpr std::size_t granule = 64 * 1024;
    std::size_t chunk = (bytes + options_.slots - 1) / options_.slots;
    chunk = (chunk + granule - 1) / granule * granule;
    return std::min(options_.chunk_bytes, std::max(options_.min_chunk_bytes, chunk));
  }

  /// A copy of the counters.
  staging_stats stats() const {
    staging_stats copy;
    {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      copy = stats_;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    copy.rings = rings_.size();
    return copy;
  }

  const staging_options& options() const noexcept { return options_; }
  Copier& copier() noexcept { return copier_; }
  pinned_pool& pool() noexcept { return *pool_; }

 private:
  struct slot {
    explicit slot(device d) : done(d), filled(d) {}
    void* ptr = nullptr;
    std::size_t capacity = 0;
    bool used = false;  // `done` has been recorded
    event done;         // completes when the slot's last use has (the DMA out of it, or the host copy out of it)
    event filled;       // to_host: completes when the DMA into the slot has
  };

  struct ring {
    ring(stream_view s, device d, std::size_t count) : key(s), dev(d), tail(d) {
      slots.reserve(count);
      for (std::size_t i = 0; i < count; ++i) slots.emplace_back(d);
    }
    stream_view key;
    device dev;
    std::mutex mutex;  // held for a whole call: one call per stream at a time
    std::vector<slot> slots;
    std::size_t next = 0;
    std::unique_ptr<stream> side;  // to_host's host copies
    event tail;                    // to_host: the side stream's last host copy
    std::uint64_t last_used = 0;
    bool retired = false;
  };

  struct ring_lease {
    std::shared_ptr<ring> r;
    std::unique_lock<std::mutex> lock;
  };

  unsigned threads_for(std::size_t length) const noexcept {
    const std::size_t by_size = std::max<std::size_t>(1, length / options_.bytes_per_thread);
    return static_cast<unsigned>(std::min<std::size_t>(options_.threads, by_size));
  }

  // The ring of stream `s`, locked. Creates it on first use, first releasing idle rings (least recently used first)
  // while there are max_rings or more.
  ring_lease acquire_ring(stream_view s) {
    const device d = s.device();
    for (;;) {
      std::shared_ptr<ring> r;
      std::size_t retired = 0;
      bool created = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& candidate : rings_) {
          if (candidate->key == s && candidate->dev == d) {
            r = candidate;
            break;
          }
        }
        if (!r) {
          if (rings_.size() >= options_.max_rings) {
            std::vector<std::shared_ptr<ring>> by_age(rings_);
            std::sort(by_age.begin(), by_age.end(),
                      [](const std::shared_ptr<ring>& a, const std::shared_ptr<ring>& b) {
                        return a->last_used < b->last_used;
                      });
            for (auto& candidate : by_age) {
              if (rings_.size() - retired < options_.max_rings) break;
              if (try_retire_locked(*candidate)) ++retired;
            }
            rings_.erase(std::remove_if(rings_.begin(), rings_.end(),
                                        [](const std::shared_ptr<ring>& x) { return x->retired; }),
                         rings_.end());
          }
          r = std::make_shared<ring>(s, d, options_.slots);
          rings_.push_back(r);
          created = true;
        }
        r->last_used = ++tick_;
      }
      if (created || retired != 0) {
        std::lock_guard<std::mutex> lock(stats_mutex_);
        stats_.rings_created += created ? 1 : 0;
        stats_.rings_released += retired;
      }
      std::unique_lock<std::mutex> ring_lock(r->mutex);
      if (r->retired) continue;  // released between the lookup and the lock: look again
      return ring_lease{std::move(r), std::move(ring_lock)};
    }
  }

  // Under mutex_: retires the ring if no call holds it and all its work has completed, returning its slots to the
  // pool.
  bool try_retire_locked(ring& r) {
    std::unique_lock<std::mutex> lock(r.mutex, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    try {
      for (auto& sl : r.slots) {
        if (sl.used && !sl.done.ready()) return false;
      }
      if (!r.tail.ready()) return false;
      for (auto& sl : r.slots) {
        if (sl.ptr != nullptr) pool_->deallocate(sl.ptr);
        sl.ptr = nullptr;
        sl.capacity = 0;
      }
      r.side.reset();
      r.retired = true;
      return true;
    } catch (...) {
      return false;  // a failing event query: keep the ring
    }
  }

  void drain_and_free_locked(ring& r) noexcept {
    for (auto& sl : r.slots) {
      try {
        if (sl.used) sl.done.synchronize();
      } catch (...) {
      }
      try {
        if (sl.ptr != nullptr) pool_->deallocate(sl.ptr);
      } catch (...) {
      }
      sl.ptr = nullptr;
      sl.capacity = 0;
    }
    r.side.reset();
  }

  // Polls `e` until it completes or the deadline passes. Spins briefly (a DMA of a chunk takes ~150 µs), then sleeps.
  static bool wait_until(const event& e, std::chrono::steady_clock::time_point deadline) {
    for (int spin = 0;; ++spin) {
      if (e.ready()) return true;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return e.ready();
      if (spin < 64) {
        std::this_thread::yield();
      } else {
        const auto left = deadline - now;
        std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, std::chrono::microseconds(50)));
      }
    }
  }

  // A slot whose previous use has completed: replace its block with a bigger one if needed.
  void grow_idle_slot(slot& sl, std::size_t bytes) {
    if (sl.capacity >= bytes) return;
    void* p = pool_->allocate(bytes);
    if (sl.ptr != nullptr) pool_->deallocate(sl.ptr);
    sl.ptr = p;
    sl.capacity = bytes;
  }

  // to_host: a slot whose previous use may still be in flight on `s` or `side`: the old block goes back to the pool
  // with events on both streams, so it is reused only after that use.
  void grow_slot_stream_ordered(slot& sl, std::size_t bytes, stream_view s, stream_view side) {
    if (sl.capacity >= bytes) return;
    void* p = pool_->allocate(bytes);
    if (sl.ptr != nullptr) {
      try {
        if (sl.used) {
          pool_->record_stream(sl.ptr, s);
          pool_->record_stream(sl.ptr, side);
        }
        pool_->deallocate(sl.ptr);
      } catch (...) {
        pool_->deallocate(p);
        throw;
      }
    }
    sl.ptr = p;
    sl.capacity = bytes;
  }

  // Records the slot's completion event after its use was enqueued on `s`. If recording fails, the slot's block may
  // still be in use with nothing to wait for, so it leaves the ring.
  void record_done(slot& sl, stream_view s) {
    try {
      sl.done.record(s);
      sl.used = true;
    } catch (...) {
      abandon_slot(sl, s, nullptr);
      throw;
    }
  }

  // Takes a slot whose block may be in use by work its events do not capture out of the ring: the block goes back
  // to the pool with events recorded now on `s` (and `side`), which do capture it; if even that fails, the pool
  // keeps the block out of use for good. The slot is empty afterwards and gets a new block when next used.
  void abandon_slot(slot& sl, stream_view s, const stream_view* side) noexcept {
    void* p = std::exchange(sl.ptr, nullptr);
    sl.capacity = 0;
    sl.used = false;
    if (p == nullptr) return;
    try {
      pool_->record_stream(p, s);
      if (side != nullptr) pool_->record_stream(p, *side);
      pool_->deallocate(p);
    } catch (...) {
      // The pool marks the block lost when it cannot record its events.
    }
  }

  // to_device out of patience: the rest goes through one pool block, freed stream-ordered.
  void overflow_to_device(char* dst, const char* src, std::size_t bytes, stream_view s) {
    void* block = pool_->allocate(bytes);
    try {
      parallel_copy(block, src, bytes, threads_for(bytes));
      copier_(dst, block, bytes, copy_direction::host_to_device, s);
    } catch (...) {
      pool_->deallocate(block);
      throw;
    }
    pool_->deallocate(block, s);
  }

  // After a failure in to_host: order the stream's later work after the host copies already enqueued.
  void join_side_noexcept(ring& r, stream_view s) noexcept {
    try {
      r.tail.record(r.side->view());
      r.tail.wait(s);
    } catch (...) {
    }
  }

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
inline staging_engine& default_staging_engine(device d) {
  if (d.is_cpu()) {
    static staging_engine* cpu_engine = new staging_engine(default_pinned_pool(device::cpu()));
    return *cpu_engine;
  }
  static staging_engine* cuda_engine = new staging_engine(default_pinned_pool(d));
  return *cuda_engine;
}

}  // namespace gpukit
