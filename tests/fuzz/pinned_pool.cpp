// Fuzz target: the pinned pool engine (include/gpukit/memory/pinned_pool.hpp) on the CPU backend: operation
// sequences over real CPU streams held back by gates, a capacity-limited host upstream that checks every release,
// and an event layer that fails on demand. After EVERY operation: live blocks do not overlap, the statistics equal
// a recomputation from the live set and the upstream's books, the cap holds, memory recorded for a busy stream is
// not handed out before that stream's work completes, and out of memory is gpukit::out_of_memory_error with the
// pool still usable.
#define DOCTEST_CONFIG_DISABLE  // the shared test helpers include doctest; no test runner here
#include <gpukit/memory/pinned_pool.hpp>
#include <gpukit/warning.hpp>
#include <gpukit/stream/stream.hpp>

#include "fuzz_support.hpp"
#include "gated_streams.hpp"
#include <gpukit/memory/pinned_pool_impl.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
using gpukit_fuzz::stream_count;
using gpukit_fuzz::world;

/// Host pages with a capacity; keeps the books of what is out, so a double or unknown release is caught.
struct upstream_books {
  std::size_t capacity = 0;
  std::size_t outstanding = 0;
  std::map<void*, std::size_t> blocks;
  int fail_next = 0;
};

class limited_upstream {
 public:
  explicit limited_upstream(std::shared_ptr<upstream_books> books) : books_(std::move(books)) {}
  void* allocate(std::size_t bytes) {
    if (books_->fail_next > 0 || bytes > books_->capacity - books_->outstanding) {
      if (books_->fail_next > 0) --books_->fail_next;
      throw gpukit::out_of_memory_error("limited_upstream: " + std::to_string(bytes) + " bytes, " +
                                        std::to_string(books_->capacity - books_->outstanding) + " left");
    }
    void* p = gpukit::detail::allocate_host_pages(bytes, "limited_upstream");
    books_->outstanding += bytes;
    books_->blocks.emplace(p, bytes);
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept {
    const auto it = books_->blocks.find(p);
    if (it == books_->blocks.end()) gpukit_fuzz::fail("the pool released a block it does not hold (twice?)");
    if (it->second != bytes) gpukit_fuzz::fail("the pool released a block with another size");
    books_->outstanding -= bytes;
    books_->blocks.erase(it);
    gpukit::detail::free_host_pages(p);
  }
  bool page_locked() const noexcept { return false; }

 private:
  std::shared_ptr<upstream_books> books_;
};

/// gpukit's events, failing on demand: the fault-injecting event layer.
struct event_faults {
  int fail_record = 0;  // when N > 0: the N-th record() call from now throws
  int fail_ready = 0;   // when N > 0: the N-th ready() call from now throws
};

struct faulty_sync {
  std::shared_ptr<event_faults> faults;
  gpukit::pinned_pool_sync real;
  using marker = gpukit::pinned_pool_sync::marker;
  marker record(gpukit::stream_view s) {
    if (faults->fail_record > 0 && --faults->fail_record == 0) {
      throw gpukit::cuda_error("injected: event record failed", cudaErrorLaunchFailure);
    }
    return real.record(s);
  }
  bool ready(const marker& m) {
    if (faults->fail_ready > 0 && --faults->fail_ready == 0) {
      throw gpukit::cuda_error("injected: event query failed", cudaErrorLaunchFailure);
    }
    return real.ready(m);
  }
  void wait(const marker& m) { real.wait(m); }
  void recycle(marker&& m) noexcept { real.recycle(std::move(m)); }
};

using pool_type = gpukit::basic_pinned_pool<limited_upstream, faulty_sync>;

struct live_block {
  void* p = nullptr;
  std::size_t bytes = 0;
  std::size_t size = 0;  // its size class
  std::array<bool, stream_count> recorded{};
};

struct fence {
  std::uintptr_t begin = 0, end = 0;
  int stream = 0;
  std::uint64_t epoch = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpukit_fuzz::input in(data, size);
  gpukit_fuzz::gated_streams& w = world();
  auto books = std::make_shared<upstream_books>();
  auto faults = std::make_shared<event_faults>();
  const std::uint8_t setup = in.byte();
  books->capacity = (std::size_t{1} << (setup % 4)) * 4 * MiB;  // 4-32 MiB
  gpukit::pinned_pool_options options;
  const std::size_t caps[] = {0, 64 * KiB, 1 * MiB, 4 * MiB, SIZE_MAX};
  options.max_cached_bytes = caps[(setup >> 2) % 5];
  options.classes_per_doubling = std::size_t{1} << ((setup >> 5) % 4);

  // The pool warns only when destroyed with lost blocks (kept out of use for good, documented); anything else is
  // unexpected.
  std::vector<std::string> warnings;
  const gpukit::warning_handler previous_handler =
      gpukit::set_warning_handler([&warnings](std::string_view message) { warnings.emplace_back(message); });
  std::vector<live_block> live;
  std::vector<fence> fences;
  std::size_t lost_blocks = 0;
  std::size_t lost_bytes = 0;
  {
    pool_type pool(limited_upstream(books), options, faulty_sync{faults, {}});
    for (int step = 0; !in.empty() && step < 256; ++step) {
      const std::uint8_t op = in.byte();
      std::string what = "step " + std::to_string(step) + " op " + std::to_string(op % 12);
      const bool query_fault_armed = faults->fail_ready > 0;
      try {
        switch (op % 12) {
          case 0:
          case 1:
          case 2: {
            const std::uint8_t scale = in.byte();
            const std::size_t bytes = scale % 4 == 0   ? static_cast<std::size_t>(in.in_range(0, 8 * KiB))
                                      : scale % 4 == 3 ? static_cast<std::size_t>(in.in_range(1, 40 * MiB))
                                                       : static_cast<std::size_t>(in.in_range(1, 2 * MiB));
            what += " allocate " + std::to_string(bytes);
            try {
              void* p = pool.allocate(bytes);
              if (bytes == 0) {
                GPUKIT_FUZZ_CHECK(p == nullptr, what);
                break;
              }
              const std::size_t cls = gpukit::pinned_size_class(bytes, options.classes_per_doubling);
              GPUKIT_FUZZ_CHECK(p != nullptr && pool.block_size(p) == cls && cls >= bytes, what);
              const auto begin = reinterpret_cast<std::uintptr_t>(p);
              for (const auto& f : fences) {
                if (w.epoch[f.stream] > f.epoch) continue;
                GPUKIT_FUZZ_CHECK(begin + cls <= f.begin || f.end <= begin,
                                  what + ": handed out memory a busy recorded stream may still use");
              }
              live.push_back({p, bytes, cls, {}});
            } catch (const gpukit::out_of_memory_error&) {
              // Documented; the checks below say the pool is still consistent.
            }
            break;
          }
          case 3:
          case 4: {
            if (live.empty()) break;
            const std::size_t i = in.byte() % live.size();
            const bool on_stream = (op % 12) == 4;
            const int s = static_cast<int>(in.byte() % stream_count);
            live_block b = live[i];
            what += " deallocate block " + std::to_string(i) + (on_stream ? " on stream " + std::to_string(s) : "");
            live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
            try {
              if (on_stream) {
                b.recorded[s] = true;
                pool.deallocate(b.p, *w.streams[s]);
              } else {
                pool.deallocate(b.p);
              }
            } catch (const gpukit::cuda_error&) {
              // An event could not be recorded: documented to take the block out of use and rethrow.
              ++lost_blocks;
              lost_bytes += b.size;
              break;
            }
            const auto begin = reinterpret_cast<std::uintptr_t>(b.p);
            for (int k = 0; k < stream_count; ++k) {
              if (b.recorded[k] && w.gates[k]) fences.push_back({begin, begin + b.size, k, w.epoch[k]});
            }
            break;
          }
          case 5: {
            if (live.empty()) break;
            const std::size_t i = in.byte() % live.size();
            const int s = static_cast<int>(in.byte() % stream_count);
            what += " record_stream block " + std::to_string(i) + " stream " + std::to_string(s);
            pool.record_stream(live[i].p, *w.streams[s]);
            live[i].recorded[s] = true;
            break;
          }
          case 6:
            w.hold(static_cast<int>(in.byte() % stream_count));
            break;
          case 7:
            w.complete(static_cast<int>(in.byte() % stream_count));
            break;
          case 8:
            what += " empty_cache";
            // Defect 1: empty_cache releases twice a block it promotes from pending when that pushes the cache over
            // the cap. Until the fix lands, promote first (stats() does, correctly), so empty_cache promotes nothing.
            if (!GPUKIT_FUZZ_FIXED_DEFECT_1) (void)pool.stats();
            pool.empty_cache();
            break;
          case 9: {
            options.max_cached_bytes = caps[in.byte() % 5];
            what += " set_max_cached_bytes " + std::to_string(options.max_cached_bytes);
            pool.set_max_cached_bytes(options.max_cached_bytes);
            break;
          }
          case 10: {
            const std::uint8_t kind = in.byte();
            if (kind & 1) books->fail_next = 1;
            if (kind & 2) faults->fail_record = 1 + (kind >> 6);
            if (GPUKIT_FUZZ_FIXED_DEFECT_3 && (kind & 4)) faults->fail_ready = 1 + ((kind >> 3) & 7);
            continue;  // armed for the next call of the pool, checked after it
          }
          default: {  // misuse: a pointer the pool did not hand out (or freed) changes nothing
            if (live.empty()) break;
            const auto& b = live[in.byte() % live.size()];
            void* bogus = static_cast<char*>(b.p) + 1 + in.byte() % b.size;
            what += " deallocate an interior pointer";
            bool refused = false;
            try {
              pool.deallocate(bogus);
            } catch (const gpukit::invalid_argument_error&) {
              refused = true;
            }
            GPUKIT_FUZZ_CHECK(refused, what);
            break;
          }
        }
      } catch (const gpukit::cuda_error& e) {
        // A failed event query propagates from the call that polled (documented); the checks below say the pool
        // is still consistent.
        GPUKIT_FUZZ_CHECK(query_fault_armed, what + ": " + e.what());
        what += std::string(" (threw: ") + e.what() + ")";
      }
      gpukit_fuzz::trace(what);
      w.settle();
      // An injected query failure may surface from the next call that polls; clear what is left of it here.
      faults->fail_ready = 0;
      faults->fail_record = 0;
      books->fail_next = 0;

      // Holding or completing a stream is not a call of the pool, and stats() promotes pending blocks: checking
      // here would hide what the pool's next call does with blocks whose events have just completed (defect 1).
      if (op % 12 == 6 || op % 12 == 7) continue;
      const gpukit::pinned_pool_stats st = pool.stats();
      std::size_t allocated = 0;
      std::size_t requested = 0;
      for (std::size_t i = 0; i < live.size(); ++i) {
        allocated += live[i].size;
        requested += live[i].bytes;
        const auto a0 = reinterpret_cast<std::uintptr_t>(live[i].p);
        for (std::size_t j = 0; j < i; ++j) {
          const auto b0 = reinterpret_cast<std::uintptr_t>(live[j].p);
          GPUKIT_FUZZ_CHECK(a0 + live[i].size <= b0 || b0 + live[j].size <= a0, what + ": live blocks overlap");
        }
      }
      const std::string numbers = what + ": allocated " + std::to_string(st.allocated_bytes) + " (expected " +
                                  std::to_string(allocated) + "), reserved " + std::to_string(st.reserved_bytes) +
                                  " (upstream " + std::to_string(books->outstanding) + "), cached " +
                                  std::to_string(st.cached_bytes) + ", pending " + std::to_string(st.pending_bytes);
      GPUKIT_FUZZ_CHECK(st.allocated_bytes == allocated, numbers);
      GPUKIT_FUZZ_CHECK(st.requested_bytes == requested, numbers);
      GPUKIT_FUZZ_CHECK(st.active_blocks == live.size(), numbers);
      GPUKIT_FUZZ_CHECK(st.lost_blocks == lost_blocks, numbers);
      GPUKIT_FUZZ_CHECK(st.reserved_bytes == books->outstanding, numbers);
      GPUKIT_FUZZ_CHECK(st.cached_bytes == st.reserved_bytes - st.allocated_bytes - lost_bytes, numbers);
      GPUKIT_FUZZ_CHECK(st.pending_bytes <= st.cached_bytes, numbers);
      GPUKIT_FUZZ_CHECK(st.active_blocks + st.free_blocks + st.pending_blocks + st.lost_blocks == books->blocks.size(),
                        numbers);
      GPUKIT_FUZZ_CHECK(st.cached_bytes - st.pending_bytes <= options.max_cached_bytes || st.free_blocks == 0,
                        numbers + ": free blocks over the cap");
      GPUKIT_FUZZ_CHECK(st.allocated_bytes_peak >= st.allocated_bytes && st.reserved_bytes_peak >= st.reserved_bytes,
                        numbers);
      // The same books in the caching allocator's vocabulary (memory_stats).
      const gpukit::host_allocator_stats h = pool.memory_stats();
      // A freed block waiting for its streams is still allocated there, as in PyTorch. Idle streams' events may
      // complete between the two calls (memory_stats promotes them), so the pending part is bounded, not exact.
      GPUKIT_FUZZ_CHECK(h.allocated_bytes.current >= static_cast<std::int64_t>(allocated) &&
                            h.allocated_bytes.current <= static_cast<std::int64_t>(allocated + st.pending_bytes),
                        numbers + ": memory_stats");
      GPUKIT_FUZZ_CHECK(h.allocation.current >= static_cast<std::int64_t>(live.size()) &&
                            h.allocation.current <= static_cast<std::int64_t>(live.size() + st.pending_blocks),
                        numbers + ": memory_stats");
      GPUKIT_FUZZ_CHECK(h.reserved_bytes.current == static_cast<std::int64_t>(books->outstanding),
                        numbers + ": memory_stats");
      GPUKIT_FUZZ_CHECK(h.segment.current == static_cast<std::int64_t>(books->blocks.size()),
                        numbers + ": memory_stats");
      GPUKIT_FUZZ_CHECK(h.num_host_alloc == h.segment.allocated && h.num_host_free == h.segment.freed,
                        numbers + ": memory_stats");
      for (const gpukit::stat* x : {&h.allocation, &h.segment, &h.allocated_bytes, &h.reserved_bytes}) {
        GPUKIT_FUZZ_CHECK(x->allocated - x->freed == x->current && x->peak >= x->current && x->current >= 0,
                          numbers + ": memory_stats");
      }
    }
    *faults = event_faults{};  // an input may end with a fault armed
    books->fail_next = 0;
    for (const auto& b : live) pool.deallocate(b.p);
    w.complete_all();
    w.settle();
    (void)pool.stats();
    pool.empty_cache();
    const gpukit::pinned_pool_stats st = pool.stats();
    GPUKIT_FUZZ_CHECK(st.reserved_bytes == lost_bytes && books->outstanding == lost_bytes,
                      "everything freed: only lost blocks stay reserved; reserved " +
                          std::to_string(st.reserved_bytes) + ", upstream " + std::to_string(books->outstanding) +
                          ", lost " + std::to_string(lost_bytes) + ", pending " + std::to_string(st.pending_bytes) +
                          ", free blocks " + std::to_string(st.free_blocks));
  }
  gpukit::set_warning_handler(previous_handler);
  for (const auto& m : warnings) {
    GPUKIT_FUZZ_CHECK(lost_blocks > 0 && m.find("destroyed with") != std::string::npos, "unexpected warning: " + m);
  }
  // Lost blocks are leaked on purpose by the pool (the device may still read them); the books say which.
  for (const auto& entry : books->blocks) gpukit::detail::free_host_pages(entry.first);
  w.complete_all();
  return 0;
}
