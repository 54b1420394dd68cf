// The caching allocator's CUDA upstreams on the simulator, where a device's memory can be small enough to run out:
// cuda_upstream (cudaMalloc) beside memory that cudaMallocAsync's default pool keeps after its frees.
#include <gpukit/gpukit.hpp>

#include "cudasim.hpp"
#include "support.hpp"

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
/// library), and holds 40 MiB freed by cudaFreeAsync and synchronized.
struct pool_holds_memory : small_device {
  pool_holds_memory() {
    if (!configured) return;
    REQUIRE(cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess);
    cuuint64_t keep_all = std::numeric_limits<cuuint64_t>::max();
    REQUIRE(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all) == cudaSuccess);
    void* p = nullptr;
    REQUIRE(cudaMallocAsync(&p, 40 * MiB, s.cuda_handle()) == cudaSuccess);
    REQUIRE(cudaFreeAsync(p, s.cuda_handle()) == cudaSuccess);
    s.synchronize();
    REQUIRE(pool_figure(pool, cudaMemPoolAttrReservedMemCurrent) == 40 * MiB);
  }
  gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s{gpukit::device::cuda(0)};
  cudaMemPool_t pool = nullptr;
};

}  // namespace

TEST_CASE("upstreams: cudaMalloc out of memory gets what the default pool keeps unused, and tries once more") {
  pool_holds_memory f;
  if (!f.configured) return;
  gpukit::cuda_upstream up(f.d);
  void* p = up.allocate(32 * MiB);  // 48 MiB usable, 40 of them kept by the pool
  CHECK(p != nullptr);
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  if (p != nullptr) up.deallocate(p, 32 * MiB);
}

TEST_CASE("upstreams: the caching allocator over cudaMalloc is not out of memory while the default pool keeps it") {
  pool_holds_memory f;
  if (!f.configured) return;
  gpukit::caching_allocator a(f.d);
  void* p = a.allocate(30 * MiB, f.s);
  CHECK(a.stats().num_ooms == 0);
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
  CHECK(up.allocate(32 * MiB) == nullptr);  // 8 MiB left: nothing the pool keeps unused could help
  CHECK(pool_figure(f.pool, cudaMemPoolAttrReservedMemCurrent) == 40 * MiB);
  CHECK(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaFreeAsync(live, f.s.cuda_handle()) == cudaSuccess);
  f.s.synchronize();
}
