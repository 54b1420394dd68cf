# Benchmarks of pinned memory and transfers (included by bench/CMakeLists.txt). GPU benchmarks are compiled always
# and registered only when a CUDA device is usable; each executable prints its ratios against baselines measured in
# the same run.
gpukit_add_benchmark(bench_transfer "${CMAKE_CURRENT_SOURCE_DIR}/bench_transfer.cpp")
gpukit_add_benchmark(bench_pinned_pool "${CMAKE_CURRENT_SOURCE_DIR}/bench_pinned_pool.cpp")
