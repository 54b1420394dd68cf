// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A map node made before it is needed: inserting a node handle into a std::map does not allocate, so bookkeeping
/// that must not fail once a resource is had (an address range cut, device memory allocated) makes its node first.

#include <gpukit/detail/config.hpp>

#include <utility>

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// A node of `Map` (std::map or another container with node handles) holding (`key`, `value`), in no map yet.
/// Allocates (std::bad_alloc); insert it later with `map.insert(std::move(node))`, which cannot fail.
template <class Map, class Key, class Value>
typename Map::node_type detached_node(Key&& key, Value&& value) {
  Map one;
  one.emplace(std::forward<Key>(key), std::forward<Value>(value));
  return one.extract(one.begin());
}

}  // namespace detail
GPUKIT_END_NAMESPACE
