// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Configuration every gpukit header includes first.
///
/// GPUKIT_EXPORT marks the inline functions that own process-wide state (the warning handler, the default
/// allocators, pools and engines, caches). A function-local static of a header-only library is one object per
/// shared library when libraries are built with -fvisibility=hidden (and -fvisibility-inlines-hidden): each .so
/// would get its own "process-wide" default allocator. Exported, the dynamic linker binds every library to one copy.
/// The attribute overrides both options, on free and member functions alike.
///
/// GPUKIT_BEGIN_NAMESPACE / GPUKIT_END_NAMESPACE open and close `namespace gpukit` with an inline namespace chosen
/// by the translation unit's default-stream mode. CUDA's per-thread default stream (nvcc --default-stream
/// per-thread, which defines CUDA_API_PER_THREAD_DEFAULT_STREAM, or that macro defined before cuda_runtime_api.h)
/// maps the stream API to `_ptds`/`_ptsz` symbols per translation unit, so an inline gpukit function compiled in
/// both modes would be two different functions with one name (an ODR violation: the linker keeps one of them).
/// With a namespace per mode (gpukit::abi_v1 or gpukit::abi_v1_ptds) each mode has its own symbols, and so its own
/// copy of gpukit, including its own process-wide singletons (default allocators, pools). Code names `gpukit::x`
/// either way; forward-declaring gpukit types in `namespace gpukit { ... }` is not supported.
///
/// The mode is the one cuda_runtime_api.h chose for this translation unit (its __CUDART_API_PER_THREAD_DEFAULT_STREAM),
/// so it is right whichever of gpukit and CUDA is included first.

#include <cuda_runtime_api.h>

#include <cstddef>

// CUDA 13's runtime API: cudaStreamGetCaptureInfo with edge data, cudaGetDriverEntryPointByVersion (12.5), the
// device attributes that replaced the fields CUDA 13 removed from cudaDeviceProp.
#if !defined(CUDART_VERSION) || CUDART_VERSION < 13000
#error "gpukit needs the CUDA 13.0 toolkit or newer (cuda_runtime_api.h with CUDART_VERSION >= 13000)"
#endif

// C++17, in .cu files too: gpukit::gpukit requires cxx_std_17, which CMake applies to C++ sources only (a CUDA target
// takes CMAKE_CUDA_STANDARD / CUDA_STANDARD, or nvcc's default).
#if __cplusplus < 201703L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 201703L)
#error "gpukit needs C++17 or newer (for a .cu file: nvcc -std=c++17, or CMake's CUDA_STANDARD 17)"
#endif

// GPUKIT_SEPARATE_COMPILATION (defined by linking gpukit::compiled) leaves the member functions of the engines out
// (the caching allocator, the pinned pool, the staging engine: each defines them in its *_impl.hpp, which its header
// includes only header-only), so a translation unit calls the instantiations gpukit::compiled holds. One that
// includes an *_impl.hpp itself, to instantiate an engine of its own, sees those instantiations declared extern
// there. Header-only (without the macro) stays the default and needs nothing linked but the CUDA Runtime.
#if defined(GPUKIT_SEPARATE_COMPILATION)
#define GPUKIT_DETAIL_EXTERN_TEMPLATES 1
#else
#define GPUKIT_DETAIL_EXTERN_TEMPLATES 0
#endif

// The compiled mode also leaves out the bodies of gpukit's non-template functions: the headers then hold their
// declarations only, and gpukit::compiled (whose sources define GPUKIT_DETAIL_BUILDING_COMPILED) defines each function
// once, as {fmt} does without FMT_HEADER_ONLY. Parsing those bodies, and instantiating the standard containers they
// use, is most of what including gpukit costs. A header that defines such functions out of class keeps them in one
// block, at its end, under `#if GPUKIT_DETAIL_DEFINITIONS`, each marked GPUKIT_INLINE: `inline` header-only, nothing
// in the compiled library. Constexpr functions, member templates and the caching engine's hot-path helpers
// (spin_mutex, size classes, page maps) stay in the headers in every mode.
#if !defined(GPUKIT_SEPARATE_COMPILATION) || defined(GPUKIT_DETAIL_BUILDING_COMPILED)
#define GPUKIT_DETAIL_DEFINITIONS 1
#else
#define GPUKIT_DETAIL_DEFINITIONS 0
#endif
#if defined(GPUKIT_SEPARATE_COMPILATION)
#define GPUKIT_INLINE
#else
#define GPUKIT_INLINE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define GPUKIT_EXPORT __attribute__((visibility("default")))
#else
#define GPUKIT_EXPORT
#endif

// Inlines everything a hot function calls (the allocator's front cache), where the compiler supports it; its slow
// paths are marked NOINLINE, so that flattening stops there (else the whole block heap is inlined into it).
#if defined(__GNUC__) || defined(__clang__)
#define GPUKIT_DETAIL_FLATTEN __attribute__((flatten))
#define GPUKIT_DETAIL_NOINLINE __attribute__((noinline))
#else
#define GPUKIT_DETAIL_FLATTEN
#define GPUKIT_DETAIL_NOINLINE
#endif

// For the few one-line helpers the allocator's heap path calls many times per pair (statistics, the spin lock),
// defined in class. In a large translation unit GCC stops inlining once the unit has grown past its budget
// (--param inline-unit-growth), one-line functions included: in bench_allocator's, which includes CUB, the heap's
// 8 MiB pair went from 126 ns to 94 ns (medians of five runs) once these were inlined.
#if defined(__GNUC__) || defined(__clang__)
#define GPUKIT_DETAIL_ALWAYS_INLINE __attribute__((always_inline))
#elif defined(_MSC_VER)
#define GPUKIT_DETAIL_ALWAYS_INLINE __forceinline
#else
#define GPUKIT_DETAIL_ALWAYS_INLINE
#endif

// The version in the name changes whenever a layout or virtual table of gpukit's types changes, so that code built
// against an older gpukit fails to link with newer code instead of misbehaving (v1: device_allocator's virtual
// functions became the private do_* ones).
#if defined(__CUDART_API_PER_THREAD_DEFAULT_STREAM)
#define GPUKIT_DETAIL_PER_THREAD_DEFAULT_STREAM 1
#define GPUKIT_ABI_NAMESPACE abi_v1_ptds
#else
#define GPUKIT_DETAIL_PER_THREAD_DEFAULT_STREAM 0
#define GPUKIT_ABI_NAMESPACE abi_v1
#endif

// The state shared by both default-stream modes (namespace gpukit::mode_independent, below) is defined once in the
// compiled mode: by gpukit_compiled.cpp, not again by its per-thread default stream twin.
#if !defined(GPUKIT_SEPARATE_COMPILATION) || \
    (defined(GPUKIT_DETAIL_BUILDING_COMPILED) && !GPUKIT_DETAIL_PER_THREAD_DEFAULT_STREAM)
#define GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS 1
#else
#define GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS 0
#endif

#define GPUKIT_BEGIN_NAMESPACE \
  namespace gpukit {           \
  inline namespace GPUKIT_ABI_NAMESPACE {
#define GPUKIT_END_NAMESPACE \
  }                          \
  }

GPUKIT_BEGIN_NAMESPACE
namespace detail {

/// Whether this translation unit uses CUDA's per-thread default stream (see the file comment). Each mode has its
/// own copy of this function, as of every gpukit function.
constexpr bool per_thread_default_stream_mode() noexcept { return GPUKIT_DETAIL_PER_THREAD_DEFAULT_STREAM != 0; }

/// How far apart data written by different threads on a hot path is kept (alignas): 128 bytes, two cache lines. On
/// Intel processors since Sandy Bridge the L2 spatial prefetcher fetches lines in 128-byte aligned pairs, so two cores
/// writing the two lines of one pair can take it from each other (Intel's optimization manual; folly and crossbeam
/// pad to 128 bytes on x86-64 for this reason). bench_allocator's BM_line_pair_writes measures it on its machine.
constexpr std::size_t false_sharing_range = 128;

/// `T`, named so that the name depends on `Dependent` (a template's parameter, or a value computed from one): a
/// template that uses an engine through it instantiates the engine's class when it is instantiated itself, not where
/// it is defined, so a translation unit that never uses the template does not pay for the engine.
template <auto Dependent, class T>
struct dependent_type {
  using type = T;  ///< `T`
};
/// `T`, as a name that depends on `Dependent` (dependent_type).
template <auto Dependent, class T>
using dependent_t = typename dependent_type<Dependent, T>::type;

}  // namespace detail
GPUKIT_END_NAMESPACE
