// pinned_buffer and host_registration: the CPU-device story (plain memory, no-op registration), ownership, misuse,
// and what happens on a CUDA device without a driver.
#include <gpukit/memory/pinned_buffer.hpp>
#include <gpukit/memory/pinned_registration.hpp>

#include "support.hpp"

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {
const gpukit::device cpu = gpukit::device::cpu();
}

TEST_CASE("a pinned_buffer for the CPU device is plain, page-aligned, writable host memory") {
  gpukit::pinned_buffer<int> b(1000, cpu);
  REQUIRE(b.data() != nullptr);
  CHECK(b.size() == 1000);
  CHECK(b.size_bytes() == 4000);
  CHECK_FALSE(b.empty());
  CHECK_FALSE(b.page_locked());
  CHECK(b.device() == cpu);
  CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 4096 == 0);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int>(i);
  long sum = 0;
  for (int v : b) sum += v;
  CHECK(sum == 999L * 1000 / 2);
  CHECK(b.span().data() == b.data());
  CHECK(b.span().size() == b.size());
  CHECK(b.device_pointer() == b.data());  // on the CPU "device" code reads host memory
}

TEST_CASE("pinned_buffer: zero elements allocate nothing, moves transfer ownership") {
  gpukit::pinned_buffer<double> empty(0, cpu);
  CHECK(empty.data() == nullptr);
  CHECK(empty.empty());
  gpukit::pinned_buffer<double> a(16, cpu);
  double* p = a.data();
  gpukit::pinned_buffer<double> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  CHECK(a.empty());
  gpukit::pinned_buffer<double> c(4, cpu);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.size() == 16);
}

TEST_CASE("pinned_buffer: a size that overflows size_t is invalid_argument_error") {
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  CHECK_THROWS_AS(gpukit::pinned_buffer<std::uint64_t>(huge, cpu), gpukit::invalid_argument_error);
}

TEST_CASE("pinned_flags map to cudaHostAlloc's flag word") {
  gpukit::pinned_flags f;
  CHECK(f.cuda_flags() == cudaHostAllocPortable);
  f.mapped = true;
  f.write_combined = true;
  CHECK(f.cuda_flags() == (cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined));
  CHECK(f.to_string() == "cudaHostAllocPortable|cudaHostAllocMapped|cudaHostAllocWriteCombined");
  CHECK(gpukit::pinned_flags{false, false, false}.to_string() == "cudaHostAllocDefault");
}

TEST_CASE("pinned_buffer for a CUDA device: page-locked with a GPU, no_device_error without") {
  if (gpukit::device_count() == 0) {
    try {
      gpukit::pinned_buffer<int> b(10, gpukit::device::cuda(0));
      FAIL("cudaHostAlloc succeeded without a driver");
    } catch (const gpukit::no_device_error& e) {
      CHECK(std::string(e.what()).find("cudaHostAlloc(40, cudaHostAllocPortable)") == 0);
    }
  } else {
    gpukit::pinned_buffer<int> b(10, gpukit::device::cuda(0));
    CHECK(b.page_locked());
  }
}

TEST_CASE("host_registration is a no-op for the CPU device") {
  std::vector<float> data(1024);
  gpukit::host_registration r(gpukit::span<float>(data), cpu);
  CHECK_FALSE(r.registered());
  CHECK(r.data() == data.data());
  CHECK(r.size_bytes() == 4096);
  CHECK(r.device() == cpu);
  gpukit::host_registration moved(std::move(r));
  CHECK(moved.data() == data.data());
  moved.reset();
  CHECK(moved.data() == nullptr);
}

TEST_CASE("host_registration: null with a size is invalid, an empty range registers nothing") {
  CHECK_THROWS_AS(gpukit::host_registration(nullptr, 64, cpu), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::host_registration(nullptr, 64, gpukit::device::cuda(0)), gpukit::invalid_argument_error);
  gpukit::host_registration empty(nullptr, 0, gpukit::device::cuda(0));  // no CUDA call for an empty range
  CHECK_FALSE(empty.registered());
}

TEST_CASE("host_registration for a CUDA device: registered with a GPU, no_device_error without") {
  std::vector<char> data(1 << 16);
  if (gpukit::device_count() == 0) {
    CHECK_THROWS_AS(gpukit::host_registration(data.data(), data.size(), gpukit::device::cuda(0)),
                    gpukit::no_device_error);
  } else {
    gpukit::host_registration r(data.data(), data.size(), gpukit::device::cuda(0));
    CHECK(r.registered());
  }
}

TEST_CASE("registration_flags map to cudaHostRegister's flag word") {
  gpukit::registration_flags f;
  CHECK(f.cuda_flags() == cudaHostRegisterPortable);
  f.mapped = true;
  f.read_only = true;
  CHECK(f.cuda_flags() == (cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterReadOnly));
}
