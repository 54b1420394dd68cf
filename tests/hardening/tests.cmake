# Hardening tests (issue 12): fault injection, the misuse catalogue and bounded stress scenarios for
# ThreadSanitizer. Included by tests/CMakeLists.txt; the fuzz targets live in tests/fuzz.
set(gpukit_hardening_tests "${CMAKE_CURRENT_LIST_DIR}")
foreach(entry
    "test_fault_pinned_pool;pinned_pool_faults_test.cpp;CPU"
    "test_fault_allocator;allocator_faults_test.cpp;CPU"
    "test_fault_cuda;cuda_faults_test.cpp;GPU"
    "test_fault_heap;heap_faults_test.cpp;CPU"
    "test_misuse;misuse_test.cpp;CPU"
    "test_stress;stress_test.cpp;CPU")
  list(GET entry 0 name)
  list(GET entry 1 source)
  list(GET entry 2 kind)
  if(EXISTS "${gpukit_hardening_tests}/${source}")
    if(kind STREQUAL "GPU")
      gpukit_add_test(${name} SOURCES "${gpukit_hardening_tests}/${source}" GPU LABELS hardening)
    else()
      gpukit_add_test(${name} SOURCES "${gpukit_hardening_tests}/${source}" LABELS hardening)
    endif()
  endif()
endforeach()
