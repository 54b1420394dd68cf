# Benchmarks of the caching device allocator (included by bench/CMakeLists.txt).
gpukit_add_benchmark(bench_fragmentation "${CMAKE_CURRENT_LIST_DIR}/bench_fragmentation.cpp")
gpukit_add_benchmark(bench_allocator "${CMAKE_CURRENT_LIST_DIR}/bench_allocator.cpp")
# cub::CachingDeviceAllocator for the GPU comparison (the toolkit's CCCL, found by gpukitDevelopment.cmake).
if(TARGET CCCL::CCCL)
  target_link_libraries(bench_allocator PRIVATE CCCL::CCCL)
  target_compile_definitions(bench_allocator PRIVATE GPUKIT_BENCH_HAVE_CUB=1)
endif()
gpukit_add_benchmark(bench_trace_replay "${CMAKE_CURRENT_LIST_DIR}/bench_trace_replay.cpp")
