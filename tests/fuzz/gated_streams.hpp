// Three CPU streams shared by every input of a sequence fuzz target, each either idle or held back by a gate, so a
// target decides when a stream's work completes.
#pragma once

#include "support.hpp"

#include <gpukit/stream/stream.hpp>

#include <array>
#include <cstdint>
#include <memory>

namespace gpukit_fuzz {

constexpr int stream_count = 3;

struct gated_streams {
  std::array<std::unique_ptr<gpukit::stream>, stream_count> streams;
  std::array<std::unique_ptr<gpukit_test::gate>, stream_count> gates;  // non-null while the stream is held
  std::array<std::uint64_t, stream_count> epoch{};                     // completions so far
  std::array<std::uint64_t, stream_count> generation{};                // replacements so far

  gated_streams() {
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
  void complete_all() {
    for (int i = 0; i < stream_count; ++i) complete(i);
  }
  bool any_held() const { return gates[0] || gates[1] || gates[2]; }
  /// Lets the streams not held finish what they have (events just recorded on them), so that whether a freed block
  /// is still pending never depends on thread timing: every input replays the same way.
  void settle() {
    for (int i = 0; i < stream_count; ++i) {
      if (!gates[i]) streams[i]->synchronize();
    }
  }
  int index_of(const gpukit::stream_view& s) const {
    for (int i = 0; i < stream_count; ++i) {
      if (streams[i]->view().id() == s.id()) return i;
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
