# The optional compiled mode (gpukit::compiled, GPUKIT_SEPARATE_COMPILATION), included by tests/CMakeLists.txt.
#
# gpukit::compiled links the real CUDA runtime; the tests build the same sources into a library of their own with
# the build's warnings and sanitizers and no runtime, so one library serves the CPU tests (real runtime) and the
# simulator's.
if(NOT TARGET gpukit_compiled)
  return()
endif()
get_target_property(gpukit_compiled_sources gpukit_compiled SOURCES)
list(TRANSFORM gpukit_compiled_sources PREPEND "${PROJECT_SOURCE_DIR}/")
add_library(gpukit_test_compiled STATIC ${gpukit_compiled_sources})
target_compile_definitions(gpukit_test_compiled PUBLIC GPUKIT_SEPARATE_COMPILATION)
target_link_libraries(gpukit_test_compiled PUBLIC gpukit::headers gpukit_strict_flags)
set_target_properties(gpukit_test_compiled PROPERTIES POSITION_INDEPENDENT_CODE ON)  # the tests' shared libraries
# Built as a parent project that defines CUDA's per-thread default stream for every target would build it: the
# library must still hold a legacy half and the state both modes share, or no test that links it links.
target_compile_definitions(gpukit_test_compiled PRIVATE CUDA_API_PER_THREAD_DEFAULT_STREAM)
get_target_property(gpukit_compiled_options gpukit_compiled COMPILE_OPTIONS)
if(gpukit_compiled_options)
  target_compile_options(gpukit_test_compiled PRIVATE ${gpukit_compiled_options})  # -fno-semantic-interposition
endif()

if(GPUKIT_TESTS_USE_COMPILED)
  # Every test, example and tool calls the library's engines (tests/run_all.sh builds its sanitizer and Release
  # configurations so, which halves the compile time of an engine-heavy test); the header-only probe below still
  # compiles header-only.
  target_link_libraries(gpukit_development INTERFACE gpukit_test_compiled)
  target_link_libraries(gpukit_sim_development INTERFACE gpukit_test_compiled)
else()
  # Existing suites, run again with every engine coming from the library: the same behaviour in both modes.
  gpukit_add_test(test_compiled_mode SOURCES memory/device_buffer_test.cpp transfer/copy_test.cpp
                  transfer/staging_test.cpp transfer/pinned_pool_test.cpp)
  target_link_libraries(test_compiled_mode PRIVATE gpukit_test_compiled)
  gpukit_add_sim_test(test_compiled_mode_sim SOURCES "${PROJECT_SOURCE_DIR}/tests/memory/gpu_allocator_test.cpp"
                      "${PROJECT_SOURCE_DIR}/tests/transfer/gpu_transfer_test.cpp")
  target_link_libraries(test_compiled_mode_sim PRIVATE gpukit_test_compiled)
endif()

# Both default-stream modes in one program, each calling its own instantiations in the library.
gpukit_add_test(test_compiled_odr_mode SOURCES visibility/odr_mode_test.cpp visibility/odr_mode_per_thread_tu.cpp)
target_link_libraries(test_compiled_odr_mode PRIVATE gpukit_test_compiled)

# The point of the mode: a translation unit that uses device_buffer and copy_async defines none of the engines'
# functions (it calls the library's), where the header-only build of the same file defines them.
add_library(gpukit_compiled_probe OBJECT "${CMAKE_CURRENT_LIST_DIR}/compiled_probe.cpp")
target_link_libraries(gpukit_compiled_probe PRIVATE gpukit_test_compiled)
add_library(gpukit_header_only_probe OBJECT "${CMAKE_CURRENT_LIST_DIR}/compiled_probe.cpp")
target_link_libraries(gpukit_header_only_probe PRIVATE gpukit::headers gpukit_strict_flags)
add_test(NAME test_compiled_probe
  COMMAND "${CMAKE_COMMAND}" -DNM=${CMAKE_NM} "-DCOMPILED=$<TARGET_OBJECTS:gpukit_compiled_probe>"
          "-DHEADER_ONLY=$<TARGET_OBJECTS:gpukit_header_only_probe>"
          -P "${CMAKE_CURRENT_LIST_DIR}/check_probe.cmake")
set_tests_properties(test_compiled_probe PROPERTIES LABELS cpu)

# An engine of one's own in the compiled mode: the translation unit includes the engine's *_impl.hpp and compiles
# that instantiation, while the default engine's stay extern (the library's).
add_library(gpukit_custom_engine_probe OBJECT "${CMAKE_CURRENT_LIST_DIR}/custom_engine_probe.cpp")
target_link_libraries(gpukit_custom_engine_probe PRIVATE gpukit_test_compiled)
add_test(NAME test_custom_engine_probe
  COMMAND "${CMAKE_COMMAND}" -DNM=${CMAKE_NM} "-DOBJECT=$<TARGET_OBJECTS:gpukit_custom_engine_probe>" -DOWN=ON
          -P "${CMAKE_CURRENT_LIST_DIR}/check_custom_probe.cmake")
set_tests_properties(test_custom_engine_probe PROPERTIES LABELS cpu)
# A caching_allocator built directly, without the *_impl.hpp: the engine (its constructor too) stays the library's.
add_library(gpukit_direct_allocator_probe OBJECT "${CMAKE_CURRENT_LIST_DIR}/direct_allocator_probe.cpp")
target_link_libraries(gpukit_direct_allocator_probe PRIVATE gpukit_test_compiled)
add_test(NAME test_direct_allocator_probe
  COMMAND "${CMAKE_COMMAND}" -DNM=${CMAKE_NM} "-DOBJECT=$<TARGET_OBJECTS:gpukit_direct_allocator_probe>"
          -P "${CMAKE_CURRENT_LIST_DIR}/check_custom_probe.cmake")
set_tests_properties(test_direct_allocator_probe PROPERTIES LABELS cpu)

# gpukit_compiled.cpp refuses (#error) CUDA headers included before it in the per-thread mode: the mode is chosen
# there, and the library would have no legacy half.
list(GET CUDAToolkit_INCLUDE_DIRS 0 gpukit_compiled_cuda_include)
add_test(NAME test_compiled_forced_include
  COMMAND "${CMAKE_COMMAND}" "-DCXX=${CMAKE_CXX_COMPILER}" "-DSOURCE_DIR=${PROJECT_SOURCE_DIR}"
          "-DCUDA_INCLUDE=${gpukit_compiled_cuda_include}" -P "${CMAKE_CURRENT_LIST_DIR}/check_forced_include.cmake")
set_tests_properties(test_compiled_forced_include PROPERTIES LABELS cpu)
