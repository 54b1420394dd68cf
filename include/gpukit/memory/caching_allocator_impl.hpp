// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The member functions of basic_caching_allocator (caching_allocator.hpp), defined out of the class so that the
/// compiled mode can leave them out. caching_allocator.hpp includes this file header-only. In the compiled mode
/// (GPUKIT_SEPARATE_COMPILATION) it does not: translation units call the instantiation gpukit::compiled holds, and
/// include this file only to instantiate basic_caching_allocator with template arguments of their own.

#include <gpukit/detail/warning_text.hpp>
#include <gpukit/memory/caching_allocator.hpp>

#include <bitset>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Why a device's upstream offers no virtual memory, as the warning and the expandable_segments_required error say.
inline constexpr const char* no_device_virtual_memory =
    ", but the device (or its driver) has no virtual memory management gpukit can use (the driver's entry points, the "
    "device's attribute, or its page granularity refused)";
/// How the errors of expandable_segments_required begin: the device's name follows.
inline constexpr const char* expandable_segments_required_for =
    "gpukit: expandable segments are required for the caching allocator of ";
}  // namespace detail

// The constructor is a member template (upstream arguments): gpukit::compiled instantiates it for no arguments.
template <class Upstream, class StreamOps>
template <class... UpstreamArgs>
GPUKIT_INLINE basic_caching_allocator<Upstream, StreamOps>::basic_caching_allocator(gpukit::device d,
                                                                                    allocator_options options,
                                                                                    UpstreamArgs&&... upstream_args)
    : device_(d), options_(options), upstream_(make_upstream(d, std::forward<UpstreamArgs>(upstream_args)...)) {
  options_.validate();
  unowned_ = std::make_unique<stream_state>(no_stream_key, stream_type{}, d, tracker_type{});
  for (auto& pool : unowned_->pools) pool = std::make_unique<index_type>();  // retire() must not fail midway
  limit_ = options_.reserved_limit;
  limit_atomic_.store(limit_, std::memory_order_relaxed);  // reported by reserved_limit(), stats(), memory_summary
  needs_fence_ = options_.cross_stream_reuse || !upstream_.synchronizes_on_free();
  // Blocks cached in front are reused by their own stream only: cross-stream reuse wants them in the heap.
  front_cache_ = options_.front_cache && !options_.cross_stream_reuse;
  front_cache_large_.store(front_cache_ && options_.front_cache_large, std::memory_order_relaxed);
  watch_contention_ = front_cache_ && !options_.front_cache_large && options_.front_cache_large_when_contended;
  // Fixed for the allocator's life: the statistics' readers walk the used slots without a lock.
  fronts_used_ =
      front_cache_large_.load(std::memory_order_relaxed) || watch_contention_ ? front_slot_count : front_slots_per_pool;
  if (options_.expandable_segments && !has_vm) {
    if (options_.expandable_segments_required) {
      throw invalid_argument_error(detail::expandable_segments_required_for + d.to_string() +
                                   ", but its upstream has no virtual memory (reserve/map/unmap)");
    }
    detail::warn_parts("gpukit: expandable segments were asked for the caching allocator of ", d,
                       ", but its upstream has no virtual memory (reserve/map/unmap): ordinary segments are used");
  }
  if constexpr (has_vm && detail::has_virtual_memory_query<Upstream>::value) {
    if (options_.expandable_segments_required && !upstream_.virtual_memory_supported()) {
      const std::string asked = detail::expandable_segments_required_for + d.to_string();
      if (!d.is_cuda()) throw invalid_argument_error(asked + ", but its upstream has no virtual memory on this device");
      throw no_device_error(asked + detail::no_device_virtual_memory, cudaSuccess, {}, d.ordinal());
    }
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE basic_caching_allocator<Upstream, StreamOps>::~basic_caching_allocator() {
  // cudaFree and the host waits below are refused in global mode while any thread captures, invalidating that
  // capture; relaxed, they are not (as in empty_cache).
  const detail::relaxed_capture_mode relaxed(device_.is_cuda());
  std::unique_lock<detail::device_mutex> lock(mutex_);
  const std::size_t live = user_current(st_allocation);  // blocks in front caches are not live
  if (live > 0) {
    detail::warn_parts("gpukit: the caching allocator of ", device_, " is destroyed with ", live,
                       " live allocation(s) (", detail::bytes_part{user_current(st_allocated_bytes)},
                       "); their memory is released now, so any later use of it is invalid");
  }
  if (unrecorded_ != 0) record_deferred();
  // Blocks whose event on the legacy stream a gpukit capture underway keeps from being recorded: nothing can wait for
  // that stream's work now without invalidating the capture. An upstream whose free waits for the device (cudaFree)
  // still takes their memory back; another cannot, so their segments (only those) are left to it unreleased, and
  // that is said.
  const bool keep_unrecorded = unrecorded_ != 0 && !upstream_.synchronizes_on_free();
  std::size_t kept_segments = 0;
  std::size_t kept_bytes = 0;
  for (auto& st : streams_) {
    for (auto& record : st->pending) {
      if (record.unrecorded) {
        segment* seg = record.b->seg;
        if (keep_unrecorded && !seg->left_to_upstream) {
          seg->left_to_upstream = true;
          ++kept_segments;
          kept_bytes += seg->mapped();
        }
        continue;
      }
      if (record.event) {
        synchronize_quietly(*record.event);
      } else {
        wait_finished_quietly(st->tracker);
      }
    }
    st->pending.clear();
  }
  if (keep_unrecorded) {
    detail::warn_parts("gpukit: the caching allocator of ", device_, " is destroyed while a CUDA graph capture keeps ",
                       unrecorded_, " event(s) on the legacy default stream from being recorded; ", kept_segments,
                       " segment(s) (", detail::bytes_part{kept_bytes},
                       ") are not given back to the upstream, since that stream may still use them");
  }
  if (!upstream_.synchronizes_on_free()) {
    for (stream_state* st : dead_streams_) wait_finished_quietly(st->tracker);  // their blocks had no fence
  }
  if constexpr (has_vm) {
    // The pages of expandable segments go first, in place, after one wait for the streams that may use them (the
    // device's only where a stream is unknown); a range whose pages could not be unmapped keeps them, with a warning.
    try {
      std::vector<segment*> ranges;
      for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
        if (seg->expandable && !seg->left_to_upstream && seg->mapped() != 0) ranges.push_back(seg);
      }
      if (!ranges.empty()) {
        unmap_wait wait;
        wait_for_unmap(lock, &ranges, false, wait);
        (void)unmap_victims(ranges, wait, false);
      }
    } catch (...) {  // no memory for the list: the ranges with pages mapped are kept (return_segment warns)
    }
  }
  for (segment* seg = segments_; seg != nullptr;) {
    if (!seg->left_to_upstream) {
      for (block* b = seg->first; b != nullptr; b = b->next) {
        if (b->fence) synchronize_quietly(*b->fence);
      }
      record_segment_free(*seg);
      return_segment(seg, {});
    }
    segment* next = seg->next_segment;
    delete seg;
    seg = next;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void* basic_caching_allocator<Upstream, StreamOps>::allocate(std::size_t bytes,
                                                                           const stream_type& stream) {
  if (bytes == 0) return nullptr;
  refuse_if_captured(stream, "allocate");
  const std::size_t size = round_request(bytes);
  const bool small = size <= options_.small_size;
  if (front_cache_ && (small || front_cache_large_.load(std::memory_order_relaxed)) &&
      ops_.device_of(stream) == device_) {
    if (block* cached = front_take(ops_.key(stream), size, bytes, !small)) {
      if (history_.load(std::memory_order_acquire) != nullptr) note(memory_action::alloc, cached);
      return reinterpret_cast<void*>(cached->address);
    }
  }
  return allocate_from_heap(stream, bytes, size, small);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::deallocate(void* p) {
  if (p == nullptr) return;
  block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
  if (b == nullptr) throw_not_owned(p, "deallocate");
  // Until the block leaves the map (or enters a front cache) nothing else changes it: its owner (set under the
  // lock when it was allocated) is fixed. If anything below throws (captured, asking the stream failed on a
  // broken context, no memory for the message), the allocation stays live and the program can still free it.
  refuse_free_if_captured(b);
  const bool expired_owner = owner_expired(b);
  const bool busy = owner_may_be_busy(b, expired_owner);
  // Reusable at once on its own stream: a small block (a large one too once front_cache_large_ is on) is cached in
  // front for the next request of its size there (it stays in the map, marked). Only when it needs no fence: the stream
  // may be destroyed while the block is cached, and must not be asked (or recorded on) later.
  if (front_cache_ && (b->small || front_cache_large_.load(std::memory_order_relaxed)) && !busy && !expired_owner &&
      b->recorded.empty() && !b->partly_mapped) {
    const front_result r = front_give(b);  // refuses a stream whose destruction was noticed meanwhile
    if (r == front_result::cached) return;
    if (r == front_result::already_free) throw_not_owned(p, "deallocate");
  }
  free_to_heap(b, busy, expired_owner || owner_expired(b));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::deallocate(void* p, const stream_type& stream) {
  if (p == nullptr) return;
  // On the stream it was allocated on, no other stream's order is needed: deallocate(p), whose front cache may take
  // it (adaptors free on the current stream, which is usually that one). The owner is fixed while the block is live.
  if (const block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
      b != nullptr && ops_.device_of(stream) == device_ && b->owner->key == ops_.key(stream)) {
    deallocate(p);
    return;
  }
  refuse_if_captured(stream, "deallocate");
  std::string report;
  {
    const std::unique_lock<detail::device_mutex> lock = lock_for_heap(false);  // its block's pool is not known yet
    stream_state& st = stream_for(stream, true);  // checks the device before anything changes
    block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
    if (b == nullptr) throw_not_owned_locked(p, "deallocate");
    refuse_if_captured(b->owner->stream, "deallocate");
    note_stream_use(b, st);  // may throw (memory): the block is still allocated then
    const bool expired_owner = owner_expired(b);
    const bool busy = owner_may_be_busy(b, expired_owner);
    if (expired_owner) report = expired_owner_message(b);  // may throw (memory): still allocated, still mapped
    if (map_.erase(reinterpret_cast<std::uintptr_t>(p)) != b) throw_not_owned_locked(p, "deallocate");
    free_allocated(b, busy);  // puts the block back in the map if it throws
  }
  if (!report.empty()) warn(report);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::record_stream(void* p, const stream_type& stream) {
  refuse_if_captured(stream, "record_stream");
  std::lock_guard<detail::device_mutex> lock(mutex_);
  stream_state& st = stream_for(stream, true);
  block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
  if (b == nullptr) throw_not_owned_locked(p, "record_stream");
  note_stream_use(b, st);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::owns(const void* p) const noexcept {
  return p != nullptr && live_block(reinterpret_cast<std::uintptr_t>(p)) != nullptr;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::allocation_size(const void* p) const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  const block* b = live_block(reinterpret_cast<std::uintptr_t>(p));
  if (b == nullptr) throw_not_owned_locked(p, "allocation_size");
  return b->requested;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE allocator_stats basic_caching_allocator<Upstream, StreamOps>::stats() const noexcept {
  return consistent_read([this] { return read_stats(); });
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::memory_allocated() const noexcept {
  return consistent_read([this] { return user_current(st_allocated_bytes); });
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::memory_reserved() const noexcept {
  return current(stats_.reserved_bytes);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::max_memory_allocated() const noexcept {
  return peak(stats_.allocated_bytes);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::max_memory_reserved() const noexcept {
  return peak(stats_.reserved_bytes);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::reset_peak_stats() noexcept {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  fronts_lock all(*this);
  all_changing changes(*this);
  for (front_slot_type* slot : owned_fronts()) {
    for (std::size_t q = 0; q < detail::front_quantity_count; ++q) slot->claim[q] = slot->value(q);
  }
  // Each peak is stored once, as the users' value (never the heap's part alone, which readers could see).
  for (std::size_t k = 0; k < counter_count; ++k) {
    detail::atomic_stat& g = stat_ref(k / 3).pools[k % 3];
    std::int64_t value = g.current.load(std::memory_order_relaxed);
    if (fronts_active_ && fronted(k / 3)) {
      for (const front_slot_type* slot : owned_fronts()) value += front_value(*slot, k);
      slack_[k] = 0;
    }
    g.peak.store(value, std::memory_order_release);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::reset_accumulated_stats() noexcept {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  fronts_lock all(*this);
  all_changing changes(*this);
  for (std::size_t id = 0; id < stat_count; ++id) stat_ref(id).reset_accumulated();
  for (front_slot_type* slot : owned_fronts()) slot->reset_totals();
  stats_.num_alloc_retries.reset();
  stats_.num_ooms.reset();
  stats_.num_sync_all_streams.reset();
  stats_.num_device_alloc.reset();
  stats_.num_device_free.reset();
  stats_.num_device_free_unforced.reset();
  stats_.num_lock_waits.reset();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE free_space_info basic_caching_allocator<Upstream, StreamOps>::free_space() const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  return free_space_locked();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE allocator_snapshot basic_caching_allocator<Upstream, StreamOps>::snapshot() const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  fronts_lock all(*this);  // blocks do not enter or leave the front caches meanwhile
  allocator_snapshot taken = detail::caching_diagnostics::snapshot(*this);
  // Recorded under the locks: the history's events before it are exactly those the snapshot reflects (up to
  // allocations being returned on other threads), which is where memory_picture anchors its levels. After the
  // snapshot is built: one that fails (std::bad_alloc) leaves no anchor behind.
  if (memory_history* h = history_.load(std::memory_order_acquire)) taken.history_position = h->record_snapshot();
  return taken;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::string basic_caching_allocator<Upstream, StreamOps>::memory_summary() const {
  allocator_stats s;
  free_space_info f;
  {
    std::lock_guard<detail::device_mutex> lock(mutex_);
    {
      fronts_lock all(*this);
      s = read_stats();
    }
    f = free_space_locked();
  }
  return format_memory_summary("gpukit caching allocator, " + device_.to_string(), s, f);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::empty_cache() {
  detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
  release_held_segments();
  std::unique_lock<detail::device_mutex> lock(mutex_);
  refuse_release_if_captured("empty_cache");
  release_cached(lock, true, 0, true);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::trim(std::size_t target_reserved) {
  detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
  release_held_segments();
  std::unique_lock<detail::device_mutex> lock(mutex_);
  refuse_release_if_captured("trim");
  // At the target already: nothing to release, so no wait for pending work and no flush of the front caches (a
  // program that trims to its budget every step would otherwise drain its streams each time).
  if (target_reserved != 0 && current(stats_.reserved_bytes) <= target_reserved) return current(stats_.reserved_bytes);
  release_cached(lock, true, target_reserved, true);
  return current(stats_.reserved_bytes);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::set_reserved_limit(std::size_t bytes) {
  detail::relaxed_capture_mode relaxed(device_.is_cuda());  // cudaFree during another thread's capture
  release_held_segments();
  std::unique_lock<detail::device_mutex> lock(mutex_);
  limit_ = bytes;
  limit_atomic_.store(bytes, std::memory_order_relaxed);
  if (current(stats_.reserved_bytes) > bytes) release_cached(lock, true, bytes, true);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw invalid_argument_error("gpukit: a memory fraction must be in (0, 1], not " + std::to_string(fraction));
  }
  const upstream_memory_info info = upstream_.memory_info();
  if (!info.known || info.total_bytes == 0) {
    throw invalid_argument_error("gpukit: the total memory of " + device_.to_string() +
                                 " is unknown, so a fraction of it cannot be a limit; use set_reserved_limit");
  }
  set_reserved_limit(static_cast<std::size_t>(fraction * static_cast<double>(info.total_bytes)));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::uint64_t basic_caching_allocator<Upstream, StreamOps>::add_out_of_memory_observer(
    out_of_memory_observer observer) {
  return observers_.add(std::move(observer));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::remove_out_of_memory_observer(std::uint64_t id) {
  return observers_.remove(id);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::set_memory_history(
    std::shared_ptr<memory_history> history) {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  memory_history* const raw = history.get();
  if (history != nullptr && std::find(histories_.begin(), histories_.end(), history) == histories_.end()) {
    histories_.push_back(history);
  }
  current_history_ = std::move(history);
  history_.store(raw, std::memory_order_release);  // the history's construction happens before its first record
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::shared_ptr<memory_history> basic_caching_allocator<Upstream, StreamOps>::history() const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  return current_history_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::reserved_limit() const noexcept {
  return limit_atomic_.load(std::memory_order_relaxed);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE const allocator_options& basic_caching_allocator<Upstream, StreamOps>::options() const noexcept {
  return options_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE gpukit::device basic_caching_allocator<Upstream, StreamOps>::device() const noexcept {
  return device_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE Upstream& basic_caching_allocator<Upstream, StreamOps>::upstream() noexcept {
  return upstream_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE const Upstream& basic_caching_allocator<Upstream, StreamOps>::upstream() const noexcept {
  return upstream_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE StreamOps& basic_caching_allocator<Upstream, StreamOps>::stream_operations() noexcept {
  return ops_;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::stream_count() const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  return streams_.size();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::rounded_size(std::size_t bytes) const {
  if (bytes == 0) return 0;  // allocate(0) takes nothing (rounded_request's 0 means an overflow)
  return round_request(bytes);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::segment_size_for(std::size_t size) const {
  return segment_size(size, size <= options_.small_size);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE allocator_stats basic_caching_allocator<Upstream, StreamOps>::read_stats() const noexcept {
  allocator_stats s;
  s.allocation = load_stat(st_allocation);
  s.segment = load_stat(st_segment);
  s.active = load_stat(st_active);
  s.inactive_split = load_stat(st_inactive_split);
  s.allocated_bytes = load_stat(st_allocated_bytes);
  s.reserved_bytes = load_stat(st_reserved_bytes);
  s.active_bytes = load_stat(st_active_bytes);
  s.inactive_split_bytes = load_stat(st_inactive_split_bytes);
  s.requested_bytes = load_stat(st_requested_bytes);
  s.num_alloc_retries = stats_.num_alloc_retries.load();
  s.num_ooms = stats_.num_ooms.load();
  s.num_sync_all_streams = stats_.num_sync_all_streams.load();
  s.num_device_alloc = stats_.num_device_alloc.load();
  s.num_device_free = stats_.num_device_free.load();
  s.num_device_free_unforced = stats_.num_device_free_unforced.load();
  s.num_lock_waits = stats_.num_lock_waits.load();
  s.front_cache_large_on = front_cache_large_.load(std::memory_order_relaxed);
  s.reserved_limit = limit_atomic_.load(std::memory_order_relaxed);
  s.expandable_address_space = address_space_.load(std::memory_order_relaxed);
  s.expandable_mapped_bytes = expandable_mapped_.load(std::memory_order_relaxed);
  return s;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE pool_stats basic_caching_allocator<Upstream, StreamOps>::load_stat(std::size_t id) const noexcept {
  pool_stats p = stat_ref(id).load();
  if (!fronted(id)) return p;
  for (const front_slot_type& slot : used_fronts()) {
    for (std::size_t pool = 0; pool < 3; ++pool) {
      const std::size_t q = quantity_of(id * 3 + pool, is_large_slot(slot));
      if (q == detail::front_quantity_count) continue;
      p.pools[pool].current += slot.value(q);
      p.pools[pool].allocated += slot.raised_total(q);
      p.pools[pool].freed += slot.lowered_total(q);
    }
  }
  return p;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::user_current(std::size_t id) const noexcept {
  std::int64_t v = stat_ref(id).pools[0].current.load(std::memory_order_acquire);
  for (const front_slot_type& slot : used_fronts()) v += front_value(slot, id * 3);
  return v > 0 ? static_cast<std::size_t>(v) : 0;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::current(
    const detail::atomic_pool_stats& s) noexcept {
  return static_cast<std::size_t>(s.pools[0].current.load(std::memory_order_relaxed));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::peak(
    const detail::atomic_pool_stats& s) noexcept {
  return static_cast<std::size_t>(s.pools[0].peak.load(std::memory_order_relaxed));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::int64_t basic_caching_allocator<Upstream, StreamOps>::as_delta(std::size_t v) noexcept {
  return static_cast<std::int64_t>(v);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_overflow(std::size_t bytes) const {
  throw invalid_argument_error("gpukit: cannot allocate " + std::to_string(bytes) + " bytes on " + device_.to_string() +
                               ": the size overflows when rounded up");
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::round_request(std::size_t bytes) const {
  const std::size_t size = detail::segment_sizing::rounded_request(options_, bytes);
  if (size == 0) throw_overflow(bytes);
  return size;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::segment_size(std::size_t size,
                                                                                     bool small) const noexcept {
  return detail::segment_sizing::preferred(options_, size, small, current(stats_.reserved_bytes));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::fitted_segment_size(std::size_t size,
                                                                                            bool small) const noexcept {
  return detail::segment_sizing::fitted(options_, size, small, current(stats_.reserved_bytes), in_flight_, limit_);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::should_split(const block* b, std::size_t size,
                                                                              std::size_t remainder) const noexcept {
  return detail::segment_sizing::should_split(options_, b->small, b->seg->dedicated && !b->split_whole, size, remainder,
                                              b->seg->expandable);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::stream_for(const stream_type& s, bool other_devices)
    -> stream_state& {
  const gpukit::device d = ops_.device_of(s);
  if (d != device_ && !(other_devices && d.is_cuda() && device_.is_cuda())) throw_wrong_device(d);
  const std::uintptr_t key = ops_.key(s);
  stream_state* found = streams_.find(key);
  if (found == nullptr) return *register_stream(s, key, d);
  if (found->device != d) throw_key_collision(found->device, d, key);
  return *found;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_wrong_device(gpukit::device d) const {
  throw invalid_argument_error("gpukit: a stream of " + d.to_string() + " was passed to the caching allocator of " +
                                   device_.to_string() + " (wrong device)",
                               cudaSuccess, "gpukit::basic_caching_allocator", device_ordinal());
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_key_collision(gpukit::device known,
                                                                                     gpukit::device passed,
                                                                                     std::uintptr_t key) const {
  throw invalid_argument_error("gpukit: a stream of " + passed.to_string() +
                                   " was passed to the caching allocator of " + device_.to_string() + ", but its key " +
                                   std::to_string(key) + " is that of a stream of " + known.to_string() +
                                   " the allocator already knows; stream keys must be unique across devices",
                               cudaSuccess, "gpukit::basic_caching_allocator", device_ordinal());
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE int basic_caching_allocator<Upstream, StreamOps>::device_ordinal() const noexcept {
  return device_.is_cuda() ? device_.ordinal() : -1;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::register_stream(const stream_type& s,
                                                                                 std::uintptr_t key, gpukit::device d)
    -> stream_state* {
  // A server that creates and destroys streams must not grow this registry forever: states with nothing cached,
  // pending or allocated go, in sweeps whose cost is amortized over the registrations since the last one.
  if (streams_.size() >= prune_at_) prune_streams();
  stream_type kept = s;
  if constexpr (detail::has_stream_resolve<StreamOps>::value) kept = ops_.resolve(s);
  tracker_type tracker{};
  if constexpr (tracks_lifetimes) {
    tracker = ops_.track(s);
    // Room to list every registered stream as dead, made now: noting a destruction (free_allocated,
    // note_expirations) must not allocate, as it runs on error paths (a free undoing a failed allocate).
    if (dead_streams_.capacity() <= streams_.size()) dead_streams_.reserve(2 * streams_.size() + 8);
  }
  return &streams_.add(key, key, kept, d, std::move(tracker));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::prune_streams() {
  if constexpr (tracks_lifetimes) {
    note_expirations();
    if (!dead_streams_.empty()) retire_finished();
  }
  streams_.remove_if([](const stream_state& st) noexcept {
    const bool idle = st.pins == 0 && st.in_use == 0 && st.pending.empty() && (!st.dead || st.retired) &&
                      (!st.pools[0] || st.pools[0]->empty()) && (!st.pools[1] || st.pools[1]->empty());
    if (idle) disown_ranges(st);  // its ranges (free blocks of other streams) outlive it
    return idle;
  });
  ++sweeps_;
  // Abandoned states go at the next sweep (their cache is released before the footprint grows): the next sweep
  // comes after as many registrations again as there are streams still in use.
  std::size_t abandoned = 0;
  for (const auto& st : streams_) abandoned += abandoned_state(*st) ? 1 : 0;
  may_have_abandoned_ = abandoned != 0;
  prune_at_ = std::max(min_prune_at, 2 * (streams_.size() - abandoned));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::abandoned_state(
    const stream_state& st) const noexcept {
  return st.last_sweep < sweeps_ && st.in_use == 0 && st.pending.empty() && !st.dead;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::release_abandoned(
    std::unique_lock<detail::device_mutex>& lock) {
  if (!may_have_abandoned_) return 0;
  std::vector<segment*> victims;
  for (segment* seg : free_segments()) {
    bool abandoned = true;
    for (const block* b = seg->first; b != nullptr && abandoned; b = b->next) {
      abandoned = b->owner != unowned_.get() && abandoned_state(*b->owner);  // unowned blocks serve any stream
    }
    if (abandoned) victims.push_back(seg);
  }
  // Cleared after the scan (which may throw) and before the release, which unlocks (a sweep meanwhile sets it
  // again); set again if the release throws (std::bad_alloc, before it changes anything): the next request looks.
  may_have_abandoned_ = false;
  try {
    return release_segments(lock, victims, true);
  } catch (...) {
    if (lock.owns_lock()) may_have_abandoned_ = true;
    throw;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::expired(const stream_state& st) const noexcept {
  if constexpr (tracks_lifetimes) {
    return ops_.expired(st.tracker);
  } else {
    (void)st;
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::owner_expired(const block* b) const noexcept {
  return expired(*b->owner);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::finished(const stream_state& st) const {
  if constexpr (tracks_lifetimes) {
    return ops_.finished(st.tracker);
  } else {
    (void)st;
    return true;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::note_expirations() {
  if constexpr (tracks_lifetimes) {
    seen_expirations_ = ops_.expirations();  // before the scan: a destruction during it is seen next time
    for (const auto& st : streams_) {
      if (st->dead || !ops_.expired(st->tracker)) continue;
      dead_streams_.push_back(st.get());  // cannot throw: room for every registered stream (register_stream)
      st->dead = true;
      slots_to_release_ = true;
    }
    if (slots_to_release_) release_slots_of_dead();
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::release_slots_of_dead() {
  const auto unreleased = [this](std::uintptr_t key) {
    return std::any_of(dead_streams_.begin(), dead_streams_.end(),
                       [key](const stream_state* st) { return st->key == key && !st->slots_released; });
  };
  // Slots change hands only under the device lock (front_give_slow), so their owners can be read without theirs.
  bool owned = false;
  for (const front_slot_type* slot : owned_fronts())
    owned = owned || unreleased(owner_of(*slot).load(std::memory_order_relaxed));
  if (owned) {
    fronts_lock all(*this);
    std::optional<deferred_peaks> deferred;  // only when blocks move: it settles every peak
    for (front_slot_type* slot : owned_fronts()) {
      if (!unreleased(owner_of(*slot).load(std::memory_order_relaxed))) continue;
      slot->owner_gone = true;
      slot->idle_mark = slot->use();
      if (slot->blocks.load(std::memory_order_relaxed) == 0) continue;
      if (!deferred) deferred.emplace(*this);
      for (auto& bin : slot->bins) flush_bin(*slot, bin);
    }
  }
  for (stream_state* st : dead_streams_) st->slots_released = true;
  slots_to_release_ = false;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::retire_finished() {
  for (std::size_t i = 0; i < dead_streams_.size();) {
    stream_state* st = dead_streams_[i];
    if (!finished(*st)) {
      ++i;
      continue;
    }
    dead_streams_[i] = dead_streams_.back();
    dead_streams_.pop_back();
    retire(st);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::retire(stream_state* st) {
  st->retired = true;
  disown_ranges(*st);
  for (auto& index : st->pools) {
    if (!index) continue;
    while (block* b = index->find(1, [](const block*) { return true; })) (void)give_free_block(b, heir_of(b));
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::give_free_block(block* b, stream_state* heir)
    -> block* {
  unindex_free(b);
  recycle_event(std::move(b->fence), device_);  // its work is done, fenced work included
  b->owner = heir;
  return insert_free(b);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::disown_ranges(const stream_state& st) noexcept {
  for (segment* range : st.expandable) {
    if (range != nullptr && range->range_of == &st) range->range_of = nullptr;  // the next stream without one takes it
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::heir_of(const block* b) const noexcept
    -> stream_state* {
  // In a range a stream has, the block merges with that stream's free blocks (its index exists: made with the range,
  // or when the range was taken over); elsewhere it is any stream's.
  stream_state* range_owner = b->seg->expandable ? b->seg->range_of : nullptr;
  return range_owner != nullptr && !range_owner->retired ? range_owner : unowned_.get();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::take_over(stream_state& st, segment* range) noexcept {
  try {
    (void)index_in(st, range->small);  // the only step that can fail: then the range stays free for the taking
  } catch (...) {
    return false;
  }
  range->range_of = &st;
  st.expandable[range->small ? 1 : 0] = range;
  // Its free blocks, mapped or not, as the stream that made it left them (no fence: their work has completed), merged
  // with st's own free blocks beside them (until now unowned blocks merged only with one another). insert_free
  // absorbs free neighbours of either kind, so each run of free blocks becomes one of st's.
  for (block* b = range->first; b != nullptr; b = b->next) {
    const bool joins = b->owner == unowned_.get() || (b->owner == &st && joinable(b->next, &st));
    if (b->state != block_state::free || !joins) continue;
    unindex_free(b);
    b->owner = &st;
    b = insert_free(b);  // cannot throw: st's index exists
  }
  return true;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::wait_finished_quietly(
    const tracker_type& tracker) noexcept {
  if constexpr (tracks_lifetimes) {
    try {
      ops_.wait_finished(tracker);
    } catch (const std::exception& ex) {
      detail::warn_parts("gpukit: waiting for the work of a destroyed stream failed: ", ex.what());
    } catch (...) {
      warn("gpukit: waiting for the work of a destroyed stream failed");
    }
  } else {
    (void)tracker;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::wait_for_dead_streams(
    std::unique_lock<detail::device_mutex>& lock) {
  if constexpr (tracks_lifetimes) {
    note_expirations();
    if (dead_streams_.empty()) return;
    std::vector<tracker_type> trackers;
    for (const stream_state* st : dead_streams_) trackers.push_back(st->tracker);
    lock.unlock();
    for (const auto& t : trackers) wait_finished_quietly(t);
    lock.lock();
    retire_finished();
  } else {
    (void)lock;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::string basic_caching_allocator<Upstream, StreamOps>::describe(const stream_state& st) const {
  if constexpr (detail::has_stream_describe<StreamOps>::value) {
    try {
      return ops_.describe(st.stream);
    } catch (...) {
    }
  }
  return "stream " + std::to_string(st.key);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::string basic_caching_allocator<Upstream, StreamOps>::expired_owner_message(const block* b) const {
  return detail::caching_diagnostics::expired_owner_message(*this, b);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::acquire_event(gpukit::device d)
    -> std::unique_ptr<event_type> {
  if (auto pooled = events_.take(d)) return std::move(*pooled);
  return std::make_unique<event_type>(ops_.create_event(d));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::recycle_event(std::unique_ptr<event_type> e,
                                                                               gpukit::device d) noexcept {
  if (e) events_.give(d, std::move(e));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::synchronize_quietly(const event_type& e) noexcept {
  try {
    ops_.synchronize(e);
  } catch (const std::exception& ex) {
    detail::warn_parts("gpukit: waiting for an event of the caching allocator failed: ", ex.what());
  } catch (...) {
    warn("gpukit: waiting for an event of the caching allocator failed");
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::note_stream_use(block* b, stream_state& st) {
  if (&st == b->owner) return;
  if (std::find(b->recorded.begin(), b->recorded.end(), &st) != b->recorded.end()) return;
  b->recorded.push_back(&st);
  ++st.in_use;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::clear_recorded(block* b) noexcept {
  for (stream_state* user : b->recorded) --user->in_use;
  b->recorded.clear();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::record_complete(const stream_state& st,
                                                                                 const pending_record& record) const {
  if (record.unrecorded) return false;
  return record.event ? ops_.ready(*record.event) : finished(st);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::needs_capture_hold(
    const stream_type& s) const noexcept {
  if constexpr (detail::has_capture_hold_query<StreamOps>::value) {
    static_assert(noexcept(ops_.needs_capture_hold(s)), "StreamOps::needs_capture_hold must be noexcept");
    return ops_.needs_capture_hold(s);
  } else {
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::record_on(event_type& e, const stream_state& st) {
  if (st.device == device_) {
    ops_.record(e, st.stream);
  } else {
    device_guard guard(st.device);  // a peer device's event, recorded with that device current
    ops_.record(e, st.stream);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::record_deferred() noexcept {
  if (detail::gpukit_capture_underway()) return;  // without touching the holds, which a capture begun may wait for
  const detail::capture_hold hold(true);          // until the events are recorded
  if (hold.refused()) return;                     // a capture began meanwhile
  for (stream_state* st : pending_streams_) {
    for (pending_record& record : st->pending) {
      if (unrecorded_ == 0) return;
      if (!record.unrecorded) continue;
      if (expired(*st)) {
        // Destroyed since (its handle may be another stream's): its last work is waited for instead (null event).
        recycle_event(std::move(record.event), st->device);
      } else {
        try {
          record_on(*record.event, *st);  // the stream's work so far: the work before the free, and more
        } catch (...) {                   // tried again at the next call; the block stays pending meanwhile
          continue;
        }
        // Destroyed by another thread meanwhile (its handle perhaps a new stream's by the record): as above.
        if (expired(*st)) recycle_event(std::move(record.event), st->device);
      }
      record.unrecorded = false;
      --unrecorded_;
    }
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::process_events() {
  if (unrecorded_ != 0) record_deferred();
  for (std::size_t i = 0; i < pending_streams_.size();) {
    stream_state* st = pending_streams_[i];
    while (!st->pending.empty() && record_complete(*st, st->pending.front())) {
      pending_record record = std::move(st->pending.front());
      st->pending.pop_front();
      recycle_event(std::move(record.event), st->device);
      complete_pending(record.b);
    }
    if (st->pending.empty()) {
      pending_streams_[i] = pending_streams_.back();
      pending_streams_.pop_back();
    } else {
      ++i;
    }
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::complete_pending(block* b) {
  --pending_total_;
  if (--b->pending_events != 0) return;
  if (memory_history* h = history_.load(std::memory_order_acquire)) {
    h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
  }
  count(st_active, b->small, -1);
  count(st_active_bytes, b->small, -as_delta(b->size));
  return_to_pool(b);
}

template <class Upstream, class StreamOps>
void* basic_caching_allocator<Upstream, StreamOps>::allocate_from_heap(const stream_type& stream, std::size_t bytes,
                                                                       std::size_t size, bool small) {
  block* b;
  {
    std::unique_lock<detail::device_mutex> lock = lock_for_heap(!small);
    stream_state& st = stream_for(stream);
    // The slow paths below release the lock (to grow, to wait); meanwhile another thread's registration of a stream
    // may sweep idle states, which this one is until it holds a block. Unpinned with the lock held (an out-of-memory
    // error leaves unlocked).
    struct pin {
      pin(stream_state& s, std::unique_lock<detail::device_mutex>& l) noexcept : st(s), lock(l) { ++st.pins; }
      ~pin() {
        if (!lock.owns_lock()) lock.lock();
        --st.pins;
      }
      pin(const pin&) = delete;
      pin& operator=(const pin&) = delete;
      stream_state& st;
      std::unique_lock<detail::device_mutex>& lock;
    } pinned(st, lock);
    st.last_sweep = sweeps_;
    if (pending_total_ != 0) process_events();
    if constexpr (tracks_lifetimes) {
      if (ops_.expirations() != seen_expirations_) {  // one relaxed load when nothing changed
        note_expirations();
      } else if (slots_to_release_) {
        release_slots_of_dead();  // free_allocated found a stream destroyed
      }
      if (!dead_streams_.empty()) retire_finished();
    }
    do {  // again only when a gpukit capture began between find_free and take (take)
      b = find_free(st, size, small);
      if (b == nullptr && flush_fronts()) b = find_free(st, size, small);  // cached blocks of other sizes
      if (b == nullptr) {
        // The upstream's cudaMalloc (and cudaFree) for this stream, which is not captured, must be neither refused
        // nor invalidate a capture in global mode that another thread has underway.
        detail::relaxed_capture_mode relaxed(device_.is_cuda());
        b = allocate_slow(lock, st, bytes, size, small);
      }
      if (b->seg->expandable) {
        detail::relaxed_capture_mode relaxed(device_.is_cuda());
        b = back_with_pages(lock, st, b, bytes, size, small);
      }
    } while (!take(b, st, size, bytes));
  }
  try {
    map_.insert(b->address, b);
  } catch (...) {
    std::lock_guard<detail::device_mutex> lock(mutex_);
    // Never handed out, but its stream's earlier work may still use the memory (take() dropped the fence of a block
    // reused on its own stream): fenced again, so that another stream cannot take it without waiting.
    bool busy = true;
    try {
      busy = owner_may_be_busy(b, owner_expired(b));
    } catch (...) {  // asking failed: assumed busy
    }
    free_allocated(b, busy, false);
    throw;
  }
  if (history_.load(std::memory_order_acquire) != nullptr) note(memory_action::alloc, b);
  return reinterpret_cast<void*>(b->address);
}

template <class Upstream, class StreamOps>
void basic_caching_allocator<Upstream, StreamOps>::free_to_heap(block* b, bool busy, bool expired_owner) {
  void* p = reinterpret_cast<void*>(b->address);
  std::string report;
  if (expired_owner) report = expired_owner_message(b);
  // Two frees of one pointer: the first to take it out of the map frees it.
  if (map_.erase(b->address) != b) throw_not_owned(p, "deallocate");
  {
    const std::unique_lock<detail::device_mutex> lock = lock_for_heap(!b->small);
    free_allocated(b, busy);
  }
  if (!report.empty()) warn(report);
}

template <class Upstream, class StreamOps>
std::unique_lock<detail::device_mutex> basic_caching_allocator<Upstream, StreamOps>::lock_for_heap(bool large) {
  std::unique_lock<detail::device_mutex> lock(mutex_, std::try_to_lock);
  const bool waited = !lock.owns_lock();
  if (waited) {
    stats_.num_lock_waits.increment_shared();  // before the wait: a test sees a thread waiting
    lock.lock();
  }
  if (large && watch_contention_ && !front_cache_large_.load(std::memory_order_relaxed)) {
    watch_large_contention(waited);
  }
  return lock;
}

template <class Upstream, class StreamOps>
void basic_caching_allocator<Upstream, StreamOps>::watch_large_contention(bool waited) noexcept {
  // 8 waits among the last 64 large heap operations turn caching on. A single thread never waits (stats() and
  // memory_allocated() take no lock), and a monitor printing memory_summary() without a pause beside one allocating
  // thread caused about one wait per 100 pairs (bench_allocator, BM_summary_beside).
  constexpr std::size_t waits_to_turn_on = 8;
  large_waits_seen_ = (large_waits_seen_ << 1U) | static_cast<std::uint64_t>(waited);
  if (waited && std::bitset<64>(large_waits_seen_).count() >= waits_to_turn_on) {
    front_cache_large_.store(true, std::memory_order_relaxed);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::used_fronts() noexcept -> slot_range<front_slot_type> {
  return {fronts_.data(), fronts_.data() + fronts_used_};
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::used_fronts() const noexcept
    -> slot_range<const front_slot_type> {
  return {fronts_.data(), fronts_.data() + fronts_used_};
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::owned_fronts() const noexcept
    -> slot_range<front_slot_type* const> {
  return {owned_.data(), owned_.data() + owned_count_};
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::note_owned(front_slot_type& slot) noexcept {
  owned_[owned_count_++] = &slot;  // at most front_slot_count: owners are never reset to unowned
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::is_large_slot(
    const front_slot_type& slot) const noexcept {
  return &slot >= fronts_.data() + front_slots_per_pool;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::int64_t basic_caching_allocator<Upstream, StreamOps>::front_value(const front_slot_type& slot,
                                                                                     std::size_t k) const noexcept {
  const std::size_t q = quantity_of(k, is_large_slot(slot));
  return q < detail::front_quantity_count ? slot.value(q) : 0;
}

template <class Upstream, class StreamOps>
void basic_caching_allocator<Upstream, StreamOps>::raise_peak_with_fronts(std::size_t k, std::int64_t d) noexcept {
  // First the room the slots hold and do not use (their claims above their values), one slot at a time: each claim
  // given back is room in every counter of its quantity. The device lock's holder may wait for a slot's lock. Not
  // again for a counter whose last look found too little, until a slot's claims rise (spare_exhausted_): at a rising
  // peak every look fails, and 16 slots' locks a counter made such an allocation 1.6x the instructions (helper-219).
  const std::uint32_t bit = std::uint32_t{1} << k;
  if ((spare_exhausted_ & bit) == 0 && take_spare_claims(k, d - slack_[k])) {
    slack_[k] -= d;
    return;
  }
  spare_exhausted_ |= bit;
  fronts_lock all(*this);
  ++heap_peak_raises_;
  rebalance(k, nullptr, d);
}

template <class Upstream, class StreamOps>
bool basic_caching_allocator<Upstream, StreamOps>::take_spare_claims(std::size_t k, std::int64_t missing) noexcept {
  ++heap_spare_looks_;
  for (front_slot_type* slot : owned_fronts()) {
    const std::size_t q = quantity_of(k, is_large_slot(*slot));
    if (q == detail::front_quantity_count) continue;
    const std::lock_guard<detail::spin_mutex> lock(slot->mutex);
    const std::int64_t spare = std::min(missing, slot->claim[q] - slot->value(q));
    if (spare <= 0) continue;
    return_claim(*slot, q, spare);
    missing -= spare;
    if (missing == 0) return true;
  }
  return false;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::rebalance(std::size_t k, const front_slot_type* acting,
                                                                           std::int64_t pending) noexcept {
  detail::atomic_stat& g = stat_ref(k / 3).pools[k % 3];
  std::int64_t claimed = g.current.load(std::memory_order_relaxed) + pending;
  std::int64_t value = claimed;
  for (front_slot_type* slot : owned_fronts()) {  // the slots whose blocks counter k counts (none for segments)
    const std::size_t q = quantity_of(k, is_large_slot(*slot));
    if (q == detail::front_quantity_count) continue;
    value += slot->value(q);
    slot->claim[q] = std::max(slot->claim[q], slot->value(q));
    claimed += slot->claim[q];
  }
  g.raise_peak(value);
  const std::int64_t peak = g.peak.load(std::memory_order_relaxed);
  std::int64_t excess = claimed - peak;
  for (int round = 0; round < 2 && excess > 0; ++round) {
    for (front_slot_type* slot : owned_fronts()) {
      const std::size_t q = quantity_of(k, is_large_slot(*slot));
      if (q == detail::front_quantity_count || (slot == acting) == (round == 0)) continue;
      const std::int64_t spare = std::min(excess, slot->claim[q] - slot->value(q));
      if (spare == 0) continue;
      slot->claim[q] -= spare;
      excess -= spare;
      // The claim counts in the other counters of its quantity too: their room grows as much (found here, the
      // heap's next counter of a pair does not come back for it).
      for (std::size_t other : counters_of(q, is_large_slot(*slot))) {
        if (other != k) slack_[other] += spare;
      }
    }
  }
  slack_[k] = -excess;  // peak - heap - claims, >= 0
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::rebalance_all() noexcept {
  for (std::size_t k = 0; k < counter_count; ++k) {
    if (fronted(k / 3)) rebalance(k, nullptr);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::rebalance_risen(front_slot_type& slot,
                                                                                 bool left) noexcept {
  // The slot that came here comes back for the same quantities: it also gets the room left under their peaks, so
  // its next blocks up to the peaks leave and enter on the fast path. Left with the heap, the room came back to the
  // slot only through here, one block at a time: a cycle of 9 sizes on one stream, one served by the heap, took the
  // slow path on most of its pairs. A claim counts in every counter of its quantity: it rises by their least room.
  const bool large = is_large_slot(slot);
  for (std::size_t q = 0; q < detail::front_quantity_count; ++q) {
    if ((q == detail::fq_split_blocks || q == detail::fq_split_bytes) == left) continue;
    for (std::size_t k : counters_of(q, large)) rebalance(k, &slot);
    std::int64_t room = std::numeric_limits<std::int64_t>::max();
    for (std::size_t k : counters_of(q, large)) room = std::min(room, slack_[k]);
    grant_claim(slot, q, room);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::grant_claim(front_slot_type& slot, std::size_t q,
                                                                             std::int64_t amount) noexcept {
  for (std::size_t k : counters_of(q, is_large_slot(slot))) slack_[k] -= amount;
  slot.claim[q] += amount;
  spare_exhausted_ = 0;  // the slot's claims rise: the heap may find spare room in them again
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::return_claim(front_slot_type& slot, std::size_t q,
                                                                              std::int64_t amount) noexcept {
  slot.claim[q] -= amount;
  for (std::size_t k : counters_of(q, is_large_slot(slot))) slack_[k] += amount;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::front_slot_at(std::uintptr_t key, std::size_t probe,
                                                                               bool large) noexcept
    -> front_slot_type& {
  const std::size_t i = (detail::front_home(key, front_slots_per_pool) + probe) % front_slots_per_pool;
  return fronts_[large ? front_slots_per_pool + i : i];
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::atomic<std::uintptr_t>& basic_caching_allocator<Upstream, StreamOps>::owner_of(
    const front_slot_type& slot) noexcept {
  return front_owners_.key[static_cast<std::size_t>(&slot - fronts_.data())];
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::front_take(std::uintptr_t key, std::size_t size,
                                                                            std::size_t requested, bool large)
    -> block* {
  // The stream's home slot here, the other probes out of line: most streams own their home slot, and a hit there
  // then pays for no loop (with front_give's the same way, a 256 B pair went from 499 instructions to about 440).
  const probe_outcome home = front_take_at(front_slot_at(key, 0, large), key, size, requested, large);
  return home.search_on ? front_take_probing(key, size, requested, large) : home.taken;
}

template <class Upstream, class StreamOps>
auto basic_caching_allocator<Upstream, StreamOps>::front_take_probing(std::uintptr_t key, std::size_t size,
                                                                      std::size_t requested, bool large) -> block* {
  for (std::size_t probe = 1; probe < front_slots_per_pool; ++probe) {
    const probe_outcome here = front_take_at(front_slot_at(key, probe, large), key, size, requested, large);
    if (!here.search_on) return here.taken;
  }
  return nullptr;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::front_take_at(front_slot_type& slot,
                                                                               std::uintptr_t key, std::size_t size,
                                                                               std::size_t requested, bool large)
    -> probe_outcome {
  const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
  // A slot never owned ends the search (a stream's slots come before it): a miss only costs the heap's path.
  if (owner != key) return {nullptr, owner != front_slot_type::unowned};
  if (slot.blocks.load(std::memory_order_relaxed) == 0) {
    slot.note_miss();  // in use, though empty: not to be taken over
    return {nullptr, true};
  }
  std::unique_lock<detail::spin_mutex> lock(slot.mutex);  // the reads above were hints
  if (slot.blocks.load(std::memory_order_relaxed) == 0 || owner_of(slot).load(std::memory_order_relaxed) != key) {
    return {nullptr, true};
  }
  ++slot.tick;
  auto* bin = slot.find(size);
  if (bin == nullptr) return {nullptr, true};
  if (slot.may_leave(*bin->top, requested) || borrow_claims(slot, slot.shortfall_to_leave(*bin->top, requested)) ||
      claim_from_heap(slot, slot.shortfall_to_leave(*bin->top, requested))) {
    return {take_cached(slot, *bin, requested, false), false};
  }
  lock.unlock();
  return {front_take_slow(key, size, requested, large), false};
}

template <class Upstream, class StreamOps>
bool basic_caching_allocator<Upstream, StreamOps>::borrow_claims(front_slot_type& slot,
                                                                 typename front_slot_type::amounts need) noexcept {
  // A try_lock only: the caller holds its own slot's lock, and a thread holding every lock may be waiting for it.
  // The room may be spread over several slots (one holds a block's room, another its bytes'): each gives what it
  // can; what moved stays moved when the rest is not found (the sum is the same either way).
  front_slot_type* const pool = fronts_.data() + (is_large_slot(slot) ? front_slots_per_pool : 0);
  for (std::size_t i = 0; i < front_slots_per_pool; ++i) {
    front_slot_type& donor = pool[i];
    if (&donor == &slot || owner_of(donor).load(std::memory_order_relaxed) == front_slot_type::unowned) continue;
    if (!donor.mutex.try_lock()) continue;
    const bool met = donor.give_spare(slot, need);
    donor.mutex.unlock();
    if (met) return true;
  }
  return false;
}

template <class Upstream, class StreamOps>
bool basic_caching_allocator<Upstream, StreamOps>::claim_from_heap(front_slot_type& slot,
                                                                   typename front_slot_type::amounts need) noexcept {
  // try_locks only, as in borrow_claims: the device lock's holder may be waiting for this slot's lock.
  const std::unique_lock<detail::device_mutex> device_lock(mutex_, std::try_to_lock);
  if (!device_lock.owns_lock() || peaks_deferred_) return false;
  const bool large = is_large_slot(slot);
  std::array<std::int64_t, detail::front_quantity_count> given{};
  for (std::size_t q = 0; q < detail::front_quantity_count; ++q) {
    if (need[q] <= 0) continue;
    // The least room of q's counters: the all-pools ones (k % 3 == 0), which either pool's claims count in, and this
    // pool's own.
    std::int64_t all_room = std::numeric_limits<std::int64_t>::max();
    std::int64_t pool_room = all_room;
    for (std::size_t k : counters_of(q, large)) {
      std::int64_t& room = k % 3 == 0 ? all_room : pool_room;
      room = std::min(room, slack_[k]);
    }
    // Short of room: the other slots' spare claims for q, this pool's first; the other pool's give room only in the
    // all-pools counters, so they are asked only once this pool's own have it (else they would lose claims to no
    // purpose).
    for (const bool same_pool : {true, false}) {
      if (std::min(all_room, pool_room) >= need[q] || (!same_pool && pool_room < need[q])) break;
      for (front_slot_type* other : owned_fronts()) {
        if (other == &slot || (is_large_slot(*other) == large) != same_pool || !other->mutex.try_lock()) continue;
        const std::int64_t spare = std::min(need[q] - std::min(all_room, pool_room), other->claim[q] - other->value(q));
        if (spare > 0) return_claim(*other, q, spare);
        other->mutex.unlock();
        if (spare <= 0) continue;
        all_room += spare;
        if (same_pool) pool_room += spare;
        if (std::min(all_room, pool_room) >= need[q]) break;
      }
    }
    given[q] = std::min(all_room, pool_room);
    if (given[q] < need[q]) return false;
  }
  // All the room left, as the slow path gives (rebalance_risen): the slot comes back less often, and the heap takes
  // back what it needs one slot lock at a time. (Only the block's need: a cycle of 9 sizes on one stream cost 1239
  // instructions a pair against 864.)
  for (std::size_t q = 0; q < detail::front_quantity_count; ++q) {
    if (need[q] > 0) grant_claim(slot, q, given[q]);
  }
  return true;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::take_cached(front_slot_type& slot,
                                                                             typename front_slot_type::bin& bin,
                                                                             std::size_t requested, bool slow)
    -> block* {
  block* b = bin.top;  // still in the pointer map
  slot.pop(bin);
  detail::sequence_write change(slot.sequence);  // readers see the counts with the peaks that cover them
  slot.leave(*b, requested);
  if (slow) rebalance_risen(slot, true);
  b->requested = requested;
  b->in_front.store(false, std::memory_order_relaxed);
  return b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::give_cached(front_slot_type& slot,
                                                                             typename front_slot_type::bin& bin,
                                                                             block* b, bool slow) noexcept {
  // Recorded under the slot's lock: no other thread can take the block (and record its alloc) before this free.
  if (history_.load(std::memory_order_acquire) != nullptr) note_cached_free(b);
  detail::sequence_write change(slot.sequence);
  slot.enter(*b);
  if (slow) rebalance_risen(slot, false);
  std::atomic<std::uintptr_t>& owner = owner_of(slot);
  if (owner.load(std::memory_order_relaxed) != b->owner->key) {
    owner.store(b->owner->key, std::memory_order_relaxed);
    slot.owner_gone = false;
  }
  slot.push(bin, b);
  b->in_front.store(true, std::memory_order_relaxed);
}

template <class Upstream, class StreamOps>
auto basic_caching_allocator<Upstream, StreamOps>::front_take_slow(std::uintptr_t key, std::size_t size,
                                                                   std::size_t requested, bool large) -> block* {
  std::lock_guard<detail::device_mutex> device_lock(mutex_);
  fronts_lock all(*this);
  ++front_slow_paths_;
  for (std::size_t probe = 0; probe < front_slots_per_pool; ++probe) {
    front_slot_type& slot = front_slot_at(key, probe, large);
    const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
    if (owner == front_slot_type::unowned) return nullptr;
    if (slot.blocks.load(std::memory_order_relaxed) == 0 || owner != key) continue;
    auto* bin = slot.find(size);
    if (bin != nullptr) return take_cached(slot, *bin, requested, true);
  }
  return nullptr;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::front_give(block* b) -> front_result {
  const std::uintptr_t key = b->owner->key;
  if (key == front_slot_type::unowned) return front_result::no_room;  // no stream has it (see front_slot::unowned)
  // The stream's home slot here, the search out of line (see front_take).
  front_slot_type& home = front_slot_at(key, 0, !b->small);
  if (owner_of(home).load(std::memory_order_relaxed) == key) {
    std::unique_lock<detail::spin_mutex> lock(home.mutex);
    if (owner_of(home).load(std::memory_order_relaxed) == key) return front_give_to(home, lock, b);
  }
  return front_give_probing(b);
}

template <class Upstream, class StreamOps>
auto basic_caching_allocator<Upstream, StreamOps>::front_give_probing(block* b) -> front_result {
  const std::uintptr_t key = b->owner->key;
  constexpr std::uintptr_t unowned = front_slot_type::unowned;
  const bool large = !b->small;
  // Pass 0: the stream's own slot (before the first slot never owned); pass 1: a slot never owned; pass 2 (all
  // slots owned by other streams): one whose owner went idle, among the first few, so that with more busy streams
  // than slots a free without a slot locks only a few others' slots. Reads without the lock are hints, checked
  // under it. A slot changes hands only on the slow path, with every lock held, which looks for the stream's own
  // slot first: two threads freeing on one stream at once, each in pass 1, would otherwise claim a slot each.
  constexpr std::size_t takeover_probes = 4;
  for (int pass = 0; pass < 3; ++pass) {
    for (std::size_t probe = 0; probe < (pass == 2 ? takeover_probes : front_slots_per_pool); ++probe) {
      front_slot_type& slot = front_slot_at(key, probe, large);
      const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
      if (pass == 0 && owner == unowned) break;
      if (owner != (pass == 0 ? key : unowned) && pass != 2) continue;
      if (pass == 2 && (owner == key || owner == unowned || slot.blocks.load(std::memory_order_relaxed) != 0)) {
        continue;
      }
      std::unique_lock<detail::spin_mutex> lock(slot.mutex);
      const std::uintptr_t now = owner_of(slot).load(std::memory_order_relaxed);
      if (pass == 0) {
        if (now != key) continue;
        return front_give_to(slot, lock, b);
      }
      if (pass == 2 ? !slot.may_take_over(key, now) : now != unowned) continue;
      const slot_seen seen = seen_by_fast_path(slot);
      lock.unlock();
      return front_give_slow(b, slot, seen);
    }
  }
  return front_result::no_room;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::front_give_to(
    front_slot_type& slot, std::unique_lock<detail::spin_mutex>& lock, block* b) -> front_result {
  if (b->in_front.load(std::memory_order_relaxed)) return front_result::already_free;
  // Destroyed since deallocate asked, and the slot already emptied (release_slots_of_dead): the block would hold
  // it for a stream that never asks again. A flag on the slot's own line: asking the stream cost the pair 10 %.
  if (slot.owner_gone) return front_result::no_room;
  ++slot.tick;
  auto* bin = slot.room_for(b->size);
  if (bin == nullptr) {
    if (slot.stale_bin(b->size) == nullptr) return front_result::no_room;
    const slot_seen seen = seen_by_fast_path(slot);
    lock.unlock();
    return front_give_slow(b, slot, seen);  // a bin of sizes no longer used gives way
  }
  if (!fronts_active_ || (!slot.may_enter(*b) && !borrow_claims(slot, slot.shortfall_to_enter(*b)) &&
                          !claim_from_heap(slot, slot.shortfall_to_enter(*b)))) {
    const slot_seen seen = seen_by_fast_path(slot);
    lock.unlock();
    return front_give_slow(b, slot, seen);
  }
  give_cached(slot, *bin, b, false);
  return front_result::cached;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::seen_by_fast_path(front_slot_type& slot) noexcept
    -> slot_seen {
  return {owner_of(slot).load(std::memory_order_relaxed), slot.use()};
}

template <class Upstream, class StreamOps>
auto basic_caching_allocator<Upstream, StreamOps>::front_give_slow(block* b, front_slot_type& chosen, slot_seen seen)
    -> front_result {
  std::lock_guard<detail::device_mutex> device_lock(mutex_);
  fronts_lock all(*this);
  ++front_slow_paths_;
  if (b->in_front.load(std::memory_order_relaxed)) return front_result::already_free;
  if (owner_expired(b)) return front_result::no_room;  // as in front_give_to
  if (!fronts_active_) {
    // From now on the heap's counters alone no longer give the peaks: start the claims at zero.
    fronts_active_ = true;
    rebalance_all();
  }
  const std::uintptr_t key = b->owner->key;
  constexpr std::uintptr_t unowned = front_slot_type::unowned;
  // The stream's own slot first (another thread of it may have claimed one since front_give looked), then
  // `chosen`, then the first slot never owned. Another stream's slot is taken over only as front_give's pass 2
  // decided (empty, and unused since another stream last asked): not if it changed hands or was used since.
  front_slot_type* found = nullptr;
  front_slot_type* first_unowned = nullptr;
  for (std::size_t probe = 0; probe < front_slots_per_pool && first_unowned == nullptr; ++probe) {
    front_slot_type& slot = front_slot_at(key, probe, !b->small);
    const std::uintptr_t owner = owner_of(slot).load(std::memory_order_relaxed);
    if (owner == key) {
      found = &slot;
      break;
    }
    if (owner == unowned) first_unowned = &slot;  // a stream's slots come before it (see front_slot_at)
  }
  const std::uintptr_t chosen_owner = owner_of(chosen).load(std::memory_order_relaxed);
  const bool unchanged = chosen_owner == seen.owner && chosen.use() == seen.use;
  if (found == nullptr && chosen_owner != unowned && unchanged && chosen.blocks.load(std::memory_order_relaxed) == 0) {
    found = &chosen;
  }
  if (found == nullptr) found = first_unowned;  // `chosen` when front_give found it never owned
  if (found != nullptr) {
    front_slot_type& slot = *found;
    // A slot never owned is not among those `all` locked: lock it, and it is owned from here on (rebalance_risen,
    // in give_cached, must see it). Threads that lock it meanwhile (front_give's pass 1) wait for nothing else.
    std::unique_lock<detail::spin_mutex> adopted;
    if (owner_of(slot).load(std::memory_order_relaxed) == unowned) {
      adopted = std::unique_lock<detail::spin_mutex>(slot.mutex);
      note_owned(slot);
    }
    auto* bin = slot.room_for(b->size);
    if (bin == nullptr) {
      bin = slot.stale_bin(b->size);
      if (bin == nullptr) return front_result::no_room;
      deferred_peaks deferred(*this);
      flush_bin(slot, *bin);
    }
    give_cached(slot, *bin, b, true);
    return front_result::cached;
  }
  return front_result::no_room;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::flush_bin(front_slot_type& slot,
                                                                           typename front_slot_type::bin& bin) {
  while (bin.count != 0) {
    block* b = slot.pop(bin);
    map_.erase(b->address);  // a cached block stays in the map (marked) until the heap takes it
    b->in_front.store(false, std::memory_order_release);  // after the erase: see live_block
    // The user's free was counted when the block entered the cache; the heap's free below counts it again.
    slot.unwind(*b);
    try {
      free_allocated(b, false, false);  // cached only when it needed no fence; its free is already recorded
    } catch (...) {
      // free_allocated put it back in the map as allocated: it is cached again instead.
      slot.enter(*b);
      slot.push(bin, b);
      b->in_front.store(true, std::memory_order_relaxed);
      throw;
    }
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::flush_fronts(bool large_only) {
  if (!fronts_active_) return false;
  bool any = false;
  fronts_lock all(*this);
  deferred_peaks deferred(*this);
  for (front_slot_type* slot : owned_fronts()) {
    if (slot->blocks.load(std::memory_order_relaxed) == 0 || (large_only && !is_large_slot(*slot))) continue;
    for (auto& bin : slot->bins) {
      any = any || bin.count != 0;
      flush_bin(*slot, bin);
    }
  }
  return any;
}

template <class Upstream, class StreamOps>
void basic_caching_allocator<Upstream, StreamOps>::note_cached_free(const block* b) const noexcept {
  if (memory_history* h = history_.load(std::memory_order_acquire)) {
    h->record(memory_action::free_requested, b->address, b->requested, b->owner->key);
    h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
  }
}

template <class Upstream, class StreamOps>
void basic_caching_allocator<Upstream, StreamOps>::note(memory_action action, const block* b) const noexcept {
  if (memory_history* h = history_.load(std::memory_order_acquire)) {
    h->record(action, b->address, b->requested, b->owner->key);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::live_block(std::uintptr_t address) const noexcept
    -> block* {
  typename map_type::version_type version = 0;
  block* b = map_.find(address, version);
  if (b == nullptr || b->in_front.load(std::memory_order_acquire)) return nullptr;
  if (!map_.unchanged(address, version) && map_.find(address) != b) return nullptr;
  return b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::new_block() -> block* {
  if (spare_blocks_ == nullptr) {
    constexpr std::size_t chunk = 256;
    block_chunks_.push_back(std::make_unique<block[]>(chunk));
    block* blocks = block_chunks_.back().get();
    for (std::size_t i = 0; i < chunk; ++i) {
      blocks[i].next = spare_blocks_;
      spare_blocks_ = &blocks[i];
    }
  }
  block* b = spare_blocks_;
  spare_blocks_ = b->next;
  b->next = nullptr;
  return b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::recycle(block* b) noexcept {
  b->address = 0;
  b->size = 0;
  b->requested = 0;
  b->prev = b->free_prev = b->free_next = nullptr;
  b->seg = nullptr;
  b->owner = nullptr;
  b->fence.reset();
  b->recorded.clear();
  b->pending_events = 0;
  b->free_since = 0;
  b->state = block_state::free;
  b->taken_split = false;
  b->split_whole = false;
  b->in_front.store(false, std::memory_order_relaxed);
  b->next = spare_blocks_;
  spare_blocks_ = b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::index_in(stream_state& st, bool small) -> index_type& {
  auto& pool = st.pools[small ? 1 : 0];
  if (!pool) pool = std::make_unique<index_type>();
  return *pool;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::index_of(block* b) -> index_type& {
  return index_in(*b->owner, b->small);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::counts_as_split(const block* b) noexcept {
  return (b->prev != nullptr || b->next != nullptr) && !b->seg->expandable;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::releasable(const block* b, bool quarantine) noexcept {
  return b->state == block_state::free && !(quarantine && b->owner->dead);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::index_free(block* b) {
  index_of(b).insert(b);
  if (counts_as_split(b)) {
    count(st_inactive_split, b->small, 1);
    count(st_inactive_split_bytes, b->small, as_delta(b->size));
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::unindex_free(block* b) noexcept {
  b->owner->pools[b->small ? 1 : 0]->remove(b);
  if (counts_as_split(b)) {
    count(st_inactive_split, b->small, -1);
    count(st_inactive_split_bytes, b->small, -as_delta(b->size));
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::absorb_fence(block* into, block* from) noexcept {
  if (!from->fence) return;
  if (!into->fence || from->fence_sequence > into->fence_sequence) {
    std::swap(into->fence, from->fence);
    into->fence_sequence = from->fence_sequence;
  }
  recycle_event(std::move(from->fence), device_);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::return_to_pool(block* b) {
  b->state = block_state::free;
  b->free_since = ++free_clock_;
  b->requested = 0;
  clear_recorded(b);
  --b->owner->in_use;
  if (b->owner->retired) {
    recycle_event(std::move(b->fence), device_);
    b->owner = heir_of(b);
  }
  insert_free(b);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::joinable(const block* n,
                                                                          const stream_state* owner) const noexcept {
  return n != nullptr && n->state == block_state::free && (n->owner == owner || n->owner == unowned_.get());
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::insert_free(block* b) -> block* {
  stream_state* const owner = b->owner;
  for (block* p = b->prev; joinable(p, owner); p = b->prev) {
    unindex_free(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next != nullptr) b->next->prev = p;
    p->owner = owner;
    p->free_since = std::max(p->free_since, b->free_since);
    absorb_fence(p, b);
    recycle(b);
    b = p;
  }
  for (block* n = b->next; joinable(n, owner); n = b->next) {
    unindex_free(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    b->free_since = std::max(b->free_since, n->free_since);
    absorb_fence(b, n);
    recycle(n);
  }
  index_free(b);
  return b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::find_free(stream_state& st, std::size_t size,
                                                                           bool small, free_search search) -> block* {
  const std::size_t max_split = options_.max_split_size;
  const std::size_t max_waste = options_.max_oversize_waste;
  // max_split_size concerns segments made for one large request; shared segments are always split.
  // With reuse_before_release, a segment made for a huge request serves smaller ones only through it (under
  // pressure), also once split; without, a block of one that has been split (a new segment's rounding) may.
  const bool whole_segment = options_.reuse_before_release;
  auto accept = [this, size, max_split, max_waste, search, whole_segment](const block* candidate) {
    if (search == free_search::mapped_only) return candidate->seg->expandable && !needs_pages(candidate, size);
    const std::size_t kept_size = whole_segment ? candidate->seg->size : candidate->size;
    const bool kept_whole =
        candidate->seg->dedicated && (size < max_split ? kept_size >= max_split : candidate->size - size > max_waste);
    return kept_whole == (search == free_search::kept_whole);
  };
  const int pool = small ? 1 : 0;
  // Pages are mapped in a range for its own stream only: free blocks of different streams do not merge, so streams
  // mapping pages in one range interleave their blocks there, and hold pages none of them can use (under stream
  // churn, peak reserved 2.5x that of the same streams kept; bench_fragmentation). Mapped memory serves any stream
  // that may take the block.
  // A range no stream has is taken over by the first stream without one that finds a block there (found, below).
  auto may_take_over = [&st, pool](const segment* seg) {
    return seg->expandable && seg->range_of == nullptr && st.expandable[pool] == nullptr;
  };
  auto may_map = [this, &st, size, &may_take_over](const block* candidate) {
    const segment* seg = candidate->seg;
    return !seg->expandable || seg->range_of == &st || may_take_over(seg) || !needs_pages(candidate, size);
  };
  auto accept_mapping = [&accept, &may_map](const block* candidate) { return accept(candidate) && may_map(candidate); };
  // (Not in a search for mapped memory, which maps no page; nor for a stream destroyed while the lock was released.)
  auto found = [&](block* b) {
    if (may_take_over(b->seg) && search != free_search::mapped_only && !st.dead && take_over(st, b->seg)) {
      return find_free(st, size, small, search);  // its blocks are st's now, merged (`b` may be gone): once more
    }
    return b;
  };
  if (const auto& index = st.pools[pool]; index && !index->empty()) {
    if (block* b = index->find(size, accept_mapping)) return found(b);
  }
  // Blocks of destroyed streams whose work has completed: no stream can still be using them.
  if (const auto& index = unowned_->pools[pool]; index && !index->empty()) {
    if (block* b = index->find(size, accept_mapping)) return found(b);
  }
  if (!options_.cross_stream_reuse) return nullptr;
  // Another stream's block with a fence makes this stream wait for it (take): on the legacy stream, not while a
  // gpukit capture is underway.
  const bool no_waits = needs_capture_hold(st.stream) && detail::gpukit_capture_underway();
  auto accept_elsewhere = [&accept_mapping, no_waits](const block* candidate) {
    return accept_mapping(candidate) && !(no_waits && candidate->fence);
  };
  for (const auto& other : streams_) {
    if (other.get() == &st || other->dead) continue;  // a destroyed stream's blocks wait for its last work
    if (const auto& index = other->pools[pool]; index && !index->empty()) {
      if (block* b = index->find(size, accept_elsewhere)) return found(b);
    }
  }
  return nullptr;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::take(block* b, stream_state& st, std::size_t size,
                                                                      std::size_t requested) {
  const std::size_t remainder = b->size - size;
  const bool split = should_split(b, size, remainder);
  b->split_whole = false;
  block* rest = split ? new_block() : nullptr;  // the steps that can fail, before anything changes
  if (b->owner != &st) {
    try {
      (void)index_in(st, b->small);  // its free goes to this stream's index: made now, so that the free cannot fail
    } catch (...) {
      if (rest != nullptr) recycle(rest);
      throw;
    }
  }
  unindex_free(b);
  std::unique_ptr<event_type> fence = std::move(b->fence);
  if (b->owner != &st && fence) {
    const auto put_back = [&] {  // as it was found
      b->fence = std::move(fence);
      index_free(b);
      if (rest != nullptr) recycle(rest);
    };
    bool refused = false;
    try {
      const detail::capture_hold hold(needs_capture_hold(st.stream));  // until the wait is enqueued
      refused = hold.refused();
      if (!refused) ops_.wait(*fence, st.stream);  // the new stream waits for the old one's work, on the device
    } catch (...) {
      put_back();
      throw;
    }
    if (refused) {
      // A wait on the legacy stream would invalidate the gpukit capture begun since find_free looked: left as it
      // was, for a search that passes over fenced blocks.
      put_back();
      return false;
    }
  }
  if (split) {
    rest->address = b->address + size;
    rest->size = remainder;
    rest->seg = b->seg;
    rest->owner = b->owner;  // the remainder stays with the stream it was cached for
    rest->small = b->small;
    rest->state = block_state::free;
    rest->free_since = b->free_since;  // its memory has been free as long
    rest->prev = b;
    rest->next = b->next;
    if (b->next != nullptr) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    rest->fence = std::move(fence);  // the old stream's work may still use the remainder's memory
    rest->fence_sequence = b->fence_sequence;
    index_free(rest);
  } else {
    recycle_event(std::move(fence), device_);
  }
  b->owner = &st;
  ++st.in_use;
  b->state = block_state::allocated;
  b->requested = requested;
  b->taken_split = counts_as_split(b);
  b->partly_mapped = !split && b->seg->expandable && needs_pages(b, b->size);
  count(st_allocation, b->small, 1);
  count(st_allocated_bytes, b->small, as_delta(b->size));
  count(st_active, b->small, 1);
  count(st_active_bytes, b->small, as_delta(b->size));
  count(st_requested_bytes, b->small, as_delta(requested));
  return true;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::owner_may_be_busy(const block* b,
                                                                                   bool owner_gone) const {
  return !owner_gone && needs_fence_ && ops_.may_have_pending_work(b->owner->stream);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::free_allocated(block* b, bool owner_busy,
                                                                                bool user_free) {
  std::unique_ptr<event_type> fence;
  struct use {
    stream_state* stream;
    std::unique_ptr<event_type> event;  // null: the stream was destroyed, its last work is waited for
    bool unrecorded;                    // pending_record::unrecorded
    bool first = false;                 // the stream had no pending event before this one
  };
  std::vector<use> uses;
  std::size_t queued = 0;  // uses whose record is in their stream's queue
  // Events on the legacy default stream are recorded under a capture hold; while a gpukit capture is underway they
  // are recorded after it (record_deferred), and the block stays pending until then.
  bool hold_needed = false;
  if constexpr (detail::has_capture_hold_query<StreamOps>::value) {
    if (owner_busy && !b->owner->dead) hold_needed = needs_capture_hold(b->owner->stream);
    for (const stream_state* user : b->recorded) hold_needed = hold_needed || needs_capture_hold(user->stream);
  }
  detail::capture_hold hold(hold_needed);  // until the events are recorded
  // Also while a capture of a blocking stream begun with the raw runtime holds the legacy stream (no hold sees it; the
  // record would be refused, and the free with it): asked only for such streams, on this rare path.
  const auto deferred = [&](const stream_state& st) {
    return needs_capture_hold(st.stream) && (hold.refused() || detail::legacy_stream_captured(st.device));
  };
  // Destroyed, but not yet noted (the expiration count was read before it changed): from now on no other stream may
  // take its blocks before its last work completes.
  const auto note_if_dead = [&](stream_state* owner) noexcept {
    if constexpr (tracks_lifetimes) {
      if (!owner->dead && expired(*owner)) {
        dead_streams_.push_back(owner);  // cannot throw (register_stream made the room)
        owner->dead = true;
        slots_to_release_ = true;  // not here: this may run under the slot locks (flush_bin)
      }
    }
  };
  try {
    note_if_dead(b->owner);
    // A stream destroyed since the caller asked whether it was busy takes no event (its handle may be another
    // stream's by now): its blocks wait for its last work (retire) instead.
    if (owner_busy && !b->owner->dead) {
      if (deferred(*b->owner)) {
        // No fence: the owner's work is waited for as a user's is, and the block stays pending until then.
        uses.push_back(use{b->owner, acquire_event(device_), true});
      } else {
        fence = acquire_event(device_);
        ops_.record(*fence, b->owner->stream);
        // Destroyed by another thread meanwhile, its handle perhaps a new stream's by the record (the fence then
        // orders only that one's work): dead from now on, as above.
        note_if_dead(b->owner);
      }
    }
    for (stream_state* user : b->recorded) {
      if (expired(*user)) {
        // Destroyed since: no event can be recorded on it; its last work is waited for instead (null event).
        if (!finished(*user)) uses.push_back(use{user, nullptr, false});
        continue;
      }
      uses.push_back(use{user, acquire_event(user->device), deferred(*user)});
      if (!uses.back().unrecorded) {
        record_on(*uses.back().event, *user);
        // Destroyed by another thread meanwhile, its handle perhaps a new stream's by the record (which then ordered
        // only that one's work): its last work is waited for instead, as above.
        if (expired(*user)) recycle_event(std::move(uses.back().event), user->device);
      }
    }
    if (!uses.empty()) pending_streams_.reserve(pending_streams_.size() + uses.size());
    // Last, as they may allocate (a queue's new node): a record without its event first, so that a failure leaves
    // the event here. One use per stream.
    for (; queued < uses.size(); ++queued) {
      use& u = uses[queued];
      u.first = u.stream->pending.empty();
      u.stream->pending.push_back(pending_record{nullptr, b, u.unrecorded});
      u.stream->pending.back().event = std::move(u.event);
    }
  } catch (...) {
    while (queued != 0) {
      use& u = uses[--queued];
      u.event = std::move(u.stream->pending.back().event);
      u.stream->pending.pop_back();
    }
    recycle_event(std::move(fence), device_);
    for (auto& u : uses) recycle_event(std::move(u.event), u.stream->device);
    map_.restore(b->address, b);  // still allocated (cannot throw: no growth)
    throw;
  }
  hold.release();
  if (fence) {
    b->fence = std::move(fence);
    b->fence_sequence = ++fence_counter_;
  }
  memory_history* const h = user_free ? history_.load(std::memory_order_acquire) : nullptr;
  if (h != nullptr) h->record(memory_action::free_requested, b->address, b->requested, b->owner->key);
  count(st_allocation, b->small, -1);
  count(st_allocated_bytes, b->small, -as_delta(b->size));
  count(st_requested_bytes, b->small, -as_delta(b->requested));
  clear_recorded(b);  // the users' pending events (below) keep their states alive
  if (uses.empty()) {
    if (h != nullptr) h->record(memory_action::free_completed, b->address, b->requested, b->owner->key);
    count(st_active, b->small, -1);
    count(st_active_bytes, b->small, -as_delta(b->size));
    return_to_pool(b);
    return;
  }
  b->state = block_state::pending;  // keeps `requested` for the history's free_completed
  b->pending_events = static_cast<std::uint32_t>(uses.size());
  pending_total_ += uses.size();
  for (const use& u : uses) {
    if (u.first && std::find(pending_streams_.begin(), pending_streams_.end(), u.stream) == pending_streams_.end()) {
      pending_streams_.push_back(u.stream);  // reserved above: cannot throw
    }
    if (u.unrecorded) ++unrecorded_;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::within_limit(
    std::size_t segment_bytes) const noexcept {
  const std::size_t reserved = current(stats_.reserved_bytes) + in_flight_;
  return reserved <= limit_ && segment_bytes <= limit_ - reserved;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::grow(std::unique_lock<detail::device_mutex>& lock,
                                                                      stream_state& st, std::size_t size,
                                                                      std::size_t segment_bytes, bool small,
                                                                      bool& limit_hit) -> block* {
  if (!within_limit(segment_bytes)) {
    limit_hit = true;
    return nullptr;
  }
  limit_hit = false;  // the last refusal, if any, is the upstream's
  in_flight_ += segment_bytes;
  lock.unlock();
  void* p = nullptr;
  try {
    p = upstream_.allocate(segment_bytes);
  } catch (const out_of_memory_error&) {
    p = nullptr;  // the upstream contract's other way to refuse (the pinned pool's upstreams throw)
  } catch (...) {
    lock.lock();
    in_flight_ -= segment_bytes;
    throw;
  }
  lock.lock();
  in_flight_ -= segment_bytes;
  if (p == nullptr) return nullptr;
  if (!within_limit(segment_bytes)) {  // lowered meanwhile (set_reserved_limit from another thread): kept no more
    lock.unlock();
    upstream_.deallocate(p, segment_bytes);
    lock.lock();
    limit_hit = true;
    return nullptr;
  }
  std::unique_ptr<segment> seg;
  block* b = nullptr;
  try {
    seg = std::make_unique<segment>();
    b = new_block();
    b->owner = &st;
    b->small = small;
    (void)index_of(b);
  } catch (...) {
    if (b != nullptr) recycle(b);
    lock.unlock();
    upstream_.deallocate(p, segment_bytes);
    lock.lock();
    throw;
  }
  seg->dedicated = !small && size >= options_.own_segment_size();
  link_segment(std::move(seg), b, reinterpret_cast<std::uintptr_t>(p), segment_bytes, small);
  count(st_reserved_bytes, small, as_delta(segment_bytes));
  stats_.num_device_alloc.increment();
  high_water_ = std::max(high_water_, current(stats_.reserved_bytes));
  return b;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::link_segment(std::unique_ptr<segment> seg, block* b,
                                                                              std::uintptr_t address, std::size_t bytes,
                                                                              bool small) {
  seg->address = address;
  seg->size = bytes;
  seg->small = small;
  seg->first = b;
  seg->next_segment = segments_;
  if (segments_ != nullptr) segments_->prev_segment = seg.get();
  segments_ = seg.release();
  b->address = address;
  b->size = bytes;
  b->seg = segments_;
  b->state = block_state::free;
  b->free_since = ++free_clock_;
  index_free(b);
  count(st_segment, small, 1);
  // An expandable segment's reserved range is no memory yet: its pages are recorded as they are mapped.
  if (memory_history* h = history_.load(std::memory_order_acquire); h != nullptr && !segments_->expandable) {
    h->record(memory_action::segment_alloc, address, bytes, 0);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::grow_expandable(stream_state& st, std::size_t size,
                                                                                 bool small, std::size_t& refused_range)
    -> block* {
  if constexpr (has_vm) {
    if (!options_.expandable_segments || st.expandable[small ? 1 : 0] != nullptr || vm_refused_) return nullptr;
    if constexpr (detail::has_virtual_memory_query<Upstream>::value) {
      if (!upstream_.virtual_memory_supported()) {
        vm_refused_ = true;
        detail::warn_parts("gpukit: expandable segments were asked for the caching allocator of ", device_,
                           detail::no_device_virtual_memory, ": ordinary segments are used");
        return nullptr;
      }
    }
    const std::size_t page = upstream_.page_size();
    const upstream_memory_info info = memory_info_quietly();
    if (!info.known || info.total_bytes == 0 || page == 0) {
      if (options_.expandable_segments_required) {
        throw no_device_error(detail::expandable_segments_required_for + device_.to_string() +
                                  ", but the size of its memory (or its page) is unknown: no "
                                  "address range could be sized",
                              cudaSuccess, {}, device_ordinal());
      }
      vm_refused_ = true;  // once, rather than asked again at every growth
      detail::warn_parts("gpukit: expandable segments were asked for the caching allocator of ", device_,
                         ", but the size of its memory (or its page) is unknown, so no address range could be sized: "
                         "ordinary segments are used");
      return nullptr;
    }
    // The device's memory and an eighth, as PyTorch (at most 4 TiB): holes left by freed blocks use address space
    // too, but best fit keeps them few (bench_fragmentation's minimum capacities are those of ranges four times as
    // large), and every stream's two ranges share the process's address space (2^47 bytes).
    const std::size_t limit = std::size_t{1} << 42;
    const std::size_t total = std::min(info.total_bytes, limit / 9 * 8);
    const std::size_t range = (total + total / 8 + page - 1) / page * page;
    if (range < size) return nullptr;
    auto seg = std::make_unique<segment>();
    block* b = new_block();
    b->owner = &st;
    b->small = small;
    try {
      seg->pages = detail::page_map(range / page, page);
      (void)index_of(b);
    } catch (...) {
      recycle(b);
      throw;
    }
    void* p = nullptr;
    try {
      p = upstream_.reserve(range);  // a driver error throws
    } catch (...) {
      recycle(b);
      throw;
    }
    if (p == nullptr) {
      recycle(b);
      refused_range = range;  // allocate_slow says so (with the request and the lock) if ranges are required
      if (!options_.expandable_segments_required) {
        // Once, rather than a reservation tried at every growth and streams left with both kinds of segment.
        vm_refused_ = true;
        detail::warn_parts("gpukit: expandable segments were asked for the caching allocator of ", device_,
                           ", but a virtual address range of ", detail::bytes_part{range},
                           " could not be reserved (this allocator holds ",
                           detail::bytes_part{address_space_.load(std::memory_order_relaxed)},
                           " of address space): ordinary segments are used from now on");
      }
      return nullptr;
    }
    seg->expandable = true;
    seg->range_of = &st;
    link_segment(std::move(seg), b, reinterpret_cast<std::uintptr_t>(p), range, small);
    address_space_.store(address_space_.load(std::memory_order_relaxed) + range, std::memory_order_relaxed);
    st.expandable[small ? 1 : 0] = segments_;
    return find_free(st, size, small);
  } else {
    (void)st;
    (void)size;
    (void)small;
    return nullptr;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::map_pages(block* b, std::size_t size,
                                                                           bool& limit_hit) {
  if constexpr (has_vm) {
    segment* seg = b->seg;
    const std::size_t page = seg->pages.page_size();
    const auto touched = seg->pages.touched_by(b->address - seg->address, size);
    std::vector<std::size_t> missing;
    for (std::size_t i = touched.first; i < touched.end; ++i) {
      if (!seg->pages.is_mapped(i)) missing.push_back(i);
    }
    if (missing.empty()) return true;  // cached memory: no limit to check (reserved may be above a lowered one)
    limit_hit = !within_limit(missing.size() * page);  // all or none: a refused request leaves nothing mapped
    if (limit_hit) return false;
    std::size_t mapped = 0;
    try {
      while (mapped < missing.size() &&
             upstream_.map(reinterpret_cast<void*>(seg->address + missing[mapped] * page), page)) {
        ++mapped;
      }
    } catch (...) {
      unmap_unused(seg, missing.data(), mapped);
      throw;
    }
    if (mapped < missing.size()) {  // the device is out of memory: the pages of this request go back, as PyTorch's
      unmap_unused(seg, missing.data(), mapped);  // expandable segments do
      return false;
    }
    for (const std::size_t i : missing) note_mapped(seg, i);
    return true;
  } else {
    (void)b;
    (void)size;
    (void)limit_hit;
    return true;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::note_mapped(segment* seg, std::size_t i) noexcept {
  const std::size_t page = seg->pages.page_size();
  if (memory_history* h = history_.load(std::memory_order_acquire)) {
    h->record(memory_action::segment_map, seg->address + i * page, page, 0);
  }
  seg->pages.set_mapped(i);
  expandable_mapped_.store(expandable_mapped_.load(std::memory_order_relaxed) + page, std::memory_order_relaxed);
  count(st_reserved_bytes, seg->small, as_delta(page));
  stats_.num_device_alloc.increment();
  high_water_ = std::max(high_water_, current(stats_.reserved_bytes));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::unmap_unused(segment* seg, const std::size_t* pages,
                                                                              std::size_t n) noexcept {
  const std::size_t page = seg->pages.page_size();
  for (std::size_t k = 0; k < n; ++k) {
    // No work has used these pages: nothing to wait for. One the upstream keeps mapped is cached memory.
    if (!upstream_unmap(seg->address + pages[k] * page, page, true)) note_mapped(seg, pages[k]);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::back_with_pages(
    std::unique_lock<detail::device_mutex>& lock, stream_state& st, block* b, std::size_t requested, std::size_t size,
    bool small) -> block* {
  // Mapping pages grows the footprint: as before a new segment, cached large blocks go back to the heap first, so
  // that one of them (coalesced with its free neighbours) can serve the request with pages already mapped; else
  // each size would keep its own pages mapped in its bin (found by review: 304 MiB reserved against 160). Small
  // blocks stay cached: they hold little of a 2 MiB page, and taking them back at every page moved the minimum
  // capacity of the small transformer traces the wrong way (bench_fragmentation, L2 h256: 1.054 to 1.069).
  if (front_cache_large_.load(std::memory_order_relaxed) && needs_pages(b, size) && flush_fronts(true)) {
    b = find_free(st, size, small);  // the flush may have merged `b` away
    if (b == nullptr) b = allocate_slow(lock, st, requested, size, small);
    if (!b->seg->expandable) return b;
  }
  bool limit_hit = false;
  if (map_pages(b, size, limit_hit)) return b;
  for (const bool wait_pending : {false, true}) {
    release_cached(lock, wait_pending, 0);
    stats_.num_alloc_retries.increment();
    b = find_free(st, size, small);
    if (b == nullptr) b = allocate_slow(lock, st, requested, size, small);
    if (!b->seg->expandable || map_pages(b, size, limit_hit)) return b;
  }
  if (release_elsewhere(lock, limit_hit)) {  // as allocate_slow's last resort
    b = find_free(st, size, small);
    if (b == nullptr) b = allocate_slow(lock, st, requested, size, small);
    if (!b->seg->expandable || map_pages(b, size, limit_hit)) return b;
  }
  // Best fit chose a block that needs pages the device cannot back, where another free block may hold the request
  // in mapped pages already (a hole's mapped start, when a range's unmapped end fits more tightly). Only now: taken
  // before the releases above, it raised bench_fragmentation's minimum capacities (L24 h1024: 1.006 to 1.007).
  if (block* mapped = find_free(st, size, small, free_search::mapped_only)) return mapped;
  const detail::page_map& pages = b->seg->pages;  // what the request still lacks, in pages
  const std::size_t missing = pages.unmapped_count(pages.touched_by(b->address - b->seg->address, size));
  throw_out_of_memory(lock, requested, size, missing * pages.page_size(), limit_hit, pages.page_size());
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::release_elsewhere(
    std::unique_lock<detail::device_mutex>& lock, bool limit_hit) {
  if constexpr (detail::has_release_elsewhere<Upstream>::value) {
    if (limit_hit) return false;  // our own limit: memory elsewhere would not help
    lock.unlock();
    (void)upstream_.release_unused_elsewhere();
    lock.lock();
    return true;
  } else {
    (void)lock;
    (void)limit_hit;
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::needs_pages(const block* b,
                                                                             std::size_t size) const noexcept {
  const detail::page_map& pages = b->seg->pages;
  return pages.any_unmapped(pages.touched_by(b->address - b->seg->address, size));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::recordable(const stream_state& st) const noexcept {
  if constexpr (tracks_lifetimes) {
    if (st.tracker) return true;  // a tracked stream (the caller checked that it is not destroyed)
    if constexpr (std::is_same<stream_type, stream_view>::value) {
      return st.stream.is_default();  // CUDA's legacy or per-thread stream (or the CPU's): never destroyed
    } else {
      return false;
    }
  } else {
    (void)st;
    return true;  // streams outlive the memory they are used with
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::captured_now(const stream_state& st) const noexcept {
  if constexpr (detail::has_capture_query<StreamOps>::value) {
    try {
      return ops_.capturing(st.stream);
    } catch (...) {
      return true;  // cannot be told: not waited for
    }
  } else {
    (void)st;
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::wait_for_unmap(
    std::unique_lock<detail::device_mutex>& lock, const std::vector<segment*>* ranges, bool unlocked,
    unmap_wait& w) noexcept {
  w.every_stream = false;
  w.streams.clear();
  w.horizon = free_clock_;  // under the lock, with every event below recorded before it is released
  if constexpr (has_vm && detail::has_unmap_after_wait<Upstream>::value) {
    constexpr bool per_stream = detail::has_unmap_wait_for_events<Upstream, event_type>::value;
    struct owner_wait {
      stream_state* st;
      tracker_type tracker;  // a destroyed stream: its last work is waited for (wait_finished)
      std::unique_ptr<event_type> event;
      bool dead;
      gpukit::device device;  // st's, read under the lock: `st` may be pruned while the lock is released for the wait
    };
    std::vector<owner_wait> waits;
    std::vector<const event_type*> events;
    // The runtime was torn down (process exit): no work runs any more, so every page may go (as the upstream's own
    // waits answer then).
    bool torn_down = false;
    const auto teardown = [](const error& e) noexcept { return detail::is_teardown_result(e.cuda_result()); };
    try {
      // The streams whose work may use the pages: each block's owner (and, for a live block at destruction, the
      // streams recorded for it).
      std::vector<stream_state*> owners;
      const auto add = [&](stream_state* st) {
        if (st == unowned_.get() || st->retired) return;  // no work of any stream can still use its blocks
        if (std::find(owners.begin(), owners.end(), st) == owners.end()) owners.push_back(st);
      };
      const bool quarantine = !upstream_.synchronizes_on_free();
      const auto consider = [&](segment* seg, bool every_block) {
        if (!seg->expandable || seg->mapped() == 0) return;
        for (block* b = seg->first; b != nullptr; b = b->next) {
          if (!every_block && !releasable(b, quarantine)) continue;
          if (!on_mapped_page(seg, b)) continue;
          add(b->owner);
          for (stream_state* user : b->recorded) add(user);
        }
      };
      if (ranges != nullptr) {
        for (segment* seg : *ranges) consider(seg, true);
      } else {
        for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) consider(seg, false);
      }
      bool device = false;  // an owner that only a wait for the whole device reaches
      // An owner being captured: nothing may wait for it, nor for the device (nor may the device be waited for while a
      // gpukit capture runs on another thread: cudaDeviceSynchronize would invalidate it).
      bool captured = false;
      waits.reserve(owners.size());
      for (stream_state* st : owners) {
        if (expired(*st)) {
          waits.push_back(owner_wait{st, st->tracker, nullptr, true, st->device});
        } else if (!recordable(*st)) {
          device = true;  // a raw handle is not asked whether it is captured: it may have been destroyed
        } else if (captured_now(*st)) {
          captured = true;
        } else if (!per_stream) {
          device = true;
        } else {
          waits.push_back(owner_wait{st, tracker_type{}, nullptr, false, st->device});
        }
      }
      // The device-wide wait would invalidate a capture in sight (a gpukit one, or a raw capture of a blocking stream
      // of the device; in any mode): the raw handles' pages stay, and the other owners' events are waited for.
      if (device && detail::capture_in_sight(device_)) captured = true;
      if (device && !captured) {
        waits.clear();  // the device's wait covers every stream
        if (unlocked) lock.unlock();
        const bool idle = upstream_.wait_before_unmap();  // reported by the upstream when it fails
        if (unlocked) lock.lock();
        w.every_stream = idle;
        return;
      }
      events.reserve(waits.size());
      w.streams.reserve(waits.size());
      for (owner_wait& x : waits) {
        if (x.dead) continue;
        try {
          // The legacy default stream: under a capture hold, as every record there (refused while a gpukit capture
          // is underway, which an event there would invalidate: not waited for then).
          const detail::capture_hold hold(needs_capture_hold(x.st->stream));
          if (hold.refused()) {
            x.st = nullptr;
            continue;
          }
          x.event = acquire_event(x.device);
          record_on(*x.event, *x.st);  // refuses a captured stream
        } catch (const error& e) {
          torn_down = torn_down || teardown(e);
          recycle_event(std::move(x.event), x.device);
          x.st = nullptr;
          continue;
        } catch (...) {
          recycle_event(std::move(x.event), x.device);
          x.st = nullptr;
          continue;
        }
        if (expired(*x.st)) {
          // Destroyed by another thread meanwhile (its handle perhaps a new stream's by the record): its last work.
          recycle_event(std::move(x.event), x.device);
          x.tracker = x.st->tracker;
          x.dead = true;
        } else if (captured_now(*x.st)) {  // captured since it was asked: the event may be the graph's
          recycle_event(std::move(x.event), x.device);
          x.st = nullptr;
        } else {
          events.push_back(x.event.get());
        }
      }
    } catch (...) {  // no memory: nothing is waited for, nothing covered
      for (owner_wait& x : waits) {
        if (x.event) recycle_event(std::move(x.event), x.device);
      }
      return;
    }
    if (torn_down) {
      for (owner_wait& x : waits) {
        if (x.event) recycle_event(std::move(x.event), x.device);
      }
      w.every_stream = true;
      return;
    }
    if (unlocked) lock.unlock();
    bool events_done = true;
    if constexpr (per_stream) {
      if (!events.empty()) events_done = upstream_.wait_before_unmap(events);  // reported by the upstream
    }
    for (owner_wait& x : waits) {
      if (x.st == nullptr || !x.dead) continue;
      if constexpr (tracks_lifetimes) {
        try {
          ops_.wait_finished(x.tracker);
        } catch (const error& e) {
          if (!teardown(e)) {
            detail::warn_parts("gpukit: waiting for the work of a destroyed stream before unmapping pages failed: ",
                               e.what());
            x.st = nullptr;
          }
        } catch (const std::exception& e) {
          detail::warn_parts("gpukit: waiting for the work of a destroyed stream before unmapping pages failed: ",
                             e.what());
          x.st = nullptr;
        } catch (...) {
          warn("gpukit: waiting for the work of a destroyed stream before unmapping pages failed");
          x.st = nullptr;
        }
      }
    }
    if (unlocked) lock.lock();
    for (owner_wait& x : waits) {
      if (x.st == nullptr) continue;
      if (x.dead || events_done) w.streams.push_back(x.st);  // reserved above: cannot throw
      if (x.event) recycle_event(std::move(x.event), x.device);
    }
  } else {
    // Its unmap waits by itself, each time, under the lock: every page free by then may go.
    (void)lock;
    (void)ranges;
    (void)unlocked;
    w.every_stream = true;
    w.horizon = std::numeric_limits<std::uint64_t>::max();
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::covers(const unmap_wait& w,
                                                                        const block* b) const noexcept {
  if (b->free_since > w.horizon) return false;  // freed since: its stream may have queued work after the wait
  if (w.every_stream) return true;
  const auto waited = [&](const stream_state* st) {
    return st == unowned_.get() || st->retired || std::find(w.streams.begin(), w.streams.end(), st) != w.streams.end();
  };
  if (!waited(b->owner)) return false;
  return std::all_of(b->recorded.begin(), b->recorded.end(), waited);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::unmap_free_pages(std::size_t target,
                                                                                         const unmap_wait& w) {
  if constexpr (has_vm) {
    const auto target_met = [&] { return target != 0 && current(stats_.reserved_bytes) <= target; };
    if (!options_.expandable_segments || target_met()) return 0;
    constexpr bool waits_apart = detail::has_unmap_after_wait<Upstream>::value;
    const bool quarantine = !upstream_.synchronizes_on_free();
    std::size_t unmapped = 0;
    for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      if (!seg->expandable || seg->mapped() == 0) continue;
      const std::size_t page = seg->pages.page_size();
      for (block* b = seg->first; b != nullptr; b = b->next) {
        if (target_met()) return unmapped;
        if (!releasable(b, quarantine) || !covers(w, b)) continue;
        const auto inside = free_pages_of(seg, b, &w, quarantine);
        for (std::size_t i = inside.first; i < inside.end;) {
          if (!seg->pages.is_mapped(i)) {
            ++i;
            continue;
          }
          if (b->fence) {
            synchronize_quietly(*b->fence);  // after the wait (waits_apart), completed already
            recycle_event(std::move(b->fence), device_);
          }
          const std::size_t run = unmap_run(seg, i, inside.end, waits_apart);
          if (run == 0) return unmapped;  // the device could not be waited for: nothing more is unmapped now
          unmapped += run * page;
          count(st_reserved_bytes, seg->small, -as_delta(run * page));
          i += run;
        }
      }
    }
    return unmapped;
  } else {
    (void)target;
    (void)w;
    return 0;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::give_to_heirs(const unmap_wait& w) noexcept {
  if constexpr (has_vm) {
    // Without a wait of its own before unmapping, the upstream waited in unmap: `w` covers nothing then.
    constexpr bool waits_apart = detail::has_unmap_after_wait<Upstream>::value;
    const bool quarantine = !upstream_.synchronizes_on_free();
    for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      if (!seg->expandable) continue;
      for (block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state != block_state::free) continue;
        stream_state* const heir = heir_of(b);
        if (b->owner == heir) continue;
        const bool done = !on_mapped_page(seg, b) || (waits_apart && releasable(b, quarantine) && covers(w, b));
        if (!done) continue;
        try {
          (void)index_in(*heir, b->small);  // the only step that can fail: then the block stays where it is
        } catch (...) {
          continue;
        }
        b = give_free_block(b, heir);  // cannot throw: the heir's index exists
      }
    }
  } else {
    (void)w;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::has_unmappable_pages() const noexcept {
  const bool quarantine = !upstream_.synchronizes_on_free();
  for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
    if (!seg->expandable || seg->mapped() == 0) continue;
    for (const block* b = seg->first; b != nullptr; b = b->next) {
      if (!releasable(b, quarantine)) continue;
      if (seg->pages.any_mapped(free_pages_of(seg, b, nullptr, quarantine))) return true;
    }
  }
  return false;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::on_mapped_page(const segment* seg,
                                                                                const block* b) noexcept {
  return seg->pages.any_mapped(seg->pages.touched_by(b->address - seg->address, b->size));
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE detail::page_map::page_range basic_caching_allocator<Upstream, StreamOps>::free_pages_of(
    const segment* seg, const block* b, const unmap_wait* w, bool quarantine) const noexcept {
  const detail::page_map& pages = seg->pages;
  const std::size_t page = pages.page_size();
  const std::size_t offset = b->address - seg->address;
  const detail::page_map::page_range touched = pages.touched_by(offset, b->size);
  const detail::page_map::page_range inside = pages.inside(offset, b->size);
  // Whether every other block on page `i` is free too (and covered by `w`): blocks of different streams are not
  // merged (cross_stream_reuse), so a page between two free ones lies wholly in neither.
  const auto shared_page_free = [&](std::size_t i) {
    const std::uintptr_t start = seg->address + i * page;
    const auto gone = [&](const block* n) { return releasable(n, quarantine) && (w == nullptr || covers(*w, n)); };
    for (const block* n = b->prev; n != nullptr && n->address + n->size > start; n = n->prev) {
      if (!gone(n)) return false;
    }
    for (const block* n = b->next; n != nullptr && n->address < start + page; n = n->next) {
      if (!gone(n)) return false;
    }
    return true;
  };
  const std::size_t last = touched.end - 1;
  detail::page_map::page_range free_pages = inside;
  if (touched.first < inside.first && shared_page_free(touched.first)) free_pages.first = touched.first;
  if (last >= inside.end && shared_page_free(last)) free_pages.end = last + 1;
  return free_pages;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::has_pages_to_release(
    const std::vector<segment*>& victims) const noexcept {
  if (!has_vm || !options_.expandable_segments) return false;
  const bool ranges = std::any_of(victims.begin(), victims.end(),
                                  [](const segment* seg) { return seg->expandable && seg->mapped() != 0; });
  return ranges || has_unmappable_pages();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::unmap_victims(std::vector<segment*>& victims,
                                                                                      const unmap_wait& w,
                                                                                      bool recheck) {
  std::vector<segment*> free_now;
  if (recheck) free_now = free_segments();
  constexpr bool waits_apart = detail::has_unmap_after_wait<Upstream>::value;
  std::size_t unmapped = 0;
  auto kept = victims.begin();
  for (segment* seg : victims) {
    // Compared before anything of it is read: one released by another thread meanwhile is gone.
    if (recheck && std::find(free_now.begin(), free_now.end(), seg) == free_now.end()) continue;
    if (has_vm && seg->expandable && seg->mapped() != 0) {
      bool all = true;
      for (const block* b = seg->first; b != nullptr && all; b = b->next) {
        if (on_mapped_page(seg, b)) all = covers(w, b);  // the others' streams were not waited for, nor need be
      }
      const std::size_t page = seg->pages.page_size();
      for (std::size_t i = 0; all && i < seg->pages.page_count();) {
        if (!seg->pages.is_mapped(i)) {
          ++i;
          continue;
        }
        const std::size_t run = unmap_run(seg, i, seg->pages.page_count(), waits_apart);
        all = run != 0;  // the upstream kept them mapped (its unmap could not wait)
        unmapped += run * page;
        count(st_reserved_bytes, seg->small, -as_delta(run * page));
        i += run;
      }
      if (!all) continue;  // stays linked and counted: a later release unmaps its pages
    }
    *kept++ = seg;
  }
  victims.erase(kept, victims.end());
  return unmapped;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::unmap_run(segment* seg, std::size_t i,
                                                                                  std::size_t end,
                                                                                  bool waited) noexcept {
  const std::size_t page = seg->pages.page_size();
  const std::size_t n = seg->pages.mapped_run(i, end);
  if (n == 0 || !upstream_unmap(seg->address + i * page, n * page, waited)) return 0;
  seg->pages.set_unmapped({i, i + n});
  expandable_mapped_.store(expandable_mapped_.load(std::memory_order_relaxed) - n * page, std::memory_order_relaxed);
  if (memory_history* h = history_.load(std::memory_order_acquire); h != nullptr) {
    h->record(memory_action::segment_unmap, seg->address + i * page, n * page, 0);
  }
  for (std::size_t k = 0; k < n; ++k) stats_.num_device_free.increment();
  return n;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::upstream_unmap(std::uintptr_t address,
                                                                                std::size_t bytes,
                                                                                bool waited) noexcept {
  if constexpr (has_vm) {
    if constexpr (detail::has_unmap_after_wait<Upstream>::value) {
      if (waited) return upstream_.unmap_after_wait(reinterpret_cast<void*>(address), bytes);
    } else {
      (void)waited;
    }
    if constexpr (std::is_same_v<decltype(upstream_.unmap(nullptr, bytes)), bool>) {
      return upstream_.unmap(reinterpret_cast<void*>(address), bytes);
    } else {
      upstream_.unmap(reinterpret_cast<void*>(address), bytes);
      return true;
    }
  } else {
    (void)address;
    (void)bytes;
    (void)waited;
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::forget_expandable(const segment* seg) noexcept {
  auto forget = [seg](stream_state& st) {
    for (segment*& e : st.expandable) {
      if (e == seg) e = nullptr;
    }
  };
  for (auto& st : streams_) forget(*st);
  forget(*unowned_);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::order_release(const segment& seg) noexcept
    -> ordered_release {
  ordered_release o;
  if constexpr (detail::has_ordered_release<Upstream, event_type>::value && tracks_lifetimes) {
    if (seg.expandable) return o;
    std::vector<const stream_state*> owners;
    const auto alive = [this](const stream_state* owner) {
      return owner->tracker && !owner->dead && !ops_.expired(owner->tracker);
    };
    bool orderable = true;
    try {
      for (const block* b = seg.first; b != nullptr; b = b->next) {
        const stream_state* owner = b->owner;
        if (owner == unowned_.get() || owner->retired) continue;  // no work of any stream can still use it
        if (!alive(owner)) return o;
        if (std::find(owners.begin(), owners.end(), owner) == owners.end()) owners.push_back(owner);
      }
      for (const stream_state* owner : owners) {
        auto e = acquire_event(device_);
        ops_.record(*e, owner->stream);  // refuses a captured stream
        o.after.push_back(std::move(e));
      }
      // Destroyed (its handle maybe reused) or captured since it was asked: the events may be on the wrong work.
      for (const stream_state* owner : owners) {
        bool captured = false;
        if constexpr (detail::has_capture_query<StreamOps>::value) captured = ops_.capturing(owner->stream);
        orderable = orderable && alive(owner) && !captured;
      }
    } catch (...) {  // no memory, no event, or a captured stream
      orderable = false;
    }
    if (!orderable) {  // the upstream's deallocate (which waits) instead
      for (auto& e : o.after) recycle_event(std::move(e), device_);
      o.after.clear();
      return o;
    }
    o.possible = true;
  } else {
    (void)seg;
  }
  return o;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::deallocate_in_order(
    const segment* seg, const ordered_release& ordered) noexcept {
  if constexpr (detail::has_ordered_release<Upstream, event_type>::value) {
    if (!ordered.possible) return false;
    std::vector<const event_type*> after;
    try {
      after.reserve(ordered.after.size());
    } catch (...) {
      return false;  // no memory for the list
    }
    for (const auto& e : ordered.after) after.push_back(e.get());
    return upstream_.deallocate_after(reinterpret_cast<void*>(seg->address), seg->size, after);
  } else {
    (void)seg;
    (void)ordered;
    return false;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::record_segment_free(const segment& seg) noexcept {
  // Recorded where the segment leaves the statistics and snapshots (under the lock), so that a snapshot's own event
  // and its segments agree; and before the upstream call: once freed, the memory may be another thread's new
  // segment, whose segment_alloc must come after this. An expandable range records its pages' unmaps instead.
  if (seg.expandable) return;
  if (memory_history* h = history_.load(std::memory_order_acquire); h != nullptr) {
    h->record(memory_action::segment_free, seg.address, seg.size, 0);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::return_segment(
    segment* seg, const ordered_release& ordered) noexcept {
  if constexpr (has_vm) {
    if (seg->expandable) {
      // Its pages were unmapped while it was linked (unmap_victims), so nothing is waited for here.
      if (seg->mapped() == 0) {
        upstream_.unreserve(reinterpret_cast<void*>(seg->address), seg->size);
      } else {  // the destructor's only: pages the device may still use stay mapped, and the range is kept (leaked)
        detail::warn_parts("gpukit: the caching allocator of ", device_, " keeps an expandable segment of ", seg->size,
                           " bytes reserved: its pages could not be unmapped");
      }
      return;
    }
  }
  if (!deallocate_in_order(seg, ordered)) upstream_.deallocate(reinterpret_cast<void*>(seg->address), seg->size);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::allocate_slow(
    std::unique_lock<detail::device_mutex>& lock, stream_state& st, std::size_t requested, std::size_t size, bool small)
    -> block* {
  std::size_t refused_range = 0;
  if (block* b = grow_expandable(st, size, small, refused_range)) return b;
  if (refused_range != 0 && options_.expandable_segments_required) {
    throw_out_of_memory(
        lock, requested, size, refused_range, false, 0,
        "expandable segments are required and a virtual address range of " + detail::format_bytes(refused_range) +
            " could not be reserved (each stream's small and large pools reserve one; this "
            "allocator holds " +
            detail::format_bytes(address_space_.load(std::memory_order_relaxed)) + " of address space)");
  }
  std::size_t segment_bytes = fitted_segment_size(size, small);
  bool limit_hit = false;
  if (options_.release_before_grow) {
    const std::size_t reserved = current(stats_.reserved_bytes) + in_flight_;
    const std::size_t room = high_water_ > reserved ? high_water_ - reserved : 0;
    if (segment_bytes > room && release_for_growth(lock, segment_bytes - room) > 0) {
      if (block* b = find_free(st, size, small)) return b;  // freed by another thread meanwhile
    }
  }
  if (release_abandoned(lock) > 0) {
    if (block* b = find_free(st, size, small)) return b;
  }
  if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
  // The upstream (or the limit) refused. Other threads may have freed memory while the lock was released.
  if (block* b = find_free(st, size, small)) return b;
  if (options_.reuse_before_release && !(has_vm && options_.expandable_segments && !vm_refused_)) {
    // Memory kept whole serves the request before anything is given back; then only what the segment needs goes.
    if (block* b = find_free(st, size, small, free_search::kept_whole)) {
      b->split_whole = true;
      return b;
    }
    for (bool short_of_room = true; short_of_room;) {
      const std::size_t shortfall = growth_shortfall(lock, segment_bytes, limit_hit);
      if (release_for_growth(lock, shortfall, false) == 0) break;
      stats_.num_alloc_retries.increment();
      if (block* b = find_free(st, size, small)) return b;
      if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
      // Refused with room enough (the device's own fragmentation, a bounded resource, segments held back during a
      // capture): the smallest segment once (a shortfall of 0), then everything.
      short_of_room = shortfall != 0;
    }
  }
  // First retry: give back the free segments (waiting only for fences of work that may still use them). The
  // segment is sized again: it grows with reserved memory, which just shrank.
  if (release_cached(lock, false, 0) > 0) {
    stats_.num_alloc_retries.increment();
    if (block* b = find_free(st, size, small)) return b;
    segment_bytes = fitted_segment_size(size, small);
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
  }
  // Last retry, always made (the failure may have been transient): wait for blocks that other streams still
  // use, give back everything free, and try once more.
  release_cached(lock, true, 0);
  stats_.num_alloc_retries.increment();
  if (block* b = find_free(st, size, small)) return b;
  // The segment sized for the footprint, then, as it may not fit where the request does, the smallest ones that hold
  // it: first a few such requests with nothing lost to rounding (two of 5 MiB: 10 MiB), then the request alone.
  const auto grow_fitted_or_smaller = [&]() -> block* {
    segment_bytes = fitted_segment_size(size, small);
    if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    for (const std::size_t smaller : {detail::segment_sizing::unrounded(options_, size, small),
                                      detail::segment_sizing::minimal(options_, size, small)}) {
      if (smaller >= segment_bytes) continue;
      segment_bytes = smaller;
      if (block* b = grow(lock, st, size, segment_bytes, small, limit_hit)) return b;
    }
    return nullptr;
  };
  if (block* b = grow_fitted_or_smaller()) return b;
  // Last resort: memory held outside the allocator (another user's memory pool), only once nothing of ours fits;
  // tried again even when this call freed nothing, since another thread's may just have.
  if (release_elsewhere(lock, limit_hit)) {
    if (block* b = find_free(st, size, small)) return b;
    if (block* b = grow_fitted_or_smaller()) return b;
  }
  throw_out_of_memory(lock, requested, size, segment_bytes, limit_hit);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE upstream_memory_info basic_caching_allocator<Upstream, StreamOps>::memory_info_quietly() const noexcept {
  try {
    return upstream_.memory_info();
  } catch (...) {
    return {};  // unknown
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::growth_shortfall(
    std::unique_lock<detail::device_mutex>& lock, std::size_t segment_bytes, bool limit_hit) {
  std::size_t room = 0;
  if (limit_hit) {
    const std::size_t taken = current(stats_.reserved_bytes) + in_flight_;
    room = limit_ > taken ? limit_ - taken : 0;
  } else {
    lock.unlock();  // the upstream may ask the driver (cudaMemGetInfo)
    const upstream_memory_info info = memory_info_quietly();
    lock.lock();
    if (info.known) room = info.free_bytes;  // unknown: the whole segment is short
  }
  return segment_bytes > room ? segment_bytes - room : 0;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::release_cached(
    std::unique_lock<detail::device_mutex>& lock, bool wait_pending, std::size_t target, bool wait_unlocked) {
  flush_fronts();
  if (wait_pending) {
    wait_for_pending_events(lock);
    wait_for_dead_streams(lock);
  }
  const auto choose = [&] {
    std::vector<segment*> victims = free_segments();
    if (target != 0) {
      std::sort(victims.begin(), victims.end(),
                [](const segment* a, const segment* b) { return a->mapped() > b->mapped(); });
      std::size_t reserved = current(stats_.reserved_bytes);
      std::size_t keep = 0;
      while (keep < victims.size() && reserved > target) reserved -= victims[keep++]->mapped();
      victims.resize(keep);
    }
    return victims;
  };
  std::vector<segment*> victims = choose();
  const bool target_met = target != 0 && current(stats_.reserved_bytes) <= target;
  if (target_met || !has_pages_to_release(victims)) return release_segments(lock, victims);
  // One wait for the ranges given back whole and the free pages of the others, then their pages go in place.
  unmap_wait wait;
  wait_for_unmap(lock, nullptr, wait_unlocked, wait);
  if (wait_unlocked) victims = choose();  // threads allocated and freed meanwhile
  std::size_t released = unmap_victims(victims, wait, false);
  if (!wait_unlocked) released += unmap_free_pages(target, wait);  // before release_segments releases the lock
  released += release_segments(lock, victims, false, &wait);
  if (wait_unlocked) released += unmap_free_pages(target, wait);
  give_to_heirs(wait);
  return released;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::release_for_growth(
    std::unique_lock<detail::device_mutex>& lock, std::size_t deficit, bool unforced) {
  std::vector<segment*> candidates = free_segments();
  if (candidates.empty()) return 0;
  std::sort(candidates.begin(), candidates.end(),
            [](const segment* a, const segment* b) { return a->mapped() < b->mapped(); });
  const auto covering = std::find_if(candidates.begin(), candidates.end(),
                                     [deficit](const segment* seg) { return seg->mapped() >= deficit; });
  std::vector<segment*> victims;
  if (covering != candidates.end()) {
    victims.push_back(*covering);
  } else {
    std::size_t covered = 0;
    for (auto it = candidates.rbegin(); it != candidates.rend() && covered < deficit; ++it) {
      victims.push_back(*it);
      covered += (*it)->mapped();
    }
  }
  return release_segments(lock, victims, unforced);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::wait_for_pending_events(
    std::unique_lock<detail::device_mutex>& lock) {
  stats_.num_sync_all_streams.increment();
  struct waiting {
    pending_record record;
    gpukit::device device;
    tracker_type tracker;  // for a null event: the destroyed stream whose last work is awaited
  };
  if (unrecorded_ != 0) record_deferred();
  std::vector<waiting> records;
  records.reserve(pending_total_);  // before anything moves: nothing below allocates
  for (std::size_t i = 0; i < pending_streams_.size();) {
    stream_state* st = pending_streams_[i];
    // Records a gpukit capture still keeps from being recorded stay pending, in order; the others are waited for.
    auto kept = st->pending.begin();
    for (auto it = st->pending.begin(); it != st->pending.end(); ++it) {
      if (it->unrecorded) {
        if (kept != it) *kept = std::move(*it);
        ++kept;
        continue;
      }
      tracker_type tracker{};
      if (!it->event) tracker = st->tracker;
      records.push_back(waiting{std::move(*it), st->device, std::move(tracker)});
    }
    st->pending.erase(kept, st->pending.end());
    if (st->pending.empty()) {
      pending_streams_[i] = pending_streams_.back();
      pending_streams_.pop_back();
    } else {
      ++i;
    }
  }
  if (records.empty()) return;
  lock.unlock();
  for (auto& w : records) {
    if (w.record.event) {
      synchronize_quietly(*w.record.event);
    } else {
      wait_finished_quietly(w.tracker);
    }
  }
  lock.lock();
  for (auto& w : records) {
    recycle_event(std::move(w.record.event), w.device);
    complete_pending(w.record.b);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE auto basic_caching_allocator<Upstream, StreamOps>::free_segments() const -> std::vector<segment*> {
  const bool quarantine = !upstream_.synchronizes_on_free();
  std::vector<segment*> result;
  for (segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
    bool all_free = true;
    for (const block* b = seg->first; b != nullptr && all_free; b = b->next) {
      all_free = releasable(b, quarantine);
    }
    if (all_free) result.push_back(seg);
  }
  return result;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::release_segments(
    std::unique_lock<detail::device_mutex>& lock, const std::vector<segment*>& chosen, bool unforced,
    const unmap_wait* waited) {
  if (chosen.empty()) return 0;
  std::size_t unmapped = 0;  // pages of expandable victims, unmapped before they are unlinked
  std::vector<segment*> victims(chosen);
  if constexpr (has_vm) {
    const bool pages = std::any_of(victims.begin(), victims.end(),
                                   [](const segment* seg) { return seg->expandable && seg->mapped() != 0; });
    if (waited == nullptr && pages) {  // release_for_growth, release_abandoned
      std::size_t page = 0;
      for (const segment* seg : victims) page = seg->expandable ? seg->pages.page_size() : page;
      unmap_wait wait;
      wait_for_unmap(lock, &victims, true, wait);
      unmapped = unmap_victims(victims, wait, true);
      if (unforced) {
        for (std::size_t i = 0; i < unmapped / page; ++i) stats_.num_device_free_unforced.increment();
      }
      if (victims.empty()) return unmapped;
    }
  } else {
    (void)waited;
  }
  // Everything that allocates comes before the first change: the loop that unlinks the segments cannot fail.
  std::vector<std::unique_ptr<event_type>> fences;
  std::size_t fence_count = 0;
  for (const segment* seg : victims) {
    for (const block* b = seg->first; b != nullptr; b = b->next) fence_count += b->fence ? 1 : 0;
  }
  fences.reserve(fence_count);
  std::vector<ordered_release> ordered(victims.size());
  std::size_t released = 0;
  std::size_t frees = 0;
  for (std::size_t i = 0; i < victims.size(); ++i) {
    segment* seg = victims[i];
    ordered[i] = order_release(*seg);
    for (block* b = seg->first; b != nullptr;) {
      block* next = b->next;
      unindex_free(b);
      if (b->fence) fences.push_back(std::move(b->fence));
      recycle(b);
      b = next;
    }
    if (seg->prev_segment != nullptr) {
      seg->prev_segment->next_segment = seg->next_segment;
    } else {
      segments_ = seg->next_segment;
    }
    if (seg->next_segment != nullptr) seg->next_segment->prev_segment = seg->prev_segment;
    if (seg->expandable) {
      forget_expandable(seg);
      address_space_.store(address_space_.load(std::memory_order_relaxed) - seg->size, std::memory_order_relaxed);
      expandable_mapped_.store(expandable_mapped_.load(std::memory_order_relaxed) - seg->mapped(),
                               std::memory_order_relaxed);
    }
    record_segment_free(*seg);
    frees += seg->expandable ? seg->mapped() / seg->pages.page_size() : 1;  // an unmap per page, or a cudaFree
    count(st_segment, seg->small, -1);
    count(st_reserved_bytes, seg->small, -as_delta(seg->mapped()));
    released += seg->mapped();
  }
  for (std::size_t i = 0; i < frees; ++i) {  // with the reserved bytes: statistics read meanwhile agree
    stats_.num_device_free.increment();
    if (unforced) stats_.num_device_free_unforced.increment();
  }
  lock.unlock();
  for (const auto& fence : fences) synchronize_quietly(*fence);
  for (std::size_t i = 0; i < victims.size(); ++i) {
    return_segment(victims[i], ordered[i]);
    delete victims[i];
  }
  lock.lock();
  for (auto& fence : fences) recycle_event(std::move(fence), device_);
  for (ordered_release& o : ordered) {
    for (auto& e : o.after) recycle_event(std::move(e), device_);
  }
  return released + unmapped;
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE std::size_t basic_caching_allocator<Upstream, StreamOps>::mapped_bytes_of(const block* b) const noexcept {
  return b->seg->pages.mapped_bytes_in(b->address - b->seg->address, b->size);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE free_space_info basic_caching_allocator<Upstream, StreamOps>::free_space_locked() const noexcept {
  fronts_lock all(*this);
  return detail::caching_diagnostics::free_space(*this);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE bool basic_caching_allocator<Upstream, StreamOps>::checks_captures() const noexcept {
  return options_.capture_check == capture_checks::every_call || detail::gpukit_capture_underway();
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::refuse_if_captured(const stream_type& s,
                                                                                    const char* operation) const {
  if constexpr (detail::has_capture_query<StreamOps>::value) {
    if (checks_captures() && ops_.capturing(s)) throw_stream_captured(s, operation);
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::refuse_free_if_captured(const block* b) const {
  if constexpr (detail::has_capture_query<StreamOps>::value) {
    if (checks_captures() && ops_.capturing(b->owner->stream)) {
      throw_stream_captured(b->owner->stream, "deallocate");
    }
  } else {
    (void)b;
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::refuse_release_if_captured(
    const char* operation) const {
  if constexpr (detail::has_capture_query<StreamOps>::value) {
    std::vector<const stream_state*> asked;
    for (const segment* seg = segments_; seg != nullptr; seg = seg->next_segment) {
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state != block_state::allocated || std::find(asked.begin(), asked.end(), b->owner) != asked.end()) {
          continue;
        }
        asked.push_back(b->owner);
        if (ops_.capturing(b->owner->stream)) throw_stream_captured(b->owner->stream, operation);
      }
    }
  }
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_stream_captured(const stream_type& s,
                                                                                       const char* operation) const {
  std::string text;
  if constexpr (std::is_same<stream_type, stream_view>::value) {
    text = detail::describe_stream(s.native_handle(), device_);
  } else {
    text = "stream " + std::to_string(ops_.key(s)) + " of " + device_.to_string();
  }
  detail::throw_captured(operation, text, device_, detail::capture_advice_allocator);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_out_of_memory(
    std::unique_lock<detail::device_mutex>& lock, std::size_t requested, std::size_t size, std::size_t segment_bytes,
    bool limit_hit, std::size_t page_bytes, std::string_view cause) {
  stats_.num_ooms.increment();
  const free_space_info f = free_space_locked();
  std::size_t allocated = 0;
  {
    fronts_lock all(*this);  // the heap's part and the slots' together
    allocated = user_current(st_allocated_bytes);
  }
  const std::size_t reserved = current(stats_.reserved_bytes);
  const std::size_t limit = limit_;
  lock.unlock();
  const upstream_memory_info info = memory_info_quietly();
  out_of_memory_info facts{
      device_ordinal(),     requested, size,      segment_bytes, allocated,        reserved,        f.free_bytes,
      f.largest_free_block, limit,     limit_hit, info.known,    info.total_bytes, info.free_bytes, {}};
  facts.message = detail::out_of_memory_message(facts, device_.to_string(), page_bytes, cause);
  if (memory_history* h = history_.load(std::memory_order_acquire)) {
    h->record(memory_action::oom, 0, requested, 0, info.known ? info.free_bytes : 0);
  }
  observers_.notify(facts, device_.to_string());
  const cudaError_t result = device_.is_cuda() && !limit_hit ? cudaErrorMemoryAllocation : cudaSuccess;
  throw out_of_memory_error(facts.message, result,
                            "gpukit::basic_caching_allocator::allocate(" + std::to_string(requested) + ")",
                            device_.ordinal());
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_not_owned(const void* p,
                                                                                 const char* operation) const {
  std::lock_guard<detail::device_mutex> lock(mutex_);
  throw_not_owned_locked(p, operation);
}

template <class Upstream, class StreamOps>
GPUKIT_INLINE void basic_caching_allocator<Upstream, StreamOps>::throw_not_owned_locked(const void* p,
                                                                                        const char* operation) const {
  throw invalid_argument_error(detail::caching_diagnostics::not_owned_message(*this, p, operation), cudaSuccess,
                               operation, device_.ordinal());
}

#if GPUKIT_DETAIL_EXTERN_TEMPLATES  // compiled once into gpukit::compiled (see detail/config.hpp)
extern template class basic_caching_allocator<device_upstream, stream_ops>;
// The constructor is a member template (upstream arguments), which the class's explicit instantiation leaves out.
extern template basic_caching_allocator<device_upstream, stream_ops>::basic_caching_allocator(gpukit::device,
                                                                                              allocator_options);
#endif

GPUKIT_END_NAMESPACE
