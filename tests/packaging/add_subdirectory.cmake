# packaging.add_subdirectory: a parent project adds the gpukit source tree with add_subdirectory, exports a target
# that links gpukit::gpukit (with GPUKIT_INSTALL turned on), builds and runs. gpukit must add none of its tests,
# examples or benchmarks to the parent, and the parent's install must carry gpukit's package along. A parent with a
# hidden visibility preset and unity builds must not impose them on gpukit::compiled (configured only).
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
set(build "${WORK_DIR}/build")
set(prefix "${WORK_DIR}/prefix")

packaging_configure("configure the parent: add_subdirectory(gpukit), GPUKIT_INSTALL ON, exports a target"
  "${PACKAGING_DIR}/add_subdirectory_consumer" "${build}"
  ARGS "-DGPUKIT_SOURCE_DIR=${SOURCE_DIR}" "-DCMAKE_INSTALL_PREFIX=${prefix}"
       "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=${WORK_DIR}/bin")
packaging_build("build the parent" "${build}")
packaging_executable(program "${WORK_DIR}/bin" consumer)
packaging_run_consumer("run the parent's program" "${program}")
packaging_expect_only_own_tests("${build}" 1)
packaging_expect_no_development_targets("${build}" "${build}/gpukit")

packaging_run("cmake --install the parent" COMMAND "${CMAKE_COMMAND}" --install "${build}")
foreach(file include/gpukit/gpukit.hpp share/cmake/gpukit/gpukitConfig.cmake share/cmake/gpukit/gpukitTargets.cmake
             share/cmake/consumer/consumerTargets.cmake)
  if(NOT EXISTS "${prefix}/${file}")
    packaging_fail("the parent's install lacks ${file}")
  endif()
endforeach()
file(READ "${prefix}/share/cmake/consumer/consumerTargets.cmake" exported)
packaging_expect_match("the parent's exported target" "${exported}" "INTERFACE_LINK_LIBRARIES \"gpukit::gpukit\"")
message(STATUS "the parent's install has its own package and gpukit's")

# A parent that hides symbols by default and merges sources (CMAKE_CXX_VISIBILITY_PRESET hidden, CMAKE_UNITY_BUILD):
# gpukit::compiled's symbols must stay visible (each shared library that links it would otherwise get its own default
# allocator) and its two sources, one per default-stream mode, must compile apart. The parent's own program proves the
# settings took effect.
set(hidden_unity "${WORK_DIR}/build-hidden-unity")
packaging_configure("configure the parent with a hidden visibility preset and unity builds"
  "${PACKAGING_DIR}/add_subdirectory_consumer" "${hidden_unity}"
  ARGS "-DGPUKIT_SOURCE_DIR=${SOURCE_DIR}" -DCMAKE_CXX_VISIBILITY_PRESET=hidden -DCMAKE_VISIBILITY_INLINES_HIDDEN=ON
       -DCMAKE_UNITY_BUILD=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
file(READ "${hidden_unity}/compile_commands.json" compile_commands)
string(JSON count LENGTH "${compile_commands}")
math(EXPR last "${count} - 1")
set(compiled_sources "")
set(parent_hidden_unity FALSE)
foreach(i RANGE ${last})
  string(JSON file GET "${compile_commands}" ${i} file)
  string(JSON command GET "${compile_commands}" ${i} command)
  if(file MATCHES "/src/gpukit_compiled(_ptds)?\\.cpp$")
    list(APPEND compiled_sources "${file}")
    if(command MATCHES "-fvisibility=hidden|-fvisibility-inlines-hidden")
      packaging_fail("gpukit::compiled took the parent's visibility preset: ${command}")
    endif()
  elseif(file MATCHES "/consumer\\.dir/.*unity_.*\\.cxx$" AND command MATCHES "-fvisibility=hidden")
    set(parent_hidden_unity TRUE)
  elseif(command MATCHES "gpukit_compiled")
    packaging_fail("a source of gpukit::compiled was merged into a unity file: ${file}")
  endif()
endforeach()
list(LENGTH compiled_sources n)
if(NOT n EQUAL 2)
  packaging_fail("expected gpukit_compiled.cpp and gpukit_compiled_ptds.cpp compiled apart, found: ${compiled_sources}")
endif()
if(NOT parent_hidden_unity)
  packaging_fail("the parent's own program was not built from a unity file with hidden visibility: the settings "
                 "this check relies on did not take effect")
endif()
message(STATUS "gpukit::compiled keeps default visibility and its two sources under a hidden, unity-built parent")
