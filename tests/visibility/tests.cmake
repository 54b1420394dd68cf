# Symbol visibility and default-stream modes, included by tests/CMakeLists.txt.
set(gpukit_visibility_tests "${CMAKE_CURRENT_LIST_DIR}")

# Two shared libraries built as many projects build theirs, hiding everything they do not export: gpukit's
# process-wide objects must still be one per process (GPUKIT_EXPORT in include/gpukit/detail/config.hpp).
# gpukit_strict_flags brings the warnings and the sanitizer flags of the build. Header-only, in every configuration:
# in the compiled mode a process links gpukit::compiled once (README, "Compiled mode"), where each of these would
# hold a copy of the static library.
function(gpukit_visibility_library library type)
  add_library(gpukit_visibility_${library} ${type} "${gpukit_visibility_tests}/singleton_library.cpp")
  set_target_properties(gpukit_visibility_${library} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  target_compile_definitions(gpukit_visibility_${library} PRIVATE GPUKIT_VISIBILITY_LIBRARY=${library})
  target_link_libraries(gpukit_visibility_${library} PRIVATE gpukit::gpukit gpukit_strict_flags)
endfunction()
gpukit_visibility_library(a SHARED)
gpukit_visibility_library(b SHARED)
gpukit_add_test(test_visibility HEADER_ONLY SOURCES "${gpukit_visibility_tests}/visibility_test.cpp")
target_link_libraries(test_visibility PRIVATE gpukit_visibility_a gpukit_visibility_b)

# One program, two translation units in different default-stream modes (an inline namespace per mode).
gpukit_add_test(test_odr_mode SOURCES "${gpukit_visibility_tests}/odr_mode_test.cpp"
                "${gpukit_visibility_tests}/odr_mode_per_thread_tu.cpp")
set_source_files_properties("${gpukit_visibility_tests}/odr_mode_per_thread_tu.cpp" PROPERTIES
                            COMPILE_DEFINITIONS CUDA_API_PER_THREAD_DEFAULT_STREAM)

# The same library twice more, as plugins opened with dlopen(RTLD_LOCAL) by an executable that uses gpukit and
# exports its symbols (ENABLE_EXPORTS: -rdynamic), as a program that loads plugins is built: they share the
# executable's process-wide objects (README, "Compiled mode", says which builds do not).
gpukit_visibility_library(plugin_a MODULE)
gpukit_visibility_library(plugin_b MODULE)
gpukit_add_test(test_visibility_dlopen HEADER_ONLY SOURCES "${gpukit_visibility_tests}/dlopen_test.cpp")
set_target_properties(test_visibility_dlopen PROPERTIES ENABLE_EXPORTS ON)
target_link_libraries(test_visibility_dlopen PRIVATE ${CMAKE_DL_LIBS})
add_dependencies(test_visibility_dlopen gpukit_visibility_plugin_a gpukit_visibility_plugin_b)
target_compile_definitions(test_visibility_dlopen PRIVATE
  GPUKIT_PLUGIN_A="$<TARGET_FILE:gpukit_visibility_plugin_a>" GPUKIT_PLUGIN_B="$<TARGET_FILE:gpukit_visibility_plugin_b>")
