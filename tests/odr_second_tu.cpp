// The second translation unit of the ODR test (see odr_test.cpp).
#include <gpukit/gpukit.hpp>

std::string odr_second_tu_device_text() { return gpukit::device::parse("cuda:1").to_string(); }
const void* odr_second_tu_warning_state() { return &gpukit::detail::warnings(); }
const void* odr_second_tu_environment_snapshot() { return &gpukit::detail::cuda_environment_at_init(); }
