// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// prefetcher<T>: a double- or triple-buffered loader. A user callback produces batch N+1 into pinned memory on a
/// background thread (or several) and its copy to the device runs on a copy stream, while the consumer stream still
/// works on batch N. Each batch is handed to the consumer stream with the right dependencies, none of them a host
/// wait:
///
/// - the consumer stream waits (on the device) for the batch's copy before the work enqueued after next();
/// - releasing a batch records an event on the consumer stream; the copy stream waits for it before it overwrites
///   that device buffer with a later batch.
///
///     gpukit::prefetcher<float> loader(s, batch_elements, [&](std::size_t index, gpukit::span<float> out) {
///       return read_batch(index, out);           // elements written; 0 ends the data
///     });
///     while (auto batch = loader.next()) {
///       train_step(batch->data(), s);            // work enqueued on s sees the batch
///     }                                          // the batch is released here: its buffer may be refilled
///
/// With `depth` device buffers, batches are prepared while earlier ones are in use: batch N uses buffer N % depth,
/// so it can be copied once batch N − depth has been released. next() throws instead of deadlocking when that
/// batch is still held. Batches come in index order, whatever the number of producer threads.
///
/// The producer's lead is bounded (prefetch_options::prefetch_factor, like a DataLoader's): each batch is produced
/// into one of at most prefetch_factor × producer_threads pinned buffers, and a buffer is refilled only once its copy
/// has completed. A host that releases batches faster than the device consumes them therefore ends up waiting in
/// next() for the device, with bounded pinned memory, instead of queueing ever more copies. The producer threads
/// find out that a copy completed by querying its event (with a backoff of at most 1 ms), not through a host
/// function, since CUDA may run the host functions of all streams of a device one at a time.
///
/// An exception thrown by the callback is rethrown by next() once the batches before it have been handed out. The
/// callback must not call next() on its own prefetcher: that call throws invalid_argument_error (it would wait for
/// itself), which reaches the consumer the same way. stats() reports the waits on both sides, the batches in flight
/// and the pinned memory held. Works unchanged on the CPU device.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/spans.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// How a prefetcher buffers.
struct prefetch_options {
  /// Device buffers in the rotation: 2 is double buffering, 3 triple (absorbs jitter in the producer).
  std::size_t depth = 2;
  /// Batches each producer thread may have in pinned memory at once: being produced, or waiting for or in their
  /// copy to the device. Bounds the producer's lead over the device and the pinned memory held, at
  /// prefetch_factor × producer_threads buffers of the batch capacity. 0 lifts the bound: the producer never waits
  /// for a copy, and pinned memory grows while the device lags. Use 0 only when the host holds the consumer stream
  /// back until it has received later batches (a bounded producer would wait for that stream, and next() for it).
  std::size_t prefetch_factor = 2;
  /// Threads calling the producer, concurrently when more than 1 (then it must be thread-safe). Each index is
  /// produced once and batches are still handed out in index order.
  std::size_t producer_threads = 1;
};

/// What a prefetcher has done and waited for (prefetcher::stats()).
struct prefetch_stats {
  std::size_t batches_produced = 0;    ///< producer calls that returned a batch
  std::size_t batches_handed_out = 0;  ///< batches next() returned
  /// Batches in pinned memory now: being produced, waiting for their device buffer, or their copy not completed.
  std::size_t batches_in_flight = 0;
  std::size_t max_batches_in_flight = 0;  ///< the most seen when a producer thread took a buffer
  std::size_t pinned_buffers = 0;         ///< pinned buffers the prefetcher holds (never more than the bound)
  std::size_t pinned_bytes = 0;           ///< their size in bytes, as requested from the pinned pool
  /// Time next() blocked for a batch not yet produced and enqueued: the consumer waited for the producer.
  std::chrono::nanoseconds consumer_wait{0};
  /// Time producer threads waited for a pinned buffer, all those allowed being in flight: mostly because their
  /// copies had not completed (the device was behind).
  std::chrono::nanoseconds producer_wait_for_pinned{0};
  /// Time producer threads waited, with a batch ready in pinned memory, for the consumer to release the device
  /// buffer it goes to: the consumer was behind.
  std::chrono::nanoseconds producer_wait_for_release{0};

  /// One line, e.g. "batches 64 (in flight 2, max 4), pinned 16.0 MiB in 4 buffers, consumer waited 12.1 ms,
  /// producer waited 3.0 ms for pinned memory and 40.2 ms for releases".
  std::string to_string() const;
};

/// A double/triple-buffered loader (see the file comment). Not copyable or movable; next() is called from one thread.
template <class T>
class prefetcher {
  static_assert(std::is_trivially_copyable<T>::value, "gpukit::prefetcher<T>: T must be trivially copyable");

 public:
  /// Writes batch `index` into `out` (at most out.size() elements) and returns the number written; 0 ends the data.
  /// Runs on a producer thread.
  using producer = std::function<std::size_t(std::size_t index, gpukit::span<T> out)>;

 private:
  using clock = std::chrono::steady_clock;
  static constexpr std::size_t no_end = std::numeric_limits<std::size_t>::max();

  /// A device buffer in the rotation. Its flags are guarded by state::mutex.
  struct slot {
    slot(device d, std::size_t capacity, stream_view copy_stream, stream_view consumer, std::size_t first)
        : dev(capacity, copy_stream), copied(d), consumed(d), expected(first) {
      dev.record_stream(consumer);  // freed only after the consumer's work on it
    }
    device_buffer<T> dev;
    event copied;                    // the copy of the current batch into dev (on the copy stream)
    event consumed;                  // the consumer released the previous batch in dev (on the consumer stream)
    bool consumed_deferred = false;  // released while the consumer's stream could not be named: the producer records
    std::size_t expected;            // the batch this buffer holds next: its predecessor has been released
    bool ready = false;              // holds batch `index`, not yet handed out
    bool held = false;               // handed out, not yet released
    std::size_t count = 0;
    std::size_t index = 0;
  };

  /// A pinned buffer a batch is produced into. Free when not busy and its last copy has completed.
  struct staging_buffer {
    staging_buffer(std::size_t capacity, pinned_pool& pool, device d, stream_view copy_stream)
        : host(capacity, pool), copied(d) {
      host.record_stream(copy_stream);  // back to the pool only after the copies from it
    }
    pooled_pinned_buffer<T> host;
    event copied;  // the latest copy from host (on the copy stream); never recorded = free
    bool busy = true;
  };

  struct state {
    state(stream_view consumer_stream, std::size_t capacity_, producer produce_, const prefetch_options& options)
        : consumer(consumer_stream.resolved()),  // a default stream of this device, from any thread
          dev(consumer_stream.device()),
          copy_stream(dev),
          capacity(capacity_),
          produce(std::move(produce_)),
          max_buffers(options.prefetch_factor == 0 ? no_end : options.prefetch_factor * options.producer_threads) {
      slots.reserve(options.depth);
      if (max_buffers <= 1024) buffers.reserve(max_buffers);  // then the list never grows
      for (std::size_t i = 0; i < options.depth; ++i) {
        slots.push_back(std::make_unique<slot>(dev, capacity, copy_stream.view(), consumer, i));
      }
    }
    stream_view consumer;  // resolved: a default stream is the constructing thread's, of `dev`, wherever it is used
    device dev;
    stream copy_stream;  // declared before the buffers: destroyed after them, so their blocks are freed on it
    std::size_t capacity;
    producer produce;
    std::size_t max_buffers;                                       // pinned buffers at most (no_end: unbounded)
    pinned_pool* pool = std::addressof(default_pinned_pool(dev));  // `&` would need the pool's class instantiated
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<std::unique_ptr<slot>> slots;
    std::vector<std::unique_ptr<staging_buffer>> buffers;  // null while a producer thread allocates it (or failed to)
    std::size_t failed_places = 0;                         // null places whose allocation failed
    std::size_t next_to_claim = 0;                         // the next index a producer thread takes
    std::size_t next_to_hand = 0;                          // the index of the next batch next() returns
    std::size_t end = no_end;    // the first index that is not a batch (the producer returned 0 or failed)
    std::exception_ptr failure;  // why batch `end` failed, if it did
    std::size_t held = 0;
    bool taking = false;  // a next() is waiting for its batch or enqueueing the wait for its copy
    bool stopping = false;
    std::vector<std::thread::id> producer_ids;  // filled by the threads before they call the producer
    prefetch_stats stats;
  };

 public:
  /// A batch on loan to the consumer: its device memory and index. Releasing it (or destroying it) lets the
  /// prefetcher reuse the buffer for a later batch once the consumer stream's work enqueued so far has completed.
  class batch {
   public:
    /// Takes over `other`'s loan; `other` then holds nothing.
    batch(batch&& other) noexcept : state_(std::move(other.state_)), slot_(std::exchange(other.slot_, nullptr)) {}
    /// Releases this batch, then takes over `other`'s loan; `other` then holds nothing.
    batch& operator=(batch&& other) noexcept {
      if (this != &other) {
        release();
        state_ = std::move(other.state_);
        slot_ = std::exchange(other.slot_, nullptr);
      }
      return *this;
    }
    batch(const batch&) = delete;
    batch& operator=(const batch&) = delete;
    ~batch() { release(); }

    /// What index() says of a batch that holds nothing (moved from or released).
    static constexpr std::size_t no_index = std::numeric_limits<std::size_t>::max();

    /// True until the batch is released or moved from.
    bool held() const noexcept { return slot_ != nullptr; }
    /// The batch in device memory (host memory on the CPU device); valid until release. Empty once released or moved
    /// from.
    device_span<T> data() const noexcept {
      if (slot_ == nullptr) return {};
      return {slot_->dev.data(), slot_->count, state_->dev};
    }
    /// Elements in the batch, at most the prefetcher's batch_capacity(); 0 once released or moved from.
    std::size_t size() const noexcept { return slot_ == nullptr ? 0 : slot_->count; }
    /// The batch's index: 0, 1, 2, ... in order; no_index once released or moved from.
    std::size_t index() const noexcept { return slot_ == nullptr ? no_index : slot_->index; }

    /// Gives the buffer back: the copy stream will wait for the consumer's work enqueued so far before refilling
    /// it, from any thread (a per-thread default consumer stream is the constructing thread's). Recording that event
    /// is a CUDA call. Where the event goes to the legacy default stream (a legacy or another thread's per-thread
    /// consumer) while a capture of a blocking stream is underway (gpukit's, or a raw one), or where that record
    /// fails, the producer records it before it refills this buffer, once no capture is in the way; another consumer
    /// whose record fails is waited for on the host. Failures are reported through gpukit::warn.
    void release() noexcept {
      if (slot_ == nullptr) return;
      const stream_view& consumer = state_->consumer;
      bool deferred = false;
      bool via_legacy = true;  // where it cannot be told: no host wait then, which could end a capture
      try {
        via_legacy = detail::may_use_legacy_stream(consumer);
        const detail::capture_hold hold(via_legacy);  // until the event is recorded
        if (detail::capture_status(consumer) != cudaStreamCaptureStatusNone) {
          // An event recorded in a capture would pull the copy stream into it (and its waits would fail).
          warn(
              "gpukit::prefetcher: a batch was released while its consumer stream is being captured into a CUDA "
              "graph; its buffer may be refilled before the captured work runs");
        } else if (hold.refuses_or_raw_captured(consumer)) {
          // Recording on the legacy default stream now would break a capture of a blocking stream (a raw one too,
          // which no hold keeps off): the producer records before it refills this buffer, once no capture is in the
          // way (a later record orders at least as much).
          deferred = true;
        } else {
          detail::record_from_any_thread(slot_->consumed, consumer);
        }
      } catch (const std::exception& e) {
        // Without the event the copy stream would not wait, and the next copy could overwrite what the consumer reads.
        if (via_legacy) {
          // A capture begun since the question, or a failure the producer's record will meet and report. No host
          // wait: another thread's per-thread stream is reached only through the device, whose wait would end any
          // capture on it.
          deferred = true;
          if (!detail::capture_in_sight(consumer.device())) {
            detail::warn_parts("gpukit::prefetcher: releasing a batch failed (", e.what(),
                               "); the producer records it before refilling the buffer");
          }
        } else {
          detail::warn_parts("gpukit::prefetcher: releasing a batch failed (", e.what(),
                             "); waiting for the consumer's work on the host");
          try {
            consumer.synchronize();
          } catch (const std::exception& again) {
            detail::warn_parts("gpukit::prefetcher: waiting for the consumer failed too: ", again.what());
          }
        }
      }
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        slot_->consumed_deferred = deferred;
        slot_->held = false;
        slot_->expected = slot_->index + state_->slots.size();
        --state_->held;
      }
      state_->cv.notify_all();
      slot_ = nullptr;
      state_.reset();
    }

   private:
    friend class prefetcher;
    batch(std::shared_ptr<state> st, slot* sl) noexcept : state_(std::move(st)), slot_(sl) {}
    std::shared_ptr<state> state_;
    slot* slot_ = nullptr;
  };

  /// Starts producing at once: batches of up to `batch_capacity` elements for work on `consumer` (whose device
  /// they are copied to). A per-thread default stream (cudaStreamPerThread) means the constructing thread's: batches
  /// taken or released on other threads are ordered with it through the legacy default stream. Allocates options.depth
  /// device buffers; pinned buffers come from default_pinned_pool(consumer's device) as the producers need them. Throws
  /// invalid_argument_error for a depth below 2, no producer thread, a zero capacity or an empty producer.
  prefetcher(stream_view consumer, std::size_t batch_capacity, producer produce, prefetch_options options = {}) {
    if (options.depth < 2) throw invalid_argument_error("gpukit::prefetcher: depth must be at least 2");
    if (options.producer_threads == 0) {
      throw invalid_argument_error("gpukit::prefetcher: producer_threads must be at least 1");
    }
    if (options.prefetch_factor > no_end / options.producer_threads) {
      throw invalid_argument_error("gpukit::prefetcher: prefetch_factor " + std::to_string(options.prefetch_factor) +
                                   " × producer_threads " + std::to_string(options.producer_threads) +
                                   " overflows; use 0 for no bound");
    }
    if (batch_capacity == 0) throw invalid_argument_error("gpukit::prefetcher: the batch capacity must be positive");
    if (!produce) throw invalid_argument_error("gpukit::prefetcher: the producer is empty");
    (void)detail::checked_bytes(batch_capacity, sizeof(T), "gpukit::prefetcher");
    state_ = std::make_shared<state>(consumer, batch_capacity, std::move(produce), options);
    state_->producer_ids.reserve(options.producer_threads);
    workers_.reserve(options.producer_threads);
    try {
      for (std::size_t i = 0; i < options.producer_threads; ++i) {
        workers_.emplace_back([st = state_] { run(*st); });
      }
    } catch (...) {
      stop();
      throw;
    }
  }

  /// As above, for work on the calling thread's current stream of `d` (current_stream(d): the default stream unless
  /// a stream_guard says otherwise), taken now. That stream must outlive the prefetcher and its batches, as a passed
  /// one must.
  prefetcher(gpukit::device d, std::size_t batch_capacity, producer produce, prefetch_options options = {})
      : prefetcher(current_stream(d), batch_capacity, std::move(produce), options) {}

  prefetcher(const prefetcher&) = delete;
  prefetcher& operator=(const prefetcher&) = delete;

  /// Stops the producers (after the callbacks in progress, if any, return) and joins their threads. Batches still
  /// held stay valid until released; their consumer stream must outlive them too (releasing one records an event on
  /// it: a destroyed stream's handle may already be another stream's).
  ~prefetcher() { stop(); }

  /// The next batch in index order, or nullopt at the end of the data. Blocks the host only until the batch has
  /// been produced and its copy enqueued; the consumer stream waits for the copy on the device. Rethrows the
  /// producer's exception at the point where it happened. Throws invalid_argument_error if batch index − depth,
  /// whose buffer the next batch needs, is still held, and if called from the producer callback (it would wait for
  /// the batch that very callback is producing): unless the producer catches it, that error ends the data and the
  /// consumer's next() rethrows it, like any producer exception. Throws invalid_argument_error, taking nothing,
  /// while the consumer stream is being captured into a CUDA graph. While a gpukit capture, or a raw capture of a
  /// blocking stream of the device, is underway, a consumer this thread can order only through the legacy default
  /// stream (that stream, or the constructing thread's per-thread one from another thread) would break the capture:
  /// the copy is then waited for on the host. Throws invalid_argument_error, taking nothing, when the batch's buffer
  /// was released during a capture and is not refilled yet, inside this thread's gpukit::capture, or for such a
  /// consumer while a raw capture of a blocking stream is underway (on any thread: gpukit cannot tell whose): it is
  /// refilled only once the captures end, so the wait might never end (a gpukit capture in another thread that waits
  /// for this one cannot be seen: do not take batches there).
  /// Batches go to one consumer at a time: a call while another thread's is underway throws invalid_argument_error,
  /// taking nothing. If the consumer's wait for the copy cannot be enqueued (a CUDA error, thrown as cuda_error),
  /// nothing is taken either: the next call hands out the same batch.
  std::optional<batch> next() {
    state& st = *state_;
    if (detail::capture_status(st.consumer) != cudaStreamCaptureStatusNone) {
      throw invalid_argument_error(
          "gpukit::prefetcher::next: the consumer stream is being captured into a CUDA graph; "
          "batches arrive at run time, so take them outside the capture");
    }
    std::unique_lock<std::mutex> lock(st.mutex);
    if (std::find(st.producer_ids.begin(), st.producer_ids.end(), std::this_thread::get_id()) !=
        st.producer_ids.end()) {
      throw invalid_argument_error(
          "gpukit::prefetcher::next: called from the producer callback, on one of the prefetcher's own threads; it "
          "would wait forever for the batch being produced (batch " +
          std::to_string(st.next_to_hand) + ")");
    }
    if (st.taking) {
      // Both calls would wait for the same index, and the one that does not get it would wait until the end.
      throw invalid_argument_error(
          "gpukit::prefetcher::next: called while another thread's next() is underway (batch " +
          std::to_string(st.next_to_hand) + "); batches go to one consumer at a time, in index order");
    }
    const std::size_t index = st.next_to_hand;
    const std::size_t depth = st.slots.size();
    slot& sl = *st.slots[index % depth];
    if (sl.held) {
      throw invalid_argument_error("gpukit::prefetcher::next: batch " + std::to_string(index) +
                                   " needs the buffer of batch " + std::to_string(index - depth) +
                                   ", which is still held (depth " + std::to_string(depth) + "); release it first");
    }
    const auto arrived = [&] { return (sl.ready && sl.index == index) || st.end <= index; };
    if (!arrived() && sl.consumed_deferred && mode_independent::gpukit_captures_on_this_thread() != 0) {
      // The producer refills the buffer once the captures end (batch::release), and this thread's cannot end while
      // it waits here.
      throw invalid_argument_error("gpukit::prefetcher::next: batch " + std::to_string(index) +
                                   " goes into the buffer of batch " + std::to_string(index - depth) +
                                   ", released during a CUDA graph capture, which is refilled only once the "
                                   "captures end; this thread is capturing (gpukit::capture): take it after the "
                                   "capture");
    }
    const bool via_legacy = detail::may_use_legacy_stream(st.consumer);
    if (!arrived() && sl.consumed_deferred && via_legacy && detail::legacy_stream_captured(st.consumer.device())) {
      // A capture of a blocking stream begun with the raw runtime keeps the producer from recording the release, and
      // it may be this thread's, which cannot end while it waits here: refused rather than a wait that may not end.
      throw invalid_argument_error("gpukit::prefetcher::next: batch " + std::to_string(index) +
                                   " goes into the buffer of batch " + std::to_string(index - depth) +
                                   ", whose release is recorded on the legacy default stream only once no capture "
                                   "of a blocking stream of " +
                                   st.consumer.device().to_string() +
                                   " is underway, and one is (begun with the raw runtime): take it after the capture");
    }
    if (!arrived()) {
      st.taking = true;  // until the wait ends: no lock is held meanwhile
      const auto start = clock::now();
      st.cv.wait(lock, arrived);
      st.stats.consumer_wait += clock::now() - start;
      st.taking = false;
    }
    if (!(sl.ready && sl.index == index)) {
      if (st.failure) std::rethrow_exception(st.failure);
      return std::nullopt;
    }
    // The batch stays ready (the producer leaves a ready buffer alone) until the consumer's wait for its copy is
    // enqueued: if that fails, the next call hands out the same batch instead of skipping it.
    st.taking = true;
    lock.unlock();
    try {
      const detail::capture_hold hold(via_legacy);  // until the wait is enqueued
      if (hold.refuses_or_raw_captured(st.consumer)) {
        sl.copied.synchronize();  // a wait enqueued on the legacy stream would join (and break) the capture
      } else {
        detail::wait_from_any_thread(sl.copied, st.consumer);  // device-side: the consumer's later work runs after it
      }
    } catch (...) {
      lock.lock();
      st.taking = false;
      throw;
    }
    lock.lock();
    st.taking = false;
    sl.ready = false;
    sl.held = true;
    ++st.held;
    ++st.next_to_hand;
    ++st.stats.batches_handed_out;
    lock.unlock();
    batch b(state_, &sl);
    return std::optional<batch>(std::move(b));
  }

  /// The waits, batches in flight and pinned memory so far (a consistent copy). Queries the events of the copies
  /// from pinned memory, so a CUDA error may throw.
  prefetch_stats stats() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    prefetch_stats result = state_->stats;
    result.batches_in_flight = in_flight(*state_);
    return result;
  }

  /// The stream the copies run on.
  stream_view copy_stream() const { return state_->copy_stream.view(); }
  /// The stream the batches are for (whose work waits for each batch's copy).
  stream_view consumer_stream() const noexcept { return state_->consumer; }
  /// Device buffers in the rotation (prefetch_options::depth).
  std::size_t depth() const noexcept { return state_->slots.size(); }
  /// The most elements a batch holds: the size of each buffer, in elements.
  std::size_t batch_capacity() const noexcept { return state_->capacity; }

 private:
  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
    }
    state_->cv.notify_all();
    for (std::thread& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  /// One producer thread: claims the next index, produces it into a free pinned buffer, waits for the device buffer
  /// the batch goes to, and enqueues the copy; until the data ends, a failure, or stop().
  static void run(state& st) {
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.producer_ids.push_back(std::this_thread::get_id());
    }
    // A new thread's current device is cuda:0, without a context: work on the consumer's device, whose context the
    // constructor's allocations created, so this thread's CUDA calls never create cuda:0's.
    try {
      set_current_device(st.dev);
    } catch (...) {
      std::lock_guard<std::mutex> lock(st.mutex);
      end_at(st, st.next_to_claim, std::current_exception());
      return;
    }
    for (;;) {
      std::size_t index = 0;
      staging_buffer* buffer = nullptr;
      try {
        if (!claim(st, index, buffer)) return;
      } catch (...) {  // an event query or a pinned allocation failed: the data ends at the index not claimed
        std::lock_guard<std::mutex> lock(st.mutex);
        end_at(st, st.next_to_claim, std::current_exception());
        return;
      }
      if (!produce_and_copy(st, index, *buffer)) return;
    }
  }

  /// Takes the next index and a free pinned buffer for it (false: stop). Waits while every buffer allowed is busy.
  static bool claim(state& st, std::size_t& index, staging_buffer*& buffer) {
    std::unique_lock<std::mutex> lock(st.mutex);
    std::optional<clock::time_point> waiting_since;
    auto backoff = std::chrono::microseconds(20);
    std::size_t in_use = 0;
    for (;;) {
      if (st.stopping || st.next_to_claim >= st.end) break;
      buffer = free_buffer(st, in_use);
      if (buffer != nullptr || st.buffers.size() < st.max_buffers) break;
      if (!waiting_since) waiting_since = clock::now();
      // A copy's completion is seen by querying its event; stop() and the end of the data notify at once.
      st.cv.wait_for(lock, backoff);
      backoff = std::min<std::chrono::microseconds>(backoff * 2, std::chrono::milliseconds(1));
    }
    if (waiting_since) st.stats.producer_wait_for_pinned += clock::now() - *waiting_since;
    if (st.stopping || st.next_to_claim >= st.end) return false;
    if (buffer != nullptr) {
      index = st.next_to_claim++;
      st.stats.max_batches_in_flight = std::max(st.stats.max_batches_in_flight, in_use + 1);
      buffer->busy = true;
      return true;
    }
    // A new buffer, in a place reserved for it before the index is taken (growing the list may throw: then no index
    // is lost). It is allocated without the lock: pinning may take milliseconds, and cudaFreeHost in the pool waits
    // for the device.
    const std::size_t place = st.buffers.size();
    st.buffers.emplace_back();
    index = st.next_to_claim++;
    st.stats.max_batches_in_flight = std::max(st.stats.max_batches_in_flight, in_use + 1);
    lock.unlock();
    std::unique_ptr<staging_buffer> made;
    try {
      made = std::make_unique<staging_buffer>(st.capacity, *st.pool, st.dev, st.copy_stream.view());
    } catch (...) {
      lock.lock();
      ++st.failed_places;  // stays empty (other threads may be filling later places); the data ends here anyway
      end_at(st, index, std::current_exception());
      return false;
    }
    buffer = made.get();
    lock.lock();
    st.buffers[place] = std::move(made);
    ++st.stats.pinned_buffers;
    st.stats.pinned_bytes += st.capacity * sizeof(T);
    if (st.stopping || st.end <= index) {  // stopped, or the data ended, while the buffer was being pinned
      buffer->busy = false;
      return false;
    }
    return true;
  }

  /// A pinned buffer not being produced into whose last copy has completed, or null; `in_use` counts the others.
  static staging_buffer* free_buffer(state& st, std::size_t& in_use) {
    staging_buffer* found = nullptr;
    in_use = 0;
    for (auto& b : st.buffers) {
      if (!b || b->busy || !b->copied.ready()) {
        ++in_use;
      } else if (found == nullptr) {
        found = b.get();
      }
    }
    return found;
  }

  /// Buffers being produced into, waiting for their device buffer, or being copied from.
  static std::size_t in_flight(state& st) {
    std::size_t in_use = 0;
    (void)free_buffer(st, in_use);
    return in_use - st.failed_places;
  }

  /// Produces batch `index` into `buffer`, waits for its device buffer and enqueues the copy (false: stop).
  static bool produce_and_copy(state& st, std::size_t index, staging_buffer& buffer) {
    slot& sl = *st.slots[index % st.slots.size()];
    bool copy_enqueued = false;
    bool record_consumed = false;
    try {
      const std::size_t count = st.produce(index, buffer.host.span());
      if (count > st.capacity) {
        throw invalid_argument_error("gpukit::prefetcher: the producer wrote " + std::to_string(count) +
                                     " elements into a batch of " + std::to_string(st.capacity));
      }
      // For a deferred release's event, on the legacy stream. Not an std::optional: GCC 13 at -O3 warns
      // (maybe-uninitialized) through its engaged flag.
      detail::capture_hold hold(false);
      {
        std::unique_lock<std::mutex> lock(st.mutex);
        if (count == 0) {
          buffer.busy = false;
          end_at(st, index, nullptr);
          return false;
        }
        ++st.stats.batches_produced;
        // The device buffer's previous batch (index − depth) must have been handed out and released.
        const auto can_copy = [&] { return st.stopping || st.end <= index || sl.expected == index; };
        if (!can_copy()) {
          const auto start = clock::now();
          st.cv.wait(lock, can_copy);
          st.stats.producer_wait_for_release += clock::now() - start;
        }
        if (sl.consumed_deferred) {
          // The previous batch was released during a capture, when its event could not be recorded (batch::release):
          // record it now, once no capture is in the way; the consumer's work enqueued since is ordered too.
          // The deferral stays set until the record is made: a next() for this buffer meanwhile must still see
          // that its refill waits for a capture (it refuses rather than waits, the capture may be its thread's).
          wait_until_recordable(st, index, lock, hold);
          record_consumed = true;
        }
        if (st.stopping || st.end <= index) {  // stopped, or an earlier batch ended the data
          buffer.busy = false;
          return false;
        }
      }
      int unexplained = 0;  // refusals with no capture in sight when asked
      while (record_consumed) {
        try {
          detail::record_from_any_thread(sl.consumed, st.consumer);
          break;
        } catch (const std::exception&) {
          // A raw capture of a blocking stream begun since the look (no hold keeps those off): wait for it to end,
          // rather than end the data for a refusal that lasts only as long as that capture. Once more even when none
          // is in sight: it may have ended before the question; a second such failure is not a capture's.
          if (!detail::may_use_legacy_stream(st.consumer) ||
              (!detail::capture_in_sight(st.consumer.device()) && ++unexplained > 1)) {
            throw;
          }
        }
        std::unique_lock<std::mutex> lock(st.mutex);
        wait_until_recordable(st, index, lock, hold);
        if (st.stopping || st.end <= index) {
          buffer.busy = false;
          return false;
        }
      }
      if (record_consumed) {
        std::lock_guard<std::mutex> lock(st.mutex);
        sl.consumed_deferred = false;
      }
      hold.release();
      sl.consumed.wait(st.copy_stream.view());  // the consumer is done with the device buffer's last batch
      copy_async(device_span<T>(sl.dev.data(), count, st.dev), pinned_span<const T>(buffer.host.data(), count),
                 st.copy_stream.view());
      copy_enqueued = true;
      buffer.copied.record(st.copy_stream.view());
      sl.copied.record(st.copy_stream.view());
      {
        std::lock_guard<std::mutex> lock(st.mutex);
        buffer.busy = false;  // free again once `copied` completes
        sl.count = count;
        sl.index = index;
        sl.ready = true;
      }
      st.cv.notify_all();
      return true;
    } catch (...) {
      std::lock_guard<std::mutex> lock(st.mutex);
      // After the copy, an event record failed: the buffer may still be read, so it stays busy (never reused).
      if (!copy_enqueued) buffer.busy = false;
      end_at(st, index, std::current_exception());
      return false;
    }
  }

  /// For a deferred release's event (`st.mutex` held by `lock`): waits until an event on the consumer can be recorded
  /// without breaking a capture, or until the prefetcher stops or the data ends before `index`. Where the event goes
  /// to the legacy default stream, that is when no gpukit capture is underway (`hold`, held from here until the event
  /// is recorded, keeps new ones off) and no capture of a blocking stream of its device (a raw one) is.
  static void wait_until_recordable(state& st, std::size_t index, std::unique_lock<std::mutex>& lock,
                                    detail::capture_hold& hold) {
    const auto start = clock::now();
    auto backoff = std::chrono::microseconds(20);
    const bool needed = detail::may_use_legacy_stream(st.consumer);
    hold.retake(needed);
    while (!st.stopping && index < st.end && hold.refuses_or_raw_captured(st.consumer)) {
      hold.release();  // never held while waiting: a capture waits for the holds
      st.cv.wait_for(lock, backoff);
      backoff = std::min<std::chrono::microseconds>(backoff * 2, std::chrono::milliseconds(1));
      hold.retake(needed);
    }
    st.stats.producer_wait_for_release += clock::now() - start;
  }

  /// The data ends before `index` (called with the lock held): a producer returned 0 there, or failed. The earliest
  /// end wins; batches from it on are dropped.
  static void end_at(state& st, std::size_t index, std::exception_ptr failure) {
    if (index < st.end) {
      st.end = index;
      st.failure = std::move(failure);
    }
    st.cv.notify_all();
  }

  std::shared_ptr<state> state_;
  std::vector<std::thread> workers_;
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE std::string prefetch_stats::to_string() const {
  const auto ms = [](std::chrono::nanoseconds d) { return static_cast<double>(d.count()) / 1e6; };
  char line[320];
  std::snprintf(line, sizeof line,
                "batches %zu (in flight %zu, max %zu), pinned %.1f MiB in %zu buffers, consumer waited %.1f ms, "
                "producer waited %.1f ms for pinned memory and %.1f ms for releases",
                batches_handed_out, batches_in_flight, max_batches_in_flight,
                static_cast<double>(pinned_bytes) / (1024.0 * 1024.0), pinned_buffers, ms(consumer_wait),
                ms(producer_wait_for_pinned), ms(producer_wait_for_release));
  return line;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
