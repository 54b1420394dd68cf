// A device_resource written as a user would: host memory for the CPU device, with nothing but the five functions
// the interface asks for (no statistics, no control). Tests plug it into buffers and the standard adaptors.
#pragma once

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/device_resource.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace gpukit_test {

class arena_resource final : public gpukit::device_resource {
 public:
  ~arena_resource() override {
    for (void* p : live_) std::free(p);
  }
  [[nodiscard]] gpukit::device device() const noexcept override { return gpukit::device::cpu(); }
  /// Allocations not yet freed.
  [[nodiscard]] std::size_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.size();
  }
  /// Frees on another stream recorded so far.
  [[nodiscard]] std::size_t stream_frees() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stream_frees_;
  }

 private:
  void* do_allocate(std::size_t bytes, gpukit::stream_view stream) override {
    if (!stream.is_cpu()) throw gpukit::invalid_argument_error("arena_resource: not a CPU stream");
    if (bytes == 0) return nullptr;
    void* p =
        std::aligned_alloc(default_alignment, (bytes + default_alignment - 1) / default_alignment * default_alignment);
    if (p == nullptr) throw gpukit::out_of_memory_error("arena_resource: " + std::to_string(bytes) + " bytes");
    std::lock_guard<std::mutex> lock(mutex_);
    live_.insert(p);
    return p;
  }
  void do_deallocate(void* p) override {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_.erase(p) == 0) throw gpukit::invalid_argument_error("arena_resource: a pointer it does not own");
    std::free(p);
  }
  void do_deallocate(void* p, gpukit::stream_view stream) override {
    (void)stream;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (p != nullptr && live_.count(p) != 0) ++stream_frees_;
    }
    do_deallocate(p);
  }
  void do_record_stream(void* p, gpukit::stream_view stream) override {
    (void)stream;
    if (!do_owns(p)) throw gpukit::invalid_argument_error("arena_resource: record_stream of a pointer it does not own");
  }
  bool do_owns(const void* p) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.count(const_cast<void*>(p)) != 0;
  }

  mutable std::mutex mutex_;
  std::set<void*> live_;
  std::size_t stream_frees_ = 0;
};

}  // namespace gpukit_test
