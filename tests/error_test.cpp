// The error model: exception types, messages a user can act on, warnings.
#include <gpukit/detail/driver_api.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/detail/device_mutex.hpp>
#include <gpukit/warning.hpp>

#include "support.hpp"

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <mutex>
#include <vector>

static_assert(std::is_base_of<std::runtime_error, gpukit::error>::value, "rooted in std::runtime_error");
static_assert(std::is_nothrow_copy_constructible<gpukit::error>::value, "exceptions copy without throwing");
static_assert(std::is_nothrow_copy_constructible<gpukit::cuda_error>::value, "exceptions copy without throwing");

namespace {
template <class Expected>
Expected thrown_by(cudaError_t result, const char* call, int device) {
  try {
    gpukit::detail::throw_cuda_error(result, call, device, "file.cpp", 42);
  } catch (const Expected& e) {
    return e;
  }
  FAIL("no exception of the expected type");
  throw std::logic_error("unreachable");
}
}  // namespace

TEST_CASE("CUDA results map to distinct exception types") {
  CHECK(thrown_by<gpukit::no_device_error>(cudaErrorInsufficientDriver, "cudaGetDeviceCount", -1).code() ==
        gpukit::errc::no_device);
  CHECK(thrown_by<gpukit::no_device_error>(cudaErrorStubLibrary, "x", -1).code() == gpukit::errc::no_device);
  CHECK(thrown_by<gpukit::no_device_error>(cudaErrorNoDevice, "x", -1).code() == gpukit::errc::no_device);
  CHECK(thrown_by<gpukit::out_of_memory_error>(cudaErrorMemoryAllocation, "cudaMalloc", 0).code() ==
        gpukit::errc::out_of_memory);
  CHECK(thrown_by<gpukit::invalid_argument_error>(cudaErrorInvalidValue, "x", 0).code() ==
        gpukit::errc::invalid_argument);
  CHECK(thrown_by<gpukit::invalid_argument_error>(cudaErrorInvalidDevice, "x", 0).code() ==
        gpukit::errc::invalid_argument);
  CHECK(thrown_by<gpukit::cuda_error>(cudaErrorLaunchFailure, "x", 0).code() == gpukit::errc::cuda);
}

TEST_CASE("a CUDA that fails to initialise is no_device_error, as device_count() and select_device() take it") {
  for (const cudaError_t result : {cudaErrorInitializationError, cudaErrorSystemNotReady, cudaErrorSystemDriverMismatch,
                                   cudaErrorCompatNotSupportedOnDevice}) {
    CAPTURE(result);
    CHECK(thrown_by<gpukit::no_device_error>(result, "cudaGetDevice", -1).cuda_result() == result);
  }
}

TEST_CASE("a CUDA error carries the call, result, device and location") {
  const auto e = thrown_by<gpukit::error>(cudaErrorLaunchFailure, "cudaStreamSynchronize", 2);
  CHECK(e.cuda_result() == cudaErrorLaunchFailure);
  CHECK(std::string(e.cuda_error_name()) == "cudaErrorLaunchFailure");
  CHECK(e.call() == "cudaStreamSynchronize");
  CHECK(e.device() == 2);
  CHECK(std::string(e.file()) == "file.cpp");
  CHECK(e.line() == 42);
  const std::string what = e.what();
  CHECK(what.find("cudaStreamSynchronize failed on cuda:2: ") == 0);
  CHECK(what.find("(cudaErrorLaunchFailure)") != std::string::npos);
}

// CUDA reads CUDA_VISIBLE_DEVICES once, and the message shows the value of the process's first CUDA use (the other
// test cases, run in the same process, come first): this check runs in a child started with the variable set.
TEST_CASE("error: visible-devices message child" * doctest::skip()) {
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess) visible = 0;
  (void)cudaGetLastError();
  const auto e = thrown_by<gpukit::invalid_argument_error>(cudaErrorInvalidDevice, "cudaSetDevice(3)", -1);
  const std::string expected_start = "cudaSetDevice(3) failed: invalid device ordinal (cudaErrorInvalidDevice); " +
                                     std::to_string(visible) + (visible == 1 ? " device" : " devices") +
                                     " visible; CUDA_VISIBLE_DEVICES=\"1\"";
  CHECK(std::string(e.what()).find(expected_start) == 0);
}

TEST_CASE("the message names the call, the error, the visible devices and CUDA_VISIBLE_DEVICES") {
  const gpukit_test::child_result child =
      gpukit_test::run_test_case_in_child("CUDA_VISIBLE_DEVICES=1", "error: visible-devices message child");
  CHECK(child.status == 0);
  if (child.status != 0) MESSAGE(child.stderr_text);
}

TEST_CASE("no-driver errors say what is wrong in words") {
  gpukit_test::scoped_env env("CUDA_VISIBLE_DEVICES", std::nullopt);
  const auto e = thrown_by<gpukit::no_device_error>(cudaErrorInsufficientDriver, "cudaMalloc(1024)", 0);
  const std::string what = e.what();
  CHECK(what.find("cudaErrorInsufficientDriver") != std::string::npos);
  CHECK(what.find("CUDA_VISIBLE_DEVICES unset") != std::string::npos);
  CHECK(what.find("no NVIDIA driver is loaded") != std::string::npos);
}

TEST_CASE("stream-capture errors say which rule was broken") {
  const std::pair<cudaError_t, const char*> expected[] = {
      {cudaErrorCapturedEvent, "last recorded inside a stream capture"},
      {cudaErrorStreamCaptureUnsupported, "not permitted while a stream capture is underway"},
      {cudaErrorStreamCaptureUnsupported, "legacy default stream was to be captured"},
      {cudaErrorStreamCaptureImplicit, "legacy default stream would join the capture"},
      {cudaErrorStreamCaptureInvalidated, "an earlier error during the capture"},
      {cudaErrorStreamCaptureUnjoined, "was not joined back"},
      {cudaErrorStreamCaptureWrongThread, "ended by the thread that began it"},
      {cudaErrorStreamCaptureIsolation, "last recorded in a capture that has ended"},
      {cudaErrorStreamCaptureIsolation, "waited for an event recorded outside the capture"},
      {cudaErrorStreamCaptureMerge, "two captures cannot be merged"},
  };
  for (const auto& [result, words] : expected) {
    const std::string what = thrown_by<gpukit::error>(result, "cudaEventSynchronize", 0).what();
    INFO(what);
    CHECK(what.find(cudaGetErrorName(result)) != std::string::npos);
    CHECK(what.find(words) != std::string::npos);
  }
}

TEST_CASE("GPUKIT_CUDA_TRY throws on failure and evaluates the description only then") {
  int described = 0;
  auto describe = [&] {
    ++described;
    return std::string("described call");
  };
  GPUKIT_CUDA_TRY_DESCRIBED(cudaSuccess, describe(), -1);
  CHECK(described == 0);
  CHECK_THROWS_AS(GPUKIT_CUDA_TRY_DESCRIBED(cudaErrorInvalidValue, describe(), 1), gpukit::invalid_argument_error);
  CHECK(described == 1);
  try {
    GPUKIT_CUDA_TRY(cudaErrorInvalidValue);
  } catch (const gpukit::error& e) {
    CHECK(e.call() == "cudaErrorInvalidValue");
    CHECK(e.line() > 0);
  }
}

TEST_CASE("errors without a CUDA cause report cudaSuccess") {
  const gpukit::invalid_argument_error e("bad input");
  CHECK(e.cuda_result() == cudaSuccess);
  CHECK(e.call().empty());
  CHECK(e.device() == -1);
  CHECK(std::string(e.what()) == "bad input");
}

TEST_CASE("warnings go to the handler, and a throwing handler is ignored") {
  {
    gpukit_test::captured_warnings warnings;
    gpukit::warn("first");
    CHECK(warnings.messages() == std::vector<std::string>{"first"});
  }
  auto previous = gpukit::set_warning_handler([](std::string_view) { throw std::runtime_error("handler failed"); });
  CHECK_NOTHROW(gpukit::warn("ignored"));
  gpukit::set_warning_handler(previous);
}

TEST_CASE("failures in destructors are reported, except while the runtime unloads") {
  gpukit_test::captured_warnings warnings;
  gpukit::detail::report_cuda_failure(cudaErrorCudartUnloading, "cudaStreamDestroy", 0);
  gpukit::detail::report_cuda_failure(cudaSuccess, "cudaStreamDestroy", 0);
  CHECK(warnings.messages().empty());
  gpukit::detail::report_cuda_failure(cudaErrorInvalidResourceHandle, "cudaEventDestroy (in ~event)", 1);
  REQUIRE(warnings.messages().size() == 1);
  CHECK(warnings.contains("cudaEventDestroy (in ~event) failed on cuda:1"));
}

TEST_CASE("a driver upgraded without a reboot is named as the cause") {
  const std::string what =
      thrown_by<gpukit::no_device_error>(cudaErrorSystemDriverMismatch, "cudaGetDeviceCount", -1).what();
  CHECK(what.find("(cudaErrorSystemDriverMismatch)") != std::string::npos);
  CHECK(what.find("driver upgrade without a reboot") != std::string::npos);
}

TEST_CASE("an initialisation error names the fork that usually causes it") {
  const std::string what =
      thrown_by<gpukit::no_device_error>(cudaErrorInitializationError, "cudaGetDeviceCount", -1).what();
  CHECK(what.find("forked after its parent used CUDA") != std::string::npos);
}

TEST_CASE("too many peers is explained with what to do about it") {
  const std::string what = thrown_by<gpukit::cuda_error>(cudaErrorTooManyPeers, "cudaDeviceEnablePeerAccess", 0).what();
  CHECK(what.find("(cudaErrorTooManyPeers)") != std::string::npos);
  CHECK(what.find("release peer_access objects no longer needed") != std::string::npos);
}

TEST_CASE("a driver result keeps its number where the runtime has it, so a sticky error stays recognisable") {
  CHECK(gpukit::detail::runtime_error_of(CUDA_SUCCESS) == cudaSuccess);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_DEINITIALIZED) == cudaErrorCudartUnloading);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_OUT_OF_MEMORY) == cudaErrorMemoryAllocation);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_INVALID_CONTEXT) == cudaErrorDeviceUninitialized);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_ILLEGAL_STATE) == cudaErrorIllegalState);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_ILLEGAL_ADDRESS) == cudaErrorIllegalAddress);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_TOO_MANY_PEERS) == cudaErrorTooManyPeers);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_LAUNCH_FAILED) == cudaErrorLaunchFailure);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_NOT_PERMITTED) == cudaErrorNotPermitted);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_NOT_SUPPORTED) == cudaErrorNotSupported);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH) == cudaErrorSystemDriverMismatch);
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) == cudaErrorStreamCaptureInvalidated);
  // Driver results the runtime has no value for.
  CHECK(gpukit::detail::runtime_error_of(CUDA_ERROR_CONTEXT_ALREADY_CURRENT) == cudaErrorUnknown);
  CHECK(gpukit::detail::runtime_error_of(static_cast<CUresult>(916)) == cudaErrorUnknown);
  CHECK(gpukit::detail::runtime_error_of(static_cast<CUresult>(1000)) == cudaErrorUnknown);
}

TEST_CASE("format_bytes chooses the unit after rounding") {
  using gpukit::detail::format_bytes;
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1024) == "1.00 KiB");
  CHECK(format_bytes(1048570) == "1023.99 KiB");  // 1023.994 KiB
  CHECK(format_bytes((std::size_t{1} << 20) - 1) == "1.00 MiB");
  CHECK(format_bytes((std::size_t{1} << 30) - 1) == "1.00 GiB");
  CHECK(format_bytes(std::size_t{3} << 29) == "1.50 GiB");
  CHECK(format_bytes(~std::size_t{0}) == "16384.00 PiB");  // no unit past PiB
  CHECK(gpukit::detail::format_bytes_exact((std::size_t{1} << 20) - 1) == "1.00 MiB (1048575 bytes)");
}

TEST_CASE("a warning handler that warns again is not re-entered and does not deadlock") {
  std::vector<std::string> received;
  auto previous = gpukit::set_warning_handler([&](std::string_view message) {
    received.emplace_back(message);
    gpukit::warn("from inside the handler");  // goes to the default sink (stderr), not back here
  });
  gpukit::warn("outer");
  gpukit::warn("second");
  gpukit::set_warning_handler(previous);
  CHECK(received == std::vector<std::string>{"outer", "second"});
}

TEST_CASE("a warning handler that replaces itself does not deadlock and the new handler takes over") {
  std::vector<std::string> first_saw;
  std::vector<std::string> second_saw;
  gpukit::warning_handler second = [&](std::string_view message) { second_saw.emplace_back(message); };
  gpukit::warning_handler replaced_by_first;
  auto previous = gpukit::set_warning_handler([&](std::string_view message) {
    first_saw.emplace_back(message);
    // The handler running now is kept alive until it returns, although set_warning_handler hands it back.
    replaced_by_first = gpukit::set_warning_handler(second);
    first_saw.emplace_back("still running");
  });
  gpukit::warn("one");
  gpukit::warn("two");
  gpukit::set_warning_handler(previous);
  CHECK(first_saw == std::vector<std::string>{"one", "still running"});
  CHECK(second_saw == std::vector<std::string>{"two"});
  CHECK(static_cast<bool>(replaced_by_first));
}

TEST_CASE("set_warning_handler returns only once other threads' calls of the old handler have finished") {
  gpukit_test::gate release_handler;
  gpukit_test::gate handler_entered;
  std::atomic<bool> old_handler_finished{false};
  auto previous = gpukit::set_warning_handler([&](std::string_view) {
    handler_entered.open();
    release_handler.wait();
    old_handler_finished = true;
  });
  std::thread warner([] { gpukit::warn("held in the handler"); });
  handler_entered.wait();
  bool finished_when_replaced = false;
  std::thread replacer([&] {
    gpukit::set_warning_handler([](std::string_view) {});
    finished_when_replaced = old_handler_finished.load();  // what the old handler refers to may now be destroyed
  });
  release_handler.open();
  replacer.join();
  warner.join();
  gpukit::set_warning_handler(previous);
  CHECK(finished_when_replaced);
}

TEST_CASE("warnings raised under the allocator's device lock reach the handler once the last such lock is released") {
  gpukit::detail::device_mutex outer;
  gpukit::detail::device_mutex inner;
  std::vector<std::string> received;
  std::vector<bool> outer_free;
  auto previous = gpukit::set_warning_handler([&](std::string_view message) {
    received.emplace_back(message);
    outer_free.push_back(outer.try_lock());  // the handler may take the lock (say, the allocator's snapshot)
    if (outer_free.back()) outer.unlock();
  });
  {
    std::lock_guard<gpukit::detail::device_mutex> a(outer);
    gpukit::warn("first");
    {
      std::lock_guard<gpukit::detail::device_mutex> b(inner);
      gpukit::warn(std::string("second\0with a null", 18));  // any bytes, kept whole
    }
    CHECK(received.empty());  // still under `outer`
    gpukit::warn("");
  }
  gpukit::warn("after");
  gpukit::set_warning_handler(previous);
  CHECK(received == std::vector<std::string>{"first", std::string("second\0with a null", 18), "", "after"});
  CHECK(outer_free == std::vector<bool>{true, true, true, true});
  CHECK(gpukit::detail::warnings_held_on_this_thread().depth == 0);
  CHECK(gpukit::detail::warnings_held_on_this_thread().pending == nullptr);
}

TEST_CASE("a warning a handler raises under the device lock goes to stderr, not back into the handler") {
  // Held and delivered after the batch it was raised in, it went back into the handler (no longer marked as
  // running): a handler that took a snapshot (which warns under the lock) for every warning was called for ever
  // (helper-177). It is the handler's own, and goes to stderr as any other it raises (warning.hpp).
  gpukit::detail::device_mutex m;
  std::vector<std::string> received;
  auto previous = gpukit::set_warning_handler([&](std::string_view message) {
    received.emplace_back(message);
    if (received.size() > 50) return;  // the defect: fed its own warnings, one per call
    const std::lock_guard<gpukit::detail::device_mutex> lock(m);
    gpukit::warn(std::string(message) + ", raised by its handler");
  });
  {
    const std::lock_guard<gpukit::detail::device_mutex> lock(m);
    gpukit::warn("A");
    gpukit::warn("B");
  }
  gpukit::warn("C");  // the same handler, called directly: its warning goes to stderr there too
  gpukit::set_warning_handler(previous);
  CHECK(received == std::vector<std::string>{"A", "B", "C"});
  CHECK(gpukit::detail::warnings_held_on_this_thread().pending == nullptr);
}
