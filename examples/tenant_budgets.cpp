// tenant_budgets: a resource of one's own (gpukit::device_resource) in a multi-tenant server. Each tenant's buffers
// come from a budget_resource, an adaptor over the device's default (caching) allocator that refuses what would take
// the tenant past its byte budget: one tenant cannot starve the others, and the cache stays shared. Runs on the
// first GPU, or on the CPU device when there is none. Exits 0 when every budget held and every byte came back.
#include <gpukit/gpukit.hpp>
#include <gpukit/memory/pmr.hpp>

#include <cstdio>
#include <exception>
#include <memory_resource>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

/// Memory from `upstream` while a tenant stays within `budget` bytes; beyond it, out_of_memory_error naming the
/// tenant. Thread-safe. Only the five functions of device_resource (and device()) are written: over-aligned
/// requests, the buffers and the standard adaptors come with the interface.
class budget_resource final : public gpukit::device_resource {
 public:
  budget_resource(std::string tenant, std::size_t budget, gpukit::device_resource& upstream)
      : tenant_(std::move(tenant)), budget_(budget), upstream_(upstream) {}

  gpukit::device device() const noexcept override { return upstream_.device(); }
  std::size_t in_use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  std::size_t refused() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return refused_;
  }

 private:
  void* do_allocate(std::size_t bytes, gpukit::stream_view stream) override {
    if (bytes == 0) return nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > budget_ - in_use_) {
        ++refused_;
        throw gpukit::out_of_memory_error("tenant " + tenant_ + ": " + std::to_string(bytes) + " bytes would exceed " +
                                          "its budget of " + std::to_string(budget_) + " (" + std::to_string(in_use_) +
                                          " in use)");
      }
      in_use_ += bytes;  // claimed before the upstream call, so two threads cannot both pass the check
    }
    void* p = nullptr;
    try {
      p = upstream_.allocate(bytes, stream);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ -= bytes;
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_.emplace(p, bytes);
    return p;
  }
  void do_deallocate(void* p) override {
    free_with(p, [&] { upstream_.deallocate(p); });
  }
  void do_deallocate(void* p, gpukit::stream_view stream) override {
    free_with(p, [&] { upstream_.deallocate(p, stream); });
  }
  void do_record_stream(void* p, gpukit::stream_view stream) override { upstream_.record_stream(p, stream); }
  bool do_owns(const void* p) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return sizes_.count(const_cast<void*>(p)) != 0;
  }
  std::size_t do_natural_alignment() const noexcept override { return upstream_.natural_alignment(); }

  template <class Free>
  void free_with(void* p, Free&& free) {
    if (p == nullptr) return;
    std::size_t bytes = 0;
    {
      // Forgotten before the upstream frees it: once freed, another thread may get `p` back from the cache and
      // record it here, which a later erase would undo.
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = sizes_.find(p);
      if (it == sizes_.end()) {
        throw gpukit::invalid_argument_error("tenant " + tenant_ + ": freeing memory it did not allocate");
      }
      bytes = it->second;
      sizes_.erase(it);
    }
    try {
      free();
    } catch (...) {  // the upstream refused the pointer: it stays this tenant's, as it was
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_.emplace(p, bytes);
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    in_use_ -= bytes;
  }

  std::string tenant_;
  std::size_t budget_;
  gpukit::device_resource& upstream_;
  mutable std::mutex mutex_;
  std::size_t in_use_ = 0;
  std::size_t refused_ = 0;
  std::unordered_map<void*, std::size_t> sizes_;
};

}  // namespace

static int run() {
  const gpukit::device d = gpukit::device_count() > 0 ? gpukit::device::cuda(0) : gpukit::device::cpu();
  constexpr std::size_t MiB = std::size_t{1} << 20;
  gpukit::device_allocator& shared = gpukit::default_allocator(d);
  budget_resource small("small", 8 * MiB, shared);
  budget_resource large("large", 64 * MiB, shared);
  gpukit::stream s(d);
  std::printf("tenants on %s: small (8 MiB), large (64 MiB), over one caching allocator\n", d.to_string().c_str());

  bool ok = true;
  {
    std::vector<gpukit::device_buffer<float>> small_batches;
    std::vector<gpukit::device_buffer<float>> large_batches;
    for (int request = 0; request < 12; ++request) {
      try {
        small_batches.emplace_back(MiB / sizeof(float), s, small);  // 1 MiB each: the 9th is refused
      } catch (const gpukit::out_of_memory_error& e) {
        if (request == 8) std::printf("refused: %s\n", e.what());
      }
      large_batches.emplace_back(4 * MiB / sizeof(float), s, large);  // 48 MiB of 64: all served
    }
    std::printf("small: %zu batches, %s in use, %zu refused; large: %zu batches, %s in use, %zu refused\n",
                small_batches.size(), gpukit::detail::format_bytes(small.in_use()).c_str(), small.refused(),
                large_batches.size(), gpukit::detail::format_bytes(large.in_use()).c_str(), large.refused());
    std::printf("the shared allocator: %s allocated, %s reserved\n",
                gpukit::detail::format_bytes(shared.memory_allocated()).c_str(),
                gpukit::detail::format_bytes(shared.memory_reserved()).c_str());
    ok = small_batches.size() == 8 && small.refused() == 4 && large_batches.size() == 12 && large.refused() == 0;
    // A std::pmr container of the large tenant, within its budget too (device memory: touched on the host only
    // because it is the CPU device here).
    if (d.is_cpu()) {
      gpukit::device_pmr_resource pmr(large, s.view());
      std::pmr::vector<int> ids(1000, 7, &pmr);
      ok = ok && large.in_use() > 48 * MiB;
    }
  }
  s.synchronize();
  ok = ok && small.in_use() == 0 && large.in_use() == 0;
  std::printf("after the batches: small %s, large %s in use; %s\n",
              gpukit::detail::format_bytes(small.in_use()).c_str(),
              gpukit::detail::format_bytes(large.in_use()).c_str(), ok ? "every budget held" : "UNEXPECTED");
  return ok ? 0 : 1;
}

// Any gpukit error (a bad GPUKIT_ALLOC_CONF, no memory, a CUDA failure) is printed, and the exit code says it: 1.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tenant_budgets: %s\n", e.what());
    return 1;
  }
}
