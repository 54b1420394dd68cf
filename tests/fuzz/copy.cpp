// Fuzz target: copy_async (include/gpukit/transfer/copy.hpp) on a CPU stream, compared byte for byte with memcpy on
// shadow copies: host (pageable), pinned and device arenas, every direction, three element types, through a staging
// engine with tiny chunks (many chunks and slot reuse per copy) or the default one. Checks when the documented
// guarantees say data is ready: a pageable destination when copy_async returns, everything after synchronize; a
// pageable source may be overwritten as soon as copy_async returns. Misuse (overlap, size mismatch, null) must be
// gpukit::invalid_argument_error and change nothing.
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/transfer/copy.hpp>

#include "fuzz_support.hpp"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr std::size_t arena_bytes = 16 * 1024;  // 4 chunks of the tiny engine
enum arena { host, pinned, device_memory };

struct fixture {
  gpukit::stream stream{gpukit::device::cpu()};
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  std::unique_ptr<gpukit::staging_engine> tiny;
  std::vector<unsigned char> host_arena = std::vector<unsigned char>(arena_bytes);
  unsigned char* pinned_arena = nullptr;
  std::vector<unsigned char> device_arena = std::vector<unsigned char>(arena_bytes);

  fixture() {
    gpukit::staging_options o;
    o.chunk_bytes = 4096;
    o.min_chunk_bytes = 1024;
    o.slots = 2;
    o.download_slots = 2;
    o.threads = 2;
    o.bytes_per_thread = 1024;
    tiny = std::make_unique<gpukit::staging_engine>(pool, o);
    pinned_arena = static_cast<unsigned char*>(pool.allocate(arena_bytes));
  }
  unsigned char* base(arena a) {
    return a == host ? host_arena.data() : a == pinned ? pinned_arena : device_arena.data();
  }
};

fixture& fix() {
  static fixture* f = new fixture();  // never destroyed: the stream's thread outlives every input
  return *f;
}

struct shadows {
  std::vector<unsigned char> bytes[3];
};

void compare(fixture& f, const shadows& sh, arena a, const std::string& what) {
  const unsigned char* real = f.base(a);
  if (std::memcmp(real, sh.bytes[a].data(), arena_bytes) == 0) return;
  for (std::size_t i = 0; i < arena_bytes; ++i) {
    if (real[i] != sh.bytes[a][i]) {
      gpukit_fuzz::fail(what + ": arena " + std::to_string(a) + " differs from memcpy at byte " + std::to_string(i));
    }
  }
}

template <class T>
void copy_typed(fixture& f, arena dst, arena src, std::size_t dst_offset, std::size_t src_offset, std::size_t dst_count,
                std::size_t src_count, bool tiny_engine) {
  T* d = reinterpret_cast<T*>(f.base(dst) + dst_offset);
  T* s = reinterpret_cast<T*>(f.base(src) + src_offset);
  const gpukit::device cpu = gpukit::device::cpu();
  auto run = [&](auto dst_span, auto src_span) {
    if (tiny_engine) {
      gpukit::copy_async(dst_span, src_span, f.stream, *f.tiny);
    } else {
      gpukit::copy_async(dst_span, src_span, f.stream);
    }
  };
  if (dst == device_memory && src == device_memory) {
    run(gpukit::device_span<T>(d, dst_count, cpu), gpukit::device_span<const T>(s, src_count, cpu));
  } else if (dst == device_memory && src == host) {
    run(gpukit::device_span<T>(d, dst_count, cpu), gpukit::host_span<const T>(s, src_count));
  } else if (dst == device_memory && src == pinned) {
    run(gpukit::device_span<T>(d, dst_count, cpu), gpukit::pinned_span<const T>(s, src_count));
  } else if (dst == host) {
    run(gpukit::host_span<T>(d, dst_count), gpukit::device_span<const T>(s, src_count, cpu));
  } else {
    run(gpukit::pinned_span<T>(d, dst_count), gpukit::device_span<const T>(s, src_count, cpu));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpukit_fuzz::input in(data, size);
  fixture& f = fix();
  shadows sh;
  for (int a = 0; a < 3; ++a) {  // a fresh pattern per input
    unsigned char* real = f.base(static_cast<arena>(a));
    for (std::size_t i = 0; i < arena_bytes; ++i) real[i] = static_cast<unsigned char>(i * 31 + a * 7 + size);
    sh.bytes[a].assign(real, real + arena_bytes);
  }
  for (int step = 0; !in.empty() && step < 32; ++step) {
    const std::uint8_t op = in.byte();
    std::string what = "step " + std::to_string(step);
    if (op % 8 == 7) {
      f.stream.synchronize();
      for (int a = 0; a < 3; ++a) compare(f, sh, static_cast<arena>(a), what + " after synchronize");
      continue;
    }
    static const arena directions[][2] = {{device_memory, host},
                                          {host, device_memory},
                                          {device_memory, pinned},
                                          {pinned, device_memory},
                                          {device_memory, device_memory}};
    const arena dst = directions[op % 5][0];
    const arena src = directions[op % 5][1];
    const std::size_t element = std::size_t{1} << ((op >> 3) % 4 == 3 ? 3 : (op >> 3) % 3 == 1 ? 2 : 0);  // 1, 4, 8
    const bool tiny_engine = (op & 0x40) != 0;
    const std::uint8_t shape = in.byte();
    const std::size_t max_count = arena_bytes / element;
    std::size_t count = shape % 4 == 0 ? static_cast<std::size_t>(in.in_range(0, 8))
                                       : static_cast<std::size_t>(in.in_range(0, max_count));
    const std::size_t dst_offset = static_cast<std::size_t>(in.in_range(0, max_count - count)) * element;
    const std::size_t src_offset = static_cast<std::size_t>(in.in_range(0, max_count - count)) * element;
    std::size_t src_count = count;
    bool expect_refusal = false;
    if (shape & 0x10) {  // sizes differ
      src_count = count + 1 + in.byte() % 4;
      if (src_offset + src_count * element > arena_bytes) src_count = count;
      expect_refusal = src_count != count;
    }
    if (GPUKIT_FUZZ_FIXED_DEFECT_9 && (shape & 0x20) && element > 1) {  // count * element wraps to a few bytes
      count = src_count = (std::numeric_limits<std::size_t>::max() / element) + 1 + in.byte() % 4;
      expect_refusal = true;
    }
    const std::size_t bytes = count * element;
    if (!expect_refusal && dst == src && count != 0) {
      expect_refusal = dst_offset < src_offset + bytes && src_offset < dst_offset + bytes;  // overlap
    }
    what += " copy " + std::to_string(count) + "x" + std::to_string(element) + " bytes from arena " +
            std::to_string(src) + "+" + std::to_string(src_offset) + " to arena " + std::to_string(dst) + "+" +
            std::to_string(dst_offset) + (tiny_engine ? " (tiny chunks)" : "");
    bool refused = false;
    try {
      switch (element) {
        case 1:
          copy_typed<std::uint8_t>(f, dst, src, dst_offset, src_offset, count, src_count, tiny_engine);
          break;
        case 4:
          copy_typed<std::uint32_t>(f, dst, src, dst_offset, src_offset, count, src_count, tiny_engine);
          break;
        default:
          copy_typed<std::uint64_t>(f, dst, src, dst_offset, src_offset, count, src_count, tiny_engine);
          break;
      }
    } catch (const gpukit::invalid_argument_error&) {
      refused = true;
    }
    GPUKIT_FUZZ_CHECK(refused == (expect_refusal && (count != 0 || src_count != 0)), what);
    if (refused) continue;
    std::memmove(sh.bytes[dst].data() + dst_offset, sh.bytes[src].data() + src_offset, bytes);
    if (dst == host) compare(f, sh, host, what + ": a pageable destination is ready when copy_async returns");
    if (src == host && bytes != 0 && (shape & 0x40)) {
      // The caller reuses its pageable source at once, as documented; the copy must already hold the old data.
      std::memset(f.base(host) + src_offset, 0xA5, bytes);
      std::memset(sh.bytes[host].data() + src_offset, 0xA5, bytes);
    }
  }
  f.stream.synchronize();
  for (int a = 0; a < 3; ++a) compare(f, sh, static_cast<arena>(a), "at the end");
  return 0;
}
