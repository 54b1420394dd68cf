# Helpers for the packaging test drivers (the *.cmake scripts beside this file, run with cmake -P by ctest).
# tests.cmake passes every driver, with -D:
#   TEST_NAME      the ctest name, used in messages
#   SOURCE_DIR     the gpukit source tree
#   WORK_DIR       a directory of the build tree that belongs to this test alone; the driver empties it first
#   PREFIX         where packaging.install installs gpukit (the fixture the other tests use)
#   VERSION        gpukit's version, MAJOR.MINOR.PATCH
#   GENERATOR, MAKE_PROGRAM, CXX_COMPILER, CTEST_COMMAND   of the outer build, used for every nested build
# A failed step stops the driver with FATAL_ERROR (so ctest reports the test as failed), naming the step and showing
# the command and its output.
cmake_minimum_required(VERSION 3.18)

foreach(var TEST_NAME SOURCE_DIR WORK_DIR VERSION GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "packaging test driver ${CMAKE_SCRIPT_MODE_FILE}: -D${var}=... is missing")
  endif()
endforeach()
if(NOT DEFINED CTEST_COMMAND OR CTEST_COMMAND STREQUAL "")
  get_filename_component(cmake_bin_dir "${CMAKE_COMMAND}" DIRECTORY)
  set(CTEST_COMMAND "${cmake_bin_dir}/ctest")
endif()
set(PACKAGING_DIR "${CMAKE_CURRENT_LIST_DIR}")
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)$" _ "${VERSION}")
set(VERSION_MAJOR "${CMAKE_MATCH_1}")
set(VERSION_MINOR "${CMAKE_MATCH_2}")

# packaging_fail(<text>...): stop the test, saying why.
function(packaging_fail)
  string(JOIN "" text ${ARGN})
  message(FATAL_ERROR "\n*** ${TEST_NAME} FAILED: ${text}\n")
endfunction()

# packaging_run(<what> [EXPECT_FAILURE] [SHOW_OUTPUT] [OUTPUT_VARIABLE <var>] [WORKING_DIRECTORY <dir>]
#               COMMAND <command> <args>...)
# Runs one step. It must exit 0 (with EXPECT_FAILURE: must not). stdout and stderr together go to <var>.
function(packaging_run what)
  cmake_parse_arguments(PARSE_ARGV 1 arg "EXPECT_FAILURE;SHOW_OUTPUT" "OUTPUT_VARIABLE;WORKING_DIRECTORY" "COMMAND")
  if(NOT arg_COMMAND)
    packaging_fail("packaging_run(${what}) without COMMAND")
  endif()
  set(shown "")
  foreach(word IN LISTS arg_COMMAND)
    if(word MATCHES "[ \"']")
      string(APPEND shown " '${word}'")
    else()
      string(APPEND shown " ${word}")
    endif()
  endforeach()
  set(wd "")
  if(arg_WORKING_DIRECTORY)
    set(wd WORKING_DIRECTORY "${arg_WORKING_DIRECTORY}")
    set(shown " (cd ${arg_WORKING_DIRECTORY} &&${shown})")
  endif()
  string(TIMESTAMP start "%s")
  execute_process(COMMAND ${arg_COMMAND} ${wd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(TIMESTAMP stop "%s")
  math(EXPR seconds "${stop} - ${start}")
  if(arg_EXPECT_FAILURE)
    if(rc STREQUAL "0")
      packaging_fail("${what}: this command was expected to fail, but it succeeded:\n  \$${shown}\n${out}")
    endif()
    message(STATUS "[${seconds} s] ${what}: failed, as expected")
  else()
    if(NOT rc STREQUAL "0")
      packaging_fail("${what} (exit status ${rc}):\n  \$${shown}\n${out}")
    endif()
    message(STATUS "[${seconds} s] ${what}")
  endif()
  if(arg_SHOW_OUTPUT)
    string(STRIP "${out}" stripped)
    string(REPLACE "\n" "\n    " stripped "${stripped}")
    message("    ${stripped}")
  endif()
  if(arg_OUTPUT_VARIABLE)
    set(${arg_OUTPUT_VARIABLE} "${out}" PARENT_SCOPE)
  endif()
endfunction()

# packaging_configure(<what> <source dir> <build dir> [EXPECT_FAILURE] [OUTPUT_VARIABLE <var>] [ARGS <cache args>...])
# A fresh configure with the outer build's generator and compiler.
function(packaging_configure what source build)
  cmake_parse_arguments(PARSE_ARGV 3 arg "EXPECT_FAILURE" "OUTPUT_VARIABLE" "ARGS")
  file(REMOVE_RECURSE "${build}")
  set(flags "")
  if(arg_EXPECT_FAILURE)
    set(flags EXPECT_FAILURE)
  endif()
  set(generator_args -G "${GENERATOR}")
  if(MAKE_PROGRAM)
    list(APPEND generator_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  packaging_run("${what}" ${flags} OUTPUT_VARIABLE out
    COMMAND "${CMAKE_COMMAND}" -S "${source}" -B "${build}" ${generator_args} "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
            -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${arg_ARGS})
  if(arg_OUTPUT_VARIABLE)
    set(${arg_OUTPUT_VARIABLE} "${out}" PARENT_SCOPE)
  endif()
endfunction()

# packaging_build(<what> <build dir>)
function(packaging_build what build)
  packaging_run("${what}" COMMAND "${CMAKE_COMMAND}" --build "${build}" --parallel 2)
endfunction()

# packaging_fresh_dir(<dir>): an empty directory.
function(packaging_fresh_dir dir)
  file(REMOVE_RECURSE "${dir}")
  file(MAKE_DIRECTORY "${dir}")
endfunction()

# packaging_copy_prefix(<to>): a copy of the installed gpukit somewhere else, to prove the install tree relocatable.
function(packaging_copy_prefix to)
  if(NOT EXISTS "${PREFIX}/include/gpukit/gpukit.hpp")
    packaging_fail("gpukit is not installed in ${PREFIX} (the fixture test packaging.install must run first)")
  endif()
  file(REMOVE_RECURSE "${to}")
  file(COPY "${PREFIX}/" DESTINATION "${to}")
endfunction()

# packaging_expect_match(<what> <text> <regex>...): each regex must match the text.
function(packaging_expect_match what text)
  foreach(regex IN LISTS ARGN)
    if(NOT text MATCHES "${regex}")
      packaging_fail("${what}: expected to match \"${regex}\", got:\n${text}")
    endif()
  endforeach()
endfunction()

# packaging_executable(<var> <dir> <name>): the path of a built program in <dir> (or <dir>/<config>/).
function(packaging_executable var dir name)
  file(GLOB candidates "${dir}/${name}" "${dir}/*/${name}")
  list(LENGTH candidates n)
  if(NOT n EQUAL 1)
    packaging_fail("expected one program named ${name} under ${dir}, found ${n}: ${candidates}")
  endif()
  set(${var} "${candidates}" PARENT_SCOPE)
endfunction()

# packaging_run_consumer(<what> <program>): run a consumer program; it must exit 0 and say it is ok.
function(packaging_run_consumer what program)
  packaging_run("${what}" SHOW_OUTPUT OUTPUT_VARIABLE out COMMAND "${program}")
  packaging_expect_match("${what}" "${out}" "gpukit ${VERSION}, " "consumer: ok")
endfunction()

# packaging_expect_only_own_tests(<build dir> <count>): ctest -N in the consumer lists only the consumer's tests.
function(packaging_expect_only_own_tests build count)
  packaging_run("ctest -N in the consumer's build lists only its own ${count} test(s)" OUTPUT_VARIABLE out
    WORKING_DIRECTORY "${build}" COMMAND "${CTEST_COMMAND}" -N)
  if(NOT out MATCHES "Total Tests: ${count}\n")
    packaging_fail("ctest -N in ${build} should list ${count} test(s) (the consumer's own), it lists:\n${out}")
  endif()
endfunction()

# packaging_expect_no_development_targets(<build dir> <gpukit's binary dir>): gpukit added no tests, examples or
# benchmarks to the parent: none of their directories exists and none of their programs was built.
function(packaging_expect_no_development_targets build gpukit_binary_dir)
  if(NOT EXISTS "${gpukit_binary_dir}/CMakeFiles")
    packaging_fail("gpukit's binary directory is not where expected: ${gpukit_binary_dir}")
  endif()
  foreach(sub tests examples bench)
    if(EXISTS "${gpukit_binary_dir}/${sub}")
      packaging_fail("gpukit's ${sub}/ was added to the parent project: ${gpukit_binary_dir}/${sub} exists")
    endif()
  endforeach()
  file(GLOB_RECURSE built "${build}/*device_query*" "${build}/*test_error*" "${build}/*bench_*"
       "${build}/*gpukit_fake_nvml*" "${build}/*gpukit_doctest_main*")
  if(built)
    packaging_fail("gpukit's own programs were built in the parent project:\n${built}")
  endif()
  message(STATUS "gpukit added no tests, examples or benchmarks to the parent")
endfunction()

# packaging_compile_with_pkg_config(<what> <pkg-config> <program>): compiles and links consumer_main.cpp with the
# flags of `pkg-config --cflags --libs gpukit` alone (the caller sets PKG_CONFIG_PATH; the compiler's search paths
# from the environment are unset). The flags themselves must lead to CUDA, since a machine may also have CUDA's
# headers or libraries on default paths, which would hide a missing flag: one -I directory holds
# cuda_runtime_api.h, one -L directory holds libcudart (it becomes the program's rpath), and -lcudart is there.
function(packaging_compile_with_pkg_config what pkg_config program)
  packaging_run("pkg-config --cflags --libs gpukit (${what})" SHOW_OUTPUT OUTPUT_VARIABLE flags
    COMMAND "${pkg_config}" --cflags --libs gpukit)
  separate_arguments(flags UNIX_COMMAND "${flags}")
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
    packaging_fail("${what}: pkg-config's flags must name CUDA's include directory (-I, with cuda_runtime_api.h: "
                   "\"${found_header}\"), its library directory (-L, with libcudart: \"${found_library}\") and -lcudart")
  endif()
  foreach(var CPATH C_INCLUDE_PATH CPLUS_INCLUDE_PATH LIBRARY_PATH)
    unset(ENV{${var}})
  endforeach()
  packaging_run("compile and link (${what}): ${CXX_COMPILER} -std=c++17 consumer_main.cpp $(pkg-config --cflags --libs gpukit)"
    COMMAND "${CXX_COMPILER}" -std=c++17 "-DGPUKIT_EXPECTED_VERSION=\"${VERSION}\"" "${PACKAGING_DIR}/consumer_main.cpp"
            ${flags} "-Wl,-rpath,${found_library}" -o "${program}")
endfunction()
