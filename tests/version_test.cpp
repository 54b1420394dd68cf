// The version header and CMake's project(VERSION) agree (CMake reads the header; this proves the reading).
#include <gpukit/version.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("version macros agree with CMake and with each other") {
  CHECK(std::string(GPUKIT_VERSION_STRING) == GPUKIT_CMAKE_PROJECT_VERSION);
  CHECK(GPUKIT_VERSION == GPUKIT_VERSION_MAJOR * 10000 + GPUKIT_VERSION_MINOR * 100 + GPUKIT_VERSION_PATCH);
  CHECK(std::string(GPUKIT_VERSION_STRING) == std::to_string(GPUKIT_VERSION_MAJOR) + "." +
                                                  std::to_string(GPUKIT_VERSION_MINOR) + "." +
                                                  std::to_string(GPUKIT_VERSION_PATCH));
}
