// Peer access between devices (<gpukit/device/peer_access.hpp>) and peer copies, on the simulator: the topology
// query, the process-wide counting of peer_access holds, access enabled outside gpukit, unsupported pairs, contexts
// only on the two named devices, threads, and destructors after the runtime unloaded. Tests that need a machine other
// than the default two devices configure it and are Skipped when an earlier test of the process initialised CUDA.
#include <gpukit/gpukit.hpp>
#include <gpukit/device/peer_access.hpp>
#include <gpukit/graph/graph.hpp>
#include <gpukit/memory/async_allocator.hpp>

#include "call_during_capture.hpp"
#include "cudasim.hpp"
#include "support.hpp"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

const gpukit::device cuda0 = gpukit::device::cuda(0);
const gpukit::device cuda1 = gpukit::device::cuda(1);

/// Four devices: 0 and 1 are peers both ways, 2 and 3 are peers both ways, no pair across.
cudasim::machine_config two_islands() {
  cudasim::machine_config machine = cudasim::default_machine(4);
  machine.peer_access = {{false, true, false, false},
                         {true, false, false, false},
                         {false, false, false, true},
                         {false, false, true, false}};
  return machine;
}

std::string exception_text(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("peer: every pair of the default machine can be peers, and asking creates no context") {
  CHECK(gpukit::can_access_peer(cuda0, cuda1));
  CHECK(gpukit::can_access_peer(cuda1, cuda0));
  const gpukit::nvml::library no_nvml("/nonexistent/libnvidia-ml.so.1");
  const gpukit::peer_matrix m = gpukit::query_peer_matrix(no_nvml);
  REQUIRE(m.size() == 2);
  CHECK(m.devices == std::vector<gpukit::device>{cuda0, cuda1});
  CHECK(m.can_access == std::vector<std::vector<bool>>{{false, true}, {true, false}});
  CHECK(m.links.empty());
  CHECK(m.to_string().rfind("        cuda:0  cuda:1\n"
                            "cuda:0  X       OK\n"
                            "cuda:1  OK      X\n\n",
                            0) == 0);
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 0);
  CHECK(cudasim::calls("cudaDeviceCanAccessPeer") == 4);
}

TEST_CASE("peer: a topology with pairs that cannot access each other") {
  if (!cudasim::configure_or_skip(two_islands())) return;
  cudasim::allow_contexts_only_on({0});
  const gpukit::peer_matrix m = gpukit::query_peer_matrix();
  REQUIRE(m.size() == 4);
  CHECK(m.can_access[0][1]);
  CHECK(m.can_access[3][2]);
  CHECK_FALSE(m.can_access[0][2]);
  CHECK_FALSE(m.can_access[1][3]);
  CHECK_FALSE(m.can_access[2][2]);
  CHECK(m.to_string().rfind("        cuda:0  cuda:1  cuda:2  cuda:3\n"
                            "cuda:0  X       OK      --      --\n"
                            "cuda:1  OK      X       --      --\n"
                            "cuda:2  --      --      X       OK\n"
                            "cuda:3  --      --      OK      X\n",
                            0) == 0);
  CHECK_FALSE(gpukit::can_access_peer(gpukit::device::cuda(1), gpukit::device::cuda(2)));

  // An unsupported pair: the error names both devices and the result; nothing is held, no error is left pending.
  const gpukit::device cuda2 = gpukit::device::cuda(2);
  std::string text;
  try {
    gpukit::peer_access p(cuda0, cuda2);
    FAIL("cuda:0 -> cuda:2 is not a peer pair");
  } catch (const gpukit::cuda_error& e) {
    text = e.what();
    CHECK(e.cuda_result() == cudaErrorPeerAccessUnsupported);
    CHECK(e.device() == 0);
  }
  CHECK(text.find("cuda:0 -> cuda:2") != std::string::npos);
  CHECK(text.find("cudaErrorPeerAccessUnsupported") != std::string::npos);
  CHECK(text.find("cuda:0 cannot access the memory of cuda:2 directly") != std::string::npos);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  CHECK_FALSE(cudasim::peer_access_enabled(0, 2));
  CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 0);  // asked first: no context made for nothing
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(2) == 0);
  // The failed attempt is not remembered as a hold: a later pair that works is enabled normally.
  cudasim::allow_contexts_only_on({0, 1});
  {
    gpukit::peer_access p(cuda0, cuda1);
    CHECK(cudasim::peer_access_enabled(0, 1));
  }
  CHECK_FALSE(cudasim::peer_access_enabled(0, 1));
  CHECK(cudasim::context_creations(3) == 0);
}

TEST_CASE("peer: ordinals follow CUDA_VISIBLE_DEVICES in the topology") {
  gpukit_test::scoped_env visible("CUDA_VISIBLE_DEVICES", std::string("2,0,1"));
  if (!cudasim::configure_or_skip(two_islands())) return;
  const gpukit::peer_matrix m = gpukit::query_peer_matrix();
  REQUIRE(m.size() == 3);  // cuda:0 is physical 2, whose peer (3) is not visible
  const std::vector<std::vector<bool>> expected{{false, false, false}, {false, false, true}, {false, true, false}};
  CHECK(m.can_access == expected);
}

TEST_CASE("peer: holds are counted: the first enables, the last disables, and only the two devices get contexts") {
  if (!cudasim::configure_or_skip(cudasim::default_machine(4))) return;
  cudasim::allow_contexts_only_on({1, 2});
  const gpukit::device cuda2 = gpukit::device::cuda(2);
  {
    gpukit::peer_access a(cuda1, cuda2);
    CHECK(a.active());
    CHECK(a.from() == cuda1);
    CHECK(a.to() == cuda2);
    CHECK(cudasim::peer_access_enabled(1, 2));
    CHECK_FALSE(cudasim::peer_access_enabled(2, 1));  // one direction only
    {
      gpukit::peer_access b(cuda1, cuda2);
      CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 1);
    }
    CHECK(cudasim::peer_access_enabled(1, 2));  // `a` still holds it
    CHECK(cudasim::calls("cudaDeviceDisablePeerAccess") == 0);
    gpukit::peer_access back(cuda2, cuda1);  // the other direction is a pair of its own
    CHECK(cudasim::peer_access_enabled(2, 1));
    CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 2);
  }
  CHECK_FALSE(cudasim::peer_access_enabled(1, 2));
  CHECK_FALSE(cudasim::peer_access_enabled(2, 1));
  CHECK(cudasim::calls("cudaDeviceDisablePeerAccess") == 2);
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(3) == 0);
  CHECK(cudasim::context_creations(1) == 1);
  CHECK(cudasim::context_creations(2) == 1);
  // A thread that had chosen a device keeps it.
  REQUIRE(cudaSetDevice(2) == cudaSuccess);
  { gpukit::peer_access a(cuda1, cuda2); }
  CHECK(gpukit::current_device() == cuda2);
}

TEST_CASE("peer: access enabled outside gpukit is used, its error cleared, and left enabled") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  REQUIRE(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
  {
    gpukit::peer_access p(cuda0, cuda1);
    CHECK(p.active());
    CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 2);
    CHECK(cudaPeekAtLastError() == cudaSuccess);  // cudaErrorPeerAccessAlreadyEnabled does not linger
    gpukit::peer_access q(cuda0, cuda1);
    CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 2);
  }
  CHECK(cudasim::peer_access_enabled(0, 1));
  CHECK(cudasim::calls("cudaDeviceDisablePeerAccess") == 0);
  REQUIRE(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
  // Once the last hold is gone the next one enables it again, and owns it.
  {
    gpukit::peer_access p(cuda0, cuda1);
    CHECK(cudasim::peer_access_enabled(0, 1));
  }
  CHECK_FALSE(cudasim::peer_access_enabled(0, 1));
}

TEST_CASE("peer: a peer_access moves its hold, and reset drops it early") {
  gpukit::peer_access a(cuda0, cuda1);
  gpukit::peer_access b(std::move(a));
  CHECK_FALSE(a.active());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK(b.active());
  gpukit::peer_access c;
  CHECK_FALSE(c.active());
  c = std::move(b);
  CHECK(c.active());
  CHECK(cudasim::peer_access_enabled(0, 1));
  gpukit::peer_access other(cuda1, cuda0);
  c = std::move(other);  // drops cuda:0 -> cuda:1 (its only hold), takes cuda:1 -> cuda:0
  CHECK_FALSE(cudasim::peer_access_enabled(0, 1));
  CHECK(cudasim::peer_access_enabled(1, 0));
  CHECK(c.from() == cuda1);
  c.reset();
  CHECK_FALSE(c.active());
  CHECK_FALSE(cudasim::peer_access_enabled(1, 0));
  CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 2);
  CHECK(cudasim::calls("cudaDeviceDisablePeerAccess") == 2);
}

TEST_CASE("peer: threads taking and dropping the same pair concurrently") {
  constexpr int threads = 8;
  constexpr int rounds = 200;
  std::atomic<int> holds_without_access{0};
  auto churn = [&] {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([t, &holds_without_access] {
        for (int i = 0; i < rounds; ++i) {
          gpukit::peer_access p(cuda0, cuda1);
          if ((i + t) % 3 == 0) gpukit::peer_access nested(cuda0, cuda1);
          if (!cudasim::peer_access_enabled(0, 1)) ++holds_without_access;
        }
      });
    }
    for (auto& th : pool) th.join();
  };
  const std::size_t enables = cudasim::calls("cudaDeviceEnablePeerAccess");
  const std::size_t disables = cudasim::calls("cudaDeviceDisablePeerAccess");
  {
    gpukit::peer_access held(cuda0, cuda1);  // while one hold lasts, the others only count
    churn();
    CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == enables + 1);
    CHECK(cudasim::calls("cudaDeviceDisablePeerAccess") == disables);
  }
  CHECK_FALSE(cudasim::peer_access_enabled(0, 1));
  churn();
  CHECK_FALSE(cudasim::peer_access_enabled(0, 1));
  CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") - enables ==
        cudasim::calls("cudaDeviceDisablePeerAccess") - disables);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  CHECK(holds_without_access == 0);
}

TEST_CASE("peer: a hold released after the runtime unloaded does nothing and reports nothing") {
  for (const cudaError_t result : {cudaErrorCudartUnloading, cudaErrorContextIsDestroyed}) {
    CAPTURE(cudaGetErrorName(result));
    gpukit_test::captured_warnings warnings;
    auto p = std::make_unique<gpukit::peer_access>(cuda0, cuda1);
    cudasim::unload(result);  // as at process exit
    p.reset();
    cudasim::clear_faults();
    CHECK(warnings.messages().empty());
    for (const auto& m : warnings.messages()) MESSAGE(m);
    CHECK(cudasim::peer_access_enabled(0, 1));  // the call had no effect, as on a runtime that is gone
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
  }
}

TEST_CASE("peer: a failure to disable is a warning naming the pair") {
  gpukit_test::captured_warnings warnings;
  {
    gpukit::peer_access p(cuda0, cuda1);
    cudasim::fail_call("cudaDeviceDisablePeerAccess", 1, cudaErrorUnknown);
  }
  const auto messages = warnings.messages();
  REQUIRE(messages.size() == 1);
  CHECK(messages[0].find("cudaDeviceDisablePeerAccess(cuda:0 -> cuda:1)") != std::string::npos);
  CHECK(messages[0].find("cudaErrorUnknown") != std::string::npos);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

TEST_CASE("peer: the CPU is never a peer, and a device with itself is a no-op") {
  CHECK_FALSE(gpukit::can_access_peer(gpukit::device::cpu(), cuda0));
  CHECK_FALSE(gpukit::can_access_peer(cuda0, gpukit::device::cpu()));
  CHECK_FALSE(gpukit::can_access_peer(cuda1, cuda1));
  CHECK_THROWS_AS(gpukit::peer_access(gpukit::device::cpu(), cuda0), gpukit::invalid_argument_error);
  CHECK(exception_text([] { gpukit::peer_access p(cuda1, gpukit::device::cpu()); }).find("cuda:1 -> cpu") !=
        std::string::npos);
  gpukit::peer_access self(cuda1, cuda1);
  CHECK_FALSE(self.active());
  CHECK(cudasim::calls("cudaDeviceCanAccessPeer") == 0);
  CHECK(cudasim::calls("cudaDeviceEnablePeerAccess") == 0);
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 0);
}

TEST_CASE("peer: an ordinal that is not visible is an invalid_argument_error naming both devices") {
  const gpukit::device cuda7 = gpukit::device::cuda(7);
  CHECK_THROWS_AS(gpukit::can_access_peer(cuda0, cuda7), gpukit::invalid_argument_error);
  CHECK(exception_text([&] { (void)gpukit::can_access_peer(cuda0, cuda7); }).find("cuda:0 -> cuda:7") !=
        std::string::npos);
  CHECK(exception_text([&] { gpukit::peer_access p(cuda0, cuda7); }).find("cuda:0 -> cuda:7") != std::string::npos);
  CHECK_THROWS_AS(gpukit::peer_access(cuda7, cuda0), gpukit::invalid_argument_error);
  CHECK(exception_text([&] { gpukit::peer_access p(cuda7, cuda0); }).find("cuda:7 -> cuda:0") != std::string::npos);
  CHECK(exception_text([&] { gpukit::peer_access p(cuda7, cuda7); }).find("cuda:7 is not visible (2 CUDA devices)") !=
        std::string::npos);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  CHECK(cudasim::context_creations(0) == 0);  // refused before any context was made
  CHECK(cudasim::context_creations(1) == 0);
}

TEST_CASE("peer: the matrix names each link from NVML where NVML knows the devices") {
  // The fake NVML's cudasim machine: the simulator's two devices under one PCIe host bridge, no NVLink.
  gpukit_test::scoped_env machine("FAKE_NVML_MACHINE", std::string("cudasim"));
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const gpukit::peer_matrix m = gpukit::query_peer_matrix(nvml);
  CHECK(m.links == std::vector<std::vector<std::string>>{{"X", "PHB"}, {"PHB", "X"}});
  CHECK(m.to_string().rfind("        cuda:0  cuda:1\n"
                            "cuda:0  X       OK PHB\n"
                            "cuda:1  OK PHB  X\n",
                            0) == 0);
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 0);
}

TEST_CASE("peer: links are printed beside the access when filled in") {
  gpukit::peer_matrix m = gpukit::query_peer_matrix();
  m.links = {{"", "NV18"}, {"NV18", ""}};
  CHECK(m.to_string().rfind("         cuda:0   cuda:1\n"
                            "cuda:0   X        OK NV18\n"
                            "cuda:1   OK NV18  X\n",
                            0) == 0);
  CHECK(gpukit::peer_matrix{}.to_string() == "no CUDA devices\n");
}

TEST_CASE("peer: copy_peer_async copies between devices with or without peer access, and checks its arguments") {
  cudasim::allow_contexts_only_on({0, 1});
  std::vector<int> host(1000);
  std::iota(host.begin(), host.end(), 1);
  gpukit::stream s0(cuda0);
  gpukit::stream s1(cuda1);
  gpukit::device_buffer<int> a(host.size(), s0);
  gpukit::device_buffer<int> b(host.size(), s1);
  gpukit::copy_async(a, host, s0);
  s0.synchronize();
  gpukit::copy_peer_async(b.data(), cuda1, a.data(), cuda0, host.size() * sizeof(int), s1);  // no peer access
  CHECK(gpukit::to_host(b, s1) == host);
  {
    gpukit::peer_access p(cuda1, cuda0);
    std::vector<int> zeros(host.size(), 0);
    gpukit::copy_async(b, zeros, s1);
    s1.synchronize();  // the peer copy below runs on s0, unordered with s1
    gpukit::copy_peer_async(b.data(), cuda1, a.data(), cuda0, host.size() * sizeof(int), s0);  // a stream of the source
    s0.synchronize();
    CHECK(gpukit::to_host(b, s1) == host);
  }
  gpukit::copy_peer_async(nullptr, cuda1, nullptr, cuda0, 0, s1);  // zero bytes: nothing
  CHECK_THROWS_AS(gpukit::copy_peer_async(nullptr, cuda1, a.data(), cuda0, 4, s1), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::copy_peer_async(b.data(), gpukit::device::cpu(), a.data(), cuda0, 4, s1),
                  gpukit::invalid_argument_error);
  // The devices named must be the pointers' devices: the runtime refuses (and cudasim records the violation).
  const std::string text = exception_text([&] { gpukit::copy_peer_async(b.data(), cuda0, a.data(), cuda1, 4, s1); });
  CHECK(text.find("cudaMemcpyPeerAsync(4 bytes, cuda:1 -> cuda:0)") != std::string::npos);
  const auto taken = cudasim::take_violations();
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].call == "cudaMemcpyPeerAsync");
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  CHECK(cudasim::calls("cudaMemcpyPeerAsync") == 3);
}

TEST_CASE("peer: access covers gpukit's virtual-memory pages and the default pool, mapped before or after it") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  gpukit::allocator_options expandable;
  expandable.expandable_segments = true;
  gpukit::stream s(cuda0);
  gpukit::caching_allocator paged(cuda0, expandable);
  gpukit::caching_allocator plain(cuda0);  // cudaMalloc segments: peer access covers them
  gpukit::async_allocator pooled(cuda0);   // the default pool: it does not
  void* before = paged.allocate(4 * MiB, s);
  void* malloced = plain.allocate(4096, s);
  void* from_pool = pooled.allocate(4096, s);
  const std::vector<const void*> early{before, static_cast<const char*>(before) + 2 * MiB, malloced, from_pool};
  for (const void* p : early) {
    CHECK(cudasim::accessible_from(0, p));
    CHECK_FALSE(cudasim::accessible_from(1, p));
  }
  void* after = nullptr;
  {
    gpukit::peer_access access(cuda1, cuda0);
    for (const void* p : early) CHECK(cudasim::accessible_from(1, p));
    after = paged.allocate(8 * MiB, s);  // pages mapped while the access is held get it too
    CHECK(cudasim::accessible_from(1, after));
    CHECK(cudasim::accessible_from(1, static_cast<const char*>(after) + 6 * MiB));
    { gpukit::peer_access again(cuda1, cuda0); }  // a second hold changes nothing when it goes
    CHECK(cudasim::accessible_from(1, after));
  }
  for (const void* p : {static_cast<const void*>(before), static_cast<const void*>(after),
                        static_cast<const void*>(malloced), static_cast<const void*>(from_pool)}) {
    CHECK_FALSE(cudasim::accessible_from(1, p));  // the last hold took it all back
    CHECK(cudasim::accessible_from(0, p));        // the device's own access stays
  }
  paged.deallocate(before);
  paged.deallocate(after);
  plain.deallocate(malloced);
  pooled.deallocate(from_pool);
  s.synchronize();
  paged.empty_cache();  // unmapped pages leave gpukit's record: a later grant does not touch them
  gpukit::peer_access access(cuda1, cuda0);
  CHECK(cudasim::peer_access_enabled(1, 0));
}

TEST_CASE("peer: a hold taken or dropped while pages are being mapped is applied to those pages too") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  gpukit::allocator_options expandable;
  expandable.expandable_segments = true;
  gpukit::stream s(cuda0);
  gpukit::caching_allocator paged(cuda0, expandable);
  std::optional<gpukit::peer_access> hold;
  // Taken after map() read the holders, before its first page is mapped (as another thread could): the pages it
  // maps with the old holders' access are granted when they are recorded.
  cudasim::before_call("cuMemMap", 1, [&] { hold.emplace(cuda1, cuda0); });
  void* granted = paged.allocate(4 * MiB, s);
  REQUIRE(hold.has_value());
  CHECK(cudasim::accessible_from(1, granted));
  CHECK(cudasim::accessible_from(1, static_cast<const char*>(granted) + 2 * MiB));
  // Dropped the same way: the pages mapped with peer 1's access lose it when they are recorded.
  cudasim::before_call("cuMemMap", 1, [&] { hold.reset(); });
  void* revoked = paged.allocate(16 * MiB, s);
  CHECK_FALSE(hold.has_value());
  CHECK_FALSE(cudasim::accessible_from(1, revoked));
  CHECK_FALSE(cudasim::accessible_from(1, static_cast<const char*>(revoked) + 14 * MiB));
  CHECK_FALSE(cudasim::accessible_from(1, granted));  // the release took back what was recorded before
  for (const void* p : {static_cast<const void*>(granted), static_cast<const void*>(revoked)}) {
    CHECK(cudasim::accessible_from(0, p));
  }
  paged.deallocate(granted);
  paged.deallocate(revoked);
  s.synchronize();
  paged.empty_cache();
}

TEST_CASE("peer: a failure to grant the pool's memory is a warning naming the call, and peer access stands") {
  gpukit::stream s(cuda0);
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cudaMemPoolSetAccess", 1, cudaErrorInvalidValue);
  {
    gpukit::peer_access access(cuda1, cuda0);
    CHECK(cudasim::peer_access_enabled(1, 0));  // cudaMalloc memory is reachable
    CHECK(warnings.contains("cudaMemPoolSetAccess failed"));
    CHECK(warnings.contains("cuda:1 -> cuda:0"));
    gpukit::async_allocator pooled(cuda0);
    void* p = pooled.allocate(4096, s);
    CHECK_FALSE(cudasim::accessible_from(1, p));  // the pool was not granted
    pooled.deallocate(p);
    s.synchronize();
  }
  const std::size_t set_access = cudasim::calls("cudaMemPoolSetAccess");
  CHECK(set_access == 1);  // the failed grant only: nothing gpukit did not grant is taken back
  CHECK_FALSE(cudasim::peer_access_enabled(1, 0));
}

TEST_CASE("peer: warnings about the grants are raised outside the process-wide peer registry's lock") {
  // A warning handler may free memory or take a peer_access itself, which take that lock.
  gpukit_test::lock_at_warnings registry(gpukit::mode_independent::peer_access_holders_v2().mutex);
  cudasim::fail_call("cudaMemPoolSetAccess", 1, cudaErrorInvalidValue);  // the grant
  { gpukit::peer_access refused(cuda1, cuda0); }
  cudasim::fail_call("cudaMemPoolSetAccess", 2, cudaErrorInvalidValue);  // the grant succeeds, the take-back fails
  { gpukit::peer_access taken_back(cuda1, cuda0); }
  CHECK(registry.free_at_each() == std::vector<bool>{true, true});
}

TEST_CASE("peer: a device without memory pools is skipped, its refusal not left as the thread's last error") {
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cudaDeviceGetDefaultMemPool", 1, cudaErrorNotSupported);
  {
    gpukit::peer_access access(cuda1, cuda0);
    CHECK(cudasim::peer_access_enabled(1, 0));
    CHECK(cudaGetLastError() == cudaSuccess);  // a user's next error check must not see gpukit's probe
    CHECK(warnings.messages().empty());
  }
  CHECK(cudasim::calls("cudaMemPoolSetAccess") == 0);
  CHECK_FALSE(cudasim::peer_access_enabled(1, 0));
}

TEST_CASE("peer: pool access granted outside gpukit is left as it is when the last hold goes") {
  gpukit::stream s(cuda0);
  cudaMemPool_t pool = nullptr;
  REQUIRE(cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess);
  cudaMemAccessDesc access{};
  access.location.type = cudaMemLocationTypeDevice;
  access.location.id = 1;
  access.flags = cudaMemAccessFlagsProtReadWrite;
  REQUIRE(cudaMemPoolSetAccess(pool, &access, 1) == cudaSuccess);  // another library's grant
  gpukit::async_allocator pooled(cuda0);
  void* p = pooled.allocate(4096, s);
  { gpukit::peer_access hold(cuda1, cuda0); }
  CHECK(cudasim::accessible_from(1, p));  // still granted: gpukit did not grant it, so it did not take it back
  pooled.deallocate(p);
  s.synchronize();
}

TEST_CASE(
    "peer: a copy across devices on the current streams is refused while either is captured, and leaves it valid") {
  cudasim::allow_contexts_only_on({0, 1});
  std::vector<int> host(256);
  std::iota(host.begin(), host.end(), 1);
  gpukit::stream s0(cuda0);
  gpukit::stream s1(cuda1);
  gpukit::device_buffer<int> a(host.size(), s0);
  gpukit::device_buffer<int> b(host.size(), s1);
  gpukit::copy_async(a, host, s0);
  s0.synchronize();
  const gpukit::stream_guard current0(s0);
  const gpukit::stream_guard current1(s1);
  const std::size_t copies = cudasim::calls("cudaMemcpyAsync");
  for (gpukit::stream* captured : {&s0, &s1}) {
    const gpukit::device_guard on(captured->device());
    REQUIRE(cudaStreamBeginCapture(captured->cuda_handle(), cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    const std::string text = exception_text([&] { gpukit::copy_async(b, a); });
    CHECK(text.find("across devices") != std::string::npos);
    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamEndCapture(captured->cuda_handle(), &graph) == cudaSuccess);  // not invalidated
    if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  }
  CHECK(cudasim::calls("cudaMemcpyAsync") == copies);  // nothing was enqueued
  gpukit::copy_async(b, a);                            // outside a capture: copied, ordered on both current streams
  CHECK(gpukit::to_host(b, s1) == host);
}

TEST_CASE("peer: a copy across devices on the current streams that its checks refuse enqueues nothing") {
  // The checks run before the two events that order the current streams: a refused copy leaves neither stream
  // waiting for the other.
  cudasim::allow_contexts_only_on({0, 1});
  gpukit::stream s0(cuda0);
  gpukit::stream s1(cuda1);
  gpukit::device_buffer<int> a(256, s0);
  const gpukit::stream_guard current0(s0);
  const gpukit::stream_guard current1(s1);
  const std::size_t records = cudasim::calls("cudaEventRecord");
  const std::size_t waits = cudasim::calls("cudaStreamWaitEvent");
  const std::string text =
      exception_text([&] { gpukit::copy_async(gpukit::device_span<int>(nullptr, 256, cuda1), a); });
  CHECK(text.find("is a null pointer") != std::string::npos);
  CHECK(cudasim::calls("cudaEventRecord") == records);
  CHECK(cudasim::calls("cudaStreamWaitEvent") == waits);
}

TEST_CASE(
    "peer: copy_peer_async on the legacy stream is refused during another thread's capture, errors name its device") {
  cudasim::allow_contexts_only_on({0, 1});
  const gpukit::stream_view legacy = gpukit::stream_view::default_stream(cuda0);
  gpukit::stream_options o;
  o.non_blocking = false;
  gpukit::stream blocking(cuda0, o);
  gpukit::stream s0(cuda0);
  gpukit::stream s1(cuda1);
  gpukit::device_buffer<int> a(1024, s0);
  gpukit::device_buffer<int> b(1024, s1);
  s1.synchronize();
  const std::size_t bytes = a.size() * sizeof(int);
  const gpukit_test::call_in_capture seen = gpukit_test::call_during_capture(
      blocking, [&] { gpukit::copy_peer_async(b.data(), cuda1, a.data(), cuda0, bytes, legacy); });
  CHECK(seen.returned);
  INFO("refusal: " << seen.refusal);
  INFO("capture error: " << seen.capture_error);
  CHECK(seen.capture_error.empty());  // the capture stays valid
  CHECK(seen.refusal.find("copy_peer_async") != std::string::npos);
  CHECK(cudasim::take_violations().empty());
  // Outside a capture it is enqueued on the legacy stream.
  gpukit::copy_peer_async(b.data(), cuda1, a.data(), cuda0, bytes, legacy);
  legacy.synchronize();
  // The call runs on the stream's device (cuda:0 here), which a failure names.
  cudasim::fail_call("cudaMemcpyPeerAsync", 1, cudaErrorInvalidValue);
  const std::string text =
      exception_text([&] { gpukit::copy_peer_async(b.data(), cuda1, a.data(), cuda0, bytes, s0); });
  INFO(text);
  CHECK(text.find("failed on cuda:0") != std::string::npos);
  CHECK(text.find("cuda:1:") == std::string::npos);
  cudasim::drain_all();
}

TEST_CASE(
    "peer: a cross-device copy on the legacy streams is not refused after it ran when a capture begins meanwhile") {
  // Another thread begins a gpukit capture of a blocking cuda:1 stream between the copy and its last event wait on
  // cuda:1's legacy stream. The capture must wait for the whole sequence, not refuse its last step.
  cudasim::allow_contexts_only_on({0, 1});
  gpukit::device_buffer<int> src(1024, gpukit::stream_view::default_stream(cuda0));
  gpukit::device_buffer<int> dst(1024, gpukit::stream_view::default_stream(cuda1));
  gpukit::copy_async(src, std::vector<int>(1024, 1));
  gpukit::copy_async(dst, std::vector<int>(1024, 0));
  gpukit::stream_options o;
  o.non_blocking = false;
  gpukit::stream blocking1(cuda1, o);
  std::mutex m;
  std::condition_variable cv;
  bool started = false;
  bool finish = false;
  std::string capture_error;
  std::thread capturer;
  cudasim::before_call("cudaEventRecord", 2, [&] {  // the record after the copy
    capturer = std::thread([&] {
      try {
        gpukit::graph g = gpukit::capture(blocking1, [&] {
          std::unique_lock<std::mutex> lock(m);
          started = true;
          cv.notify_all();
          cv.wait_for(lock, std::chrono::seconds(20), [&] { return finish; });
        });
      } catch (const std::exception& e) {
        capture_error = e.what();
      }
    });
    // Bounded: with the holds kept, the capture waits for this copy_async to return.
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::seconds(2), [&] { return started; });
  });
  std::string refusal;
  try {
    gpukit::copy_async(dst, src);  // the current streams: the legacy streams of cuda:1 and cuda:0
  } catch (const gpukit::invalid_argument_error& e) {
    refusal = e.what();
  }
  {
    std::lock_guard<std::mutex> lock(m);
    finish = true;
  }
  cv.notify_all();
  if (capturer.joinable()) capturer.join();
  cudasim::clear_faults();
  cudasim::drain_all();
  INFO("refusal: " << refusal);
  INFO("capture error: " << capture_error);
  CHECK(refusal.empty());
  CHECK(capture_error.empty());
  CHECK(gpukit::to_host(dst, gpukit::stream_view::default_stream(cuda1)) == std::vector<int>(1024, 1));
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("peer: a temporary device buffer copied across devices on the current streams is not freed under the copy") {
  // The temporary frees on its own stream `a`, not on the copy's (cuda:0's legacy stream, held here).
  cudasim::allow_contexts_only_on({0, 1});
  gpukit::stream a(cuda0);
  cudasim::reuse_pool_addresses(true);
  const std::size_t n = 1 << 16;
  gpukit::device_buffer<int> dst(n, gpukit::stream_view::default_stream(cuda1));
  const auto filled = [&] {
    gpukit::device_buffer<int> d(n, a);
    gpukit::copy_async(d, std::vector<int>(n, 7), a);
    return d;
  };
  {
    gpukit_test::gate g;
    g.hold(gpukit::stream_view::default_stream(cuda0));
    gpukit::copy_async(dst, filled());
    a.synchronize();
    gpukit::device_buffer<int> other(n, a);  // may get the freed block
    gpukit::copy_async(other, std::vector<int>(n, 0), a);
    a.synchronize();
    g.open();
    cudasim::drain_all();
  }
  cudasim::reuse_pool_addresses(false);
  CHECK(gpukit::to_host(dst, gpukit::stream_view::default_stream(cuda1)) == std::vector<int>(n, 7));
  CHECK(cudasim::take_violations().empty());
}
