// thrust_allocator (thrust_allocator.hpp) under Thrust's CPP device system, compiled by the C++ compiler: Thrust's
// containers then touch the memory from the host, which is right for the CPU device and for the simulated runtime
// (its device memory is host memory), so the allocator's plumbing (stream order, alignment, statistics, rebinding)
// is tested here without a GPU. On a real GPU the CUDA system is needed: gpu_thrust_test.cu, built with nvcc.
#include <gpukit/memory/thrust_allocator.hpp>

#include "arena_resource.hpp"
#include "support.hpp"

#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>

#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <thrust/sort.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

static_assert(THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CPP, "this test touches device memory from the host");

namespace {
template <class T>
using gpukit_vector = thrust::device_vector<T, gpukit::thrust_allocator<T>>;

/// A device_vector on `allocator` and `s`: filled from the host, sorted, read back; memory freed with the vector.
void exercise(gpukit::device_allocator& allocator, gpukit::stream_view s) {
  const std::size_t before = allocator.memory_allocated();
  {
    thrust::host_vector<int> h(10000);
    for (int i = 0; i < 10000; ++i) h[static_cast<std::size_t>(i)] = 10000 - i;
    gpukit_vector<int> v(h.begin(), h.end(), gpukit::thrust_allocator<int>(allocator, s));
    CHECK(v.get_allocator().stream() == s);
    CHECK(allocator.owns(thrust::raw_pointer_cast(v.data())));
    CHECK(allocator.memory_allocated() >= before + 10000 * sizeof(int));
    thrust::sort(v.begin(), v.end());
    thrust::host_vector<int> back = v;
    CHECK(back[0] == 1);
    CHECK(back[9999] == 10000);
    v.resize(50000, 7);  // reallocates through the allocator
    CHECK(v[49999] == 7);
  }
  CHECK(allocator.memory_allocated() == before);
}
}  // namespace

TEST_CASE("thrust_allocator backs a device_vector with a caching allocator on a stream (CPU device)") {
  gpukit::caching_allocator allocator(gpukit::device::cpu());
  gpukit::stream s(gpukit::device::cpu());
  exercise(allocator, s);
  CHECK(allocator.stats().num_alloc_retries == 0);
}

TEST_CASE("thrust_allocator over a resource of one's own (a device_resource without statistics)") {
  gpukit_test::arena_resource arena;
  gpukit::stream s(gpukit::device::cpu());
  {
    gpukit_vector<int> v(1000, 5, gpukit::thrust_allocator<int>(arena, s));
    CHECK(&v.get_allocator().allocator() == &arena);
    CHECK(arena.owns(thrust::raw_pointer_cast(v.data())));
    v.resize(100000, 6);  // reallocates through the resource
    CHECK(v[99999] == 6);
    CHECK(arena.live() == 1);
  }
  CHECK(arena.live() == 0);
}

TEST_CASE("thrust_allocator: defaults, rebinding, equality, alignment and overflow") {
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::stream s(cpu);
  {
    gpukit::stream_guard guard(s);
    gpukit::thrust_allocator<double> by_stream(s);
    CHECK(&by_stream.allocator() == &gpukit::default_allocator(cpu));
  }
  gpukit::caching_allocator allocator(cpu);
  gpukit::thrust_allocator<char> chars(allocator, s);
  gpukit::thrust_allocator<double> doubles(chars);  // rebound: same allocator and stream
  CHECK(&doubles.allocator() == &allocator);
  CHECK(doubles.stream() == s.view());
  CHECK(chars == gpukit::thrust_allocator<char>(allocator, s));
  gpukit::stream other(cpu);
  CHECK(chars == gpukit::thrust_allocator<char>(allocator, other));  // memory may be freed on either stream
  gpukit::caching_allocator another(cpu);
  CHECK(chars != gpukit::thrust_allocator<char>(another, s));
  struct alignas(1024) wide {
    char bytes[1024];
  };
  gpukit::thrust_allocator<wide> wides(allocator, s);
  auto p = wides.allocate(3);
  CHECK(reinterpret_cast<std::uintptr_t>(thrust::raw_pointer_cast(p)) % 1024 == 0);
  wides.deallocate(p, 3);
  CHECK_THROWS_AS((void)doubles.allocate(std::numeric_limits<std::size_t>::max() / 4), gpukit::invalid_argument_error);
  CHECK(allocator.memory_allocated() == 0);
}

TEST_CASE("vectors on two streams of one allocator swap and move their storage") {
  gpukit::caching_allocator allocator(gpukit::device::cpu());
  gpukit::stream s1(gpukit::device::cpu());
  gpukit::stream s2(gpukit::device::cpu());
  {
    gpukit_vector<int> a(100, 1, gpukit::thrust_allocator<int>(allocator, s1));
    gpukit_vector<int> b(200, 2, gpukit::thrust_allocator<int>(allocator, s2));
    a.swap(b);
    CHECK(a.size() == 200);
    CHECK(b[99] == 1);
    a = std::move(b);
    CHECK(a.size() == 100);
  }
  s1.synchronize();
  s2.synchronize();
  CHECK(allocator.memory_allocated() == 0);
}

// Thrust moves and swaps a vector's storage without asking whether the allocators are equal: the allocator must go
// with the memory (propagate_on_container_move_assignment, ..._swap), or the memory is freed through another
// allocator, which refuses it (leaked), or an arena that cannot tell takes memory that is not its own (helper-203).
TEST_CASE("vectors of two allocators moved and swapped give their memory back to the allocator it came from") {
  gpukit::caching_allocator first(gpukit::device::cpu());
  gpukit::caching_allocator second(gpukit::device::cpu());
  gpukit_test::arena_resource one;
  gpukit_test::arena_resource two;
  gpukit::stream s(gpukit::device::cpu());
  gpukit_test::captured_warnings warnings;
  {
    gpukit_vector<int> a(100, 1, gpukit::thrust_allocator<int>(first, s));
    gpukit_vector<int> b(200, 2, gpukit::thrust_allocator<int>(second, s));
    b = std::move(a);
    CHECK(b.size() == 100);
    CHECK(&b.get_allocator().allocator() == &first);
    gpukit_vector<int> c(300, 3, gpukit::thrust_allocator<int>(second, s));
    b.swap(c);
    CHECK(b.size() == 300);
    CHECK(&c.get_allocator().allocator() == &first);
    gpukit_vector<int> d(100, 1, gpukit::thrust_allocator<int>(one, s));
    gpukit_vector<int> e(200, 2, gpukit::thrust_allocator<int>(two, s));
    e = std::move(d);
  }
  s.synchronize();
  CHECK(warnings.messages().empty());
  CHECK(first.memory_allocated() == 0);
  CHECK(second.memory_allocated() == 0);
  CHECK(one.live() == 0);
  CHECK(two.live() == 0);
}

namespace {
template <class A, class B, class = void>
struct equality_comparable : std::false_type {};
template <class A, class B>
struct equality_comparable<A, B, std::void_t<decltype(std::declval<const A&>() == std::declval<const B&>())>>
    : std::true_type {};
}  // namespace

// [allocator.requirements]: a == b holds for b of a rebound type (the base class's operator== made it ambiguous).
TEST_CASE("thrust_allocator compares with its rebound types") {
  static_assert(equality_comparable<gpukit::thrust_allocator<int>, gpukit::thrust_allocator<float>>::value);
  gpukit::caching_allocator first(gpukit::device::cpu());
  gpukit::caching_allocator second(gpukit::device::cpu());
  gpukit::stream s(gpukit::device::cpu());
  const gpukit::thrust_allocator<int> ints(first, s);
  CHECK(ints == gpukit::thrust_allocator<float>(first, s));
  CHECK(ints != gpukit::thrust_allocator<float>(second, s));
  CHECK(ints == gpukit::thrust_allocator<int>(first, gpukit::stream_view(s)));
  CHECK_FALSE(ints != gpukit::thrust_allocator<double>(ints));
}

TEST_CASE("thrust_allocator reports a bad free through gpukit::warn instead of throwing from a destructor") {
  gpukit::caching_allocator allocator(gpukit::device::cpu());
  gpukit::stream s(gpukit::device::cpu());
  gpukit::thrust_allocator<int> a(allocator, s);
  auto p = a.allocate(10);
  a.deallocate(p, 10);
  gpukit_test::captured_warnings warnings;
  a.deallocate(p, 10);  // freed twice: reported, not thrown
  CHECK(warnings.contains("thrust_allocator::deallocate"));
}

TEST_CASE("sim: thrust_allocator on cuda:0 of the simulated runtime") {
  GPUKIT_REQUIRE_GPU();
  if (!gpukit_test::on_simulator()) {
    std::printf(
        "GPUKIT_TEST_NOT_APPLICABLE: Thrust's CPP system cannot touch a real GPU's memory (gpu_thrust_test.cu does)\n");
    return;
  }
  const gpukit::device d = gpukit::device::cuda(0);
  gpukit::stream s(d);
  gpukit::caching_allocator allocator(d);
  exercise(allocator, s);
  exercise(gpukit::default_allocator(d), s);
  s.synchronize();
}
