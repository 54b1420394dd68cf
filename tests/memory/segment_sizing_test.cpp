// The caching allocator's growth policy (memory/detail/segment_sizing.hpp) alone: rounding, segment sizes for the
// footprint and under a limit, the sizes tried when memory is short, and when blocks split. The engine's own tests
// (allocator_*_test.cpp, bench_fragmentation) check what these sizes do to a workload.
#include <gpukit/memory/detail/segment_sizing.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <limits>
#include <string>

namespace sizing = gpukit::detail::segment_sizing;
using gpukit::allocator_options;

namespace {
constexpr std::size_t MiB = allocator_options::MiB;
constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
}  // namespace

static_assert(sizing::rounded_request(allocator_options{}, 1) == 512, "usable in constant expressions");

TEST_CASE("requests are rounded, and sizes that overflow when rounded are refused") {
  const allocator_options o;
  CHECK(sizing::rounded_request(o, 1) == 512);
  CHECK(sizing::rounded_request(o, 512) == 512);
  CHECK(sizing::rounded_request(o, 513) == 1024);
  CHECK(sizing::rounded_request(o, 100 * MiB + 1) == 100 * MiB + 512);
  CHECK(sizing::rounded_request(o, max) == 0);
  CHECK(sizing::rounded_request(o, max - 100) == 0);
  // Rounds to 512 without overflow, but its own segment (rounded to 2 MiB) would overflow.
  CHECK(sizing::rounded_request(o, max - 2 * MiB + 2) == 0);
  CHECK(sizing::rounded_request(o, max - 2 * MiB) == max - 2 * MiB + 1);  // its segment rounds to exactly that
}

TEST_CASE("shared segments hold a whole number of requests and grow with the footprint, up to 4 x medium_size") {
  const allocator_options o;
  CHECK(sizing::preferred(o, 4096, true, 0) == 2 * MiB);                 // small segment
  CHECK(sizing::preferred(o, 5 * MiB, false, 0) == 20 * MiB);            // 4 requests
  CHECK(sizing::preferred(o, 6 * MiB, false, 0) == 18 * MiB);            // 3 requests, not 20 MiB with a tail
  CHECK(sizing::preferred(o, 5 * MiB, false, 800 * MiB) == 100 * MiB);   // reserved / 8
  CHECK(sizing::medium_segment_cap(o) == 256 * MiB);                     // 4 x 64 MiB
  CHECK(sizing::preferred(o, 5 * MiB, false, 4096 * MiB) == 250 * MiB);  // capped; 50 requests round exactly
  CHECK(sizing::preferred(o, 100 * MiB + 512, false, 0) == 102 * MiB);   // its own segment, rounded to 2 MiB
  // PyTorch's constants: no growth, and 10 MiB is where requests get their own segments.
  const allocator_options torch = allocator_options::pytorch();
  CHECK(sizing::preferred(torch, 5 * MiB, false, 4096 * MiB) == 20 * MiB);
  CHECK(sizing::preferred(torch, 12 * MiB, false, 0) == 12 * MiB);
  // A max_split_size below medium_size is where requests get their own segments (a shared one is always split).
  allocator_options split_32 = o;
  split_32.max_split_size = 32 * MiB;
  CHECK(sizing::preferred(split_32, 31 * MiB, false, 800 * MiB) == 62 * MiB);  // shared: 2 requests round exactly
  CHECK(sizing::preferred(split_32, 32 * MiB, false, 800 * MiB) == 32 * MiB);
  CHECK(sizing::preferred(o, 32 * MiB, false, 800 * MiB) == 96 * MiB);  // shared under the defaults
  CHECK(sizing::fitted(split_32, 40 * MiB, false, 0, 0, 41 * MiB) == 40 * MiB);
  // A medium_size so large that 4x overflows saturates instead of wrapping.
  allocator_options huge;
  huge.medium_size = max / 2;
  CHECK(sizing::medium_segment_cap(huge) == max / (2 * MiB) * (2 * MiB));
  // Shared segments near the largest size saturate too: never 0, never below the request (a segment of 0 bytes was
  // handed out as the request's, with a free remainder that had wrapped to about 2^64).
  allocator_options wide;
  wide.medium_segment_size = max / (2 * MiB) * (2 * MiB) - MiB;  // a multiple of 512, 2^64 - 2^20 - ...
  const std::size_t request = MiB + 512;
  const std::size_t seg = sizing::preferred(wide, request, false, 0);
  CHECK(seg >= request);
  CHECK(seg % (2 * MiB) == 0);
  CHECK(seg > max - 4 * MiB);    // as many requests as round up without overflow
  huge.medium_size = max - 511;  // every request shares segments; one near the largest size cannot be rounded
  huge.max_split_size = allocator_options::unlimited;  // (a smaller one would give such requests their own)
  CHECK(sizing::preferred(huge, max - 1023, false, 0) == max - 1023);  // the request itself, as minimal() gives it
}

TEST_CASE("when memory is short: the smallest segments that hold a request, and the room under a limit") {
  const allocator_options o;
  CHECK(sizing::minimal(o, 4096, true) == 2 * MiB);
  CHECK(sizing::minimal(o, 5 * MiB, false) == 6 * MiB);
  CHECK(sizing::unrounded(o, 5 * MiB, false) == 10 * MiB);       // two requests are a multiple of 2 MiB
  CHECK(sizing::unrounded(o, 3 * MiB + 512, false) == 4 * MiB);  // no count up to 4 is: the minimal segment
  CHECK(sizing::unrounded(o, 100 * MiB, false) == 100 * MiB);    // own segment: minimal
  const std::size_t unlimited = allocator_options::unlimited;
  CHECK(sizing::fitted(o, 5 * MiB, false, 0, 0, unlimited) == 20 * MiB);
  CHECK(sizing::fitted(o, 5 * MiB, false, 0, 0, 30 * MiB) == 20 * MiB);         // fits
  CHECK(sizing::fitted(o, 5 * MiB, false, 0, 0, 16 * MiB) == 16 * MiB);         // shrunk to the room left
  CHECK(sizing::fitted(o, 5 * MiB, false, 0, 10 * MiB, 24 * MiB) == 14 * MiB);  // allocations in flight count
  CHECK(sizing::fitted(o, 5 * MiB, false, 0, 0, 4 * MiB) == 6 * MiB);           // never below minimal: hits the limit
  CHECK(sizing::fitted(o, 5 * MiB, false, 40 * MiB, 0, 30 * MiB) == 6 * MiB);   // over the limit already
  CHECK(sizing::fitted(o, 4096, true, 0, 0, 1 * MiB) == 2 * MiB);               // small segments are never shrunk
}

TEST_CASE("blocks split past their pool's threshold, and blocks of huge dedicated segments stay whole") {
  const allocator_options o;
  CHECK_FALSE(sizing::should_split(o, true, false, 512, 0));
  CHECK(sizing::should_split(o, true, false, 512, 512));
  CHECK_FALSE(sizing::should_split(o, false, false, 2 * MiB, 1 * MiB));
  CHECK(sizing::should_split(o, false, false, 2 * MiB, 1 * MiB + 512));
  CHECK(sizing::should_split(o, false, true, 100 * MiB, 10 * MiB));  // dedicated, below max_split_size
  CHECK_FALSE(sizing::should_split(o, false, true, 300 * MiB, 10 * MiB));
  // Large blocks of expandable ranges: any remainder (PyTorch's expandable segments, likewise).
  CHECK(sizing::should_split(o, false, false, 2 * MiB, 512, true));
  CHECK_FALSE(sizing::should_split(o, false, false, 2 * MiB, 0, true));
  CHECK_FALSE(sizing::should_split(o, false, true, 300 * MiB, 10 * MiB, true));
}

TEST_CASE("growth does not oscillate: a request's shared segment never shrinks as the footprint grows") {
  // Issue 9: segment sizes follow reserved / 8, trimmed to whole requests and rounded; as the footprint grows the
  // size for one request size may only stay or grow (it would otherwise alternate between sizes as segments are
  // added), and it always holds the request.
  for (const allocator_options& o : {allocator_options{}, allocator_options::pytorch()}) {
    std::size_t grew = 0;  // steps where a size grew: gpukit's grow with the footprint, PyTorch's constants do not
    for (std::size_t request = 512; request <= 80 * MiB; request = request * 3 / 2 + 512) {
      const std::size_t rounded = sizing::rounded_request(o, request);
      const bool small = rounded <= o.small_size;
      std::size_t previous = 0;
      for (std::size_t reserved = 0; reserved <= std::size_t{16} << 30; reserved += 7 * MiB + 512) {
        const std::size_t size = sizing::preferred(o, rounded, small, reserved);
        if (size < previous || size < rounded) {
          const std::string what = "request " + std::to_string(rounded) + " B at " + std::to_string(reserved) +
                                   " B reserved: " + std::to_string(size) + " B after " + std::to_string(previous);
          INFO(what);
          CHECK(size >= previous);
          CHECK(size >= rounded);
          break;
        }
        if (previous != 0 && size > previous) ++grew;
        previous = size;
      }
    }
    if (o.medium_segment_growth != 0) {
      CHECK(grew > 0);
    } else {
      CHECK(grew == 0);
    }
  }
}
