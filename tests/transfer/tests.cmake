# Tests of pinned memory and transfers (included by tests/CMakeLists.txt). Paths are relative to tests/.
gpukit_add_test(test_pinned_memory SOURCES transfer/pinned_memory_test.cpp)
gpukit_add_test(test_pinned_pool SOURCES transfer/pinned_pool_test.cpp)
gpukit_add_test(test_staging SOURCES transfer/staging_test.cpp)
gpukit_add_test(test_copy SOURCES transfer/copy_test.cpp)
gpukit_add_test(test_gpu_transfer SOURCES transfer/gpu_transfer_test.cpp GPU)
gpukit_add_test(test_prefetcher SOURCES transfer/prefetcher_test.cpp)
