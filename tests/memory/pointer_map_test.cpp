// The allocator's pointer map (memory/detail/pointer_map.hpp): against std::unordered_map over random operations
// (collisions, backward-shift deletion, growth), and lookups without a lock while another thread inserts, erases
// and grows the shards: a key present throughout is always found, a key never inserted never is.
#include <doctest/doctest.h>

#include <gpukit/memory/detail/pointer_map.hpp>

#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct value {
  std::uintptr_t key = 0;
};
using map_type = gpukit::detail::sharded_pointer_map<value>;

}  // namespace

TEST_CASE("pointer map: random inserts, erases and lookups agree with std::unordered_map") {
  map_type map;
  std::unordered_map<std::uintptr_t, value*> model;
  std::vector<std::unique_ptr<value>> values;
  std::mt19937_64 rng(7);
  // Addresses as blocks have them: 512-byte aligned, in a few dense ranges, so probe runs collide.
  auto random_key = [&] { return (std::uintptr_t{1} << 40) + (rng() % 20000) * 512; };
  for (int i = 0; i < 200000; ++i) {
    const std::uintptr_t key = random_key();
    const auto it = model.find(key);
    switch (rng() % 3) {
      case 0:
        if (it == model.end()) {
          values.push_back(std::make_unique<value>(value{key}));
          map.insert(key, values.back().get());
          model.emplace(key, values.back().get());
        }
        break;
      case 1:
        CHECK(map.erase(key) == (it == model.end() ? nullptr : it->second));
        if (it != model.end()) model.erase(it);
        break;
      default:
        CHECK(map.find(key) == (it == model.end() ? nullptr : it->second));
    }
  }
  CHECK(map.size() == model.size());
  for (const auto& [key, v] : model) REQUIRE(map.find(key) == v);
  for (const auto& [key, v] : model) REQUIRE(map.erase(key) == v);
  CHECK(map.size() == 0);
  CHECK(map.find(1 << 20) == nullptr);
  CHECK(map.erase(1 << 20) == nullptr);
}

TEST_CASE("pointer map: lookups without a lock see every stable key while another thread changes the shards") {
  map_type map;
  constexpr std::size_t stable_count = 512;
  std::vector<value> stable(stable_count);
  for (std::size_t i = 0; i < stable_count; ++i) {
    stable[i].key = (std::uintptr_t{1} << 40) + i * 40 * 512;  // among the churned keys: their shifts move these
    map.insert(stable[i].key, &stable[i]);
  }
  std::atomic<bool> done{false};
  std::atomic<long> misses{0};
  std::atomic<long> phantoms{0};
  std::atomic<long> lookups{0};
  std::thread reader([&] {
    std::mt19937_64 rng(3);
    while (!done.load(std::memory_order_relaxed)) {
      ++lookups;
      const std::size_t i = rng() % stable_count;
      if (map.find(stable[i].key) != &stable[i]) ++misses;
      // Odd multiples of 512 above the churned range are never inserted.
      if (map.find((std::uintptr_t{1} << 41) + (2 * (rng() % 4096) + 1) * 512) != nullptr) ++phantoms;
    }
  });
  // The writer fills the shards (growing every one several times) and empties them, repeatedly.
  std::vector<value> churn(20000);
  for (int round = 0; round < 4 || lookups.load() < 100000; ++round) {
    for (std::size_t i = 0; i < churn.size(); ++i) {
      churn[i].key = (std::uintptr_t{1} << 40) + (i + i / 39 + 1) * 512;  // every multiple but the stable ones
      map.insert(churn[i].key, &churn[i]);
    }
    for (std::size_t i = 0; i < churn.size(); ++i) REQUIRE(map.erase(churn[i].key) == &churn[i]);
  }
  done = true;
  reader.join();
  CHECK(misses.load() == 0);
  CHECK(phantoms.load() == 0);
  CHECK(map.size() == stable_count);
}
