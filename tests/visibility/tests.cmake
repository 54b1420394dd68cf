# Symbol visibility and default-stream modes, included by tests/CMakeLists.txt.
set(gpukit_visibility_tests "${CMAKE_CURRENT_LIST_DIR}")

# Two shared libraries built as many projects build theirs, hiding everything they do not export: gpukit's
# process-wide objects must still be one per process (GPUKIT_EXPORT in include/gpukit/detail/config.hpp).
# gpukit_strict_flags brings the warnings and the sanitizer flags of the build. Header-only, in every configuration:
# in the compiled mode a process links gpukit::compiled once (README, "Compiled mode"), where each of these would
# hold a copy of the static library.
foreach(library a b)
  add_library(gpukit_visibility_${library} SHARED "${gpukit_visibility_tests}/singleton_library.cpp")
  set_target_properties(gpukit_visibility_${library} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  target_compile_definitions(gpukit_visibility_${library} PRIVATE GPUKIT_VISIBILITY_LIBRARY=${library})
  target_link_libraries(gpukit_visibility_${library} PRIVATE gpukit::gpukit gpukit_strict_flags)
endforeach()
gpukit_add_test(test_visibility HEADER_ONLY SOURCES "${gpukit_visibility_tests}/visibility_test.cpp")
target_link_libraries(test_visibility PRIVATE gpukit_visibility_a gpukit_visibility_b)

# One program, two translation units in different default-stream modes (an inline namespace per mode).
gpukit_add_test(test_odr_mode SOURCES "${gpukit_visibility_tests}/odr_mode_test.cpp"
                "${gpukit_visibility_tests}/odr_mode_per_thread_tu.cpp")
set_source_files_properties("${gpukit_visibility_tests}/odr_mode_per_thread_tu.cpp" PROPERTIES
                            COMPILE_DEFINITIONS CUDA_API_PER_THREAD_DEFAULT_STREAM)
