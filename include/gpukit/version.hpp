// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Library version. CMakeLists.txt reads these three macros to set project(VERSION), so this file is the single
/// source of truth; tests/version_test.cpp checks the two agree.

/// Major version (Semantic Versioning): raised for API breaks once it is above 0.
#define GPUKIT_VERSION_MAJOR 0
/// Minor version: raised for new features; while the major version is 0, also for API breaks.
#define GPUKIT_VERSION_MINOR 1
/// Patch version: raised for fixes that leave the API unchanged.
#define GPUKIT_VERSION_PATCH 0

#define GPUKIT_DETAIL_STRINGIFY2(x) #x
#define GPUKIT_DETAIL_STRINGIFY(x) GPUKIT_DETAIL_STRINGIFY2(x)

/// "MAJOR.MINOR.PATCH"
#define GPUKIT_VERSION_STRING                   \
  GPUKIT_DETAIL_STRINGIFY(GPUKIT_VERSION_MAJOR) \
  "." GPUKIT_DETAIL_STRINGIFY(GPUKIT_VERSION_MINOR) "." GPUKIT_DETAIL_STRINGIFY(GPUKIT_VERSION_PATCH)

/// MAJOR * 10000 + MINOR * 100 + PATCH, for preprocessor comparisons.
#define GPUKIT_VERSION (GPUKIT_VERSION_MAJOR * 10000 + GPUKIT_VERSION_MINOR * 100 + GPUKIT_VERSION_PATCH)
