// The caching allocator's stream registry (memory/detail/stream_registry.hpp): lookups by key below and above the
// linear-scan threshold, removal that keeps the other states where they are, and the strong guarantee of add() when
// any allocation inside it fails (this executable replaces operator new to fail on demand).
#include <doctest/doctest.h>

#include <gpukit/memory/detail/stream_registry.hpp>

#include "failing_heap.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

namespace {

// Allocations left before operator new fails (negative: never). Only armed around the call under test; atomic so
// that the compiler keeps the stores that arm it.
std::atomic<int> allocations_left{-1};

bool allocation_fails() {
  if (allocations_left.load() == 0) return true;
  if (allocations_left.load() > 0) --allocations_left;
  return false;
}
[[maybe_unused]] const bool installed = [] {
  gpukit_test::heap_fails = allocation_fails;
  return true;
}();

struct state {
  state(std::uintptr_t k, int v) : key(k), value(v) {}
  std::uintptr_t key;
  int value;
};

using registry = gpukit::detail::stream_registry<state>;

std::uintptr_t key_of(int i) { return 0x1000u + static_cast<std::uintptr_t>(i) * 0x40u; }

/// Every state of `r` is found by its key, with its value; `missing` is not.
void check_lookups(const registry& r, std::uintptr_t missing) {
  for (const auto& st : r) {
    const state* found = r.find(st->key);
    REQUIRE(found == st.get());
    CHECK(found->value == static_cast<int>((st->key - 0x1000u) / 0x40u));
  }
  CHECK(r.find(missing) == nullptr);
}

}  // namespace

TEST_CASE("stream registry: lookups scan the keys up to the threshold, then use the index, and find every state") {
  registry r;
  CHECK(r.find(key_of(0)) == nullptr);
  const int count = static_cast<int>(registry::linear_lookup) * 3;
  std::vector<const state*> addresses;
  for (int i = 0; i < count; ++i) {
    addresses.push_back(&r.add(key_of(i), key_of(i), i));
    CHECK(r.indexed() == (r.size() > registry::linear_lookup));
    check_lookups(r, key_of(count));
  }
  for (int i = 0; i < count; ++i) CHECK(r.find(key_of(i)) == addresses[static_cast<std::size_t>(i)]);
}

TEST_CASE("stream registry: remove_if drops the idle states, the others keep their addresses") {
  registry r;
  const int count = static_cast<int>(registry::linear_lookup) * 3;
  for (int i = 0; i < count; ++i) (void)r.add(key_of(i), key_of(i), i);
  const state* kept = r.find(key_of(1));
  r.remove_if([](const state& st) noexcept { return st.value % 2 == 0; });
  CHECK(r.size() == static_cast<std::size_t>(count / 2));
  CHECK(r.find(key_of(1)) == kept);
  for (int i = 0; i < count; ++i) CHECK((r.find(key_of(i)) != nullptr) == (i % 2 == 1));
  CHECK(r.indexed());  // still above the threshold: the index is rebuilt
  r.remove_if([](const state& st) noexcept { return st.value > 5; });  // below the threshold: back to scanning
  CHECK(r.size() == 3);
  CHECK_FALSE(r.indexed());
  check_lookups(r, key_of(0));
  (void)r.add(key_of(0), key_of(0), 0);  // a removed key may come back
  CHECK(r.find(key_of(0))->value == 0);
}

TEST_CASE("stream registry: remove_if never throws, and finds every state when rebuilding the index fails") {
  const int count = static_cast<int>(registry::linear_lookup) * 3;
  bool failed = false;
  for (int fail_at = 0; !failed || fail_at < 64; ++fail_at) {
    registry r;
    for (int i = 0; i < count; ++i) (void)r.add(key_of(i), key_of(i), i);
    allocations_left = fail_at;
    r.remove_if([](const state& st) noexcept { return st.value % 3 == 0; });  // noexcept: a throw would terminate
    const bool indexed = r.indexed();
    allocations_left = -1;
    if (!indexed) failed = true;  // the index could not be rebuilt: lookups scan
    CHECK(r.size() == static_cast<std::size_t>(count - count / 3));
    check_lookups(r, key_of(0));
    (void)r.add(key_of(0), key_of(0), 0);  // the next registration builds the index whole
    CHECK(r.indexed());
    check_lookups(r, key_of(count));
    if (indexed && fail_at > 0) break;  // enough allocations for the whole rebuild: every failure point was tried
  }
  CHECK(failed);
}

TEST_CASE("stream registry: add is all or nothing when an allocation fails, at every allocation it makes") {
  // Each size from 1 to 3 times the threshold, failing at each allocation add makes in turn (the state, the keys'
  // growth, the index: built whole when the threshold is passed, one entry after), until one succeeds.
  const int count = static_cast<int>(registry::linear_lookup) * 3;
  registry r;
  int failures = 0;
  for (int i = 0; i < count; ++i) {
    for (int fail_at = 0;; ++fail_at) {
      allocations_left = fail_at;
      bool threw = false;
      try {
        (void)r.add(key_of(i), key_of(i), i);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      allocations_left = -1;
      if (!threw) break;
      ++failures;
      REQUIRE(r.size() == static_cast<std::size_t>(i));  // unchanged
      check_lookups(r, key_of(i));                       // every earlier state still found, the new one not
    }
    REQUIRE(r.find(key_of(i)) != nullptr);
  }
  check_lookups(r, key_of(count));
  CHECK(r.indexed());
  CHECK(failures > count);  // every add failed at least once, and building the index failed at several points
}
