// device_resource: a resource of one's own (five functions, no statistics) backs buffers, over-aligned memory and
// the std::pmr adaptor; device_allocator is a device_resource with statistics and control.
#include "arena_resource.hpp"
#include "support.hpp"

#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/memory/pmr.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <type_traits>
#include <vector>

static_assert(!std::is_abstract_v<gpukit_test::arena_resource>, "five functions and device() make a resource");
static_assert(!std::is_base_of_v<gpukit::device_allocator, gpukit_test::arena_resource>, "no statistics asked");
static_assert(std::is_base_of_v<gpukit::device_resource, gpukit::device_allocator>, "allocators are resources");
static_assert(
    std::is_same_v<decltype(std::declval<gpukit::device_allocation&>().allocator()), gpukit::device_resource*>,
    "buffers hold any resource");

namespace {
const gpukit::device cpu = gpukit::device::cpu();
bool aligned_to(const void* p, std::size_t alignment) { return reinterpret_cast<std::uintptr_t>(p) % alignment == 0; }
}  // namespace

TEST_CASE("a resource of one's own backs buffers, over-aligned memory and std::pmr containers") {
  gpukit_test::arena_resource arena;
  gpukit::stream s(cpu);
  {
    gpukit::device_buffer<int> buffer(1000, s, arena);
    CHECK(buffer.allocator() == &arena);
    CHECK(buffer.device() == cpu);
    CHECK(arena.live() == 1);
    std::memset(buffer.data(), 0, buffer.size_bytes());
    CHECK(arena.owns(buffer.data()));
  }
  CHECK(arena.live() == 0);

  // Over-aligned requests are device_resource's work: the resource sees a larger block at its own alignment.
  void* p = arena.allocate(100, 4096, s);
  CHECK(aligned_to(p, 4096));
  CHECK(arena.owns(p));
  arena.record_stream(p, s);
  arena.deallocate(p, s);
  CHECK(arena.live() == 0);
  CHECK(arena.stream_frees() == 1);

  {
    gpukit::device_pmr_resource pmr(arena, s.view());
    CHECK(&pmr.allocator() == &arena);
    std::pmr::vector<int> v(5000, 3, &pmr);
    CHECK(v[4999] == 3);
    CHECK(arena.live() == 1);
  }
  CHECK(arena.live() == 0);
}

TEST_CASE("a pmr container outliving the current stream it was allocated on is freed, on the allocation's stream") {
  // current_stream() refuses a stream destroyed while current; the pmr resource then frees on the stream the
  // memory was allocated on (which the allocator keeps), instead of leaking it.
  gpukit_test::arena_resource arena;
  gpukit_test::captured_warnings warnings;
  gpukit::device_pmr_resource pmr(arena);  // no stream: the current one
  auto s = std::make_unique<gpukit::stream>(cpu);
  gpukit::set_current_stream(*s);
  {
    std::pmr::vector<int> v(1000, 3, &pmr);
    s.reset();
  }
  CHECK(arena.live() == 0);
  CHECK(warnings.messages().empty());
  gpukit::set_current_stream(gpukit::stream_view::default_stream(cpu));
}

TEST_CASE("bad input through a resource of one's own is a clear error, and nothing leaks") {
  gpukit_test::arena_resource arena;
  gpukit::stream s(cpu);
  CHECK_THROWS_AS((void)arena.allocate(100, 48, s), gpukit::invalid_argument_error);  // not a power of two
  void* p = arena.allocate(100, s);
  arena.deallocate(p);
  CHECK_THROWS_AS(arena.deallocate(p), gpukit::invalid_argument_error);  // the resource's own check
  void* q = arena.allocate(100, 8192, s);
  arena.deallocate(q);
  CHECK_THROWS_AS(arena.deallocate(q), gpukit::invalid_argument_error);  // over-aligned: forgotten after the free
  int not_from_the_arena = 0;
  CHECK_THROWS_AS(arena.record_stream(&not_from_the_arena, s), gpukit::invalid_argument_error);
  CHECK(arena.allocate(0, s) == nullptr);
  CHECK(arena.live() == 0);
}
