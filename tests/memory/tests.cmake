# Tests of the caching device allocator (include/gpukit/memory), included by tests/CMakeLists.txt.
set(gpukit_memory_tests "${CMAKE_CURRENT_LIST_DIR}")
gpukit_add_test(test_allocator_random SOURCES "${gpukit_memory_tests}/allocator_random_test.cpp")
gpukit_add_test(test_allocator_edge SOURCES "${gpukit_memory_tests}/allocator_edge_test.cpp")
gpukit_add_test(test_allocator_steady_state SOURCES "${gpukit_memory_tests}/allocator_steady_state_test.cpp")
gpukit_add_test(test_allocator_front_cache SOURCES "${gpukit_memory_tests}/allocator_front_cache_test.cpp")
gpukit_add_test(test_pointer_map SOURCES "${gpukit_memory_tests}/pointer_map_test.cpp")
gpukit_add_test(test_allocator_expandable SOURCES "${gpukit_memory_tests}/allocator_expandable_test.cpp")
gpukit_add_test(test_allocator_config SOURCES "${gpukit_memory_tests}/allocator_config_test.cpp")
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
