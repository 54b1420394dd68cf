// GPU tests of peer access and peer copies: run on a machine with a CUDA device (and on the simulator), reported as
// Skipped elsewhere. With one GPU they check the one-device answers; the pair checks need two.
#include <gpukit/gpukit.hpp>
#include <gpukit/device/peer_access.hpp>

#include "support.hpp"

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

TEST_CASE("gpu: the peer matrix matches cudaDeviceCanAccessPeer and prints every device") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::peer_matrix m = gpukit::query_peer_matrix();
  REQUIRE(static_cast<int>(m.size()) == gpukit::device_count());
  for (std::size_t i = 0; i < m.size(); ++i) {
    CHECK_FALSE(m.can_access[i][i]);
    for (std::size_t j = 0; j < m.size(); ++j) {
      int can = -1;
      REQUIRE(cudaDeviceCanAccessPeer(&can, static_cast<int>(i), static_cast<int>(j)) == cudaSuccess);
      CHECK(m.can_access[i][j] == (can != 0));  // a device is not its own peer (can == 0 on the diagonal)
    }
  }
  // What the simulator assumes about refusals (tests/cudasim/README.md), checked against the real runtime.
  gpukit::device_guard guard(gpukit::device::cuda(0));
  CHECK(cudaDeviceEnablePeerAccess(0, 0) == cudaErrorPeerAccessUnsupported);  // H100, driver 580.159
  (void)cudaGetLastError();
  for (std::size_t j = 1; j < m.size(); ++j) {
    if (m.can_access[0][j]) continue;
    CHECK(cudaDeviceEnablePeerAccess(static_cast<int>(j), 0) == cudaErrorPeerAccessUnsupported);
    (void)cudaGetLastError();
    break;
  }
  const std::string table = m.to_string();
  for (const gpukit::device d : m.devices) CHECK(table.find(d.to_string()) != std::string::npos);
  std::printf("%s", table.c_str());
}

TEST_CASE("gpu: peer_access enables and disables access, and peer copies work with and without it") {
  GPUKIT_REQUIRE_GPU();
  const gpukit::device d0 = gpukit::device::cuda(0);
  const gpukit::device d1 = gpukit::device::cuda(gpukit::device_count() > 1 ? 1 : 0);  // itself on one GPU
  {
    gpukit::peer_access self(d0, d0);
    CHECK_FALSE(self.active());
  }
  std::vector<int> host(1 << 16);
  std::iota(host.begin(), host.end(), 0);
  gpukit::stream s0(d0);
  gpukit::stream s1(d1);
  gpukit::device_buffer<int> a(host.size(), s0);
  gpukit::device_buffer<int> b(host.size(), s1);
  gpukit::copy_async(a, host, s0);
  s0.synchronize();
  gpukit::copy_peer_async(b.data(), d1, a.data(), d0, host.size() * sizeof(int), s1);
  CHECK(gpukit::to_host(b, s1) == host);
  if (d1 == d0 || !gpukit::can_access_peer(d1, d0)) {
    std::printf("no peer pair: %s\n", d1 == d0 ? "one GPU" : "cuda:1 cannot access cuda:0");
    return;
  }
  {
    gpukit::peer_access first(d1, d0);
    gpukit::peer_access second(d1, d0);
    CHECK(first.active());
    // Already enabled (by `first`): the runtime says so, and the answer must not linger as the last error.
    {
      gpukit::device_guard guard(d1);
      CHECK(cudaDeviceEnablePeerAccess(d0.ordinal(), 0) == cudaErrorPeerAccessAlreadyEnabled);
      (void)cudaGetLastError();
    }
    gpukit::copy_peer_async(b.data(), d1, a.data(), d0, host.size() * sizeof(int), s1);
    CHECK(gpukit::to_host(b, s1) == host);
  }
  // The last hold disabled it: disabling again is refused.
  gpukit::device_guard guard(d1);
  CHECK(cudaDeviceDisablePeerAccess(d0.ordinal()) == cudaErrorPeerAccessNotEnabled);
  (void)cudaGetLastError();
}
