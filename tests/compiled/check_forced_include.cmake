# cmake -DCXX=<compiler> -DSOURCE_DIR=<gpukit> -DCUDA_INCLUDE=<dir> -P check_forced_include.cmake
# Preprocesses the library's legacy half (src/gpukit_compiled.cpp) with CUDA_API_PER_THREAD_DEFAULT_STREAM defined:
# alone it must come out in the legacy mode (gpukit::abi_v1, with the shared state's definitions); with
# cuda_runtime_api.h force-included first it must stop with gpukit's #error, not build a second per-thread half.
cmake_minimum_required(VERSION 3.18)
set(base "${CXX}" -std=c++17 -E -dM "-I${SOURCE_DIR}/include" -isystem "${CUDA_INCLUDE}"
         -DCUDA_API_PER_THREAD_DEFAULT_STREAM)
execute_process(COMMAND ${base} "${SOURCE_DIR}/src/gpukit_compiled.cpp" OUTPUT_VARIABLE macros
                ERROR_VARIABLE errors RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "preprocessing gpukit_compiled.cpp with the per-thread macro failed (${rc}):\n${errors}")
endif()
foreach(expected "#define GPUKIT_ABI_NAMESPACE abi_v1\n" "#define GPUKIT_DETAIL_MODE_INDEPENDENT_DEFINITIONS 1\n")
  string(FIND "${macros}" "${expected}" at)
  if(at EQUAL -1)
    string(STRIP "${expected}" expected)
    message(FATAL_ERROR "gpukit_compiled.cpp with the per-thread macro defined: expected `${expected}`")
  endif()
endforeach()
message(STATUS "legacy half, per-thread macro defined: gpukit::abi_v1 with the shared state")
execute_process(COMMAND ${base} -include cuda_runtime_api.h "${SOURCE_DIR}/src/gpukit_compiled.cpp"
                OUTPUT_QUIET ERROR_VARIABLE errors RESULT_VARIABLE rc)
if(rc EQUAL 0 OR NOT errors MATCHES "wrong default-stream mode")
  message(FATAL_ERROR "gpukit_compiled.cpp after a per-thread cuda_runtime_api.h: expected gpukit's #error, got "
                      "exit ${rc}:\n${errors}")
endif()
message(STATUS "legacy half after a forced per-thread include: refused")
