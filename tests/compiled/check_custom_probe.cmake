# cmake -DNM=<nm> -DOBJECT=<object> [-DOWN=ON] -P check_custom_probe.cmake
# Fails unless the compiled-mode object defines none of the default engine's functions
# (basic_caching_allocator<device_upstream>) but calls them, and, with OWN, defines those of its own engine
# (basic_caching_allocator<host_upstream>, from caching_allocator_impl.hpp, whose extern template declarations
# leave the default engine to gpukit::compiled).
cmake_minimum_required(VERSION 3.18)
include("${CMAKE_CURRENT_LIST_DIR}/nm_lines.cmake")
nm_lines("${OBJECT}" lines)
set(own 0)
set(library 0)
set(library_called 0)
foreach(line IN LISTS lines)
  if(line MATCHES "^[0-9a-f]+ [TWtw] gpukit::[a-z0-9_]+::basic_caching_allocator<gpukit::[a-z0-9_]+::host_upstream")
    math(EXPR own "${own} + 1")
  elseif(line MATCHES "^[0-9a-f]+ [TWtw] gpukit::[a-z0-9_]+::basic_caching_allocator<gpukit::[a-z0-9_]+::device_upstream")
    math(EXPR library "${library} + 1")
    message(STATUS "  defined: ${line}")
  elseif(line MATCHES "^ +U gpukit::[a-z0-9_]+::basic_caching_allocator<gpukit::[a-z0-9_]+::device_upstream")
    math(EXPR library_called "${library_called} + 1")
  endif()
endforeach()
message(STATUS "own engine: ${own} functions defined; default engine: ${library} defined, ${library_called} called")
if((OWN AND own EQUAL 0) OR NOT library EQUAL 0 OR library_called EQUAL 0)
  message(FATAL_ERROR "expected the default engine's functions only called (${library} defined, ${library_called} "
                      "called) and, with OWN, the own engine's defined (${own})")
endif()
