// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
//
// The instantiations of gpukit_compiled.cpp for translation units in CUDA's per-thread default stream mode (nvcc
// --default-stream per-thread), which name gpukit::abi_v1_ptds (see include/gpukit/detail/config.hpp).
#define GPUKIT_DETAIL_COMPILING_PER_THREAD_HALF 1
#ifndef CUDA_API_PER_THREAD_DEFAULT_STREAM  // a parent project may define it for every target
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1
#endif
#include "gpukit_compiled.cpp"
