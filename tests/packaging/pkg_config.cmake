# packaging.pkg_config: compile and run a program with the flags from `pkg-config --cflags --libs gpukit`, against a
# copy of the installed tree (gpukit.pc finds its prefix from its own location).
include("${CMAKE_CURRENT_LIST_DIR}/common.cmake")
packaging_fresh_dir("${WORK_DIR}")
find_program(pkg_config NAMES pkg-config pkgconf)
if(NOT pkg_config)
  packaging_fail("pkg-config was not found (Debian: apt-get install pkg-config; or run .ci/install-deps)")
endif()
set(prefix "${WORK_DIR}/moved-prefix")
packaging_copy_prefix("${prefix}")
set(ENV{PKG_CONFIG_PATH} "${prefix}/lib/pkgconfig")

packaging_run("pkg-config --modversion gpukit" OUTPUT_VARIABLE version COMMAND "${pkg_config}" --modversion gpukit)
string(STRIP "${version}" version)
if(NOT version STREQUAL VERSION)
  packaging_fail("pkg-config says gpukit ${version}, expected ${VERSION}")
endif()
packaging_run("pkg-config --variable=includedir gpukit" OUTPUT_VARIABLE includedir
  COMMAND "${pkg_config}" --variable=includedir gpukit)
string(STRIP "${includedir}" includedir)
get_filename_component(includedir "${includedir}" ABSOLUTE)
if(NOT includedir STREQUAL "${prefix}/include")
  packaging_fail("gpukit.pc's includedir is ${includedir}, expected the moved tree's ${prefix}/include")
endif()
packaging_run("pkg-config --cflags --libs gpukit" SHOW_OUTPUT OUTPUT_VARIABLE flags
  COMMAND "${pkg_config}" --cflags --libs gpukit)
packaging_run("pkg-config --variable=cuda_libdir gpukit" OUTPUT_VARIABLE cuda_libdir
  COMMAND "${pkg_config}" --variable=cuda_libdir gpukit)
string(STRIP "${cuda_libdir}" cuda_libdir)
separate_arguments(flags UNIX_COMMAND "${flags}")

# The flags themselves must lead to CUDA (a machine may also have CUDA's headers or libraries on default paths,
# which would hide a missing flag from the compile below): one -I directory holds cuda_runtime_api.h, one -L
# directory holds libcudart.
set(found_header "")
set(found_library "")
foreach(flag IN LISTS flags)
  if(flag MATCHES "^-I(.+)$")
    if(EXISTS "${CMAKE_MATCH_1}/cuda_runtime_api.h")
      set(found_header "${CMAKE_MATCH_1}")
    endif()
  elseif(flag MATCHES "^-L(.+)$")
    file(GLOB cudart "${CMAKE_MATCH_1}/libcudart.so*" "${CMAKE_MATCH_1}/libcudart.a")
    if(cudart)
      set(found_library "${CMAKE_MATCH_1}")
    endif()
  endif()
endforeach()
if(NOT found_header OR NOT found_library OR NOT "-lcudart" IN_LIST flags)
  packaging_fail("pkg-config's flags must name CUDA's include directory (-I, with cuda_runtime_api.h: "
                 "\"${found_header}\"), its library directory (-L, with libcudart: \"${found_library}\") and -lcudart")
endif()
foreach(var CPATH CPLUS_INCLUDE_PATH LIBRARY_PATH)  # only the flags from pkg-config count
  unset(ENV{${var}})
endforeach()

set(program "${WORK_DIR}/consumer")
packaging_run("compile and link: ${CXX_COMPILER} -std=c++17 consumer_main.cpp $(pkg-config --cflags --libs gpukit)"
  COMMAND "${CXX_COMPILER}" -std=c++17 "-DGPUKIT_EXPECTED_VERSION=\"${VERSION}\"" "${PACKAGING_DIR}/consumer_main.cpp"
          ${flags} "-Wl,-rpath,${cuda_libdir}" -o "${program}")
packaging_run_consumer("run the program" "${program}")
