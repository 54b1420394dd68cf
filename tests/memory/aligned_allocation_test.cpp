// Aligned allocation through device_allocator (over-aligned requests served inside a larger block) and the
// std::pmr adaptors (pmr.hpp), on the CPU device.
#include "allocator_support.hpp"
#include "support.hpp"

#include <gpukit/memory/caching_allocator_impl.hpp>
#include <gpukit/memory/default_allocator.hpp>
#include <gpukit/memory/detail/pinned_aligned.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/memory/pinned_pool_impl.hpp>  // pools and allocators over the tests' upstreams, in the compiled mode
#include <gpukit/memory/pmr.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/current_stream.hpp>
#include <gpukit/stream/stream.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <memory_resource>
#include <string>
#include <thread>
#include <vector>

using namespace gpukit_test;

namespace {
const gpukit::device cpu = gpukit::device::cpu();

bool aligned_to(const void* p, std::size_t alignment) { return reinterpret_cast<std::uintptr_t>(p) % alignment == 0; }
}  // namespace

TEST_CASE("allocate with an alignment up to the natural one costs nothing extra") {
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  CHECK(a.natural_alignment() == 256);
  for (std::size_t alignment : {1, 2, 8, 64, 256}) {
    void* p = a.allocate(1000, alignment, s);
    CHECK(aligned_to(p, alignment));
    CHECK(a.owns(p));
    CHECK(a.memory_allocated() == a.engine().rounded_size(1000));
    a.deallocate(p);
    CHECK(a.memory_allocated() == 0);
  }
}

TEST_CASE("an over-aligned allocation is aligned, owned, freed and counted with its extra bytes") {
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  // A first small block moves the next one off any large boundary, so over-alignment has to shift the address.
  void* first = a.allocate(512, s);
  for (std::size_t alignment : {std::size_t{512}, std::size_t{4096}, std::size_t{1} << 16, std::size_t{1} << 20}) {
    CAPTURE(alignment);
    void* p = a.allocate(3000, alignment, s);
    REQUIRE(p != nullptr);
    CHECK(aligned_to(p, alignment));
    CHECK(a.owns(p));
    std::memset(p, 0x5a, 3000);  // all of it is usable
    CHECK(a.memory_allocated() >= 512 + 3000);
    CHECK(a.memory_allocated() <= 512 + a.engine().rounded_size(3000 + alignment - 256));
    a.record_stream(p, s);
    a.deallocate(p);
    CHECK_FALSE(a.owns(p));
    CHECK(a.memory_allocated() == 512);
  }
  a.deallocate(first);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("over-aligned allocations freed on a stream, and many of them live at once") {
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  gpukit::stream other(cpu);
  std::vector<void*> live;
  for (int i = 0; i < 64; ++i) live.push_back(a.allocate(100 + static_cast<std::size_t>(i), 2048, s));
  for (void* p : live) CHECK(aligned_to(p, 2048));
  for (std::size_t i = 0; i < live.size(); ++i) {
    if (i % 2 == 0) {
      a.deallocate(live[i], other);
    } else {
      a.deallocate(live[i]);
    }
  }
  CHECK(a.memory_allocated() == 0);
  CHECK(a.snapshot().stats.allocation.all().current == 0);
}

TEST_CASE("bad alignments, overflow and double frees of over-aligned memory are clear errors") {
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  for (std::size_t alignment : {std::size_t{0}, std::size_t{3}, std::size_t{768}}) {
    CAPTURE(alignment);
    try {
      (void)a.allocate(100, alignment, s);
      FAIL("no error");
    } catch (const gpukit::invalid_argument_error& e) {
      CHECK(std::string(e.what()).find("power of two, not " + std::to_string(alignment)) != std::string::npos);
    }
  }
  CHECK_THROWS_AS((void)a.allocate(std::numeric_limits<std::size_t>::max() - 100, 4096, s),
                  gpukit::invalid_argument_error);
  CHECK(a.allocate(0, 4096, s) == nullptr);
  void* p = a.allocate(100, 4096, s);
  a.deallocate(p);
  CHECK_THROWS_AS(a.deallocate(p), gpukit::invalid_argument_error);
  CHECK(a.memory_allocated() == 0);
  // Still usable afterwards.
  void* q = a.allocate(100, 8192, s);
  CHECK(aligned_to(q, 8192));
  // Freed through another allocator: refused, and the message names the pointer given, not only the block's start
  // (an address the caller never saw; helper-203). The allocation stays live and is freed by its own allocator.
  gpukit::caching_allocator other(cpu);
  try {
    other.deallocate(q);
    FAIL("another allocator freed the over-aligned allocation");
  } catch (const gpukit::invalid_argument_error& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK(message.find("over-aligned address " + gpukit::detail::format_pointer(q)) != std::string::npos);
  }
  CHECK(a.owns(q));
  a.deallocate(q);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("an over-aligned request that does not fit says what was asked, and the block it needed") {
  // The engine sees only the padded block: its message named 9 MiB for a request of 1 MiB aligned to 8 MiB.
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  a.set_reserved_limit(std::size_t{4} << 20);
  try {
    (void)a.allocate(std::size_t{1} << 20, std::size_t{1} << 23, s);
    FAIL("no error");
  } catch (const gpukit::out_of_memory_error& e) {
    const std::string what = e.what();
    CHECK(what.find("(1048576 bytes aligned to 8388608) asked for a block of 9436928 bytes") != std::string::npos);
    CHECK(what.find("9.00 MiB") != std::string::npos);  // the engine's own account follows
    CHECK(e.code() == gpukit::errc::out_of_memory);
  }
  void* p = a.allocate(100, 4096, s);  // usable afterwards
  CHECK(aligned_to(p, 4096));
  a.deallocate(p);
}

TEST_CASE("a smaller rounding lowers the natural alignment, and larger requests are still honoured") {
  gpukit::allocator_options options;
  options.rounding = 64;
  gpukit::caching_allocator a(cpu, options);
  gpukit::stream s(cpu);
  CHECK(a.natural_alignment() == 64);
  std::vector<void*> live;
  for (int i = 0; i < 8; ++i) live.push_back(a.allocate(64, 256, s));
  for (void* p : live) CHECK(aligned_to(p, 256));
  for (void* p : live) a.deallocate(p);
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("pinned_pmr_resource backs standard containers and pool resources, whatever alignment they ask") {
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  gpukit::pinned_pmr_resource pinned(pool);
  {
    std::pmr::vector<int> v(1000, 7, &pinned);
    CHECK(v[999] == 7);
    CHECK(pool.stats().allocated_bytes > 0);
    // libstdc++'s pool resource asks its upstream for large alignments.
    std::pmr::unsynchronized_pool_resource pooled(&pinned);
    std::pmr::vector<double> w(&pooled);
    for (int i = 0; i < 10000; ++i) w.push_back(i);
    CHECK(w[9999] == 9999);
    void* big = pinned.allocate(100, std::size_t{1} << 16);
    CHECK(aligned_to(big, std::size_t{1} << 16));
    pinned.deallocate(big, 100, std::size_t{1} << 16);
  }
  CHECK(pool.stats().allocated_bytes == 0);
  CHECK(pinned.is_equal(pinned));
  gpukit::pinned_pmr_resource same_pool(pool);
  CHECK(pinned.is_equal(same_pool));
  gpukit::pinned_pool other_pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  gpukit::pinned_pmr_resource other(other_pool);
  CHECK_FALSE(pinned.is_equal(other));
  CHECK_FALSE(pinned.is_equal(*std::pmr::new_delete_resource()));
  void* empty = pinned.allocate(0);  // std::pmr wants memory for 0 bytes too
  CHECK(empty != nullptr);
  pinned.deallocate(empty, 0);
  {
    gpukit_test::captured_warnings warnings;  // std::pmr's deallocate throws nothing: reported instead
    pinned.deallocate(empty, 0);
    CHECK(warnings.contains("pinned_pmr_resource::deallocate"));
  }
  std::size_t not_a_power_of_two = 3;  // a variable: clang refuses the constant at compile time
  CHECK_THROWS_AS((void)pinned.allocate(100, not_a_power_of_two), gpukit::invalid_argument_error);
}

TEST_CASE("device_pmr_resource orders on its stream, or the thread's current one") {
  gpukit::caching_allocator a(cpu);
  gpukit::stream s(cpu);
  {
    gpukit::device_pmr_resource on_stream(a, s.view());
    void* p = on_stream.allocate(4096, 512);
    CHECK(aligned_to(p, 512));
    CHECK(a.memory_allocated() >= 4096);  // 512 is over the natural 256: up to 256 more
    on_stream.deallocate(p, 4096, 512);
    CHECK(a.memory_allocated() == 0);
  }
  {
    gpukit::device_pmr_resource current(a);
    gpukit::stream_guard guard(s);
    // On the CPU device the memory is host memory: a pool resource over it is fine there.
    std::pmr::unsynchronized_pool_resource pooled(&current);
    std::pmr::vector<int> v(&pooled);
    v.resize(50000, 3);
    CHECK(v[49999] == 3);
    CHECK(a.memory_allocated() > 0);
  }
  CHECK(a.memory_allocated() == 0);
  gpukit::device_pmr_resource x(a);
  gpukit::device_pmr_resource y(a, s.view());
  gpukit::caching_allocator b(cpu);
  gpukit::device_pmr_resource z(b);
  CHECK(x.is_equal(y));
  CHECK_FALSE(x.is_equal(z));
  gpukit::device_pmr_resource by_device(cpu);
  CHECK(&by_device.allocator() == &gpukit::default_allocator(cpu));
}

TEST_CASE("threads allocating and freeing over-aligned memory at once keep every address right") {
  gpukit::caching_allocator a(cpu);
  std::vector<std::thread> threads;
  std::atomic<int> misaligned{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, &misaligned, t] {
      gpukit::stream s(cpu);
      std::vector<void*> live;
      for (int i = 0; i < 300; ++i) {
        const std::size_t alignment = std::size_t{512} << ((i + t) % 5);
        void* p = a.allocate(100 + static_cast<std::size_t>(i), alignment, s);
        if (!aligned_to(p, alignment) || !a.owns(p)) ++misaligned;
        live.push_back(p);
        if (live.size() > 8) {
          a.deallocate(live.front(), s);
          live.erase(live.begin());
        }
      }
      for (void* p : live) a.deallocate(p);
      s.synchronize();
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(misaligned.load() == 0);
  CHECK(a.memory_allocated() == 0);
}

namespace {
/// An arena as the README describes one: bump allocation in a buffer it is given, released whole when it goes (its
/// allocations are not freed one by one). Tells its blocks' starts (do_owns). With `forgets`, its destructor tells
/// the table of over-aligned addresses that the memory it handed out is taken back.
class bump_arena final : public gpukit::device_resource {
 public:
  explicit bump_arena(unsigned char* buffer, bool forgets = false) : start_(buffer), next_(buffer), forgets_(forgets) {}
  bump_arena(const bump_arena&) = delete;
  bump_arena& operator=(const bump_arena&) = delete;
  ~bump_arena() override {
    if (forgets_) forget_over_aligned_addresses(start_, static_cast<std::size_t>(next_ - start_));
  }
  [[nodiscard]] gpukit::device device() const noexcept override { return cpu; }

 private:
  void* do_allocate(std::size_t bytes, gpukit::stream_view /*stream*/) override {
    void* p = next_;
    next_ += (bytes + 255) / 256 * 256;
    live_.push_back(p);
    return p;
  }
  void do_deallocate(void* p) override {
    const auto it = std::find(live_.begin(), live_.end(), p);
    if (it == live_.end()) throw gpukit::invalid_argument_error("bump_arena: not a live allocation");
    live_.erase(it);
  }
  void do_deallocate(void* p, gpukit::stream_view /*stream*/) override { do_deallocate(p); }
  void do_record_stream(void* p, gpukit::stream_view /*stream*/) override {
    if (!do_owns(p)) throw gpukit::invalid_argument_error("bump_arena: not a live allocation");
  }
  bool do_owns(const void* p) const noexcept override {
    return std::find(live_.begin(), live_.end(), p) != live_.end();
  }

  unsigned char* start_;
  unsigned char* next_;
  bool forgets_;
  std::vector<void*> live_;
};
}  // namespace

// A sub-allocator built inside an over-aligned chunk of another resource starts its first block at the chunk's
// address: that block is the sub-allocator's (it was taken for the chunk's, and its free refused), and the chunk stays
// its resource's to free (helper-204).
TEST_CASE("a resource nested in an over-aligned chunk owns and frees the block it starts at the chunk's address") {
  alignas(4096) static unsigned char memory[32 * 1024];
  gpukit::stream s(cpu);
  bump_arena upstream(memory);
  void* head = upstream.allocate(256, s);          // memory + 0
  void* chunk = upstream.allocate(8192, 4096, s);  // block at memory + 256, handed out at memory + 4096
  REQUIRE(chunk == memory + 4096);
  bump_arena nested(static_cast<unsigned char*>(chunk));
  void* first = nested.allocate(256, s);
  REQUIRE(first == chunk);
  CHECK(nested.owns(first));
  CHECK_NOTHROW(nested.record_stream(first, s));
  CHECK_NOTHROW(nested.deallocate(first, s));
  CHECK_FALSE(nested.owns(first));
  CHECK(upstream.owns(chunk));
  CHECK_NOTHROW(upstream.deallocate(chunk));
  CHECK_FALSE(upstream.owns(chunk));
  upstream.deallocate(head);
}

// An arena released whole leaves its over-aligned addresses in the table. When another resource reuses the memory,
// its block that starts at such an address is its own: owns() said no, the free was refused, or freed another live
// block (the old over-aligned block's start; helper-203).
TEST_CASE("memory of an arena released whole, reused by another resource, is that resource's") {
  alignas(4096) static unsigned char memory[16 * 1024];
  gpukit::stream s(cpu);
  auto before = std::make_unique<bump_arena>(memory);
  (void)before->allocate(256, s);                            // memory + 0
  REQUIRE(before->allocate(100, 4096, s) == memory + 4096);  // its block at memory + 256
  bump_arena after(memory);           // alive together with `before`: another resource, at another address
  before.reset();                     // released whole, its allocations never freed
  void* a = after.allocate(256, s);   // memory + 0
  void* b = after.allocate(3840, s);  // memory + 256: the old block's start
  void* c = after.allocate(100, s);   // memory + 4096: the old over-aligned address
  REQUIRE(b == memory + 256);
  REQUIRE(c == memory + 4096);
  CHECK(after.owns(c));
  CHECK_NOTHROW(after.record_stream(c, s));
  CHECK_NOTHROW(after.deallocate(c, s));  // c, not b
  CHECK(after.owns(b));
  after.deallocate(b);
  after.deallocate(a);
}

// The same with the arena rebuilt over its memory at the same address (on the stack in a loop): its block at the old
// over-aligned address is its own, whichever object handed that address out (helper-205).
TEST_CASE("an arena rebuilt at the same address over the same memory owns and frees its own blocks") {
  alignas(4096) static unsigned char memory[16 * 1024];
  gpukit::stream s(cpu);
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    bump_arena arena(memory);
    (void)arena.allocate(256, s);  // memory + 0
    if (round == 0) {
      REQUIRE(arena.allocate(100, 4096, s) == memory + 4096);  // never freed: released whole
      continue;
    }
    void* b = arena.allocate(3840, s);  // memory + 256: the old block's start
    void* c = arena.allocate(100, s);   // memory + 4096: the old over-aligned address
    REQUIRE(c == memory + 4096);
    CHECK(arena.owns(c));
    CHECK_NOTHROW(arena.deallocate(c));
    CHECK(arena.owns(b));
  }
}

// owns() only asks: a resource nested in another's over-aligned allocation (a sub-allocator taking an aligned chunk),
// whose first block starts at the chunk's address, leaves the chunk's entry alone (helper-204 found a first version
// of a stale-entry purge that erased it there, so the chunk's free was refused).
TEST_CASE("asking a resource nested in an over-aligned chunk whether it owns an address keeps the chunk freeable") {
  alignas(4096) static unsigned char memory[32 * 1024];
  gpukit::stream s(cpu);
  bump_arena upstream(memory);
  void* head = upstream.allocate(256, s);
  void* chunk = upstream.allocate(8192, 4096, s);  // block at memory + 256, handed out at memory + 4096
  REQUIRE(chunk == memory + 4096);
  REQUIRE(upstream.owns(chunk));
  {
    bump_arena nested(static_cast<unsigned char*>(chunk));
    void* first = nested.allocate(256, s);
    REQUIRE(first == chunk);
    (void)nested.owns(first);
  }  // released whole
  CHECK(upstream.owns(chunk));
  CHECK_NOTHROW(upstream.deallocate(chunk));
  CHECK_FALSE(upstream.owns(chunk));
  upstream.deallocate(head);
}

namespace {
/// A pinned pool's upstream that hands out consecutive pieces of a buffer it is given (never given back), in
/// multiples of `granularity` bytes.
struct buffer_upstream {
  unsigned char* next;
  std::size_t granularity;
  void* allocate(std::size_t bytes) {
    void* p = next;
    next += (bytes + granularity - 1) / granularity * granularity;
    return p;
  }
  void deallocate(void* /*p*/, std::size_t /*bytes*/) noexcept {}
  bool page_locked() const noexcept { return false; }
};
}  // namespace

// The pinned adaptors look addresses up in the same table: a pinned block that starts at an over-aligned address an
// arena released whole left behind is the pool's block, for record_stream and for the adaptors' free (both were
// taken for the old allocation's block, and refused; helper-205).
TEST_CASE("a pinned block starting at an address an arena released whole left behind is the pool's") {
  alignas(65536) static unsigned char memory[128 * 1024];
  gpukit::stream s(cpu);
  const gpukit::stream_view on = s;
  {
    bump_arena before(memory);
    (void)before.allocate(256, s);                            // memory + 0
    REQUIRE(before.allocate(100, 4096, s) == memory + 4096);  // its block at memory + 256; released whole
  }
  gpukit::basic_pinned_pool<buffer_upstream> pool(buffer_upstream{memory + 4096, 4096});
  void* p = gpukit::detail::pinned_allocate_aligned(pool, 1000, 64, "test");
  REQUIRE(p == memory + 4096);
  CHECK(pool.is_allocated(p));
  CHECK_NOTHROW(pool.record_stream(p, s));
  CHECK_NOTHROW(gpukit::detail::pinned_deallocate_aligned(pool, p, &on));
  CHECK_FALSE(pool.is_allocated(p));
  // The pool's own over-aligned addresses are still found through the table.
  void* q = gpukit::detail::pinned_allocate_aligned(pool, 1000, 16384, "test");
  CHECK(reinterpret_cast<std::uintptr_t>(q) % 16384 == 0);
  REQUIRE(gpukit::detail::over_aligned_addresses().block_of(q) != q);  // the block starts at a page below q
  CHECK_FALSE(pool.is_allocated(q));
  CHECK_NOTHROW(pool.record_stream(q, s));
  CHECK_NOTHROW(gpukit::detail::pinned_deallocate_aligned(pool, q, nullptr));
  s.synchronize();
  CHECK(pool.stats().allocated_bytes == 0);
}

// An arena released whole without forgetting its addresses leaves entries behind; a pointer freed through the wrong
// resource then reaches that resource's live block at the entry's block start (helper-210: a pinned block freed
// through a device arena freed the arena's own block; a device block through a pinned adaptor, a pinned block). An
// arena that forgets its range when released (device_resource::forget_over_aligned_addresses) leaves none: the
// wrong resource refuses the pointer.
TEST_CASE("an arena that forgets its over-aligned addresses when released whole leaves no entry to misdirect a free") {
  alignas(65536) static unsigned char memory[64 * 1024];
  gpukit::stream s(cpu);
  {
    bump_arena before(memory, true);
    (void)before.allocate(256, s);                            // memory + 0
    REQUIRE(before.allocate(100, 4096, s) == memory + 4096);  // its block at memory + 256; released whole
    REQUIRE(gpukit::detail::over_aligned_addresses().block_of(memory + 4096) == memory + 256);
  }
  CHECK(gpukit::detail::over_aligned_addresses().block_of(memory + 4096) == memory + 4096);
  SUBCASE("a pinned block at the old address, freed through a device arena") {
    bump_arena after(memory);
    (void)after.allocate(256, s);      // memory + 0
    void* b = after.allocate(256, s);  // memory + 256: the old block's start
    REQUIRE(b == memory + 256);
    gpukit::basic_pinned_pool<buffer_upstream> pool(buffer_upstream{memory + 4096, 4096});
    void* p = gpukit::detail::pinned_allocate_aligned(pool, 1000, 64, "test");
    REQUIRE(p == memory + 4096);
    CHECK_FALSE(after.owns(p));
    CHECK_THROWS_AS(after.deallocate(p), gpukit::invalid_argument_error);
    CHECK(after.owns(b));
    gpukit::detail::pinned_deallocate_aligned(pool, p, nullptr);
    CHECK_FALSE(pool.is_allocated(p));
  }
  SUBCASE("a device block at the old address, freed through a pinned adaptor") {
    gpukit::basic_pinned_pool<buffer_upstream> pool(buffer_upstream{memory + 256, 256});
    void* pinned = pool.allocate(1000);  // a live pinned block at the old block's start
    REQUIRE(pinned == memory + 256);
    bump_arena after(memory + 4096);
    void* dev = after.allocate(256, s);  // a live device block at the old over-aligned address
    REQUIRE(dev == memory + 4096);
    CHECK_THROWS_AS(gpukit::detail::pinned_deallocate_aligned(pool, dev, nullptr), gpukit::invalid_argument_error);
    CHECK(pool.is_allocated(pinned));
    CHECK(after.owns(dev));
    after.deallocate(dev);
    pool.deallocate(pinned);
  }
}

TEST_CASE("forgetting a range of over-aligned addresses forgets those inside it only") {
  gpukit::detail::aligned_offsets table;
  alignas(4096) static unsigned char memory[64 * 1024];
  const std::size_t offsets[] = {0, 512, 4096, 8192, 16384, 32768};
  for (std::size_t offset : offsets) table.add(memory + offset + 4096, memory + offset);
  table.erase_range(memory + 4608, 12288 - 4608);          // [memory + 4608, memory + 12288)
  CHECK(table.block_of(memory + 4096) == memory);          // below the range
  CHECK(table.block_of(memory + 4608) == memory + 512);    // its first byte: kept (a parent's address)
  CHECK(table.block_of(memory + 8192) == memory + 8192);   // after it: forgotten
  CHECK(table.block_of(memory + 12288) == memory + 8192);  // its end: kept
  CHECK(table.block_of(memory + 20480) == memory + 16384);
  table.erase_range(memory + 20480, 0);  // an empty range: nothing
  table.erase_range(memory + 20480, 1);  // its first byte only: nothing
  CHECK(table.block_of(memory + 20480) == memory + 16384);
  table.erase_range(memory + 20479, 2);  // the byte after the first
  CHECK(table.block_of(memory + 20480) == memory + 20480);
  table.add(memory + 20480, memory + 16384);
  table.erase_range(memory, SIZE_MAX);  // to the end of the address space
  CHECK(table.block_of(memory + 20480) == memory + 20480);
  CHECK(table.block_of(memory + 36864) == memory + 36864);
}

namespace {
/// Allocates 512-byte blocks from `a` until the free memory after them (where a small request lands next) does not
/// start at a multiple of `alignment`, so that an over-aligned request there is served at a shifted address. Host
/// segments are only 256-aligned: one block is not always enough.
std::vector<void*> shift_off_boundary(gpukit::device_resource& a, std::size_t alignment, const gpukit::stream& s) {
  std::vector<void*> shifts{a.allocate(512, s)};
  while ((reinterpret_cast<std::uintptr_t>(shifts.back()) + 512) % alignment == 0) shifts.push_back(a.allocate(512, s));
  return shifts;
}
}  // namespace

// An allocator destroyed with allocations live releases their memory (and warns): their over-aligned addresses go
// with it, so that a block which later starts at one is not taken for them.
TEST_CASE("an allocator destroyed with over-aligned allocations live forgets their addresses") {
  gpukit::stream s(cpu);
  void* p = nullptr;
  {
    gpukit_test::captured_warnings warnings;
    gpukit::caching_allocator a(cpu);
    (void)shift_off_boundary(a, std::size_t{1} << 16, s);  // left live too
    p = a.allocate(3000, std::size_t{1} << 16, s);
    REQUIRE(gpukit::detail::over_aligned_addresses().block_of(p) != p);
  }
  CHECK(gpukit::detail::over_aligned_addresses().block_of(p) == p);
}

// An arena built in memory another resource handed out over-aligned starts at the other's over-aligned address:
// forgetting its range keeps that address, so the memory's owner can still free it (helper-211: it was forgotten,
// the free refused as "points into a block", the block leaked).
TEST_CASE("an arena in an over-aligned buffer forgets its range, and the buffer's owner still frees the buffer") {
  gpukit::stream s(cpu);
  gpukit::caching_allocator parent(cpu);
  const std::vector<void*> shifts = shift_off_boundary(parent, 4096, s);
  auto* buffer = static_cast<unsigned char*>(parent.allocate(64 * 1024, 4096, s));
  REQUIRE(gpukit::detail::over_aligned_addresses().block_of(buffer) != buffer);
  {
    bump_arena arena(buffer, true);
    (void)arena.allocate(256, s);  // its first block starts at the parent's over-aligned address
  }
  CHECK(gpukit::detail::over_aligned_addresses().block_of(buffer) != buffer);
  CHECK(parent.owns(buffer));
  CHECK_NOTHROW(parent.deallocate(buffer));
  for (void* shift : shifts) parent.deallocate(shift);
  CHECK(parent.memory_allocated() == 0);
}

namespace {
/// Segments from a device_resource at a 4 KiB alignment (over-aligned for it).
struct aligned_resource_upstream {
  gpukit::device_resource* resource;
  gpukit::stream_view stream;
  void* allocate(std::size_t bytes) { return resource->allocate(bytes, 4096, stream); }
  void deallocate(void* p, std::size_t /*bytes*/) noexcept {
    gpukit::detail::free_reporting_errors("aligned_resource_upstream", [&] { resource->deallocate(p); });
  }
  gpukit::upstream_memory_info memory_info() const { return {}; }
  bool synchronizes_on_free() const noexcept { return false; }
};
}  // namespace

// The same for an allocator whose segments come over-aligned from another resource, destroyed with an allocation live:
// its segments go back to that resource (helper-211: their addresses were forgotten first, so their frees failed).
TEST_CASE("an allocator over over-aligned segments, destroyed with allocations live, gives its segments back") {
  gpukit::stream s(cpu);
  gpukit::caching_allocator parent(cpu);
  const std::vector<void*> shifts = shift_off_boundary(parent, 4096, s);
  gpukit_test::captured_warnings warnings;
  {
    gpukit::allocator_options small;  // the child's segments are small requests of the parent, after the shifts
    small.small_size = 64 * 1024;
    small.small_segment_size = 128 * 1024;
    gpukit::caching_device_allocator<aligned_resource_upstream> child(cpu, small,
                                                                      aligned_resource_upstream{&parent, s});
    (void)child.allocate(1000, s);  // left live
    std::size_t shifted = 0;        // segments that start at an over-aligned address of the parent
    child.engine().for_each_segment([&shifted](std::uintptr_t address, std::size_t /*bytes*/) noexcept {
      const auto* start = reinterpret_cast<const void*>(address);
      shifted += gpukit::detail::over_aligned_addresses().block_of(start) != start ? 1 : 0;
    });
    REQUIRE(shifted == 1);
  }
  CHECK(warnings.contains("live allocation(s)"));
  CHECK_FALSE(warnings.contains("aligned_resource_upstream"));
  for (void* shift : shifts) parent.deallocate(shift);
  CHECK(parent.memory_allocated() == 0);
}

// Finding the segments to forget records nothing in the memory history (helper-211: a snapshot was taken, whose
// event memory_picture and the pickle anchor on).
TEST_CASE("destroying an allocator with allocations live records no snapshot in its memory history") {
  gpukit::stream s(cpu);
  auto history = std::make_shared<gpukit::memory_history>();
  gpukit_test::captured_warnings warnings;
  {
    gpukit::caching_allocator a(cpu);
    a.set_memory_history(history);
    (void)a.allocate(1000, s);  // left live
  }
  std::size_t snapshots = 0;
  for (const auto& e : history->events()) snapshots += e.action == gpukit::memory_action::snapshot ? 1 : 0;
  CHECK(snapshots == 0);
  CHECK_FALSE(history->events().empty());
}
