// Process-wide state across shared libraries: two libraries built with -fvisibility=hidden and
// -fvisibility-inlines-hidden (singleton_library.cpp) and this executable see one default allocator, one warning
// handler, one pinned pool, ... because the functions that own them are exported (GPUKIT_EXPORT). Without the
// export each library has its own copies and every check below fails.
#include "singletons.hpp"

#include <gpukit/error.hpp>
#include <gpukit/warning.hpp>

#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

extern "C" gpukit_visibility::singleton_addresses gpukit_visibility_a_singletons();
extern "C" gpukit_visibility::singleton_addresses gpukit_visibility_b_singletons();
extern "C" void gpukit_visibility_a_warn(const char* message);
extern "C" void gpukit_visibility_b_warn(const char* message);

TEST_CASE("shared libraries built with hidden visibility share gpukit's process-wide objects with the executable") {
  // Libraries first: the objects are created inside one of them, and the executable must still find the same ones.
  const auto a = gpukit_visibility_a_singletons();
  const auto b = gpukit_visibility_b_singletons();
  const auto exe = gpukit_visibility::collect_singleton_addresses();
  for (std::size_t i = 0; i < gpukit_visibility::singleton_count; ++i) {
    INFO("gpukit::" << std::string(gpukit_visibility::singleton_names[i]));
    CHECK(exe.at[i] != nullptr);
    CHECK(a.at[i] == exe.at[i]);
    CHECK(b.at[i] == exe.at[i]);
  }
}

TEST_CASE("a warning handler set by the executable receives the warnings of both libraries") {
  std::vector<std::string> received;
  auto previous = gpukit::set_warning_handler([&](std::string_view m) { received.emplace_back(m); });
  gpukit_visibility_a_warn("from a");
  gpukit_visibility_b_warn("from b");
  gpukit::set_warning_handler(std::move(previous));
  REQUIRE(received.size() == 2);
  CHECK(received[0] == "from a");
  CHECK(received[1] == "from b");
}
