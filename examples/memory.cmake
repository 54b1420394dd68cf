# Example of the caching device allocator (included by examples/CMakeLists.txt).
gpukit_add_example(memory_stats "${CMAKE_CURRENT_LIST_DIR}/memory_stats.cpp")
gpukit_add_example(graph_replay "${CMAKE_CURRENT_LIST_DIR}/graph_replay.cpp")
gpukit_add_example(memory_history "${CMAKE_CURRENT_LIST_DIR}/memory_history.cpp")
gpukit_add_example(tenant_budgets "${CMAKE_CURRENT_LIST_DIR}/tenant_budgets.cpp")
# The memory_summary the README quotes is what memory_stats prints on the CPU (so that it does not go stale).
if(GPUKIT_BUILD_TESTS)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    add_test(NAME example.memory_stats_readme
      COMMAND Python3::Interpreter "${PROJECT_SOURCE_DIR}/tools/check_readme_output.py" "${PROJECT_SOURCE_DIR}/README.md"
              "output of `examples/memory_stats`" $<TARGET_FILE:memory_stats>)
    set_tests_properties(example.memory_stats_readme PROPERTIES LABELS "example;cpu;lint" TIMEOUT 300)
  endif()
endif()
