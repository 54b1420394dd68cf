// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The member functions of basic_staging_engine (staging.hpp), defined out of the class so that the compiled mode can
/// leave them out. staging.hpp includes this file header-only. In the compiled mode (GPUKIT_SEPARATE_COMPILATION) it
/// does not: translation units call the instantiation gpukit::compiled holds, and include this file only to instantiate
/// basic_staging_engine with template arguments of their own.

#include <gpukit/transfer/staging.hpp>

GPUKIT_BEGIN_NAMESPACE

template <class Copier>
GPUKIT_INLINE basic_staging_engine<Copier>::basic_staging_engine(pinned_pool& pool, staging_options options,
                                                                 Copier copier)
    : pool_(&pool), options_(options), copier_(std::move(copier)) {
  if (options_.chunk_bytes == 0 || options_.slots == 0 || options_.download_slots == 0) {
    throw invalid_argument_error(
        "gpukit::staging_engine: chunk_bytes, slots and download_slots must be positive (got " +
        std::to_string(options_.chunk_bytes) + ", " + std::to_string(options_.slots) + " and " +
        std::to_string(options_.download_slots) + ")");
  }
  if (options_.min_chunk_bytes == 0 || options_.min_chunk_bytes > options_.chunk_bytes) {
    options_.min_chunk_bytes = options_.chunk_bytes;
  }
  if (options_.bytes_per_thread == 0) options_.bytes_per_thread = 1;
  if (options_.threads == 0) {
    const unsigned hardware = std::thread::hardware_concurrency();
    options_.threads = std::max(1u, std::min(8u, hardware));
  }
  if (options_.max_rings == 0) options_.max_rings = 1;
}

template <class Copier>
GPUKIT_INLINE basic_staging_engine<Copier>::~basic_staging_engine() {
  for (auto& r : rings_) {
    finish_background(*r);
    std::lock_guard<std::mutex> up(r->up.mutex);
    std::lock_guard<std::mutex> down(r->down.mutex);
    drain_and_free_locked(*r);
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::to_device(void* dst, const void* src, std::size_t bytes,
                                                           stream_view s) {
  if (bytes == 0) return;
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("staging_engine::to_device");
  detail::refuse_capture(s, s.device(), "gpukit::staging_engine::to_device", detail::capture_advice_staging);
  const detail::defer_pinned_cap no_release_here;  // cudaFreeHost would wait for `s`, which may wait for this thread
  lane_lease lease = acquire_for(s, &ring::up, "to_device", bytes);
  ring& r = *lease.r;
  lane& ln = r.up;
  const std::size_t chunk = chunk_for(bytes);
  std::chrono::steady_clock::duration waited{};
  std::chrono::steady_clock::duration copying{};
  std::uint64_t waits = 0;
  std::uint64_t chunks = 0;
  std::size_t offset = 0;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  // A transfer that fails part-way counts what it did (chunks went through slots) before its error goes on.
  auto count_work = [&]() noexcept {
    try {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      stats_.chunks += chunks;
      stats_.slot_waits += waits;
      stats_.wait_time += std::chrono::duration_cast<std::chrono::nanoseconds>(waited);
      stats_.host_copy_time += std::chrono::duration_cast<std::chrono::nanoseconds>(copying);
    } catch (...) {  // a mutex that cannot be locked: the counts are lost, not the transfer's error
    }
  };
  if (!background_idle(r)) {
    // Behind the rest of an earlier transfer: the data lands in call order.
    try {
      hand_over(r, s, out, in, bytes, chunk, true);
    } catch (const std::bad_alloc& e) {
      throw detail::staging_bad_alloc(e.what(), "to_device", r.dev, 0, bytes, bytes, 0,
                                      detail::staging_bad_alloc::part::rest);
    }
  } else {
    dispose_orphans(r);
    while (offset < bytes) {
      const std::size_t length = std::min(chunk, bytes - offset);
      slot& sl = ln.slots[ln.next];
      bool copy_enqueued = false;
      try {
        if (sl.used && !sl.done.ready()) {
          ++waits;
          // Each wait gets the whole patience: only a slot that stays busy that long means the stream is held (a
          // deadline for the call would hand over any long transfer whose DMAs are merely slower than the host).
          const auto start = std::chrono::steady_clock::now();
          const bool freed = wait_until(sl.done, start + options_.patience);
          waited += std::chrono::steady_clock::now() - start;
          if (!freed) break;
        }
        grow_idle_slot(sl, chunk);
        const auto copy_start = std::chrono::steady_clock::now();
        parallel_copy(sl.ptr, in + offset, length, threads_for(length), options_.streaming_stores);
        copying += std::chrono::steady_clock::now() - copy_start;
        copier_(out + offset, sl.ptr, length, copy_direction::host_to_device, s);
        copy_enqueued = true;
        record_done(sl, s);
      } catch (const error& e) {
        count_work();
        detail::throw_chunk_failure(e, "to_device", r.dev, offset, length, bytes,
                                    offset + (copy_enqueued ? length : 0));
      } catch (const std::bad_alloc& e) {
        count_work();
        throw detail::staging_bad_alloc(e.what(), "to_device", r.dev, offset, length, bytes,
                                        offset + (copy_enqueued ? length : 0));
      }
      ln.next = (ln.next + 1) % ln.slots.size();
      offset += length;
      ++chunks;
    }
    if (offset < bytes) {
      try {
        hand_over(r, s, out + offset, in + offset, bytes - offset, chunk, false);
      } catch (const error& e) {  // the first `offset` bytes are enqueued: said, as for a chunk's failure
        count_work();
        detail::throw_chunk_failure(e, "to_device", r.dev, offset, bytes - offset, bytes, offset,
                                    detail::staging_bad_alloc::part::rest);
      } catch (const std::bad_alloc& e) {
        count_work();
        throw detail::staging_bad_alloc(e.what(), "to_device", r.dev, offset, bytes - offset, bytes, offset,
                                        detail::staging_bad_alloc::part::rest);
      }
    }
  }
  count_work();
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ++stats_.to_device_calls;
  stats_.bytes += bytes;
  if (offset < bytes) {
    ++stats_.overflows;
    stats_.overflow_bytes += bytes - offset;
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::to_host(void* dst, const void* src, std::size_t bytes, stream_view s) {
  if (bytes == 0) return;
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("staging_engine::to_host");
  detail::refuse_capture(s, s.device(), "gpukit::staging_engine::to_host", detail::capture_advice_staging);
  const detail::defer_pinned_cap no_release_here;  // cudaFreeHost would wait for `s`, which may wait for this thread
  lane_lease lease = acquire_for(s, &ring::down, "to_host", bytes);
  lane& ln = lease.r->down;
  const std::size_t chunk = chunk_for(bytes);
  const std::size_t count = (bytes + chunk - 1) / chunk;
  const std::size_t depth = ln.slots.size();
  const std::size_t first = ln.next;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  std::size_t staged = 0;  // chunks whose copies were enqueued
  // Chunk k goes through slot (first + k) % depth; the DMAs of up to `depth` chunks run ahead of the host copies.
  // A slot's previous use was this stream's DMA into it and this thread's copy out of it, so stream order suffices.
  auto enqueue = [&](std::size_t k) {
    slot& sl = ln.slots[(first + k) % depth];
    const std::size_t offset = k * chunk;
    grow_slot_stream_ordered(sl, chunk, s);
    copier_(sl.ptr, in + offset, std::min(chunk, bytes - offset), copy_direction::device_to_host, s);
    record_done(sl, s);
    ++staged;
  };
  // A transfer that fails part-way counts the chunks whose copies it enqueued (they went through slots).
  auto count_chunks = [&]() noexcept {
    try {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      stats_.chunks += staged;
    } catch (...) {  // a mutex that cannot be locked: the count is lost, not the transfer's error
    }
  };
  std::size_t enqueued = 0;
  std::size_t written = 0;  // bytes of the destination copied out of the slots
  std::size_t failing = 0;  // the chunk being enqueued or copied out, for an error's message
  try {
    for (; enqueued < std::min(depth, count); ++enqueued) enqueue(failing = enqueued);
    for (std::size_t k = 0; k < count; ++k) {
      slot& sl = ln.slots[(first + k) % depth];
      const std::size_t offset = k * chunk;
      const std::size_t length = std::min(chunk, bytes - offset);
      failing = k;
      sl.done.synchronize();
      parallel_copy(out + offset, sl.ptr, length, threads_for(length));
      written += length;
      if (enqueued < count) enqueue(failing = enqueued++);
    }
  } catch (const error& e) {
    count_chunks();
    const std::size_t offset = failing * chunk;
    detail::throw_chunk_failure(e, "to_host", lease.r->dev, offset, std::min(chunk, bytes - offset), bytes, written);
  } catch (const std::bad_alloc& e) {
    count_chunks();
    const std::size_t offset = failing * chunk;
    throw detail::staging_bad_alloc(e.what(), "to_host", lease.r->dev, offset, std::min(chunk, bytes - offset), bytes,
                                    written);
  }
  ln.next = (first + count) % depth;
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ++stats_.to_host_calls;
  stats_.chunks += staged;
  stats_.bytes += bytes;
}

template <class Copier>
GPUKIT_INLINE std::size_t basic_staging_engine<Copier>::release_idle() {
  std::vector<std::shared_ptr<ring>> idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle.reserve(rings_.size());  // first: a ring retired must leave the list (acquire would find it for ever)
    for (std::size_t i = 0; i < rings_.size();) {
      if (try_retire_locked(*rings_[i])) {
        idle.push_back(std::move(rings_[i]));
        rings_.erase(rings_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  std::size_t released = 0;
  for (const auto& r : idle) released += give_back_retired(r) ? 1 : 0;  // unlocked: see try_retire_locked
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.rings_released += released;
  return released;
}

template <class Copier>
GPUKIT_INLINE std::size_t basic_staging_engine<Copier>::chunk_for(std::size_t bytes) const noexcept {
  if (bytes <= options_.min_chunk_bytes) return std::min(bytes, options_.chunk_bytes);
  constexpr std::size_t granule = 64 * 1024;
  std::size_t chunk = (bytes + options_.slots - 1) / options_.slots;
  chunk = (chunk + granule - 1) / granule * granule;
  return std::min(options_.chunk_bytes, std::max(options_.min_chunk_bytes, chunk));
}

template <class Copier>
GPUKIT_INLINE std::size_t basic_staging_engine<Copier>::max_pinned_bytes_per_stream() const {
  return (options_.slots + options_.download_slots) *
         pinned_size_class(options_.chunk_bytes, pool_->options().classes_per_doubling);
}

template <class Copier>
GPUKIT_INLINE staging_stats basic_staging_engine<Copier>::stats() const {
  staging_stats copy;
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    copy = stats_;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  copy.rings = rings_.size();
  return copy;
}

template <class Copier>
GPUKIT_INLINE const staging_options& basic_staging_engine<Copier>::options() const noexcept {
  return options_;
}

template <class Copier>
GPUKIT_INLINE Copier& basic_staging_engine<Copier>::copier() noexcept {
  return copier_;
}

template <class Copier>
GPUKIT_INLINE pinned_pool& basic_staging_engine<Copier>::pool() noexcept {
  return *pool_;
}

template <class Copier>
GPUKIT_INLINE unsigned basic_staging_engine<Copier>::threads_for(std::size_t length) const noexcept {
  const std::size_t by_size = std::max<std::size_t>(1, length / options_.bytes_per_thread);
  return static_cast<unsigned>(std::min<std::size_t>(options_.threads, by_size));
}

template <class Copier>
GPUKIT_INLINE auto basic_staging_engine<Copier>::key_of(stream_view s, device d) -> stream_key {
  if (d.is_cpu()) return stream_key{d, 0, s.cpu_queue()};
  return stream_key{d, s.id(), nullptr};  // cudaStreamGetId: a destroyed stream's handle may be another's now
}

template <class Copier>
GPUKIT_INLINE auto basic_staging_engine<Copier>::acquire(stream_view s, lane ring::*which) -> lane_lease {
  const stream_key key = key_of(s, s.device());
  for (;;) {
    std::shared_ptr<ring> r;
    std::size_t retired = 0;
    std::vector<std::shared_ptr<ring>> released;  // given back once mutex_ is let go
    bool created = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& candidate : rings_) {
        if (candidate->key == key) {
          r = candidate;
          break;
        }
      }
      if (!r) {
        // Made first: running out of memory here must not follow the release of other rings.
        auto fresh = std::make_shared<ring>(key, options_.slots, options_.download_slots);
        if (rings_.size() >= options_.max_rings) {
          released.reserve(rings_.size());
          std::vector<std::shared_ptr<ring>> by_age(rings_);
          std::sort(by_age.begin(), by_age.end(), [](const std::shared_ptr<ring>& a, const std::shared_ptr<ring>& b) {
            return a->last_used < b->last_used;
          });
          for (auto& candidate : by_age) {
            if (rings_.size() - retired < options_.max_rings) break;
            if (try_retire_locked(*candidate)) {
              ++retired;
              released.push_back(candidate);  // capacity reserved above
            }
          }
          rings_.erase(
              std::remove_if(rings_.begin(), rings_.end(), [](const std::shared_ptr<ring>& x) { return x->retired; }),
              rings_.end());
        }
        rings_.push_back(fresh);  // no allocation when rings were released; else nothing changed yet
        r = std::move(fresh);
        created = true;
      }
      r->last_used = ++tick_;
    }
    for (const auto& x : released) retired -= give_back_retired(x) ? 0 : 1;
    if (created || retired != 0) {
      std::lock_guard<std::mutex> lock(stats_mutex_);
      stats_.rings_created += created ? 1 : 0;
      stats_.rings_released += retired;
    }
    std::unique_lock<std::mutex> lane_lock(((*r).*which).mutex);
    if (r->retired) continue;  // released between the lookup and the lock: look again
    return lane_lease{std::move(r), std::move(lane_lock)};
  }
}

template <class Copier>
GPUKIT_INLINE auto basic_staging_engine<Copier>::acquire_for(stream_view s, lane ring::*which,
                                                             std::string_view operation, std::size_t bytes)
    -> lane_lease {
  const gpukit::device d = s.device();  // before: asked in the handler, a failure would replace the std::bad_alloc
  try {
    return acquire(s, which);
  } catch (const std::bad_alloc& e) {  // making the stream's ring: nothing is enqueued yet
    throw detail::staging_bad_alloc(e.what(), operation, d, 0, 0, bytes, 0, detail::staging_bad_alloc::part::setup);
  }
}

template <class Copier>
GPUKIT_INLINE bool basic_staging_engine<Copier>::try_retire_locked(ring& r) {
  std::unique_lock<std::mutex> up(r.up.mutex, std::try_to_lock);
  if (!up.owns_lock()) return false;
  std::unique_lock<std::mutex> down(r.down.mutex, std::try_to_lock);
  if (!down.owns_lock()) return false;
  {
    std::lock_guard<std::mutex> jobs(r.jobs_mutex);
    if (r.background_owns_up) return false;
  }
  try {
    for (lane* ln : {&r.up, &r.down}) {
      for (auto& sl : ln->slots) {
        if (sl.used && !sl.done.ready()) return false;
      }
    }
    // Its blocks go back in give_back_retired, after mutex_: over the pool's cap, cudaFreeHost waits for all the
    // device's work, and every transfer would wait for mutex_ meanwhile.
    r.retired = true;
    return true;
  } catch (...) {
    return false;  // a failing event query: keep the ring
  }
}

template <class Copier>
GPUKIT_INLINE bool basic_staging_engine<Copier>::give_back_retired(const std::shared_ptr<ring>& r) noexcept {
  // Uncontended: a caller that finds the ring retired looks again.
  std::lock_guard<std::mutex> up(r->up.mutex);
  std::lock_guard<std::mutex> down(r->down.mutex);
  dispose_orphans(*r);
  bool kept = !r->orphans.empty();
  for (lane* ln : {&r->up, &r->down}) {
    for (auto& sl : ln->slots) {
      try {
        give_slot_block_back(sl, nullptr);  // idle: seen at the retirement
      } catch (...) {
        kept = kept || sl.ptr != nullptr;  // refused (out of host memory): still the slot's; else lost
      }
    }
  }
  if (!kept) {
    r->side.reset();
    return true;
  }
  // The pool refused some blocks: the ring keeps them and is listed again, for a later release or the destruction.
  try {
    std::lock_guard<std::mutex> lock(mutex_);  // after the lanes: no one waits for a lane while holding mutex_
    rings_.push_back(r);
    r->retired = false;
    return false;
  } catch (...) {
  }
  // Not even that: as at the engine's destruction, without waiting (this may run inside a transfer).
  bool copies_done = false;
  try {
    copies_done = !r->side || r->side->view().ready();
  } catch (...) {
  }
  for (void* p : r->orphans) give_back_at_teardown(p, copies_done);
  r->orphans.clear();
  for (lane* ln : {&r->up, &r->down}) {
    for (auto& sl : ln->slots) {
      if (sl.ptr != nullptr) give_back_at_teardown(sl.ptr, true);
      sl.forget_block();
    }
  }
  r->side.reset();
  return true;
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::drain_and_free_locked(ring& r) noexcept {
  dispose_orphans(r);
  if (!r.orphans.empty()) {
    // Refused by the pool (out of host memory): once the side stream's copies from them are done, they go back
    // without an event.
    bool copies_done = false;
    try {
      if (r.side) r.side->synchronize();
      copies_done = true;
    } catch (const error& e) {
      copies_done = detail::is_teardown_result(e.cuda_result());
    } catch (...) {
    }
    for (void* p : r.orphans) give_back_at_teardown(p, copies_done);
    r.orphans.clear();
  }
  for (lane* ln : {&r.up, &r.down}) {
    for (auto& sl : ln->slots) {
      bool idle = true;
      try {
        if (sl.used) sl.done.synchronize();
      } catch (const error& e) {
        idle = detail::is_teardown_result(e.cuda_result());  // at process exit the device's work went with it
      } catch (...) {
        idle = false;
      }
      if (sl.ptr != nullptr) give_back_at_teardown(sl.ptr, idle);
      sl.forget_block();
    }
  }
  r.side.reset();
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::give_back_at_teardown(void* p, bool idle) noexcept {
  if (idle) {
    try {
      pool_->deallocate(p);
      return;
    } catch (...) {
    }
  }
  if (pool_->is_allocated(p)) {
    warn(idle ? "gpukit::staging_engine: destroyed with a staging block the pinned pool refused to take back (out of "
                "host memory); it stays allocated, unused, until the pool is destroyed"
              : "gpukit::staging_engine: destroyed with a staging block whose copies could not be waited for; it "
                "stays allocated, unused, until the pool is destroyed");
  }
}

template <class Copier>
GPUKIT_INLINE bool basic_staging_engine<Copier>::wait_until(const event& e,
                                                            std::chrono::steady_clock::time_point deadline) {
  return poll_until([&] { return e.ready(); }, deadline);
}

template <class Copier>
template <class Ready>
GPUKIT_INLINE bool basic_staging_engine<Copier>::poll_until(Ready&& ready,
                                                            std::chrono::steady_clock::time_point deadline) {
  for (int spin = 0;; ++spin) {
    if (ready()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return ready();
    if (spin < 64) {
      std::this_thread::yield();
    } else {
      const auto left = deadline - now;
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, std::chrono::microseconds(50)));
    }
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::poll_until_ready(const event& e) {
  for (unsigned spin = 0; !e.ready(); spin = std::min(spin + 1, 4096u)) {
    if (spin < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 2048 ? 50 : 500));
    }
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::give_slot_block_back(slot& sl, const stream_view* s) {
  if (sl.ptr == nullptr) return;
  try {
    if (s != nullptr) {
      pool_->deallocate(sl.ptr, *s);
    } else {
      pool_->deallocate(sl.ptr);
    }
  } catch (...) {
    // Refused, the block is still the slot's; lost (no event could be recorded), it is gone.
    if (!pool_->is_allocated(sl.ptr)) sl.forget_block();
    throw;
  }
  sl.forget_block();
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::grow_idle_slot(slot& sl, std::size_t bytes) {
  if (sl.capacity >= bytes) return;
  give_slot_block_back(sl, nullptr);
  sl.ptr = pool_->allocate(bytes);
  sl.capacity = pool_->block_size(sl.ptr);  // its size class: a later, slightly larger chunk may fit
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::grow_slot_stream_ordered(slot& sl, std::size_t bytes, stream_view s) {
  if (sl.capacity >= bytes) return;
  give_slot_block_back(sl, sl.used ? &s : nullptr);
  sl.ptr = pool_->allocate(bytes);
  sl.capacity = pool_->block_size(sl.ptr);  // its size class, as above
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::record_done(slot& sl, stream_view s) {
  try {
    sl.done.record(s);
    sl.used = true;
  } catch (...) {
    abandon_slot(sl, s);
    throw;
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::abandon_slot(slot& sl, stream_view s) noexcept {
  try {
    give_slot_block_back(sl, &s);
    return;
  } catch (...) {
  }
  if (sl.ptr == nullptr) return;  // lost: the pool keeps it out of use
  // Refused (out of host memory): the block is still the slot's, idle once `s` has finished with it. That is polled
  // for at most the patience (the stream may wait for this very thread), never on a captured stream.
  const auto report = [&](const char* why) noexcept {
    detail::warn_parts("gpukit::staging_engine: a staging block of ", detail::bytes_part{sl.capacity, false},
                       " could be neither given back to the pinned pool (out of host memory) nor waited for (", why,
                       "); it stays allocated, unused, until the pool is destroyed");
  };
  try {
    if (detail::capture_status(s) != cudaStreamCaptureStatusNone) {
      report("its stream is being captured");
    } else if (poll_until([&] { return s.ready(); }, std::chrono::steady_clock::now() + options_.patience)) {
      sl.used = false;
      return;
    } else {
      report("its stream did not finish within the patience");
    }
  } catch (const std::exception& e) {  // reported inside the handler: e.what() dies with it
    report(e.what());
  } catch (...) {
    report("an unknown exception");
  }
  sl.forget_block();
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::grow_upload_slots(ring& r, stream_view s, std::size_t bytes) {
  dispose_orphans(r);
  for (slot& sl : r.up.slots) {
    if (sl.capacity >= bytes) continue;
    if (sl.ptr != nullptr) {
      if (sl.used && !sl.done.ready()) sl.done.wait(s);
      give_slot_block_back(sl, &s);
    }
    sl.ptr = pool_->allocate(bytes);
    sl.capacity = pool_->block_size(sl.ptr);  // its size class, as above
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::dispose_orphans(ring& r) noexcept {
  std::size_t kept = 0;  // blocks the pool refused (out of host memory): given back at a later call
  for (void* p : r.orphans) {
    try {
      pool_->deallocate(p, r.side->view());
      continue;
    } catch (...) {
    }
    if (pool_->is_allocated(p)) r.orphans[kept++] = p;  // else lost: the pool keeps it out of use
  }
  r.orphans.resize(kept);
}

template <class Copier>
GPUKIT_INLINE bool basic_staging_engine<Copier>::background_idle(ring& r) {
  std::lock_guard<std::mutex> lock(r.jobs_mutex);
  return !r.background_owns_up;
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::hand_over(ring& r, stream_view s, char* dst, const char* src,
                                                           std::size_t bytes, std::size_t chunk, bool behind_earlier) {
  // Every pool call happens here, before the host function exists: the background thread makes none. A busy
  // background thread owns the slots; it stages this transfer through them at the size they have.
  if (background_idle(r)) grow_upload_slots(r, s, chunk);
  auto j = std::make_shared<job>(r.dev, dst, bytes, chunk, behind_earlier);
  parallel_copy(j->data.get(), src, bytes, threads_for(bytes));
  if (!r.side) r.side = std::make_unique<stream>(r.dev);
  j->after.record(s);
  s.enqueue_host([done = j->done] { done->wait(); });
  // The stream now waits for the job: it must run, or be marked done.
  try {
    start_background(r, j);
  } catch (...) {
    j->done->set();
    throw;
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::start_background(ring& r, std::shared_ptr<job> j) {
  std::unique_lock<std::mutex> lock(r.jobs_mutex);
  r.jobs.push_back(std::move(j));
  if (r.background_owns_up) return;  // the running thread takes it
  r.background_owns_up = true;
  lock.unlock();
  try {
    // Detached: once it has given the lane back it touches neither the ring nor the engine, which may then go.
    std::thread([this, &r] { run_background(r); }).detach();
  } catch (...) {
    lock.lock();
    r.jobs.pop_back();
    r.background_owns_up = false;
    r.jobs_changed.notify_all();
    throw;
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::run_background(ring& r) noexcept {
  try {
    if (r.dev.is_cuda()) set_current_device(r.dev);  // so that device guards in this thread change nothing
  } catch (...) {
    // The copies below report their own failures.
  }
  for (bool last = false; !last;) {
    std::shared_ptr<job> j;
    {
      std::lock_guard<std::mutex> lock(r.jobs_mutex);
      j = r.jobs.front();  // never empty here: the thread starts with a job and ends when none is left
    }
    stage_in_background(r, *j);
    {
      std::lock_guard<std::mutex> lock(r.jobs_mutex);
      r.jobs.pop_front();
      if (r.jobs.empty()) {
        r.background_owns_up = false;
        r.jobs_changed.notify_all();
        last = true;
      }
    }
    j->done->set();  // from here on the ring and the engine may be gone: touch only the job
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::stage_in_background(ring& r, job& j) noexcept {
  lane& ln = r.up;
  std::uint64_t chunks = 0;
  std::exception_ptr failure;  // copying it cannot throw, unlike a message (this is noexcept)
  try {
    const stream_view side = r.side->view();
    j.after.wait(side);  // after the stream's work before the hand-over
    for (std::size_t offset = 0, empty = 0; offset < j.bytes;) {
      slot& sl = ln.slots[ln.next];
      if (sl.capacity == 0) {  // orphaned by an earlier failure: only a caller may give it a block again
        ln.next = (ln.next + 1) % ln.slots.size();
        if (++empty == ln.slots.size()) {
          throw error(errc::cuda, "every upload slot lost its block to an earlier failure");
        }
        continue;
      }
      empty = 0;
      if (sl.used) poll_until_ready(sl.done);
      const std::size_t length = std::min({j.chunk, sl.capacity, j.bytes - offset});
      parallel_copy(sl.ptr, j.data.get() + offset, length, threads_for(length), options_.streaming_stores);
      copier_(j.dst + offset, sl.ptr, length, copy_direction::host_to_device, side);
      record_done_in_background(r, sl, side);
      ln.next = (ln.next + 1) % ln.slots.size();
      offset += length;
      ++chunks;
    }
  } catch (...) {
    failure = std::current_exception();
  }
  try {
    // The stream's later work goes on once the copies enqueued so far have completed.
    j.after.record(r.side->view());
    poll_until_ready(j.after);
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  j.data.reset();
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.chunks += chunks;
    if (failure) ++stats_.background_failures;
  }
  if (!failure) return;
  detail::with_message_of(failure, [&](const char* reason) noexcept {
    detail::warn_parts("gpukit::staging_engine: staging ", j.why(), " (", detail::bytes_part{j.bytes, true}, " to ",
                       r.dev, ") failed after ", chunks, " chunk(s): ", reason, "; the destination is incomplete");
  });
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::record_done_in_background(ring& r, slot& sl, stream_view side) {
  try {
    sl.done.record(side);
    sl.used = true;
  } catch (...) {
    r.orphans.push_back(std::exchange(sl.ptr, nullptr));
    sl.capacity = 0;
    sl.used = false;
    throw;
  }
}

template <class Copier>
GPUKIT_INLINE void basic_staging_engine<Copier>::finish_background(ring& r) noexcept {
  try {
    std::unique_lock<std::mutex> lock(r.jobs_mutex);
    r.jobs_changed.wait(lock, [&r] { return !r.background_owns_up; });
  } catch (...) {
  }
}

#if GPUKIT_DETAIL_EXTERN_TEMPLATES  // compiled once into gpukit::compiled (see detail/config.hpp)
extern template class basic_staging_engine<device_copier>;
#endif

GPUKIT_END_NAMESPACE
