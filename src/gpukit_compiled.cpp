// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
//
// gpukit::compiled: gpukit.hpp's non-template functions and the engines behind gpukit's defaults, compiled once.
// Translation units that link the target get GPUKIT_SEPARATE_COMPILATION, under which the headers declare these
// functions and instantiations without their bodies (see include/gpukit/detail/config.hpp), so they call this code
// instead of compiling it themselves.
// gpukit_compiled_ptds.cpp compiles the same list for CUDA's per-thread default stream mode, whose translation units
// use their own inline namespace (gpukit::abi_v1_ptds).

// This file is the legacy default-stream half of the library, and the only one that defines the state both modes
// share (gpukit::mode_independent). A parent project that defines CUDA_API_PER_THREAD_DEFAULT_STREAM for every target
// (add_compile_definitions, or nvcc's --default-stream per-thread passed to the host compiler) would otherwise compile
// it in the per-thread mode too: two per-thread halves, no legacy one, and the shared state defined nowhere (a link
// failure in every program). gpukit_compiled_ptds.cpp, which includes this file, marks itself.
#if !defined(GPUKIT_DETAIL_COMPILING_PER_THREAD_HALF)
#undef CUDA_API_PER_THREAD_DEFAULT_STREAM
#endif

#ifndef GPUKIT_SEPARATE_COMPILATION
#define GPUKIT_SEPARATE_COMPILATION 1  // an explicit instantiation may follow its extern declaration
#endif
// This file defines the non-template functions whose bodies the compiled mode leaves out of the headers (each
// once, not inline; see include/gpukit/detail/config.hpp): the headers of gpukit.hpp.
#define GPUKIT_DETAIL_BUILDING_COMPILED 1
#include <gpukit/gpukit.hpp>

// The CUDA headers choose the mode when they are first included; one included before this file (a forced include)
// would have chosen it already.
#if defined(GPUKIT_DETAIL_COMPILING_PER_THREAD_HALF) != (GPUKIT_DETAIL_PER_THREAD_DEFAULT_STREAM != 0)
#error \
    "gpukit::compiled: the CUDA headers were included in the wrong default-stream mode before this file (gpukit_compiled.cpp must be compiled in the legacy mode, gpukit_compiled_ptds.cpp in the per-thread mode); do not force-include cuda_runtime_api.h into gpukit's sources"
#endif

// The default device allocators' engine and its device_allocator wrapper (default_allocator(d)); the constructors
// are member templates, which the class instantiations leave out.
template class gpukit::basic_caching_allocator<gpukit::device_upstream, gpukit::stream_ops>;
template class gpukit::caching_device_allocator<gpukit::device_upstream>;
template gpukit::basic_caching_allocator<gpukit::device_upstream, gpukit::stream_ops>::basic_caching_allocator(
    gpukit::device, gpukit::allocator_options);
template gpukit::caching_device_allocator<gpukit::device_upstream>::caching_device_allocator(gpukit::device,
                                                                                             gpukit::allocator_options);
// default_pinned_pool(d) and default_staging_engine(d).
template class gpukit::basic_pinned_pool<gpukit::pinned_upstream, gpukit::pinned_pool_sync>;
template class gpukit::basic_staging_engine<gpukit::device_copier>;
