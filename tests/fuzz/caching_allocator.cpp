// Fuzz target: the caching allocator engine (include/gpukit/memory/caching_allocator.hpp) over the address-space
// upstream, driven by operation sequences on real CPU streams held back by gates, destroyed and made anew. After EVERY
// operation: segments and blocks tile, no two live allocations overlap, the statistics equal a recomputation from the
// snapshot, the upstream's outstanding bytes equal reserved bytes, memory recorded for a busy stream is not handed out
// before that stream's work completes, and out of memory is gpukit::out_of_memory_error with the allocator still
// usable.
//
// The allocator waits on the host for pending events in empty_cache, trim, limits and on its out-of-memory path; a
// gated stream would never finish, so the stream ops open every gate before such a wait (the work "completes"), and
// before a stream waits for another's (cross-stream reuse). The upstream's free opens them too, as cudaFree waits for
// the device. A held stream may be abandoned: the stream ops report it destroyed while its work is still held (a
// CUDA stream destroyed with work queued), so its memory must wait for that work however it leaves the stream.
#define DOCTEST_CONFIG_DISABLE  // the shared invariant checker includes doctest; no test runner here
#include "memory/allocator_support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>

#include "fuzz_support.hpp"
#include "gated_streams.hpp"
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

using gpukit_fuzz::stream_count;
using gpukit_fuzz::world;

/// gpukit's stream ops, except that a host wait first lets the stream waited for finish (that stream only: the
/// others stay held), and that abandoned streams (gated_streams::abandon) count as destroyed. (They count as
/// unfinished without help: a stream's life says finished only once the stream is destroyed.)
struct gated_stream_ops : gpukit::stream_ops {
  bool expired(const tracker_type& t) const noexcept {
    return (t && world().is_zombie(t.get())) || gpukit::stream_ops::expired(t);
  }
  std::uint64_t expirations() const noexcept { return gpukit::stream_ops::expirations() + world().abandoned; }
  void record(gpukit::event& e, const gpukit::stream_view& s) const {
    gpukit::stream_ops::record(e, s);
    world().recorded_on[&e] = s.id();
  }
  void synchronize(const gpukit::event& e) const {
    world().complete_recorder_of(&e);
    if (!e.ready()) world().complete_all();  // recorded elsewhere (not through these ops)
    gpukit::stream_ops::synchronize(e);
  }
  void wait_finished(const tracker_type& t) const {
    if (t && world().is_zombie(t.get())) world().complete_zombie(world().zombie_of(t.get()));
    gpukit::stream_ops::wait_finished(t);  // any other destroyed stream's work has completed (a CPU stream's has)
  }
  /// A stream's wait for another's work (cross_stream_reuse) would hold it behind a gate too, and settle() would
  /// wait for it forever: the stream that recorded the event completes first (the others stay held). Streams not
  /// held have finished (settle), so the order does not depend on timing.
  void wait(const gpukit::event& e, const gpukit::stream_view& s) const {
    world().settle();
    world().complete_recorder_of(&e);
    if (!e.ready()) world().complete_all();
    gpukit::stream_ops::wait(e, s);
  }
};

/// The fences of the input being replayed, which unmapping pages checks (draining_upstream).
const std::vector<struct fence>* active_fences = nullptr;
bool overlaps_busy_fence(std::uintptr_t begin, std::uintptr_t end);

/// The address-space upstream, whose free waits for every stream's work first, as cudaFree waits for the device (the
/// allocator relies on it: synchronizes_on_free()), and whose wait before unmapping waits for it too, as
/// cuda_upstream's does. Unmapping after that wait does not wait: the allocator must have waited for the work that
/// uses the pages, which is checked here (a GPU would fault).
struct draining_upstream : gpukit::address_space_upstream {
  using gpukit::address_space_upstream::address_space_upstream;
  void deallocate(void* p, std::size_t bytes) noexcept {
    world().complete_all();
    gpukit::address_space_upstream::deallocate(p, bytes);
  }
  bool wait_before_unmap() noexcept {
    world().complete_all();
    return gpukit::address_space_upstream::wait_before_unmap();
  }
  bool unmap_after_wait(void* address, std::size_t bytes) noexcept {
    const auto begin = reinterpret_cast<std::uintptr_t>(address);
    GPUKIT_FUZZ_CHECK(!overlaps_busy_fence(begin, begin + bytes), "unmapped pages a busy stream may still use");
    return gpukit::address_space_upstream::unmap_after_wait(address, bytes);
  }
};

using allocator_type = gpukit::basic_caching_allocator<draining_upstream, gated_stream_ops>;

struct live_block {
  void* p = nullptr;
  std::size_t bytes = 0;
  int stream = 0;
  std::uint64_t generation = 0;  // of the stream it was allocated on: replaced since, its free warns (misuse)
  std::array<bool, stream_count> recorded{};
};

/// Memory a busy stream may still use: not to be handed out before that stream's epoch passes (or, for a stream
/// abandoned since, before its work completes).
struct fence {
  std::uintptr_t begin = 0, end = 0;
  int stream = 0;
  std::uint64_t generation = 0;  // of the stream at `stream`
  std::uint64_t epoch = 0;
  int exempt = -1;  // the stream whose own later work is ordered after it (the owner's fence), of this generation
  std::uint64_t exempt_generation = 0;
};

/// Memory [begin, end) used by the work stream k holds now.
fence fence_of(std::uintptr_t begin, std::uintptr_t end, int k, const gpukit_fuzz::gated_streams& w) {
  return {begin, end, k, w.generation[k], w.epoch[k]};
}

/// The work the fence waits for has completed.
bool passed(const fence& f, const gpukit_fuzz::gated_streams& w) {
  if (f.generation == w.generation[f.stream]) return w.epoch[f.stream] > f.epoch;
  return w.work_done(f.stream, f.generation, f.epoch);
}

bool overlaps_busy_fence(std::uintptr_t begin, std::uintptr_t end) {
  if (active_fences == nullptr) return false;
  for (const fence& f : *active_fences) {
    if (!passed(f, world()) && begin < f.end && f.begin < end) return true;
  }
  return false;
}

std::size_t pick_size(gpukit_fuzz::input& in, std::size_t capacity) {
  switch (in.byte() % 8) {
    case 0:
      return static_cast<std::size_t>(in.in_range(0, 4096));
    case 1:
    case 2:
      return static_cast<std::size_t>(in.in_range(1, MiB));
    case 3:
    case 4:
      return static_cast<std::size_t>(in.in_range(MiB, 64 * MiB));
    case 5:
      return static_cast<std::size_t>(in.in_range(1, capacity + capacity / 2));
    case 6:
      return static_cast<std::size_t>(in.in_range(1, 16)) * MiB;
    default:
      return std::numeric_limits<std::size_t>::max() - static_cast<std::size_t>(in.in_range(0, 1 << 20));
  }
}

std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

/// The block's stream was destroyed and replaced since it was allocated (its free is a misuse, warned once).
bool outlived_its_stream(const live_block& b, const gpukit_fuzz::gated_streams& w) {
  return b.generation != w.generation[b.stream];
}

/// Stream `s` is not the one the block was allocated on: another index, or a new stream at the same index.
bool is_other_stream(const live_block& b, int s, const gpukit_fuzz::gated_streams& w) {
  return s != b.stream || b.generation != w.generation[s];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpukit_fuzz::input in(data, size);
  gpukit_fuzz::gated_streams& w = world();
  w.complete_all();  // nothing held or abandoned is left from an input that failed
  w.recorded_on.clear();
  gpukit_test::captured_warnings warnings;

  const std::uint8_t setup = in.byte();
  gpukit::allocator_options options = (setup & 1) ? gpukit::allocator_options::pytorch() : gpukit::allocator_options{};
  if (setup & 2) options.release_before_grow = !options.release_before_grow;
  if (setup & 4) options.reserved_limit = static_cast<std::size_t>(in.in_range(1, 512)) * MiB;
  if (setup & 32) options.expandable_segments = true;  // pages of 2 MiB mapped into one range per stream and pool
  if (setup & 64) options.front_cache = false;
  // Blocks move between streams, also into other streams' ranges of expandable segments (with bit 16, one of the
  // capacity's: no byte of its own, so that the corpus's inputs read as before).
  if ((setup & 80) == 80) options.cross_stream_reuse = true;
  if (setup & 128) options.reuse_before_release = true;  // split blocks kept whole, then give back what is needed
  const std::size_t capacities[] = {8 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB};
  std::size_t capacity = capacities[(setup >> 3) % 4];
  std::size_t limit = options.reserved_limit;

  std::vector<live_block> live;
  std::vector<fence> fences;
  active_fences = &fences;
  std::vector<std::uintptr_t> freed;   // addresses freed and not live again (double-free probes)
  std::size_t frees_after_stream = 0;  // allocations freed after their stream was destroyed: one warning each
  {
    allocator_type a(gpukit::device::cpu(), options, capacity);
    int injected_failures = 0;  // upstream failures still armed (fail_next)
    for (int step = 0; !in.empty() && step < 256; ++step) {
      const std::uint8_t op = in.byte();
      const std::size_t reserved_before = a.memory_reserved();
      std::string what = "step " + std::to_string(step) + " op " + std::to_string(op % 16);
      switch (op % 16) {
        case 0:
        case 1:
        case 2: {  // allocate
          const int s = static_cast<int>(in.byte() % stream_count);
          const std::size_t bytes = pick_size(in, capacity);
          what += " allocate " + std::to_string(bytes) + " on stream " + std::to_string(s);
          try {
            void* p = a.allocate(bytes, *w.streams[s]);
            if (bytes == 0) {
              GPUKIT_FUZZ_CHECK(p == nullptr, what);
              break;
            }
            GPUKIT_FUZZ_CHECK(p != nullptr, what);
            const auto begin = reinterpret_cast<std::uintptr_t>(p);
            for (const auto& f : fences) {
              if (passed(f, w)) continue;
              if (f.exempt == s && f.exempt_generation == w.generation[s]) continue;
              GPUKIT_FUZZ_CHECK(begin + bytes <= f.begin || f.end <= begin,
                                what + ": handed out memory a busy recorded stream may still use");
            }
            GPUKIT_FUZZ_CHECK(a.memory_reserved() <= reserved_before || a.memory_reserved() <= limit,
                              what + ": grew reserved memory above the limit");
            live.push_back({p, bytes, s, w.generation[s], {}});
            for (std::size_t i = 0; i < freed.size(); ++i) {
              if (freed[i] == begin) freed.erase(freed.begin() + static_cast<std::ptrdiff_t>(i--));
            }
          } catch (const gpukit::out_of_memory_error& e) {
            what += std::string(": ") + e.what();
            if (GPUKIT_FUZZ_FIXED_DEFECT_2 && injected_failures == 0 && bytes < capacity) {
              // No false out of memory: what is left must not fit the smallest segment the request could use.
              w.complete_all();
              const std::size_t rounded = a.rounded_size(bytes);
              const std::size_t smallest = rounded <= options.small_size
                                               ? options.small_segment_size
                                               : round_up(rounded, options.large_segment_rounding);
              const std::size_t ceiling = std::min(capacity, limit);
              a.empty_cache();
              GPUKIT_FUZZ_CHECK(a.memory_reserved() + smallest > ceiling, what + ": false out of memory");
            }
          } catch (const gpukit::invalid_argument_error& e) {
            GPUKIT_FUZZ_CHECK(bytes > std::numeric_limits<std::size_t>::max() / 2, what + ": " + e.what());
          }
          // An injected failure counts for this request only: disarm one the allocator did not reach (a limit
          // refused first), so a later out of memory is never blamed on it.
          a.upstream().fail_next(0);
          injected_failures = 0;
          break;
        }
        case 3:
        case 4: {  // deallocate, maybe on another stream
          if (live.empty()) break;
          const std::size_t i = in.byte() % live.size();
          const bool on_stream = (op % 16) == 4;
          const int s = static_cast<int>(in.byte() % stream_count);
          live_block b = live[i];
          if (on_stream && is_other_stream(b, s, w)) b.recorded[s] = true;
          what += " deallocate block " + std::to_string(i) + (on_stream ? " on stream " + std::to_string(s) : "");
          if (outlived_its_stream(b, w)) ++frees_after_stream;
          if (on_stream) {
            a.deallocate(b.p, *w.streams[s]);
          } else {
            a.deallocate(b.p);
          }
          const auto begin = reinterpret_cast<std::uintptr_t>(b.p);
          for (int k = 0; k < stream_count; ++k) {
            if (b.recorded[k] && w.gates[k]) fences.push_back(fence_of(begin, begin + b.bytes, k, w));
          }
          // Another stream may take the block only after the owner's held work: with cross-stream reuse the engine
          // records an event at the free and makes the new stream wait for it; without, the block goes to another
          // stream only once the owner is destroyed and its work done, or through the upstream (whose free waits).
          // The owner itself reuses it at once (its later work is ordered after). An abandoned owner's work was
          // fenced when it was abandoned.
          if (!outlived_its_stream(b, w) && w.gates[b.stream]) {
            fence f = fence_of(begin, begin + b.bytes, b.stream, w);
            f.exempt = b.stream;
            f.exempt_generation = b.generation;
            fences.push_back(f);
          }
          freed.push_back(begin);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
        case 5: {  // record_stream
          if (live.empty()) break;
          const std::size_t i = in.byte() % live.size();
          const int s = static_cast<int>(in.byte() % stream_count);
          what += " record_stream block " + std::to_string(i) + " stream " + std::to_string(s);
          a.record_stream(live[i].p, *w.streams[s]);
          if (is_other_stream(live[i], s, w)) live[i].recorded[s] = true;
          break;
        }
        case 6:
        case 7: {  // hold a stream back (work that uses its memory is in flight)
          const int s = static_cast<int>(in.byte() % stream_count);
          what += " hold stream " + std::to_string(s);
          w.hold(s);
          break;
        }
        case 8: {  // its work completes
          const int s = static_cast<int>(in.byte() % stream_count);
          what += " complete stream " + std::to_string(s);
          w.complete(s);
          break;
        }
        case 9:
          what += " empty_cache";
          a.empty_cache();
          break;
        case 10: {
          const std::size_t target = static_cast<std::size_t>(in.in_range(0, capacity));
          what += " trim " + std::to_string(target);
          const std::size_t after = a.trim(target);
          GPUKIT_FUZZ_CHECK(after == a.memory_reserved(), what);
          break;
        }
        case 11: {  // limits, below usage too
          const std::uint8_t kind = in.byte();
          const std::size_t reported_before = a.reserved_limit();
          bool changed = true;
          if (kind & 1) {
            limit =
                (kind & 2) ? gpukit::allocator_options::unlimited : static_cast<std::size_t>(in.in_range(0, capacity));
            what += " set_reserved_limit " + std::to_string(limit);
            a.set_reserved_limit(limit);
          } else {
            static const double fractions[] = {0.0, -0.5, 1.5, std::nan(""), 1.0, 0.5, 0.125, 1e-9};
            const double f = fractions[(kind >> 1) % 8];
            what += " set_memory_fraction " + std::to_string(f);
            try {
              a.set_memory_fraction(f);
              GPUKIT_FUZZ_CHECK(f > 0.0 && f <= 1.0, what);
              limit = a.reserved_limit();
            } catch (const gpukit::invalid_argument_error&) {
              GPUKIT_FUZZ_CHECK(!(f > 0.0 && f <= 1.0), what);
              changed = false;
            }
          }
          GPUKIT_FUZZ_CHECK(a.reserved_limit() == (changed ? limit : reported_before), what);
          break;
        }
        case 12: {  // another process takes (or gives back) device memory
          capacity = capacities[in.byte() % 4];
          a.upstream().set_capacity(capacity);
          break;
        }
        case 13:
          a.upstream().fail_next(1);
          injected_failures = 1;
          break;
        case 14: {  // misuse: a double free or an interior pointer changes nothing
          std::uintptr_t bogus = 0;
          if (!freed.empty() && in.flag()) {
            bogus = freed[in.byte() % freed.size()];
          } else if (!live.empty()) {
            const auto& b = live[in.byte() % live.size()];
            bogus = reinterpret_cast<std::uintptr_t>(b.p) + 1 + in.byte() % b.bytes;
          }
          if (bogus == 0) break;
          bool live_start = false;
          for (const auto& b : live) live_start = live_start || reinterpret_cast<std::uintptr_t>(b.p) == bogus;
          if (live_start) break;
          what += " deallocate a pointer it does not own";
          bool refused = false;
          try {
            a.deallocate(reinterpret_cast<void*>(bogus));
          } catch (const gpukit::invalid_argument_error&) {
            refused = true;
          }
          GPUKIT_FUZZ_CHECK(refused, what);
          break;
        }
        default:
          if (op & 16) {  // a stream is destroyed (once its work completes, or with it held), a new one in its place
            const std::uint8_t pick = in.byte();
            const int s = static_cast<int>(pick % stream_count);
            if ((pick & 128) && w.can_abandon(s)) {
              // Abandoned with its work held: the memory that work uses (blocks recorded on it, its own live blocks,
              // the user may free later: a misuse, warned) waits for it. Its free blocks carry its fences already.
              what += " abandon held stream " + std::to_string(s);
              for (const auto& b : live) {
                const auto begin = reinterpret_cast<std::uintptr_t>(b.p);
                if (b.recorded[s] || !is_other_stream(b, s, w))
                  fences.push_back(fence_of(begin, begin + b.bytes, s, w));
              }
              w.abandon(s);
            } else {
              what += " replace stream " + std::to_string(s);
              w.replace(s);
            }
            for (auto& b : live) b.recorded[s] = false;  // the new stream has not used them
          } else {
            a.reset_peak_stats();
          }
          break;
      }

      gpukit_fuzz::trace(what);
      w.settle();
      std::vector<gpukit_test::live_allocation> expected;
      for (const auto& b : live) expected.push_back({reinterpret_cast<std::uintptr_t>(b.p), b.bytes});
      const std::string problem =
          gpukit_test::check_invariants(a.snapshot(), expected, options.rounding, true, false, true);
      GPUKIT_FUZZ_CHECK(problem.empty(), what + ": " + problem);
      GPUKIT_FUZZ_CHECK(a.upstream().used() == a.memory_reserved(), what + ": upstream and reserved bytes differ");
      if (GPUKIT_FUZZ_FIXED_DEFECT_5) {
        GPUKIT_FUZZ_CHECK(a.reserved_limit() == limit && a.stats().reserved_limit == limit, what);
      }
    }
    for (const auto& b : live) {
      if (outlived_its_stream(b, w)) ++frees_after_stream;
      a.deallocate(b.p);
    }
    w.complete_all();
    w.settle();
    a.empty_cache();
    GPUKIT_FUZZ_CHECK(a.memory_reserved() == 0 && a.upstream().used() == 0, "everything freed, nothing reserved");
  }
  const std::vector<std::string> messages = warnings.messages();
  for (const std::string& m : messages) {  // the misuse of freeing after the stream's destruction, once each
    if (m.find("was destroyed while the allocation was live") == std::string::npos) {
      gpukit_fuzz::fail("unexpected warning: " + m);
    }
  }
  GPUKIT_FUZZ_CHECK(messages.size() == frees_after_stream, std::to_string(messages.size()) + " warnings for " +
                                                               std::to_string(frees_after_stream) +
                                                               " allocations freed after their stream was destroyed");
  w.complete_all();
  active_fences = nullptr;
  return 0;
}
