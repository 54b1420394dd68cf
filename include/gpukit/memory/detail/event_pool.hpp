// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Events kept for reuse, per device, so that recording "this memory is free once the stream gets here" does not
/// create and destroy an event each time. The one event pool of gpukit's stream-ordered engines: the caching
/// allocator keeps one under its device lock, the pinned pool and the staging engine share a process-wide one behind
/// a mutex (pinned_pool.hpp). Not synchronized itself: its owner's lock guards it.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>

#include <cstddef>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Idle events (`Item`: an event, or a pointer owning one), a list per device: an event can be recorded only on
/// streams of its own device.
template <class Item>
class event_pool {
 public:
  /// Keeps at most `capacity` events per device; those given back beyond it are destroyed.
  explicit event_pool(std::size_t capacity = std::numeric_limits<std::size_t>::max()) noexcept : capacity_(capacity) {}

  /// An idle event of device `d`, or nothing (the caller creates one).
  std::optional<Item> take(gpukit::device d) noexcept {
    std::vector<Item>* list = find(d);
    if (list == nullptr || list->empty()) return std::nullopt;
    std::optional<Item> item(std::move(list->back()));
    list->pop_back();
    return item;
  }

  /// Keeps `item`, an event of device `d` whose recorded work is no longer waited for. When the pool is full for
  /// `d`, or no memory is left to keep it, it is destroyed instead.
  void give(gpukit::device d, Item item) noexcept {
    try {
      std::vector<Item>* list = find(d);
      if (list == nullptr) list = &lists_.emplace_back(d, std::vector<Item>{}).second;
      if (list->size() < capacity_) list->push_back(std::move(item));
    } catch (...) {
      // No memory to keep it: `item` is destroyed on return.
    }
  }

 private:
  std::vector<Item>* find(gpukit::device d) noexcept {
    for (auto& [device, list] : lists_) {
      if (device == d) return &list;
    }
    return nullptr;
  }

  std::size_t capacity_;
  std::vector<std::pair<gpukit::device, std::vector<Item>>> lists_;  // a few devices: a scan is cheapest
};

}  // namespace detail
GPUKIT_END_NAMESPACE
