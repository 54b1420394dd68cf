// The caching allocator's CUDA upstreams on the simulator, where a device's memory can be small enough to run out:
// cuda_upstream (cudaMalloc) beside memory that cudaMallocAsync's default pool keeps after its frees.
#include <gpukit/gpukit.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

cuuint64_t pool_figure(cudaMemPool_t pool, cudaMemPoolAttr attribute) {
  cuuint64_t value = 0;
  REQUIRE(cudaMemPoolGetAttribute(pool, attribute, &value) == cudaSuccess);
  return value;
}

/// A device of 64 MiB, 16 of them taken by its context (configured before any CUDA call).
struct small_device {
  small_device() {
    cudasim::machine_config machine = cudasim::default_machine(1);
    machine.devices[0].total_memory = 64 * MiB;
    machine.context_bytes = 16 * MiB;
    configured = cudasim::configure_or_skip(machine);
  }
  bool configured = false;
};

/// Its default pool keeps everything freed (the release threshold of async_allocator(d, limit) or of another
/// library), and holds `kept` bytes (40 MiB unless told) freed by cudaFreeAsync and synchronized.
struct pool_holds_memory : small_device {
  explicit pool_holds_memory(std::size_t kept = 40 * MiB) {
    if (!configured) return;
    REQUIRE(cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess);
    cuuint64_t keep_all = std::numeric_limits<cuuint64_t>::max();
    REQUIRE(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all) == cudaSuccess);
    void* p = nullptr;
    REQUIRE(cudaMallocAsync(&p, kept, s.cuda_handle()) == cudaSuccess);
    REQUIRE(cudaFreeAsync(p, s.cuda_handle()) == cudaSuccess);
    s.synchronize();
    REQUIRE(pool_figure(pool, cudaMemPoolAttrReservedMemCurrent) == kept);
  }
  gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s{gpukit::device::cuda(0)};
  cudaMemPool_t pool = nullptr;
};

}  // namespace

TEST_CASE("upstreams: release_unused_elsewhere gives back what the default pool keeps unused, for cudaMalloc") {
  pool_holds_memory f;
  if (!f.configured) return;
  gpukit::cuda_upstream up(f.d);
  CHECK(up.allocate(32 * MiB) == nullptr);  // 48 MiB usable, 40 of them kept by the pool
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 40 * MiB);  // allocate alone leaves it
  CHECK(up.release_unused_elsewhere());
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 0);
  void* p = up.allocate(32 * MiB);
  CHECK(p != nullptr);
  CHECK_FALSE(up.release_unused_elsewhere());  // nothing left to give
  CHECK(cudaGetLastError() == cudaSuccess);
  if (p != nullptr) up.deallocate(p, 32 * MiB);
}

TEST_CASE("upstreams: the caching allocator is not out of memory while the default pool keeps memory unused") {
  pool_holds_memory f;
  if (!f.configured) return;
  gpukit::caching_allocator a(f.d);
  void* p = a.allocate(30 * MiB, f.s);
  CHECK(a.stats().num_ooms == 0);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 0);
  a.deallocate(p);
  a.empty_cache();
}

TEST_CASE("upstreams: with expandable segments too, the pages come from what the default pool keeps unused") {
  pool_holds_memory f;
  if (!f.configured) return;
  gpukit::allocator_options o;
  o.expandable_segments = true;
  o.expandable_segments_required = true;
  gpukit::caching_allocator a(f.d, o);
  void* p = a.allocate(30 * MiB, f.s);  // 15 pages of 2 MiB, from cuMemCreate
  CHECK(a.stats().num_ooms == 0);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 0);
  a.deallocate(p);
  a.empty_cache();
}

TEST_CASE("upstreams: the allocator gives back its own cache before it takes what another user's pool keeps") {
  pool_holds_memory f(16 * MiB);  // another user's cache: 16 MiB
  if (!f.configured) return;
  gpukit::caching_allocator a(f.d);
  a.deallocate(a.allocate(20 * MiB, f.s));  // cached: 32 of the 48 usable MiB are held, 16 by each
  REQUIRE(a.memory_reserved() >= 20 * MiB);
  void* p = a.allocate(26 * MiB, f.s);  // fits once the allocator's own cache goes back
  CHECK(a.stats().num_ooms == 0);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 16 * MiB);  // the pool's cache was not needed
  a.deallocate(p);
  a.empty_cache();
}

TEST_CASE("upstreams: a smaller segment that fits is made before another user's pool is asked to give back") {
  pool_holds_memory f(38 * MiB);  // 10 of the 48 usable MiB left
  if (!f.configured) return;
  gpukit::caching_allocator a(f.d);
  void* p = a.allocate(6 * MiB, f.s);  // its shared segment (20 MiB) does not fit; one of 6 MiB does
  CHECK(a.memory_reserved() < 10 * MiB);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 38 * MiB);
  a.deallocate(p);
  a.empty_cache();
}

TEST_CASE("upstreams: memory the pool has handed out is not taken, and out of memory stays nullptr, no error left") {
  pool_holds_memory f;
  if (!f.configured) return;
  void* live = nullptr;
  REQUIRE(cudaMallocAsync(&live, 40 * MiB, f.s.cuda_handle()) == cudaSuccess);  // the pool's 40 MiB, in use again
  f.s.synchronize();
  gpukit::cuda_upstream up(f.d);
  CHECK_FALSE(up.release_unused_elsewhere());  // nothing the pool keeps is unused
  CHECK(up.allocate(32 * MiB) == nullptr);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 40 * MiB);
  CHECK(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaFreeAsync(live, f.s.cuda_handle()) == cudaSuccess);
  f.s.synchronize();
}

// reuse_before_release on cudaMalloc: the refusal is the device's, and the shortfall comes from cudaMemGetInfo.
TEST_CASE("upstreams: reuse_before_release splits a kept block, then frees only what cudaMalloc lacks") {
  small_device f;  // 48 MiB usable
  if (!f.configured) return;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::allocator_options o;
  o.medium_size = 8 * MiB;     // requests of 8 MiB or more get segments of their own...
  o.max_split_size = 8 * MiB;  // ...kept whole, taken by requests at most 2 MiB smaller
  o.max_oversize_waste = 2 * MiB;
  o.reuse_before_release = true;
  gpukit::caching_allocator a(d, o);
  void* big = a.allocate(30 * MiB, s);
  a.deallocate(big);
  void* split = a.allocate(20 * MiB, s);  // 30 + 20 MiB exceed the device: the cached block is split instead
  CHECK(split == big);
  CHECK(a.stats().num_device_free == 0);
  CHECK(a.stats().num_device_alloc == 1);
  a.deallocate(split);
  a.empty_cache();
  void* live = a.allocate(10 * MiB, s);
  void* x = a.allocate(12 * MiB, s);
  void* y = a.allocate(14 * MiB, s);
  a.deallocate(x);
  a.deallocate(y);  // 36 MiB reserved: 12 free on the device, 24 MiB needed
  const std::size_t frees = a.stats().num_device_free;
  void* r = a.allocate(24 * MiB, s);
  CHECK(a.stats().num_device_free == frees + 1);  // 12 MiB short: the 12 MiB segment covers it
  CHECK(a.memory_reserved() == 10 * MiB + 14 * MiB + 24 * MiB);
  CHECK(a.stats().num_device_free_unforced == 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  a.deallocate(r);
  a.deallocate(live);
  a.empty_cache();
}
