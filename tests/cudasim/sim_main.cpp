// The doctest main of tests that run on the simulated CUDA runtime. Each ctest test runs one test case in its own
// process; when the case has passed but left a CUDA rule violation recorded (a call from a host function, a
// destroyed handle used, a context on a device the test did not name, an illegal call during capture, ...), the
// violations are printed and the process fails. Tests that break a rule on purpose take the violations they expect
// with cudasim::take_violations().
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cudasim.hpp"

#include <cstdio>

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (context.shouldExit()) return result;
  const auto left = cudasim::violations();
  if (left.empty()) return result;
  std::fprintf(stderr, "cudasim: %zu CUDA rule violation(s) left by the test:\n", left.size());
  for (const auto& v : left) {
    std::fprintf(stderr, "  %s -> %s: %s\n", v.call.c_str(), cudaGetErrorName(v.error), v.message.c_str());
  }
  return result != 0 ? result : 1;
}
