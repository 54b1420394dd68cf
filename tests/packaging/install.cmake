# packaging.install (fixture for the tests that consume an installed gpukit): configure the source tree afresh with
# tests, examples and benchmarks off, install it into PREFIX, and check the installed tree: exactly the expected
# files, and no path of this machine in the CMake package.
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
packaging_build("build (nothing to compile: header-only)" "${build}")
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
foreach(file gpukitConfig.cmake gpukitConfigVersion.cmake gpukitTargets.cmake)
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
if(targets MATCHES "INTERFACE_[A-Z_]+ \"/")
  packaging_fail("gpukitTargets.cmake has an absolute path in a usage requirement:\n${targets}")
endif()

# --- gpukitConfig.cmake creates CUDA::cudart and Threads::Threads before loading the targets ---
file(READ "${PREFIX}/${cmakedir}/gpukitConfig.cmake" config)
string(FIND "${config}" "find_dependency(CUDAToolkit)" at_cuda)
string(FIND "${config}" "find_dependency(Threads)" at_threads)
string(FIND "${config}" "gpukitTargets.cmake\")" at_targets)
if(at_cuda EQUAL -1 OR at_threads EQUAL -1 OR at_targets EQUAL -1 OR at_cuda GREATER at_targets
   OR at_threads GREATER at_targets)
  packaging_fail("gpukitConfig.cmake must call find_dependency(CUDAToolkit) and find_dependency(Threads) before it "
                 "includes gpukitTargets.cmake:\n${config}")
endif()

# --- the pkg-config file finds its prefix from its own location ---
file(READ "${PREFIX}/lib/pkgconfig/gpukit.pc" pc)
packaging_expect_match("gpukit.pc" "${pc}" "\nprefix=\\\${pcfiledir}/\\.\\./\\.\\.\n" "\nVersion: ${VERSION}\n"
  "\nLibs: [^\n]*-lcudart")
message(STATUS "install tree of gpukit ${VERSION} in ${PREFIX}: ok")
