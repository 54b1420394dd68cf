# packaging.install (fixture for the tests that consume an installed gpukit): configure the source tree afresh with
# tests, examples and benchmarks off, install it into PREFIX, and check the installed tree: exactly the expected
# files, and no path of this machine in the CMake package. Then the same install with the CUDA toolkit hidden must
# give the same CMake package, which a find_package consumer uses.
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
file(REMOVE_RECURSE "${PREFIX}")
set(build "${WORK_DIR}/build")

# GPUKIT_INSTALL is not passed: it must default to ON in a top-level build. The configured prefix does not exist:
# installing with --prefix elsewhere shows that nothing installed depends on it.
set(configured_prefix "/gpukit-configured-prefix-not-used")
packaging_configure("configure gpukit (tests, examples, benchmarks off)" "${SOURCE_DIR}" "${build}"
  ARGS "-DCMAKE_INSTALL_PREFIX=${configured_prefix}" -DGPUKIT_BUILD_TESTS=OFF -DGPUKIT_BUILD_EXAMPLES=OFF
       -DGPUKIT_BUILD_BENCHMARKS=OFF)
packaging_build("build (gpukit::compiled only: the headers need no build)" "${build}")
# No build type given: a top-level gpukit builds Release (gpukit::compiled unoptimized would be ~10x slower).
file(STRINGS "${build}/CMakeCache.txt" build_type REGEX "^CMAKE_BUILD_TYPE:")
if(NOT build_type MATCHES "=Release$")
  packaging_fail("configured with no build type, the build type is not Release: ${build_type}")
endif()
packaging_run("cmake --install into ${PREFIX}" COMMAND "${CMAKE_COMMAND}" --install "${build}" --prefix "${PREFIX}")

# --- exactly the expected files ---
set(cmakedir "share/cmake/gpukit")
file(GLOB_RECURSE headers RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/gpukit/*.hpp"
     "${SOURCE_DIR}/include/gpukit/*.h" "${SOURCE_DIR}/include/gpukit/*.cuh" "${SOURCE_DIR}/include/gpukit/*.inl")
set(expected "")
foreach(header IN LISTS headers)
  list(APPEND expected "include/${header}")
endforeach()
list(APPEND expected "${cmakedir}/gpukitConfig.cmake" "${cmakedir}/gpukitConfigVersion.cmake"
     "${cmakedir}/gpukitTargets.cmake" "lib/pkgconfig/gpukit.pc" "share/doc/gpukit/LICENSE")
# gpukit::compiled (the optional compiled mode), built with the toolkit: the library and its export set.
set(expected_compiled "lib/libgpukit.a" "${cmakedir}/gpukitCompiledTargets.cmake"
    "${cmakedir}/gpukitCompiledTargets-release.cmake")
list(APPEND expected ${expected_compiled})
file(GLOB_RECURSE installed LIST_DIRECTORIES false RELATIVE "${PREFIX}" "${PREFIX}/*")
set(missing ${expected})
list(REMOVE_ITEM missing ${installed})
set(unexpected ${installed})
list(REMOVE_ITEM unexpected ${expected})
if(missing OR unexpected)
  string(REPLACE ";" "\n  " missing "${missing}")
  string(REPLACE ";" "\n  " unexpected "${unexpected}")
  packaging_fail("the installed files are not the expected ones.\nmissing:\n  ${missing}\nunexpected:\n  ${unexpected}")
endif()
list(LENGTH installed n)
message(STATUS "installed ${n} files, as expected")
file(GLOB_RECURSE all_dirs LIST_DIRECTORIES true "${PREFIX}/*")
foreach(dir IN LISTS all_dirs)
  if(IS_DIRECTORY "${dir}")
    file(GLOB entries "${dir}/*")
    if(NOT entries)
      packaging_fail("the install tree has an empty directory: ${dir}")
    endif()
  endif()
endforeach()

# --- the CMake package is relocatable ---
string(REPLACE "|" ";" CUDA_INCLUDE_DIRS "${CUDA_INCLUDE_DIRS}")  # tests.cmake joins the list with |
foreach(file gpukitConfig.cmake gpukitConfigVersion.cmake gpukitTargets.cmake gpukitCompiledTargets.cmake)
  file(READ "${PREFIX}/${cmakedir}/${file}" text)
  foreach(path "${SOURCE_DIR}" "${WORK_DIR}" "${PREFIX}" "${configured_prefix}" ${CUDA_INCLUDE_DIRS}
               "${CUDA_LIBRARY_DIR}")
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      packaging_fail("${cmakedir}/${file} contains the absolute path ${path}: the package is not relocatable")
    endif()
  endforeach()
endforeach()
file(READ "${PREFIX}/${cmakedir}/gpukitTargets.cmake" targets)
# gpukit::gpukit is gpukit::headers (include directory, C++17, CUDA's headers, threads, dl) plus the CUDA runtime.
packaging_expect_match("gpukitTargets.cmake: usage requirements of gpukit::gpukit and gpukit::headers" "${targets}"
  "INTERFACE_COMPILE_FEATURES \"cxx_std_17\""
  "INTERFACE_INCLUDE_DIRECTORIES \"\\\${_IMPORT_PREFIX}/include\""
  "INTERFACE_LINK_LIBRARIES \"gpukit::headers;CUDA::cudart\""
  "INTERFACE_LINK_LIBRARIES \"CUDA::toolkit;Threads::Threads")
file(READ "${PREFIX}/${cmakedir}/gpukitCompiledTargets.cmake" compiled_targets)
packaging_expect_match("gpukitCompiledTargets.cmake: gpukit::compiled" "${compiled_targets}"
  "add_library\\(gpukit::compiled STATIC IMPORTED\\)"
  "INTERFACE_COMPILE_DEFINITIONS \"GPUKIT_SEPARATE_COMPILATION\""
  "INTERFACE_LINK_LIBRARIES \"gpukit::gpukit\"")
if(targets MATCHES "INTERFACE_[A-Z_]+ \"/")
  packaging_fail("gpukitTargets.cmake has an absolute path in a usage requirement:\n${targets}")
endif()

# --- gpukitConfig.cmake creates CUDA::cudart and Threads::Threads before loading the targets ---
file(READ "${PREFIX}/${cmakedir}/gpukitConfig.cmake" config)
string(FIND "${config}" "find_dependency(CUDAToolkit 13.0)" at_cuda)  # the toolkit gpukit needs
string(FIND "${config}" "find_dependency(Threads)" at_threads)
string(FIND "${config}" "gpukitTargets.cmake\")" at_targets)
if(at_cuda EQUAL -1 OR at_threads EQUAL -1 OR at_targets EQUAL -1 OR at_cuda GREATER at_targets
   OR at_threads GREATER at_targets)
  packaging_fail("gpukitConfig.cmake must call find_dependency(CUDAToolkit 13.0) and find_dependency(Threads) before it "
                 "includes gpukitTargets.cmake:\n${config}")
endif()

# --- the pkg-config file finds its prefix from its own location ---
file(READ "${PREFIX}/lib/pkgconfig/gpukit.pc" pc)
packaging_expect_match("gpukit.pc" "${pc}" "\nprefix=\\\${pcfiledir}/\\.\\./\\.\\.\n" "\nVersion: ${VERSION}\n"
  "\nLibs: [^\n]*-lcudart")
message(STATUS "install tree of gpukit ${VERSION} in ${PREFIX}: ok")

# --- no CUDA toolkit is needed to install ---
# Package managers install gpukit where there may be no toolkit (the Conan recipe disables the search to prove it).
# Nothing is compiled then, so CUDA is not looked for: the installed files must be the same, byte for byte, except
# gpukit.pc, which records the toolkit's paths and is left out with a message, and gpukit::compiled, which needs the
# toolkit's headers to build (the package then has no `compiled` component). gpukitConfig.cmake still finds CUDA
# on the consumer's machine, as the find_package consumer below shows.
set(build "${WORK_DIR}/build-no-cuda")
set(no_cuda_prefix "${WORK_DIR}/prefix-no-cuda")
packaging_configure("configure gpukit with -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON (nothing to compile)"
  "${SOURCE_DIR}" "${build}" OUTPUT_VARIABLE out
  ARGS "-DCMAKE_INSTALL_PREFIX=${configured_prefix}" -DGPUKIT_BUILD_TESTS=OFF -DGPUKIT_BUILD_EXAMPLES=OFF
       -DGPUKIT_BUILD_BENCHMARKS=OFF -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
packaging_expect_match("the configure without CUDA" "${out}" "no CUDA toolkit found: gpukit\\.pc is not installed")
packaging_build("build without CUDA (nothing to compile)" "${build}")
packaging_run("cmake --install into ${no_cuda_prefix}"
  COMMAND "${CMAKE_COMMAND}" --install "${build}" --prefix "${no_cuda_prefix}")
file(GLOB_RECURSE installed_no_cuda LIST_DIRECTORIES false RELATIVE "${no_cuda_prefix}" "${no_cuda_prefix}/*")
set(expected_no_cuda ${expected})
list(REMOVE_ITEM expected_no_cuda "lib/pkgconfig/gpukit.pc" ${expected_compiled})
list(SORT installed_no_cuda)
list(SORT expected_no_cuda)
if(NOT installed_no_cuda STREQUAL expected_no_cuda)
  string(REPLACE ";" "\n  " installed_no_cuda "${installed_no_cuda}")
  packaging_fail("installed without CUDA, the files are not those of the normal install less gpukit.pc:\n  "
                 "${installed_no_cuda}")
endif()
foreach(file IN LISTS expected_no_cuda)
  file(READ "${PREFIX}/${file}" normal)
  file(READ "${no_cuda_prefix}/${file}" no_cuda)
  # gpukitConfig.cmake records whether the install has gpukit::compiled: the one difference allowed.
  string(REPLACE "_gpukit_installs_compiled TRUE)" "_gpukit_installs_compiled FALSE)" normal "${normal}")
  if(NOT no_cuda STREQUAL normal)
    packaging_fail("${file} installed without CUDA differs from the normal install's.\nnormal:\n${normal}\n"
                   "without CUDA:\n${no_cuda}")
  endif()
endforeach()
list(LENGTH expected_no_cuda n)
message(STATUS "installed without CUDA: the same ${n} files, gpukit.pc left out")

set(build "${WORK_DIR}/consumer-no-cuda")
packaging_configure("configure the find_package consumer of the install without CUDA"
  "${PACKAGING_DIR}/find_package_consumer" "${build}"
  ARGS "-DCMAKE_PREFIX_PATH=${no_cuda_prefix}" "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=${WORK_DIR}/bin")
packaging_build("build the consumer" "${build}")
packaging_executable(program "${WORK_DIR}/bin" consumer)
packaging_run_consumer("run the consumer" "${program}")
message(STATUS "install tree of gpukit ${VERSION} without CUDA at configure time: ok")

# --- a header-only install over an install with gpukit::compiled does not leave that component findable ---
# (its targets file stays in the prefix, and its library would not match the new headers).
set(stale_prefix "${WORK_DIR}/prefix-reinstalled")
file(REMOVE_RECURSE "${stale_prefix}")
file(COPY "${PREFIX}/" DESTINATION "${stale_prefix}")
packaging_run("cmake --install the install without CUDA over a copy of the normal install"
  COMMAND "${CMAKE_COMMAND}" --install "${WORK_DIR}/build-no-cuda" --prefix "${stale_prefix}")
set(probe "${WORK_DIR}/compiled-probe")
file(MAKE_DIRECTORY "${probe}")
file(WRITE "${probe}/CMakeLists.txt" "cmake_minimum_required(VERSION 3.18)\nproject(probe LANGUAGES CXX)\n"
  "find_package(gpukit CONFIG REQUIRED OPTIONAL_COMPONENTS compiled)\n"
  "message(STATUS \"compiled component found: \${gpukit_compiled_FOUND}\")\n")
foreach(case "${PREFIX};TRUE" "${stale_prefix};FALSE")
  list(GET case 0 prefix)
  list(GET case 1 found)
  packaging_configure("find_package(gpukit OPTIONAL_COMPONENTS compiled) in ${prefix}" "${probe}"
    "${WORK_DIR}/compiled-probe-build" OUTPUT_VARIABLE out ARGS "-DCMAKE_PREFIX_PATH=${prefix}")
  packaging_expect_match("the compiled component of ${prefix}" "${out}" "compiled component found: ${found}")
endforeach()
message(STATUS "a header-only reinstall leaves no gpukit::compiled to find: ok")
