# packaging.find_package: a separate project finds the installed gpukit with find_package(gpukit CONFIG REQUIRED),
# builds and runs. The install tree is first copied elsewhere (relocatable), the consumer asks for C++14 (gpukit must
# raise it to C++17) and mentions neither CUDA nor threads (gpukit's package must bring them). Then the version
# file: a compatible request succeeds, incompatible ones fail.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
set(prefix "${WORK_DIR}/moved-prefix")
packaging_copy_prefix("${prefix}")
set(consumer "${PACKAGING_DIR}/find_package_consumer")
set(build "${WORK_DIR}/build")

packaging_configure("configure the consumer: find_package(gpukit ${VERSION_MAJOR}.${VERSION_MINOR} CONFIG REQUIRED)"
  "${consumer}" "${build}"
  ARGS "-DCMAKE_PREFIX_PATH=${prefix}" "-DGPUKIT_CONSUMER_VERSION=${VERSION_MAJOR}.${VERSION_MINOR}"
       -DCMAKE_CXX_STANDARD=14 "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=${WORK_DIR}/bin")
file(STRINGS "${build}/CMakeCache.txt" found REGEX "^gpukit_DIR:")
if(NOT found STREQUAL "gpukit_DIR:PATH=${prefix}/share/cmake/gpukit")
  packaging_fail("the consumer found another gpukit than the one installed by this test: ${found}")
endif()
packaging_build("build the consumer" "${build}")
packaging_executable(program "${WORK_DIR}/bin" consumer)
packaging_run_consumer("run the consumer" "${program}")

# The compiled mode: find_package(gpukit COMPONENTS compiled) and gpukit::compiled, which brings
# GPUKIT_SEPARATE_COMPILATION (the consumer checks) and the library holding the engines it then calls.
packaging_configure("configure the consumer: find_package(gpukit CONFIG REQUIRED COMPONENTS compiled)"
  "${consumer}" "${WORK_DIR}/build-compiled"
  ARGS "-DCMAKE_PREFIX_PATH=${prefix}" -DGPUKIT_CONSUMER_COMPILED=ON
       "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=${WORK_DIR}/bin-compiled")
packaging_build("build the compiled-mode consumer" "${WORK_DIR}/build-compiled")
packaging_executable(program "${WORK_DIR}/bin-compiled" consumer)
packaging_run_consumer("run the compiled-mode consumer" "${program}")

# The version file: a newer minor or another major than the installed one must be refused, and while the major
# version is 0 (a minor version may break the API) an older minor too (SameMinorVersion).
math(EXPR next_major "${VERSION_MAJOR} + 1")
math(EXPR next_minor "${VERSION_MINOR} + 1")
set(refused "${next_major}.0" "${VERSION_MAJOR}.${next_minor}")
if(VERSION_MAJOR EQUAL 0 AND VERSION_MINOR GREATER 0)
  math(EXPR previous_minor "${VERSION_MINOR} - 1")
  list(APPEND refused "0.${previous_minor}")
endif()
foreach(requested IN LISTS refused)
  packaging_configure("find_package(gpukit ${requested} CONFIG REQUIRED) is refused (gpukit ${VERSION} installed)"
    "${consumer}" "${WORK_DIR}/build-${requested}" EXPECT_FAILURE OUTPUT_VARIABLE out
    ARGS "-DCMAKE_PREFIX_PATH=${prefix}" "-DGPUKIT_CONSUMER_VERSION=${requested}")
  packaging_expect_match("the refusal names the installed version" "${out}"
    "compatible[ \n]+with[ \n]+requested[ \n]+version[ \n]+\"${requested}\""
    "considered but not accepted:[ \n]+[^\n]*/gpukitConfig\\.cmake, version: ${VERSION}")
endforeach()
