// Three CPU streams shared by every input of a sequence fuzz target, each either idle or held back by a gate, so a
// target decides when a stream's work completes. A held stream may also be abandoned: destroyed, as the allocator's
// stream ops are told (see zombie), while its work is still held, as a CUDA stream's work outlives cudaStreamDestroy.
#pragma once

#include "support.hpp"

#include <gpukit/stream/stream.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace gpukit_fuzz {

constexpr int stream_count = 3;

/// A stream abandoned while held: to the allocator (through its stream ops) destroyed, its work unfinished. A CPU
/// stream's destructor would wait for that work, so the stream itself lives on here until the work completes.
struct zombie {
  int index = 0;                 // the slot a new stream took
  std::uint64_t generation = 0;  // the slot's generation the stream was
  std::uint64_t epoch = 0;       // the slot's completions when it was abandoned: its work since is held
  std::unique_ptr<gpukit::stream> stream;
  std::unique_ptr<gpukit_test::gate> gate;
  const void* life = nullptr;  // what the allocator tracks the stream by (stream_view::lifetime())
  std::uintptr_t id = 0;       // stream_view::id(), which events recorded on it name (recorded_on)
};

struct gated_streams {
  std::array<std::unique_ptr<gpukit::stream>, stream_count> streams;
  std::array<std::unique_ptr<gpukit_test::gate>, stream_count> gates;  // non-null while the stream is held
  std::array<std::uint64_t, stream_count> epoch{};                     // completions so far
  std::array<std::uint64_t, stream_count> generation{};                // replacements so far
  std::vector<zombie> zombies;                                         // in the order they were abandoned
  std::uint64_t abandoned = 0;                                         // zombies made so far (expirations)
  static constexpr std::size_t max_zombies = 4;                        // each keeps a worker thread
  /// The stream (stream_view::id()) each event was last recorded on, so that a wait for an event completes that
  /// stream only: a wait that completed every stream would let any fence pass.
  std::unordered_map<const void*, std::uintptr_t> recorded_on;

  gated_streams() {
    zombies.reserve(max_zombies);  // abandon() cannot fail once it has moved a stream out
    for (auto& s : streams) s = std::make_unique<gpukit::stream>(gpukit::device::cpu());
  }
  void hold(int i) {
    if (gates[i]) return;
    gates[i] = std::make_unique<gpukit_test::gate>();
    gates[i]->hold(*streams[i]);
  }
  void complete(int i) {
    if (!gates[i]) return;
    gates[i]->open();
    streams[i]->synchronize();  // the host function waiting on the gate has returned: the gate may go
    gates[i].reset();
    ++epoch[i];
  }
  /// Stream i's work completes and the stream is destroyed; a new one takes its place (a server's stream per request).
  void replace(int i) {
    complete(i);
    streams[i] = std::make_unique<gpukit::stream>(gpukit::device::cpu());
    ++generation[i];
  }
  /// Stream i may be abandoned: it is held, and fewer than max_zombies are.
  bool can_abandon(int i) const { return gates[i] && zombies.size() < max_zombies; }
  /// Stream i (can_abandon) is destroyed, as the allocator sees it, with its work still held, and a new stream takes
  /// its place.
  void abandon(int i) {
    const gpukit::stream_view view = streams[i]->view();
    zombies.push_back(
        {i, generation[i], epoch[i], std::move(streams[i]), std::move(gates[i]), view.lifetime().get(), view.id()});
    streams[i] = std::make_unique<gpukit::stream>(gpukit::device::cpu());
    ++generation[i];
    ++abandoned;
  }
  /// An abandoned stream's work completes, and it is destroyed for real.
  void complete_zombie(std::size_t k) {
    zombies[k].gate->open();
    zombies[k].stream.reset();  // waits for the host function that waited on the gate
    zombies.erase(zombies.begin() + static_cast<std::ptrdiff_t>(k));
  }
  void complete_zombies() {
    while (!zombies.empty()) complete_zombie(0);
  }
  /// The abandoned stream the allocator tracks by `life` (zombies.size(): none).
  std::size_t zombie_of(const void* life) const {
    std::size_t k = 0;
    while (k < zombies.size() && zombies[k].life != life) ++k;
    return k;
  }
  bool is_zombie(const void* life) const { return zombie_of(life) < zombies.size(); }
  /// Whether the work stream `index` held at completion count `at`, as generation `gen`, has completed. Asked once the
  /// slot has a new stream: unless the stream was abandoned with that work held, it completed before it was replaced.
  bool work_done(int index, std::uint64_t gen, std::uint64_t at) const {
    for (const zombie& z : zombies) {
      if (z.index == index && z.generation == gen) return z.epoch > at;  // completed before the abandonment
    }
    return true;
  }
  /// Completes the stream (held, or abandoned) that `event` was last recorded on.
  void complete_recorder_of(const void* event) {
    const auto found = recorded_on.find(event);
    if (found == recorded_on.end()) return;
    if (const int i = index_of_id(found->second); i >= 0) return complete(i);
    for (std::size_t k = 0; k < zombies.size(); ++k) {
      if (zombies[k].id == found->second) return complete_zombie(k);
    }
  }
  void complete_all() {
    for (int i = 0; i < stream_count; ++i) complete(i);
    complete_zombies();
  }
  bool any_held() const { return gates[0] || gates[1] || gates[2]; }
  /// Lets the streams not held finish what they have (events just recorded on them), so that whether a freed block
  /// is still pending never depends on thread timing: every input replays the same way.
  void settle() {
    for (int i = 0; i < stream_count; ++i) {
      if (!gates[i]) streams[i]->synchronize();
    }
  }
  /// The held stream whose stream_view::id() is `id`, or -1.
  int index_of_id(std::uintptr_t id) const {
    for (int i = 0; i < stream_count; ++i) {
      if (streams[i]->view().id() == id) return i;
    }
    return -1;
  }
};

/// The streams of this process, created on first use and never destroyed: their threads outlive every input.
inline gated_streams& world() {
  static gated_streams* w = new gated_streams();
  return *w;
}

}  // namespace gpukit_fuzz
