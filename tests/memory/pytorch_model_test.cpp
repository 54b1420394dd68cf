// The baseline bench_fragmentation compares gpukit with: bench/pytorch_allocator_model.hpp, a model of PyTorch's
// CUDA caching allocator. Each rule it models is checked on a small hand-made sequence, so the baseline is itself
// tested: rounding, small/large pools and segment sizes, split thresholds, coalescing, best fit by size then
// address, release-and-retry at capacity, max_split_size, and free blocks keyed by stream.
#include "pytorch_allocator_model.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using model = gpukit_bench::pytorch_allocator_model;
using blocks = std::vector<std::pair<std::uintptr_t, std::size_t>>;
constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

std::uintptr_t address(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

TEST_CASE("PyTorch model: requests are rounded up to 512 bytes") {
  CHECK(model::round_size(1) == 512);
  CHECK(model::round_size(512) == 512);
  CHECK(model::round_size(513) == 1024);
  model m;
  void* a = m.allocate(1);
  void* b = m.allocate(513);
  CHECK(m.allocated() == 512 + 1024);
  CHECK(address(b) == address(a) + 512);  // the allocation takes the low part of the block it splits
  CHECK(m.free_blocks(true) == blocks{{address(a) + 1536, 2 * MiB - 1536}});
}

TEST_CASE("PyTorch model: small requests come from 2 MiB segments, < 10 MiB from 20 MiB, larger rounded to 2 MiB") {
  CHECK(model::segment_size(1 * MiB) == 2 * MiB);
  CHECK(model::segment_size(1 * MiB + 512) == 20 * MiB);
  CHECK(model::segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(model::segment_size(10 * MiB) == 10 * MiB);
  CHECK(model::segment_size(11 * MiB + 512) == 12 * MiB);
  model m;
  m.allocate(11 * MiB + 1);  // a segment of its own, 12 MiB; 1 MiB - 512 remains: not split
  CHECK(m.reserved() == 12 * MiB);
  m.allocate(1 * MiB);
  m.allocate(1 * MiB);  // both small, from one 2 MiB segment
  CHECK(m.reserved() == 14 * MiB);
  m.allocate(1 * MiB + 1);  // large (rounded to 1 MiB + 512), below 10 MiB: a 20 MiB segment
  CHECK(m.reserved() == 34 * MiB);
  CHECK(m.free_blocks(true).empty());
  CHECK(m.free_blocks(false) == blocks{{m.free_blocks(false).front().first, 19 * MiB - 512}});
  m.allocate(512);  // a small request never uses the large pool's free block, however big
  CHECK(m.reserved() == 36 * MiB);
  CHECK(m.upstream_allocs() == 4);
}

TEST_CASE("PyTorch model: small blocks split when >= 512 B remain, large ones when more than 1 MiB remains") {
  model m;
  void* a = m.allocate(1 * MiB);
  void* b = m.allocate(1 * MiB - 512);  // 512 B remain: split
  CHECK(m.free_blocks(true) == blocks{{address(a) + 2 * MiB - 512, 512}});
  void* c = m.allocate(512);  // exact fit
  CHECK(address(c) == address(b) + 1 * MiB - 512);
  CHECK(m.free_blocks(true).empty());
  CHECK(m.upstream_allocs() == 1);

  void* d = m.allocate(19 * MiB);  // 1 MiB remains of 20 MiB: not split, the block is the whole segment
  CHECK(m.free_blocks(false).empty());
  CHECK(m.allocated() == 2 * MiB + 20 * MiB);
  void* e = m.allocate(19 * MiB - 512);  // 1 MiB + 512 remains: split
  CHECK(m.free_blocks(false) == blocks{{address(e) + 19 * MiB - 512, 1 * MiB + 512}});
  (void)d;
}

TEST_CASE("PyTorch model: a freed block coalesces with its free neighbours of the same segment") {
  model m;
  void* a = m.allocate(512 * KiB);
  void* b = m.allocate(512 * KiB);
  void* c = m.allocate(512 * KiB);
  void* other = m.allocate(1 * MiB + 512);  // another segment: never merged with the first
  const std::uintptr_t base = address(a);
  m.deallocate(b);
  CHECK(m.free_blocks(true) == blocks{{base + 512 * KiB, 512 * KiB}, {base + 1536 * KiB, 512 * KiB}});
  m.deallocate(a);
  CHECK(m.free_blocks(true) == blocks{{base + 1536 * KiB, 512 * KiB}, {base, 1 * MiB}});
  m.deallocate(c);
  CHECK(m.free_blocks(true) == blocks{{base, 2 * MiB}});
  m.deallocate(other);
  CHECK(m.free_blocks(false) == blocks{{address(other), 20 * MiB}});
  CHECK(m.reserved() == 22 * MiB);  // freeing caches; nothing goes back to the upstream
  CHECK(m.upstream_frees() == 0);
}

TEST_CASE("PyTorch model: best fit takes the smallest block that fits, the lowest address among equal sizes") {
  model m;
  void* a = m.allocate(256 * KiB);
  m.allocate(64 * KiB);
  void* b = m.allocate(128 * KiB);
  m.allocate(64 * KiB);
  void* c = m.allocate(256 * KiB);
  m.allocate(64 * KiB);
  m.deallocate(c);
  m.deallocate(b);
  m.deallocate(a);
  // Free: a 256 KiB, b 128 KiB, c 256 KiB (each between live blocks) and the segment's tail (1216 KiB).
  CHECK(address(m.allocate(100 * KiB)) == address(b));  // 128 KiB is the best fit
  CHECK(address(m.allocate(200 * KiB)) == address(a));  // 256 KiB at the lower address
  CHECK(m.upstream_allocs() == 1);
}

TEST_CASE(
    "PyTorch model: when the upstream refuses, free whole segments are released and the allocation retried once") {
  model m(22 * MiB);
  void* big = m.allocate(15 * MiB);  // a 16 MiB segment of its own
  m.allocate(1 * MiB);               // a 2 MiB small segment, kept live
  m.deallocate(big);                 // cached: 18 MiB reserved
  CHECK(m.reserved() == 18 * MiB);
  void* p = m.allocate(17 * MiB);  // needs 18 MiB: 36 > 22, so the cached 16 MiB goes back and the retry fits
  CHECK(p != nullptr);
  CHECK(m.upstream_frees() == 1);
  CHECK(m.retries() == 1);
  CHECK(m.reserved() == 20 * MiB);
  CHECK(m.allocate(4 * MiB) == nullptr);  // a 20 MiB segment cannot fit: nothing free to release, out of memory
  CHECK(m.ooms() == 1);
  CHECK(m.retries() == 2);
  CHECK(m.reserved() == 20 * MiB);  // segments with live blocks are never released
  CHECK(m.peak_reserved() == 20 * MiB);
}

TEST_CASE("PyTorch model: max_split_size keeps oversize blocks whole and releases them before a full flush") {
  model m(model::unlimited, 32 * MiB);
  void* big = m.allocate(40 * MiB);
  m.deallocate(big);
  m.allocate(8 * MiB);  // below max_split: does not take the cached 40 MiB block
  CHECK(m.upstream_allocs() == 2);
  void* p = m.allocate(36 * MiB);  // at least max_split, less than 20 MiB smaller than the block: taken whole
  CHECK(address(p) == address(big));
  CHECK(m.allocated() == 8 * MiB + 40 * MiB);
  m.deallocate(p);
  m.allocate(18 * MiB + 512);  // below max_split: the cached 40 MiB block is refused, a new segment is made
  CHECK(m.upstream_allocs() == 3);

  model limited(64 * MiB, 32 * MiB);
  void* oversize = limited.allocate(40 * MiB);
  limited.allocate(1 * MiB);  // 42 MiB reserved
  limited.deallocate(oversize);
  CHECK(limited.allocate(30 * MiB) != nullptr);  // 72 > 64: the oversize block is released first, no full flush
  CHECK(limited.upstream_frees() == 1);
  CHECK(limited.retries() == 0);

  model waste(model::unlimited, 32 * MiB);
  void* huge = waste.allocate(64 * MiB);
  waste.deallocate(huge);
  CHECK(address(waste.allocate(40 * MiB)) != address(huge));  // 64 >= 40 + 20 MiB: too wasteful
  CHECK(address(waste.allocate(50 * MiB)) == address(huge));  // 64 < 50 + 20 MiB
}

TEST_CASE("PyTorch model: a block freed on one stream serves only it, and a refusal releases every stream's segments") {
  model m(40 * MiB);
  void* on_first = m.allocate(15 * MiB, 1);  // a 16 MiB segment of its own, for stream 1
  m.deallocate(on_first);
  void* on_second = m.allocate(15 * MiB, 2);  // stream 2 does not take stream 1's free block
  CHECK(address(on_second) != address(on_first));
  CHECK(m.upstream_allocs() == 2);
  CHECK(address(m.allocate(15 * MiB, 1)) == address(on_first));  // stream 1 takes its own
  m.deallocate(on_first);
  m.deallocate(on_second);
  CHECK(m.reserved() == 32 * MiB);
  // A third stream's 20 MiB segment does not fit beside both (52 > 40): both streams' free segments go back.
  CHECK(m.allocate(19 * MiB, 3) != nullptr);
  CHECK(m.upstream_frees() == 2);
  CHECK(m.retries() == 1);
  CHECK(m.reserved() == 20 * MiB);

  // max_split_size releases the requesting stream's oversize block, not another stream's.
  model limited(64 * MiB, 32 * MiB);
  void* mine = limited.allocate(40 * MiB, 1);
  void* theirs = limited.allocate(20 * MiB, 2);
  limited.deallocate(mine);
  limited.deallocate(theirs);
  limited.allocate(1 * MiB, 1);                     // 62 MiB reserved
  CHECK(limited.allocate(30 * MiB, 1) != nullptr);  // 62 + 30 > 64: stream 1's 40 MiB block goes first, no full flush
  CHECK(limited.upstream_frees() == 1);
  CHECK(limited.retries() == 0);
  CHECK(limited.reserved() == 52 * MiB);  // stream 2's 20 MiB segment stays

  // When no single oversize block of the stream covers the request, only the stream's own are released (too few
  // here), then everything: another stream's oversize block is not taken on the way.
  model mixed(100 * MiB, 32 * MiB);
  void* other = mixed.allocate(40 * MiB, 0);
  void* own = mixed.allocate(36 * MiB, 1);
  mixed.deallocate(other);
  mixed.deallocate(own);
  CHECK(mixed.allocate(50 * MiB, 1) != nullptr);  // 76 + 50 > 100, and stream 1's 36 MiB alone is short of 50
  CHECK(mixed.retries() == 1);                    // a stream-blind release would have taken stream 0's 40 MiB too
  CHECK(mixed.upstream_frees() == 2);
}
