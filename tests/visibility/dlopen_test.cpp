// Process-wide state across plugins: two copies of singleton_library.cpp (hidden visibility), opened with
// dlopen(RTLD_LOCAL) by this executable, which uses gpukit and exports its symbols (-rdynamic): the plugins' copies
// bind to the executable's, with g++ and clang++ alike (README, "Compiled mode", says which builds do not share).
#include "singletons.hpp"

#include <doctest/doctest.h>

#include <dlfcn.h>

#include <string>

namespace {
using collect_function = gpukit_visibility::singleton_addresses (*)();

gpukit_visibility::singleton_addresses plugin_singletons(const char* path, const char* entry) {
  void* plugin = dlopen(path, RTLD_NOW | RTLD_LOCAL);  // never closed: its objects may be the process's (README)
  REQUIRE_MESSAGE(plugin != nullptr, dlerror());
  void* collect = dlsym(plugin, entry);
  REQUIRE_MESSAGE(collect != nullptr, dlerror());
  return reinterpret_cast<collect_function>(collect)();
}
}  // namespace

TEST_CASE("plugins opened with RTLD_LOCAL share gpukit's process-wide objects with an executable that exports them") {
  const auto exe = gpukit_visibility::collect_singleton_addresses();  // made here first
  const auto a = plugin_singletons(GPUKIT_PLUGIN_A, "gpukit_visibility_plugin_a_singletons");
  const auto b = plugin_singletons(GPUKIT_PLUGIN_B, "gpukit_visibility_plugin_b_singletons");
  for (std::size_t i = 0; i < gpukit_visibility::singleton_count; ++i) {
    INFO("gpukit::" << std::string(gpukit_visibility::singleton_names[i]));
    CHECK(exe.at[i] != nullptr);
    CHECK(a.at[i] == exe.at[i]);
    CHECK(b.at[i] == exe.at[i]);
  }
}
