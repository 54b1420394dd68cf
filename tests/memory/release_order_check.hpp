// A check, on a GPU or the simulator, that a caching allocator gives a segment back in stream order: copies queued on
// a stream before the release (held back by a gate) still read the data, empty_cache returns while they are queued,
// and nothing waits for the device. Used by the tests of async_pool_upstream and resource_upstream.
#pragma once

#include <gpukit/error.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/stream/stream.hpp>

#include <doctest/doctest.h>

#include "support.hpp"  // gate

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

namespace gpukit_test {

/// Eight copies of a 16 MiB buffer (a segment of its own) to pinned host memory (pageable memory would make each copy
/// finish before cudaMemcpyAsync returns) are queued on a stream held by a gate, and the buffer is freed. empty_cache
/// must return with the copies still queued; then new memory on another stream is overwritten at once: had the
/// segment been handed out again before the copies ran, they would read zeros.
template <class Allocator>
void check_release_in_stream_order(Allocator& a, gpukit::device d) {
  gpukit::stream s(d);
  gpukit::stream other(d);
  std::vector<int> host(std::size_t{1} << 22);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int>(i * 5 + 1);
  std::vector<gpukit::pinned_buffer<int>> back;
  for (int i = 0; i < 8; ++i) back.emplace_back(host.size(), d);
  gate g;
  struct open_and_drain {  // a failed check or an exception must not leave the copies held, or the gate gone under them
    gate& g;
    gpukit::stream& s;
    ~open_and_drain() {
      g.open();
      try {
        s.synchronize();
      } catch (...) {
        // The check has failed already; the stream's error is not this one's to report.
      }
    }
  } at_exit{g, s};
  {
    gpukit::device_buffer<int> b(host.size(), s, a);
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(b.data(), host.data(), b.size_bytes(), cudaMemcpyHostToDevice, s.cuda_handle()));
    g.hold(s);
    for (auto& copy : back) {
      GPUKIT_CUDA_TRY(cudaMemcpyAsync(copy.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
    }
  }  // freed on s, the copies still queued
  // In stream order: returns without waiting for s (a wait for the device would wait for the gate).
  cudaError_t queued = cudaSuccess;
  CHECK_FALSE(g.opened_to_return([&] {
    a.empty_cache();
    queued = cudaStreamQuery(s.cuda_handle());
  }));
  CHECK(queued == cudaErrorNotReady);
  CHECK(a.memory_reserved() == 0);
  g.open();  // before growing again: a pool may serve the segment whose release waits for s
  gpukit::device_buffer<int> c(host.size(), other, a);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(c.data(), 0, c.size_bytes(), other.cuda_handle()));
  other.synchronize();
  s.synchronize();
  for (const auto& copy : back) CHECK(std::equal(host.begin(), host.end(), copy.data()));
}

}  // namespace gpukit_test
