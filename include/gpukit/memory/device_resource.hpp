// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// device_resource: stream-ordered device memory, the one interface buffers and the standard adaptors allocate
/// through. A resource of your own (an arena, a logging or limiting adaptor, memory of another library) overrides
/// five private functions and plugs into device_buffer, device_pmr_resource, device_memory_resource and
/// thrust_allocator; statistics and control are not part of it (device_allocator adds them).

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/memory/detail/aligned_offsets.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstddef>

GPUKIT_BEGIN_NAMESPACE

/// Stream-ordered device memory: the interface buffers, the std::pmr, cuda::mr and Thrust adaptors take. An
/// implementation overrides the private do_* functions (five, plus do_natural_alignment where it is not 256) and
/// device(); statistics and control are device_allocator's (device_allocator.hpp), which the caching allocators
/// implement. Implementations are thread-safe.
class device_resource {
 public:
  virtual ~device_resource() = default;

  /// The device whose memory this allocator hands out.
  [[nodiscard]] virtual gpukit::device device() const noexcept = 0;

  /// The alignment every allocation has without asking, as with cudaMalloc (an allocator configured with a smaller
  /// rounding gives that rounding; see natural_alignment()).
  static constexpr std::size_t default_alignment = 256;
  /// The least natural alignment an allocator may have (alignof(std::max_align_t) on x86-64).
  static constexpr std::size_t min_natural_alignment = 16;

  /// `bytes` usable on `stream` at once, aligned to natural_alignment(); nullptr for 0 bytes. Throws
  /// out_of_memory_error, or invalid_argument_error for a stream of another device.
  [[nodiscard]] void* allocate(std::size_t bytes, stream_view stream);
  /// The same, aligned to `alignment` (a power of two). Above natural_alignment() the memory comes from a block
  /// `alignment - natural_alignment()` bytes larger (the statistics, snapshots and history show that block: its
  /// start and size), and the aligned address is remembered process-wide, so it may be freed through any allocator
  /// that could free the block. Throws invalid_argument_error for an alignment that is not a power of two.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment, stream_view stream);
  /// Frees `p` in the order of the stream it was allocated on. Throws invalid_argument_error for a pointer this
  /// allocator does not own (including a double free); nullptr is ignored.
  void deallocate(void* p);
  /// Frees `p` after the work enqueued so far on `stream` too (memory last used on another stream). Whether
  /// `stream` may be another CUDA device's is the implementation's: the caching allocator accepts it (peer use),
  /// async_allocator refuses it (invalid_argument_error; order a stream of its device after it with event::wait).
  void deallocate(void* p, stream_view stream);
  /// `stream` also uses `p`: on free, the block is reused only after that stream's work up to the free. Another
  /// device's stream: as for deallocate(p, stream).
  void record_stream(void* p, stream_view stream);
  /// True when `p` is the start of a live allocation of this allocator (for an over-aligned one, the address
  /// allocate returned).
  [[nodiscard]] bool owns(const void* p) const noexcept;
  /// The alignment of every allocation made without asking for one (a power of two, at least
  /// min_natural_alignment).
  [[nodiscard]] std::size_t natural_alignment() const noexcept;

 protected:
  /// For a resource that takes memory back whole, with allocations in it never freed (an arena's reset or
  /// destruction): forgets the over-aligned addresses handed out in (begin, begin + bytes), so that a block which
  /// later starts at one of them, this resource's or another's, is not taken for the old allocation (a free of it
  /// through the wrong resource, or a query or a double free after its free, would otherwise reach the old
  /// allocation's block, another live block by then). `begin` itself is kept: it may be the over-aligned address a
  /// parent resource handed this memory out at. Thread-safe; costs a pass over the table.
  static void forget_over_aligned_addresses(const void* begin, std::size_t bytes) noexcept;

  device_resource() = default;
  /// The interface holds no state; whether an implementation can be copied is its own choice.
  device_resource(const device_resource&) = default;
  /// The interface holds no state; whether an implementation can be assigned is its own choice.
  device_resource& operator=(const device_resource&) = default;

 private:
  /// `bytes` (non-zero, or nullptr) at the natural alignment, usable on `stream` at once.
  virtual void* do_allocate(std::size_t bytes, stream_view stream) = 0;
  /// Frees a pointer do_allocate returned (or reports one it did not); nullptr is ignored.
  virtual void do_deallocate(void* p) = 0;
  /// Frees after the work enqueued so far on `stream` too.
  virtual void do_deallocate(void* p, stream_view stream) = 0;
  virtual void do_record_stream(void* p, stream_view stream) = 0;
  /// Exactly: whether a live allocation of this resource starts at `p` (never true for an address inside one:
  /// over-aligned frees rely on it, see aligned_offsets::block_for).
  virtual bool do_owns(const void* p) const noexcept = 0;
  /// cudaMalloc's guarantee unless an implementation says otherwise (never below min_natural_alignment).
  [[nodiscard]] virtual std::size_t do_natural_alignment() const noexcept;

  /// do_owns as the table of over-aligned addresses asks it (aligned_offsets::block_for).
  auto owns_block_at() const noexcept {
    return [this](const void* p) noexcept { return do_owns(p); };
  }
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE void* device_resource::allocate(std::size_t bytes, stream_view stream) {
  return do_allocate(bytes, stream);
}

GPUKIT_INLINE void* device_resource::allocate(std::size_t bytes, std::size_t alignment, stream_view stream) {
  // Every allocator's natural alignment is at least min_natural_alignment: no virtual call for the common types.
  if (alignment <= min_natural_alignment && detail::is_power_of_two(alignment)) return do_allocate(bytes, stream);
  detail::require_power_of_two_alignment(alignment, "gpukit::device_resource::allocate");
  const std::size_t natural = natural_alignment();
  if (alignment <= natural || bytes == 0) return do_allocate(bytes, stream);
  return detail::allocate_over_aligned(
      bytes, alignment, natural, "gpukit::device_resource::allocate",
      [&](std::size_t size) { return do_allocate(size, stream); }, [&](void* block) { do_deallocate(block); });
}

// An address in the table of over-aligned addresses at which this resource has a live block of its own is that
// block's (aligned_offsets::block_for; do_owns is asked only for addresses in the table).
GPUKIT_INLINE void device_resource::deallocate(void* p) {
  detail::over_aligned_addresses().free_with(p, owns_block_at(), [this](void* block) { do_deallocate(block); });
}

GPUKIT_INLINE void device_resource::deallocate(void* p, stream_view stream) {
  detail::over_aligned_addresses().free_with(p, owns_block_at(),
                                             [this, stream](void* block) { do_deallocate(block, stream); });
}

GPUKIT_INLINE void device_resource::record_stream(void* p, stream_view stream) {
  do_record_stream(detail::over_aligned_addresses().block_for(p, owns_block_at()), stream);
}

GPUKIT_INLINE bool device_resource::owns(const void* p) const noexcept {
  return do_owns(detail::over_aligned_addresses().block_for(p, owns_block_at()));
}

GPUKIT_INLINE std::size_t device_resource::natural_alignment() const noexcept { return do_natural_alignment(); }

GPUKIT_INLINE void device_resource::forget_over_aligned_addresses(const void* begin, std::size_t bytes) noexcept {
  try {
    detail::over_aligned_addresses().erase_range(begin, bytes);
  } catch (...) {  // the table could not be made (its first use): it holds nothing to forget
  }
}

GPUKIT_INLINE std::size_t device_resource::do_natural_alignment() const noexcept { return default_alignment; }

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
