// An upstream of expandable segments over real host memory, for stress tests that a release never unmaps a page still
// in use: reserve is an inaccessible mapping (PROT_NONE), map makes pages readable and writable, unmap discards them
// and makes them inaccessible again, so stream work that touches a page after it was unmapped faults at once (and one
// mapped again reads zeros). Linux only.
#pragma once

#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

namespace gpukit_test {

/// The wait before unmapping is the test's streams' work so far (the whole device's, as cudaDeviceSynchronize) and,
/// with `EventWaits`, also the allocator's events alone (wait_before_unmap(after), as cuda_upstream's
/// cudaEventSynchronize). Both are counted.
template <bool EventWaits>
class basic_host_vm_upstream {
 public:
  static constexpr std::size_t capacity = std::size_t{1} << 30;

  [[nodiscard]] void* allocate(std::size_t bytes) {  // ordinary segments (not used with expandable segments)
    wait_for_streams();
    return std::malloc(bytes);
  }
  void deallocate(void* p, std::size_t /*bytes*/) noexcept { std::free(p); }
  gpukit::upstream_memory_info memory_info() const {
    gpukit::upstream_memory_info info;
    info.known = true;
    info.total_bytes = capacity;
    info.free_bytes = capacity - mapped_.load();
    return info;
  }
  bool synchronizes_on_free() const noexcept { return true; }
  std::size_t page_size() const noexcept { return std::size_t{64} << 10; }
  void* reserve(std::size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  bool map(void* address, std::size_t bytes) {
    if (mapped_.fetch_add(bytes) + bytes > capacity) {
      mapped_.fetch_sub(bytes);
      return false;
    }
    return mprotect(address, bytes, PROT_READ | PROT_WRITE) == 0;
  }
  bool unmap(void* address, std::size_t bytes) noexcept {
    return wait_before_unmap() && unmap_after_wait(address, bytes);
  }
  bool wait_before_unmap() noexcept {  // the whole device's: every stream's work so far
    wait_for_streams();
    device_waits_.fetch_add(1);
    return true;
  }
  template <bool E = EventWaits, std::enable_if_t<E, int> = 0>
  bool wait_before_unmap(const std::vector<const gpukit::event*>& after) noexcept {
    for (const gpukit::event* e : after) e->synchronize();
    event_waits_.fetch_add(1);
    return true;
  }
  bool unmap_after_wait(void* address, std::size_t bytes) noexcept {
    (void)madvise(address, bytes, MADV_DONTNEED);
    (void)mprotect(address, bytes, PROT_NONE);
    mapped_.fetch_sub(bytes);
    return true;
  }
  void unreserve(void* address, std::size_t bytes) noexcept { (void)munmap(address, bytes); }

  std::vector<std::unique_ptr<gpukit::stream>>* streams = nullptr;  // set while they exist
  std::size_t mapped() const { return mapped_.load(); }
  std::size_t device_waits() const { return device_waits_.load(); }
  std::size_t event_waits() const { return event_waits_.load(); }

 private:
  void wait_for_streams() noexcept {
    if (streams == nullptr) return;  // the streams are gone: so is their work
    for (const auto& s : *streams) s->synchronize();
  }
  std::atomic<std::size_t> mapped_{0};
  std::atomic<std::size_t> device_waits_{0};
  std::atomic<std::size_t> event_waits_{0};
};

/// The wait before unmapping is for every stream's work.
using host_vm_upstream = basic_host_vm_upstream<false>;
/// The wait before unmapping is for the allocator's events where it can (its device-wide wait otherwise).
using host_event_upstream = basic_host_vm_upstream<true>;

}  // namespace gpukit_test
