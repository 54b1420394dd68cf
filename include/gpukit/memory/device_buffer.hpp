// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Owning handles to stream-ordered device memory:
/// - device_buffer<T>: `count` uninitialised elements of a trivially copyable T (device memory cannot run
///   constructors), typed, move-only, with span();
/// - device_allocation: raw bytes, unique_ptr-style (get(), explicit operator bool).
/// Both come from an allocator (the default allocator of the stream's device unless one is given) and are freed
/// in the order of the stream they were allocated on when destroyed or reset(). They work for the CPU device
/// too (host memory, CPU streams). A buffer must be reset or destroyed before its stream is destroyed (if a
/// gpukit::stream is destroyed first, the free is reported through gpukit::warn and the memory is reused only after
/// the stream's last work; a raw cudaStream_t is not checked), and before its allocator is (default allocators live
/// until the process exits).
///
///     gpukit::stream s(gpukit::device::cuda(0));
///     gpukit::device_buffer<float> x(1 << 20, s);     // from cuda:0's caching allocator, usable on s
///     kernel<<<grid, block, 0, s.cuda_handle()>>>(x.data(), x.size());
///     // ~device_buffer: freed in s's order: the memory is reused by later work on s, never during the kernel

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/span.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstddef>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

GPUKIT_BEGIN_NAMESPACE

namespace detail {
/// Frees memory from a destructor: an error cannot be thrown there, so it is reported through gpukit::warn.
GPUKIT_INLINE void deallocate_quietly(device_resource* allocator, void* p, const char* owner) noexcept;
}  // namespace detail

/// Raw bytes of stream-ordered device memory, owned (move-only). An empty allocation (0 bytes, default
/// constructed or moved from) has get() == nullptr.
class device_allocation {
 public:
  /// Empty; belongs to no device (device() is the CPU).
  device_allocation() noexcept = default;

  /// `bytes` from the default allocator of `stream`'s device, usable on `stream` at once. (`Deferred`, never given:
  /// see default_allocator.)
  template <int Deferred = 0>
  device_allocation(std::size_t bytes, stream_view stream)
      : device_allocation(bytes, stream, default_allocator(stream.device())) {}

  /// `bytes` from the default allocator of `d`, on the calling thread's current stream of `d` (current_stream(d):
  /// the default stream unless a stream_guard says otherwise), as PyTorch allocates on the current stream.
  template <int Deferred = 0>
  device_allocation(std::size_t bytes, gpukit::device d) : device_allocation(bytes, current_stream(d)) {}

  /// `bytes` from `allocator`, which must outlive this allocation.
  device_allocation(std::size_t bytes, stream_view stream, device_resource& allocator);

  /// `bytes` from `allocator` (which must outlive this allocation), aligned to `alignment` (a power of two; see
  /// device_resource::allocate). Throws invalid_argument_error for another alignment.
  device_allocation(std::size_t bytes, std::size_t alignment, stream_view stream, device_resource& allocator);

  /// Takes over `other`'s memory, allocator and stream; `other` is left empty.
  device_allocation(device_allocation&& other) noexcept;
  /// Frees this allocation's memory in its stream's order (errors are reported through gpukit::warn), then takes
  /// over `other`'s; `other` is left empty.
  device_allocation& operator=(device_allocation&& other) noexcept;
  device_allocation(const device_allocation&) = delete;
  device_allocation& operator=(const device_allocation&) = delete;
  ~device_allocation();

  /// The memory (device memory: dereference only in device code), or nullptr when empty.
  void* get() const noexcept;
  /// Size in bytes, as requested (0 when empty).
  std::size_t size() const noexcept;
  /// True when there is no memory (get() == nullptr).
  bool empty() const noexcept;
  /// True when there is memory (get() != nullptr).
  explicit operator bool() const noexcept;
  /// The device the memory is on: its allocator's (the CPU when default-constructed, moved from or reset).
  gpukit::device device() const noexcept;
  /// The stream the memory was allocated on and is freed on (the CPU's default stream when default-constructed, moved
  /// from or reset, as device() is the CPU then).
  stream_view stream() const noexcept;
  /// The allocator it came from, or nullptr when default-constructed, moved from or reset (a zero-byte allocation
  /// keeps its allocator).
  device_resource* allocator() const noexcept;

  /// Frees the memory now (in the stream's order) and leaves the allocation empty, also when the free throws (a
  /// misuse such as freeing the pointer behind the handle's back is reported once, not again by the destructor).
  void reset();

  /// `s` also uses this memory: when freed, it is reused only after s's work up to then (record_stream).
  void record_stream(stream_view s);

 private:
  template <class>
  friend class device_buffer;

  /// Frees from a destructor or move assignment: errors are reported through gpukit::warn, naming `owner`.
  void free_quietly(const char* owner = "device_allocation") noexcept;
  /// The stream of an empty allocation: the CPU's default stream, as its device is the CPU.
  static stream_view no_stream() noexcept { return stream_view::default_stream(gpukit::device::cpu()); }

  device_resource* allocator_ = nullptr;
  stream_view stream_ = no_stream();
  void* pointer_ = nullptr;
  std::size_t size_ = 0;
};

/// `size()` elements of T in stream-ordered device memory, uninitialised, owned (move-only).
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable<T>::value,
                "gpukit::device_buffer<T>: T must be trivially copyable (device memory runs no constructors)");
  static_assert(!std::is_const<T>::value, "gpukit::device_buffer<T>: T must not be const");

 public:
  /// The element type.
  using value_type = T;
  /// The type of sizes and counts.
  using size_type = std::size_t;
  /// Pointer to an element (device memory).
  using pointer = T*;
  /// Pointer to a const element (device memory).
  using const_pointer = const T*;

  /// Empty (no memory, CPU device).
  device_buffer() noexcept = default;

  /// `count` elements from the default allocator of `stream`'s device, usable on `stream` at once.
  device_buffer(std::size_t count, stream_view stream)
      : device_buffer(count, stream, default_allocator(stream.device())) {}

  /// `count` elements from the default allocator of `d`, on the calling thread's current stream of `d`
  /// (current_stream(d): the default stream unless a stream_guard says otherwise), as PyTorch allocates.
  device_buffer(std::size_t count, gpukit::device d) : device_buffer(count, current_stream(d)) {}

  /// `count` elements from `allocator` (which must outlive the buffer), usable on `stream` at once, aligned for
  /// `T` (however large alignof(T) is). Throws
  /// invalid_argument_error if count * sizeof(T) overflows, out_of_memory_error if memory cannot be had.
  device_buffer(std::size_t count, stream_view stream, device_resource& allocator)
      : memory_(detail::checked_bytes(count, sizeof(T), "gpukit::device_buffer"), alignof(T), stream, allocator) {}

  /// Takes over `other`'s memory, allocator and stream; `other` is left empty.
  device_buffer(device_buffer&& other) noexcept = default;
  /// Frees this buffer's memory in its stream's order (errors are reported through gpukit::warn), then takes over
  /// `other`'s; `other` is left empty.
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      memory_.free_quietly("device_buffer");
      memory_ = std::move(other.memory_);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { memory_.free_quietly("device_buffer"); }

  /// The first element (device memory: dereference only in device code), or nullptr when empty.
  T* data() noexcept { return static_cast<T*>(memory_.get()); }
  /// The first element, read-only (device memory), or nullptr when empty.
  const T* data() const noexcept { return static_cast<const T*>(memory_.get()); }
  /// Number of elements.
  std::size_t size() const noexcept { return memory_.size() / sizeof(T); }
  /// Size in bytes: size() * sizeof(T).
  std::size_t size_bytes() const noexcept { return memory_.size(); }
  /// True when the buffer holds no elements.
  bool empty() const noexcept { return memory_.size() == 0; }
  /// The elements as a span (device memory: dereference only in device code, or on the host for the CPU device).
  gpukit::span<T> span() noexcept { return {data(), size()}; }
  /// The elements as a read-only span (device memory, as above).
  gpukit::span<const T> span() const noexcept { return {data(), size()}; }
  /// The device the memory is on (the CPU for a default-constructed or moved-from buffer).
  gpukit::device device() const noexcept { return memory_.device(); }
  /// The stream the memory was allocated on and is freed on (the CPU's default stream when empty but for a zero-size
  /// buffer, as device() is the CPU then).
  stream_view stream() const noexcept { return memory_.stream(); }
  /// The allocator the memory came from, or nullptr for a default-constructed, moved-from or reset buffer.
  device_resource* allocator() const noexcept { return memory_.allocator(); }
  /// The memory as raw bytes (the buffer still owns it).
  const device_allocation& allocation() const noexcept { return memory_; }

  /// Frees the memory now (in the stream's order) and leaves the buffer empty, also when the free throws. Errors are
  /// thrown (the destructor reports them through gpukit::warn instead).
  void reset() { memory_.reset(); }

  /// `s` also uses this memory: when freed, it is reused only after s's work up to then (record_stream).
  void record_stream(stream_view s) { memory_.record_stream(s); }

 private:
  device_allocation memory_;  // count * sizeof(T) bytes, aligned for T
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE void deallocate_quietly(device_resource* allocator, void* p, const char* owner) noexcept {
  try {
    allocator->deallocate(p);
  } catch (const std::exception& e) {
    warn_parts("gpukit: freeing a ", owner, " failed: ", e.what());
  } catch (...) {
    warn_parts("gpukit: freeing a ", owner, " failed");
  }
}
}  // namespace detail

GPUKIT_INLINE device_allocation::device_allocation(std::size_t bytes, stream_view stream, device_resource& allocator)
    : allocator_(&allocator), stream_(stream), size_(bytes) {
  pointer_ = allocator.allocate(bytes, stream);
}

GPUKIT_INLINE device_allocation::device_allocation(std::size_t bytes, std::size_t alignment, stream_view stream,
                                                   device_resource& allocator)
    : allocator_(&allocator), stream_(stream), size_(bytes) {
  pointer_ = allocator.allocate(bytes, alignment, stream);
}

GPUKIT_INLINE device_allocation::device_allocation(device_allocation&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      stream_(std::exchange(other.stream_, no_stream())),
      pointer_(std::exchange(other.pointer_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

GPUKIT_INLINE device_allocation& device_allocation::operator=(device_allocation&& other) noexcept {
  if (this != &other) {
    free_quietly();
    allocator_ = std::exchange(other.allocator_, nullptr);
    stream_ = std::exchange(other.stream_, no_stream());
    pointer_ = std::exchange(other.pointer_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

GPUKIT_INLINE device_allocation::~device_allocation() { free_quietly(); }

GPUKIT_INLINE void* device_allocation::get() const noexcept { return pointer_; }

GPUKIT_INLINE std::size_t device_allocation::size() const noexcept { return size_; }

GPUKIT_INLINE bool device_allocation::empty() const noexcept { return pointer_ == nullptr; }

GPUKIT_INLINE device_allocation::operator bool() const noexcept { return pointer_ != nullptr; }

GPUKIT_INLINE gpukit::device device_allocation::device() const noexcept {
  return allocator_ != nullptr ? allocator_->device() : gpukit::device::cpu();
}

GPUKIT_INLINE stream_view device_allocation::stream() const noexcept { return stream_; }

GPUKIT_INLINE device_resource* device_allocation::allocator() const noexcept { return allocator_; }

GPUKIT_INLINE void device_allocation::reset() {
  void* p = std::exchange(pointer_, nullptr);
  device_resource* allocator = std::exchange(allocator_, nullptr);
  stream_ = no_stream();
  size_ = 0;
  if (p != nullptr) allocator->deallocate(p);
}

GPUKIT_INLINE void device_allocation::record_stream(stream_view s) {
  if (pointer_ != nullptr) allocator_->record_stream(pointer_, s);
}

GPUKIT_INLINE void device_allocation::free_quietly(const char* owner) noexcept {
  if (pointer_ != nullptr) detail::deallocate_quietly(allocator_, pointer_, owner);
  pointer_ = nullptr;
  allocator_ = nullptr;
  stream_ = no_stream();
  size_ = 0;
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
