# packaging.fetchcontent: a project gets gpukit with FetchContent (SOURCE_DIR: this checkout, no network), builds and
# runs. It includes CTest (BUILD_TESTING ON); gpukit must still add none of its tests, examples or benchmarks, and,
# GPUKIT_INSTALL being off for a subproject by default, the project's install must contain nothing of gpukit.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
set(build "${WORK_DIR}/build")
set(prefix "${WORK_DIR}/prefix")

packaging_configure("configure the consumer: FetchContent_Declare(gpukit SOURCE_DIR <checkout>)"
  "${PACKAGING_DIR}/fetchcontent_consumer" "${build}"
  ARGS "-DGPUKIT_CHECKOUT=${SOURCE_DIR}" "-DCMAKE_INSTALL_PREFIX=${prefix}"
       "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=${WORK_DIR}/bin")
file(STRINGS "${build}/CMakeCache.txt" testing REGEX "^BUILD_TESTING:")
if(NOT testing STREQUAL "BUILD_TESTING:BOOL=ON")
  packaging_fail("the consumer should have BUILD_TESTING ON (include(CTest)); cache says: ${testing}")
endif()
packaging_build("build the consumer" "${build}")
packaging_executable(program "${WORK_DIR}/bin" consumer)
packaging_run_consumer("run the consumer" "${program}")
packaging_expect_only_own_tests("${build}" 1)
packaging_expect_no_development_targets("${build}" "${build}/_deps/gpukit-build")

packaging_run("cmake --install the consumer" COMMAND "${CMAKE_COMMAND}" --install "${build}")
file(GLOB_RECURSE installed RELATIVE "${prefix}" "${prefix}/*")
if(NOT installed STREQUAL "bin/consumer")
  packaging_fail("the consumer's install should hold bin/consumer only (gpukit installs nothing unless "
                 "GPUKIT_INSTALL is ON), it holds: ${installed}")
endif()
message(STATUS "gpukit installed nothing into the consumer's prefix")
