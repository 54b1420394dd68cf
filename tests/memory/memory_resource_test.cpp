// gpukit memory as CCCL memory resources (memory_resource.hpp): conformance to the cuda::mr concepts of the CCCL
// this file is compiled against (the toolkit's 3.0, and a newer one where CI installed it: both shapes), use
// through resource_ref, alignment, equality, on cuda:0 where a GPU (or the simulator) is; the CPU device is refused.
#include <gpukit/memory/memory_resource.hpp>
#include <gpukit/memory/resource_upstream.hpp>

#include "arena_resource.hpp"
#include "release_order_check.hpp"
#include "support.hpp"

#include <gpukit/memory/async_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace mr = ::cuda::mr;

#if CCCL_VERSION >= 3001000
// CCCL 3.1 and later: synchronous_resource (allocate_sync) and resource (stream-ordered allocate).
static_assert(mr::synchronous_resource<gpukit::device_memory_resource>, "");
static_assert(mr::resource_with<gpukit::device_memory_resource, mr::device_accessible>, "");
static_assert(!mr::resource_with<gpukit::device_memory_resource, mr::host_accessible>, "device memory");
static_assert(mr::resource_with<gpukit::pinned_memory_resource, mr::device_accessible, mr::host_accessible>, "");
template <class... Properties>
using sync_ref = mr::synchronous_resource_ref<Properties...>;
template <class... Properties>
using stream_ordered_ref = mr::resource_ref<Properties...>;
void* allocate_on(stream_ordered_ref<mr::device_accessible> ref, cuda::stream_ref s, std::size_t bytes,
                  std::size_t alignment) {
  return ref.allocate(s, bytes, alignment);
}
void deallocate_on(stream_ordered_ref<mr::device_accessible> ref, cuda::stream_ref s, void* p, std::size_t bytes,
                   std::size_t alignment) {
  ref.deallocate(s, p, bytes, alignment);
}
void* allocate_sync(sync_ref<mr::device_accessible> ref, std::size_t bytes, std::size_t alignment) {
  return ref.allocate_sync(bytes, alignment);
}
void deallocate_sync(sync_ref<mr::device_accessible> ref, void* p, std::size_t bytes, std::size_t alignment) {
  ref.deallocate_sync(p, bytes, alignment);
}
#else
// CCCL 3.0 (CUDA 13.0): resource (synchronous) and async_resource (stream-ordered), experimental.
static_assert(mr::resource<gpukit::device_memory_resource>, "");
static_assert(mr::async_resource_with<gpukit::device_memory_resource, mr::device_accessible>, "");
static_assert(!mr::resource_with<gpukit::device_memory_resource, mr::host_accessible>, "device memory");
static_assert(mr::async_resource_with<gpukit::pinned_memory_resource, mr::device_accessible, mr::host_accessible>, "");
template <class... Properties>
using sync_ref = mr::resource_ref<Properties...>;
template <class... Properties>
using stream_ordered_ref = mr::async_resource_ref<Properties...>;
void* allocate_on(stream_ordered_ref<mr::device_accessible> ref, cuda::stream_ref s, std::size_t bytes,
                  std::size_t alignment) {
  return ref.allocate_async(bytes, alignment, s);
}
void deallocate_on(stream_ordered_ref<mr::device_accessible> ref, cuda::stream_ref s, void* p, std::size_t bytes,
                   std::size_t alignment) {
  ref.deallocate_async(p, bytes, alignment, s);
}
void* allocate_sync(sync_ref<mr::device_accessible> ref, std::size_t bytes, std::size_t alignment) {
  return ref.allocate(bytes, alignment);
}
void deallocate_sync(sync_ref<mr::device_accessible> ref, void* p, std::size_t bytes, std::size_t alignment) {
  ref.deallocate(p, bytes, alignment);
}
#endif

namespace {
bool aligned_to(const void* p, std::size_t alignment) { return reinterpret_cast<std::uintptr_t>(p) % alignment == 0; }

/// Stream-ordered and synchronous allocation through resource_refs of a device_memory_resource over `a` on `s` (a
/// stream of its device).
void exercise_device_resource(gpukit::device_allocator& a, gpukit::stream_view s) {
  gpukit::device_memory_resource resource(a);
  CHECK(&resource.allocator() == &a);
  const std::size_t before = a.memory_allocated();
  void* p = allocate_on(resource, s, 1 << 20, 256);
  REQUIRE(p != nullptr);
  CHECK(a.owns(p));
  CHECK(a.memory_allocated() == before + (1 << 20));
  void* q = allocate_on(resource, s, 1000, 1 << 16);
  CHECK(aligned_to(q, 1 << 16));
  void* r = allocate_sync(resource, 3000, 4096);
  CHECK(aligned_to(r, 4096));
  deallocate_on(resource, s, p, 1 << 20, 256);
  deallocate_on(resource, s, q, 1000, 1 << 16);
  deallocate_sync(resource, r, 3000, 4096);
  CHECK(a.memory_allocated() == before);
}
}  // namespace

TEST_CASE("device_memory_resource and pinned_memory_resource refuse the CPU device, whose memory is host memory") {
  // Their types say cuda::mr::device_accessible: a kernel must not be handed the CPU device's malloc'd memory.
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::caching_allocator a(cpu);
  gpukit_test::arena_resource arena;  // a resource of one's own, of the CPU device
  const auto refused = [](const auto& make, const char* what) {
    try {
      make();
      FAIL("not refused");
    } catch (const gpukit::invalid_argument_error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  refused([&] { (void)gpukit::device_memory_resource(cpu); }, "device_memory_resource: the CPU device");
  refused([&] { (void)gpukit::device_memory_resource(a); }, "device_memory_resource: the CPU device");
  refused([&] { (void)gpukit::device_memory_resource(arena); }, "device_memory_resource: the CPU device");
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  refused([&] { (void)gpukit::pinned_memory_resource(cpu); }, "pinned_memory_resource: the CPU device");
  refused([&] { (void)gpukit::pinned_memory_resource(pool, cpu); }, "pinned_memory_resource: the CPU device");
  // A CPU pool is not page-locked, whatever device orders its frees (refused before any CUDA call).
  refused([&] { (void)gpukit::pinned_memory_resource(pool, gpukit::device::cuda(0)); }, "not page-locked");
  CHECK(pool.stats().active_blocks == 0);
}

TEST_CASE("gpu: device_memory_resource on cuda:0: CPU streams, alignment, zero bytes and refused frees") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator a(d);
  gpukit::device_memory_resource resource(a);
  CHECK(&resource.allocator() == &a);
  CHECK(resource.device() == d);
  gpukit::stream s(gpukit::device::cpu());
  // A CPU stream has no cuda::stream_ref: stream-ordered calls take CUDA streams, synchronous ones work.
  CHECK_THROWS_AS((void)allocate_on(resource, gpukit::to_stream_ref(s), 100, 256), gpukit::invalid_argument_error);
  void* p = allocate_sync(resource, 5000, 1 << 12);
  CHECK(aligned_to(p, 1 << 12));
  CHECK(a.memory_allocated() >= 5000);
  deallocate_sync(resource, p, 5000, 1 << 12);
  CHECK(a.memory_allocated() == 0);
  CHECK_THROWS_AS((void)allocate_sync(resource, 100, 48), gpukit::invalid_argument_error);
  CHECK(allocate_sync(resource, 0, 256) == nullptr);
  static_assert(noexcept(resource.deallocate_sync(nullptr, 0, 256)), "CCCL calls deallocation noexcept");
  gpukit_test::captured_warnings warnings;
  int not_from_the_allocator = 0;
  deallocate_sync(resource, &not_from_the_allocator, 4, 256);
  CHECK(warnings.contains("device_memory_resource::deallocate"));
}

TEST_CASE("gpu: device_memory_resource's synchronous free is ordered on the current stream, as its allocation") {
  // Freed under another stream's guard than the allocation's, the block went back in the allocation stream's order
  // alone, and that stream's next request got it while the current stream's work still used it.
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator a(d);
  gpukit::device_memory_resource resource(a);
  gpukit::stream s1(d);
  gpukit::stream s2(d);
  void* p = nullptr;
  {
    gpukit::stream_guard on(s1);
    p = allocate_sync(resource, 4096, 256);
  }
  gpukit_test::gate held;
  held.hold(s2);  // stands for a kernel on s2 that still uses p
  {
    gpukit::stream_guard on(s2);
    deallocate_sync(resource, p, 4096, 256);
  }
  void* q = nullptr;
  {
    gpukit::stream_guard on(s1);
    q = allocate_sync(resource, 4096, 256);
  }
  CHECK(q != p);  // s2's work is pending
  held.open();
  s2.synchronize();
  // Freed on its own stream (the usual case: one current stream), the block is reused there at once, as
  // deallocate(p) does: the stream-ordered free takes the same path when the stream is the allocation's.
  {
    gpukit::stream_guard on(s1);
    deallocate_sync(resource, q, 4096, 256);
    CHECK(allocate_sync(resource, 4096, 256) == q);
    deallocate_sync(resource, q, 4096, 256);
  }
  CHECK(a.memory_allocated() == 0);
}

namespace {
/// A device_resource of one's own on cuda:0 (no statistics, no control): the five functions, over an allocator.
class forwarding_resource final : public gpukit::device_resource {
 public:
  explicit forwarding_resource(gpukit::device_resource& to) : to_(to) {}
  [[nodiscard]] gpukit::device device() const noexcept override { return to_.device(); }
  std::size_t live = 0;

 private:
  void* do_allocate(std::size_t bytes, gpukit::stream_view stream) override {
    void* p = to_.allocate(bytes, stream);
    if (p != nullptr) ++live;
    return p;
  }
  void do_deallocate(void* p) override {
    to_.deallocate(p);
    --live;
  }
  void do_deallocate(void* p, gpukit::stream_view stream) override {
    to_.deallocate(p, stream);
    --live;
  }
  void do_record_stream(void* p, gpukit::stream_view stream) override { to_.record_stream(p, stream); }
  bool do_owns(const void* p) const noexcept override { return to_.owns(p); }
  gpukit::device_resource& to_;
};
}  // namespace

TEST_CASE("gpu: device_memory_resource over a resource of one's own (a device_resource without statistics)") {
  GPUKIT_REQUIRE_GPU();
  gpukit::caching_allocator a(gpukit::device::cuda(0));
  forwarding_resource own(a);
  gpukit::device_memory_resource resource(own);
  CHECK(&resource.allocator() == &own);
  void* p = allocate_sync(resource, 5000, 1 << 12);
  CHECK(aligned_to(p, 1 << 12));
  CHECK(own.live == 1);
  deallocate_sync(resource, p, 5000, 1 << 12);
  CHECK(own.live == 0);
  CHECK(gpukit::device_memory_resource(own) == resource);
}

namespace {
/// A cuda::mr resource (both of CCCL's shapes) that fails every allocation the way `mode` says.
struct failing_resource {
  enum class mode { bad_alloc, cccl_out_of_memory, other };
  mode how = mode::other;
  void* allocate_sync(std::size_t, std::size_t) {
    switch (how) {
      case mode::bad_alloc:
        throw std::bad_alloc();
      case mode::cccl_out_of_memory:
        throw ::cuda::cuda_error(cudaErrorMemoryAllocation, "out of memory");
      case mode::other:
        break;
    }
    throw std::runtime_error("failing_resource: broken");
  }
  void deallocate_sync(void*, std::size_t, std::size_t) noexcept {}
  void* allocate(std::size_t bytes, std::size_t alignment) { return allocate_sync(bytes, alignment); }
  void deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept { deallocate_sync(p, bytes, alignment); }
  bool operator==(const failing_resource& other) const noexcept { return how == other.how; }
  bool operator!=(const failing_resource& other) const noexcept { return how != other.how; }
};

// Segments go back in stream order to a stream-ordered resource only (the upstream then has deallocate_after).
static_assert(gpukit::resource_upstream<gpukit::device_memory_resource>::stream_ordered, "");
static_assert(gpukit::detail::has_ordered_release<gpukit::resource_upstream<gpukit::device_memory_resource>,
                                                  gpukit::event>::value,
              "");
static_assert(!gpukit::resource_upstream<failing_resource>::stream_ordered, "synchronous only");
static_assert(!gpukit::detail::has_ordered_release<gpukit::resource_upstream<failing_resource>, gpukit::event>::value,
              "");
}  // namespace

TEST_CASE("gpu: resource_upstream: a caching allocator in front of a cuda::mr resource") {
  GPUKIT_REQUIRE_GPU();
  using gpukit::allocator_options;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator inner(d);
  using upstream = gpukit::resource_upstream<gpukit::device_memory_resource>;
  gpukit::caching_device_allocator<upstream> outer(d, {}, gpukit::device_memory_resource(inner), d);
  CHECK(&outer.engine().upstream().resource().allocator() == &inner);
  gpukit::stream s(d);
  void* p = outer.allocate(1000, s);
  CHECK(outer.memory_reserved() == allocator_options{}.small_segment_size);  // one segment from the resource
  CHECK(inner.memory_allocated() == outer.memory_reserved());
  void* q = outer.allocate(1000, s);  // from the same segment: the resource is not asked again
  CHECK(inner.stats().allocation.all().current == 1);
  outer.deallocate(p);
  outer.deallocate(q);
  outer.empty_cache();
  CHECK(inner.memory_allocated() == 0);

  // The resource refuses for lack of memory: the outer allocator gives its cache back and retries, and reports out
  // of memory only when that does not help either.
  constexpr std::size_t MiB = allocator_options::MiB;
  outer.deallocate(outer.allocate(3 * MiB, s));  // caches a shared segment of 6 such requests
  CHECK(outer.memory_reserved() == 18 * MiB);
  inner.set_reserved_limit(30 * MiB);
  void* big = outer.allocate(24 * MiB, s);  // 18 + 24 > 30: refused once, served after the cache went back
  CHECK(outer.stats().num_alloc_retries == 1);
  CHECK(outer.memory_reserved() == 24 * MiB);
  outer.deallocate(big);
  CHECK_THROWS_AS((void)outer.allocate(40 * MiB, s), gpukit::out_of_memory_error);
  CHECK(outer.stats().num_ooms == 1);
  CHECK(inner.memory_allocated() == 0);  // every cached segment went back before the error
  inner.set_reserved_limit(allocator_options::unlimited);
  outer.deallocate(outer.allocate(40 * MiB, s));  // usable afterwards
  s.synchronize();
}

TEST_CASE("resource_upstream: a cuda::mr resource that refuses (CPU device)") {
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::stream s(cpu);
  std::vector<failing_resource::mode> refusals{failing_resource::mode::bad_alloc};
#if CCCL_VERSION < 3001000
  // From CCCL 3.1 on, making a cuda::cuda_error asks the driver for the error's name: not without a driver.
  refusals.push_back(failing_resource::mode::cccl_out_of_memory);
#endif
  for (const auto how : refusals) {
    gpukit::caching_device_allocator<gpukit::resource_upstream<failing_resource>> full(cpu, {}, failing_resource{how},
                                                                                       cpu);
    CHECK_THROWS_AS((void)full.allocate(100, s), gpukit::out_of_memory_error);
    CHECK(full.stats().num_ooms == 1);
  }
  gpukit::caching_device_allocator<gpukit::resource_upstream<failing_resource>> broken(cpu, {}, failing_resource{},
                                                                                       cpu);
  CHECK_THROWS_WITH_AS((void)broken.allocate(100, s), "failing_resource: broken", std::runtime_error);
  CHECK(broken.stats().num_ooms == 0);
  CHECK(broken.memory_reserved() == 0);
}

TEST_CASE("gpu: cuda::mr resources compare equal when they share an allocator or pool") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator a(d);
  gpukit::caching_allocator b(d);
  CHECK(gpukit::device_memory_resource(a) == gpukit::device_memory_resource(a));
  CHECK(gpukit::device_memory_resource(a) != gpukit::device_memory_resource(b));
  CHECK(gpukit::device_memory_resource(d) == gpukit::device_memory_resource(gpukit::default_allocator(d)));
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda, {}, d.ordinal())};
  gpukit::pinned_pool other{gpukit::pinned_upstream(gpukit::device::kind::cuda, {}, d.ordinal())};
  CHECK(gpukit::pinned_memory_resource(pool, d) == gpukit::pinned_memory_resource(pool, d));
  CHECK(gpukit::pinned_memory_resource(pool, d) != gpukit::pinned_memory_resource(other, d));
}

TEST_CASE("gpu: pinned_memory_resource: host- and device-accessible memory from a pinned pool, any alignment") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda, {}, d.ordinal())};
  gpukit::pinned_memory_resource resource(pool, d);
  CHECK(resource.device() == d);
  sync_ref<mr::host_accessible, mr::device_accessible> ref{resource};
#if CCCL_VERSION >= 3001000
  void* p = ref.allocate_sync(10000, 64);
  void* q = ref.allocate_sync(100, 1 << 16);
#else
  void* p = ref.allocate(10000, 64);
  void* q = ref.allocate(100, 1 << 16);
#endif
  CHECK(aligned_to(p, 64));
  CHECK(aligned_to(q, 1 << 16));
  std::memset(q, 2, 100);
  CHECK(pool.stats().active_blocks == 2);
#if CCCL_VERSION >= 3001000
  ref.deallocate_sync(p, 10000, 64);
  ref.deallocate_sync(q, 100, 1 << 16);
#else
  ref.deallocate(p, 10000, 64);
  ref.deallocate(q, 100, 1 << 16);
#endif
  CHECK(pool.stats().active_blocks == 0);
  CHECK_THROWS_AS((void)resource.allocate_sync(100, 5), gpukit::invalid_argument_error);
  // Freed twice: CCCL's references call deallocation noexcept, so the pool's refusal is reported, not thrown.
  void* r = resource.allocate_sync(100, 1 << 14);
  resource.deallocate_sync(r, 100, 1 << 14);
  gpukit_test::captured_warnings warnings;
  resource.deallocate_sync(r, 100, 1 << 14);
  CHECK(warnings.contains("pinned_memory_resource::deallocate"));
  CHECK(pool.stats().active_blocks == 0);
}

TEST_CASE("gpu: device_memory_resource on cuda:0, stream-ordered and synchronous") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  exercise_device_resource(gpukit::default_allocator(d), s.view());
  gpukit::caching_allocator own(d);
  exercise_device_resource(own, s.view());
  // The legacy default stream of the device, through a stream_ref of handle 0.
  exercise_device_resource(own, gpukit::stream_view::default_stream(d));
  own.empty_cache();
  if (gpukit::device_count() > 1) {
    // A stream of another device is refused (reported: deallocation cannot throw), not taken for cuda:0's.
    gpukit::stream other(gpukit::device::cuda(1));
    gpukit::device_memory_resource resource(own);
    CHECK_THROWS_AS((void)resource.allocate(other, 256, 256), gpukit::invalid_argument_error);
  }
}

TEST_CASE("gpu: pinned_memory_resource on cuda:0 frees in a stream's order") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::pinned_memory_resource resource(d);
  CHECK(resource.device() == d);
  gpukit::stream s(d);
  void* p = resource.allocate(s, 1 << 20, 1 << 13);
  CHECK(aligned_to(p, 1 << 13));
  cudaPointerAttributes attributes{};
  REQUIRE(cudaPointerGetAttributes(&attributes, p) == cudaSuccess);
  CHECK(attributes.type == cudaMemoryTypeHost);
  resource.deallocate(s, p, 1 << 20, 1 << 13);
  s.synchronize();
}

TEST_CASE("gpu: pinned_memory_resource orders its frees on the current stream, another device's stream, a capture") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda, {}, d.ordinal())};
  gpukit::pinned_memory_resource resource(pool, d);
  gpukit_test::captured_warnings warnings;
  gpukit::stream s(d);
  {
    // deallocate_sync: after the work so far on the current stream (a copy there may still read the block).
    gpukit_test::gate g;
    const gpukit::stream_guard current(s);
    void* p = resource.allocate_sync(4096);
    g.hold(s);
    // Under a watchdog: on a GPU, a call that waits for s would wait for good (a timeout that says nothing).
    CHECK_FALSE(g.opened_to_return([&] {
      resource.deallocate_sync(p, 4096);
      void* q = resource.allocate_sync(4096);
      CHECK(q != p);  // p waits for s
      resource.deallocate_sync(q, 4096);
    }));
    g.open();
    s.synchronize();
  }
  if (gpukit::device_count() > 1) {
    // A stream of cuda:1: the block waits for it (an event of cuda:0 recorded there failed: the block was lost).
    gpukit::stream other(gpukit::device::cuda(1));
    gpukit_test::gate g;
    void* p = resource.allocate(other, 4096, 256);
    g.hold(other);
    resource.deallocate(other, p, 4096, 256);
    void* q = resource.allocate(other, 4096, 256);
    CHECK(q != p);
    resource.deallocate(other, q, 4096, 256);
    g.open();
    other.synchronize();
  }
  {
    // Freed on a stream being captured (a CCCL buffer destroyed in the capture): waits for the capture to end, then
    // for the work enqueued on s before it. A raw capture: gpukit::capture also instantiates the graph, which CUDA
    // may not do while a host function holds the stream (tests/graph/gpu_capture_rules_test.cpp asks).
    (void)pool.empty_cache();  // the blocks above: p will be the only free one of its class
    void* p = resource.allocate(s, 4096, 256);
    void* q = nullptr;
    gpukit_test::gate g;
    g.hold(s);
    CHECK_FALSE(g.opened_to_return([&] {
      REQUIRE(cudaStreamBeginCapture(s.cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      struct end_capture {  // also if the free throws, so that s is not left captured
        cudaStream_t stream;
        cudaError_t end() {
          cudaGraph_t graph = nullptr;
          const cudaError_t result = cudaStreamEndCapture(stream, &graph);
          stream = nullptr;
          if (graph != nullptr) (void)cudaGraphDestroy(graph);
          return result;
        }
        ~end_capture() {
          if (stream != nullptr) (void)end();
        }
      } capture{s.cuda_handle()};
      resource.deallocate(s, p, 4096, 256);
      REQUIRE(capture.end() == cudaSuccess);
      const gpukit::pinned_pool_stats after = pool.stats();
      CHECK(after.active_blocks == 0);
      CHECK(after.pending_blocks == 1);  // deferred: the old code refused the free and lost the block
      q = resource.allocate(s, 4096, 256);
      CHECK(q != p);
    }));
    g.open();
    s.synchronize();
    void* r = resource.allocate(s, 4096, 256);
    CHECK(r == p);  // back in the pool once s passed its earlier work
    resource.deallocate(s, q, 4096, 256);
    resource.deallocate(s, r, 4096, 256);
    s.synchronize();
    CHECK(pool.stats().pending_blocks == 0);  // q and r reclaimed: the count below sees only p
  }
  {
    // The same on a stream gpukit did not create: its device and id are not asked of CUDA during the capture (the
    // questions would invalidate it, as on an H200); the block waits for the capture, then for the stream.
    cudaStream_t raw = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
    void* p = resource.allocate(::cuda::stream_ref(raw), 4096, 256);
    gpukit_test::gate g;
    g.hold(gpukit::stream_view(raw));
    CHECK_FALSE(g.opened_to_return([&] {
      REQUIRE(cudaStreamBeginCapture(raw, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      resource.deallocate(::cuda::stream_ref(raw), p, 4096, 256);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(raw, &graph);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      CHECK(ended == cudaSuccess);
      CHECK(pool.stats().pending_blocks == 1);  // p, deferred until the capture ends
    }));
    g.open();
    CHECK(cudaStreamSynchronize(s.cuda_handle()) == cudaSuccess);
    CHECK(cudaStreamSynchronize(raw) == cudaSuccess);
    (void)pool.stats();  // records p's event on `raw`, the capture being over
    CHECK(cudaStreamSynchronize(raw) == cudaSuccess);
    CHECK(pool.stats().pending_blocks == 0);
    CHECK(cudaStreamDestroy(raw) == cudaSuccess);
  }
  CHECK(warnings.messages().empty());
  CHECK(pool.stats().lost_blocks == 0);
}

TEST_CASE("gpu: resource_upstream over a cuda::mr resource of cuda:0 gives segments back after the device's work") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::caching_allocator inner(d);
  gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> outer(
      d, {}, gpukit::device_memory_resource(inner), d);
  CHECK(outer.engine().upstream().synchronizes_on_free());
  CHECK(outer.engine().upstream().memory_info().known);
  gpukit::stream s(d);
  void* p = outer.allocate(std::size_t{5} << 20, s);
  CHECK(inner.memory_allocated() == outer.memory_reserved());
  outer.deallocate(p);
  outer.empty_cache();
  CHECK(inner.memory_allocated() == 0);
  inner.empty_cache();
}

TEST_CASE(
    "gpu: resource_upstream over a stream-ordered resource gives segments back in stream order: work queued before "
    "the release reads intact data, and empty_cache does not wait for it") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::async_allocator pool(d);  // cudaMallocAsync / cudaFreeAsync behind a cuda::mr resource
  gpukit::caching_device_allocator<gpukit::resource_upstream<gpukit::device_memory_resource>> a(
      d, {}, gpukit::device_memory_resource(pool), d);
  gpukit_test::check_release_in_stream_order(a, d);
  CHECK(pool.memory_allocated() == a.memory_reserved());
}
