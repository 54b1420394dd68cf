# The simulated CUDA runtime (see README.md here) and the targets that run gpukit's GPU tests on it.
#
# libgpukit_cudasim exports the CUDA Runtime functions gpukit calls. gpukit_sim_development is gpukit's headers with
# that library instead of libcudart, plus the project's warnings and sanitizers; gpukit_add_test(... GPU) builds each
# GPU test twice: against the real runtime (label gpu, Skipped without a GPU) and against the simulator (label
# cudasim, runs everywhere).
add_library(gpukit_cudasim SHARED "${CMAKE_CURRENT_LIST_DIR}/cudasim.cpp")
target_link_libraries(gpukit_cudasim PRIVATE CUDA::toolkit Threads::Threads gpukit_strict_flags)
target_compile_features(gpukit_cudasim PRIVATE cxx_std_17)  # clang++ 14 defaults to C++14
target_include_directories(gpukit_cudasim PUBLIC "${CMAKE_CURRENT_LIST_DIR}")
set_target_properties(gpukit_cudasim PROPERTIES CXX_VISIBILITY_PRESET hidden)

add_library(gpukit_sim_development INTERFACE)
target_link_libraries(gpukit_sim_development INTERFACE gpukit::headers gpukit_strict_flags gpukit_cudasim)

# The doctest main of simulator tests: a test that leaves a recorded CUDA rule violation fails.
add_library(gpukit_sim_main OBJECT "${CMAKE_CURRENT_LIST_DIR}/sim_main.cpp")
target_link_libraries(gpukit_sim_main PUBLIC doctest::doctest gpukit_sim_development)

# gpukit_add_sim_test(<name> SOURCES <files...>): one doctest executable on the simulator, label cudasim.
function(gpukit_add_sim_test name)
  cmake_parse_arguments(arg "" "" "SOURCES;LABELS" ${ARGN})
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE gpukit_sim_main doctest::doctest gpukit_sim_development)
  target_include_directories(${name} PRIVATE "${PROJECT_SOURCE_DIR}/tests")
  set_property(GLOBAL APPEND PROPERTY GPUKIT_TEST_EXECUTABLES "$<TARGET_FILE:${name}>")
  set_property(GLOBAL APPEND PROPERTY GPUKIT_GPU_CHECK_SIM_TARGETS ${name})
  doctest_discover_tests(${name}
    TEST_PREFIX "${name}."
    PROPERTIES SKIP_REGULAR_EXPRESSION "GPUKIT_TEST_(SKIPPED|NOT_APPLICABLE)" LABELS "cudasim;${arg_LABELS}" TIMEOUT 300)
endfunction()

# Simulator-only tests of gpukit's CUDA layer (they use the control interface in cudasim.hpp: contexts, violations,
# fault injection), one file per topic: tests/cudasim/<topic>_test.cpp -> test_sim_<topic>.
function(gpukit_add_sim_topic_tests)
  foreach(topic contexts streams capture staging errors vmm prefetcher peer heap_faults upstreams)
    if(EXISTS "${PROJECT_SOURCE_DIR}/tests/cudasim/${topic}_test.cpp")
      gpukit_add_sim_test(test_sim_${topic} SOURCES "${PROJECT_SOURCE_DIR}/tests/cudasim/${topic}_test.cpp")
    endif()
  endforeach()
endfunction()
gpukit_add_sim_topic_tests()

# Capture in CUDA's per-thread default stream mode (a translation unit of that mode, on the simulator).
gpukit_add_sim_test(test_sim_per_thread_capture SOURCES "${PROJECT_SOURCE_DIR}/tests/cudasim/per_thread_capture_test.cpp")
target_compile_definitions(test_sim_per_thread_capture PRIVATE CUDA_API_PER_THREAD_DEFAULT_STREAM)

# Both default-stream modes in one process: what they share (released streams' records), on the simulator.
gpukit_add_sim_test(test_sim_mixed_modes SOURCES "${PROJECT_SOURCE_DIR}/tests/cudasim/mixed_modes_test.cpp"
                    "${PROJECT_SOURCE_DIR}/tests/cudasim/mixed_modes_per_thread.cpp")
set_source_files_properties("${PROJECT_SOURCE_DIR}/tests/cudasim/mixed_modes_per_thread.cpp"
                            PROPERTIES COMPILE_DEFINITIONS CUDA_API_PER_THREAD_DEFAULT_STREAM)
