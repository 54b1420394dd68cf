// The test-only control of the fake libnvidia-ml (tests/fake_nvml.cpp), for the tests that load it.
#pragma once

#include <doctest/doctest.h>

#include <dlfcn.h>

namespace gpukit_test {

/// Sets `field` of the fake NVML's GPU `gpu` (fake_nvml_set) in the library at `path`, as loaded by the test.
inline void set_fake_nvml(const char* path, unsigned gpu, const char* field, long long value) {
  void* fake = dlopen(path, RTLD_NOW);  // the same handle as the NVML loader's; this reference stays for the process
  auto* set = reinterpret_cast<void (*)(unsigned, const char*, long long)>(dlsym(fake, "fake_nvml_set"));
  const bool found = set != nullptr;
  REQUIRE(found);
  set(gpu, field, value);
}

}  // namespace gpukit_test
