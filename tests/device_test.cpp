// The device value type, device_count, the current-device guard and the behaviour without a driver.
#include <gpukit/device/device.hpp>
#include <gpukit/device/peer_access.hpp>
#include <gpukit/device/properties.hpp>

#include "support.hpp"

#include <iterator>  // defines __cpp_lib_ranges where the library has ranges
#if defined(__cpp_lib_ranges)
#include <ranges>
#endif
#include <sstream>
#include <type_traits>
#include <unordered_set>

/// In a test of behaviour without a GPU: skip when this machine has one.
#define GPUKIT_REQUIRE_NO_GPU()                                                       \
  do {                                                                                \
    if (::gpukit::device_count() != 0) {                                              \
      std::printf("GPUKIT_TEST_SKIPPED: this test checks behaviour without a GPU\n"); \
      return;                                                                         \
    }                                                                                 \
  } while (false)

static_assert(noexcept(gpukit::device_count()), "device_count never throws");
static_assert(!std::is_copy_constructible<gpukit::device_guard>::value, "guards are not copyable");

TEST_CASE("devices parse from and format to cpu / cuda:N") {
  CHECK(gpukit::device::parse("cpu") == gpukit::device::cpu());
  CHECK(gpukit::device::parse("cuda") == gpukit::device::cuda(0));
  CHECK(gpukit::device::parse("cuda:0") == gpukit::device::cuda(0));
  CHECK(gpukit::device::parse(" cuda:12\t") == gpukit::device::cuda(12));
  for (const char* text : {"cpu", "cuda:0", "cuda:7"}) {
    CHECK(gpukit::device::parse(text).to_string() == text);
  }
  CHECK(gpukit::device().is_cpu());
  CHECK(gpukit::device::cuda(3).ordinal() == 3);
  CHECK(gpukit::device::cpu().ordinal() == -1);
  std::ostringstream out;
  out << gpukit::device::cuda(1) << " " << gpukit::device::cpu();
  CHECK(out.str() == "cuda:1 cpu");
}

TEST_CASE("malformed device strings throw naming the text") {
  for (const char* text : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda:+1", "cuda: 1", "cuda:99999999999",
                           "cuda:0:1", "cpu0"}) {
    CAPTURE(text);
    try {
      (void)gpukit::device::parse(text);
      FAIL("accepted a malformed device string");
    } catch (const gpukit::invalid_argument_error& e) {
      CHECK(std::string(e.what()).find(std::string("\"") + text + "\"") != std::string::npos);
      CHECK(std::string(e.what()).find("cuda:N") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(gpukit::device::cuda(-1), gpukit::invalid_argument_error);
}

TEST_CASE("devices compare, order and hash as values") {
  CHECK(gpukit::device::cuda(0) != gpukit::device::cpu());
  CHECK(gpukit::device::cpu() < gpukit::device::cuda(0));
  CHECK(gpukit::device::cuda(0) < gpukit::device::cuda(1));
  std::unordered_set<gpukit::device> set{gpukit::device::cpu(), gpukit::device::cuda(0), gpukit::device::cuda(0)};
  CHECK(set.size() == 2);
}

TEST_CASE("GPU UUIDs print in nvidia-smi's form") {
  const unsigned char bytes[16] = {0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0,
                                   0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef};
  CHECK(gpukit::detail::format_gpu_uuid(bytes) == "GPU-12345678-9abc-def0-0123-456789abcdef");
}

TEST_CASE("the device range is empty exactly when no device is visible") {
  const auto range = gpukit::cuda_devices();
  CHECK(static_cast<int>(range.size()) == gpukit::device_count());
  int n = 0;
  for (gpukit::device d : range) {
    CHECK(d.ordinal() == n);
    ++n;
  }
  CHECK(n == gpukit::device_count());
}

TEST_CASE("without a driver: count 0 and clear errors from calls that need a GPU") {
  GPUKIT_REQUIRE_NO_GPU();
  CHECK(gpukit::device_count() == 0);
  CHECK(gpukit::cuda_devices().empty());
  CHECK_THROWS_AS(gpukit::current_device(), gpukit::no_device_error);
  try {
    gpukit::device_guard guard(gpukit::device::cuda(0));
    FAIL("a guard for cuda:0 was created without a GPU");
  } catch (const gpukit::no_device_error& e) {
    CHECK(e.cuda_result() != cudaSuccess);
    CHECK(std::string(e.what()).find("0 devices visible") != std::string::npos);
  }
  try {
    gpukit::set_current_device(gpukit::device::cuda(3));
    FAIL("cudaSetDevice(3) succeeded without a GPU");
  } catch (const gpukit::error& e) {
    CHECK(std::string(e.what()).find("cudaSetDevice(3) failed") == 0);
    CHECK(e.device() == 3);
  }
  CHECK_THROWS_AS(gpukit::properties(gpukit::device::cuda(0)), gpukit::no_device_error);
  CHECK_THROWS_AS(gpukit::query_memory_info(gpukit::device::cuda(0)), gpukit::no_device_error);
  CHECK_THROWS_AS(gpukit::stream_priority_range(gpukit::device::cuda(0)), gpukit::no_device_error);
  // With itself as with another device: no GPU, not "cuda:0 is not visible (0 CUDA devices)" (helper-202).
  CHECK_THROWS_AS(gpukit::peer_access(gpukit::device::cuda(0), gpukit::device::cuda(1)), gpukit::no_device_error);
  try {
    gpukit::peer_access self(gpukit::device::cuda(0), gpukit::device::cuda(0));
    FAIL("peer_access of cuda:0 with itself was made without a GPU");
  } catch (const gpukit::no_device_error& e) {
    CHECK(e.call() == "cudaGetDeviceCount");
  }
}

TEST_CASE("without a driver: no driver entry points, so whether contexts exist is unknown") {
  GPUKIT_REQUIRE_NO_GPU();
  const auto& api = gpukit::detail::driver();
  CHECK(!api.ctx_get_current);
  CHECK(!api.primary_ctx_get_state);
  CHECK(&api == &gpukit::detail::driver());  // looked up once
  CHECK(gpukit::detail::thread_context_state() == -1);
  CHECK(gpukit::detail::primary_context_state(0) == -1);
}

TEST_CASE("the CPU has no CUDA state") {
  gpukit::device_guard guard(gpukit::device::cpu());  // no CUDA call, so fine without a driver
  gpukit::set_current_device(gpukit::device::cpu());
  CHECK_THROWS_AS(gpukit::properties(gpukit::device::cpu()), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::query_memory_info(gpukit::device::cpu()), gpukit::invalid_argument_error);
  CHECK(gpukit::stream_priority_range(gpukit::device::cpu()).least == 0);
  CHECK(gpukit::stream_priority_range(gpukit::device::cpu()).greatest == 0);
}

TEST_CASE("device::parse ignores any surrounding whitespace and reads every int ordinal") {
  CHECK(gpukit::device::parse("cuda:1\n") == gpukit::device::cuda(1));
  CHECK(gpukit::device::parse("\r\n\v\fcpu\r\n") == gpukit::device::cpu());
  CHECK(gpukit::device::parse(" cuda \n") == gpukit::device::cuda(0));
  CHECK(gpukit::device::parse("cuda:0007") == gpukit::device::cuda(7));
  // Every ordinal device::cuda accepts round-trips through to_string.
  CHECK(gpukit::device::parse("cuda:2147483647") == gpukit::device::cuda(2147483647));
  CHECK(gpukit::device::parse(gpukit::device::cuda(1234567).to_string()) == gpukit::device::cuda(1234567));
  for (const char* text : {"cuda:2147483648", "cuda:18446744073709551616", "cuda:1\n2", "\n"}) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS(gpukit::device::parse(text), doctest::Contains("cuda:N"), gpukit::invalid_argument_error);
  }
}

TEST_CASE("the device range's iterator claims what it is: input in C++17's terms, forward in C++20's") {
  using iterator = gpukit::device_range::iterator;
  static_assert(std::is_same_v<std::iterator_traits<iterator>::iterator_category, std::input_iterator_tag>);
#if defined(__cpp_lib_ranges) && __cpp_lib_ranges >= 201911L
  static_assert(std::forward_iterator<iterator>);
  static_assert(std::ranges::forward_range<gpukit::device_range>);
#endif
  iterator a(1);
  iterator b = a++;  // multi-pass: copies step independently
  CHECK(*b == gpukit::device::cuda(1));
  CHECK(*a == gpukit::device::cuda(2));
  CHECK(b != a);
  CHECK(++b == a);
}
