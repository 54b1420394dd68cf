// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// prefetcher<T>: a double- or triple-buffered loader. A user callback produces batch N+1 into pinned memory on a
/// background thread and its copy to the device runs on a copy stream, while the consumer stream still works on
/// batch N. Each batch is handed to the consumer stream with the right dependencies, none of them a host wait:
///
/// - the consumer stream waits (on the device) for the batch's copy before the work enqueued after next();
/// - releasing a batch records an event on the consumer stream; the copy stream waits for it before it overwrites
///   that device buffer with a later batch;
/// - each batch is produced into a block of the pinned pool, freed stream-ordered after its copy, so the producer
///   never waits for a stream (a consumer stream held back by the host cannot deadlock the loader; blocks pile up
///   in the pool instead, cached after warm-up).
///
///     gpukit::prefetcher<float> loader(s, batch_elements, [&](std::size_t index, gpukit::span<float> out) {
///       return read_batch(index, out);           // elements written; 0 ends the data
///     });
///     while (auto batch = loader.next()) {
///       train_step(batch->data(), s);            // work enqueued on s sees the batch
///     }                                          // the batch is released here: its buffer may be refilled
///
/// With `depth` device buffers, batches are prepared while earlier ones are in use: batch N uses buffer N % depth,
/// so it can be prepared once batch N − depth has been released. next() throws instead of deadlocking when that
/// batch is still held. Batches come in index order. An exception thrown by the callback is rethrown by next() once
/// the batches before it have been handed out. The callback must not call next() on its own prefetcher: that call
/// throws invalid_argument_error (it would wait for itself), which reaches the consumer the same way. Works unchanged
/// on the CPU device.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/copy.hpp>
#include <gpukit/transfer/spans.hpp>

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
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
};

/// A double/triple-buffered loader (see the file comment). Not copyable or movable; next() is called from one thread.
template <class T>
class prefetcher {
  static_assert(std::is_trivially_copyable<T>::value, "gpukit::prefetcher<T>: T must be trivially copyable");

 public:
  /// Writes batch `index` into `out` (at most out.size() elements) and returns the number written; 0 ends the data.
  /// Runs on the prefetcher's thread.
  using producer = std::function<std::size_t(std::size_t index, gpukit::span<T> out)>;

 private:
  struct slot {
    slot(device d, std::size_t capacity, stream_view copy_stream, stream_view consumer)
        : dev(capacity, copy_stream), copied(d), consumed(d) {
      dev.record_stream(consumer);  // freed only after the consumer's work on it
    }
    device_buffer<T> dev;
    event copied;    // the copy of the current batch into dev (on the copy stream)
    event consumed;  // the consumer released the previous batch in dev (on the consumer stream)
    bool ready = false;    // holds a produced batch not yet handed out
    bool held = false;     // handed out, not yet released
    std::size_t count = 0;
    std::size_t index = 0;
  };

  struct state {
    state(stream_view consumer_stream, std::size_t capacity_, producer produce_, std::size_t depth)
        : consumer(consumer_stream),
          dev(consumer_stream.device()),
          copy_stream(dev),
          capacity(capacity_),
          produce(std::move(produce_)) {
      slots.reserve(depth);
      for (std::size_t i = 0; i < depth; ++i) {
        slots.push_back(std::make_unique<slot>(dev, capacity, copy_stream.view(), consumer));
      }
    }
    stream_view consumer;
    device dev;
    stream copy_stream;  // declared before the slots: destroyed after them, so their blocks are freed on it
    std::size_t capacity;
    producer produce;
    pinned_pool* pool = &default_pinned_pool(dev);
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<std::unique_ptr<slot>> slots;
    std::size_t next_to_hand = 0;  // index of the next batch next() returns
    std::size_t produced = 0;      // batches produced so far
    std::size_t held = 0;
    bool finished = false;  // the producer returned 0 (or failed) after `produced` batches
    bool stopping = false;
    std::exception_ptr failure;
    std::thread::id producer_thread;  // set by the worker before it calls the producer
  };

 public:
  /// A batch on loan to the consumer: its device memory and index. Releasing it (or destroying it) lets the
  /// prefetcher reuse the buffer for a later batch once the consumer stream's work enqueued so far has completed.
  class batch {
   public:
    batch(batch&& other) noexcept
        : state_(std::move(other.state_)), slot_(std::exchange(other.slot_, nullptr)) {}
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

    /// The batch in device memory (host memory on the CPU device); valid until release.
    device_span<T> data() const noexcept { return {slot_->dev.data(), slot_->count, state_->dev}; }
    std::size_t size() const noexcept { return slot_->count; }
    /// The batch's index: 0, 1, 2, ... in order.
    std::size_t index() const noexcept { return slot_->index; }

    /// Gives the buffer back: the copy stream will wait for the consumer's work enqueued so far before refilling
    /// it. Recording that event is a CUDA call; failures are reported through gpukit::warn.
    void release() noexcept {
      if (slot_ == nullptr) return;
      try {
        slot_->consumed.record(state_->consumer);
      } catch (const std::exception& e) {
        warn(std::string("gpukit::prefetcher: releasing a batch failed: ") + e.what());
      }
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        slot_->held = false;
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
  /// they are copied to). Allocates options.depth device buffers; pinned blocks come from
  /// default_pinned_pool(consumer's device). Throws invalid_argument_error for a depth below 2, a zero capacity or
  /// an empty producer.
  prefetcher(stream_view consumer, std::size_t batch_capacity, producer produce, prefetch_options options = {}) {
    if (options.depth < 2) throw invalid_argument_error("gpukit::prefetcher: depth must be at least 2");
    if (batch_capacity == 0) throw invalid_argument_error("gpukit::prefetcher: the batch capacity must be positive");
    if (!produce) throw invalid_argument_error("gpukit::prefetcher: the producer is empty");
    state_ = std::make_shared<state>(consumer, batch_capacity, std::move(produce), options.depth);
    worker_ = std::thread([st = state_] { run(*st); });
  }

  prefetcher(const prefetcher&) = delete;
  prefetcher& operator=(const prefetcher&) = delete;

  /// Stops the producer (after the callback in progress, if any, returns) and joins its thread. Batches still held
  /// stay valid until released.
  ~prefetcher() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
    }
    state_->cv.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  /// The next batch in index order, or nullopt at the end of the data. Blocks the host only until the batch has
  /// been produced and its copy enqueued; the consumer stream waits for the copy on the device. Rethrows the
  /// producer's exception at the point where it happened. Throws invalid_argument_error if batch index − depth,
  /// whose buffer the next batch needs, is still held, and if called from the producer callback (it would wait for
  /// the batch that very callback is producing): unless the producer catches it, that error ends the data and the
  /// consumer's next() rethrows it, like any producer exception.
  std::optional<batch> next() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (std::this_thread::get_id() == state_->producer_thread) {
      throw invalid_argument_error(
          "gpukit::prefetcher::next: called from the producer callback, on the prefetcher's own thread; it would wait "
          "forever for the batch being produced (batch " + std::to_string(state_->produced) + ")");
    }
    const std::size_t index = state_->next_to_hand;
    const std::size_t depth = state_->slots.size();
    slot& sl = *state_->slots[index % depth];
    if (sl.held) {
      throw invalid_argument_error("gpukit::prefetcher::next: batch " + std::to_string(index) +
                                   " needs the buffer of batch " + std::to_string(index - depth) +
                                   ", which is still held (depth " + std::to_string(depth) + "); release it first");
    }
    state_->cv.wait(lock, [&] {
      return (sl.ready && sl.index == index) || (state_->finished && state_->produced <= index);
    });
    if (!(sl.ready && sl.index == index)) {
      if (state_->failure) std::rethrow_exception(state_->failure);
      return std::nullopt;
    }
    sl.ready = false;
    sl.held = true;
    ++state_->held;
    ++state_->next_to_hand;
    lock.unlock();
    state_->cv.notify_all();
    batch b(state_, &sl);
    sl.copied.wait(state_->consumer);  // device-side: the consumer's later work runs after the copy
    return std::optional<batch>(std::move(b));
  }

  /// The stream the copies run on.
  stream_view copy_stream() const { return state_->copy_stream.view(); }
  std::size_t depth() const noexcept { return state_->slots.size(); }
  std::size_t batch_capacity() const noexcept { return state_->capacity; }

 private:
  static void run(state& st) {
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.producer_thread = std::this_thread::get_id();
    }
    // A new thread's current device is cuda:0, without a context: work on the consumer's device, whose context the
    // constructor's allocations created, so this thread's CUDA calls never create cuda:0's.
    try {
      set_current_device(st.dev);
    } catch (...) {
      finish(st, std::current_exception());
      return;
    }
    for (std::size_t index = 0;; ++index) {
      slot& sl = *st.slots[index % st.slots.size()];
      {
        std::unique_lock<std::mutex> lock(st.mutex);
        // The slot's previous batch must have been handed out and released.
        st.cv.wait(lock, [&] { return st.stopping || (!sl.ready && !sl.held); });
        if (st.stopping) return;
      }
      try {
        pooled_pinned_buffer<T> host(st.capacity, *st.pool);  // cached after warm-up; never waits for a stream
        const std::size_t count = st.produce(index, host.span());
        if (count > st.capacity) {
          throw invalid_argument_error("gpukit::prefetcher: the producer wrote " + std::to_string(count) +
                                       " elements into a batch of " + std::to_string(st.capacity));
        }
        if (count == 0) {
          finish(st, nullptr);
          return;
        }
        sl.consumed.wait(st.copy_stream.view());  // the consumer is done with the device buffer's last batch
        copy_async(device_span<T>(sl.dev.data(), count, st.dev), pinned_span<const T>(host.data(), count),
                   st.copy_stream.view());
        sl.copied.record(st.copy_stream.view());
        host.record_stream(st.copy_stream.view());  // back to the pool once the copy has completed
        {
          std::lock_guard<std::mutex> lock(st.mutex);
          sl.count = count;
          sl.index = index;
          sl.ready = true;
          st.produced = index + 1;
        }
        st.cv.notify_all();
      } catch (...) {
        finish(st, std::current_exception());
        return;
      }
    }
  }

  static void finish(state& st, std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      st.finished = true;
      st.failure = std::move(failure);
    }
    st.cv.notify_all();
  }

  std::shared_ptr<state> state_;
  std::thread worker_;
};

GPUKIT_END_NAMESPACE
