// GPU tests of async_allocator, cudaMallocAsync behind device_allocator (label gpu; on the simulator as *_sim):
// normal use with data through the memory, statistics, record_stream ordering, out of memory with observers, bad
// input; and the caching allocator over async_pool_upstream (segments from the same pool; the pool's release
// threshold and what is left in the pool once the upstream is gone); graph allocations (made in a capture: left out
// of the statistics, and not freed outside the capture while it runs). Skipped with GPUKIT_TEST_SKIPPED without a GPU.
#include "allocator_support.hpp"
#include "release_order_check.hpp"
#include "support.hpp"

#ifdef GPUKIT_TEST_ON_CUDASIM
#include "cudasim/cudasim.hpp"
#endif

#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/async_allocator.hpp>
#include <gpukit/memory/async_pool_upstream.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/stream/event.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace gpukit_test;

namespace {
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// What `f` threw: "invalid_argument_error: " and its message, "other: " and another exception's, or "none".
template <class F>
std::string thrown_by(F&& f) {
  try {
    f();
  } catch (const gpukit::invalid_argument_error& e) {
    return std::string("invalid_argument_error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "none";
}
}  // namespace

TEST_CASE("gpu: async_allocator allocates on a stream, data round-trips, statistics count it") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  std::vector<int> host(1 << 18);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int>(i * 3);
  void* p = a.allocate(host.size() * sizeof(int), s);
  REQUIRE(p != nullptr);
  CHECK(a.owns(p));
  CHECK(a.memory_allocated() == host.size() * sizeof(int));
  CHECK(a.memory_reserved() >= a.memory_allocated());
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(p, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice, s.cuda_handle()));
  std::vector<int> back(host.size());
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), p, host.size() * sizeof(int), cudaMemcpyDeviceToHost, s.cuda_handle()));
  s.synchronize();
  CHECK(back == host);
  const auto stats = a.stats();
  CHECK(stats.allocation.all().current == 1);
  CHECK(stats.allocated_bytes.all().peak == static_cast<std::int64_t>(host.size() * sizeof(int)));
  CHECK(stats.num_device_alloc == 1);
  a.deallocate(p);
  CHECK_FALSE(a.owns(p));
  CHECK(a.memory_allocated() == 0);
  CHECK(a.max_memory_allocated() == host.size() * sizeof(int));
  CHECK(a.allocate(0, s) == nullptr);
  a.deallocate(nullptr);
  CHECK(a.snapshot().segments.empty());
  CHECK(contains(a.memory_summary(), "gpukit async allocator (cudaMallocAsync), cuda:0"));
  a.empty_cache();
  s.synchronize();
}

TEST_CASE("gpu: async_allocator's free space leaves out memory other users of the shared pool hold") {
  // The default pool is shared: another library's live memory in it is not free, though not this allocator's.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  constexpr std::size_t theirs_bytes = std::size_t{64} << 20;
  void* theirs = nullptr;  // another user of the pool
  GPUKIT_CUDA_TRY(cudaMallocFromPoolAsync(&theirs, theirs_bytes, a.pool(), s.cuda_handle()));
  void* mine = a.allocate(4096, s);
  const gpukit::free_space_info f = a.free_space();
  const std::size_t reserved = a.memory_reserved();
  CHECK(reserved >= theirs_bytes + 4096);
  CHECK(f.free_bytes + theirs_bytes + 4096 <= reserved);
  CHECK(f.largest_free_block == f.free_bytes);
  a.deallocate(mine);
  GPUKIT_CUDA_TRY(cudaFreeAsync(theirs, s.cuda_handle()));
  s.synchronize();
}

TEST_CASE("gpu: async_allocator's release threshold decides what the pool keeps at a synchronization") {
  // CUDA's default threshold (0) gives freed memory back at every synchronization, so the next allocation goes to
  // the driver again; gpukit's default keeps it, and trim gives it back. The pool is the process's: only relations.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  constexpr std::size_t bytes = std::size_t{64} << 20;  // above the driver's granularity (2 MiB pages, 32 MiB chunks)
  const auto reserved_after_free_and_synchronize = [&](gpukit::async_allocator& a) {
    void* p = a.allocate(bytes, s);
    const std::size_t with = a.memory_reserved();
    CHECK(with >= bytes);
    a.deallocate(p);
    s.synchronize();
    return std::make_pair(with, a.memory_reserved());
  };
  {
    gpukit::async_allocator keeps(d);  // threshold: everything
    const auto [with, after] = reserved_after_free_and_synchronize(keeps);
    CHECK(after == with);
    CHECK(keeps.trim(0) < with);
  }
  {
    gpukit::async_allocator gives_back(d, 0);  // CUDA's default
    const auto [with, after] = reserved_after_free_and_synchronize(gives_back);
    CHECK(after < with);
    CHECK(after + bytes <= with);
  }
  gpukit::async_allocator restore(d);  // gpukit's default for the tests after this one
}

TEST_CASE("gpu: cudaMemPoolTrimTo keeps a free still pending and gives back one the host has seen complete") {
  // The simulator's rule for trims and the release threshold (tests/cudasim/README.md): only frees the host has
  // observed complete (a synchronization or a successful query) go back. A free CUDA may still count as
  // outstanding, complete on the GPU but not observed, is printed: the simulator keeps it (checked there only).
  GPUKIT_REQUIRE_GPU();
  GPUKIT_CUDA_TRY(cudaSetDevice(0));
  cudaMemPool_t pool = nullptr;
  GPUKIT_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, 0));
  cuuint64_t threshold_before = 0;
  GPUKIT_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold_before));
  cuuint64_t keep_all = std::numeric_limits<cuuint64_t>::max();
  GPUKIT_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  const auto reserved = [&] {
    cuuint64_t value = 0;
    GPUKIT_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &value));
    return static_cast<std::size_t>(value);
  };
  constexpr std::size_t bytes = std::size_t{64} << 20;
  cudaStream_t s = nullptr;
  GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  GPUKIT_CUDA_TRY(cudaDeviceSynchronize());
  GPUKIT_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
  const std::size_t base = reserved();
  void* p = nullptr;
  GPUKIT_CUDA_TRY(cudaMallocAsync(&p, bytes, s));
  GPUKIT_CUDA_TRY(cudaStreamSynchronize(s));
  REQUIRE(reserved() >= base + bytes);
  std::atomic<bool> free_done{false};
  {
    gate g;
    g.hold(gpukit::stream_view(s));
    GPUKIT_CUDA_TRY(cudaFreeAsync(p, s));
    gpukit::stream_view(s).enqueue_host([&free_done] { free_done = true; });
    cudaError_t trimmed = cudaSuccess;
    const bool waited = g.opened_to_return([&] { trimmed = cudaMemPoolTrimTo(pool, 0); }, std::chrono::seconds(10));
    CHECK(trimmed == cudaSuccess);
    CHECK_FALSE(waited);                // a trim does not wait for pending frees
    CHECK(reserved() >= base + bytes);  // the pending free is kept
  }
  // The gate is open: the free runs, then the host function. Complete on the GPU, not yet observed by the host.
  while (!free_done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  GPUKIT_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
  const bool unobserved_given_back = reserved() <= base;
  std::printf("cudaMemPoolTrimTo(0) of a free complete on the GPU that the host has not observed (%s): %s\n",
              on_simulator() ? "simulated runtime" : "real runtime",
              unobserved_given_back ? "given back" : "kept, as the simulator's model says");
  if (on_simulator()) CHECK_FALSE(unobserved_given_back);
  GPUKIT_CUDA_TRY(cudaStreamSynchronize(s));  // observed
  GPUKIT_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
  CHECK(reserved() <= base);
  GPUKIT_CUDA_TRY(cudaStreamDestroy(s));
  GPUKIT_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold_before));
}

TEST_CASE("gpu: async_allocator serves device_buffer and orders a free after recorded streams") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d), other(d);
  {
    gpukit::device_buffer<float> b(1000, s, a);
    CHECK(b.device() == d);
    CHECK(a.memory_allocated() == 1000 * sizeof(float));
    a.record_stream(b.data(), other);  // freed on s after other's work so far
  }
  CHECK(a.memory_allocated() == 0);
  void* p = a.allocate(4096, s);
  a.deallocate(p, other);  // freed in other's order, after s's work
  s.synchronize();
  other.synchronize();
  CHECK(a.stats().num_device_free == 2);
}

TEST_CASE("gpu: async_allocator out of memory and its limit: observers, the numbers, and a usable allocator") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  std::vector<gpukit::out_of_memory_info> seen;
  const auto id = a.add_out_of_memory_observer([&](const gpukit::out_of_memory_info& oom) { seen.push_back(oom); });
  try {
    (void)a.allocate(std::size_t{1} << 50, s);
    FAIL("a 1 PiB cudaMallocAsync succeeded");
  } catch (const gpukit::out_of_memory_error& e) {
    CHECK(contains(e.what(), "cudaMallocAsync of"));
    CHECK(e.cuda_result() == cudaErrorMemoryAllocation);
  }
  REQUIRE(seen.size() == 1);
  CHECK(seen.front().requested == std::size_t{1} << 50);
  CHECK_FALSE(seen.front().limit_hit);
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.stats().num_alloc_retries == 2);
  a.set_reserved_limit(MiB);
  void* p = a.allocate(MiB / 2, s);
  try {
    (void)a.allocate(MiB, s);
    FAIL("the limit was not applied");
  } catch (const gpukit::out_of_memory_error& e) {
    INFO(e.what());
    CHECK(contains(e.what(), "refused: this allocator's limit of 1.00 MiB would be exceeded"));
    CHECK_FALSE(contains(e.what(), "cudaMallocAsync of"));  // none was made
    CHECK(e.cuda_result() == cudaSuccess);
  }
  REQUIRE(seen.size() == 2);
  CHECK(seen.back().limit_hit);
  CHECK(seen.back().reserved_limit == MiB);
  CHECK(a.remove_out_of_memory_observer(id));
  a.deallocate(p);
  void* q = a.allocate(MiB, s);  // usable afterwards
  a.deallocate(q);
  s.synchronize();
}

TEST_CASE("gpu: async_allocator refuses the CPU, other devices' streams, and pointers it does not own") {
  GPUKIT_REQUIRE_GPU();
  CHECK_THROWS_AS(gpukit::async_allocator{gpukit::device::cpu()}, gpukit::invalid_argument_error);
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  CHECK_THROWS_AS((void)a.allocate(16, gpukit::stream_view::default_stream(gpukit::device::cpu())),
                  gpukit::invalid_argument_error);
  int local = 0;
  CHECK_THROWS_AS(a.deallocate(&local), gpukit::invalid_argument_error);
  void* p = a.allocate(256, s);
  a.deallocate(p);
  try {
    a.deallocate(p);
    FAIL("a double free was accepted");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(contains(e.what(), "not a live allocation of this allocator"));
  }
  CHECK_THROWS_AS(a.record_stream(p, s), gpukit::invalid_argument_error);
  // A CPU stream for record_stream or a stream-ordered free: refused, the allocation still live and freeable.
  void* q = a.allocate(256, s);
  gpukit::stream cpu_queue(gpukit::device::cpu());
  for (const gpukit::stream_view cpu_stream :
       {gpukit::stream_view(cpu_queue), gpukit::stream_view::default_stream(gpukit::device::cpu())}) {
    CHECK_THROWS_WITH_AS(a.record_stream(q, cpu_stream), doctest::Contains("wrong device"),
                         gpukit::invalid_argument_error);
    CHECK_THROWS_WITH_AS(a.deallocate(q, cpu_stream), doctest::Contains("wrong device"),
                         gpukit::invalid_argument_error);
    CHECK(a.owns(q));
  }
  a.deallocate(q);
  CHECK_THROWS_AS(a.add_out_of_memory_observer(nullptr), gpukit::invalid_argument_error);
  if (gpukit::device_count() > 1) {
    gpukit::stream elsewhere(gpukit::device::cuda(1));
    CHECK_THROWS_AS((void)a.allocate(16, elsewhere), gpukit::invalid_argument_error);
  }
  s.synchronize();
}

TEST_CASE("gpu: async_allocator's record_stream and deallocate with a peer's stream say both devices and the way") {
  GPUKIT_REQUIRE_GPU();
  if (gpukit::device_count() < 2) return;  // needs a peer
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  gpukit::stream peer(gpukit::device::cuda(1));
  void* p = a.allocate(256, s);
  for (const char* operation : {"record_stream", "deallocate"}) {
    try {
      if (std::string(operation) == "record_stream") {
        a.record_stream(p, peer);
      } else {
        a.deallocate(p, peer);
      }
      FAIL("a peer's stream was accepted");
    } catch (const gpukit::invalid_argument_error& e) {
      CHECK(contains(e.what(),
                     std::string("async_allocator::") + operation + ": a stream of cuda:1 for memory of cuda:0"));
      CHECK(contains(e.what(), "event::wait"));
    }
  }
  // Nothing was done: the memory is live and freed in the documented way.
  CHECK(a.owns(p));
  gpukit::event used(peer.device());
  used.record(peer);
  used.wait(s);
  a.deallocate(p, s);
  CHECK(a.memory_allocated() == 0);
  s.synchronize();
}

TEST_CASE("gpu: the caching allocator over async_pool_upstream: data round-trips and segments go back to the pool") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(d);
  gpukit::stream s(d), other(d);
  std::vector<int> host(1 << 20);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<int>(i * 7);
  std::vector<int> back(host.size());
  {
    gpukit::device_buffer<int> b(host.size(), s, a);
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(b.data(), host.data(), b.size_bytes(), cudaMemcpyHostToDevice, s.cuda_handle()));
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
    s.synchronize();
    CHECK(back == host);
    cudaPointerAttributes attributes{};
    REQUIRE(cudaPointerGetAttributes(&attributes, b.data()) == cudaSuccess);
    CHECK(attributes.type == cudaMemoryTypeDevice);
    CHECK(a.engine().upstream().pool() != nullptr);
  }
  // A segment from the pool is usable on another stream at once (the allocation was waited for on the host).
  gpukit::device_buffer<int> c(host.size(), other, a);
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(c.data(), host.data(), c.size_bytes(), cudaMemcpyHostToDevice, other.cuda_handle()));
  GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), c.data(), c.size_bytes(), cudaMemcpyDeviceToHost, other.cuda_handle()));
  other.synchronize();
  CHECK(back == host);
  c = gpukit::device_buffer<int>();
  CHECK(a.memory_reserved() > 0);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(a.stats().num_device_free == a.stats().num_device_alloc);
  const auto info = a.engine().upstream().memory_info();
  CHECK(info.known);
  CHECK_THROWS_AS(gpukit::async_pool_upstream{gpukit::device::cpu()}, gpukit::invalid_argument_error);
}

TEST_CASE(
    "gpu: async_pool_upstream gives segments back in stream order: work queued before the release reads intact "
    "data, and empty_cache does not wait for it") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_device_allocator<gpukit::async_pool_upstream> a(d);
  check_release_in_stream_order(a, d);
}

TEST_CASE("gpu: async_pool_upstream raises only CUDA's default release threshold, and when destroyed trims the pool") {
  // A pool at CUDA's default (0) would hand every segment given back to the driver at the next synchronization, so
  // the upstream raises it; a threshold someone set is theirs. Destroyed, the upstream must not leave the memory it
  // gave back reserved in the pool (cudaMalloc could not use it).
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  cudaMemPool_t pool = nullptr;
  GPUKIT_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, d.ordinal()));
  const auto threshold = [&] {
    cuuint64_t value = 0;
    GPUKIT_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &value));
    return value;
  };
  const auto set_threshold = [&](cuuint64_t value) {
    GPUKIT_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &value));
  };
  const auto reserved = [&] {
    cuuint64_t value = 0;
    GPUKIT_CUDA_TRY(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &value));
    return value;
  };
  const cuuint64_t found = threshold();  // put back at the end: the pool is the process's
  constexpr std::size_t bytes = std::size_t{64} << 20;
  constexpr cuuint64_t keep_all = std::numeric_limits<std::size_t>::max();
  using allocator = gpukit::caching_device_allocator<gpukit::async_pool_upstream>;
  const auto use = [&](allocator& a) {
    void* p = a.allocate(bytes, s);
    a.deallocate(p);
    s.synchronize();
  };
  SUBCASE("CUDA's default is raised; when the upstream is destroyed the memory is trimmed") {
    set_threshold(0);
    GPUKIT_CUDA_TRY(cudaMemPoolTrimTo(pool, 0));
    cuuint64_t kept = 0;
    {
      allocator a(d);
      use(a);
      CHECK(threshold() == keep_all);
      a.empty_cache();
      GPUKIT_CUDA_TRY(cudaDeviceSynchronize());  // the frees in stream order, and a synchronization point
      kept = reserved();
      CHECK(kept >= bytes);  // given back to the pool, which keeps it
    }
    CHECK(reserved() + bytes <= kept);  // trimmed: back to the driver
  }
  SUBCASE("a threshold set by the user (async_allocator(d, 1 GiB)) is left alone, during and after") {
    gpukit::async_allocator keep_1_gib(d, GiB);
    REQUIRE(threshold() == GiB);
    {
      allocator a(d);
      use(a);
      CHECK(threshold() == GiB);
    }
    CHECK(threshold() == GiB);
  }
  SUBCASE("a threshold raised by one upstream is not raised again, nor put back, by the next") {
    set_threshold(0);
    {
      allocator first(d);
      use(first);
    }
    CHECK(threshold() == keep_all);  // stays: async_allocator and other users may count on it
    set_threshold(std::size_t{256} << 20);
    {
      allocator second(d);
      use(second);
      CHECK(threshold() == (std::size_t{256} << 20));
    }
    CHECK(threshold() == (std::size_t{256} << 20));
  }
  set_threshold(found);
}

TEST_CASE("gpu: an async_pool_upstream's destructor does not wait for another upstream's release held on the host") {
  // Frees in stream order run on gpukit's shared release stream, behind waits for the streams that used the memory.
  // A destructor that waited for that stream waited for another upstream's release, whose stream a host function may
  // hold until this thread goes on: a deadlock. It waits for its own stream only.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::async_pool_upstream b(d);
  auto a = std::make_unique<gpukit::async_pool_upstream>(d);
  void* pa = a->allocate(std::size_t{1} << 20);
  a->deallocate(pa, std::size_t{1} << 20);
  void* pb = b.allocate(std::size_t{1} << 20);
  gpukit_test::gate held;
  held.hold(s);  // `s` stays busy until this thread opens the gate
  gpukit::event used(d);
  used.record(s);
  REQUIRE(b.deallocate_after(pb, std::size_t{1} << 20, {&used}));  // queued on the release stream behind `used`
  bool destroyed = false;
  {
    gpukit_test::bounded_calls calls;
    destroyed = calls.returned_within([&] { a.reset(); });
    held.open();
  }
  CHECK(destroyed);
  s.synchronize();
}

TEST_CASE("gpu: async_allocator's statistics and limit leave out graph allocations, which are their graphs' memory") {
  // A request in a capture is an allocation node: its memory comes from the graph memory pool at each launch, not
  // from the default pool the statistics and the limit are about, during the capture or after it.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  gpukit::stream s(d);
  constexpr std::size_t scratch_bytes = std::size_t{1} << 20;
  constexpr std::size_t kept_bytes = 16384;
  void* before = a.allocate(4096, s);
  a.set_reserved_limit(8192);  // below either graph allocation
  void* kept = nullptr;
  std::size_t allocated_during = 0;
  gpukit::async_allocator::graph_allocation_totals during;
  gpukit::graph g = gpukit::capture(s, [&] {
    void* scratch = a.allocate(scratch_bytes, s);  // freed in the graph
    GPUKIT_CUDA_TRY(cudaMemsetAsync(scratch, 1, scratch_bytes, s.cuda_handle()));
    kept = a.allocate(kept_bytes, s);  // kept past the capture
    GPUKIT_CUDA_TRY(cudaMemsetAsync(kept, 2, kept_bytes, s.cuda_handle()));
    allocated_during = a.memory_allocated();
    during = a.graph_allocations();
    a.deallocate(scratch);  // a free node
  });
  CHECK(allocated_during == 4096);
  CHECK(during.count == 2);
  CHECK(during.bytes == scratch_bytes + kept_bytes);
  CHECK(a.owns(kept));
  CHECK(a.memory_allocated() == 4096);
  CHECK(a.max_memory_allocated() == 4096);
  const gpukit::allocator_stats stats = a.stats();
  CHECK(stats.allocation.all().current == 1);
  CHECK(stats.allocation.all().allocated == 1);
  CHECK(stats.allocation.all().freed == 0);
  CHECK(stats.allocated_bytes.all().peak == 4096);
  CHECK(stats.num_device_alloc == 1);
  CHECK(stats.num_device_free == 0);
  const gpukit::allocator_snapshot snap = a.snapshot();
  CHECK(snap.segments.size() == 1);
  CHECK(snap.pointer_map_entries == 1);
  CHECK(a.graph_allocations().count == 1);
  CHECK(a.graph_allocations().bytes == kept_bytes);
  CHECK(contains(a.memory_summary(), "Graph allocs (not counted above):    1 of 16.00 KiB, their graphs' memory"));
  g.launch(s);
  a.deallocate(kept, s);  // after the launch, ordered after it
  CHECK(a.graph_allocations().count == 0);
  CHECK(a.graph_allocations().bytes == 0);
  CHECK(!contains(a.memory_summary(), "Graph allocs"));
  CHECK(a.stats().num_device_free == 0);
  a.deallocate(before);
  CHECK(a.memory_allocated() == 0);
  CHECK(a.stats().allocation.all().freed == 1);
  s.synchronize();
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::violations().empty());
#endif
}

TEST_CASE("gpu: async_allocator refuses to free a graph allocation outside its capture while that capture runs") {
  // Its graph does not exist yet, so it has not been launched: CUDA lets a graph allocation be freed outside its graph
  // only after a launch. Refused on a stream of no capture, on a stream of another capture (whose ordering after the
  // allocation stream would invalidate that capture), and from another thread whose free would wait for the capture
  // to end (this thread's per-thread stream is captured); the memory stays allocated, and the captures intact.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator a(d);
  const gpukit::stream_view mine(d, cudaStreamPerThread);
  gpukit::stream other(d);
  gpukit::stream inner(d);
  void* target = a.allocate(256, other);  // what the inner capture writes
  void* kept = nullptr;
  std::string outside, in_other_capture, other_thread;
  bool owned = false;
  gpukit::graph inner_graph;
  gpukit::graph g = gpukit::capture(mine, [&] {
    kept = a.allocate(4096, mine);
    outside = thrown_by([&] { a.deallocate(kept, other); });
    inner_graph = gpukit::capture(inner, [&] {
      in_other_capture = thrown_by([&] { a.deallocate(kept, inner); });
      GPUKIT_CUDA_TRY(cudaMemsetAsync(target, 0, 256, inner.cuda_handle()));
    });
    std::thread([&] { other_thread = thrown_by([&] { a.deallocate(kept); }); }).join();
    owned = a.owns(kept);
  });
  INFO(outside);
  INFO(in_other_capture);
  INFO(other_thread);
  for (const std::string* message : {&outside, &in_other_capture, &other_thread}) {
    CHECK(contains(*message, "invalid_argument_error: "));
    CHECK(contains(*message, "allocated during CUDA graph capture"));
    CHECK(contains(*message, "the graph cannot have been launched yet"));
    CHECK(contains(*message, "The memory is still allocated"));
  }
  CHECK(owned);
  CHECK(a.deferred_frees() == 0);
  CHECK(a.graph_allocations().count == 1);
  g.launch(mine);
  a.deallocate(kept, mine);  // after the launch, ordered after it
  inner_graph.launch(inner);
  a.deallocate(target, inner);
  CHECK(a.graph_allocations().count == 0);
  CHECK(cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess);
  inner.synchronize();
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::violations().empty());
#endif
}
