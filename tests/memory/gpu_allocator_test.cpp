// GPU tests of the caching allocator over cudaMalloc (label gpu): skipped with GPUKIT_TEST_SKIPPED without a GPU.
#include "allocator_support.hpp"
#include "support.hpp"

#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace gpukit_test;

TEST_CASE("gpu: cuda_upstream allocates device memory and reports the device's memory") {
  GPUKIT_REQUIRE_GPU();
  gpukit::cuda_upstream up(gpukit::device::cuda(0));
  void* p = up.allocate(MiB);
  REQUIRE(p != nullptr);
  cudaPointerAttributes attributes{};
  REQUIRE(cudaPointerGetAttributes(&attributes, p) == cudaSuccess);
  CHECK(attributes.type == cudaMemoryTypeDevice);
  CHECK(attributes.device == 0);
  const auto info = up.memory_info();
  CHECK(info.known);
  CHECK(info.total_bytes > GiB);
  CHECK(info.free_bytes <= info.total_bytes);
  up.deallocate(p, MiB);
  CHECK(up.allocate(std::size_t{1} << 50) == nullptr);  // out of memory is nullptr, not an exception
}

TEST_CASE("gpu: device buffers from the default allocator of cuda:0, copied to and from the host") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  const std::size_t before = gpukit::memory_allocated(d);
  std::vector<int> host(1 << 20);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int>(i);
  {
    gpukit::device_buffer<int> b(host.size(), s);
    CHECK(b.device() == d);
    CHECK(gpukit::memory_allocated(d) == before + b.size_bytes());
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(b.data(), host.data(), b.size_bytes(), cudaMemcpyHostToDevice, s.cuda_handle()));
    std::vector<int> back(host.size());
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
    s.synchronize();
    CHECK(back == host);
  }
  CHECK(gpukit::memory_allocated(d) == before);
  std::puts(gpukit::memory_summary(d).c_str());
}

TEST_CASE("gpu: a cache hit makes no cudaMalloc and empty_cache returns memory to the device") {
  GPUKIT_REQUIRE_GPU();
  gpukit::caching_allocator a(gpukit::device::cuda(0));
  gpukit::stream s(gpukit::device::cuda(0));
  void* p = a.allocate(5 * MiB, s);
  a.deallocate(p);
  for (int i = 0; i < 100; ++i) a.deallocate(a.allocate(5 * MiB, s));
  CHECK(a.stats().num_device_alloc == 1);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(a.stats().num_device_free == 1);
}

TEST_CASE("gpu: record_stream holds a block until the other CUDA stream's work is done") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator a(d);
  gpukit::stream owner(d);
  gpukit::stream user(d);
  gate g;
  void* x = a.allocate(64 * KiB, owner);
  user.enqueue_host([&g] { g.wait(); });  // holds `user` back
  a.record_stream(x, user);
  a.deallocate(x);
  void* y = a.allocate(64 * KiB, owner);
  CHECK(y != x);
  g.open();
  user.synchronize();
  void* z = a.allocate(64 * KiB, owner);
  CHECK(z == x);
  a.deallocate(y);
  a.deallocate(z);
}

TEST_CASE("gpu: cross-stream reuse makes the new CUDA stream wait on the device") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::allocator_options o;
  o.cross_stream_reuse = true;
  gpukit::caching_allocator a(d, o);
  gpukit::stream first(d);
  gpukit::stream second(d);
  gate g;
  void* x = a.allocate(4096, first);
  first.enqueue_host([&g] { g.wait(); });
  a.deallocate(x);
  void* y = a.allocate(4096, second);
  CHECK(y == x);
  CHECK_FALSE(second.ready());  // `second` waits for `first`'s held-back work (cudaStreamWaitEvent)
  g.open();
  second.synchronize();
  a.deallocate(y);
}

TEST_CASE("gpu: large blocks cached per CUDA stream serve that stream only, and go back when it is destroyed") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::allocator_options o;
  o.front_cache_large = true;  // from the start (by default: once threads contend for the device lock)
  gpukit::caching_allocator a(d, o);
  CHECK(a.stats().front_cache_large_on);
  gpukit::stream s(d);
  void* p = a.allocate(8 * MiB, s);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(p, 7, 8 * MiB, s.cuda_handle()));
  a.deallocate(p);  // cached for s: its next use on s is ordered after the memset
  CHECK(a.memory_allocated() == 0);
  void* again = a.allocate(8 * MiB - 100, s);  // the same rounded size (512 B steps) on the same stream
  CHECK(again == p);
  std::vector<unsigned char> back(4096);
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), again, back.size(), cudaMemcpyDeviceToHost, s.cuda_handle()));
  s.synchronize();
  CHECK(back == std::vector<unsigned char>(4096, 7));
  a.deallocate(again);
  {
    gpukit::stream other(d);
    void* q = a.allocate(8 * MiB, other);
    CHECK(q != p);  // p is cached for s
    GPUKIT_CUDA_TRY(cudaMemsetAsync(q, 0, 8 * MiB, other.cuda_handle()));
    a.deallocate(q);  // cached for `other`, which is destroyed next with its work maybe still running
  }
  CHECK(a.stats().num_device_alloc == 2);
  a.empty_cache();  // takes every cached block back (the destroyed stream's after its work) and frees the segments
  CHECK(a.memory_reserved() == 0);
  CHECK(a.stats().num_device_free == 2);
}

TEST_CASE("gpu: threads allocating 8 MiB blocks on their own CUDA streams keep exact statistics") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator a(d);  // defaults: large blocks move into the front caches if the threads contend
  constexpr int threads = 4;
  constexpr int pairs = 500;
  std::vector<std::unique_ptr<gpukit::stream>> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(std::make_unique<gpukit::stream>(d));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&a, &streams, t] {
      const gpukit::stream& s = *streams[static_cast<std::size_t>(t)];
      for (int i = 0; i < pairs; ++i) a.deallocate(a.allocate((2 + static_cast<std::size_t>(i % 4) * 2) * MiB, s));
    });
  }
  for (auto& w : workers) w.join();
  const gpukit::allocator_stats st = a.stats();
  CHECK(st.allocation.large().allocated == threads * pairs);
  CHECK(st.allocation.large().freed == threads * pairs);
  CHECK(st.allocated_bytes.all().current == 0);
  CHECK(st.requested_bytes.all().current == 0);
  CHECK(st.allocation.all().peak <= threads);
  MESSAGE("device lock waits: " << st.num_lock_waits << ", large blocks cached per stream: "
                                << std::string(st.front_cache_large_on ? "yes" : "no"));
  for (auto& s : streams) s->synchronize();
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("gpu: an impossible request throws out_of_memory_error with the numbers and counts it") {
  GPUKIT_REQUIRE_GPU();
  gpukit::caching_allocator a(gpukit::device::cuda(0));
  gpukit::stream s(gpukit::device::cuda(0));
  try {
    (void)a.allocate(std::size_t{1} << 50, s);
    FAIL("expected out_of_memory_error");
  } catch (const gpukit::out_of_memory_error& e) {
    const std::string m = e.what();
    CHECK(m.find("tried to allocate 1.00 PiB") != std::string::npos);
    CHECK(m.find("total") != std::string::npos);
    CHECK(e.cuda_result() == cudaErrorMemoryAllocation);
  }
  CHECK(a.stats().num_ooms == 1);
  void* p = a.allocate(MiB, s);  // still usable
  a.deallocate(p);
}

TEST_CASE("gpu: expandable segments back buffers with mapped pages and give them back on empty_cache") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::allocator_options o;
  o.expandable_segments = true;
  gpukit::caching_allocator a(d, o);
  gpukit::stream s(d);
  std::vector<int> host(5 << 20);  // 20 MiB
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int>(i * 7);
  {
    gpukit::device_buffer<int> b(host.size(), s, a);
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(b.data(), host.data(), b.size_bytes(), cudaMemcpyHostToDevice, s.cuda_handle()));
    std::vector<int> back(host.size());
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
    s.synchronize();
    CHECK(back == host);
    const auto snapshot = a.snapshot();
    REQUIRE_FALSE(snapshot.segments.empty());
    // Virtual memory on this device (every GPU since Pascal on Linux): one range, pages of the driver's granularity.
    CHECK(snapshot.segments.front().expandable);
    CHECK(a.memory_reserved() >= b.size_bytes());
    CHECK(a.memory_reserved() < b.size_bytes() + 4 * MiB);
  }
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(a.snapshot().segments.empty());
}
