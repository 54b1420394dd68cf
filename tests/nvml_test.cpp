// The optional NVML loader, against a fake libnvidia-ml (tests/fake_nvml.cpp) and against missing libraries.
#include <gpukit/device/nvml.hpp>

#include "support.hpp"

namespace {
gpukit::device_properties described(const char* uuid, const char* pci_bus_id) {
  gpukit::device_properties p;
  p.uuid = uuid;
  p.pci_bus_id = pci_bus_id;
  return p;
}
}  // namespace

TEST_CASE("NVML loads, lists the installed GPUs and maps devices by UUID") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  REQUIRE(nvml.available());
  CHECK(nvml.status().find("NVML loaded from") == 0);
  const auto installed = nvml.installed();
  REQUIRE(installed);
  CHECK(installed->count == 2);
  CHECK(installed->uuids ==
        std::vector<std::string>{"GPU-11111111-2222-3333-4444-555555555555", "GPU-99999999-8888-7777-6666-555555555555"});
  const auto memory = nvml.memory(described("GPU-99999999-8888-7777-6666-555555555555", ""));
  REQUIRE(memory);
  CHECK(memory->total == (40ull << 30));
  CHECK(memory->free == (1ull << 30));
  CHECK(nvml.utilization_percent(described("GPU-11111111-2222-3333-4444-555555555555", "")) == 35u);
}

TEST_CASE("NVML falls back to the PCI bus id, compared numerically (CUDA writes 4 domain digits, NVML 8)") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const auto memory = nvml.memory(described("GPU-unknown", "0000:1a:00.0"));
  REQUIRE(memory);
  CHECK(memory->free == (60ull << 30));
  CHECK_FALSE(nvml.memory(described("GPU-unknown", "0000:99:00.0")).has_value());
}

TEST_CASE("a MIG instance is found by its MIG UUID, not as its parent GPU by PCI bus id") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  // What properties() says about a MIG instance: its UUID's bytes (formatted GPU-...) and its parent's PCI bus id.
  const auto memory = nvml.memory(described("GPU-abcdef01-2345-5678-9abc-def012345678", "0000:1a:00.0"));
  REQUIRE(memory);
  CHECK(memory->total == (10ull << 30));
  CHECK(memory->free == (9ull << 30));
  CHECK_FALSE(nvml.utilization_percent(described("GPU-abcdef01-2345-5678-9abc-def012345678", "0000:1a:00.0")));
  const auto by_mig = nvml.memory(described("MIG-abcdef01-2345-5678-9abc-def012345678", ""));
  REQUIRE(by_mig);
  CHECK(by_mig->total == (10ull << 30));
}

TEST_CASE("unsupported NVML queries are unknown, not errors") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  CHECK_FALSE(nvml.utilization_percent(described("GPU-99999999-8888-7777-6666-555555555555", "")).has_value());
}

TEST_CASE("a missing or foreign library leaves NVML unavailable, with the reason") {
  const gpukit::nvml::library missing("/nonexistent/libnvidia-ml.so.1");
  CHECK_FALSE(missing.available());
  CHECK(missing.status().find("NVML not loaded") == 0);
  CHECK_FALSE(missing.installed().has_value());
  CHECK_FALSE(missing.memory(described("GPU-11111111-2222-3333-4444-555555555555", "")).has_value());
  const gpukit::nvml::library foreign("libm.so.6");
  CHECK_FALSE(foreign.available());
  CHECK(foreign.status().find("lacks nvmlInit_v2") != std::string::npos);
}

TEST_CASE("the process-wide instance honours GPUKIT_NVML_LIBRARY") {
  // The instance is created on first use; this test is the first user in this executable.
  gpukit_test::scoped_env path("GPUKIT_NVML_LIBRARY", std::string(GPUKIT_FAKE_NVML_PATH));
  CHECK(gpukit::nvml::instance().available());
  CHECK(&gpukit::nvml::instance() == &gpukit::nvml::instance());
}
