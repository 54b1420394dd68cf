// Expandable segments on the simulator: the caching allocator's pages through the driver's virtual memory functions
// (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree), which
// gpukit gets from cudaGetDriverEntryPoint. The simulator enforces their rules: access only to mapped pages with
// access granted, no double mapping, no range freed with pages mapped, physical memory counted against the device.
#include <gpukit/device/detail/peer_registry.hpp>  // the registry lock_at_warnings watches (compiled mode too)
#include <gpukit/device/peer_access.hpp>
#include <gpukit/gpukit.hpp>

#include "call_during_capture.hpp"
#include "cudasim.hpp"
#include "support.hpp"

#include <cuda.h>

#include <chrono>
#include <future>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

gpukit::allocator_options expandable() {
  gpukit::allocator_options o;
  o.expandable_segments = true;
  return o;
}

/// cuMemCreate's properties for memory of visible device `ordinal`, as gpukit's pages have.
CUmemAllocationProp device_memory(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  return prop;
}

}  // namespace

TEST_CASE("vmm: a caching allocator with expandable segments maps device pages on demand and unmaps them") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  std::vector<int> host(3 << 20);  // 12 MiB
  std::iota(host.begin(), host.end(), 0);
  {
    gpukit::device_buffer<int> b(host.size(), s, a);
    CHECK(cudasim::calls("cuMemAddressReserve") == 1);
    CHECK(cudasim::calls("cuMemMap") == 6);  // 12 MiB in pages of 2 MiB
    CHECK(cudasim::device_memory_used(0) == used_before + 12 * MiB);
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(b.data(), host.data(), b.size_bytes(), cudaMemcpyHostToDevice, s.cuda_handle()));
    std::vector<int> back(host.size());
    GPUKIT_CUDA_TRY(cudaMemcpyAsync(back.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.cuda_handle()));
    s.synchronize();
    CHECK(back == host);
    const gpukit::allocator_snapshot snapshot = a.snapshot();
    REQUIRE(snapshot.segments.size() == 1);
    CHECK(snapshot.segments[0].expandable);
    CHECK(snapshot.segments[0].mapped == 12 * MiB);
    CHECK(snapshot.segments[0].size >= 80 * (std::size_t{1} << 30));  // address space, not memory
  }
  CHECK(a.memory_reserved() == 12 * MiB);               // cached: still mapped
  gpukit::device_buffer<int> again(host.size(), s, a);  // reuses the mapped pages
  CHECK(cudasim::calls("cuMemMap") == 6);
  again = gpukit::device_buffer<int>();
  const std::size_t event_waits = cudasim::calls("cudaEventSynchronize");
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::calls("cuMemUnmap") == 6);
  // Once for the run of 6 pages: for an event on the stream that used them, not for the whole device.
  CHECK(cudasim::calls("cudaEventSynchronize") == event_waits + 1);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == 0);
  CHECK(cudasim::calls("cuMemAddressFree") == 1);
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::calls("cudaMalloc") == 0);
}

TEST_CASE("vmm: a stream made after another was destroyed takes over its range, and unmapping waits for its work") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::allocator_options o = expandable();
  o.front_cache = false;
  gpukit::caching_allocator a(d, o);
  gpukit_test::gate g;  // after the allocator: destroyed first, it lets held work go before the allocator waits for it
  const std::size_t reserves = cudasim::calls("cuMemAddressReserve");
  const std::size_t maps = cudasim::calls("cuMemMap");
  const std::size_t range_frees = cudasim::calls("cuMemAddressFree");
  void* p = nullptr;
  cudaStream_t old_handle = nullptr;
  {
    gpukit::stream A(d);
    old_handle = A.cuda_handle();
    p = a.allocate(4 * MiB, A);  // pages 0-1 of A's range
    GPUKIT_CUDA_TRY(cudaMemsetAsync(p, 0, 4 * MiB, A.cuda_handle()));
    a.deallocate(p);
  }
  cudasim::drain_all();  // A's work is done: its range is any stream's without one
  gpukit::stream B(d);
  REQUIRE(B.cuda_handle() == old_handle);  // a new stream on the old handle: a new stream to the allocator
  void* q = a.allocate(4 * MiB, B);
  CHECK(q == p);  // A's mapped pages, in A's range: no new range, no page mapped
  CHECK(cudasim::calls("cuMemAddressReserve") == reserves + 1);
  CHECK(cudasim::calls("cuMemMap") == maps + 2);
  void* more = a.allocate(4 * MiB, B);  // B maps pages in the range it took over
  CHECK(cudasim::calls("cuMemAddressReserve") == reserves + 1);
  CHECK(cudasim::calls("cuMemMap") == maps + 4);
  gpukit::stream C(d);  // B has the range now: C maps its own
  void* other = a.allocate(4 * MiB, C);
  CHECK(cudasim::calls("cuMemAddressReserve") == reserves + 2);
  // B's work on its blocks is held back; empty_cache must wait for it (an event on B, the only stream with free pages:
  // C's block is in use) before unmapping their pages, or the held memsets would write to unmapped pages (a
  // violation). The gate opens as that wait begins.
  g.hold(B);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(q, 1, 4 * MiB, B.cuda_handle()));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(more, 1, 4 * MiB, B.cuda_handle()));
  a.deallocate(q);
  a.deallocate(more);
  const std::size_t waits = cudasim::calls("cudaEventSynchronize");
  const std::size_t unmaps = cudasim::calls("cuMemUnmap");
  cudasim::before_call("cudaEventSynchronize", 1, [&] { g.open(); });
  a.empty_cache();
  CHECK(cudasim::calls("cudaEventSynchronize") > waits);
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 4);  // B's 4 pages
  g.open();  // a regression that waited for nothing fails here, rather than hang in drain_all
  a.deallocate(other);
  a.empty_cache();
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 6);  // C's 2
  CHECK(cudasim::calls("cuMemAddressFree") == range_frees + 2);
  CHECK(a.memory_reserved() == 0);
  cudasim::drain_all();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: empty_cache waits for the pages' stream without the allocator's lock and keeps pages freed meanwhile") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::allocator_options o = expandable();
  o.front_cache = false;  // every call takes the device lock
  gpukit::caching_allocator a(d, o);
  void* first = a.allocate(4 * MiB, s);  // pages 0-1
  void* keep = a.allocate(4 * MiB, s);   // pages 2-3
  void* late = a.allocate(4 * MiB, s);   // pages 4-5
  a.deallocate(first);
  void* during = nullptr;
  const std::size_t waits = cudasim::calls("cudaEventSynchronize");
  const std::size_t unmaps = cudasim::calls("cuMemUnmap");
  // Another thread's calls while the stream is waited for, made deterministic: with the lock held they would never
  // return. `late` is freed after the wait began (on a GPU, work queued then could outlast it), so its pages stay;
  // `during` is in use.
  cudasim::before_call("cudaEventSynchronize", 1, [&] {
    GPUKIT_CUDA_TRY(cudaMemsetAsync(late, 0, 4 * MiB, s.cuda_handle()));
    a.deallocate(late);
    during = a.allocate(2 * MiB, s);  // the first half of first's free block: page 0
  });
  gpukit_test::bounded_calls bounded;  // a wait made with the lock held would never return
  CHECK(bounded.returned_within([&] { a.empty_cache(); }));
  CHECK(cudasim::calls("cudaEventSynchronize") == waits + 1);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == 0);
  CHECK(during == first);
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 1);  // page 1 only: free since before the wait
  CHECK(a.memory_reserved() == 10 * MiB);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(during, 1, 2 * MiB, s.cuda_handle()));  // its page is mapped
  GPUKIT_CUDA_TRY(cudaMemsetAsync(keep, 1, 4 * MiB, s.cuda_handle()));
  s.synchronize();
  CHECK(cudasim::violations().empty());
  a.empty_cache();  // late's pages now
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 3);
  CHECK(a.memory_reserved() == 6 * MiB);
  a.deallocate(during);
  a.deallocate(keep);
  const std::size_t range_frees = cudasim::calls("cuMemAddressFree");
  a.empty_cache();  // the whole range: one wait for its two runs of pages (0, and 2-3)
  CHECK(cudasim::calls("cudaEventSynchronize") == waits + 3);
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 6);
  CHECK(cudasim::calls("cuMemAddressFree") == range_frees + 1);
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("vmm: out of device memory while mapping pages is an out_of_memory_error, and nothing leaks") {
  cudasim::machine_config machine = cudasim::default_machine(1);
  machine.devices[0].total_memory = 64 * MiB;
  machine.context_bytes = 16 * MiB;
  if (!cudasim::configure_or_skip(machine)) return;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  {
    gpukit::caching_allocator a(d, expandable());
    const std::size_t used_before = cudasim::device_memory_used(0);
    void* p = a.allocate(16 * MiB, s);
    std::string message;
    try {
      (void)a.allocate(56 * MiB, s);  // in the 72 MiB range (64 MiB and an eighth), beyond the device
      FAIL("56 MiB more fit in a 64 MiB device holding 16 MiB and a context of 16 MiB");
    } catch (const gpukit::out_of_memory_error& e) {
      message = e.what();
    }
    CHECK(message.find("needs 56.00 MiB more mapped into its expandable segment (28 pages of 2.00 MiB)") !=
          std::string::npos);
    CHECK(message.find("cuda:0") != std::string::npos);
    void* q = a.allocate(8 * MiB, s);  // usable afterwards
    a.deallocate(q);
    a.deallocate(p);
    a.empty_cache();
    CHECK(cudasim::device_memory_used(0) == used_before);
  }
}

TEST_CASE("vmm: a device without virtual memory management falls back to cudaMalloc segments, with a warning") {
  cudasim::machine_config machine = cudasim::default_machine(1);
  machine.devices[0].virtual_memory = false;
  if (!cudasim::configure_or_skip(machine)) return;
  std::vector<std::string> warnings;
  const auto previous = gpukit::set_warning_handler([&](std::string_view m) { warnings.emplace_back(m); });
  {
    const gpukit::device d = gpukit::device::cuda(0);
    gpukit::stream s(d);
    gpukit::caching_allocator a(d, expandable());
    void* p = a.allocate(4 * MiB, s);
    void* q = a.allocate(40 * MiB, s);
    CHECK_FALSE(a.snapshot().segments.front().expandable);
    CHECK(cudasim::calls("cuMemAddressReserve") == 0);
    CHECK(cudasim::calls("cudaMalloc") >= 1);
    a.deallocate(p);
    a.deallocate(q);
  }
  gpukit::set_warning_handler(previous);
  REQUIRE(warnings.size() == 1);  // once, not per allocation
  CHECK(warnings.front().find("no virtual memory management") != std::string::npos);
}

TEST_CASE("vmm: a page granularity the driver refuses falls back to cudaMalloc segments, with a warning") {
  cudasim::fail_call("cuMemGetAllocationGranularity", 1, cudaErrorNotSupported);
  gpukit_test::captured_warnings warnings;
  {
    const gpukit::device d = gpukit::device::cuda(0);
    gpukit::stream s(d);
    gpukit::caching_allocator a(d, expandable());
    void* p = a.allocate(4 * MiB, s);
    void* q = a.allocate(40 * MiB, s);
    CHECK(cudasim::calls("cuMemGetAllocationGranularity") == 1);  // asked once, the answer kept
    CHECK_FALSE(a.snapshot().segments.front().expandable);
    CHECK(cudasim::calls("cuMemAddressReserve") == 0);
    a.deallocate(p);
    a.deallocate(q);
    a.empty_cache();  // the segments go back: nothing leaks
    CHECK(a.memory_reserved() == 0);
  }
  CHECK(warnings.messages().size() == 1);  // once, not per allocation
  CHECK(warnings.contains("no virtual memory management gpukit can use"));
  CHECK(warnings.contains("cuda:0"));
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: expandable segments required where the device has none, or refuses its granularity, are refused") {
  cudasim::machine_config machine = cudasim::default_machine(2);
  machine.devices[1].virtual_memory = false;
  if (!cudasim::configure_or_skip(machine)) return;
  gpukit::allocator_options o = expandable();
  o.expandable_segments_required = true;
  gpukit_test::captured_warnings warnings;
  auto refusal = [&](int ordinal) {
    std::string message = "constructed";
    try {
      gpukit::caching_allocator a(gpukit::device::cuda(ordinal), o);
    } catch (const gpukit::no_device_error& e) {
      message = e.what();
      CHECK(e.device() == ordinal);
    }
    return message;
  };
  const std::string without = refusal(1);
  INFO(without);
  CHECK(without.find("expandable segments are required for the caching allocator of cuda:1") != std::string::npos);
  CHECK(without.find("no virtual memory management gpukit can use") != std::string::npos);
  cudasim::fail_call("cuMemGetAllocationGranularity", 1, cudaErrorNotSupported);
  CHECK(refusal(0).find("of cuda:0") != std::string::npos);
  CHECK(refusal(0) == "constructed");  // asked anew by a new allocator: the device has it
  {
    gpukit::caching_allocator a(gpukit::device::cuda(0), o);
    gpukit::stream s(gpukit::device::cuda(0));
    void* p = a.allocate(4 * MiB, s);
    CHECK(a.snapshot().segments.front().expandable);
    a.deallocate(p);
  }
  CHECK(warnings.messages().empty());
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: expandable segments required: a range that cannot be reserved or sized is an error, not a fallback") {
  gpukit::allocator_options o = expandable();
  o.expandable_segments_required = true;
  gpukit_test::captured_warnings warnings;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, o);
  cudasim::fail_call("cuMemAddressReserve", 1, cudaErrorMemoryAllocation);
  std::string message = "allocated";
  try {
    a.deallocate(a.allocate(4 * MiB, s));
  } catch (const gpukit::out_of_memory_error& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("gpukit: out of memory on cuda:0: tried to allocate 4.00 MiB") == 0);
  CHECK(message.find("but expandable segments are required and a virtual address range of") != std::string::npos);
  CHECK(message.find("could not be reserved") != std::string::npos);
  CHECK(a.stats().num_ooms == 1);
  CHECK(cudasim::calls("cudaMalloc") == 0);  // no ordinary segment instead
  CHECK(a.memory_reserved() == 0);
  // The device's memory size unknown (cudaMemGetInfo failed): no range can be sized, which is an error too.
  cudasim::fail_call("cudaMemGetInfo", 1, cudaErrorUnknown);
  message = "allocated";
  try {
    a.deallocate(a.allocate(4 * MiB, s));
  } catch (const gpukit::no_device_error& e) {
    message = e.what();
    CHECK(e.device() == 0);
  }
  CHECK(message.find("the size of its memory (or its page) is unknown") != std::string::npos);
  CHECK(cudasim::calls("cudaMalloc") == 0);
  (void)cudaGetLastError();
  void* p = a.allocate(4 * MiB, s);  // usable afterwards: the next range is reserved
  CHECK(a.snapshot().segments.front().expandable);
  a.deallocate(p);
  CHECK(warnings.messages().empty());
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: a driver failure reserving a range is an error naming it, not a range refused for good") {
  // Only a range the driver cannot give (out of memory or address space, a size it refuses) falls back or is out of
  // memory; another failure (say, a sticky error) was taken for one: "could not be reserved", and ordinary segments
  // for the allocator's life, or an out-of-memory error, with the CUresult lost (helper-173).
  gpukit_test::captured_warnings warnings;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  cudasim::fail_call("cuMemAddressReserve", 1, cudaErrorUnknown);
  std::string message = "allocated";
  try {
    a.deallocate(a.allocate(4 * MiB, s));
  } catch (const gpukit::cuda_error& e) {
    message = e.what();
    CHECK(e.cuda_result() == cudaErrorUnknown);
    CHECK(e.device() == 0);
  }
  INFO(message);
  CHECK(message.find("cuMemAddressReserve of ") != std::string::npos);
  CHECK(message.find("failed on cuda:0 (CUresult 999)") != std::string::npos);
  CHECK(cudasim::calls("cudaMalloc") == 0);
  CHECK(warnings.messages().empty());  // expandable segments were not given up
  void* p = a.allocate(4 * MiB, s);    // the next growth reserves the range
  CHECK(a.snapshot().segments.front().expandable);
  a.deallocate(p);
  (void)cudaGetLastError();
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: the simulator refuses copies into unmapped pages and ranges freed with pages mapped") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::device_guard guard(d);
  GPUKIT_CUDA_TRY(cudaFree(nullptr));  // a context
  const gpukit::detail::driver_api& api = gpukit::detail::driver();
  REQUIRE(api.has_virtual_memory());
  CUdeviceptr range = 0;
  REQUIRE(api.mem_address_reserve(&range, 8 * MiB, 0, 0, 0) == CUDA_SUCCESS);
  const CUmemAllocationProp prop = device_memory(0);
  CUmemGenericAllocationHandle handle{};
  REQUIRE(api.mem_create(&handle, 2 * MiB, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(api.mem_map(range, 2 * MiB, 0, handle, 0) == CUDA_SUCCESS);
  CHECK(api.mem_map(range, 2 * MiB, 0, handle, 0) == CUDA_ERROR_INVALID_VALUE);  // mapped twice
  std::vector<char> host(4096, 1);
  auto* page0 = reinterpret_cast<void*>(static_cast<std::uintptr_t>(range));
  CHECK(cudaMemcpy(page0, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaErrorIllegalAddress);  // no access
  (void)cudaGetLastError();
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  REQUIRE(api.mem_set_access(range, 2 * MiB, &access, 1) == CUDA_SUCCESS);
  CHECK(cudaMemcpy(page0, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  auto* page1 = reinterpret_cast<void*>(static_cast<std::uintptr_t>(range + 2 * MiB));
  CHECK(cudaMemcpy(page1, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaErrorIllegalAddress);
  (void)cudaGetLastError();
  CHECK(api.mem_address_free(range, 8 * MiB) == CUDA_ERROR_INVALID_VALUE);  // a page is still mapped
  CHECK(api.mem_release(handle) == CUDA_SUCCESS);
  CHECK(api.mem_unmap(range, 2 * MiB) == CUDA_SUCCESS);
  CHECK(api.mem_unmap(range, 2 * MiB) == CUDA_ERROR_INVALID_VALUE);  // unmapped twice
  CHECK(api.mem_address_free(range, 8 * MiB) == CUDA_SUCCESS);
  // The refusals above were recorded as rule violations; this test meant them.
  CHECK(cudasim::take_violations().size() == 5);
}

TEST_CASE("vmm: the simulator unmaps only whole mappings, and frees an allocation mapped twice with its last mapping") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::device_guard guard(d);
  GPUKIT_CUDA_TRY(cudaFree(nullptr));  // a context
  const gpukit::detail::driver_api& api = gpukit::detail::driver();
  REQUIRE(api.has_virtual_memory());
  const std::size_t used_before = cudasim::device_memory_used(0);
  CUdeviceptr range = 0;
  REQUIRE(api.mem_address_reserve(&range, 8 * MiB, 0, 0, 0) == CUDA_SUCCESS);
  const CUmemAllocationProp prop = device_memory(0);
  CUmemGenericAllocationHandle handle{};
  REQUIRE(api.mem_create(&handle, 4 * MiB, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(api.mem_map(range, 4 * MiB, 0, handle, 0) == CUDA_SUCCESS);
  REQUIRE(api.mem_map(range + 4 * MiB, 4 * MiB, 0, handle, 0) == CUDA_SUCCESS);  // the same memory, twice
  CHECK(cudasim::device_memory_used(0) == used_before + 4 * MiB);
  // cuda.h: cuMemUnmap cannot unmap a sub-range of a mapping.
  CHECK(api.mem_unmap(range, 2 * MiB) == CUDA_ERROR_INVALID_VALUE);
  const std::vector<cudasim::violation> refused = cudasim::take_violations();
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].message.find("cuMemUnmap of part of a mapping") != std::string::npos);
  CHECK(api.mem_release(handle) == CUDA_SUCCESS);
  CHECK(api.mem_unmap(range, 4 * MiB) == CUDA_SUCCESS);
  CHECK(cudasim::device_memory_used(0) == used_before + 4 * MiB);  // still mapped at the second address
  CHECK(api.mem_unmap(range + 4 * MiB, 4 * MiB) == CUDA_SUCCESS);
  CHECK(cudasim::device_memory_used(0) == used_before);  // gone with its last mapping
  CHECK(api.mem_address_free(range, 8 * MiB) == CUDA_SUCCESS);
  CHECK(cudasim::violations().empty());
}

TEST_CASE("vmm: driver failures while mapping are clear errors, nothing leaks, and the allocator stays usable") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  // A transient out of memory in cuMemCreate or cuMemMap: released cache, retried, served.
  void* p = nullptr;
  for (const char* call : {"cuMemCreate", "cuMemMap"}) {
    CAPTURE(std::string(call));
    if (p != nullptr) {
      a.deallocate(p);
      a.empty_cache();  // unmaps the pages, so the next request maps again
    }
    const auto retries = a.stats().num_alloc_retries;
    cudasim::fail_call(call, 1, cudaErrorMemoryAllocation);
    p = a.allocate(4 * MiB, s);
    CHECK(a.stats().num_alloc_retries > retries);
  }
  // Any other failure is an error naming the driver call and the device.
  for (const char* call : {"cuMemMap", "cuMemSetAccess", "cuMemCreate"}) {
    CAPTURE(std::string(call));
    a.empty_cache();  // unmaps the free pages, so the next request maps again
    cudasim::fail_call(call, 1, cudaErrorUnknown);
    try {
      (void)a.allocate(6 * MiB, s);
      FAIL("the failure was not reported");
    } catch (const gpukit::cuda_error& e) {
      CHECK(std::string(e.what()).find(call) != std::string::npos);
      CHECK(e.device() == 0);
    }
    void* q = a.allocate(6 * MiB, s);  // usable afterwards
    a.deallocate(q);
  }
  // The driver's result is carried as the runtime error it stands for (it was always cudaErrorUnknown), so a caller
  // can tell a destroyed context from another failure.
  a.empty_cache();
  cudasim::fail_call("cuMemMap", 1, cudaErrorContextIsDestroyed);
  try {
    (void)a.allocate(6 * MiB, s);
    FAIL("the failure was not reported");
  } catch (const gpukit::cuda_error& e) {
    CHECK(e.cuda_result() == cudaErrorContextIsDestroyed);
    CHECK(std::string(e.what()).find("(CUresult 709)") != std::string::npos);
  }
  // A refused reservation (no address space: out of memory): ordinary segments serve the request, and the later
  // ones (said once).
  a.deallocate(p);
  a.empty_cache();
  gpukit_test::captured_warnings warnings;
  const std::size_t reserves_before = cudasim::calls("cuMemAddressReserve");
  cudasim::fail_call("cuMemAddressReserve", 1, cudaErrorMemoryAllocation);
  void* r = a.allocate(4 * MiB, s);
  CHECK_FALSE(a.snapshot().segments.front().expandable);
  gpukit::stream other(d);
  void* t = a.allocate(4 * MiB, other);
  CHECK(cudasim::calls("cuMemAddressReserve") == reserves_before + 1);  // not tried again for `other`
  REQUIRE(warnings.messages().size() == 1);
  CHECK(
      warnings.contains("could not be reserved (this allocator holds 0 B of address space): ordinary segments are "
                        "used from now on"));
  a.deallocate(t);
  a.deallocate(r);
  a.empty_cache();
  CHECK(cudasim::device_memory_used(0) == used_before);  // no page, handle or segment leaked
  CHECK(a.memory_reserved() == 0);
}

TEST_CASE("vmm: pages stay mapped and in use when their stream cannot be waited for before unmapping them") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  void* p = a.allocate(4 * MiB, s);
  void* q = a.allocate(4 * MiB, s);
  a.deallocate(q);
  const std::size_t unmaps = cudasim::calls("cuMemUnmap");
  {
    // trim: the free block's pages are kept, and the allocator learns they are still mapped.
    gpukit_test::captured_warnings warnings;
    cudasim::fail_call("cudaEventSynchronize", 1, cudaErrorUnknown);
    CHECK(a.trim(4 * MiB) == 8 * MiB);
    CHECK(warnings.contains("cudaEventSynchronize (before unmapping pages)"));
    CHECK(warnings.contains("cuda:0"));
  }
  CHECK(cudasim::calls("cuMemUnmap") == unmaps);
  CHECK(a.memory_reserved() == 8 * MiB);
  CHECK(cudasim::device_memory_used(0) == used_before + 8 * MiB);
  const std::size_t maps = cudasim::calls("cuMemMap");
  void* again = a.allocate(4 * MiB, s);  // the kept pages, not new ones: usable and accessible
  CHECK(cudasim::calls("cuMemMap") == maps);
  CHECK(cudasim::accessible_from(0, again));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(again, 1, 4 * MiB, s.cuda_handle()));
  s.synchronize();
  a.deallocate(again);
  CHECK(a.trim(4 * MiB) == 4 * MiB);  // the device answers again: unmapped now
  CHECK(cudasim::calls("cuMemUnmap") == unmaps + 2);
  CHECK(cudasim::device_memory_used(0) == used_before + 4 * MiB);
  a.deallocate(p);
  a.empty_cache();
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: a free segment whose pages cannot be unmapped on empty_cache stays reserved and counted until later") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  void* p = a.allocate(4 * MiB, s);
  a.deallocate(p);
  const std::size_t frees = cudasim::calls("cuMemAddressFree");
  const std::size_t waits = cudasim::calls("cudaEventSynchronize");
  {
    gpukit_test::captured_warnings warnings;
    // Whichever wait the allocator makes fails once (the other stays armed: cleared below).
    cudasim::fail_call("cudaEventSynchronize", 1, cudaErrorUnknown);
    cudasim::fail_call("cudaDeviceSynchronize", 1, cudaErrorUnknown);
    a.empty_cache();
    CHECK(warnings.contains("before unmapping pages"));
  }
  cudasim::clear_faults();
  CHECK(cudasim::calls("cudaEventSynchronize") == waits + 1);  // one wait for the segment's run of pages
  CHECK(cudasim::calls("cuMemAddressFree") == frees);  // never freed with pages mapped (the simulator would object)
  CHECK(cudasim::device_memory_used(0) == used_before + 4 * MiB);
  // Still the allocator's, counted and usable (it was unlinked: 4 MiB mapped for good, memory_reserved() 0).
  CHECK(a.memory_reserved() == 4 * MiB);
  CHECK(a.snapshot().segments.size() == 1);
  void* again = a.allocate(4 * MiB, s);
  CHECK(again == p);
  GPUKIT_CUDA_TRY(cudaMemsetAsync(again, 0, 4 * MiB, s.cuda_handle()));
  a.deallocate(again);
  a.empty_cache();  // a release that can wait: pages and range go
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::calls("cuMemAddressFree") == frees + 1);
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: a page that cuMemUnmap refuses stays mapped: mapping it again keeps it, and the release unmaps it") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  void* p = a.allocate(4 * MiB, s);
  void* q = a.allocate(4 * MiB, s);
  a.deallocate(q);  // two pages, mapped and cached
  const std::size_t maps = cudasim::calls("cuMemMap");
  {
    gpukit_test::captured_warnings warnings;
    cudasim::fail_call("cuMemUnmap", 1, cudaErrorUnknown);  // the first page's unmap fails, the second's succeeds
    CHECK(a.trim(4 * MiB) == 4 * MiB);                      // the allocator counts both unmapped
    CHECK(warnings.contains("cuMemUnmap failed"));
    CHECK(warnings.contains("cuda:0"));
  }
  CHECK(cudasim::device_memory_used(0) == used_before + 6 * MiB);  // the refused page is still there
  // Mapping both pages again maps only the one that went; the kept page is not mapped twice, and both are usable.
  void* again = a.allocate(4 * MiB, s);
  CHECK(cudasim::calls("cuMemMap") == maps + 1);
  CHECK(cudasim::accessible_from(0, again));
  CHECK(cudasim::accessible_from(0, static_cast<char*>(again) + 2 * MiB));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(again, 1, 4 * MiB, s.cuda_handle()));
  s.synchronize();
  CHECK(cudasim::device_memory_used(0) == used_before + 8 * MiB);
  a.deallocate(again);
  a.deallocate(p);
  CHECK(cudasim::take_violations().empty());
  // Refused again, then released: the range's release unmaps the leftover page before freeing the range.
  {
    gpukit_test::captured_warnings warnings;
    cudasim::fail_call("cuMemUnmap", 1, cudaErrorUnknown);
    a.empty_cache();
    CHECK(warnings.contains("cuMemUnmap failed"));
  }
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::take_violations().empty());  // no range freed with a page mapped, no page mapped twice
}

TEST_CASE("vmm: a range whose leftover page still cannot be unmapped stays reserved, with a warning") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  a.deallocate(a.allocate(2 * MiB, s));
  const std::size_t frees = cudasim::calls("cuMemAddressFree");
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cuMemUnmap", 1, cudaErrorUnknown);  // the release's unmap
  cudasim::fail_call("cuMemUnmap", 2, cudaErrorUnknown);  // and its retry
  {
    // Each failure is reported outside the process-wide page registry's lock (a handler may free memory).
    gpukit_test::lock_at_warnings registry(gpukit::mode_independent::peer_access_holders_v2().mutex);
    a.empty_cache();
    CHECK(registry.free_at_each() == std::vector<bool>{true, true, true});
  }
  CHECK(warnings.contains("stays reserved"));
  CHECK(cudasim::calls("cuMemAddressFree") == frees);              // never freed with a page mapped
  CHECK(cudasim::device_memory_used(0) == used_before + 2 * MiB);  // leaked, and said so
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: a range cuMemAddressFree refuses is reported, and the allocator reserves anew") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  a.deallocate(a.allocate(2 * MiB, s));
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cuMemAddressFree", 1, cudaErrorUnknown);
  a.empty_cache();  // the pages go back; the address range cannot
  CHECK(warnings.contains("cuMemAddressFree failed (CUresult "));
  CHECK(a.memory_reserved() == 0);  // no memory: only address space is kept
  CHECK(cudasim::calls("cuMemUnmap") >= 1);
  const std::size_t reserves = cudasim::calls("cuMemAddressReserve");
  void* p = a.allocate(2 * MiB, s);  // a new range: the refused one is not the allocator's any more
  CHECK(cudasim::calls("cuMemAddressReserve") == reserves + 1);
  a.deallocate(p);
  a.empty_cache();
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: a page handle cuMemRelease refuses is an error naming it, the page is unmapped, the allocator usable") {
  // The mapping would keep the page's memory until its unmap; a handle the driver will not release keeps it for good
  // (the simulator keeps it as the driver would). The page goes at once and the request fails clearly: the driver
  // call and the device are named (a warning here would run under the allocator's lock, which handlers may need).
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  const std::size_t used_before = cudasim::device_memory_used(0);
  cudasim::fail_call("cuMemRelease", 1, cudaErrorUnknown);
  try {
    (void)a.allocate(2 * MiB, s);  // one page
    FAIL("the failure was not reported");
  } catch (const gpukit::cuda_error& e) {
    CHECK(std::string(e.what()).find("cuMemRelease failed on cuda:0") != std::string::npos);
    CHECK(e.device() == 0);
  }
  CHECK(a.memory_allocated() == 0);
  void* p = a.allocate(2 * MiB, s);  // usable afterwards, on a page mapped anew
  CHECK(cudaMemsetAsync(p, 1, 2 * MiB, s.cuda_handle()) == cudaSuccess);
  a.deallocate(p, s);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::device_memory_used(0) == used_before + 2 * MiB);  // the handle never released
  CHECK(cudasim::take_violations().empty());
}

namespace {

/// Begins a capture in global mode on a new non-blocking stream (one memset of `scratch` in it).
cudaStream_t begin_global_capture(void* scratch) {
  cudaStream_t cs = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(scratch, 0, MiB, cs) == cudaSuccess);
  return cs;
}

/// Ends the capture begun on `cs` and destroys the stream; the result of cudaStreamEndCapture.
cudaError_t end_capture(cudaStream_t cs) {
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(cs, &g);
  if (g != nullptr) cudaGraphDestroy(g);
  (void)cudaGetLastError();
  cudaStreamDestroy(cs);
  return end;
}

}  // namespace

TEST_CASE("vmm: a release beside another thread's capture waits for the pages' stream, and the capture survives") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  void* scratch = nullptr;
  REQUIRE(cudaMalloc(&scratch, MiB) == cudaSuccess);
  const std::size_t used_before = cudasim::device_memory_used(0);
  void* live = a.allocate(4 * MiB, s);
  a.deallocate(a.allocate(4 * MiB, s));  // free pages beside a live block
  gpukit::stream other(d);
  a.deallocate(a.allocate(8 * MiB, other));  // a whole free range
  // The legacy default stream's too: an event there leaves a capture of a non-blocking stream intact.
  a.deallocate(a.allocate(2 * MiB, gpukit::stream_view::default_stream(d)));
  const cudaStream_t cs = begin_global_capture(scratch);
  const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
  std::thread([&] { a.empty_cache(); }).join();  // an unrelated thread trims the cache meanwhile
  // A device-wide wait fails during the capture (900, relaxed mode too) and invalidates it; cudaFree does not.
  CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
  CHECK(a.memory_reserved() == 4 * MiB);
  CHECK(end_capture(cs) == cudaSuccess);  // it was cudaErrorStreamCaptureInvalidated
  std::thread([&] { a.set_reserved_limit(2 * MiB); }).join();
  a.deallocate(live);
  a.set_reserved_limit(gpukit::allocator_options::unlimited);
  a.empty_cache();
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::take_violations().empty());
  cudaFree(scratch);
}

TEST_CASE("vmm: a raw stream's free pages are not released by a device-wide wait while a gpukit capture runs") {
  // A raw cudaStream_t may have been destroyed, so its pages are waited for with the whole device; during another
  // thread's gpukit::capture that wait would invalidate the capture (900, relaxed mode too): the pages stay instead.
  const gpukit::device d = gpukit::device::cuda(0);
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
  gpukit::caching_allocator a(d, expandable());
  a.deallocate(a.allocate(4 * MiB, gpukit::stream_view(d, raw)));
  const std::size_t reserved = a.memory_reserved();
  REQUIRE(reserved == 4 * MiB);
  gpukit::stream captured(d);
  const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
  const gpukit_test::call_in_capture seen = gpukit_test::call_during_capture(captured, [&] { a.empty_cache(); });
  CHECK(seen.returned);
  CHECK(seen.capture_error.empty());  // the capture was not invalidated
  CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
  CHECK(a.memory_reserved() == reserved);  // kept for a release after the capture
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: a raw stream's free pages are not released by a device-wide wait during a raw blocking capture") {
  // cudaDeviceSynchronize invalidates a capture in any mode (measured on an H100). gpukit cannot see a raw capture of
  // a non-blocking stream, but one of a blocking stream shows in the legacy stream's capture status: the pages stay.
  const gpukit::device d = gpukit::device::cuda(0);
  cudaStream_t raw = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
  cudaStream_t blocking = nullptr;
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  void* scratch = nullptr;
  REQUIRE(cudaMalloc(&scratch, MiB) == cudaSuccess);
  for (const cudaStreamCaptureMode mode :
       {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed}) {
    INFO("capture mode " << static_cast<int>(mode));
    gpukit::caching_allocator a(d, expandable());
    a.deallocate(a.allocate(4 * MiB, gpukit::stream_view(d, raw)));
    REQUIRE(a.memory_reserved() == 4 * MiB);
    REQUIRE(cudaStreamBeginCapture(blocking, mode) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(scratch, 0, MiB, blocking) == cudaSuccess);
    const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
    std::thread([&] {
      cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;  // else a global capture refuses its CUDA calls
      REQUIRE(cudaThreadExchangeStreamCaptureMode(&relaxed) == cudaSuccess);
      a.empty_cache();
    }).join();
    CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
    CHECK(a.memory_reserved() == 4 * MiB);  // kept for a release after the capture
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamEndCapture(blocking, &g) == cudaSuccess);  // it was cudaErrorStreamCaptureInvalidated
    if (g != nullptr) cudaGraphDestroy(g);
    (void)cudaGetLastError();
    a.empty_cache();
    CHECK(a.memory_reserved() == 0);
    CHECK(cudasim::take_violations().empty());
  }
  cudaFree(scratch);
  REQUIRE(cudaStreamDestroy(blocking) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
}

TEST_CASE("vmm: free pages of a stream being captured are waited for by no release: they stay mapped until later") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream captured(d);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  void* scratch = nullptr;
  REQUIRE(cudaMalloc(&scratch, MiB) == cudaSuccess);
  const std::size_t used_before = cudasim::device_memory_used(0);
  a.deallocate(a.allocate(8 * MiB, captured));  // its range: all free
  a.deallocate(a.allocate(4 * MiB, s));
  REQUIRE(cudaStreamBeginCapture(captured.cuda_handle(), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(scratch, 0, MiB, captured.cuda_handle()) == cudaSuccess);
  const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
  // From another thread, and from the capturing one: the captured stream holds no live allocation, so neither
  // empty_cache is refused; an event recorded on it would be the graph's, and the device's wait fails (900) and
  // invalidates the capture.
  std::thread([&] { a.empty_cache(); }).join();
  CHECK(a.memory_reserved() == 8 * MiB);  // s's pages went
  a.empty_cache();
  CHECK(a.memory_reserved() == 8 * MiB);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
  cudaGraph_t g = nullptr;
  CHECK(cudaStreamEndCapture(captured.cuda_handle(), &g) == cudaSuccess);  // it was cudaErrorStreamCaptureInvalidated
  if (g != nullptr) cudaGraphDestroy(g);
  (void)cudaGetLastError();
  a.empty_cache();  // the capture has ended: its pages go now
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::device_memory_used(0) == used_before);
  CHECK(cudasim::take_violations().empty());
  cudaFree(scratch);
}

TEST_CASE("vmm: an allocation does not wait for a captured stream's free pages: out of memory, capture intact") {
  cudasim::machine_config machine = cudasim::default_machine(1);
  machine.devices[0].total_memory = 64 * MiB;
  machine.context_bytes = 16 * MiB;
  if (!cudasim::configure_or_skip(machine)) return;
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream captured(d);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  void* scratch = nullptr;
  REQUIRE(cudaMalloc(&scratch, MiB) == cudaSuccess);
  a.deallocate(a.allocate(32 * MiB, captured));  // cached, mapped: what an allocation on s would need
  REQUIRE(cudaStreamBeginCapture(captured.cuda_handle(), cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(scratch, 0, MiB, captured.cuda_handle()) == cudaSuccess);
  const std::size_t device_waits = cudasim::calls("cudaDeviceSynchronize");
  bool out_of_memory = false;
  std::thread([&] {
    try {
      a.deallocate(a.allocate(32 * MiB, s));
    } catch (const gpukit::out_of_memory_error&) {
      out_of_memory = true;
    }
  }).join();
  CHECK(out_of_memory);
  CHECK(cudasim::calls("cudaDeviceSynchronize") == device_waits);
  CHECK(a.memory_reserved() == 32 * MiB);
  cudaGraph_t g = nullptr;
  CHECK(cudaStreamEndCapture(captured.cuda_handle(), &g) == cudaSuccess);  // it was cudaErrorStreamCaptureInvalidated
  if (g != nullptr) cudaGraphDestroy(g);
  (void)cudaGetLastError();
  void* p = a.allocate(32 * MiB, s);  // the capture has ended: the captured stream's pages go for it
  a.deallocate(p);
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::take_violations().empty());
  cudaFree(scratch);
}

// Warnings raised under the allocator's device lock (its upstream's page mapping and unmapping run there) are
// delivered once the lock is released (device_mutex.hpp): a handler may ask the allocator for a snapshot. It ran with
// the lock held, and such a handler spun for ever (helper-173).
namespace {
/// A warning handler that asks the allocator for its snapshot on another thread and records, per warning, whether
/// that was answered within a second (kept until the end, so a refused one completes once the lock is free).
struct snapshot_at_warnings {
  explicit snapshot_at_warnings(gpukit::caching_allocator& a) : allocator(a) {
    previous = gpukit::set_warning_handler([this](std::string_view message) {
      auto answer = std::async(std::launch::async, [this] { (void)allocator.snapshot(); });
      answered.push_back(answer.wait_for(std::chrono::seconds(1)) == std::future_status::ready);
      messages.emplace_back(message);
      pending.push_back(std::move(answer));
    });
  }
  snapshot_at_warnings(const snapshot_at_warnings&) = delete;
  snapshot_at_warnings& operator=(const snapshot_at_warnings&) = delete;
  ~snapshot_at_warnings() {
    (void)gpukit::set_warning_handler(previous);
    for (auto& p : pending) p.wait();
  }
  gpukit::caching_allocator& allocator;
  gpukit::warning_handler previous;
  std::vector<bool> answered;
  std::vector<std::string> messages;
  std::vector<std::future<void>> pending;
};
}  // namespace

TEST_CASE("vmm: the warning of a page cuMemUnmap refuses reaches the handler outside the allocator's lock") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  a.deallocate(a.allocate(4 * MiB, s));
  s.synchronize();
  {
    snapshot_at_warnings probe(a);
    cudasim::fail_call("cuMemUnmap", 1, cudaErrorUnknown);
    (void)a.trim(0);
    REQUIRE(probe.messages.size() == 1);
    INFO(probe.messages[0]);
    CHECK(probe.messages[0].find("cuMemUnmap failed") != std::string::npos);
    CHECK(probe.answered[0]);
  }
  a.empty_cache();
  CHECK(a.memory_reserved() == 0);
  CHECK(cudasim::take_violations().empty());
}

TEST_CASE("vmm: the warning of a peer grant that fails while pages are mapped reaches the handler outside the lock") {
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator a(d, expandable());
  std::optional<gpukit::peer_access> hold;
  void* p = nullptr;
  {
    snapshot_at_warnings probe(a);
    // A peer hold taken while the page is being mapped: the grant for it fails (the page's own access is granted).
    cudasim::before_call("cuMemMap", 1, [&] { hold.emplace(gpukit::device::cuda(1), d); });
    cudasim::fail_call("cuMemSetAccess", 2, cudaErrorUnknown);
    p = a.allocate(2 * MiB, s);
    REQUIRE(probe.messages.size() == 1);
    INFO(probe.messages[0]);
    CHECK(probe.messages[0].find("cuMemSetAccess") != std::string::npos);
    CHECK(probe.answered[0]);
  }
  a.deallocate(p, s);
  s.synchronize();
  hold.reset();
  a.empty_cache();
  CHECK(cudasim::take_violations().empty());
}
