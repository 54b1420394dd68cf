# Example of the caching device allocator (included by examples/CMakeLists.txt).
gpukit_add_example(memory_stats "${CMAKE_CURRENT_LIST_DIR}/memory_stats.cpp")
gpukit_add_example(graph_replay "${CMAKE_CURRENT_LIST_DIR}/graph_replay.cpp")
gpukit_add_example(memory_history "${CMAKE_CURRENT_LIST_DIR}/memory_history.cpp")
gpukit_add_example(tenant_budgets "${CMAKE_CURRENT_LIST_DIR}/tenant_budgets.cpp")
