// Which devices gpukit creates CUDA contexts on (a primary context costs hundreds of MB of device memory): a program
// that uses one device must leave every other device untouched, on every thread, and enumerating or selecting
// devices must create no context at all. Simulator-only: cudasim counts contexts per device and, with
// allow_contexts_only_on, records a context on any other device as a violation (which fails the test).
#include <gpukit/gpukit.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <algorithm>
#include <climits>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

std::vector<float> iota(std::size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 1.0f);
  return v;
}

/// Everything a program does with one device: streams, events, allocation, copies of every kind, pinned memory,
/// registration, stream pools, a prefetcher; then frees it all.
void use_only(gpukit::device d) {
  {
    gpukit::device_guard guard(d);
    CHECK(gpukit::current_device() == d);
  }
  gpukit::stream s(d);
  gpukit::stream t(d);
  gpukit::event done(d);
  const std::vector<float> host = iota(100000);
  {
    gpukit::device_buffer<float> x(host.size(), s);
    gpukit::copy_async(x, host, s);  // pageable -> device, staged through the pinned pool
    done.record(s);
    done.wait(t);
    std::vector<float> back(host.size());
    gpukit::copy_async(back, gpukit::device_span<const float>(x.data(), x.size(), d), t);  // device -> pageable
    t.synchronize();
    done.synchronize();
    CHECK(done.ready());
    CHECK(back == host);

    gpukit::pinned_buffer<float> pinned(host.size(), d);
    std::copy(host.begin(), host.end(), pinned.begin());
    gpukit::device_buffer<float> y(host.size(), s);
    gpukit::copy_async(y, pinned, s);  // pinned -> device: one DMA
    gpukit::pinned_buffer<float> pinned_back(host.size(), d);
    gpukit::copy_async(pinned_back, y, s);  // device -> pinned
    s.synchronize();
    CHECK(std::equal(pinned_back.begin(), pinned_back.end(), host.begin()));

    gpukit::pinned_flags mapped_flags;
    mapped_flags.mapped = true;
    gpukit::pinned_buffer<float> mapped(16, d, mapped_flags);
    CHECK(mapped.device_pointer() != nullptr);

    auto z = gpukit::to_device(host, s);
    CHECK(gpukit::to_host(z) == host);

    std::vector<float> mine = iota(4096);
    {
      gpukit::host_registration registration(mine.data(), mine.size() * sizeof(float), d);
      CHECK(registration.registered());
      CHECK(gpukit::detail::query_pointer(mine.data()).kind == gpukit::detail::pointer_kind::pinned);
      gpukit::device_buffer<float> w(mine.size(), s);
      gpukit::copy_async(w, gpukit::host_span<const float>(mine), s);
      s.synchronize();
    }
    CHECK(gpukit::detail::query_pointer(x.data()).device == d.ordinal());

    gpukit::stream_pool& pool = gpukit::default_stream_pool(d);
    gpukit::stream_view shared = pool.next();
    shared.synchronize();
    {
      auto lease = pool.acquire_exclusive();
      lease.view().synchronize();
    }
    gpukit::default_stream_pool(d, gpukit::stream_priority::high).next().synchronize();

    std::size_t batches = 0;
    {
      gpukit::prefetcher<float> loader(s, 1000, [](std::size_t i, gpukit::span<float> out) -> std::size_t {
        if (i == 3) return 0;
        std::fill(out.begin(), out.end(), static_cast<float>(i));
        return out.size();
      });
      while (auto batch = loader.next()) ++batches;
      s.synchronize();
    }
    CHECK(batches == 3);
    s.synchronize();
    t.synchronize();
  }
  gpukit::empty_cache(d);
  gpukit::default_pinned_pool(d).empty_cache();
}

}  // namespace

TEST_CASE("contexts: a program that uses only cuda:1 creates no context on cuda:0") {
  cudasim::allow_contexts_only_on({1});
  gpukit_test::scoped_env select("GPUKIT_DEVICE", std::string("cuda:1"));
  const gpukit::device d = gpukit::select_device().device;
  REQUIRE(d == gpukit::device::cuda(1));
  use_only(d);
  std::thread([d] { use_only(d); }).join();  // and another thread of the program, whose current device is 0
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 1);
}

TEST_CASE("contexts: a thread that uses only cuda:1, in a process without contexts, creates none on cuda:0") {
  cudasim::allow_contexts_only_on({1});
  std::thread([] { use_only(gpukit::device::cuda(1)); }).join();
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 1);
}

TEST_CASE("contexts: a device guard on a thread that never chose a device does not restore onto cuda:0") {
  cudasim::allow_contexts_only_on({1});
  {
    gpukit::device_guard guard(gpukit::device::cuda(1));
    CHECK(gpukit::current_device() == gpukit::device::cuda(1));
  }
  CHECK(cudasim::context_creations(0) == 0);
  // The thread had no context to go back to: it stays on cuda:1 (cudaSetDevice(0) would create cuda:0's context).
  CHECK(gpukit::current_device() == gpukit::device::cuda(1));
}

TEST_CASE("contexts: a device guard on a thread that never chose a device restores cuda:0 when its context exists") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);  // cuda:0's primary context is active
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  std::thread([] {
    {
      gpukit::device_guard guard(gpukit::device::cuda(1));
      CHECK(gpukit::current_device() == gpukit::device::cuda(1));
    }
    // Going back to cudaGetDevice's 0 creates nothing, and leaves the thread as it found it.
    CHECK(gpukit::current_device() == gpukit::device::cuda(0));
    {
      gpukit::device_guard guard(gpukit::device::cuda(0));  // no context current, cudaGetDevice says 0 already
      CHECK(gpukit::current_device() == gpukit::device::cuda(0));
    }
  }).join();
  CHECK(cudasim::context_creations(0) == 1);
  CHECK(cudasim::context_creations(1) == 1);
}

TEST_CASE("contexts: a CUDA that fails to initialise is no_device_error for current_device, guards and properties") {
  // On such a machine every call fails so (803: a driver upgraded without a reboot); device_count() says 0.
  for (const cudaError_t failure : {cudaErrorSystemDriverMismatch, cudaErrorInitializationError,
                                    cudaErrorCompatNotSupportedOnDevice, cudaErrorSystemNotReady}) {
    CAPTURE(failure);
    cudasim::fail_call("cudaGetDevice", 1, failure);
    CHECK_THROWS_AS((void)gpukit::current_device(), gpukit::no_device_error);
    cudasim::fail_call("cudaGetDevice", 1, failure);
    CHECK_THROWS_AS((void)gpukit::device_guard(gpukit::device::cuda(1)), gpukit::no_device_error);
    cudasim::fail_call("cudaGetDeviceProperties", 1, failure);
    CHECK_THROWS_AS((void)gpukit::properties(gpukit::device::cuda(0)), gpukit::no_device_error);
    cudasim::fail_call("cudaDeviceGetStreamPriorityRange", 1, failure);
    CHECK_THROWS_AS((void)gpukit::stream_priority_range(gpukit::device::cuda(1)), gpukit::no_device_error);
    cudasim::clear_faults();
    CHECK(cudaPeekAtLastError() == cudaSuccess);
  }
}

namespace {
/// Runs `f` as the first CUDA work of a new thread (whose current device is 0, without a context), while cuda:1 is
/// the only device with a context; then checks that none was created on cuda:0.
template <class F>
void on_fresh_thread_while_cuda1_is_used(F f) {
  cudasim::allow_contexts_only_on({1});
  const auto d = gpukit::device::cuda(1);
  gpukit::stream s(d);
  gpukit::device_buffer<float> x(1000, s);
  std::thread([&] { f(d, x.data()); }).join();
  CHECK(cudasim::context_creations(0) == 0);
}
}  // namespace

TEST_CASE("contexts: a pinned buffer made on a fresh thread is pinned in a context that exists") {
  on_fresh_thread_while_cuda1_is_used([](gpukit::device d, float*) {
    gpukit::pinned_buffer<float> p(1000, d);
    CHECK(p.page_locked());
  });
}

TEST_CASE("contexts: a mapped pinned buffer made on a fresh thread, and its device pointer") {
  on_fresh_thread_while_cuda1_is_used([](gpukit::device d, float*) {
    gpukit::pinned_flags flags;
    flags.mapped = true;
    gpukit::pinned_buffer<float> p(1000, d, flags);
    CHECK(p.device_pointer() == p.data());  // unified addressing: mapped at its host address
  });
}

TEST_CASE("contexts: a host registration made on a fresh thread") {
  on_fresh_thread_while_cuda1_is_used([](gpukit::device d, float*) {
    std::vector<float> mine(4096);
    gpukit::host_registration r(mine.data(), mine.size() * sizeof(float), d);
    CHECK(r.registered());
  });
}

TEST_CASE("contexts: a portable host registration for a device that does not exist is refused") {
  // Portable memory is registered in whatever context is current: CUDA would not see the bad ordinal.
  gpukit::stream s(gpukit::device::cuda(0));  // a context is current on this thread
  std::vector<float> mine(4096);
  gpukit::registration_flags portable;
  portable.portable = true;
  CHECK_THROWS_WITH_AS(
      gpukit::host_registration(mine.data(), mine.size() * sizeof(float), gpukit::device::cuda(7), portable),
      doctest::Contains("gpukit::host_registration: cuda:7 is not visible ("), gpukit::invalid_argument_error);
}

TEST_CASE("contexts: a pinned_buffer for a device that does not exist is refused, portable or not") {
  // Portable memory is allocated in whatever context is current: CUDA would not see the bad ordinal, and the buffer
  // would fail only later (device_pointer(), a copy for that device).
  gpukit::stream s(gpukit::device::cuda(0));  // a context is current on this thread
  const std::size_t allocations = cudasim::calls("cudaHostAlloc");
  for (const bool portable : {true, false}) {
    gpukit::pinned_flags flags;
    flags.portable = portable;
    CHECK_THROWS_WITH_AS(gpukit::pinned_buffer<float>(1000, gpukit::device::cuda(7), flags),
                         "gpukit::pinned_buffer: cuda:7 is not visible (2 CUDA devices)",
                         gpukit::invalid_argument_error);
  }
  CHECK(cudasim::calls("cudaHostAlloc") == allocations);                    // nothing pinned
  CHECK(gpukit::pinned_buffer<float>(0, gpukit::device::cuda(7)).empty());  // nothing to allocate: no check
}

TEST_CASE("contexts: the default allocator of a device that does not exist is refused, whatever its ordinal") {
  // Its statistics would read 0 and its limits apply nowhere; an ordinal past the fast slots (up to INT_MAX, which
  // device::cuda accepts) is looked up without overflow.
  for (const int ordinal : {7, 64, 65, INT_MAX}) {
    const gpukit::device d = gpukit::device::cuda(ordinal);
    CAPTURE(ordinal);
    CHECK_THROWS_WITH_AS((void)gpukit::default_allocator(d),
                         ("gpukit::default_allocator: " + d.to_string() + " is not visible (2 CUDA devices)").c_str(),
                         gpukit::invalid_argument_error);
    CHECK_THROWS_AS((void)gpukit::memory_allocated(d), gpukit::invalid_argument_error);
    CHECK_THROWS_AS(gpukit::set_reserved_memory_limit(std::size_t{1} << 30, d), gpukit::invalid_argument_error);
    CHECK_THROWS_AS(gpukit::empty_cache(d), gpukit::invalid_argument_error);
    CHECK(!gpukit::set_default_allocator(d, nullptr));  // nothing to replace, nothing published
  }
  CHECK(gpukit::memory_allocated(gpukit::device::cuda(1)) == 0);  // a visible one is served
}

TEST_CASE("contexts: a pointer query on a fresh thread") {
  on_fresh_thread_while_cuda1_is_used([](gpukit::device, float* x) {
    const auto info = gpukit::detail::query_pointer(x);
    CHECK(info.kind == gpukit::detail::pointer_kind::device);
    CHECK(info.device == 1);
    std::vector<float> pageable(16);
    CHECK(gpukit::detail::query_pointer(pageable.data()).kind == gpukit::detail::pointer_kind::pageable);
  });
}

TEST_CASE("contexts: the pinned pool's upstream on a fresh thread") {
  on_fresh_thread_while_cuda1_is_used([](gpukit::device d, float*) {
    gpukit::pooled_pinned_buffer<float> p(1000, d);
    CHECK(gpukit::default_pinned_pool(d).stats().upstream_allocations == 1);
  });
}

TEST_CASE("contexts: pinned memory made where a context exists is freed on a fresh thread in one that exists") {
  // cudaFreeHost and cudaHostUnregister run in the current context: on a thread that never chose a device the
  // runtime would create cuda:0's for them.
  std::vector<float> mine(4096);
  auto buffer = std::make_unique<gpukit::pinned_buffer<float>>(1000, gpukit::device::cuda(1));
  auto registration =
      std::make_unique<gpukit::host_registration>(mine.data(), mine.size() * sizeof(float), gpukit::device::cuda(1));
  on_fresh_thread_while_cuda1_is_used([&](gpukit::device d, float*) {
    buffer.reset();
    registration.reset();
    { gpukit::pooled_pinned_buffer<float> p(1000, d); }
    CHECK(gpukit::default_pinned_pool(d).empty_cache() > 0);
    CHECK(cudasim::calls("cudaFreeHost") >= 2);
  });
}

TEST_CASE("contexts: portable pinned memory for another device is pinned in the context in use") {
  // Portable page-locked memory serves every device, so naming cuda:1 must not create cuda:1's context when the
  // program works on cuda:0.
  cudasim::allow_contexts_only_on({0});
  gpukit::stream s(gpukit::device::cuda(0));
  const auto other = gpukit::device::cuda(1);
  std::vector<float> mine(4096);
  {
    gpukit::host_registration r(mine.data(), mine.size() * sizeof(float), other);
    CHECK(r.registered());
  }
  {
    gpukit::pinned_flags flags;
    flags.mapped = true;
    gpukit::pinned_buffer<float> mapped(1000, other, flags);
    CHECK(mapped.device_pointer() == mapped.data());
    gpukit::pinned_buffer<float> plain(1000, other);
    CHECK(plain.device_pointer() == plain.data());
  }
  CHECK(cudasim::context_creations(1) == 0);
  CHECK(gpukit::current_device() == gpukit::device::cuda(0));
}

TEST_CASE("contexts: a pointer query with no context anywhere creates none") {
  cudasim::allow_contexts_only_on({-1});
  REQUIRE(gpukit::device_count() == 2);
  std::vector<float> pageable(16);
  CHECK(gpukit::detail::query_pointer(pageable.data()).kind == gpukit::detail::pointer_kind::pageable);
  CHECK(cudasim::context_creations(0) == 0);
}

TEST_CASE("contexts: pinned memory as a program's first CUDA work goes to the device it names") {
  cudasim::allow_contexts_only_on({1});
  { gpukit::pinned_buffer<float> p(1000, gpukit::device::cuda(1)); }
  { gpukit::pooled_pinned_buffer<float> p(1000, gpukit::device::cuda(1)); }
  std::vector<float> mine(4096);
  { gpukit::host_registration r(mine.data(), mine.size() * sizeof(float), gpukit::device::cuda(1)); }
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 1);
}

TEST_CASE("contexts: the prefetcher's thread works on the consumer's device") {
  cudasim::allow_contexts_only_on({1});
  gpukit::stream s(gpukit::device::cuda(1));
  // Warm the pinned pool, so the worker's first CUDA call is a stream wait, not a (context-choosing) pinning.
  { gpukit::pooled_pinned_buffer<float> warm(1000, gpukit::device::cuda(1)); }
  std::size_t batches = 0;
  {
    gpukit::prefetcher<float> loader(
        s, 1000, [](std::size_t i, gpukit::span<float> out) -> std::size_t { return i < 4 ? out.size() : 0; });
    while (auto batch = loader.next()) ++batches;
    s.synchronize();
  }
  CHECK(batches == 4);
  CHECK(cudasim::context_creations(0) == 0);
}

TEST_CASE("contexts: enumerating devices, reading properties and selecting create no context") {
  cudasim::allow_contexts_only_on({-1});  // no device at all
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  for (gpukit::device d : gpukit::cuda_devices()) (void)gpukit::properties(d);
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  policy.min_compute_capability = 80;
  CHECK(gpukit::select_device(policy).device.is_cuda());
  CHECK(gpukit::select_device().device == gpukit::device::cuda(0));
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 0);
}

TEST_CASE("contexts: a context probe for free memory reads only the device the environment chose") {
  // Without NVML, allow_context_probe reads free memory with cudaMemGetInfo (a context each): when GPUKIT_DEVICE or
  // the local rank decides, only that device's figure matters.
  gpukit_test::scoped_env no_nvml("GPUKIT_NVML_LIBRARY", std::string("/nonexistent/libnvidia-ml.so.1"));
  gpukit::selection_policy policy;
  policy.min_free_bytes = std::size_t{1} << 20;
  policy.allow_context_probe = true;
  {
    gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
    gpukit_test::scoped_env rank("LOCAL_RANK", std::string("1"));
    cudasim::allow_contexts_only_on({1});
    const gpukit::device_selection s = gpukit::select_device(policy);
    CHECK(s.device == gpukit::device::cuda(1));
    CHECK(cudasim::context_creations(0) == 0);
    CHECK(cudasim::context_creations(1) == 1);
  }
  {
    gpukit_test::scoped_env override_device("GPUKIT_DEVICE", std::string("cuda:1"));
    gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
    CHECK(gpukit::select_device(policy).device == gpukit::device::cuda(1));
    CHECK(cudasim::context_creations(0) == 0);
  }
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  cudasim::allow_contexts_only_on({0, 1});
  const gpukit::device_selection s = gpukit::select_device(policy);  // the policy decides: every device is read
  CHECK(s.candidates.size() == 2);
  CHECK(cudasim::context_creations(0) == 1);
}

TEST_CASE("contexts: a device guard that switched nothing restores the device that code in its scope switched") {
  // As PyTorch's guards: the scope's device is the guard's at its end, whoever switched inside (a library, say).
  const gpukit::device cuda0 = gpukit::device::cuda(0);
  const gpukit::device cuda1 = gpukit::device::cuda(1);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);  // both primary contexts active
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  REQUIRE(cudaFree(nullptr) == cudaSuccess);
  {
    gpukit::device_guard outer(cuda1);  // switches
    {
      gpukit::device_guard inner(cuda1);  // cuda:1 is current already: switches nothing
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
    }
    CHECK(gpukit::current_device() == cuda1);
  }
  CHECK(gpukit::current_device() == cuda0);
  gpukit::stream s(cuda0);
  {
    gpukit::stream_guard g(s);  // its device guard switches nothing either
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
  }
  CHECK(gpukit::current_device() == cuda0);
  {
    gpukit::device_guard unchanged(cuda0);  // nothing switched at all: nothing to restore
  }
  CHECK(gpukit::current_device() == cuda0);
  CHECK(cudasim::context_creations(0) == 1);
  CHECK(cudasim::context_creations(1) == 1);
}

TEST_CASE("contexts: a message built before CUDA starts does not fix the CUDA_VISIBLE_DEVICES value CUDA reads") {
  // select_device on a given system_snapshot reads nothing from the machine; its message named the variable and took
  // gpukit's snapshot of it, and the program then chose its GPU before its first CUDA call (as launchers do).
  gpukit_test::scoped_env unset("CUDA_VISIBLE_DEVICES", std::nullopt);
  gpukit::system_snapshot system;
  gpukit::gpu_snapshot g;
  g.device = gpukit::device::cuda(0);
  g.name = "test";
  system.gpus.push_back(g);
  system.gpukit_device = "cuda:3";
  CHECK_THROWS_WITH_AS(gpukit::select_device(gpukit::selection_policy{}, system),
                       doctest::Contains("CUDA_VISIBLE_DEVICES unset"), gpukit::invalid_argument_error);
  CHECK(gpukit::check_visible_devices_unchanged());  // nothing read yet: nothing changed
  gpukit_test::scoped_env choose("CUDA_VISIBLE_DEVICES", std::string("1"));
  gpukit_test::captured_warnings warnings;
  CHECK(gpukit::device_count() == 1);  // CUDA starts now and reads "1"
  CHECK(gpukit::visible_devices_in_effect().value == "1");
  CHECK(gpukit::check_visible_devices_unchanged());
  CHECK(warnings.messages().empty());
}

TEST_CASE("contexts: a device whose properties cannot be read is rejected with the reason, not a failed selection") {
  gpukit_test::scoped_env no_nvml("GPUKIT_NVML_LIBRARY", std::string("/nonexistent/libnvidia-ml.so.1"));
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  cudasim::fail_call("cudaGetDeviceProperties", 1, cudaErrorUnknown);  // cuda:0's (devices are read in order)
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  policy.allow_context_probe = true;
  gpukit::device_selection s;
  CHECK_NOTHROW(s = gpukit::select_device(policy));
  cudasim::clear_faults();
  CHECK(s.device == gpukit::device::cuda(1));
  REQUIRE(s.candidates.size() == 2);
  CHECK_FALSE(s.candidates[0].eligible);
  CHECK(s.candidates[0].note.find("its properties could not be read") != std::string::npos);
  CHECK(s.candidates[0].note.find("cudaErrorUnknown") != std::string::npos);
  CHECK(cudasim::context_creations(0) == 0);  // not probed either
}

TEST_CASE("contexts: a context probe skips devices below the compute capability, and a failed probe rejects one") {
  // A probe creates a context (hundreds of MiB) on the device it reads: not on one the policy rejects anyway. A device
  // whose probe fails (prohibited compute mode, say) is rejected with the reason; the others are still chosen from.
  cudasim::machine_config machine = cudasim::default_machine(2);
  machine.devices[0].major = 6;
  machine.devices[0].minor = 1;
  if (!cudasim::configure_or_skip(machine)) return;
  gpukit_test::scoped_env no_nvml("GPUKIT_NVML_LIBRARY", std::string("/nonexistent/libnvidia-ml.so.1"));
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  policy.allow_context_probe = true;
  policy.min_compute_capability = 80;
  cudasim::allow_contexts_only_on({1});
  gpukit::device_selection s = gpukit::select_device(policy);
  CHECK(s.device == gpukit::device::cuda(1));
  CHECK(cudasim::context_creations(0) == 0);
  // The probe of cuda:0 fails: it is rejected, saying why, and cuda:1 is chosen.
  cudasim::allow_contexts_only_on({});
  policy.min_compute_capability = 0;
  cudasim::fail_call("cudaMemGetInfo", 1, cudaErrorDevicesUnavailable);
  s = gpukit::select_device(policy);
  CHECK(s.device == gpukit::device::cuda(1));
  REQUIRE(s.candidates.size() == 2);
  CHECK_FALSE(s.candidates[0].eligible);
  CHECK(s.candidates[0].note.find("its memory could not be queried") != std::string::npos);
  CHECK(s.candidates[0].note.find("cudaErrorDevicesUnavailable") != std::string::npos);
}

TEST_CASE("contexts: a device in prohibited compute mode is rejected, and not probed") {
  // An administrator drained cuda:0 (nvidia-smi -c PROHIBITED): no context may be created there.
  cudasim::machine_config machine = cudasim::default_machine(2);
  machine.devices[0].compute_mode = cudaComputeModeProhibited;
  if (!cudasim::configure_or_skip(machine)) return;
  gpukit_test::scoped_env no_nvml("GPUKIT_NVML_LIBRARY", std::string("/nonexistent/libnvidia-ml.so.1"));
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  cudasim::allow_contexts_only_on({1});
  gpukit::selection_policy policy;  // first eligible
  gpukit::device_selection s = gpukit::select_device(policy);
  CHECK(s.device == gpukit::device::cuda(1));
  REQUIRE(s.candidates.size() == 2);
  CHECK(s.candidates[0].note.find("compute mode is prohibited") != std::string::npos);
  policy.prefer = gpukit::device_preference::most_free_memory;
  policy.allow_context_probe = true;
  s = gpukit::select_device(policy);
  CHECK(s.device == gpukit::device::cuda(1));
  CHECK(cudasim::context_creations(0) == 0);
  cudasim::allow_contexts_only_on({});
}

TEST_CASE("contexts: CUDA_VISIBLE_DEVICES naming no installed GPU is named in the CPU fallback's reason") {
  gpukit_test::scoped_env visible("CUDA_VISIBLE_DEVICES", std::string("16"));  // read when the runtime starts
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank("LOCAL_RANK", std::nullopt);
  const gpukit::device_selection s = gpukit::select_device();
  CHECK(s.device.is_cpu());
  CHECK(s.reason.find("no CUDA-capable GPU among those CUDA_VISIBLE_DEVICES=\"16\" names") != std::string::npos);
}

TEST_CASE("contexts: stream priority ranges are per device") {
  cudasim::machine_config machine = cudasim::default_machine(2);
  machine.devices[1].priority_greatest = -3;
  if (!cudasim::configure_or_skip(machine)) return;
  cudasim::allow_contexts_only_on({1});
  const auto d0 = gpukit::device::cuda(0);
  const auto d1 = gpukit::device::cuda(1);
  (void)gpukit::properties(d0);
  (void)gpukit::properties(d1);
  CHECK(cudasim::context_creations(1) == 0);
  const gpukit::priority_range range1 = gpukit::stream_priority_range(d1);  // creates cuda:1's context, no other
  CHECK(range1.least == 0);
  CHECK(range1.greatest == -3);
  CHECK(range1.clamp(-1000) == -3);
  CHECK(range1.clamp(7) == 0);
  CHECK(cudasim::context_creations(1) == 1);
  gpukit::stream high(d1, {true, -1000});
  CHECK(high.priority() == -3);
  int actual = 0;
  REQUIRE(cudaStreamGetPriority(gpukit::default_stream_pool(d1, gpukit::stream_priority::high).next().cuda_handle(),
                                &actual) == cudaSuccess);
  CHECK(actual == -3);
  CHECK(cudasim::context_creations(0) == 0);
  cudasim::allow_contexts_only_on({0, 1});
  CHECK(gpukit::stream_priority_range(d0).greatest == -5);  // asked with cuda:1 current: still cuda:0's own range
  gpukit::stream high0(d0, {true, -1000});
  CHECK(high0.priority() == -5);
  CHECK(gpukit::stream_priority_range(d1).greatest == -3);
  CHECK(gpukit::stream_priority_range(gpukit::device::cpu()).greatest == 0);
}

// --- the first gpukit call of a fresh thread, on streams, events and memory of cuda:1 made by the main thread ---
// cudaEventRecord, cudaStreamWaitEvent, cudaLaunchHostFunc, cudaStreamQuery and cudaStreamSynchronize run in the
// thread's current context: on a thread with none, the runtime would first create cuda:0's, whatever device the
// stream or event belongs to.

namespace {
struct cuda1_objects {
  gpukit::stream s{gpukit::device::cuda(1)};
  gpukit::stream t{gpukit::device::cuda(1)};
  gpukit::event e{gpukit::device::cuda(1)};
};

/// Runs `f` as the first gpukit call of a new thread, in a process where only cuda:1 was used (by this thread).
template <class F>
void first_call_on_fresh_thread(F f) {
  cudasim::allow_contexts_only_on({1});
  cuda1_objects o;
  o.e.record(o.s);
  std::thread([&] { f(o); }).join();
  o.s.synchronize();
  o.t.synchronize();
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 1);
}
}  // namespace

TEST_CASE("contexts: stream_view::ready as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) { (void)o.s.view().ready(); });
}

TEST_CASE("contexts: stream_view::synchronize as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) { o.s.view().synchronize(); });
}

TEST_CASE("contexts: stream_view::enqueue_host as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) { o.s.view().enqueue_host([] {}); });
}

TEST_CASE("contexts: event::record as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) { o.e.record(o.t); });
}

TEST_CASE("contexts: event::wait as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) { o.e.wait(o.t); });
}

TEST_CASE("contexts: event::ready and synchronize as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) {
    (void)o.e.ready();
    o.e.synchronize();
  });
}

TEST_CASE("contexts: freeing a device_buffer recorded on another stream as a fresh thread's first call") {
  first_call_on_fresh_thread([](cuda1_objects& o) {
    std::unique_ptr<gpukit::device_buffer<float>> x;  // (std::optional here trips g++ -O3's maybe-uninitialized)
    std::thread([&] {  // made and recorded elsewhere (the caller of this lambda is the fresh thread)
      gpukit::device_guard guard(gpukit::device::cuda(1));
      {
        gpukit::device_buffer<float> warm(1000, o.s);  // leaves a pooled event: the free below creates none
        warm.record_stream(o.t);
      }
      o.t.synchronize();
      x = std::make_unique<gpukit::device_buffer<float>>(1000, o.s);  // polls the event back into the pool
      x->record_stream(o.t);
    })
        .join();
    x.reset();  // records a pooled event on t
  });
}

TEST_CASE("contexts: the caching allocator's deallocate that records an event, as a fresh thread's first call") {
  cudasim::allow_contexts_only_on({1});
  gpukit::caching_allocator a(gpukit::device::cuda(1));
  cuda1_objects o;
  a.deallocate(a.allocate(4096, o.s), o.t);  // creates an event
  o.t.synchronize();
  void* p = a.allocate(4096, o.s);  // polls it back into the event pool
  void* q = a.allocate(4096, o.s);
  a.record_stream(p, o.t);
  std::thread([&] { a.deallocate(p); }).join();       // records the pooled event on t
  std::thread([&] { a.deallocate(q, o.t); }).join();  // creates one (with cuda:1 current) and records it
  o.s.synchronize();
  o.t.synchronize();
  CHECK(cudasim::context_creations(0) == 0);
}

TEST_CASE("contexts: stream::wrap of a raw stream asks its questions in the stream's context on a fresh thread") {
  // The simulator does not model these questions as needing a context (not measured); gpukit's rule is that every
  // stream question on a thread with none enters the stream's own context first, as the runtime would otherwise
  // create cuda:0's. The priority was asked with no context current.
  std::vector<std::string> without_context;
  std::mutex m;
  for (const char* call : {"cudaStreamGetPriority", "cudaStreamGetFlags", "cudaStreamGetId"}) {
    cudasim::before_call(call, 1, [&without_context, &m, call] {
      if (gpukit::detail::thread_context_state() != 0) return;
      const std::lock_guard<std::mutex> lock(m);
      without_context.emplace_back(call);
    });
  }
  first_call_on_fresh_thread([](cuda1_objects& o) {
    gpukit::stream wrapped = gpukit::stream::wrap(o.s.cuda_handle(), gpukit::device::cuda(1), false);
    CHECK(wrapped.device() == gpukit::device::cuda(1));
  });
  cudasim::clear_faults();
  CHECK(without_context.empty());
  for (const auto& call : without_context) MESSAGE(call);
}
