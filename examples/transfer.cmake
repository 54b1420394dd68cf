# Examples of pinned memory and transfers (included by examples/CMakeLists.txt); ctest runs each, so each exits 0
# without a GPU.
gpukit_add_example(bandwidth_test "${CMAKE_CURRENT_SOURCE_DIR}/bandwidth_test.cpp")
gpukit_add_example(prefetch_pipeline "${CMAKE_CURRENT_SOURCE_DIR}/prefetch_pipeline.cpp")
gpukit_add_example(train_input_pipeline "${CMAKE_CURRENT_SOURCE_DIR}/train_input_pipeline.cpp")
