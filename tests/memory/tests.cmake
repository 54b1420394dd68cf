# Tests of the caching device allocator (include/gpukit/memory), included by tests/CMakeLists.txt.
set(gpukit_memory_tests "${CMAKE_CURRENT_LIST_DIR}")
gpukit_add_test(test_allocator_random SOURCES "${gpukit_memory_tests}/allocator_random_test.cpp")
gpukit_add_test(test_allocator_edge SOURCES "${gpukit_memory_tests}/allocator_edge_test.cpp")
gpukit_add_test(test_allocator_steady_state SOURCES "${gpukit_memory_tests}/allocator_steady_state_test.cpp")
gpukit_add_test(test_allocator_front_cache SOURCES "${gpukit_memory_tests}/allocator_front_cache_test.cpp")
gpukit_add_test(test_pointer_map SOURCES "${gpukit_memory_tests}/pointer_map_test.cpp")
gpukit_add_test(test_stream_registry SOURCES "${gpukit_memory_tests}/stream_registry_test.cpp")
gpukit_add_test(test_page_map SOURCES "${gpukit_memory_tests}/page_map_test.cpp")
gpukit_add_test(test_allocator_expandable SOURCES "${gpukit_memory_tests}/allocator_expandable_test.cpp")
gpukit_add_test(test_allocator_config SOURCES "${gpukit_memory_tests}/allocator_config_test.cpp")
gpukit_add_test(test_segment_sizing SOURCES "${gpukit_memory_tests}/segment_sizing_test.cpp")
gpukit_add_test(test_event_pool SOURCES "${gpukit_memory_tests}/event_pool_test.cpp")
gpukit_add_test(test_allocator_oom SOURCES "${gpukit_memory_tests}/allocator_oom_test.cpp")
gpukit_add_test(test_allocator_streams SOURCES "${gpukit_memory_tests}/allocator_streams_test.cpp")
gpukit_add_test(test_allocator_concurrency SOURCES "${gpukit_memory_tests}/allocator_concurrency_test.cpp")
gpukit_add_test(test_device_buffer SOURCES "${gpukit_memory_tests}/device_buffer_test.cpp")
gpukit_add_test(test_gpu_allocator SOURCES "${gpukit_memory_tests}/gpu_allocator_test.cpp" GPU)
gpukit_add_test(test_gpu_async_allocator SOURCES "${gpukit_memory_tests}/gpu_async_allocator_test.cpp" GPU)
# The model of PyTorch's allocator that bench_fragmentation uses as a baseline (bench/pytorch_allocator_model.hpp).
gpukit_add_test(test_pytorch_allocator_model SOURCES "${gpukit_memory_tests}/pytorch_model_test.cpp")
target_include_directories(test_pytorch_allocator_model PRIVATE "${gpukit_memory_tests}/../../bench")
# The memory history and its exports; the PyTorch pickle is loaded by Python's own pickle module.
gpukit_add_test(test_memory_history SOURCES "${gpukit_memory_tests}/memory_history_test.cpp")
target_compile_definitions(test_memory_history PRIVATE
  GPUKIT_TEST_PICKLE_CHECK="${gpukit_memory_tests}/check_pytorch_snapshot.py"
  GPUKIT_TEST_PICTURE_CHECK="${gpukit_memory_tests}/check_memory_picture.py")
# Aligned allocation and the std::pmr adaptors.
gpukit_add_test(test_aligned_allocation SOURCES "${gpukit_memory_tests}/aligned_allocation_test.cpp")
# A resource of one's own (device_resource) behind buffers and the std::pmr adaptor.
gpukit_add_test(test_device_resource SOURCES "${gpukit_memory_tests}/device_resource_test.cpp")
# cuda::mr conformance against the toolkit's CCCL (3.0), and against a newer CCCL (>= 3.1: the other shape of the
# concepts) where .ci/install-deps put one (GPUKIT_CCCL_NEXT_INCLUDE_DIR).
if(TARGET CCCL::CCCL)
  gpukit_add_test(test_memory_resource SOURCES "${gpukit_memory_tests}/memory_resource_test.cpp" GPU)
  target_link_libraries(test_memory_resource PRIVATE CCCL::CCCL)
  target_link_libraries(test_memory_resource_sim PRIVATE CCCL::CCCL)
endif()
if(NOT DEFINED GPUKIT_CCCL_NEXT_INCLUDE_DIR)
  foreach(candidate "/opt/gpukit-tools/cccl-next/include" "$ENV{HOME}/.local/share/gpukit-tools/cccl-next/include")
    if(EXISTS "${candidate}/cuda/std/version")
      set(GPUKIT_CCCL_NEXT_INCLUDE_DIR "${candidate}")
      break()
    endif()
  endforeach()
endif()
if(GPUKIT_CCCL_NEXT_INCLUDE_DIR)
  gpukit_add_test(test_memory_resource_cccl_next SOURCES "${gpukit_memory_tests}/memory_resource_test.cpp" GPU)
  foreach(target test_memory_resource_cccl_next test_memory_resource_cccl_next_sim)
    # Before the toolkit's include directory, so this CCCL wins.
    target_include_directories(${target} BEFORE PRIVATE "${GPUKIT_CCCL_NEXT_INCLUDE_DIR}")
  endforeach()
else()
  message(STATUS "gpukit: no CCCL >= 3.1 headers (GPUKIT_CCCL_NEXT_INCLUDE_DIR); its cuda::mr conformance test is not built")
endif()
# thrust_allocator: under Thrust's CPP system with the C++ compiler (CPU device and simulator), and under its CUDA
# system with nvcc where the CUDA language is available (as the examples with kernels: g++ host compiler, no
# sanitizer); the nvcc test needs a GPU and exits 0 saying so without one.
find_path(GPUKIT_THRUST_INCLUDE_DIR thrust/version.h HINTS ${CUDAToolkit_INCLUDE_DIRS}/cccl ${CUDAToolkit_INCLUDE_DIRS})
if(GPUKIT_THRUST_INCLUDE_DIR)
  gpukit_add_test(test_thrust_allocator SOURCES "${gpukit_memory_tests}/thrust_allocator_test.cpp" GPU)
  if("undefined" IN_LIST GPUKIT_SANITIZE)
    # Thrust's references (thrust/detail/reference.h) bind a reference to a null execution policy: UBSan's null
    # check stops there, in Thrust, before gpukit's code runs. The other checks stay on. (A source property: it
    # comes after the sanitizer flags on the command line.)
    set_source_files_properties("${gpukit_memory_tests}/thrust_allocator_test.cpp" PROPERTIES
      COMPILE_OPTIONS -fno-sanitize=null)
  endif()
  foreach(target test_thrust_allocator test_thrust_allocator_sim)
    target_include_directories(${target} SYSTEM PRIVATE "${GPUKIT_THRUST_INCLUDE_DIR}")
    target_compile_definitions(${target} PRIVATE THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP)
  endforeach()
endif()
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER AND NOT GPUKIT_SANITIZE AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  add_executable(test_gpu_thrust "${gpukit_memory_tests}/gpu_thrust_test.cu")
  target_link_libraries(test_gpu_thrust PRIVATE gpukit::gpukit)
  set_target_properties(test_gpu_thrust PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_compile_options(test_gpu_thrust PRIVATE -Werror all-warnings -Xcompiler=-Wall,-Wextra)
  add_test(NAME test_gpu_thrust COMMAND test_gpu_thrust)
  set_tests_properties(test_gpu_thrust PROPERTIES LABELS "gpu" SKIP_REGULAR_EXPRESSION "GPUKIT_TEST_SKIPPED"
    TIMEOUT ${GPUKIT_GPU_TEST_TIMEOUT})
  set_property(GLOBAL APPEND PROPERTY GPUKIT_GPU_CHECK_TARGETS test_gpu_thrust)
endif()
