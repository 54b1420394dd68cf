// GPU tests of the foundation: run on a machine with a CUDA device, reported as Skipped elsewhere.
#include <gpukit/gpukit.hpp>

#include "support.hpp"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

TEST_CASE("gpu: properties are sane and cached") {
  GPUKIT_REQUIRE_GPU();
  for (gpukit::device d : gpukit::cuda_devices()) {
    const auto& p = gpukit::properties(d);
    CHECK(&p == &gpukit::properties(d));
    CHECK(p.device == d);
    CHECK_FALSE(p.name.empty());
    CHECK(p.uuid.size() == 40);
    CHECK(p.uuid.rfind("GPU-", 0) == 0);
    CHECK(p.pci_bus_id.size() == 12);
    CHECK(p.total_memory > (std::size_t{1} << 30));
    CHECK(p.compute_capability_major >= 5);
    CHECK(p.multiprocessor_count > 0);
    CHECK(p.copy_engine_count >= 1);
    CHECK(p.warp_size == 32);
    CHECK(p.clock_rate_khz > 0);
    CHECK(p.memory_clock_rate_khz > 0);
    const gpukit::priority_range priorities = gpukit::stream_priority_range(d);
    CHECK(priorities.greatest <= priorities.least);
    const auto info = gpukit::query_memory_info(d);
    CHECK(info.total_bytes == p.total_memory);
    CHECK(info.free_bytes <= info.total_bytes);
    std::printf("%s: %s, %s, cc %s, %d SMs, %s\n", d.to_string().c_str(), p.name.c_str(), p.uuid.c_str(),
                p.compute_capability().c_str(), p.multiprocessor_count,
                gpukit::detail::format_bytes(p.total_memory).c_str());
  }
}

TEST_CASE("gpu: the device guard restores the current device") {
  GPUKIT_REQUIRE_GPU();
  const int count = gpukit::device_count();
  gpukit::set_current_device(gpukit::device::cuda(0));
  {
    gpukit::device_guard guard(gpukit::device::cuda(count - 1));
    CHECK(gpukit::current_device() == gpukit::device::cuda(count - 1));
  }
  CHECK(gpukit::current_device() == gpukit::device::cuda(0));
  try {
    gpukit::set_current_device(gpukit::device::cuda(count));
    FAIL("an invalid ordinal was accepted");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("cudaSetDevice(" + std::to_string(count) + ") failed on cuda:" +
                                     std::to_string(count) + ": invalid device ordinal (cudaErrorInvalidDevice)") == 0);
  }
  CHECK(gpukit::current_device() == gpukit::device::cuda(0));
}

TEST_CASE("gpu: streams run host functions in order, and query/synchronize work") {
  GPUKIT_REQUIRE_GPU();
  gpukit::stream s(gpukit::device::cuda(0));
  CHECK(s.priority() <= 0);
  std::vector<int> order;
  std::atomic<bool> release{false};
  s.enqueue_host([&] {
    while (!release.load()) std::this_thread::yield();
  });
  for (int i = 0; i < 50; ++i) s.enqueue_host([&order, i] { order.push_back(i); });
  CHECK_FALSE(s.ready());
  release = true;
  s.synchronize();
  CHECK(s.ready());
  REQUIRE(order.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  gpukit::stream high(gpukit::device::cuda(0), {true, -1000});
  CHECK(high.priority() == gpukit::stream_priority_range(gpukit::device::cuda(0)).greatest);
}

TEST_CASE("gpu: events order streams and time work") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream a(d);
  gpukit::stream b(d);
  gpukit::event start(d, {true, false, false});
  gpukit::event end(d, {true, false, false});
  std::atomic<int> value{0};
  std::atomic<int> seen{-1};
  start.record(a);
  a.enqueue_host([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    value = 1;
  });
  end.record(a);
  end.wait(b);
  b.enqueue_host([&] { seen = value.load(); });
  b.synchronize();
  CHECK(seen.load() == 1);
  const auto ms = gpukit::elapsed_time(start, end);
  CHECK(ms.count() >= 19.0f);
  gpukit::stream_timer timer(a);
  CHECK(timer.elapsed().count() >= 0.0f);
}

TEST_CASE("gpu: an event from another device is rejected") {
  GPUKIT_REQUIRE_GPU();
  gpukit::event e(gpukit::device::cuda(0));
  gpukit::stream cpu_stream(gpukit::device::cpu());
  CHECK_THROWS_AS(e.record(cpu_stream), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(e.wait(cpu_stream), gpukit::invalid_argument_error);
  if (gpukit::device_count() > 1) {
    gpukit::stream other(gpukit::device::cuda(1));
    CHECK_THROWS_AS(e.record(other), gpukit::invalid_argument_error);
  }
}

TEST_CASE("gpu: an interprocess event gives a handle, and other events refuse it, saying why") {
  GPUKIT_REQUIRE_GPU();
  gpukit::event_options shared;
  shared.interprocess = true;
  gpukit::event e(gpukit::device::cuda(0), shared);
  gpukit::stream s(gpukit::device::cuda(0));
  e.record(s);
  (void)e.ipc_handle();  // cudaIpcGetEventHandle
  s.synchronize();
  CHECK(e.ready());
  gpukit::event plain(gpukit::device::cuda(0));
  CHECK_THROWS_WITH_AS(plain.ipc_handle(), doctest::Contains("interprocess = true"), gpukit::invalid_argument_error);
  shared.timing = true;  // CUDA refuses timing on interprocess events
  CHECK_THROWS_AS(gpukit::event(gpukit::device::cuda(0), shared), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::event(gpukit::device::cpu(), gpukit::event_options{false, false, true}),
                  gpukit::invalid_argument_error);
}

TEST_CASE("gpu: the pool round-robins CUDA streams and a raw handle knows its device") {
  GPUKIT_REQUIRE_GPU();
  gpukit::stream_pool pool(gpukit::device::cuda(0), 3);
  const auto s0 = pool.next();
  const auto s1 = pool.next();
  (void)pool.next();
  CHECK(pool.next() == s0);
  CHECK(s0 != s1);
  const gpukit::stream_view raw(s1.cuda_handle());
  CHECK(raw.device() == gpukit::device::cuda(0));
  auto lease = pool.acquire_exclusive();
  CHECK(lease.view() != s0);
  gpukit::stream wrapped = gpukit::stream::wrap(s1.cuda_handle(), gpukit::device::cuda(0), false);
  CHECK(wrapped.view() == s1);
}

TEST_CASE("gpu: wrapping a stream as another device's is rejected, naming both devices") {
  GPUKIT_REQUIRE_GPU();
  if (gpukit::device_count() < 2) {
    std::printf("GPUKIT_TEST_NOT_APPLICABLE: needs two CUDA devices\n");
    return;
  }
  gpukit::stream s1(gpukit::device::cuda(1));
  for (bool take_ownership : {false, true}) {
    try {
      (void)gpukit::stream::wrap(s1.cuda_handle(), gpukit::device::cuda(0), take_ownership);
      FAIL("a stream of cuda:1 was wrapped as cuda:0");
    } catch (const gpukit::invalid_argument_error& e) {
      const std::string what = e.what();
      CHECK(what.find("cuda:0") != std::string::npos);
      CHECK(what.find("cuda:1") != std::string::npos);
    }
  }
  gpukit::stream wrapped = gpukit::stream::wrap(s1.cuda_handle(), gpukit::device::cuda(1), false);
  CHECK(wrapped.view() == s1.view());
  CHECK(wrapped.device() == gpukit::device::cuda(1));
}

TEST_CASE("gpu: auto-selection picks a GPU") {
  GPUKIT_REQUIRE_GPU();
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  gpukit::selection_policy policy;
  policy.require_gpu = true;
  policy.prefer = gpukit::device_preference::most_free_memory;
  const auto selection = gpukit::select_device(policy);
  CHECK(selection.device.is_cuda());
  std::printf("%s", selection.report().c_str());
}

TEST_CASE("gpu: polling a stream or an event that is not ready keeps the program's pending CUDA error") {
  GPUKIT_REQUIRE_GPU();
  const auto d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::event e(d);
  gpukit_test::gate g;
  g.hold(s);
  e.record(s);
  (void)cudaGetLastError();
  REQUIRE(cudaSetDevice(gpukit::device_count() + 98) == cudaErrorInvalidDevice);  // the program's own error
  CHECK_FALSE(s.ready());
  CHECK_FALSE(e.ready());
  CHECK_FALSE(s.view().ready());
  // cudaErrorNotReady is a status, not an error: polling must not clear (or replace) the pending error.
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  g.open();
  s.synchronize();
  CHECK(e.ready());
}
