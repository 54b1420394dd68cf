// device_buffer<T>, device_allocation and the per-device default allocators with their free functions, on the CPU
// device (host memory, CPU streams); and what a CUDA device's default allocator does without a driver.
#include "allocator_support.hpp"
#include "support.hpp"

#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/device_buffer.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/to_device.hpp>

#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using namespace gpukit_test;

namespace {
const gpukit::device cpu = gpukit::device::cpu();

/// A private CPU allocator for a test, so the process-wide default allocator's statistics do not matter.
struct own_allocator {
  gpukit::caching_allocator a{cpu};
};
}  // namespace

static_assert(!std::is_copy_constructible<gpukit::device_buffer<int>>::value, "move-only");
static_assert(std::is_nothrow_move_constructible<gpukit::device_buffer<int>>::value, "noexcept move");
static_assert(std::is_nothrow_move_assignable<gpukit::device_buffer<int>>::value, "noexcept move");
static_assert(!std::is_copy_constructible<gpukit::device_allocation>::value, "move-only");

TEST_CASE("a device_buffer on the CPU: typed, sized, writable through span(), freed on destruction") {
  own_allocator own;
  gpukit::stream s(cpu);
  {
    gpukit::device_buffer<double> b(1000, s, own.a);
    CHECK(b.size() == 1000);
    CHECK(b.size_bytes() == 8000);
    CHECK_FALSE(b.empty());
    CHECK(b.device() == cpu);
    CHECK(b.stream() == s.view());
    CHECK(b.allocator() == &own.a);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 256 == 0);
    gpukit::span<double> view = b.span();
    CHECK(view.data() == b.data());
    CHECK(view.size() == 1000);
    s.enqueue_host([view] {  // memory of the CPU device is used by work on its stream
      for (std::size_t i = 0; i < view.size(); ++i) view[i] = static_cast<double>(i);
    });
    s.synchronize();
    CHECK(b.data()[999] == 999.0);
    const gpukit::device_buffer<double>& cb = b;
    gpukit::span<const double> cview = cb.span();
    CHECK(cview[10] == 10.0);
    CHECK(own.a.memory_allocated() == 8192);  // rounded to 512 bytes
  }
  CHECK(own.a.memory_allocated() == 0);
  CHECK(own.a.memory_reserved() == 2 * MiB);  // cached
}

TEST_CASE("device_buffer moves, reset() and empty buffers") {
  own_allocator own;
  gpukit::stream s(cpu);
  gpukit::device_buffer<int> a(100, s, own.a);
  int* data = a.data();
  gpukit::device_buffer<int> b(std::move(a));
  CHECK(b.data() == data);
  CHECK(a.data() == nullptr);  // NOLINT: moved-from state is specified
  CHECK(a.empty());
  CHECK(a.size() == 0);
  CHECK(a.allocator() == nullptr);
  CHECK(a.device() == cpu);
  CHECK(a.stream() == gpukit::stream_view::default_stream(cpu));  // the moved-from buffer keeps no stream
  CHECK(b.stream() == s.view());
  gpukit::device_buffer<int> c(50, s, own.a);
  c = std::move(b);  // frees c's memory, takes b's
  CHECK(c.data() == data);
  CHECK(own.a.stats().allocation.all().current == 1);
  c.reset();
  CHECK(c.empty());
  CHECK(c.data() == nullptr);
  CHECK(c.allocator() == nullptr);  // empty, as documented: no allocator, no stream
  CHECK(c.stream() == gpukit::stream_view::default_stream(cpu));
  CHECK(own.a.memory_allocated() == 0);
  c.reset();  // resetting an empty buffer is fine
  gpukit::device_buffer<int> zero(0, s, own.a);
  CHECK(zero.empty());
  CHECK(zero.data() == nullptr);
  CHECK(zero.allocator() == &own.a);                     // a zero-size buffer keeps its allocator (and its device)
  CHECK(own.a.stats().allocation.all().allocated == 2);  // the zero-size buffer allocated nothing
  gpukit::device_buffer<int> def;
  CHECK(def.empty());
  gpukit::device_buffer<int> moved_into;
  moved_into = std::move(def);
  CHECK(moved_into.empty());
}

TEST_CASE("device_buffer rejects element counts whose byte size overflows") {
  own_allocator own;
  gpukit::stream s(cpu);
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 4 + 1;
  CHECK_THROWS_AS(gpukit::device_buffer<std::uint32_t>(huge, s, own.a), gpukit::invalid_argument_error);
  CHECK(own.a.stats().num_ooms == 0);
}

TEST_CASE("a buffer whose free fails in its destructor reports through gpukit::warn") {
  own_allocator own;
  gpukit::stream s(cpu);
  captured_warnings warnings;
  {
    gpukit::device_buffer<char> b(100, s, own.a);
    own.a.deallocate(b.data());  // misuse: freed behind the buffer's back
  }                              // the destructor's free is a double free: reported, not thrown, no corruption
  CHECK(warnings.contains("freeing a device_buffer failed"));
  CHECK(warnings.contains("double free"));
  CHECK(check_invariants(own.a.snapshot(), {}, 512) == "");
}

TEST_CASE("device_buffer::reset() reports misuse by throwing") {
  own_allocator own;
  gpukit::stream s(cpu);
  gpukit::device_buffer<char> b(100, s, own.a);
  own.a.deallocate(b.data());
  CHECK_THROWS_AS(b.reset(), gpukit::invalid_argument_error);
}

TEST_CASE("device_buffer::record_stream keeps the memory from reuse until the other stream is done") {
  own_allocator own;
  gpukit::stream s(cpu);
  gpukit::stream other(cpu);
  gate g;
  void* first = nullptr;
  {
    gpukit::device_buffer<float> b(256, s, own.a);
    first = b.data();
    other.enqueue_host([&g] { g.wait(); });
    b.record_stream(other);
  }
  gpukit::device_buffer<float> c(256, s, own.a);
  CHECK(static_cast<void*>(c.data()) != first);
  g.open();
  other.synchronize();
  gpukit::device_buffer<float> d(256, s, own.a);
  CHECK(static_cast<void*>(d.data()) == first);
}

TEST_CASE("device_allocation: raw bytes, unique_ptr-style") {
  own_allocator own;
  gpukit::stream s(cpu);
  gpukit::device_allocation a(1000, s, own.a);
  CHECK(static_cast<bool>(a));
  CHECK(a.size() == 1000);
  CHECK(a.device() == cpu);
  CHECK(a.stream() == s.view());
  CHECK(own.a.owns(a.get()));
  void* p = a.get();
  gpukit::device_allocation b = std::move(a);
  CHECK_FALSE(a);  // NOLINT
  CHECK(b.get() == p);
  b.record_stream(s);
  b.reset();
  CHECK(b.empty());
  CHECK(own.a.memory_allocated() == 0);
  gpukit::device_allocation zero(0, s, own.a);
  CHECK_FALSE(zero);
}

TEST_CASE("the CPU default allocator serves buffers made from a stream alone, and the free functions read it") {
  gpukit::device_allocator& def = gpukit::default_allocator(cpu);
  CHECK(&def == &gpukit::default_allocator(cpu));
  CHECK(def.device() == cpu);
  gpukit::stream s(cpu);
  const std::size_t before = gpukit::memory_allocated(cpu);
  {
    gpukit::device_buffer<std::uint8_t> b(3 * MiB, s);  // large pool
    gpukit::device_allocation raw(1000, s);
    CHECK(b.allocator() == &def);
    CHECK(gpukit::memory_allocated(cpu) == before + 3 * MiB + 1024);
    CHECK(gpukit::memory_reserved(cpu) >= gpukit::memory_allocated(cpu));
    CHECK(gpukit::max_memory_allocated(cpu) >= gpukit::memory_allocated(cpu));
    CHECK(gpukit::memory_stats(cpu).allocation.all().current >= 2);
    const std::string summary = gpukit::memory_summary(cpu);
    CHECK(summary.find("gpukit caching allocator, cpu") != std::string::npos);
    CHECK(summary.find("Allocated memory") != std::string::npos);
    CHECK_FALSE(gpukit::memory_snapshot(cpu).segments.empty());
  }
  CHECK(gpukit::memory_allocated(cpu) == before);
  gpukit::empty_cache(cpu);
  if (before == 0) CHECK(gpukit::memory_reserved(cpu) == 0);
  gpukit::reset_peak_memory_stats(cpu);
  CHECK(gpukit::max_memory_allocated(cpu) == gpukit::memory_allocated(cpu));
  gpukit::reset_accumulated_memory_stats(cpu);
  CHECK(gpukit::memory_stats(cpu).num_device_alloc == 0);
  CHECK(gpukit::max_memory_reserved(cpu) >= gpukit::memory_reserved(cpu));
}

TEST_CASE("the default allocator is created once under concurrent first use") {
  const gpukit::device d = gpukit::device::cuda(17);  // not used by any other test; needs no driver to create
  std::vector<gpukit::device_allocator*> seen(8);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&seen, i, d] { seen[i] = &gpukit::default_allocator(d); });
  }
  for (auto& t : threads) t.join();
  CHECK(std::set<gpukit::device_allocator*>(seen.begin(), seen.end()).size() == 1);
  CHECK(seen[0]->device() == d);
}

TEST_CASE("the default allocator can be replaced and the previous one is handed back") {
  const gpukit::device d = gpukit::device::cuda(40);
  auto mine = std::make_shared<gpukit::caching_allocator>(d);
  auto previous = gpukit::set_default_allocator(d, mine);
  CHECK(&gpukit::default_allocator(d) == mine.get());
  CHECK_THROWS_AS((void)gpukit::set_default_allocator(d, std::make_shared<gpukit::caching_allocator>(cpu)),
                  gpukit::invalid_argument_error);
  auto back = gpukit::set_default_allocator(d, nullptr);  // the next use creates a fresh one
  CHECK(back.get() == mine.get());
  CHECK(&gpukit::default_allocator(d) != mine.get());
  gpukit::allocator_options o;
  o.rounding = 1024;
  CHECK_FALSE(gpukit::set_default_allocator_options(d, o));  // already created
  const gpukit::device fresh = gpukit::device::cuda(41);
  CHECK(gpukit::set_default_allocator_options(fresh, o));
  auto* created = dynamic_cast<gpukit::caching_allocator*>(&gpukit::default_allocator(fresh));
  REQUIRE(created != nullptr);
  CHECK(created->engine().options().rounding == 1024);
  // A device beyond the lock-free slots works too.
  const gpukit::device far = gpukit::device::cuda(100);
  CHECK(&gpukit::default_allocator(far) == &gpukit::default_allocator(far));
}

TEST_CASE("a CUDA device's default allocator exists without a driver, and allocating there reports no device") {
  if (gpukit::device_count() > 0) {
    MESSAGE("a GPU is present: the driverless behaviour is not observable here");
    return;
  }
  const gpukit::device d = gpukit::device::cuda(0);
  CHECK(gpukit::memory_allocated(d) == 0);  // creating the allocator makes no CUDA call
  CHECK(gpukit::memory_reserved(d) == 0);
  gpukit::empty_cache(d);
  CHECK(gpukit::memory_summary(d).find("cuda:0") != std::string::npos);
  const auto s = gpukit::stream_view::default_stream(d);
  CHECK_THROWS_AS(gpukit::device_buffer<int>(10, s), gpukit::no_device_error);
  CHECK(gpukit::memory_stats(d).num_ooms == 0);  // not an out-of-memory condition
  CHECK(gpukit::memory_reserved(d) == 0);
  CHECK_THROWS_AS(gpukit::set_per_device_memory_fraction(0.5, d), gpukit::invalid_argument_error);  // total unknown
  gpukit::set_reserved_memory_limit(GiB, d);
  CHECK(gpukit::memory_stats(d).reserved_limit == GiB);
  gpukit::set_reserved_memory_limit(gpukit::allocator_options::unlimited, d);
}

TEST_CASE("a buffer cannot be allocated from an allocator of another device") {
  gpukit::caching_allocator cuda_allocator(gpukit::device::cuda(3));
  gpukit::stream s(cpu);
  try {
    gpukit::device_buffer<int> b(10, s, cuda_allocator);
    FAIL("expected an exception");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("wrong device") != std::string::npos);
  }
}

TEST_CASE("memory statistics as PyTorch's flat map: every key of torch.cuda.memory_stats() that gpukit keeps") {
  own_allocator own;
  gpukit::stream s(cpu);
  void* small = own.a.allocate(1000, s);
  void* large = own.a.allocate(3 << 20, s);
  own.a.deallocate(small);
  const gpukit::allocator_stats stats = own.a.stats();
  const auto flat = gpukit::flat_memory_stats(stats);
  CHECK(flat.size() == 9 * 3 * 4 + 7);  // PyTorch's 5 counters, num_device_free_unforced and num_lock_waits
  CHECK(flat.at("allocated_bytes.all.current") == stats.allocated_bytes.all().current);
  CHECK(flat.at("allocated_bytes.all.current") == static_cast<std::int64_t>(own.a.memory_allocated()));
  CHECK(flat.at("allocated_bytes.large_pool.peak") == stats.allocated_bytes.large().peak);
  CHECK(flat.at("allocation.small_pool.allocated") == 1);
  CHECK(flat.at("allocation.small_pool.freed") == 1);
  CHECK(flat.at("allocation.all.current") == 1);
  CHECK(flat.at("reserved_bytes.all.current") == static_cast<std::int64_t>(own.a.memory_reserved()));
  CHECK(flat.at("requested_bytes.large_pool.current") == (3 << 20));
  CHECK(flat.at("segment.all.current") == stats.segment.all().current);
  CHECK(flat.at("inactive_split_bytes.all.current") == stats.inactive_split_bytes.all().current);
  CHECK(flat.at("num_device_alloc") == stats.num_device_alloc);
  CHECK(flat.at("num_ooms") == 0);
  CHECK(flat.count("num_sync_all_streams") == 1);
  CHECK(flat.count("num_device_free_unforced") == 1);
  CHECK(flat.at("num_lock_waits") == stats.num_lock_waits);
  CHECK(flat.begin()->first == "active.all.allocated");  // sorted by key, as PyTorch's OrderedDict
  own.a.deallocate(large);
  const auto defaults = gpukit::memory_stats_map(cpu);
  CHECK(defaults.at("allocated_bytes.all.current") == static_cast<std::int64_t>(gpukit::memory_allocated(cpu)));
}

TEST_CASE("buffers and to_device given a device use the thread's current stream of it") {
  gpukit::stream s(cpu);
  {
    gpukit::device_buffer<int> on_default(10, cpu);
    CHECK(on_default.stream() == gpukit::stream_view::default_stream(cpu));
    gpukit::device_allocation raw_default(64, cpu);
    CHECK(raw_default.stream() == gpukit::stream_view::default_stream(cpu));
  }
  gpukit::stream_guard guard(s);
  gpukit::device_buffer<int> b(10, cpu);
  CHECK(b.stream() == s.view());
  CHECK(b.allocator() == &gpukit::default_allocator(cpu));
  gpukit::device_allocation raw(64, cpu);
  CHECK(raw.stream() == s.view());
  const std::vector<float> host{1, 2, 3};
  gpukit::device_buffer<float> copy = gpukit::to_device(host, cpu);
  CHECK(copy.stream() == s.view());
  s.synchronize();
  CHECK(copy.span()[2] == 3.0f);
}

TEST_CASE("a device_buffer of an over-aligned type is aligned for it") {
  struct alignas(1024) page_aligned {
    unsigned char bytes[1024];
  };
  own_allocator own;
  gpukit::stream s(cpu);
  void* first = own.a.allocate(512, s);  // moves the next block off a 1024-byte boundary
  {
    gpukit::device_buffer<page_aligned> b(3, s, own.a);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % 1024 == 0);
    CHECK(own.a.owns(b.data()));
    b.record_stream(s);
  }
  own.a.deallocate(first);
  CHECK(own.a.memory_allocated() == 0);
}

TEST_CASE("device_allocation with an alignment, and a device_buffer's memory as its device_allocation") {
  gpukit::stream s(cpu);
  gpukit::device_allocation a(1000, 4096, s, gpukit::default_allocator(cpu));
  CHECK(reinterpret_cast<std::uintptr_t>(a.get()) % 4096 == 0);
  CHECK(a.size() == 1000);
  CHECK(gpukit::default_allocator(cpu).owns(a.get()));
  CHECK_THROWS_AS(gpukit::device_allocation(10, 3, s, gpukit::default_allocator(cpu)), gpukit::invalid_argument_error);
  gpukit::device_buffer<double> b(10, s);
  CHECK(b.allocation().get() == b.data());
  CHECK(b.allocation().size() == b.size_bytes());
  CHECK(b.allocation().stream() == b.stream());
  gpukit::device_buffer<double> moved(std::move(b));
  CHECK(moved.size() == 10);
  CHECK(b.allocation().empty());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
}
