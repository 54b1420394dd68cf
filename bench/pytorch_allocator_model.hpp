// A small reference model of PyTorch's CUDA caching allocator (DeviceCachingAllocator in
// c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.x), written from its rules, not from gpukit's engine, so that
// bench_fragmentation has a baseline independent of the engine it measures (allocator_options::pytorch() is the
// engine with PyTorch's constants; this is PyTorch's algorithm). Names of the original's functions in brackets.
//
// Modelled:
// - requests are rounded up to a multiple of 512 B [round_size, kMinBlockSize];
// - requests <= 1 MiB use the small pool and 2 MiB segments; larger ones the large pool, with 20 MiB segments below
//   10 MiB and a segment of their own rounded up to 2 MiB from 10 MiB [get_pool, get_allocation_size];
// - each pool is a set of free blocks ordered by (stream, size, address); a request takes the first block of its
//   stream not smaller than itself (best fit): a block freed on one stream serves only that stream
//   [BlockComparatorSize, get_free_block];
// - a block is split, the allocation taking its low part, when the remainder is >= 512 B (small pool) or > 1 MiB
//   (large pool, and only for requests below max_split_size) [should_split, alloc_found_block];
// - a freed block merges with its free neighbours of the same segment [free_block, try_merge_blocks];
// - optional max_split_size (default unlimited, as in PyTorch): a request below it takes no cached block of that
//   size or more; a request of that size or more takes no block 20 MiB or more larger than itself
//   [get_free_block]; when the upstream refuses, cached oversize blocks of the request's stream are released first
//   [release_available_cached_blocks];
// - the slow path: cudaMalloc of the segment; if that fails, release oversize blocks (max_split_size only) and retry;
//   then release every completely free segment of both pools, every stream's, and retry once; then out of memory
//   [malloc, alloc_block, release_cached_blocks].
// Left out: record_stream and events (a block is free for its stream when freed), expandable segments, the memory
// fraction and its garbage collection, free-memory callbacks, graph pools, roundup_power2_divisions, the lock.
// Segments get fresh 2 MiB-aligned addresses from a bump pointer (a driver reuses virtual addresses, which only
// changes the order of equal-size free blocks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpukit_bench {

class pytorch_allocator_model {
 public:
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
  static constexpr std::size_t min_block = 512;                          // kMinBlockSize
  static constexpr std::size_t small_size = std::size_t{1} << 20;        // kSmallSize
  static constexpr std::size_t small_buffer = std::size_t{2} << 20;      // kSmallBuffer
  static constexpr std::size_t large_buffer = std::size_t{20} << 20;     // kLargeBuffer
  static constexpr std::size_t min_large_alloc = std::size_t{10} << 20;  // kMinLargeAlloc
  static constexpr std::size_t round_large = std::size_t{2} << 20;       // kRoundLarge

  /// \param capacity       bytes the fake device holds: a segment is refused when reserved + its size exceeds it
  /// \param max_split_size PyTorch's max_split_size_mb in bytes (unlimited: PyTorch's default)
  explicit pytorch_allocator_model(std::size_t capacity = unlimited, std::size_t max_split_size = unlimited)
      : capacity_(capacity), max_split_(max_split_size) {}
  pytorch_allocator_model(const pytorch_allocator_model&) = delete;
  pytorch_allocator_model& operator=(const pytorch_allocator_model&) = delete;
  ~pytorch_allocator_model() {
    for (auto& entry : allocated_) delete entry.second;
    for (block* b : small_) delete b;
    for (block* b : large_) delete b;
  }

  static std::size_t round_size(std::size_t bytes) {
    return bytes < min_block ? min_block : (bytes + min_block - 1) / min_block * min_block;
  }
  static std::size_t segment_size(std::size_t size) {
    if (size <= small_size) return small_buffer;
    if (size < min_large_alloc) return large_buffer;
    return (size + round_large - 1) / round_large * round_large;
  }

  /// An address (never to be dereferenced) for `stream` (any number naming one), or nullptr when out of memory.
  void* allocate(std::size_t bytes, int stream = 0) {
    const std::size_t size = round_size(bytes);
    const bool small = size <= small_size;
    pool& p = small ? small_ : large_;
    block* b = take_free(p, size, stream);
    if (b == nullptr) {
      const std::size_t segment = segment_size(size);
      b = new_segment(segment, small, stream);
      if (b == nullptr && release_oversize(p, size, stream)) b = new_segment(segment, small, stream);
      if (b == nullptr) {
        release_all();  // PyTorch then always retries (num_alloc_retries)
        ++retries_;
        b = new_segment(segment, small, stream);
      }
      if (b == nullptr) {
        ++ooms_;
        return nullptr;
      }
    }
    const std::size_t remaining = b->size - size;
    if (small ? remaining >= min_block : (size < max_split_ && remaining > small_size)) {
      block* rest = new block{b->address + size, remaining, stream, small, false, b, b->next};
      if (b->next != nullptr) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      p.insert(rest);
    }
    b->allocated = true;
    allocated_bytes_ += b->size;
    allocated_.emplace(b->address, b);
    return reinterpret_cast<void*>(b->address);
  }

  /// Frees an address allocate() returned (the size is not needed; it is accepted for replay()).
  void deallocate(void* ptr, std::size_t = 0) {
    const auto found = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (found == allocated_.end()) return;
    block* b = found->second;
    allocated_.erase(found);
    allocated_bytes_ -= b->size;
    b->allocated = false;
    pool& p = b->small ? small_ : large_;
    for (block* neighbour : {b->prev, b->next}) {
      if (neighbour == nullptr || neighbour->allocated) continue;
      p.erase(neighbour);
      if (neighbour == b->prev) {
        b->address = neighbour->address;
        b->prev = neighbour->prev;
        if (b->prev != nullptr) b->prev->next = b;
      } else {
        b->next = neighbour->next;
        if (b->next != nullptr) b->next->prev = b;
      }
      b->size += neighbour->size;
      delete neighbour;
    }
    p.insert(b);
  }

  std::size_t reserved() const noexcept { return reserved_; }
  std::size_t peak_reserved() const noexcept { return peak_reserved_; }
  std::size_t allocated() const noexcept { return allocated_bytes_; }
  std::size_t upstream_allocs() const noexcept { return upstream_allocs_; }  // cudaMalloc calls (successful)
  std::size_t upstream_frees() const noexcept { return upstream_frees_; }    // cudaFree calls
  std::size_t upstream_calls() const noexcept { return upstream_allocs_ + upstream_frees_; }
  std::size_t retries() const noexcept { return retries_; }
  std::size_t ooms() const noexcept { return ooms_; }
  /// The free blocks of a pool as (address, size), in the pool's order (stream, size, then address).
  std::vector<std::pair<std::uintptr_t, std::size_t>> free_blocks(bool small) const {
    std::vector<std::pair<std::uintptr_t, std::size_t>> list;
    for (const block* b : small ? small_ : large_) list.emplace_back(b->address, b->size);
    return list;
  }

 private:
  struct block {
    std::uintptr_t address;
    std::size_t size;
    int stream;
    bool small;
    bool allocated;
    block* prev;  // neighbours in the segment
    block* next;
  };
  struct by_size_then_address {  // within a stream
    bool operator()(const block* a, const block* b) const {
      if (a->stream != b->stream) return a->stream < b->stream;
      return a->size != b->size ? a->size < b->size : a->address < b->address;
    }
  };
  using pool = std::set<block*, by_size_then_address>;

  block* take_free(pool& p, std::size_t size, int stream) {
    block key{0, size, stream, false, false, nullptr, nullptr};
    const auto it = p.lower_bound(&key);
    if (it == p.end() || (*it)->stream != stream) return nullptr;
    if (size < max_split_ && (*it)->size >= max_split_) return nullptr;            // oversize: kept for big requests
    if (size >= max_split_ && (*it)->size >= size + large_buffer) return nullptr;  // too much waste
    block* b = *it;
    p.erase(it);
    return b;
  }

  block* new_segment(std::size_t bytes, bool small, int stream) {
    if (bytes > capacity_ || reserved_ > capacity_ - bytes) return nullptr;
    reserved_ += bytes;
    if (reserved_ > peak_reserved_) peak_reserved_ = reserved_;
    ++upstream_allocs_;
    block* b = new block{next_address_, bytes, stream, small, false, nullptr, nullptr};
    next_address_ += (bytes + round_large - 1) / round_large * round_large;
    return b;
  }

  void release(pool& p, block* b) {  // a free block that is a whole segment
    p.erase(b);
    reserved_ -= b->size;
    ++upstream_frees_;
    delete b;
  }

  /// [release_available_cached_blocks] With max_split_size: the smallest cached oversize segment of the stream that
  /// covers max(size, max_split_size), else the stream's largest ones until that much is released.
  bool release_oversize(pool& p, std::size_t size, int stream) {
    if (max_split_ == unlimited) return false;
    block key{0, size < max_split_ ? max_split_ : size, stream, false, false, nullptr, nullptr};
    auto it = p.lower_bound(&key);
    if (it != p.end() && (*it)->stream == stream) {
      if ((*it)->prev != nullptr || (*it)->next != nullptr) return false;  // PyTorch assumes oversize = whole
      release(p, *it);
      return true;
    }
    std::size_t released = 0;
    while (released < key.size && it != p.begin()) {
      block* largest = *std::prev(it);  // the stream's largest block below the key
      if (largest->stream != stream || largest->size < max_split_ || largest->prev != nullptr ||
          largest->next != nullptr) {
        break;
      }
      released += largest->size;
      release(p, largest);
    }
    return released >= key.size;
  }

  /// [release_cached_blocks] Every free block that is a whole segment, large pool first.
  void release_all() {
    for (pool* p : {&large_, &small_}) {
      for (auto it = p->begin(); it != p->end();) {
        block* b = *it++;
        if (b->prev == nullptr && b->next == nullptr) release(*p, b);
      }
    }
  }

  std::size_t capacity_;
  std::size_t max_split_;
  pool small_, large_;
  std::unordered_map<std::uintptr_t, block*> allocated_;
  std::uintptr_t next_address_ = std::uintptr_t{1} << 40;
  std::size_t reserved_ = 0, peak_reserved_ = 0, allocated_bytes_ = 0;
  std::size_t upstream_allocs_ = 0, upstream_frees_ = 0, retries_ = 0, ooms_ = 0;
};

}  // namespace gpukit_bench
