// Process-wide state across shared libraries: two libraries built with -fvisibility=hidden and
// -fvisibility-inlines-hidden (singleton_library.cpp) and this executable see one default allocator, one warning
// handler, one pinned pool, ... because the functions that own them are exported (GPUKIT_EXPORT). Without the
// export each library has its own copies and every check below fails.
#include "singletons.hpp"
#include "support.hpp"

#include <gpukit/error.hpp>
#include <gpukit/warning.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

extern "C" gpukit_visibility::singleton_addresses gpukit_visibility_a_singletons();
extern "C" gpukit_visibility::singleton_addresses gpukit_visibility_b_singletons();
extern "C" void gpukit_visibility_a_warn(const char* message);
extern "C" void gpukit_visibility_b_warn(const char* message);
extern "C" gpukit::caching_allocator* gpukit_visibility_a_make_allocator();
extern "C" void gpukit_visibility_a_destroy_allocator(gpukit::caching_allocator* a);
extern "C" bool gpukit_visibility_a_out_of_memory(gpukit::caching_allocator* a);
extern "C" void gpukit_visibility_b_add_self_removing_observer(gpukit::caching_allocator* a, std::atomic<int>* calls,
                                                               std::atomic<int>* removed);

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

TEST_CASE("an out-of-memory observer of one library removes itself while another library's copy calls it") {
  // Which observers the thread is inside is one record for the process: library b's removal, from inside the call
  // that library a's copy makes, knows it is inside it. With a record per library it waited for its own call to end
  // (a deadlock). The counters live as long as the process, as the allocator does if the call never returns.
  gpukit::caching_allocator* a = gpukit_visibility_a_make_allocator();
  static std::atomic<int> calls{0};
  static std::atomic<int> removed{0};
  gpukit_visibility_b_add_self_removing_observer(a, &calls, &removed);
  auto* bounded = new gpukit_test::bounded_calls();
  auto refused = std::make_shared<std::atomic<bool>>(false);
  const bool returned = bounded->returned_within([a, refused] { *refused = gpukit_visibility_a_out_of_memory(a); });
  REQUIRE(returned);  // else the call, and the allocator it uses, are left to the process's exit (not joinable)
  delete bounded;
  CHECK(refused->load());
  CHECK(calls.load() == 1);
  CHECK(removed.load() == 1);
  CHECK(gpukit_visibility_a_out_of_memory(a));  // removed: not called again
  CHECK(calls.load() == 1);
  gpukit_visibility_a_destroy_allocator(a);
}
