// One-definition rule: two translation units include all of gpukit and link into one program. Every function is
// inline or a template, so the link succeeds and both units see the same entities.
#include <gpukit/gpukit.hpp>

#include <doctest/doctest.h>

// Defined in odr_second_tu.cpp.
std::string odr_second_tu_device_text();
const void* odr_second_tu_warning_state();
const void* odr_second_tu_environment_snapshot();

TEST_CASE("two translation units that include gpukit.hpp link and share one state") {
  CHECK(odr_second_tu_device_text() == gpukit::device::cuda(1).to_string());
  // Function-local statics of inline functions are one object across translation units.
  CHECK(odr_second_tu_warning_state() == static_cast<const void*>(&gpukit::detail::warnings()));
  CHECK(odr_second_tu_environment_snapshot() == static_cast<const void*>(&gpukit::detail::cuda_environment_at_init()));
}
