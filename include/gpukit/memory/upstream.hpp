// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Upstreams: where the caching allocator gets its segments from. An upstream is any type with
///
///     void* allocate(std::size_t bytes);                 // out of memory: nullptr or out_of_memory_error
///     void deallocate(void* p, std::size_t bytes) noexcept;
///     upstream_memory_info memory_info() const;          // free and total, for limits and OOM messages
///     bool synchronizes_on_free() const noexcept;        // deallocate waits for all work of the device
///
/// and, for expandable segments, optionally reserve / map / unmap / unreserve / page_size, where
///
///     bool unmap(void* address, std::size_t bytes) noexcept;  // false: nothing unmapped (the pages stay in use)
///
/// may also return void (it always unmaps). An upstream whose unmap waits for the device may split that wait off:
///
///     bool wait_before_unmap() noexcept;                           // waits for all work of the device; false: failed
///     bool unmap_after_wait(void* address, std::size_t bytes) noexcept;  // unmap, without the wait
///
/// so that the caching allocator waits without its lock held (threads allocate meanwhile, instead of queuing behind
/// a device synchronization), then unmaps only pages free since before the wait. Such an upstream may also have
///
///     bool wait_before_unmap(const std::vector<const event*>& after) noexcept;  // false: failed
///
/// which waits only for the events in `after` (the caching allocator records one on each stream that may still use
/// the pages): another thread's capture survives that wait, where a device synchronization invalidates it. The
/// allocator falls back to wait_before_unmap() where it knows no such stream (a raw stream handle). An upstream that
/// can free in stream order may also have
///
///     bool deallocate_after(void* p, std::size_t bytes, const std::vector<const event*>& after) noexcept;
///
/// which gives a whole segment back once the events in `after` have completed, without waiting on the host (the
/// caching allocator records them on the streams that may still use the segment); false: nothing was done, and
/// deallocate is called instead (async_pool_upstream has it, and resource_upstream over a stream-ordered resource).
///
/// Out of memory is nullptr or a thrown out_of_memory_error, whichever the upstream finds natural: both engines (this
/// caching allocator and pinned_pool) take either as a refusal, release cached memory and try again, and other
/// exceptions as failures that propagate. allocate and deallocate are the whole contract the pinned pool needs, so one
/// upstream type can serve both engines (a capacity-limited host_upstream backs a pinned pool in tests).
///
/// Upstreams are called without the allocator's lock held, so they must be thread-safe. gpukit provides:
/// - cuda_upstream: cudaMalloc / cudaFree on one CUDA device (cudaFree synchronizes the device);
/// - host_upstream: aligned host memory, optionally capacity-limited (the CPU device's memory);
/// - address_space_upstream: hands out address ranges of a capacity-limited fake address space without touching
///   any memory (for simulations, trace replays and tests of out-of-memory handling);
/// - device_upstream: cuda_upstream or host_upstream, chosen by a gpukit::device at run time.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/sizes.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/map_node.hpp>
#include <gpukit/stream/event.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace gpukit {
namespace mode_independent {
struct peer_access_registry;  // device/detail/peer_registry.hpp, which only the function bodies below need
}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

/// Free and total memory as an upstream sees it. `known` is false when the upstream cannot tell (then both are 0).
struct upstream_memory_info {
  std::size_t free_bytes = 0;   ///< bytes the upstream could still supply
  std::size_t total_bytes = 0;  ///< bytes it has in all (the device's memory, or a capacity)
  bool known = false;           ///< free_bytes and total_bytes are meaningful
};

/// Segments are at least this aligned by every gpukit upstream (cudaMalloc guarantees 256 bytes).
inline constexpr std::size_t upstream_alignment = 256;

/// Host memory (the CPU device's "device memory"), aligned to upstream_alignment. An optional capacity makes it
/// fail like a full GPU would, so out-of-memory handling can be tested with memory that can be written.
class host_upstream {
 public:
  /// \param capacity bytes that may be outstanding at once (default: unlimited, i.e. until the host runs out)
  explicit host_upstream(std::size_t capacity = std::numeric_limits<std::size_t>::max()) noexcept;
  /// Takes over the capacity and the bytes handed out (an engine that takes its upstream by value, as pinned_pool
  /// does, moves it in before it allocates anything). Not thread-safe against calls on `other`.
  host_upstream(host_upstream&& other) noexcept;

  /// Memory for a segment, or nullptr when the capacity or the host is exhausted (the allocator then frees its
  /// cache and retries, and reports out of memory if that does not help).
  [[nodiscard]] void* allocate(std::size_t bytes);

  /// Returns a segment; `bytes` must be the size it was allocated with.
  void deallocate(void* p, std::size_t bytes) noexcept;

  /// The capacity (or the machine's physical memory when unlimited) and what remains of it.
  upstream_memory_info memory_info() const noexcept;

  /// Host memory is freed at once, whatever CPU streams still do with it: the allocator must wait for them first.
  bool synchronizes_on_free() const noexcept;

  /// Bytes currently handed out.
  std::size_t used() const noexcept;

 private:
  static std::size_t physical_memory() noexcept;

  std::size_t capacity_;
  std::atomic<std::size_t> used_{0};
};

/// A capacity-limited fake address space: allocate() returns distinct, aligned addresses that must never be
/// dereferenced. It lets the allocator be driven through allocation traces far larger than this machine's memory
/// (fragmentation benchmarks) and lets tests exhaust "device memory" exactly (capacity, set_capacity). Freed ranges
/// are reused (first fit), as a driver would reuse virtual addresses.
class address_space_upstream {
 public:
  /// \param capacity  bytes that may be outstanding at once
  /// \param alignment alignment of returned addresses (a power of two, at least upstream_alignment)
  explicit address_space_upstream(std::size_t capacity, std::size_t alignment = upstream_alignment);

  address_space_upstream(const address_space_upstream&) = delete;
  address_space_upstream& operator=(const address_space_upstream&) = delete;

  /// A fresh address range of `bytes` rounded up to the alignment (what it costs of the capacity), or nullptr when
  /// the capacity would be exceeded (or after fail_next()).
  [[nodiscard]] void* allocate(std::size_t bytes);

  /// Returns a range; `bytes` must be the size it was allocated with. An unknown address, or a size other than the
  /// allocated one, is reported through gpukit::warn (this upstream is used by tests, which should see such a bug);
  /// the range is freed whole either way.
  void deallocate(void* p, std::size_t bytes) noexcept;

  /// The capacity and what remains of it.
  upstream_memory_info memory_info() const;

  /// No memory is touched, so nothing can still be using it.
  bool synchronizes_on_free() const noexcept;

  // --- virtual memory, as the driver's cuMemAddressReserve / cuMemCreate + cuMemMap model it (expandable segments) ---

  /// The mapping granularity (2 MiB, as cuMemGetAllocationGranularity says on current GPUs).
  std::size_t page_size() const noexcept;
  /// Reserves an address range of `bytes` (a multiple of page_size()) that costs no capacity; nullptr when the
  /// address space is exhausted.
  void* reserve(std::size_t bytes);
  /// Backs [address, address + bytes) of a reservation with capacity, page by page; false (nothing mapped) when the
  /// capacity would be exceeded (or after fail_next()). Throws invalid_argument_error for a range outside a
  /// reservation, not page-aligned, or with a page already mapped (a bug of the caller).
  bool map(void* address, std::size_t bytes);
  /// Returns the capacity of mapped pages in [address, address + bytes); every page must be mapped (else warns).
  /// Returns false, having unmapped nothing, when the range is not whole pages of a reservation.
  bool unmap(void* address, std::size_t bytes) noexcept;
  /// What cuda_upstream waits for before unmapping; here nothing runs, so nothing is waited for. Counted
  /// (device_waits()); true.
  bool wait_before_unmap() noexcept;
  /// unmap(), after wait_before_unmap().
  bool unmap_after_wait(void* address, std::size_t bytes) noexcept;
  /// Number of wait_before_unmap() calls so far.
  std::size_t device_waits() const;
  /// Gives a reservation back; its pages must have been unmapped (else warns, and unmaps them).
  void unreserve(void* address, std::size_t bytes) noexcept;
  /// Bytes of mapped pages (part of used()).
  std::size_t mapped() const;
  /// The granularity of map() (a power of two, at least the alignment); for tests of other page sizes.
  void set_page_size(std::size_t bytes);

  /// Changes the capacity, e.g. to simulate another process taking memory. Ranges already out stay valid.
  void set_capacity(std::size_t capacity);
  /// Makes the next `count` calls of allocate() or map() fail whatever the capacity (failure injection for tests);
  /// replaces any count still pending, so fail_next(0) disarms. Throws invalid_argument_error for a negative count.
  void fail_next(int count);
  /// Bytes that may be outstanding at once (see set_capacity).
  std::size_t capacity() const;
  /// Bytes outstanding now (ranges handed out and mapped pages).
  std::size_t used() const;
  /// The most bytes ever outstanding (a trace replay's peak reserved memory); never reset.
  std::size_t peak() const;
  /// Number of successful allocate() calls so far.
  std::size_t allocations() const;

  /// Where the fake address space starts (far from any real mapping, so a stray dereference faults).
  static constexpr std::uintptr_t base_address = std::uintptr_t{1} << 44;
  /// Size of the fake address space (64 TiB): allocate() and reserve() take their ranges from it, whatever the
  /// capacity.
  static constexpr std::size_t address_space_size = std::size_t{1} << 46;

 private:
  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::size_t alignment_;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
  std::size_t allocations_ = 0;
  std::size_t device_waits_ = 0;
  int forced_failures_ = 0;
  // start -> size. A range moves between these maps as a node, so that giving one back never allocates.
  using range_map = std::map<std::uintptr_t, std::size_t>;
  range_map free_ranges_;  // coalesced
  range_map sizes_;        // each range handed out (its aligned size)
  std::size_t page_size_ = std::size_t{2} << 20;
  range_map reservations_;           // each reserved range
  std::set<std::uintptr_t> mapped_;  // mapped pages

  /// A free address range of `bytes` aligned to `alignment` (an empty node when none), taken out of free_ranges_.
  /// Strong guarantee: throws std::bad_alloc, having changed nothing, when a node for it or its remainder cannot
  /// be made.
  range_map::node_type take_range(std::size_t bytes, std::size_t alignment);
  /// Puts a range back into free_ranges_, joined with its free neighbours (no allocation).
  void give_range(range_map::node_type range) noexcept;
  std::uintptr_t check_pages(void* address, std::size_t bytes, const char* operation) const;
};

namespace detail {
/// How the wait before a release ended: the device is idle; the wait failed (reported); the runtime is torn down
/// (process exit: the device's memory went with it, nothing is reported); or it was not made, or refused, because a
/// capture is underway (a device-wide wait would invalidate it, in any mode): the memory may go back after it.
enum class release_wait { idle, failed, torn_down, kept_for_capture };

/// Waits for all work of CUDA device `d` before memory goes back to where it came from, as cudaFree waits: kernels
/// queued earlier may still use it. A failure is reported through gpukit::warn (nothing during teardown) as
/// "cudaDeviceSynchronize (before <what>)"; the caller then keeps the memory, since a failed wait (a broken context)
/// may not have waited at all. While a capture is in sight (detail::capture_in_sight) no wait is made, nothing is
/// reported, and the answer is kept_for_capture, as for a wait refused by a capture gpukit could not see (reported).
GPUKIT_INLINE release_wait wait_before_release(gpukit::device d, const char* what) noexcept;

/// Waits for the work the events in `after` (of CUDA device `d`) captured, not for the whole device, before memory
/// that only that work may still use goes back: cudaEventSynchronize of each, in relaxed capture mode, so that another
/// thread's capture (in global mode, of a stream that is not waited for) neither refuses the wait nor is invalidated
/// by it, as cudaDeviceSynchronize would be. A failure is reported as by wait_before_release, as
/// "cudaEventSynchronize (before <what>)"; idle here means that work has completed.
GPUKIT_INLINE release_wait wait_for_events_before_release(gpukit::device d, const std::vector<const event*>& after,
                                                          const char* what) noexcept;
}  // namespace detail

/// cudaMalloc / cudaFree on one CUDA device, with that device made current around each call.
class cuda_upstream {
 public:
  /// No CUDA call is made until the first allocation.
  explicit cuda_upstream(gpukit::device d);
  /// A copy serves the same device and knows what this one learnt of its virtual memory support.
  cuda_upstream(const cuda_upstream& other) noexcept;
  /// Serves `other`'s device from now on.
  cuda_upstream& operator=(const cuda_upstream& other) noexcept;

  /// cudaMalloc; nullptr for cudaErrorMemoryAllocation (the allocator retries after freeing its cache); any other
  /// failure (no driver, invalid device) throws the matching gpukit exception.
  [[nodiscard]] void* allocate(std::size_t bytes);
  /// The caching allocator's last resort, once its own cache is given back and the device is still full: what the
  /// device's default memory pool keeps unused goes back to the driver (cudaMemPoolTrimTo(pool, 0): memory that
  /// cudaMallocAsync's users, such as async_allocator or another library, freed and keep up to a release threshold).
  /// True when the pool gave some back. Never throws.
  bool release_unused_elsewhere() noexcept;

  /// cudaFree, which waits for all work of the device; a failure is reported through gpukit::warn.
  void deallocate(void* p, std::size_t /*bytes*/) noexcept;

  /// cudaMemGetInfo (the device's context exists by then: the allocator only asks after allocating on it).
  upstream_memory_info memory_info() const;

  /// cudaFree waits for all work of the device, so the allocator need not wait before it.
  bool synchronizes_on_free() const noexcept;
  /// The CUDA device whose memory this upstream allocates.
  gpukit::device device() const noexcept;

  // --- virtual memory (expandable segments): the driver's cuMem* functions, from cudaGetDriverEntryPoint ---

  /// Whether the driver provides the virtual memory functions and the device supports them
  /// (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED). Asked once; thread-safe (threads that ask at the
  /// same time may both ask the driver, and learn the same); never throws.
  bool virtual_memory_supported() const noexcept;
  /// The mapping granularity (2 MiB on current GPUs); 0 when virtual memory is unsupported.
  std::size_t page_size() const noexcept;
  /// cuMemAddressReserve of `bytes` (a multiple of page_size()); nullptr when the range cannot be had (out of memory
  /// or address space, or a size the driver refuses); throws gpukit::cuda_error naming the call and its CUresult for
  /// any other failure (a sticky error, say), which no smaller range would avoid.
  void* reserve(std::size_t bytes);
  /// Backs whole pages of a reservation: cuMemCreate, cuMemMap and cuMemSetAccess (read/write for this device and for
  /// every device holding a gpukit::peer_access to it) per page; each handle is released at once, so the memory goes
  /// when its page is unmapped. False when the device is out of memory (the pages mapped so far stay); throws
  /// gpukit::cuda_error for any other failure.
  bool map(void* address, std::size_t bytes);
  /// Waits for the device's work (as cudaFree does: queued kernels may still use the pages), then cuMemUnmap per
  /// page. Returns false, having unmapped nothing, when the wait failed (detail::wait_before_release): the pages
  /// stay mapped. A page that cuMemUnmap refuses is reported through gpukit::warn and counts as unmapped to the
  /// caller, but stays mapped and recorded here: a later map() of it keeps it instead of mapping it twice, and
  /// unreserve() tries to unmap it again before freeing its range. Once the runtime is torn down (process exit),
  /// nothing runs on the device any more: the pages are unmapped without a wait where the driver still can, and
  /// where it cannot they went with it; true either way, with nothing reported.
  bool unmap(void* address, std::size_t bytes) noexcept;
  /// The wait of unmap() alone (cudaDeviceSynchronize on this device): true when the device is idle, or the runtime
  /// torn down; false, reported through gpukit::warn, when it could not be waited for.
  bool wait_before_unmap() noexcept;
  /// The wait before unmapping pages that only the work the events in `after` captured may still use (the caching
  /// allocator records one on each stream that owns a free block on them): cudaEventSynchronize of each, in relaxed
  /// capture mode (detail::wait_for_events_before_release), so that another thread's capture survives it. True when
  /// that work has completed, or the runtime is torn down; false, reported through gpukit::warn, when it could not be
  /// waited for.
  bool wait_before_unmap(const std::vector<const event*>& after) noexcept;
  /// unmap() without its wait: the caller waited (wait_before_unmap()) after the pages' last use.
  bool unmap_after_wait(void* address, std::size_t bytes) noexcept;
  /// cuMemAddressFree, after unmapping the range's pages that an earlier unmap() could not; failures are reported
  /// through gpukit::warn (a range that still has a page mapped is not freed: CUDA forbids it, so it stays reserved),
  /// except those of a runtime torn down at process exit, which freed the range itself.
  void unreserve(void* address, std::size_t bytes) noexcept;

 private:
  /// The pages of [start, end) recorded as mapped for this device (registry lock held).
  std::set<CUdeviceptr> recorded_pages(const mode_independent::peer_access_registry& registry, CUdeviceptr start,
                                       CUdeviceptr end) const;
  /// Unmaps the pages of [start, end) still recorded as mapped (an earlier cuMemUnmap refused them; nothing can use
  /// them since: the caller counted them unmapped). Returns CUDA_SUCCESS, or the failure of one that still cannot be
  /// unmapped (reported, unless it says the driver is torn down: then the rest are not tried).
  CUresult unmap_leftover_pages(CUdeviceptr start, CUdeviceptr end);
  /// Records [start, end) as mapped pages of this device for peer_access, and, if peers were granted or released
  /// since `generation`, sets those peers' access to the new pages as the registry now says. If the record cannot
  /// be made (no memory), the pages are unmapped again and the exception propagates.
  void record_mapped(CUdeviceptr start, CUdeviceptr end, const std::vector<int>& peers, std::uint64_t generation);
  CUmemAllocationProp allocation_properties() const noexcept;
  [[noreturn]] void throw_driver_failure(const char* call, CUresult r) const;

  gpukit::device device_;
  // What the driver said of virtual memory, asked once: not asked, unsupported, or (page size << 1) | 1.
  static constexpr std::uint64_t vm_not_asked = 0;
  static constexpr std::uint64_t vm_unsupported = 2;
  /// The page size once virtual_memory_supported() said yes.
  std::size_t page_bytes() const noexcept;
  mutable std::atomic<std::uint64_t> vm_{vm_not_asked};
};

/// The upstream of a gpukit::device: cudaMalloc for cuda:N, host memory for the CPU. The default allocators use it.
/// The device's kind is chosen once, at construction: a CPU upstream holds no CUDA upstream at all.
class device_upstream {
 public:
  /// The upstream of device `d` (CUDA or the CPU). Makes no CUDA call.
  explicit device_upstream(gpukit::device d);

  /// cudaMalloc on a CUDA device, unlimited host memory on the CPU; nullptr when out of memory (cuda_upstream,
  /// host_upstream).
  [[nodiscard]] void* allocate(std::size_t bytes);
  /// Returns a segment; `bytes` must be the size it was allocated with. On CUDA, cudaFree waits for the device.
  void deallocate(void* p, std::size_t bytes) noexcept;
  /// cuda_upstream::release_unused_elsewhere() on a CUDA device; false on the CPU.
  bool release_unused_elsewhere() noexcept;
  /// The CUDA device's free and total memory (cudaMemGetInfo), or the host's physical memory for the CPU.
  upstream_memory_info memory_info() const;
  /// True on CUDA devices (cudaFree waits for the device); false on the CPU, whose memory is freed at once.
  bool synchronizes_on_free() const noexcept;
  /// The device this upstream serves.
  gpukit::device device() const noexcept;

  /// Virtual memory on CUDA devices that support it (cuda_upstream); never for the CPU.
  bool virtual_memory_supported() const noexcept;
  /// The mapping granularity (cuda_upstream::page_size()); 0 on the CPU or without virtual memory.
  std::size_t page_size() const noexcept;
  /// Reserves an address range of `bytes` (cuda_upstream::reserve()); nullptr when refused or without virtual memory.
  void* reserve(std::size_t bytes);
  /// Backs whole pages of a range reserve() returned (cuda_upstream::map()); false when the device is out of memory.
  /// Throws invalid_argument_error on the CPU, where reserve() never returns a range.
  bool map(void* address, std::size_t bytes);
  /// Unmaps whole pages after the device's work completes (cuda_upstream::unmap(): false, the pages still mapped,
  /// when that wait failed); failures, and a call on the CPU (false), are warned about.
  bool unmap(void* address, std::size_t bytes) noexcept;
  /// cuda_upstream::wait_before_unmap(); false, warned about, on the CPU.
  bool wait_before_unmap() noexcept;
  /// cuda_upstream::wait_before_unmap(after); false, warned about, on the CPU.
  bool wait_before_unmap(const std::vector<const event*>& after) noexcept;
  /// cuda_upstream::unmap_after_wait(); false, warned about, on the CPU.
  bool unmap_after_wait(void* address, std::size_t bytes) noexcept;
  /// Gives a range reserve() returned back (cuda_upstream::unreserve()); failures, and a call on the CPU, are warned
  /// about.
  void unreserve(void* address, std::size_t bytes) noexcept;

 private:
  static void warn_no_virtual_memory(const char* call) noexcept;
  gpukit::device device_;
  std::optional<cuda_upstream> cuda_;  // for a CUDA device only
  host_upstream host_;                 // for the CPU only (it holds no memory until it allocates)
};

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
#include <gpukit/device/detail/peer_registry.hpp>

GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE host_upstream::host_upstream(std::size_t capacity) noexcept : capacity_(capacity) {}

GPUKIT_INLINE host_upstream::host_upstream(host_upstream&& other) noexcept
    : capacity_(other.capacity_), used_(other.used_.load(std::memory_order_relaxed)) {}

GPUKIT_INLINE void* host_upstream::allocate(std::size_t bytes) {
  std::size_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > capacity_ || used > capacity_ - bytes) return nullptr;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  void* p = ::operator new (bytes, std::align_val_t{upstream_alignment}, std::nothrow);
  if (p == nullptr) used_.fetch_sub(bytes, std::memory_order_relaxed);
  return p;
}

GPUKIT_INLINE void host_upstream::deallocate(void* p, std::size_t bytes) noexcept {
  ::operator delete (p, std::align_val_t{upstream_alignment});
  used_.fetch_sub(bytes, std::memory_order_relaxed);
}

GPUKIT_INLINE upstream_memory_info host_upstream::memory_info() const noexcept {
  std::size_t total = capacity_;
  if (total == std::numeric_limits<std::size_t>::max()) total = physical_memory();
  const std::size_t used = used_.load(std::memory_order_relaxed);
  upstream_memory_info info;
  info.total_bytes = total;
  info.free_bytes = used < total ? total - used : 0;
  info.known = total != 0;
  return info;
}

GPUKIT_INLINE bool host_upstream::synchronizes_on_free() const noexcept { return false; }

GPUKIT_INLINE std::size_t host_upstream::used() const noexcept { return used_.load(std::memory_order_relaxed); }

GPUKIT_INLINE std::size_t host_upstream::physical_memory() noexcept {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGE_SIZE)
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0) return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
#endif
  return 0;
}

GPUKIT_INLINE address_space_upstream::address_space_upstream(std::size_t capacity, std::size_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  if (alignment < upstream_alignment || !detail::is_power_of_two(alignment)) {
    throw invalid_argument_error(
        "gpukit::address_space_upstream: the alignment must be a power of two of at "
        "least " +
        std::to_string(upstream_alignment) + " bytes");
  }
  free_ranges_.emplace(base_address, address_space_size);
}

GPUKIT_INLINE void* address_space_upstream::allocate(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (forced_failures_ > 0) {
    --forced_failures_;
    return nullptr;
  }
  const std::size_t size = (bytes + alignment_ - 1) & ~(alignment_ - 1);
  if (bytes == 0 || size < bytes || size > capacity_ || used_ > capacity_ - size) return nullptr;
  range_map::node_type range = take_range(size, alignment_);
  if (range.empty()) return nullptr;
  const std::uintptr_t start = range.key();
  used_ += size;
  if (used_ > peak_) peak_ = used_;
  ++allocations_;
  sizes_.insert(std::move(range));
  return reinterpret_cast<void*>(start);
}

GPUKIT_INLINE void address_space_upstream::deallocate(void* p, std::size_t bytes) noexcept {
  const detail::hold_warnings held;  // delivered after the lock: a handler may ask this upstream
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = reinterpret_cast<std::uintptr_t>(p);
  const auto found = sizes_.find(start);
  if (found == sizes_.end()) {
    warn("gpukit::address_space_upstream: deallocate of an address it did not hand out");
    return;
  }
  const std::size_t size = found->second;
  if (((bytes + alignment_ - 1) & ~(alignment_ - 1)) != size) {
    detail::warn_parts("gpukit::address_space_upstream: deallocate of ", bytes, " bytes for a range of ", size,
                       " bytes");
  }
  used_ -= size;
  give_range(sizes_.extract(found));
}

GPUKIT_INLINE upstream_memory_info address_space_upstream::memory_info() const {
  std::lock_guard<std::mutex> lock(mutex_);
  upstream_memory_info info;
  info.total_bytes = capacity_;
  info.free_bytes = capacity_ - (used_ < capacity_ ? used_ : capacity_);
  info.known = true;
  return info;
}

GPUKIT_INLINE bool address_space_upstream::synchronizes_on_free() const noexcept { return true; }

GPUKIT_INLINE std::size_t address_space_upstream::page_size() const noexcept { return page_size_; }

GPUKIT_INLINE void* address_space_upstream::reserve(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  range_map::node_type range = take_range(bytes, page_size_);
  if (range.empty()) return nullptr;
  const std::uintptr_t start = range.key();
  reservations_.insert(std::move(range));
  return reinterpret_cast<void*>(start);
}

GPUKIT_INLINE bool address_space_upstream::map(void* address, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = check_pages(address, bytes, "map");
  for (std::uintptr_t at = start; at < start + bytes; at += page_size_) {
    if (mapped_.count(at) != 0) throw invalid_argument_error("gpukit::address_space_upstream: map of a mapped page");
  }
  if (forced_failures_ > 0) {
    --forced_failures_;
    return false;
  }
  if (bytes > capacity_ || used_ > capacity_ - bytes) return false;
  std::uintptr_t at = start;
  try {
    for (; at < start + bytes; at += page_size_) mapped_.insert(at);
  } catch (...) {
    for (std::uintptr_t page = start; page < at; page += page_size_) mapped_.erase(page);
    throw;
  }
  used_ += bytes;
  if (used_ > peak_) peak_ = used_;
  ++allocations_;
  return true;
}

GPUKIT_INLINE bool address_space_upstream::unmap(void* address, std::size_t bytes) noexcept {
  const detail::hold_warnings held;  // delivered after the lock: a handler may ask this upstream
  std::lock_guard<std::mutex> lock(mutex_);
  std::uintptr_t start = 0;
  try {
    start = check_pages(address, bytes, "unmap");
  } catch (const std::exception& e) {
    warn(e.what());
    return false;
  }
  for (std::uintptr_t at = start; at < start + bytes; at += page_size_) {
    if (mapped_.erase(at) == 0) {
      warn("gpukit::address_space_upstream: unmap of a page that is not mapped");
      continue;
    }
    used_ -= page_size_;
  }
  return true;
}

GPUKIT_INLINE bool address_space_upstream::wait_before_unmap() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  ++device_waits_;
  return true;
}

GPUKIT_INLINE bool address_space_upstream::unmap_after_wait(void* address, std::size_t bytes) noexcept {
  return unmap(address, bytes);
}

GPUKIT_INLINE std::size_t address_space_upstream::device_waits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return device_waits_;
}

GPUKIT_INLINE void address_space_upstream::unreserve(void* address, std::size_t bytes) noexcept {
  const detail::hold_warnings held;  // delivered after the lock: a handler may ask this upstream
  std::lock_guard<std::mutex> lock(mutex_);
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  const auto found = reservations_.find(start);
  if (found == reservations_.end() || found->second != bytes) {
    warn("gpukit::address_space_upstream: unreserve of a range it did not reserve");
    return;
  }
  for (auto it = mapped_.lower_bound(start); it != mapped_.end() && *it < start + bytes;) {
    warn("gpukit::address_space_upstream: a reservation is given back with pages still mapped");
    used_ -= page_size_;
    it = mapped_.erase(it);
  }
  give_range(reservations_.extract(found));
}

GPUKIT_INLINE std::size_t address_space_upstream::mapped() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mapped_.size() * page_size_;
}

GPUKIT_INLINE void address_space_upstream::set_page_size(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes < alignment_ || !detail::is_power_of_two(bytes) || !reservations_.empty()) {
    throw invalid_argument_error(
        "gpukit::address_space_upstream: a page size must be a power of two of at least "
        "the alignment, set before anything is reserved");
  }
  page_size_ = bytes;
}

GPUKIT_INLINE void address_space_upstream::set_capacity(std::size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = capacity;
}

GPUKIT_INLINE void address_space_upstream::fail_next(int count) {
  if (count < 0) throw invalid_argument_error("gpukit::address_space_upstream::fail_next: a negative count");
  std::lock_guard<std::mutex> lock(mutex_);
  forced_failures_ = count;
}

GPUKIT_INLINE std::size_t address_space_upstream::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

GPUKIT_INLINE std::size_t address_space_upstream::used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

GPUKIT_INLINE std::size_t address_space_upstream::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

GPUKIT_INLINE std::size_t address_space_upstream::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

GPUKIT_INLINE auto address_space_upstream::take_range(std::size_t bytes, std::size_t alignment)
    -> range_map::node_type {
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    const std::uintptr_t start = (it->first + alignment - 1) & ~(static_cast<std::uintptr_t>(alignment) - 1);
    const std::uintptr_t end = it->first + it->second;
    if (start > end || end - start < bytes) continue;
    const std::size_t before = start - it->first;
    const std::size_t after = end - start - bytes;
    // The free range's node keeps what lies before the range taken, or is the range taken when nothing does. New
    // nodes are the only steps that allocate, and come first.
    range_map::node_type rest =
        after != 0 ? detail::detached_node<range_map>(start + bytes, after) : range_map::node_type();
    range_map::node_type taken =
        before != 0 ? detail::detached_node<range_map>(start, bytes) : free_ranges_.extract(it);
    if (before != 0) {
      it->second = before;
    } else {
      taken.mapped() = bytes;
    }
    if (!rest.empty()) free_ranges_.insert(std::move(rest));
    return taken;
  }
  return {};
}

GPUKIT_INLINE void address_space_upstream::give_range(range_map::node_type range) noexcept {
  std::uintptr_t begin = range.key();
  std::size_t size = range.mapped();
  auto next = free_ranges_.lower_bound(begin);
  if (next != free_ranges_.end() && next->first == begin + size) {
    size += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == begin) {
      begin = previous->first;
      size += previous->second;
      free_ranges_.erase(previous);
    }
  }
  range.key() = begin;
  range.mapped() = size;
  free_ranges_.insert(std::move(range));
}

GPUKIT_INLINE std::uintptr_t address_space_upstream::check_pages(void* address, std::size_t bytes,
                                                                 const char* operation) const {
  const auto start = reinterpret_cast<std::uintptr_t>(address);
  auto r = reservations_.upper_bound(start);
  const bool inside =
      r != reservations_.begin() && bytes != 0 &&
      (--r, start >= r->first && start - r->first <= r->second && bytes <= r->second - (start - r->first));
  if (!inside || start % page_size_ != 0 || bytes % page_size_ != 0) {
    throw invalid_argument_error(std::string("gpukit::address_space_upstream: ") + operation +
                                 " of a range that is not whole pages of a reservation");
  }
  return start;
}
namespace detail {

GPUKIT_INLINE release_wait wait_before_release(gpukit::device d, const char* what) noexcept {
  // The wait would invalidate a capture in sight, in any mode: the caller keeps the memory and gives it back later.
  // Not reported: nothing failed.
  if (capture_in_sight(d)) return release_wait::kept_for_capture;
  try {
    device_guard guard(d);
    const cudaError_t waited = cudaDeviceSynchronize();
    if (waited == cudaSuccess) return release_wait::idle;
    if (is_teardown_result(waited)) return release_wait::torn_down;
    // Reported (a capture gpukit could not see was invalidated), then kept for later like one in sight.
    report_cuda_failure(waited, std::string("cudaDeviceSynchronize (before ") + what + ")", d.ordinal());
    if (waited == cudaErrorStreamCaptureUnsupported) return release_wait::kept_for_capture;
  } catch (const error& e) {
    if (is_teardown_result(e.cuda_result())) return release_wait::torn_down;
    warn_parts("gpukit: could not wait for ", d, " before ", what, ": ", e.what());
  } catch (const std::exception& e) {
    warn_parts("gpukit: could not wait for the device before ", what, ": ", e.what());
  }
  return release_wait::failed;
}

GPUKIT_INLINE release_wait wait_for_events_before_release(gpukit::device d, const std::vector<const event*>& after,
                                                          const char* what) noexcept {
  try {
    const relaxed_capture_mode relaxed;  // the events were recorded outside any capture
    for (const event* e : after) {
      const cudaError_t waited = cudaEventSynchronize(e->cuda_handle());
      if (waited == cudaSuccess) continue;
      if (is_teardown_result(waited)) return release_wait::torn_down;
      report_cuda_failure(waited, std::string("cudaEventSynchronize (before ") + what + ")", d.ordinal());
      return release_wait::failed;
    }
    return release_wait::idle;
  } catch (const error& e) {
    if (is_teardown_result(e.cuda_result())) return release_wait::torn_down;
    warn_parts("gpukit: could not wait for the streams of ", d, " before ", what, ": ", e.what());
  } catch (const std::exception& e) {
    warn_parts("gpukit: could not wait for the streams before ", what, ": ", e.what());
  }
  return release_wait::failed;
}
}  // namespace detail

GPUKIT_INLINE cuda_upstream::cuda_upstream(gpukit::device d) : device_(d) {
  if (!d.is_cuda()) throw invalid_argument_error("gpukit::cuda_upstream: " + d.to_string() + " is not a CUDA device");
}

GPUKIT_INLINE cuda_upstream::cuda_upstream(const cuda_upstream& other) noexcept
    : device_(other.device_), vm_(other.vm_.load(std::memory_order_acquire)) {}

GPUKIT_INLINE cuda_upstream& cuda_upstream::operator=(const cuda_upstream& other) noexcept {
  device_ = other.device_;
  vm_.store(other.vm_.load(std::memory_order_acquire), std::memory_order_release);
  return *this;
}

namespace detail {
/// Gives back to the driver what the default memory pool of the current device `d` keeps unused
/// (cudaMemPoolTrimTo(pool, 0)): freed memory cudaMallocAsync's users keep up to their release threshold
/// (async_allocator, async_pool_upstream, other libraries) that cudaMalloc cannot have. True when the pool's
/// reserved memory shrank. Never throws; leaves no error behind.
GPUKIT_INLINE bool trim_default_pool(const gpukit::device& d) noexcept {
  cudaMemPool_t pool = nullptr;
  cuuint64_t reserved = 0;
  cuuint64_t used = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, d.ordinal()) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used) != cudaSuccess) {
    (void)cudaGetLastError();  // a device without memory pools: nothing kept there
    return false;
  }
  if (reserved <= used) return false;
  cuuint64_t after = reserved;
  if (cudaMemPoolTrimTo(pool, 0) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &after) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return after < reserved;
}
}  // namespace detail

GPUKIT_INLINE void* cuda_upstream::allocate(std::size_t bytes) {
  device_guard guard(device_);
  void* p = nullptr;
  const cudaError_t result = cudaMalloc(&p, bytes);
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  GPUKIT_CUDA_TRY_DESCRIBED(result, "cudaMalloc(" + std::to_string(bytes) + ")", device_.ordinal());
  return p;
}

GPUKIT_INLINE bool cuda_upstream::release_unused_elsewhere() noexcept {
  try {
    device_guard guard(device_);
    return detail::trim_default_pool(device_);
  } catch (...) {  // the device cannot be made current: nothing was given back
    return false;
  }
}

GPUKIT_INLINE void cuda_upstream::deallocate(void* p, std::size_t /*bytes*/) noexcept {
  try {
    device_guard guard(device_);
    detail::report_cuda_failure(cudaFree(p), "cudaFree (returning a cached segment)", device_.ordinal());
  } catch (const error& e) {
    if (detail::is_teardown_result(e.cuda_result())) return;  // process exit: the segment went with the runtime
    detail::warn_parts("gpukit::cuda_upstream: could not make the device current to free a segment: ", e.what());
  } catch (const std::exception& e) {
    detail::warn_parts("gpukit::cuda_upstream: could not make the device current to free a segment: ", e.what());
  }
}

GPUKIT_INLINE upstream_memory_info cuda_upstream::memory_info() const {
  upstream_memory_info info;
  try {
    device_guard guard(device_);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_bytes = free_bytes;
      info.total_bytes = total_bytes;
      info.known = true;
    } else {
      (void)cudaGetLastError();
    }
  } catch (const error&) {
  }
  return info;
}

GPUKIT_INLINE bool cuda_upstream::synchronizes_on_free() const noexcept { return true; }

GPUKIT_INLINE gpukit::device cuda_upstream::device() const noexcept { return device_; }

GPUKIT_INLINE bool cuda_upstream::virtual_memory_supported() const noexcept {
  std::uint64_t state = vm_.load(std::memory_order_acquire);
  if (state == vm_not_asked) {
    const detail::driver_api& api = detail::driver();
    int supported = 0;
    CUdevice device = 0;
    bool ok = api.has_virtual_memory() && api.device_get(&device, device_.ordinal()) == CUDA_SUCCESS &&
              api.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) ==
                  CUDA_SUCCESS &&
              supported != 0;
    std::size_t granularity = 0;
    const CUmemAllocationProp prop = allocation_properties();
    ok = ok && detail::driver().mem_get_allocation_granularity(&granularity, &prop,
                                                               CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS;
    state = ok && granularity != 0 ? static_cast<std::uint64_t>(granularity) << 1 | 1 : vm_unsupported;
    vm_.store(state, std::memory_order_release);
  }
  return (state & 1) != 0;
}

GPUKIT_INLINE std::size_t cuda_upstream::page_size() const noexcept {
  return virtual_memory_supported() ? page_bytes() : 0;
}

GPUKIT_INLINE void* cuda_upstream::reserve(std::size_t bytes) {
  if (!virtual_memory_supported()) return nullptr;
  device_guard guard(device_);
  CUdeviceptr address = 0;
  const CUresult r = detail::driver().mem_address_reserve(&address, bytes, page_bytes(), 0, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY || r == CUDA_ERROR_INVALID_VALUE) return nullptr;  // this range cannot be had
  if (r != CUDA_SUCCESS) {
    throw cuda_error("gpukit: cuMemAddressReserve of " + std::to_string(bytes) + " bytes failed on " +
                         device_.to_string() + " (CUresult " + std::to_string(r) +
                         ") while reserving the address range of an expandable segment",
                     detail::runtime_error_of(r), "cuMemAddressReserve", device_.ordinal());
  }
  return reinterpret_cast<void*>(address);
}

GPUKIT_INLINE bool cuda_upstream::map(void* address, std::size_t bytes) {
  device_guard guard(device_);
  const detail::driver_api& api = detail::driver();
  const CUmemAllocationProp prop = allocation_properties();
  // The peers are read, not held: the registry's lock is not kept across the driver calls (other devices map
  // meanwhile); record_mapped() grants whatever peers changed in between.
  auto& registry = mode_independent::peer_access_holders_v2();
  std::vector<int> peers;
  std::uint64_t generation = 0;
  const std::size_t granule = page_bytes();
  const auto start = reinterpret_cast<CUdeviceptr>(address);
  std::set<CUdeviceptr> still_mapped;  // pages an earlier unmap() could not unmap: mapped already, kept as they are
  {
    std::lock_guard<std::mutex> lock(registry.mutex);
    peers = registry.peers_of(device_.ordinal());
    generation = registry.generation;
    still_mapped = recorded_pages(registry, start, start + bytes);
  }
  std::vector<CUmemAccessDesc> access{detail::device_access_desc(device_.ordinal(), true)};
  for (int peer : peers) access.push_back(detail::device_access_desc(peer, true));
  CUdeviceptr page = start;
  const char* failed_call = nullptr;
  bool device_full = false;  // cuMemCreate or cuMemMap found no memory: out of memory, not an error
  CUresult r = CUDA_SUCCESS;
  for (; page < start + bytes; page += granule) {
    if (still_mapped.count(page) != 0) continue;
    CUmemGenericAllocationHandle handle{};
    r = api.mem_create(&handle, granule, &prop, 0);
    if (r != CUDA_SUCCESS) {
      failed_call = "cuMemCreate";
      device_full = r == CUDA_ERROR_OUT_OF_MEMORY;
      break;
    }
    r = api.mem_map(page, granule, 0, handle, 0);
    const CUresult released = api.mem_release(handle);  // the mapping keeps the memory until it is unmapped
    if (r != CUDA_SUCCESS) {
      failed_call = "cuMemMap";
      device_full = r == CUDA_ERROR_OUT_OF_MEMORY;  // e.g. no memory left for the page tables
      break;
    }
    if (released != CUDA_SUCCESS) {
      // A handle the driver will not release would keep its memory after the unmap, for good: the page goes now,
      // and the caller gets the error (its memory stays allocated on the device; nothing more can be done).
      (void)api.mem_unmap(page, granule);
      r = released;
      failed_call = "cuMemRelease";
      break;
    }
    r = api.mem_set_access(page, granule, access.data(), access.size());
    if (r != CUDA_SUCCESS) {
      (void)api.mem_unmap(page, granule);
      failed_call = "cuMemSetAccess";
      break;
    }
  }
  record_mapped(start, page, peers, generation);  // the pages mapped so far stay mapped, so they are recorded
  if (failed_call == nullptr) return true;
  if (device_full) return false;
  throw_driver_failure(failed_call, r);
}

GPUKIT_INLINE bool cuda_upstream::unmap(void* address, std::size_t bytes) noexcept {
  return wait_before_unmap() && unmap_after_wait(address, bytes);
}

GPUKIT_INLINE bool cuda_upstream::wait_before_unmap() noexcept {
  const detail::release_wait waited = detail::wait_before_release(device_, "unmapping pages");
  return waited == detail::release_wait::idle || waited == detail::release_wait::torn_down;
}

GPUKIT_INLINE bool cuda_upstream::wait_before_unmap(const std::vector<const event*>& after) noexcept {
  return detail::wait_for_events_before_release(device_, after, "unmapping pages") != detail::release_wait::failed;
}

GPUKIT_INLINE bool cuda_upstream::unmap_after_wait(void* address, std::size_t bytes) noexcept {
  try {
    device_guard guard(device_);
    CUresult refused = CUDA_SUCCESS;  // the first failure, warned about after the lock (handlers run outside it)
    std::size_t kept = 0;
    {
      auto& registry = mode_independent::peer_access_holders_v2();
      std::lock_guard<std::mutex> lock(registry.mutex);  // a grant never meets a page being unmapped
      auto& mapped = registry.mapped_pages[device_.ordinal()];
      const std::size_t granule = page_bytes();
      const auto start = reinterpret_cast<CUdeviceptr>(address);
      for (CUdeviceptr page = start; page < start + bytes; page += granule) {
        const CUresult r = detail::driver().mem_unmap(page, granule);
        if (r == CUDA_SUCCESS) {
          mapped.erase(static_cast<std::uintptr_t>(page));
        } else if (detail::is_teardown_result(r)) {
          return true;  // the driver is gone, and the pages with it
        } else {
          if (refused == CUDA_SUCCESS) refused = r;
          ++kept;
        }
      }
    }
    if (refused != CUDA_SUCCESS) {
      detail::warn_parts("gpukit::cuda_upstream: cuMemUnmap failed (CUresult ", static_cast<int>(refused), ") on ",
                         device_, ": ", kept, kept == 1 ? " page stays" : " pages stay",
                         " mapped, for the next map() of it or the range's release");
    }
    return true;
  } catch (const error& e) {  // the guard: nothing was unmapped, unless the runtime is gone (and the pages with it)
    if (detail::is_teardown_result(e.cuda_result())) return true;
    detail::warn_parts("gpukit::cuda_upstream: could not unmap pages: ", e.what());
    return false;
  } catch (const std::exception& e) {  // no memory for the registry or a message: nothing was unmapped
    detail::warn_parts("gpukit::cuda_upstream: could not unmap pages: ", e.what());
    return false;
  }
}

GPUKIT_INLINE void cuda_upstream::unreserve(void* address, std::size_t bytes) noexcept {
  try {
    device_guard guard(device_);
    const auto start = reinterpret_cast<CUdeviceptr>(address);
    const CUresult leftover = unmap_leftover_pages(start, start + bytes);
    if (detail::is_teardown_result(leftover)) return;
    if (leftover != CUDA_SUCCESS) {
      detail::warn_parts("gpukit::cuda_upstream: an address range of ", bytes, " bytes on ", device_,
                         " stays reserved: a page of it could not be unmapped");
      return;
    }
    const CUresult r = detail::driver().mem_address_free(start, bytes);
    if (r != CUDA_SUCCESS && !detail::is_teardown_result(r))
      detail::warn_parts("gpukit::cuda_upstream: cuMemAddressFree failed (CUresult ", static_cast<int>(r), ")");
  } catch (const error& e) {
    if (!detail::is_teardown_result(e.cuda_result()))
      detail::warn_parts("gpukit::cuda_upstream: could not free an address range: ", e.what());
  } catch (const std::exception& e) {
    detail::warn_parts("gpukit::cuda_upstream: could not free an address range: ", e.what());
  }
}

GPUKIT_INLINE std::set<CUdeviceptr> cuda_upstream::recorded_pages(
    const mode_independent::peer_access_registry& registry, CUdeviceptr start, CUdeviceptr end) const {
  std::set<CUdeviceptr> pages;
  const auto found = registry.mapped_pages.find(device_.ordinal());
  if (found == registry.mapped_pages.end()) return pages;
  for (auto it = found->second.lower_bound(static_cast<std::uintptr_t>(start));
       it != found->second.end() && it->first < static_cast<std::uintptr_t>(end); ++it) {
    pages.insert(static_cast<CUdeviceptr>(it->first));
  }
  return pages;
}

GPUKIT_INLINE CUresult cuda_upstream::unmap_leftover_pages(CUdeviceptr start, CUdeviceptr end) {
  CUresult failed = CUDA_SUCCESS;
  {
    auto& registry = mode_independent::peer_access_holders_v2();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (CUdeviceptr page : recorded_pages(registry, start, end)) {
      const CUresult r = detail::driver().mem_unmap(page, page_bytes());
      if (r == CUDA_SUCCESS) {
        registry.mapped_pages[device_.ordinal()].erase(static_cast<std::uintptr_t>(page));
      } else if (detail::is_teardown_result(r)) {
        return r;
      } else {
        failed = r;
      }
    }
  }
  if (failed != CUDA_SUCCESS) {  // after the lock: warning handlers run outside gpukit's locks
    detail::warn_parts("gpukit::cuda_upstream: cuMemUnmap failed again (CUresult ", static_cast<int>(failed), ")");
  }
  return failed;
}

GPUKIT_INLINE void cuda_upstream::record_mapped(CUdeviceptr start, CUdeviceptr end, const std::vector<int>& peers,
                                                std::uint64_t generation) {
  if (end == start) return;
  auto& registry = mode_independent::peer_access_holders_v2();
  std::unique_lock<std::mutex> lock(registry.mutex);
  const std::size_t granule = page_bytes();
  try {
    auto& mapped = registry.mapped_pages[device_.ordinal()];
    for (CUdeviceptr page = start; page < end; page += granule) mapped[static_cast<std::uintptr_t>(page)] = granule;
  } catch (...) {
    for (CUdeviceptr page = start; page < end; page += granule) {
      (void)detail::driver().mem_unmap(page, granule);
      auto found = registry.mapped_pages.find(device_.ordinal());
      if (found != registry.mapped_pages.end()) found->second.erase(static_cast<std::uintptr_t>(page));
    }
    throw;
  }
  if (registry.generation == generation) return;
  const std::vector<int> now = registry.peers_of(device_.ordinal());
  std::vector<CUmemAccessDesc> changes;
  for (int peer : now) {
    if (std::find(peers.begin(), peers.end(), peer) == peers.end())
      changes.push_back(detail::device_access_desc(peer, true));
  }
  for (int peer : peers) {
    if (std::find(now.begin(), now.end(), peer) == now.end())
      changes.push_back(detail::device_access_desc(peer, false));
  }
  if (changes.empty()) return;
  const CUresult r = detail::driver().mem_set_access(start, end - start, changes.data(), changes.size());
  lock.unlock();  // warning handlers run outside gpukit's locks
  if (r != CUDA_SUCCESS) {
    detail::warn_parts(
        "gpukit::cuda_upstream: cuMemSetAccess for peers that changed while pages were mapped failed (CUresult ",
        static_cast<int>(r), ")");
  }
}

GPUKIT_INLINE CUmemAllocationProp cuda_upstream::allocation_properties() const noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_.ordinal();
  return prop;
}

GPUKIT_INLINE void cuda_upstream::throw_driver_failure(const char* call, CUresult r) const {
  throw cuda_error("gpukit: " + std::string(call) + " failed on " + device_.to_string() + " (CUresult " +
                       std::to_string(r) + ") while mapping pages of an expandable segment",
                   detail::runtime_error_of(r), call, device_.ordinal());
}

GPUKIT_INLINE std::size_t cuda_upstream::page_bytes() const noexcept {
  return static_cast<std::size_t>(vm_.load(std::memory_order_relaxed) >> 1);
}

GPUKIT_INLINE device_upstream::device_upstream(gpukit::device d) : device_(d) {
  if (d.is_cuda()) cuda_.emplace(d);
}

GPUKIT_INLINE void* device_upstream::allocate(std::size_t bytes) {
  return cuda_ ? cuda_->allocate(bytes) : host_.allocate(bytes);
}

GPUKIT_INLINE bool device_upstream::release_unused_elsewhere() noexcept {
  return cuda_ ? cuda_->release_unused_elsewhere() : false;
}

GPUKIT_INLINE void device_upstream::deallocate(void* p, std::size_t bytes) noexcept {
  if (cuda_) {
    cuda_->deallocate(p, bytes);
  } else {
    host_.deallocate(p, bytes);
  }
}

GPUKIT_INLINE upstream_memory_info device_upstream::memory_info() const {
  return cuda_ ? cuda_->memory_info() : host_.memory_info();
}

GPUKIT_INLINE bool device_upstream::synchronizes_on_free() const noexcept { return cuda_.has_value(); }

GPUKIT_INLINE gpukit::device device_upstream::device() const noexcept { return device_; }

GPUKIT_INLINE bool device_upstream::virtual_memory_supported() const noexcept {
  return cuda_ && cuda_->virtual_memory_supported();
}

GPUKIT_INLINE std::size_t device_upstream::page_size() const noexcept { return cuda_ ? cuda_->page_size() : 0; }

GPUKIT_INLINE void* device_upstream::reserve(std::size_t bytes) {
  return virtual_memory_supported() ? cuda_->reserve(bytes) : nullptr;
}

GPUKIT_INLINE bool device_upstream::map(void* address, std::size_t bytes) {
  if (!cuda_) throw invalid_argument_error("gpukit::device_upstream::map: the CPU device has no virtual memory to map");
  return cuda_->map(address, bytes);
}

GPUKIT_INLINE bool device_upstream::unmap(void* address, std::size_t bytes) noexcept {
  if (!cuda_) {
    warn_no_virtual_memory("unmap");
    return false;
  }
  return cuda_->unmap(address, bytes);
}

GPUKIT_INLINE bool device_upstream::wait_before_unmap() noexcept {
  if (!cuda_) {
    warn_no_virtual_memory("wait_before_unmap");
    return false;
  }
  return cuda_->wait_before_unmap();
}

GPUKIT_INLINE bool device_upstream::wait_before_unmap(const std::vector<const event*>& after) noexcept {
  if (!cuda_) {
    warn_no_virtual_memory("wait_before_unmap");
    return false;
  }
  return cuda_->wait_before_unmap(after);
}

GPUKIT_INLINE bool device_upstream::unmap_after_wait(void* address, std::size_t bytes) noexcept {
  if (!cuda_) {
    warn_no_virtual_memory("unmap_after_wait");
    return false;
  }
  return cuda_->unmap_after_wait(address, bytes);
}

GPUKIT_INLINE void device_upstream::unreserve(void* address, std::size_t bytes) noexcept {
  if (!cuda_) return warn_no_virtual_memory("unreserve");
  cuda_->unreserve(address, bytes);
}

GPUKIT_INLINE void device_upstream::warn_no_virtual_memory(const char* call) noexcept {
  detail::warn_parts("gpukit::device_upstream::", call, ": the CPU device has no virtual memory (nothing done)");
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
