// Helpers shared by the transfer tests: a gate that holds a CPU stream back, an instrumented device copy step, and
// upstreams for the pinned pool that count, fail or hand out fake addresses.
#pragma once

#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/staging.hpp>

#include "support.hpp"  // gate, captured_warnings

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace gpukit_test {

/// One call of the device copy step.
struct copy_call {
  void* dst;
  const void* src;
  std::size_t bytes;
  gpukit::copy_direction direction;
};

/// The default device copy step, logging each call; optionally slow (each enqueued copy sleeps first, like a slow
/// DMA), optionally failing at a given call, and optionally not copying at all (a CUDA stream in tests without a
/// GPU, or a CPU-side ceiling benchmark).
struct recording_copier {
  struct state {
    std::mutex mutex;
    std::vector<copy_call> calls;
    std::chrono::microseconds delay{0};
    long fail_at = -1;  // throw at this call index
    bool perform = true;
  };
  std::shared_ptr<state> shared = std::make_shared<state>();

  void operator()(void* dst, const void* src, std::size_t bytes, gpukit::copy_direction direction,
                  gpukit::stream_view s) const {
    std::chrono::microseconds delay{};
    bool perform = true;
    {
      std::lock_guard<std::mutex> lock(shared->mutex);
      if (shared->fail_at >= 0 && static_cast<long>(shared->calls.size()) == shared->fail_at) {
        shared->fail_at = -1;
        throw std::runtime_error("recording_copier: injected failure");
      }
      shared->calls.push_back({dst, src, bytes, direction});
      delay = shared->delay;
      perform = shared->perform;
    }
    if (!perform) return;
    if (delay.count() > 0 && s.is_cpu()) {
      s.enqueue_host([delay] { std::this_thread::sleep_for(delay); });
    }
    gpukit::device_copier()(dst, src, bytes, direction, s);
  }

  std::vector<copy_call> calls() const {
    std::lock_guard<std::mutex> lock(shared->mutex);
    return shared->calls;
  }
  void clear() const {
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->calls.clear();
  }
};

/// Host memory with a capacity, failing like a full device, and a delay per allocation (like pinning).
struct limited_upstream {
  struct state {
    std::atomic<std::size_t> outstanding{0};
    std::size_t capacity = SIZE_MAX;
    std::chrono::microseconds delay{0};
    std::atomic<int> allocations{0};
    std::atomic<int> frees{0};
  };
  std::shared_ptr<state> shared = std::make_shared<state>();

  void* allocate(std::size_t bytes) {
    if (shared->delay.count() > 0) std::this_thread::sleep_for(shared->delay);
    if (shared->outstanding.load() + bytes > shared->capacity) {
      throw gpukit::out_of_memory_error("limited_upstream: capacity exceeded");
    }
    void* p = ::operator new(bytes, std::align_val_t(256));
    shared->outstanding += bytes;
    ++shared->allocations;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept {
    ::operator delete(p, std::align_val_t(256));
    shared->outstanding -= bytes;
    ++shared->frees;
  }
  bool page_locked() const noexcept { return false; }
};

/// Hands out distinct fake addresses without memory (for tests that must not touch or free the blocks).
struct fake_address_upstream {
  std::uintptr_t next = 0x10000000;
  void* allocate(std::size_t bytes) {
    void* p = reinterpret_cast<void*>(next);
    next += (bytes + 4095) / 4096 * 4096;
    return p;
  }
  void deallocate(void*, std::size_t) noexcept {}
  bool page_locked() const noexcept { return false; }
};

/// A deterministic byte pattern for position i of transfer `seed`.
inline unsigned char pattern(std::size_t i, unsigned seed) {
  return static_cast<unsigned char>((i * 131u + seed * 17u + (i >> 11)) & 0xFFu);
}
inline std::vector<unsigned char> patterned(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = pattern(i, seed);
  return v;
}

}  // namespace gpukit_test
