// Baselines for the allocator hot-path benchmark: a caching allocator built the way PyTorch's is (one mutex, free
// blocks in a std::set ordered by (stream, size, address) for best fit, live blocks in an std::unordered_map,
// split and merged blocks allocated with new/delete), over host memory. It leaves out PyTorch's statistics,
// events and options, so it is a lower bound on the cost of that design.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>
#include <vector>

namespace gpukit_bench {

class set_best_fit_allocator {
 public:
  set_best_fit_allocator() = default;
  set_best_fit_allocator(const set_best_fit_allocator&) = delete;
  set_best_fit_allocator& operator=(const set_best_fit_allocator&) = delete;
  ~set_best_fit_allocator() {
    for (void* s : segments_) std::free(s);
    for (auto& pool : free_) {
      for (block* b : pool) delete b;
    }
    for (auto& entry : active_) delete entry.second;
  }

  void* allocate(std::size_t bytes, std::uintptr_t stream) {
    const std::size_t size = (bytes + 511) & ~std::size_t{511};
    const bool small = size <= (std::size_t{1} << 20);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& pool = free_[small ? 1 : 0];
    block key{stream, size, 0, small};
    auto it = pool.lower_bound(&key);
    block* b = nullptr;
    if (it != pool.end() && (*it)->stream == stream) {
      b = *it;
      pool.erase(it);
    } else {
      const std::size_t segment = small ? (std::size_t{2} << 20)
                                        : (size < (std::size_t{10} << 20)
                                               ? (std::size_t{20} << 20)
                                               : (size + (std::size_t{2} << 20) - 1) & ~((std::size_t{2} << 20) - 1));
      void* p = std::malloc(segment);
      if (p == nullptr) throw std::bad_alloc();
      segments_.push_back(p);
      b = new block{stream, segment, reinterpret_cast<std::uintptr_t>(p), small};
    }
    const std::size_t remaining = b->size - size;
    if (small ? remaining >= 512 : remaining > (std::size_t{1} << 20)) {
      block* rest = new block{stream, remaining, b->ptr + size, small};
      rest->prev = b;
      rest->next = b->next;
      if (b->next != nullptr) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      pool.insert(rest);
    }
    b->allocated = true;
    active_.emplace(reinterpret_cast<void*>(b->ptr), b);
    return reinterpret_cast<void*>(b->ptr);
  }

  void deallocate(void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = active_.find(p);
    block* b = it->second;
    active_.erase(it);
    b->allocated = false;
    auto& pool = free_[b->small ? 1 : 0];
    for (block* n : {b->prev, b->next}) {
      if (n == nullptr || n->allocated) continue;
      pool.erase(n);
      if (n == b->prev) {
        b->ptr = n->ptr;
        b->prev = n->prev;
        if (b->prev != nullptr) b->prev->next = b;
      } else {
        b->next = n->next;
        if (b->next != nullptr) b->next->prev = b;
      }
      b->size += n->size;
      delete n;
    }
    pool.insert(b);
  }

 private:
  struct block {
    std::uintptr_t stream;
    std::size_t size;
    std::uintptr_t ptr;
    bool small;
    block* prev = nullptr;
    block* next = nullptr;
    bool allocated = false;
  };
  struct order {
    bool operator()(const block* a, const block* b) const noexcept {
      if (a->stream != b->stream) return a->stream < b->stream;
      if (a->size != b->size) return a->size < b->size;
      return a->ptr < b->ptr;
    }
  };
  std::mutex mutex_;
  std::set<block*, order> free_[2];  // large, small
  std::unordered_map<void*, block*> active_;
  std::vector<void*> segments_;
};

}  // namespace gpukit_bench
