# Settings for gpukit's own tests, examples and benchmarks (never applied to consumers of the gpukit target).

# Strict warnings: the headers are included with -I (not as system headers) by gpukit's own targets, so any
# warning they cause fails the build. CUDA's headers come through CUDA::cudart as system headers.
# gpukit_strict_flags: the warnings and sanitizers alone; gpukit_development adds the real CUDA runtime, and
# gpukit_sim_development (tests/cudasim) the simulated one.
add_library(gpukit_strict_flags INTERFACE)
add_library(gpukit_development INTERFACE)
target_link_libraries(gpukit_development INTERFACE gpukit::gpukit gpukit_strict_flags)
target_compile_options(gpukit_strict_flags INTERFACE
  $<$<OR:$<CXX_COMPILER_ID:GNU>,$<CXX_COMPILER_ID:Clang>>:-Wall -Wextra -Wpedantic -Werror -Wshadow -Wconversion
  -Wno-sign-conversion -Wnon-virtual-dtor -Wold-style-cast -Woverloaded-virtual>)

# The toolkit's CCCL (for cuda::stream_ref interop tests). CMake's CUDA::cudart does not add include/cccl.
find_package(CCCL CONFIG QUIET HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake")

if(GPUKIT_SANITIZE)
  string(REPLACE ";" "," gpukit_sanitizers "${GPUKIT_SANITIZE}")
  target_compile_options(gpukit_strict_flags INTERFACE -fsanitize=${gpukit_sanitizers} -fno-omit-frame-pointer
    -fno-sanitize-recover=all)
  target_link_options(gpukit_strict_flags INTERFACE -fsanitize=${gpukit_sanitizers})
  target_compile_definitions(gpukit_strict_flags INTERFACE GPUKIT_TEST_SANITIZED)  # tests/support.hpp
endif()
