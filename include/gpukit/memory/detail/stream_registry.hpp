// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The caching allocator's stream registry (caching_allocator.hpp): the state it keeps for each stream it has seen,
/// found by the stream's key (stream_ops.hpp). The keys sit in one contiguous vector that a lookup only reads, so
/// threads allocating on different streams write no shared cache line here; past `linear_lookup` streams a hash
/// index is kept beside it. When to sweep and which states are idle is the allocator's policy, not the registry's.
/// Not thread-safe: the allocator's device lock guards it.

#include <gpukit/detail/config.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// The states of the streams an allocator has seen, by key. `State` has a `key` member (std::uintptr_t), the key it
/// was added under. States keep their addresses until they are removed.
template <class State>
class stream_registry {
 public:
  /// Up to this many streams a lookup scans the keys; past it, a hash index is kept as well.
  static constexpr std::size_t linear_lookup = 16;

  /// The state registered under `key`, or nullptr.
  State* find(std::uintptr_t key) const {
    if (index_.empty()) {
      for (const auto& entry : keys_) {
        if (entry.first == key) return entry.second;
      }
      return nullptr;
    }
    const auto it = index_.find(key);
    return it == index_.end() ? nullptr : it->second;
  }

  /// Registers a state made from `args` under `key`, which must not be registered yet. Strong guarantee: if it
  /// throws, the registry holds and finds what it did before.
  template <class... Args>
  State& add(std::uintptr_t key, Args&&... args) {
    states_.push_back(std::make_unique<State>(std::forward<Args>(args)...));
    State* st = states_.back().get();
    const bool building_index = index_.empty() && keys_.size() >= linear_lookup;  // this add builds it whole
    try {
      keys_.emplace_back(key, st);
      if (!index_.empty()) {
        index_.emplace(key, st);
      } else if (keys_.size() > linear_lookup) {
        for (const auto& entry : keys_) index_.emplace(entry.first, entry.second);
      }
    } catch (...) {
      if (!keys_.empty() && keys_.back().second == st) keys_.pop_back();
      // A part-built index would hide the states left out of it: lookups scan the keys until an add builds it whole.
      // A single emplace into a complete index changes nothing when it throws.
      if (building_index) index_.clear();
      states_.pop_back();
      throw;
    }
    return *st;
  }

  /// Removes (and destroys) the states for which `idle(state)` is true; the others keep their addresses. `idle` must
  /// not throw. Does not throw: the keys are rebuilt within their old capacity, and an index that cannot be rebuilt
  /// is left empty (lookups scan the keys until the next registration builds it).
  template <class Idle>
  void remove_if(Idle idle) noexcept {
    static_assert(std::is_nothrow_invocable_r_v<bool, Idle&, const State&>,
                  "stream_registry::remove_if: the predicate must be noexcept (a throw would leave states half moved)");
    states_.erase(
        std::remove_if(states_.begin(), states_.end(), [&idle](const std::unique_ptr<State>& st) { return idle(*st); }),
        states_.end());
    keys_.clear();
    index_.clear();
    for (const auto& st : states_) keys_.emplace_back(st->key, st.get());
    if (keys_.size() > linear_lookup) {
      try {
        for (const auto& entry : keys_) index_.emplace(entry.first, entry.second);
      } catch (...) {
        index_.clear();
      }
    }
  }

  /// How many states are registered.
  std::size_t size() const noexcept { return states_.size(); }
  /// Whether lookups use the hash index (tests).
  bool indexed() const noexcept { return !index_.empty(); }

  /// The states, in registration order (as owning pointers: `st->`, `st.get()`).
  auto begin() const noexcept { return states_.begin(); }
  auto end() const noexcept { return states_.end(); }

 private:
  std::vector<std::unique_ptr<State>> states_;
  std::vector<std::pair<std::uintptr_t, State*>> keys_;
  std::unordered_map<std::uintptr_t, State*> index_;
};

}  // namespace detail
GPUKIT_END_NAMESPACE
