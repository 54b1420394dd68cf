// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// copy_async(dst, src, stream): host to device, device to host and device to device, over located spans
/// (<gpukit/transfer/spans.hpp>), std::vector / std::array (host memory), pinned buffers and device buffers.
///
/// | source → destination   | how                                     | source reusable / destination ready      |
/// |------------------------|-----------------------------------------|------------------------------------------|
/// | pinned host → device   | one DMA (cudaMemcpyAsync)               | source: once the stream passed the copy  |
/// | pageable host → device | staged through the stream's pinned ring | source: **when copy_async returns**      |
/// | device → pinned host   | one DMA                                 | destination: once the stream passed it   |
/// | device → pageable host | staged; the calling thread copies out   | destination: **when copy_async returns** |
/// | device → device        | one DMA (peer copy across devices)      | both: once the stream passed it          |
/// | temporary pinned ↔ dev | one DMA, waited for (see below)         | **when copy_async returns**              |
///
/// "The stream passed the copy" means: after stream.synchronize(), or once an event recorded on the stream after
/// the call has completed; later work on the same stream sees the data. Device memory must stay valid until then in
/// every case. A temporary (an rvalue vector, std::array, pinned_buffer or pooled_pinned_buffer) is freed at the end
/// of the caller's expression, so where one DMA reads or writes its page-locked memory, copy_async waits for the copy
/// before returning, as to_device does; a pooled_pinned_buffer's block is kept for the copy instead where the stream
/// can be recorded (see below). A temporary device buffer frees in its own stream's order: copied on another stream,
/// its memory is kept for the copy (record_stream) or the copy waited for, and on a stream being captured it is
/// refused (one of the captured stream itself frees in order after the copy). On a stream being captured a temporary
/// owning host memory is refused. A copy into pageable memory waits for the stream's earlier work and returns with the
/// data, as CUDA's own cudaMemcpyAsync into pageable memory does (see <gpukit/transfer/staging.hpp>). On the CPU
/// device the same table holds: "device" memory is host memory, copies are memcpy enqueued on the CPU stream
/// (asynchronous and ordered like on a GPU), and pageable memory is staged the same way.
///
/// Checks, before anything is enqueued (each throws invalid_argument_error; nothing is left in a ring):
/// - sizes differ (element counts; element types must match at compile time);
/// - the byte count (elements x element size) overflows size_t, or a range runs past the end of the address space
///   (a span is only a pointer and a count; the message names the count and the element size);
/// - a null pointer with a non-zero size;
/// - overlapping source and destination ranges;
/// - a device span of another device than the stream's (device to device: one side must be the stream's device,
///   and CPU and CUDA memory never mix);
/// - a device pointer where host memory is expected, or host memory where device memory is expected, as
///   cudaPointerGetAttributes reports. Without a usable CUDA device no pointer can be device memory, so this check
///   accepts every pointer (see <gpukit/transfer/pointer_query.hpp>). Host memory is taken as page-locked (one DMA)
///   only when CUDA says so of both its first and its last byte: a range that runs out of a host_registration is
///   staged (one page-locked at both ends but not in the middle, two registrations with a gap, is not detected).
/// - the stream is being captured into a CUDA graph and the copy would be staged (pageable host memory): pinned and
///   device memory copies are one cudaMemcpyAsync each, which a capture records as a copy node; or the page-locked
///   host side is a temporary, which the graph would read at each launch long after it was freed.
/// A size of zero is a no-op: nothing is checked or enqueued.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/stream_ops.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/detail/cuda_backend.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/pointer_query.hpp>
#include <gpukit/transfer/spans.hpp>
#include <gpukit/transfer/staging.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// One side of a copy, type-erased.
struct copy_side {
  const void* data = nullptr;
  std::size_t count = 0;
  memory_location location = memory_location::host;
  gpukit::device dev{};         // for device memory
  bool location_known = false;  // gpukit allocated it (location_is_known): no need to ask CUDA where it is
};

GPUKIT_INLINE std::string describe_side(const char* role, const copy_side& side, std::size_t element_size);

/// Throws invalid_argument_error "gpukit::<operation>: <what>"; `operation` is the call the user made (copy_async,
/// to_device, to_host).
[[noreturn]] GPUKIT_INLINE void copy_misuse(const char* operation, const std::string& what);

/// The runtime checks of copy_async (see the file comment), named `operation` in errors; returns whether host memory
/// on the host side is page-locked (so one DMA suffices).
GPUKIT_INLINE bool check_copy(const copy_side& dst, const copy_side& src, std::size_t element_size, gpukit::device sd,
                              const char* operation);

/// What to do instead of a cross-device copy on the current streams in a capture.
inline constexpr std::string_view capture_advice_cross_device =
    "it orders the two devices' current streams with events, which would tie a captured stream to work outside its "
    "capture; pass the captured stream (copy_async(dst, src, s)) and order the other device's work with events "
    "recorded in the capture (nothing was enqueued)";

/// Picks the staging engine once the stream's device is known: a fixed one, or the default of the device's kind.
/// copier() is the engine's direct copy step, which copies that need no staging use without creating an engine.
template <class Engine>
struct fixed_engine {
  Engine* engine;
  Engine& operator()(gpukit::device) const noexcept { return *engine; }
  auto& copier() const noexcept { return engine->copier(); }
};
struct default_engine {
  staging_engine& operator()(gpukit::device d) const;
  device_copier copier() const noexcept;  // what the default engines use
};

/// The legacy default streams among two streams of different devices, held (legacy_stream_hold) from construction to
/// destruction, so that no gpukit capture of a blocking stream of their devices begins meanwhile; a hold refused throws
/// at construction (nothing done). Work on a held stream is then enqueued without taking the hold again, which a
/// capture waiting for this one would refuse.
class legacy_holds {
 public:
  legacy_holds(const stream_view& a, const stream_view& b) {
    const stream_view streams[2] = {a, b};
    for (int i = 0; i < 2; ++i) {
      if (!is_legacy(streams[i])) continue;
      holds_[i].emplace(streams[i].device().ordinal());
      refuse_legacy_stream_join("copy_async (across devices, on the legacy default stream)", streams[i],
                                holds_[i]->refused());
      held_[i] = streams[i];
    }
  }
  legacy_holds(const legacy_holds&) = delete;
  legacy_holds& operator=(const legacy_holds&) = delete;

  bool holds(const stream_view& s) const noexcept {
    return (holds_[0] && held_[0] == s) || (holds_[1] && held_[1] == s);
  }
  void record(event& e, const stream_view& s) const {
    if (!holds(s)) return e.record(s);
    cuda_backend::record_event(e.cuda_handle(), s.device().ordinal(), s.native_handle());
  }
  void wait(const event& e, const stream_view& s) const {
    if (!holds(s)) return e.wait(s);
    cuda_backend::wait_event(s.cuda_target(), e.cuda_handle(), e.device().ordinal());
  }

 private:
  static bool is_legacy(const stream_view& s) noexcept { return !s.is_cpu() && s.is_default() && !s.is_per_thread(); }
  std::optional<legacy_stream_hold> holds_[2];
  stream_view held_[2];
};

/// device_copier's copy on a legacy stream that legacy_holds holds (engines: never used, device to device only).
struct held_legacy_engine {
  struct copier_type {
    void operator()(void* dst, const void* src, std::size_t bytes, copy_direction, stream_view s) const {
      cuda_backend::copy_async(dst, src, bytes, s.native_handle(), s.device().ordinal());
    }
  };
  staging_engine& operator()(gpukit::device d) const;
  copier_type copier() const noexcept { return {}; }
};

/// Dispatches a copy that check_copy accepted (`host_pinned`: its answer). True when it enqueued one DMA on `s` that
/// reads or writes the host side when `s` gets to it (false: staged, or device to device).
template <class EngineFor>
bool dispatch_copy(const copy_side& dst, const copy_side& src, std::size_t element_size, stream_view s,
                   EngineFor engine_for, bool host_pinned, const char* operation) {
  const gpukit::device sd = s.device();
  if (s.is_other_threads_stream()) throw_other_threads_stream(operation);
  const bool d2d = dst.location == memory_location::device && src.location == memory_location::device;
  if (!d2d && !host_pinned) refuse_capture(s, sd, std::string("gpukit::") + operation, capture_advice_staging);
  const std::size_t bytes = dst.count * element_size;
  void* out = const_cast<void*>(dst.data);
  const bool to_device = dst.location == memory_location::device;
  if (d2d || host_pinned) {  // one DMA: the staging engine (and its pinned pool) is not involved
    const copy_direction direction = d2d         ? copy_direction::device_to_device
                                     : to_device ? copy_direction::host_to_device
                                                 : copy_direction::device_to_host;
    engine_for.copier()(out, src.data, bytes, direction, s);
    return !d2d;
  }
  auto& engine = engine_for(sd);  // pageable memory only
  if (to_device) {
    engine.to_device(out, src.data, bytes, s);
  } else {
    engine.to_host(out, src.data, bytes, s);
  }
  return false;
}

/// What to do instead of a temporary's page-locked memory in a capture.
inline constexpr std::string_view capture_advice_temporary =
    "the page-locked host side is a temporary, freed at the end of the expression, and the graph's copy node would "
    "read or write it at each launch; copy from or into pinned memory that outlives the graph (nothing was enqueued)";

/// What to do instead of a temporary device buffer in a capture.
inline constexpr std::string_view capture_advice_temporary_device =
    "a side is a temporary device buffer, freed at the end of the expression, and the graph's copy node would read "
    "or write it at each launch; copy from or into a buffer that outlives the graph (nothing was enqueued)";

/// Checks and dispatches a copy (see the file comment); returns what dispatch_copy returns (false: nothing to copy).
/// `temporary_host`: the host side is memory a temporary owns, which one DMA may not use after the call (refused in
/// a capture; the caller waits otherwise). `temporary_device`: a side is a temporary device buffer of another stream
/// than `s` (refused in a capture; the caller keeps its memory for the copy otherwise).
template <class EngineFor>
bool copy_bytes(const copy_side& dst, const copy_side& src, std::size_t element_size, stream_view s,
                EngineFor engine_for, const char* operation, bool temporary_host, bool temporary_device = false) {
  if (dst.count != src.count) {
    copy_misuse(operation, "size mismatch: " + describe_side("the destination", dst, element_size) + " and " +
                               describe_side("the source", src, element_size) + " differ");
  }
  if (dst.count == 0) return false;
  const bool host_pinned = check_copy(dst, src, element_size, s.device(), operation);
  if (host_pinned && temporary_host) {
    refuse_capture(s, s.device(), std::string("gpukit::") + operation, capture_advice_temporary);
  }
  if (temporary_device) {
    refuse_capture(s, s.device(), std::string("gpukit::") + operation, capture_advice_temporary_device);
  }
  return dispatch_copy(dst, src, element_size, s, engine_for, host_pinned, operation);
}

/// Whether a copy on `s` records `s` on a pooled pinned buffer's block (keep_block_for_copy): a gpukit stream or a
/// default stream, not a raw handle, which may be destroyed and its handle reused before the buffer goes.
inline bool records_block_use(const stream_view& s) noexcept { return s.is_default() || s.lifetime() != nullptr; }

/// Waits for `s` before the caller frees memory a copy enqueued on it still reads. On the legacy default stream a
/// wait is refused while a blocking stream of its device is captured (stream_view::synchronize): a capture that began
/// after the copy was enqueued (in another thread: on this one the copy itself would have been refused) is waited
/// out, polling, however long it lasts, rather than let the memory go under the copy. Throws for a gpukit capture of
/// such a stream on this thread (it would wait for itself), and for every other error.
inline void synchronize_before_freeing(const stream_view& s) {
  if (s.is_cpu() || !s.is_default() || s.is_per_thread()) return s.synchronize();
  auto backoff = std::chrono::microseconds(50);
  for (;;) {
    try {
      s.synchronize();
      return;
    } catch (const invalid_argument_error& e) {
      const bool refused = e.cuda_result() == cudaSuccess;  // the refusal; a CUDA failure carries its result
      if (!refused || mode_independent::gpukit_blocking_captures_on_this_thread(s.device().ordinal()) != 0) throw;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min<std::chrono::microseconds>(backoff * 2, std::chrono::milliseconds(10));
  }
}

/// After a copy enqueued on `s` that uses `x`'s memory when `s` gets to it: a pooled pinned buffer's block goes back
/// to its pool only after that copy (record_stream, as PyTorch records its pinned blocks' uses), so that it can be
/// destroyed right after the call. Only for gpukit's streams and the default streams: a raw handle may be destroyed
/// and its handle reused before the buffer goes (record_stream yourself where it outlives the buffer). Not in a
/// capture (the graph's copy uses the memory at each launch: the buffer must outlive the graph; the pool refuses a
/// capturing stream). If the stream cannot be recorded, the copy is waited for. True when the block is kept for (or
/// was waited for) the copy, so that the buffer may go at once.
template <class X>
bool keep_block_for_copy(const X& x, const stream_view& s) {
  if constexpr (is_pooled_pinned_buffer<std::remove_cv_t<X>>::value) {
    if (!records_block_use(s)) return false;
    if (!s.is_cpu() && capture_status(s) != cudaStreamCaptureStatusNone) return false;
    try {
      x.record_stream(s);
    } catch (...) {
      synchronize_before_freeing(s);  // the copy done, the block may go back whenever (throws if even that fails)
    }
    return true;
  } else {
    (void)x;
    (void)s;
    return false;
  }
}

/// Whether X, as an rvalue, owns host memory that goes at the end of the caller's expression (spans own nothing;
/// device buffers free in their own stream's order: is_temporary_device_buffer).
template <class X>
struct owns_host_memory : std::integral_constant<bool, is_pinned_container<std::remove_cv_t<X>>::value ||
                                                           is_host_container<std::remove_cv_t<X>>::value> {};

/// Whether an argument of forwarded type Arg is a temporary owning host memory.
template <class Arg>
inline constexpr bool is_temporary_host_memory =
    !std::is_lvalue_reference<Arg>::value && owns_host_memory<std::remove_reference_t<Arg>>::value;

/// Whether an argument of forwarded type Arg is a temporary device buffer.
template <class Arg>
inline constexpr bool is_temporary_device_buffer =
    !std::is_lvalue_reference<Arg>::value &&
    is_device_buffer_like<std::remove_cv_t<std::remove_reference_t<Arg>>>::value;

template <class X, class = void>
struct has_record_stream : std::false_type {};
template <class X>
struct has_record_stream<X, std::void_t<decltype(std::declval<X&>().record_stream(std::declval<stream_view>()))>>
    : std::true_type {};

/// Whether device buffer `x` frees in the order of stream `s` (its own stream), where work enqueued on `s` before
/// the free is safe from it.
template <class X>
bool frees_in_order_of(const X& x, const stream_view& s) {
  if constexpr (std::is_convertible<decltype(x.stream()), stream_view>::value) {
    return stream_view(x.stream()) == s;
  } else {
    return false;
  }
}

/// After a copy enqueued on `s` that uses temporary device buffer `x`: `x` frees in the order of its own stream at
/// the end of the caller's expression, so where that is neither `s` nor `ordered` (a stream that waits for the copy)
/// its block is kept for the copy (record_stream), or the copy is waited for.
template <class X>
void keep_device_buffer_for_copy(X& x, const stream_view& s, const stream_view* ordered = nullptr) {
  if (frees_in_order_of(x, s) || (ordered != nullptr && frees_in_order_of(x, *ordered))) return;
  if constexpr (has_record_stream<X>::value) {
    try {
      x.record_stream(s);
      return;
    } catch (...) {  // waited for instead
    }
  }
  synchronize_before_freeing(s);
}

/// keep_device_buffer_for_copy for a copy that failed, perhaps part-way, while its error is on its way to the
/// caller: recorded for `s`, else waited for, but never while a capture refuses the wait (the failure may be that very
/// refusal, made before anything was enqueued; synchronize_before_freeing would wait for the capture to end, for
/// ever if it is the caller's). A failure here leaves the copy's error to be reported.
template <class X>
void keep_device_buffer_after_failure(X& x, const stream_view& s) noexcept {
  if (frees_in_order_of(x, s)) return;
  if constexpr (has_record_stream<X>::value) {
    try {
      x.record_stream(s);
      return;
    } catch (...) {  // waited for instead
    }
  }
  try {
    s.synchronize();
  } catch (...) {
  }
}

/// Where `x`'s memory is for a copy on `s`: where its located view says, except that on a CUDA stream a pinned
/// container whose memory is not page-locked (one of the CPU device, or of a pool without page-locked memory) is
/// pageable host memory. (CPU streams model pinned memory by type.)
template <class X>
memory_location location_of(const X& x, memory_location viewed, const stream_view& s) {
  if constexpr (is_pinned_container<std::remove_cv_t<X>>::value) {
    // Nothing to copy: no question for the stream (a zero-size copy checks nothing).
    return x.page_locked() || x.size() == 0 || s.device().is_cpu() ? viewed : memory_location::host;
  } else {
    (void)x;
    (void)s;
    return viewed;
  }
}

/// The two sides of a copy on `s`, as copy_bytes takes them.
struct copy_sides {
  copy_side dst;
  copy_side src;
  std::size_t element_size = 0;
};

template <class Dst, class Src>
copy_sides sides_of(Dst& dst_arg, Src& src_arg, const stream_view& s) {
  auto dst = located_view(dst_arg);
  auto src = located_view(src_arg);
  using dst_type = decltype(dst);
  using src_type = decltype(src);
  using dst_element = typename dst_type::element_type;
  using src_element = typename src_type::element_type;
  static_assert(!std::is_const<dst_element>::value, "gpukit::copy_async: the destination is read-only");
  static_assert(std::is_same<std::remove_cv_t<dst_element>, std::remove_cv_t<src_element>>::value,
                "gpukit::copy_async: the source and destination element types differ");
  static_assert(std::is_trivially_copyable<dst_element>::value,
                "gpukit::copy_async: elements must be trivially copyable (they are copied as bytes)");
  static_assert(dst_type::location == memory_location::device || src_type::location == memory_location::device,
                "gpukit::copy_async: both sides are host memory; use std::copy");
  copy_side d{dst.data(), dst.size(), location_of(dst_arg, dst_type::location, s), {}, location_is_known<Dst>::value};
  copy_side r{src.data(), src.size(), location_of(src_arg, src_type::location, s), {}, location_is_known<Src>::value};
  if constexpr (dst_type::location == memory_location::device) d.dev = dst.device();
  if constexpr (src_type::location == memory_location::device) r.dev = src.device();
  return {d, r, sizeof(dst_element)};
}

/// copy_async(dst, src, s) as `operation` (the call the user made, for errors). A temporary whose page-locked memory
/// one DMA uses is waited for before it goes (see the file comment).
template <class Dst, class Src, class EngineFor>
void copy_located(Dst&& dst_arg, Src&& src_arg, stream_view s, EngineFor engine_for,
                  const char* operation = "copy_async") {
  constexpr bool temporary_dst = is_temporary_host_memory<Dst>;
  constexpr bool temporary_src = is_temporary_host_memory<Src>;
  constexpr bool device_dst = is_temporary_device_buffer<Dst>;
  constexpr bool device_src = is_temporary_device_buffer<Src>;
  // A temporary device buffer of another stream is freed outside the copy's order: refused in a capture. One of `s`
  // frees in order after the copy, in a capture too (a graph pool's, say: allocated, copied and freed in the graph).
  bool device_elsewhere = false;
  if constexpr (device_dst) device_elsewhere = device_elsewhere || !frees_in_order_of(dst_arg, s);
  if constexpr (device_src) device_elsewhere = device_elsewhere || !frees_in_order_of(src_arg, s);
  const copy_sides sides = sides_of(dst_arg, src_arg, s);
  try {
    // Only the host side can be a temporary owning host memory: a host-to-host copy does not compile.
    if (copy_bytes(sides.dst, sides.src, sides.element_size, s, engine_for, operation, temporary_dst || temporary_src,
                   device_elsewhere)) {
      const bool dst_kept = keep_block_for_copy(dst_arg, s);
      const bool src_kept = keep_block_for_copy(src_arg, s);
      if ((temporary_dst && !dst_kept) || (temporary_src && !src_kept)) synchronize_before_freeing(s);
    }
  } catch (...) {
    // A staged copy that failed part-way leaves its earlier chunks enqueued on `s`: a temporary device buffer of
    // another stream is kept for them too (freed now, the next buffer of its stream would take their writes).
    if (sides.dst.count != 0) {
      if constexpr (device_dst) keep_device_buffer_after_failure(dst_arg, s);
      if constexpr (device_src) keep_device_buffer_after_failure(src_arg, s);
    }
    throw;
  }
  // Device to device and staged copies return false above but may still use a temporary device buffer on `s`.
  if (sides.dst.count != 0) {
    if constexpr (device_dst) keep_device_buffer_for_copy(dst_arg, s);
    if constexpr (device_src) keep_device_buffer_for_copy(src_arg, s);
  }
}

}  // namespace detail

/// Copies `src` to `dst` in the order of stream `s`: host to device, device to host or device to device (see the
/// file comment for which memory may be reused when, and for the checks). Each side is a located span, a
/// std::vector / std::array (host), a pinned_buffer / pooled_pinned_buffer (pinned) or a device buffer. Pageable
/// host memory goes through default_staging_engine(stream's device). A temporary side whose page-locked memory one
/// DMA uses is waited for before this returns (all three forms; see the file comment).
template <class Dst, class Src>
void copy_async(Dst&& dst, Src&& src, stream_view s) {
  detail::copy_located(std::forward<Dst>(dst), std::forward<Src>(src), s, detail::default_engine{});
}

/// As copy_async(dst, src, s) on the calling thread's current stream (current_stream(d): the default stream unless a
/// stream_guard says otherwise) of the device side's device, as PyTorch copies. Device to device: the current stream
/// of the source's device; across two devices the copy also waits for the work already enqueued on the
/// destination device's current stream, and that stream waits for the copy (two events, as PyTorch's cross-device
/// copy_), so work on either current stream sees the data in order.
template <class Dst, class Src>
void copy_async(Dst&& dst, Src&& src) {
  const auto to = detail::located_view(dst);
  const auto from = detail::located_view(src);
  constexpr bool to_device = decltype(to)::location == memory_location::device;
  constexpr bool from_device = decltype(from)::location == memory_location::device;
  if constexpr (from_device && to_device) {
    const stream_view s = current_stream(from.device());
    if (to.device() == from.device() || to.size() != from.size() || to.size() == 0) {
      copy_async(std::forward<Dst>(dst), std::forward<Src>(src), s);  // checks (and throws for) mismatched sizes
      return;
    }
    const stream_view destination_stream = current_stream(to.device());
    // The two events would make a captured stream wait for work outside its capture, or join the other stream into
    // it: refused before anything is enqueued.
    for (const stream_view& current : {s, destination_stream}) {
      detail::refuse_capture(current, current.device(), "gpukit::copy_async (across devices, on the current streams)",
                             detail::capture_advice_cross_device);
    }
    // The copy's own checks, before the events tie the two streams together.
    const detail::copy_sides sides = detail::sides_of(dst, src, s);
    (void)detail::check_copy(sides.dst, sides.src, sides.element_size, s.device(), "copy_async");
    // A legacy stream's hold is taken once for the whole sequence, or refused before anything is enqueued: taken step
    // by step, a capture begun in between would refuse the last wait after the copy ran.
    try {
      const detail::legacy_holds held(s, destination_stream);
      event destination_ready(to.device());
      held.record(destination_ready, destination_stream);
      held.wait(destination_ready, s);
      if (held.holds(s)) {
        (void)detail::dispatch_copy(sides.dst, sides.src, sides.element_size, s, detail::held_legacy_engine{}, false,
                                    "copy_async");
      } else {
        (void)detail::dispatch_copy(sides.dst, sides.src, sides.element_size, s, detail::default_engine{}, false,
                                    "copy_async");
      }
      event copied(from.device());
      held.record(copied, s);
      held.wait(copied, destination_stream);
    } catch (...) {
      // The copy may be enqueued on `s` without the destination stream waiting for it: a temporary buffer is kept
      // for `s`, whichever stream frees it.
      if constexpr (detail::is_temporary_device_buffer<Dst>) detail::keep_device_buffer_after_failure(dst, s);
      if constexpr (detail::is_temporary_device_buffer<Src>) detail::keep_device_buffer_after_failure(src, s);
      throw;
    }
    // After the holds: a wait for the copy here must not hold back a capture it would wait for. The destination
    // stream waits for the copy: a buffer freed in its order needs nothing.
    if constexpr (detail::is_temporary_device_buffer<Dst>) {
      detail::keep_device_buffer_for_copy(dst, s, &destination_stream);
    }
    if constexpr (detail::is_temporary_device_buffer<Src>) detail::keep_device_buffer_for_copy(src, s);
  } else if constexpr (from_device) {
    copy_async(std::forward<Dst>(dst), std::forward<Src>(src), current_stream(from.device()));
  } else {
    static_assert(to_device, "gpukit::copy_async: both sides are host memory; use std::copy");
    copy_async(std::forward<Dst>(dst), std::forward<Src>(src), current_stream(to.device()));
  }
}

/// As copy_async(dst, src, s), with an engine of your own (other tuning, or an instrumented device copy step, which
/// then performs every copy, staged or direct).
template <class Dst, class Src, class Copier>
void copy_async(Dst&& dst, Src&& src, stream_view s, basic_staging_engine<Copier>& engine) {
  detail::copy_located(std::forward<Dst>(dst), std::forward<Src>(src), s,
                       detail::fixed_engine<basic_staging_engine<Copier>>{&engine});
}

/// Copies `bytes` bytes from device memory of `src_device` to device memory of `dst_device` in the order of stream `s`
/// (of any CUDA device), with cudaMemcpyPeerAsync: raw bytes with both devices named, for memory gpukit does not
/// track (copy_async does the same for device spans and buffers, with its checks). Works whether or not peer access
/// is enabled (<gpukit/device/peer_access.hpp>); without it the driver goes through the host. Both sides are ready
/// once the stream passed the copy. Throws invalid_argument_error for a CPU device or stream, another thread's
/// per-thread default stream, or a null pointer with a non-zero size, and on the legacy default stream while a
/// capture of a blocking stream of its device is underway (as device_copier); the gpukit error of the failed call,
/// naming the stream's device, otherwise. Zero bytes: a no-op.
GPUKIT_INLINE void copy_peer_async(void* dst, gpukit::device dst_device, const void* src, gpukit::device src_device,
                                   std::size_t bytes, stream_view s);

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::string describe_side(const char* role, const copy_side& side, std::size_t element_size) {
  std::string text = role;
  text += " (";
  switch (side.location) {
    case memory_location::host:
      text += "host memory";
      break;
    case memory_location::pinned:
      text += "pinned host memory";
      break;
    case memory_location::device:
      text += "memory of " + side.dev.to_string();
      break;
  }
  text += ", " + std::to_string(side.count) + " elements of " + std::to_string(element_size) + " bytes)";
  return text;
}

GPUKIT_INLINE void copy_misuse(const char* operation, const std::string& what) {
  throw invalid_argument_error(std::string("gpukit::") + operation + ": " + what);
}

GPUKIT_INLINE bool check_copy(const copy_side& dst, const copy_side& src, std::size_t element_size, gpukit::device sd,
                              const char* operation) {
  // A span is only a pointer and a count: a count whose byte size does not fit size_t would wrap to a small copy.
  if (dst.count > std::numeric_limits<std::size_t>::max() / element_size) {
    copy_misuse(operation, std::to_string(dst.count) + " elements of " + std::to_string(element_size) +
                               " bytes: the byte count overflows size_t (at most " +
                               std::to_string(std::numeric_limits<std::size_t>::max() / element_size) + " elements)");
  }
  const std::size_t bytes = dst.count * element_size;
  if (dst.data == nullptr) {
    copy_misuse(operation, describe_side("the destination", dst, element_size) + " is a null pointer");
  }
  if (src.data == nullptr) {
    copy_misuse(operation, describe_side("the source", src, element_size) + " is a null pointer");
  }
  for (const copy_side* side : {&dst, &src}) {
    const auto begin = reinterpret_cast<std::uintptr_t>(side->data);
    if (bytes - 1 > std::numeric_limits<std::uintptr_t>::max() - begin) {
      copy_misuse(operation, describe_side(side == &dst ? "the destination" : "the source", *side, element_size) +
                                 " runs past the end of the address space (" + std::to_string(bytes) + " bytes at " +
                                 std::to_string(begin) + ")");
    }
  }
  const auto d0 = reinterpret_cast<std::uintptr_t>(dst.data);
  const auto s0 = reinterpret_cast<std::uintptr_t>(src.data);
  if (d0 < s0 + bytes && s0 < d0 + bytes) {
    copy_misuse(operation, "the source and destination ranges overlap (" + std::to_string(bytes) + " bytes at " +
                               std::to_string(s0) + " and " + std::to_string(d0) + ")");
  }
  const bool d2d = dst.location == memory_location::device && src.location == memory_location::device;
  for (const copy_side* side : {&dst, &src}) {
    if (side->location != memory_location::device) continue;
    const char* role = side == &dst ? "the destination" : "the source";
    if (side->dev.is_cpu() != sd.is_cpu()) {
      copy_misuse(operation,
                  describe_side(role, *side, element_size) + " cannot be copied on a stream of " + sd.to_string());
    }
    if (!d2d && side->dev != sd) {
      copy_misuse(operation, describe_side(role, *side, element_size) + " belongs to another device than the stream (" +
                                 sd.to_string() + ")");
    }
  }
  if (d2d && dst.dev != sd && src.dev != sd) {
    copy_misuse(operation, "neither side of a device-to-device copy (" + dst.dev.to_string() + ", " +
                               src.dev.to_string() + ") is on the stream's device " + sd.to_string());
  }
  bool host_pinned = false;
  for (const copy_side* side : {&dst, &src}) {
    if (side->location_known) {
      if (side->location != memory_location::device) host_pinned = side->location == memory_location::pinned;
      continue;
    }
    const char* role = side == &dst ? "the destination" : "the source";
    const pointer_info info = query_pointer(side->data);
    if (side->location == memory_location::device) {
      if (info.kind == pointer_kind::device) {
        if (side->dev.is_cpu()) {
          copy_misuse(operation, describe_side(role, *side, element_size) + " is CUDA device memory of cuda:" +
                                     std::to_string(info.device) + ", not host memory");
        }
        if (info.device != side->dev.ordinal()) {
          copy_misuse(operation, describe_side(role, *side, element_size) +
                                     " is really memory of cuda:" + std::to_string(info.device));
        }
      } else if (sd.is_cuda() && (info.kind == pointer_kind::pageable || info.kind == pointer_kind::pinned)) {
        copy_misuse(operation,
                    describe_side(role, *side, element_size) + " is host memory where device memory is expected");
      }
    } else {
      if (info.kind == pointer_kind::device) {
        copy_misuse(operation, describe_side(role, *side, element_size) + " is device memory of cuda:" +
                                   std::to_string(info.device) + " where host memory is expected");
      }
      // On a CUDA stream a span said to be pinned is trusted only where CUDA cannot tell: memory CUDA calls pageable
      // is staged. (CPU streams model pinned memory by type.)
      const bool said_pinned = side->location == memory_location::pinned;
      if (said_pinned && sd.is_cpu()) {
        host_pinned = true;
        continue;
      }
      const auto page_locked = [said_pinned](const pointer_info& i) {
        return i.kind == pointer_kind::pinned || i.kind == pointer_kind::managed ||
               (said_pinned && i.kind != pointer_kind::pageable);
      };
      // CUDA classifies a pointer, not a range: one that runs out of a host_registration is page-locked at its
      // start only, and one DMA would read or write its pageable tail after the call. Such a range is staged.
      host_pinned = page_locked(info) &&
                    (bytes == 1 || page_locked(query_pointer(static_cast<const char*>(side->data) + (bytes - 1))));
    }
  }
  return host_pinned;
}

GPUKIT_INLINE staging_engine& default_engine::operator()(gpukit::device d) const { return default_staging_engine(d); }

GPUKIT_INLINE device_copier default_engine::copier() const noexcept { return {}; }

GPUKIT_INLINE staging_engine& held_legacy_engine::operator()(gpukit::device d) const {
  return default_staging_engine(d);
}
}  // namespace detail

GPUKIT_INLINE void copy_peer_async(void* dst, gpukit::device dst_device, const void* src, gpukit::device src_device,
                                   std::size_t bytes, stream_view s) {
  if (!dst_device.is_cuda() || !src_device.is_cuda() || s.is_cpu()) {
    throw invalid_argument_error("gpukit::copy_peer_async(" + src_device.to_string() + " -> " + dst_device.to_string() +
                                 "): both devices and the stream must be CUDA ones");
  }
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw invalid_argument_error("gpukit::copy_peer_async(" + src_device.to_string() + " -> " + dst_device.to_string() +
                                 "): null pointer");
  }
  if (s.is_other_threads_stream()) detail::throw_other_threads_stream("copy_peer_async");
  detail::note_cuda_use();
  if (s.is_default() && !s.is_per_thread()) {
    // As device_copier: on the legacy stream the copy would join a gpukit capture of a blocking stream begun meanwhile.
    const detail::legacy_stream_hold hold(s.device().ordinal());
    detail::refuse_legacy_stream_join("copy_peer_async (cudaMemcpyPeerAsync on the legacy default stream)", s,
                                      hold.refused());
    return detail::cuda_backend::copy_peer_async(dst, dst_device.ordinal(), src, src_device.ordinal(), bytes,
                                                 s.cuda_target());
  }
  detail::cuda_backend::copy_peer_async(dst, dst_device.ordinal(), src, src_device.ordinal(), bytes, s.cuda_target());
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
