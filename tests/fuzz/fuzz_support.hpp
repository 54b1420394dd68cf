// Shared by gpukit's fuzz targets: a reader that turns the fuzzer's bytes into choices, a check that reports and
// aborts (libFuzzer then saves the input), and the switches for defects of issue 12 whose fixes are still landing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

// Each switch confines a target's inputs (or turns one check off) around a known defect of issue 12. 1: the fix has
// landed and the fuzzers check that case too (each was seen to find its defect with the switch on before the fix:
// tests/fuzz/corpus/<target>/regression_defect<n>_*). Set one to 0 only to fuzz a tree without that fix (or define it
// on the command line, e.g. -DGPUKIT_FUZZ_FIXED_DEFECT_8=0).
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_1
#define GPUKIT_FUZZ_FIXED_DEFECT_1 1  // pinned pool: empty_cache releases a promoted block twice
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_2
#define GPUKIT_FUZZ_FIXED_DEFECT_2 1  // caching allocator: false out of memory (no retry with a smaller segment)
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_3
#define GPUKIT_FUZZ_FIXED_DEFECT_3 1  // pinned pool: not exception-safe when an event query throws
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_5
#define GPUKIT_FUZZ_FIXED_DEFECT_5 1  // caching allocator: options.reserved_limit reported as absent
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_7
#define GPUKIT_FUZZ_FIXED_DEFECT_7 1  // select_device reads out of bounds on gpus not in ordinal order
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_8
#define GPUKIT_FUZZ_FIXED_DEFECT_8 1  // CUDA_VISIBLE_DEVICES indices clamped to 2^30
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_9
#define GPUKIT_FUZZ_FIXED_DEFECT_9 1  // copy_async: count * sizeof(T) overflow not checked
#endif
#ifndef GPUKIT_FUZZ_FIXED_DEFECT_10
#define GPUKIT_FUZZ_FIXED_DEFECT_10 1  // LOCAL_RANK limited to 9 characters; device::parse("cuda:1\n") rejected
#endif

namespace gpukit_fuzz {

/// Reports a broken invariant and aborts, so the fuzzer (or the replay) stops with this input.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "gpukit fuzz: invariant broken: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

/// GPUKIT_FUZZ_TRACE=1 in the environment: the operation-sequence targets print each step (to replay a crash).
inline bool tracing() {
  static const bool on = std::getenv("GPUKIT_FUZZ_TRACE") != nullptr;
  return on;
}

inline void trace(const std::string& what) {
  if (tracing()) std::fprintf(stderr, "%s\n", what.c_str());
}

#define GPUKIT_FUZZ_CHECK(condition, what)                                          \
  do {                                                                              \
    if (!(condition)) ::gpukit_fuzz::fail(std::string(#condition) + ": " + (what)); \
  } while (false)

/// Consumes the input front to back; reads past the end give zeros, so every input is a valid program.
class input {
 public:
  input(const std::uint8_t* data, std::size_t size) noexcept : data_(data), size_(size) {}

  bool empty() const noexcept { return position_ >= size_; }
  std::uint8_t byte() noexcept { return empty() ? 0 : data_[position_++]; }
  bool flag() noexcept { return (byte() & 1) != 0; }
  std::uint64_t u64(int bytes = 8) noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(byte()) << (8 * i);
    return v;
  }
  /// A value in [low, high] (inclusive).
  std::uint64_t in_range(std::uint64_t low, std::uint64_t high) noexcept {
    const std::uint64_t span = high - low;
    if (span == 0) return low;
    const int bytes = span < (1ULL << 8) ? 1 : span < (1ULL << 16) ? 2 : span < (1ULL << 32) ? 4 : 8;
    const std::uint64_t v = u64(bytes);
    return span == ~0ULL ? v : low + v % (span + 1);
  }
  /// Up to `max` bytes, length first.
  std::string text(std::size_t max) {
    const std::size_t n = static_cast<std::size_t>(in_range(0, max));
    std::string s;
    for (std::size_t i = 0; i < n && !empty(); ++i) s.push_back(static_cast<char>(byte()));
    return s;
  }
  /// Everything left.
  std::string rest() {
    const std::size_t from = std::min(position_, size_);
    std::string s(reinterpret_cast<const char*>(data_ + from), size_ - from);
    position_ = size_;
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

}  // namespace gpukit_fuzz
