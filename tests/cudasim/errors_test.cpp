// CUDA calls at process exit. gpukit objects may be destroyed after main returns (objects at namespace scope, or
// owned by never-destroyed singletons), when the runtime may already be unloading (cudaErrorCudartUnloading, which is
// also the value of the driver's CUDA_ERROR_DEINITIALIZED) or the primary context already torn down
// (cudaErrorContextIsDestroyed). Their destructors must treat those results as "nothing left to release": no warning,
// no crash, and no use of function-local statics that static destruction may already have destroyed. Other failures
// are still reported. The at-exit checks run this executable again as a child process and read its stderr.
#include <gpukit/gpukit.hpp>
#include <gpukit/graph/graph.hpp>

#include "cudasim.hpp"
#include "support.hpp"

#include <cuda_runtime_api.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

const gpukit::device cuda0 = gpukit::device::cuda(0);

/// The results that mean the CUDA runtime or driver is gone (process exit).
constexpr std::array<cudaError_t, 2> teardown_results{cudaErrorCudartUnloading, cudaErrorContextIsDestroyed};

gpukit::allocator_options expandable() {
  gpukit::allocator_options o;
  o.expandable_segments = true;
  return o;
}

}  // namespace

// Objects at namespace scope, destroyed after main returns. Built without any CUDA call (none may happen during static
// initialisation); the child test case below moves real CUDA objects into them. Declaration order = construction
// order: the stream is destroyed last, after the buffers that use it.
gpukit::stream g_stream = gpukit::stream::wrap(nullptr, gpukit::device::cuda(0), false);
gpukit::caching_allocator g_allocator{gpukit::device::cuda(0)};
gpukit::caching_allocator g_expandable_allocator{gpukit::device::cuda(0), expandable()};
gpukit::event g_event{gpukit::device::cpu()};
gpukit::device_buffer<float> g_buffer;
gpukit::device_buffer<float> g_own_buffer;
gpukit::device_buffer<float> g_default_stream_buffer;  // on the legacy default stream
gpukit::pinned_buffer<float> g_pinned;
gpukit::pooled_pinned_buffer<float> g_pooled;

TEST_CASE("errors: a destructor meeting an unloaded runtime or a destroyed context warns nothing") {
  for (const cudaError_t result : teardown_results) {
    CAPTURE(cudaGetErrorName(result));
    gpukit_test::captured_warnings warnings;
    {
      gpukit::stream s(cuda0);
      cudasim::fail_call("cudaStreamDestroy", 1, result);
    }
    {
      gpukit::event e(cuda0);
      cudasim::fail_call("cudaEventDestroy", 1, result);
    }
    {
      gpukit::pinned_buffer<float> p(100, cuda0);
      cudasim::fail_call("cudaFreeHost", 1, result);
    }
    {
      gpukit::caching_allocator allocator(cuda0);
      allocator.deallocate(allocator.allocate(4096, gpukit::stream_view::default_stream(cuda0)));
      cudasim::fail_call("cudaFree", 1, result);
    }
    CHECK(warnings.messages().empty());
    for (const auto& m : warnings.messages()) MESSAGE(m);
  }
}

TEST_CASE("errors: an allocator with expandable segments destroyed after the runtime unloaded warns nothing") {
  for (const cudaError_t result : teardown_results) {
    CAPTURE(cudaGetErrorName(result));
    gpukit_test::captured_warnings warnings;
    {
      gpukit::caching_allocator allocator(cuda0, expandable());
      gpukit::stream s(cuda0);
      void* kept = allocator.allocate(std::size_t{6} << 20, s);  // mapped pages, cached after the free
      allocator.deallocate(allocator.allocate(std::size_t{1} << 20, s));
      allocator.deallocate(kept);
      REQUIRE(allocator.memory_reserved() > 0);
      cudasim::unload(result);  // every runtime and driver call now fails with `result`, as at process exit
    }
    cudasim::clear_faults();
    CHECK(warnings.messages().empty());
    for (const auto& m : warnings.messages()) MESSAGE(m);
  }
}

TEST_CASE("errors: a graph pool released after the runtime unloaded warns nothing") {
  for (const cudaError_t result : teardown_results) {
    CAPTURE(cudaGetErrorName(result));
    gpukit_test::captured_warnings warnings;
    {
      gpukit::stream s(cuda0);
      auto pool = gpukit::graph_pool::create(cuda0, std::size_t{1} << 20);
      gpukit::graph g = gpukit::capture(
          s, [&] { gpukit::device_buffer<int> tmp(16, s); }, pool);
      g.launch(s);  // the release would order the reserve after this launch
      s.synchronize();
      cudasim::unload(result);
    }
    cudasim::clear_faults();
    CHECK(warnings.messages().empty());
    for (const auto& m : warnings.messages()) MESSAGE(m);
  }
}

TEST_CASE("errors: other failures in destructors are still reported") {
  gpukit_test::captured_warnings warnings;
  {
    gpukit::stream s(cuda0);
    cudasim::fail_call("cudaStreamDestroy", 1, cudaErrorInvalidResourceHandle);
  }
  {
    gpukit::event e(cuda0);
    cudasim::fail_call("cudaEventDestroy", 1, cudaErrorLaunchFailure);
  }
  cudasim::clear_faults();  // the launch failure is sticky
  const auto messages = warnings.messages();
  REQUIRE(messages.size() == 2);
  CHECK(messages[0].find("cudaStreamDestroy") != std::string::npos);
  CHECK(messages[0].find("cudaErrorInvalidResourceHandle") != std::string::npos);
  CHECK(messages[1].find("cudaEventDestroy") != std::string::npos);
  CHECK(messages[1].find("cudaErrorLaunchFailure") != std::string::npos);
}

TEST_CASE("errors: a failed stream query throws naming the call, and the stream stays usable") {
  gpukit::stream s(cuda0);
  cudasim::fail_call("cudaStreamQuery", 1, cudaErrorInvalidResourceHandle);
  CHECK_THROWS_WITH_AS((void)s.ready(), doctest::Contains("cudaStreamQuery"), gpukit::cuda_error);
  CHECK(cudaGetLastError() == cudaSuccess);  // gpukit's exception carries the failure; none is left pending
  s.synchronize();
  CHECK(s.ready());
}

TEST_CASE(
    "errors: a destroyed stream whose final event cannot be recorded warns, and its memory waits for the device") {
  gpukit::caching_allocator a(cuda0);
  gpukit_test::captured_warnings warnings;
  {
    gpukit::stream s(cuda0);
    a.deallocate(a.allocate(4096, s));  // the allocator keeps s's state, so ~stream records a final event for it
    cudasim::fail_call("cudaEventRecord", 1, cudaErrorInvalidResourceHandle);
    // ~stream: cudaEventCreateWithFlags succeeds, cudaEventRecord fails, the event is destroyed again.
  }
  CHECK(warnings.contains("final event"));
  CHECK(warnings.contains("cudaErrorInvalidResourceHandle"));
  const std::size_t synchronizations = cudasim::calls("cudaDeviceSynchronize");
  const std::size_t events_created = cudasim::calls("cudaEventCreateWithFlags");
  a.empty_cache();  // waits for the destroyed stream's work: the whole device's, without its final event
  CHECK(cudasim::calls("cudaDeviceSynchronize") > synchronizations);
  CHECK(cudasim::calls("cudaEventCreateWithFlags") == events_created);
  CHECK(a.memory_reserved() == 0);
  gpukit::stream t(cuda0);
  void* q = a.allocate(4096, t);  // the allocator is usable afterwards
  CHECK(q != nullptr);
  a.deallocate(q);
}

TEST_CASE("errors: device memory freed after the runtime unloaded is neither reported nor acted on") {
  gpukit::stream s(cuda0);
  gpukit_test::captured_warnings warnings;
  for (const cudaError_t result : teardown_results) {
    CAPTURE(cudaGetErrorName(result));
    auto x = std::make_unique<gpukit::device_buffer<float>>(1000, s);
    auto p = std::make_unique<gpukit::pooled_pinned_buffer<float>>(1000, cuda0);
    p->record_stream(s);
    cudasim::unload(result);  // every runtime call now fails with `result`, as at process exit
    x.reset();
    p.reset();
    cudasim::clear_faults();
    CHECK(warnings.messages().empty());
    for (const auto& m : warnings.messages()) MESSAGE(m);
  }
}

// Run only as the child of the test below (GPUKIT_AT_EXIT_SCENARIO set): fills the objects at namespace scope, which
// are then destroyed after main returns. Skipped, so ctest does not list it as a test of its own (the child is run
// with --no-skip).
TEST_CASE("errors: at-exit child" * doctest::skip()) {
  const char* scenario = std::getenv("GPUKIT_AT_EXIT_SCENARIO");
  if (scenario == nullptr) return;
  const std::string which = scenario;
  g_stream = gpukit::stream(cuda0);
  g_buffer = gpukit::device_buffer<float>(1000, g_stream);
  g_own_buffer = gpukit::device_buffer<float>(1000, g_stream, g_allocator);
  g_default_stream_buffer = gpukit::device_buffer<float>(1000, gpukit::stream_view::default_stream(cuda0));
  g_allocator.deallocate(g_allocator.allocate(std::size_t{64} << 20, g_stream));  // a cached segment: cudaFree at exit
  g_expandable_allocator.deallocate(g_expandable_allocator.allocate(std::size_t{8} << 20, g_stream));  // mapped pages
  g_event = gpukit::event(cuda0);
  g_event.record(g_stream);
  g_pinned = gpukit::pinned_buffer<float>(1000, cuda0);
  g_pooled = gpukit::pooled_pinned_buffer<float>(1000, cuda0);
  g_pooled.record_stream(g_stream);
  if (which == "unloading") cudasim::unload(cudaErrorCudartUnloading);
  if (which == "context_destroyed") cudasim::unload(cudaErrorContextIsDestroyed);
  if (which == "warns") {
    // The handler state is first used here, after the objects above were constructed: a function-local static
    // would be destroyed before them. The handler owns heap memory, so using it after destruction is visible to ASan.
    gpukit::set_warning_handler([prefix = std::string(64, '>')](std::string_view message) {
      std::fprintf(stderr, "%s %.*s\n", prefix.c_str(), static_cast<int>(message.size()), message.data());
    });
    cudasim::fail_call("cudaStreamDestroy", 1, cudaErrorInvalidResourceHandle);
  }
}

namespace {

/// Runs this executable's "errors: at-exit child" test case with GPUKIT_AT_EXIT_SCENARIO=`scenario`.
gpukit_test::child_result run_at_exit_child(const std::string& scenario) {
  return gpukit_test::run_test_case_in_child("GPUKIT_AT_EXIT_SCENARIO=" + scenario, "errors: at-exit child");
}

}  // namespace

TEST_CASE("errors: objects at namespace scope destroyed after main returns neither crash nor warn") {
  for (const char* scenario : {"alive", "unloading", "context_destroyed"}) {
    CAPTURE(scenario);
    const gpukit_test::child_result child = run_at_exit_child(scenario);
    CHECK(child.status == 0);
    CHECK(child.stderr_text.empty());
    if (!child.stderr_text.empty()) MESSAGE(child.stderr_text);
  }
}

TEST_CASE("errors: a warning during static destruction reaches the handler set in main") {
  const gpukit_test::child_result child = run_at_exit_child("warns");
  CHECK(child.status == 0);
  INFO(child.stderr_text);
  const std::string expected = std::string(64, '>') + " cudaStreamDestroy (in ~stream) failed on cuda:0";
  CHECK(child.stderr_text.rfind(expected, 0) == 0);
  CHECK(child.stderr_text.find('\n') == child.stderr_text.size() - 1);  // that one line, nothing else
}

TEST_CASE(
    "errors: a failed cudaHostUnregister names the call that ended the registration, and says the range may "
    "stay page-locked") {
  const gpukit::device d = gpukit::device::cuda(0);
  std::vector<unsigned char> a(std::size_t{1} << 16);
  std::vector<unsigned char> b(std::size_t{1} << 16);
  gpukit_test::captured_warnings warnings;
  {
    gpukit::host_registration reset_one(a.data(), a.size(), d);
    cudasim::fail_call("cudaHostUnregister", 1, cudaErrorInvalidValue);
    reset_one.reset();
    CHECK_FALSE(reset_one.registered());
    gpukit::host_registration destroyed(b.data(), b.size(), d);
    cudasim::fail_call("cudaHostUnregister", 1, cudaErrorInvalidValue);
  }
  cudasim::clear_faults();
  const std::vector<std::string> messages = warnings.messages();
  REQUIRE(messages.size() == 2);
  CHECK(messages[0].find("cudaHostUnregister (in host_registration::reset; the range may stay page-locked)") !=
        std::string::npos);
  CHECK(messages[1].find("cudaHostUnregister (in ~host_registration;") != std::string::npos);
  for (void* p : {static_cast<void*>(a.data()), static_cast<void*>(b.data())}) (void)cudaHostUnregister(p);
  (void)cudaGetLastError();
}
