// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The member functions of basic_pinned_pool (pinned_pool.hpp), defined out of the class so that the compiled mode can
/// leave them out. pinned_pool.hpp includes this file header-only. In the compiled mode (GPUKIT_SEPARATE_COMPILATION)
/// it does not: translation units call the instantiation gpukit::compiled holds, and include this file only to
/// instantiate basic_pinned_pool with template arguments of their own.

#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/memory/pinned_pool.hpp>

GPUKIT_BEGIN_NAMESPACE

template <class Upstream, class Sync>
GPUKIT_INLINE basic_pinned_pool<Upstream, Sync>::basic_pinned_pool(Upstream upstream, pinned_pool_options options,
                                                                   Sync sync)
    : upstream_(std::move(upstream)), sync_(std::move(sync)), options_(options) {
  const std::size_t c = options_.classes_per_doubling;
  if (!detail::is_power_of_two(c)) {
    throw invalid_argument_error("gpukit::pinned_pool: classes_per_doubling must be a power of two, not " +
                                 std::to_string(c));
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE basic_pinned_pool<Upstream, Sync>::~basic_pinned_pool() {
  if (!deferred_.empty()) (void)process_deferred_locked();  // no other thread may use a pool being destroyed
  report_deferred_losses();
  std::size_t allocated = 0;
  std::size_t lost = 0;
  std::size_t waiting = 0;  // freed during a capture still underway
  std::size_t leaked_bytes = 0;
  for (auto& entry : blocks_) {
    block& b = entry.second;
    if (b.state == block_state::active || b.state == block_state::lost || b.state == block_state::deferred) {
      allocated += b.state == block_state::active ? 1 : 0;
      lost += b.state == block_state::lost ? 1 : 0;
      waiting += b.state == block_state::deferred ? 1 : 0;
      leaked_bytes += b.size;
      continue;
    }
    for (auto& m : b.markers) {
      try {
        sync_.wait(m);
      } catch (...) {
        // The stream failed; the memory is released anyway, as CUDA would on context teardown.
      }
      sync_.recycle(std::move(m));
    }
    for (const auto& f : b.finals) {
      try {
        f->wait_finished();
      } catch (...) {
        // As above.
      }
    }
    upstream_.deallocate(entry.first, b.size);
  }
  if (const std::size_t leaked = allocated + lost + waiting; leaked != 0) {
    detail::warn_parts("gpukit::pinned_pool destroyed with ", leaked, " block(s) (", detail::bytes_part{leaked_bytes},
                       ") it does not free: ", allocated, " still allocated, ", lost,
                       " lost (freed, but no event could be recorded for them), ", waiting,
                       " freed but waiting for a capture");
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void* basic_pinned_pool<Upstream, Sync>::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t size = pinned_size_class(bytes, options_.classes_per_doubling);
  if (size == std::numeric_limits<std::size_t>::max()) {
    throw out_of_memory_error("gpukit::pinned_pool: a request of " + std::to_string(bytes) +
                              " bytes cannot be rounded to a size class");
  }
  void* hit = nullptr;
  {
    release_list releases(*this);  // declared first: releases after the lock is dropped
    std::lock_guard<std::mutex> lock(mutex_);
    process_pending_locked(releases.blocks);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      hit = it->second.back();
      it->second.pop_back();
      block& b = blocks_.at(hit);
      b.state = block_state::active;
      b.requested = bytes;
      b.streams.clear();
      b.lives.clear();
      --free_count_;
      ++stats_.cache_hits;
      on_activate_locked(b);
    }
  }
  if (hit != nullptr) return hit;
  // The block's map entry is made and room for it reserved before pinning: once pinned, nothing may fail, since
  // unpinning (cudaFreeHost) waits for the device, which may wait for this thread (staging: defer_pinned_cap).
  typename decltype(blocks_)::node_type node;
  {
    decltype(blocks_) one;
    one.emplace(nullptr, block{});
    node = one.extract(one.begin());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.reserve(blocks_.size() + pinnings_in_flight_ + 1);  // covers every pinning underway, this one included
    ++pinnings_in_flight_;
  }
  void* p = nullptr;
  try {
    p = upstream_allocate_with_retry(size, bytes);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);  // if it throws, the reserve stays larger than needed: harmless
    --pinnings_in_flight_;
    throw;
  }
  node.key() = p;
  block& b = node.mapped();
  b.size = size;
  b.requested = bytes;
  b.state = block_state::active;
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  try {
    lock.lock();
  } catch (...) {  // never seen; not unpinned where the device must not be waited for: leaked, said
    if (detail::pinned_cap_deferrals_on_this_thread() != 0) {
      detail::warn_parts("gpukit::pinned_pool: the pool's lock failed after pinning ", detail::bytes_part{size},
                         " inside a staging transfer: the block is leaked (cudaFreeHost would wait for the device)");
    } else {
      upstream_.deallocate(p, size);
    }
    throw;
  }
  --pinnings_in_flight_;
  // No allocation: the node exists and the buckets are reserved (no rehash below the reserved count).
  auto inserted = blocks_.insert(std::move(node));
  stats_.reserved_bytes += size;
  if (stats_.reserved_bytes > stats_.reserved_bytes_peak) stats_.reserved_bytes_peak = stats_.reserved_bytes;
  detail::add_to_stat(host_stats_.segment, 1);
  detail::add_to_stat(host_stats_.reserved_bytes, static_cast<std::int64_t>(size));
  on_activate_locked(inserted.position->second);
  return p;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::record_stream(const void* p, stream_view s) {
  refuse_if_captured(s, "record_stream");
  // Bound now (device and id): cudaStreamPerThread, or a view of the current device, means this thread's stream.
  s = s.resolved();
  // An address served over-aligned (pinned_pmr_resource, pinned_memory_resource) lies inside its block, unless a
  // live block of this pool starts there (a stale entry: see aligned_offsets::block_for).
  const void* start =
      detail::over_aligned_addresses().block_for(p, [this](const void* q) noexcept { return is_allocated(q); });
  std::lock_guard<std::mutex> lock(mutex_);
  record_stream_locked(active_block_locked(start, "record_stream"), s);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::deallocate(void* p) {
  deallocate_recorded(p, nullptr, false);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::deallocate_after_captures(void* p) {
  deallocate_recorded(p, nullptr, true);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::deallocate_after_captures(void* p, stream_view s) {
  deallocate_recorded(p, &s, true);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::deallocate(void* p, stream_view s) {
  deallocate_recorded(p, &s, false);
}

template <class Upstream, class Sync>
GPUKIT_INLINE std::size_t basic_pinned_pool<Upstream, Sync>::empty_cache() {
  std::exception_ptr wait_failure;
  try {
    wait_for_streams_without_final_event();
  } catch (const error& e) {  // those blocks stay pending; the free ones are released all the same
    if (!detail::is_teardown_result(e.cuda_result())) wait_failure = std::current_exception();
  } catch (...) {
    wait_failure = std::current_exception();
  }
  return release_cached(wait_failure);
}

template <class Upstream, class Sync>
GPUKIT_INLINE std::size_t basic_pinned_pool<Upstream, Sync>::release_cached(std::exception_ptr failure) {
  release_list releases(*this);  // declared first: releases after the lock is dropped
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      process_pending_locked(releases.blocks);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    for (auto& entry : free_) {
      while (!entry.second.empty()) {
        release_free_block_locked(entry.second, entry.second.size() - 1, releases.blocks);
      }
    }
    if (failure) std::rethrow_exception(failure);
    for (const auto& r : releases.blocks) bytes += r.second;
  }
  return bytes;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::wait_for_streams_without_final_event() {
  if (detail::gpukit_capture_underway() || detail::pinned_cap_deferrals_on_this_thread() != 0) return;
  std::vector<std::shared_ptr<const detail::stream_life>> lives;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (void* p : pending_) {
      for (const auto& life : blocks_.at(p).finals) {
        if (life->final_event() == nullptr && !life->finished() &&
            std::find(lives.begin(), lives.end(), life) == lives.end()) {
          lives.push_back(life);
        }
      }
    }
  }
  for (const auto& life : lives) {
    // Asked again before each: a capture begun since would be invalidated (one begun between this check and the
    // synchronize is not seen, nor one begun with the raw runtime).
    if (detail::gpukit_capture_underway()) return;
    life->wait_finished();
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE pinned_pool_stats basic_pinned_pool<Upstream, Sync>::stats() {
  pinned_pool_stats copy;
  bool released = false;
  {
    release_list releases(*this);  // declared first: releases after the lock is dropped
    std::lock_guard<std::mutex> lock(mutex_);
    process_pending_locked(releases.blocks);
    copy = stats_;
    copy.cached_bytes = stats_.reserved_bytes - stats_.allocated_bytes - lost_bytes_;
    copy.pending_bytes = pending_bytes_;
    copy.active_blocks = active_count_;
    copy.free_blocks = free_count_;
    copy.pending_blocks = pending_.size() + deferred_.size();
    copy.lost_blocks = lost_count_;
    released = !releases.blocks.empty();
  }
  if (released) {  // promoted blocks above the cap went back to the upstream after the copy was taken
    std::lock_guard<std::mutex> lock(mutex_);
    copy.upstream_frees = stats_.upstream_frees;
    copy.unpinning_time = stats_.unpinning_time;
  }
  return copy;
}

template <class Upstream, class Sync>
GPUKIT_INLINE host_allocator_stats basic_pinned_pool<Upstream, Sync>::memory_stats() {
  {
    release_list releases(*this);  // declared first: releases after the lock is dropped
    std::lock_guard<std::mutex> lock(mutex_);
    process_pending_locked(releases.blocks);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  host_allocator_stats copy = host_stats_;
  copy.num_host_alloc = copy.segment.allocated;  // as PyTorch: so the counts and segment always agree
  copy.num_host_free = copy.segment.freed;
  return copy;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.allocated_bytes_peak = stats_.allocated_bytes;
  stats_.reserved_bytes_peak = stats_.reserved_bytes;
  for (stat* s :
       {&host_stats_.allocation, &host_stats_.segment, &host_stats_.allocated_bytes, &host_stats_.reserved_bytes}) {
    s->peak = s->current;
  }
  for (duration_stat* d : {&host_stats_.host_alloc_time, &host_stats_.host_free_time}) {
    d->min = std::chrono::nanoseconds{0};
    d->max = std::chrono::nanoseconds{0};
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (stat* s :
       {&host_stats_.allocation, &host_stats_.segment, &host_stats_.allocated_bytes, &host_stats_.reserved_bytes}) {
    s->allocated = 0;
    s->freed = 0;
  }
  for (duration_stat* d : {&host_stats_.host_alloc_time, &host_stats_.host_free_time}) {
    d->count = 0;
    d->total = std::chrono::nanoseconds{0};
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE std::size_t basic_pinned_pool<Upstream, Sync>::block_size(const void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  return active_block_locked(p, "block_size").size;
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::is_allocated(const void* p) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = blocks_.find(const_cast<void*>(p));
    return it != blocks_.end() && it->second.state == block_state::active;
  } catch (...) {
    return false;  // the lock failed: nothing more can be done with the block
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::set_max_cached_bytes(std::size_t bytes) {
  release_list releases(*this);  // declared first: releases after the lock is dropped
  std::lock_guard<std::mutex> lock(mutex_);
  options_.max_cached_bytes = bytes;
  enforce_cap_locked(releases.blocks);      // the free blocks, whatever the polling below does
  process_pending_locked(releases.blocks);  // trims what it promotes
}

template <class Upstream, class Sync>
GPUKIT_INLINE pinned_pool_options basic_pinned_pool<Upstream, Sync>::options() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_;
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::page_locked() const noexcept {
  if constexpr (detail::has_page_locked<Upstream>::value) {
    return upstream_.page_locked();
  } else {
    return false;
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE Upstream& basic_pinned_pool<Upstream, Sync>::upstream() noexcept {
  return upstream_;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::forget_destroyed_streams_locked(block& b) {
  for (std::size_t i = 0; i < b.streams.size();) {
    if (!b.lives[i] || !b.lives[i]->expired()) {
      ++i;
      continue;
    }
    if (!b.lives[i]->finished()) b.finals.push_back(b.lives[i]);
    b.streams.erase(b.streams.begin() + static_cast<std::ptrdiff_t>(i));
    b.lives.erase(b.lives.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::deallocate_recorded(void* p, const stream_view* caller,
                                                                          bool defer_captured) {
  if (p == nullptr) return;
  stream_view bound;
  const stream_view* also = nullptr;
  if (caller != nullptr) {
    if (!defer_captured) refuse_if_captured(*caller, "deallocate");
    bound = caller->resolved();  // as record_stream binds it
    also = &bound;
  }
  release_list releases(*this);  // declared first: releases after the lock is dropped
  std::lock_guard<std::mutex> lock(mutex_);
  block& b = active_block_locked(p, "deallocate");
  if (!defer_captured) {
    // Before anything changes; a destroyed stream (its handle maybe another's now) captures nothing.
    for (std::size_t i = 0; i < b.streams.size(); ++i) {
      if (also != nullptr && b.streams[i] == *also) continue;  // the caller asked
      if (detail::captured_while_kept(b.streams[i], b.lives[i].get())) {
        detail::throw_captured("gpukit::pinned_pool::deallocate",
                               detail::describe_stream(b.streams[i].native_handle(), b.streams[i].device()),
                               b.streams[i].device(), detail::capture_advice_allocator);
      }
    }
  }
  if (also != nullptr) record_stream_locked(b, *also);
  forget_destroyed_streams_locked(b);
  const detail::capture_hold hold(needs_capture_hold(b));  // until the events are recorded
  if (!can_record_now(b, defer_captured, hold)) {
    if (deferred_.size() == deferred_.capacity()) deferred_.reserve(std::max<std::size_t>(16, 2 * deferred_.size()));
    b.state = block_state::deferred;
    deferred_.push_back(p);  // capacity reserved above
    pending_bytes_ += b.size;
    on_deactivate_locked(b);
  } else if (b.streams.empty() && b.finals.empty()) {
    make_free_locked(p, b);  // strong: the only step that can throw comes first
    on_deactivate_locked(b);
    on_reusable_locked(b);
  } else {
    try {
      make_pending_locked(p, b);
    } catch (const error& e) {
      on_deactivate_locked(b);
      lose_locked(b);
      if (!detail::is_teardown_result(e.cuda_result())) throw;
      return;
    } catch (...) {
      on_deactivate_locked(b);
      lose_locked(b);
      throw;
    }
    pending_bytes_ += b.size;
    on_deactivate_locked(b);
  }
  enforce_cap_locked(releases.blocks);
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::can_record_now(const block& b, bool ask_captures,
                                                                     const detail::capture_hold& hold) {
  for (std::size_t i = 0; i < b.streams.size(); ++i) {
    // A raw capture of a blocking stream counts as a gpukit one: an event recorded on the legacy stream now would
    // invalidate it (cudaErrorStreamCaptureImplicit). The block waits.
    if (hold.refuses_or_raw_captured(b.streams[i])) return false;
    if (ask_captures && detail::captured_while_kept(b.streams[i], b.lives[i].get())) return false;
  }
  return true;
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::needs_capture_hold(const block& b) noexcept {
  return std::any_of(b.streams.begin(), b.streams.end(),
                     [](const stream_view& s) { return detail::may_use_legacy_stream(s); });
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::make_pending_locked(void* p, block& b) {
  if (pending_.size() == pending_.capacity()) pending_.reserve(std::max<std::size_t>(16, 2 * pending_.size()));
  b.markers.reserve(b.markers.size() + b.streams.size());
  b.finals.reserve(b.finals.size() + b.lives.size());
  for (std::size_t i = 0; i < b.streams.size(); ++i) {
    // Kept from destruction by another thread while its handle is used (invalid then, or a new stream's); one at a
    // time, so two threads cannot deadlock. Destroyed meanwhile, its final event covers its work instead.
    const detail::stream_life* life = b.lives[i].get();
    std::unique_lock<std::mutex> alive;
    if (life != nullptr) alive = life->keep_alive();
    if (life != nullptr && life->expired()) {
      b.finals.push_back(b.lives[i]);  // room reserved above
      continue;
    }
    b.markers.push_back(sync_.record(b.streams[i]));
    ++stats_.events_recorded;
  }
  b.streams.clear();
  b.lives.clear();
  b.state = block_state::pending;
  pending_.push_back(p);  // capacity reserved above
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::process_deferred_locked() noexcept {
  bool freed = false;
  std::size_t kept = 0;
  std::size_t i = 0;
  const detail::capture_hold hold(true);  // deferred blocks are rare; most wait for the legacy stream
  for (; i < deferred_.size(); ++i) {
    void* p = deferred_[i];
    block& b = blocks_.at(p);
    try {
      forget_destroyed_streams_locked(b);
      if (!can_record_now(b, true, hold)) {
        deferred_[kept++] = p;
        continue;
      }
      if (b.streams.empty() && b.finals.empty()) {
        make_free_locked(p, b);
        on_reusable_locked(b);
        pending_bytes_ -= b.size;
        freed = true;
      } else {
        make_pending_locked(p, b);  // still counted in pending_bytes_
      }
    } catch (const std::bad_alloc&) {
      break;
    } catch (...) {
      pending_bytes_ -= b.size;
      lose_locked(b);
      ++deferred_losses_;
      deferred_loss_ = std::current_exception();
    }
  }
  for (; i < deferred_.size(); ++i) deferred_[kept++] = deferred_[i];
  deferred_.resize(kept);
  return freed;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::report_deferred_losses() noexcept {
  std::size_t losses = 0;
  std::exception_ptr last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (deferred_losses_ == 0) return;
    losses = std::exchange(deferred_losses_, 0);
    last = std::exchange(deferred_loss_, nullptr);
  }
  detail::with_message_of(last, [&](const char* reason) noexcept {
    detail::warn_parts("gpukit::pinned_pool: ", losses,
                       " block(s) freed while a stream could not take an event are lost (the last because: ", reason,
                       ")");
  });
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::record_stream_locked(block& b, const stream_view& s) {
  for (const auto& known : b.streams) {
    if (known == s) return;  // by id where known: a destroyed stream's handle may be this one's now
  }
  auto life = s.lifetime();
  b.streams.push_back(s);
  try {
    b.lives.push_back(std::move(life));
  } catch (...) {
    b.streams.pop_back();
    throw;
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::refuse_if_captured(stream_view s, const char* who) {
  if (detail::capture_status(s) == cudaStreamCaptureStatusNone) return;
  detail::throw_captured(std::string("gpukit::pinned_pool::") + who,
                         detail::describe_stream(s.native_handle(), s.device()), s.device(),
                         detail::capture_advice_allocator);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::lose_locked(block& b) noexcept {
  on_reusable_locked(b);  // out of the users' hands for good (memory_stats; reserved still counts it)
  b.state = block_state::lost;
  ++lost_count_;
  lost_bytes_ += b.size;
}

template <class Upstream, class Sync>
GPUKIT_INLINE auto basic_pinned_pool<Upstream, Sync>::active_block_locked(const void* p, const char* who) -> block& {
  auto it = blocks_.find(const_cast<void*>(p));
  if (it == blocks_.end() || it->second.state != block_state::active) {
    throw invalid_argument_error(
        std::string("gpukit::pinned_pool::") + who + "(" + detail::format_pointer(p) + "): " +
        (it == blocks_.end()
             ? std::string("not the start of a block of this pool (a foreign or interior pointer)")
             : "its block of " + detail::format_bytes(it->second.size) + " was already deallocated (a double free)"));
  }
  return it->second;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::on_activate_locked(block& b) noexcept {
  stats_.allocated_bytes += b.size;
  stats_.requested_bytes += b.requested;
  ++stats_.allocations;
  ++active_count_;
  if (stats_.allocated_bytes > stats_.allocated_bytes_peak) stats_.allocated_bytes_peak = stats_.allocated_bytes;
  detail::add_to_stat(host_stats_.allocation, 1);
  detail::add_to_stat(host_stats_.allocated_bytes, static_cast<std::int64_t>(b.size));
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::on_deactivate_locked(const block& b) noexcept {
  stats_.allocated_bytes -= b.size;
  stats_.requested_bytes -= b.requested;
  --active_count_;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::on_reusable_locked(const block& b) noexcept {
  detail::add_to_stat(host_stats_.allocation, -1);
  detail::add_to_stat(host_stats_.allocated_bytes, -static_cast<std::int64_t>(b.size));
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::make_free_locked(void* p, block& b) {
  free_[b.size].push_back(p);
  b.state = block_state::free;
  b.freed_at = ++tick_;
  ++free_count_;
}

template <class Upstream, class Sync>
GPUKIT_INLINE bool basic_pinned_pool<Upstream, Sync>::events_completed(const block& b) {
  for (const auto& m : b.markers) {
    if (!sync_.ready(m)) return false;  // may throw (a failed event query)
  }
  for (const auto& f : b.finals) {
    if (!f->finished()) return false;
  }
  return true;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::process_pending_locked(block_list& releases) {
  bool promoted = !deferred_.empty() && process_deferred_locked();
  if (pending_.empty()) {
    if (promoted) enforce_cap_locked(releases);
    return;
  }
  std::size_t kept = 0;
  std::size_t i = 0;
  try {
    for (; i < pending_.size(); ++i) {
      void* p = pending_[i];
      block& b = blocks_.at(p);
      if (!events_completed(b)) {
        pending_[kept++] = p;
        continue;
      }
      make_free_locked(p, b);  // before anything else changes: the block is still pending if it throws
      on_reusable_locked(b);
      for (auto& m : b.markers) sync_.recycle(std::move(m));
      b.markers.clear();
      b.finals.clear();
      pending_bytes_ -= b.size;
      promoted = true;
    }
  } catch (...) {
    for (; i < pending_.size(); ++i) pending_[kept++] = pending_[i];
    pending_.resize(kept);
    if (promoted) enforce_cap_locked(releases);
    throw;
  }
  pending_.resize(kept);
  if (promoted) enforce_cap_locked(releases);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::release_free_block_locked(std::vector<void*>& list,
                                                                                std::size_t index,
                                                                                block_list& releases) {
  void* p = list[index];
  auto it = blocks_.find(p);
  const std::size_t size = it->second.size;
  releases.emplace_back(p, size);
  list.erase(list.begin() + static_cast<std::ptrdiff_t>(index));
  --free_count_;
  blocks_.erase(it);
  stats_.reserved_bytes -= size;
  detail::add_to_stat(host_stats_.segment, -1);
  detail::add_to_stat(host_stats_.reserved_bytes, -static_cast<std::int64_t>(size));
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::enforce_cap_locked(block_list& releases) noexcept {
  if (detail::pinned_cap_deferrals_on_this_thread() != 0) return;  // a later call applies it
  // Free blocks only: pending ones are still in use by their streams' work and cannot go back yet.
  while (stats_.reserved_bytes - stats_.allocated_bytes - lost_bytes_ - pending_bytes_ > options_.max_cached_bytes &&
         free_count_ > 0) {
    std::vector<void*>* oldest_list = nullptr;
    std::size_t oldest_index = 0;
    std::uint64_t oldest_tick = std::numeric_limits<std::uint64_t>::max();
    for (auto& entry : free_) {
      for (std::size_t i = 0; i < entry.second.size(); ++i) {
        const std::uint64_t freed_at = blocks_.find(entry.second[i])->second.freed_at;
        if (freed_at < oldest_tick) {
          oldest_tick = freed_at;
          oldest_list = &entry.second;
          oldest_index = i;
        }
      }
    }
    try {
      release_free_block_locked(*oldest_list, oldest_index, releases);
    } catch (...) {
      return;
    }
    ++stats_.cap_releases;
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::release_all(const block_list& blocks) noexcept {
  if (blocks.empty()) return;
  duration_stat spent;  // each call timed (host_free_time), added to the books under one lock
  auto start = std::chrono::steady_clock::now();
  for (const auto& r : blocks) {
    upstream_.deallocate(r.first, r.second);
    const auto end = std::chrono::steady_clock::now();
    detail::add_to_stat(spent, std::chrono::duration_cast<std::chrono::nanoseconds>(end - start));
    start = end;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.unpinning_time += spent.total;
  stats_.upstream_frees += blocks.size();
  detail::add_to_stat(host_stats_.host_free_time, spent);
}

template <class Upstream, class Sync>
GPUKIT_INLINE void* basic_pinned_pool<Upstream, Sync>::upstream_allocate_timed(std::size_t size) {
  const auto start = std::chrono::steady_clock::now();
  void* p = nullptr;
  try {
    p = upstream_.allocate(size);
  } catch (...) {
    add_pinning_time(std::chrono::steady_clock::now() - start, false);
    throw;
  }
  add_pinning_time(std::chrono::steady_clock::now() - start, p != nullptr);
  if (p == nullptr) {  // the upstream contract's other way to refuse (the caching allocator's upstreams return it)
    throw out_of_memory_error("allocate returned nullptr for " + detail::format_bytes_exact(size));
  }
  return p;
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::add_pinning_time(std::chrono::steady_clock::duration spent,
                                                                       bool succeeded) {
  const auto nanoseconds = std::chrono::duration_cast<std::chrono::nanoseconds>(spent);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.pinning_time += nanoseconds;
  if (succeeded) {
    ++stats_.upstream_allocations;
    detail::add_to_stat(host_stats_.host_alloc_time, nanoseconds);
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void* basic_pinned_pool<Upstream, Sync>::upstream_allocate_with_retry(std::size_t size,
                                                                                    std::size_t requested) {
  // Emptying the cache calls cudaFreeHost, which waits for all the device's work: not on a thread whose calls must
  // not wait (a staging transfer, whose stream may be held until it returns; a deadlock otherwise).
  const bool may_empty = detail::pinned_cap_deferrals_on_this_thread() == 0;
  try {
    return upstream_allocate_timed(size);
  } catch (const out_of_memory_error& e) {
    if (!may_empty) throw_exhausted(size, requested, false, e);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.oom_retries;
    }
    release_cached(nullptr);  // no device synchronize here, unlike empty_cache(): this is an allocation
  }
  try {
    return upstream_allocate_timed(size);
  } catch (const out_of_memory_error& e) {
    throw_exhausted(size, requested, true, e);
  }
}

template <class Upstream, class Sync>
GPUKIT_INLINE void basic_pinned_pool<Upstream, Sync>::throw_exhausted(std::size_t size, std::size_t requested,
                                                                      bool emptied,
                                                                      const out_of_memory_error& upstream) {
  std::size_t allocated = 0;
  std::size_t pending = 0;
  std::size_t cached = 0;
  {
    // The counters as they are: polling events here could replace this error with another.
    std::lock_guard<std::mutex> lock(mutex_);
    allocated = stats_.allocated_bytes;
    pending = pending_bytes_;
    cached = stats_.reserved_bytes - stats_.allocated_bytes - pending_bytes_ - lost_bytes_;
  }
  const std::string cache =
      emptied ? std::string(" even after emptying the cache")
              : "; the cache (" + detail::format_bytes(cached) +
                    ") was not emptied: this call is part of a staging transfer, which must not wait for the device "
                    "(cudaFreeHost waits for all its work, the transfer's stream included), so call empty_cache() "
                    "from a thread that waits for nothing, or lower max_cached_bytes";
  throw out_of_memory_error("gpukit::pinned_pool: cannot allocate " + detail::format_bytes_exact(requested) +
                            " (size class " + detail::format_bytes_exact(size) + ")" + cache + "; " +
                            detail::format_bytes(allocated) + " allocated, " + detail::format_bytes(pending) +
                            " waiting for streams; upstream: " + upstream.what());
}

#if GPUKIT_DETAIL_EXTERN_TEMPLATES  // compiled once into gpukit::compiled (see detail/config.hpp)
extern template class basic_pinned_pool<pinned_upstream, pinned_pool_sync>;
#endif

GPUKIT_END_NAMESPACE
