# packaging.add_subdirectory: a parent project adds the gpukit source tree with add_subdirectory, exports a target
# that links gpukit::gpukit (with GPUKIT_INSTALL turned on), builds and runs. gpukit must add none of its tests,
# examples or benchmarks to the parent, and the parent's install must carry gpukit's package along.
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
