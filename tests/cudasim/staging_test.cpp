// The staging engine on the simulated runtime, where what a GPU leaves to chance is fixed: a destroyed stream's
// handle is handed to the next stream created (LIFO), and the host functions of all streams of a device run one at a
// time on one thread. Staged copies must not mistake a new stream for a dead one, must not keep rings of dead
// streams, and must not depend on host functions (which another stream's host function can hold back).
#include <gpukit/gpukit.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {
constexpr std::size_t MiB = 1024 * 1024;

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131u + seed * 17u + (i >> 11)) & 0xFFu);
  return v;
}

/// Device memory of cuda:0 for a test (freed with cudaFree, which waits for the device's work).
struct device_memory {
  explicit device_memory(std::size_t bytes) { REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess); }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  ~device_memory() { (void)cudaFree(p); }
  void* p = nullptr;
};

gpukit::staging_options small_options() {
  gpukit::staging_options o;
  o.chunk_bytes = 1 * MiB;
  o.min_chunk_bytes = 256 * 1024;
  o.slots = 4;
  return o;
}
}  // namespace

TEST_CASE("sim staging: a new stream that gets a destroyed stream's handle gets its own ring, not the dead one's") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.patience = 2s;  // a new stream waiting for the dead stream's slots would wait this long
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(4 * MiB, 1);  // fills a ring
  device_memory for_a(host.size());
  device_memory for_b(host.size());
  gpukit_test::gate g;
  auto a = std::make_unique<gpukit::stream>(d);
  const cudaStream_t handle = a->cuda_handle();
  g.hold(*a);
  engine.to_device(for_a.p, host.data(), host.size(), *a);  // a's slots stay busy behind the gate
  a.reset();                                                 // destroyed with its work pending
  gpukit::stream b(d);
  REQUIRE(b.cuda_handle() == handle);  // CUDA may hand out the handle again at once; the simulator always does
  const auto start = std::chrono::steady_clock::now();
  engine.to_device(for_b.p, host.data(), host.size(), b);
  b.synchronize();
  CHECK(std::chrono::steady_clock::now() - start < 1s);
  const auto st = engine.stats();
  CHECK(st.slot_waits == 0);  // b never waited for a's slots
  CHECK(st.overflows == 0);
  CHECK(st.rings == 2);
  g.open();
  cudasim::drain_all();
  std::vector<unsigned char> back(host.size());
  engine.to_host(back.data(), for_a.p, back.size(), b);
  CHECK(back == host);
}

TEST_CASE("sim staging: rings of destroyed streams do not accumulate beyond max_rings") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.max_rings = 2;
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(2 * MiB, 2);
  device_memory dev(host.size());
  for (int i = 0; i < 10; ++i) {
    gpukit::stream s(d);  // each one the same handle as the one before, and a new stream
    engine.to_device(dev.p, host.data(), host.size(), s);
    s.synchronize();
  }
  const auto st = engine.stats();
  CHECK(st.rings_created == 10);  // one ring per stream, never one stream's ring for another
  CHECK(st.rings <= 2);
  CHECK(st.rings_released >= 8);
  CHECK(pool.stats().allocated_bytes <= 2 * 4 * MiB);
}

TEST_CASE("sim staging: copies into pageable memory launch no host function") {
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  const auto host = pattern(20 * MiB + 3, 3);
  device_memory dev(host.size());
  gpukit::copy_async(gpukit::device_span<unsigned char>(static_cast<unsigned char*>(dev.p), host.size(), d), host,
                     s);
  std::vector<unsigned char> back(host.size(), 0);
  const std::size_t before = cudasim::calls("cudaLaunchHostFunc");
  gpukit::copy_async(back, gpukit::device_span<const unsigned char>(static_cast<unsigned char*>(dev.p), host.size(), d),
                     s);
  CHECK(cudasim::calls("cudaLaunchHostFunc") == before);
  CHECK(back == host);  // complete when copy_async returned
}

TEST_CASE("sim staging: the per-thread default stream of each thread has its own ring") {
  const auto d = gpukit::device::cuda(0);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  gpukit::staging_engine engine(pool, small_options());
  const auto host = pattern(3 * MiB, 4);
  device_memory dev(host.size());
  {
    gpukit::device_guard guard(d);
    engine.to_device(dev.p, host.data(), host.size(), gpukit::stream_view(d, cudaStreamPerThread));
    CHECK(cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess);
  }
  bool same = false;
  std::thread other([&] {
    gpukit::device_guard guard(d);
    std::vector<unsigned char> back(host.size());
    engine.to_host(back.data(), dev.p, back.size(), gpukit::stream_view(d, cudaStreamPerThread));
    same = back == host;
  });
  other.join();
  CHECK(same);
  CHECK(engine.stats().rings_created == 2);
}

TEST_CASE("sim staging: the rest of a transfer staged in the background on cuda:1 touches no other device") {
  cudasim::allow_contexts_only_on({1});
  const auto d = gpukit::device::cuda(1);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cuda)};
  auto options = small_options();
  options.patience = 10ms;
  gpukit::staging_engine engine(pool, options);
  const auto host = pattern(12 * MiB + 5, 5);
  void* dev = nullptr;
  std::vector<unsigned char> back(host.size(), 0);
  {
    gpukit::device_guard guard(d);
    REQUIRE(cudaMalloc(&dev, host.size()) == cudaSuccess);
  }
  {
    gpukit::stream s(d);
    gpukit_test::gate g;
    g.hold(s);
    engine.to_device(dev, host.data(), host.size(), s);  // the ring's 4 MiB, then the rest in the background
    CHECK(engine.stats().overflows == 1);
    CHECK(pool.stats().allocated_bytes_peak <= engine.max_pinned_bytes_per_stream());
    g.open();
    engine.to_host(back.data(), dev, back.size(), s);
  }
  CHECK(back == host);
  CHECK(engine.release_idle() == 1);
  CHECK(cudasim::context_creations(0) == 0);
  {
    gpukit::device_guard guard(d);
    CHECK(cudaFree(dev) == cudaSuccess);
  }
  cudasim::allow_contexts_only_on({});
}
