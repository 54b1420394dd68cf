# Examples of pinned memory and transfers (included by examples/CMakeLists.txt); ctest runs each, so each exits 0
# without a GPU.
# On the simulator the rates mean nothing, and each size takes its time budget: up to 64 MiB (where the targets
# start) runs every path in a sixth of the time of 1 GiB.
gpukit_add_example(bandwidth_test "${CMAKE_CURRENT_SOURCE_DIR}/bandwidth_test.cpp" SIM_ARGS --max 64M)
gpukit_add_example(prefetch_pipeline "${CMAKE_CURRENT_SOURCE_DIR}/prefetch_pipeline.cpp")
gpukit_add_example(train_input_pipeline "${CMAKE_CURRENT_SOURCE_DIR}/train_input_pipeline.cpp")
