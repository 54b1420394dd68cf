# Tests of CUDA graphs and graph-private pools (include/gpukit/graph, memory/graph_pool.hpp), included by
# tests/CMakeLists.txt: GPU tests, so they also run on the simulator as *_sim.
gpukit_add_test(test_gpu_graph SOURCES "${CMAKE_CURRENT_LIST_DIR}/gpu_graph_test.cpp" GPU)
gpukit_add_test(test_gpu_capture_rules SOURCES "${CMAKE_CURRENT_LIST_DIR}/gpu_capture_rules_test.cpp" GPU)
# They take the refusals they expect (cudasim::take_violations).
target_compile_definitions(test_gpu_graph_sim PRIVATE GPUKIT_TEST_ON_CUDASIM)
target_compile_definitions(test_gpu_capture_rules_sim PRIVATE GPUKIT_TEST_ON_CUDASIM)
