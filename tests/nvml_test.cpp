// The optional NVML loader, against a fake libnvidia-ml (tests/fake_nvml.cpp) and against missing libraries.
#include <gpukit/device/nvml.hpp>

#include "fake_nvml_control.hpp"
#include "support.hpp"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace {
gpukit::device_properties described(const char* uuid, const char* pci_bus_id) {
  gpukit::device_properties p;
  p.uuid = uuid;
  p.pci_bus_id = pci_bus_id;
  return p;
}
}  // namespace

namespace {
gpukit::device_properties gpu_at(const char* uuid, int bus) {
  gpukit::device_properties p = described(uuid, "");
  p.pci_bus = bus;
  return p;
}
void set_fake(unsigned gpu, const char* field, long long value) {
  gpukit_test::set_fake_nvml(GPUKIT_FAKE_NVML_PATH, gpu, field, value);
}
}  // namespace

TEST_CASE("NVML loads, lists the installed GPUs and maps devices by UUID") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  REQUIRE(nvml.available());
  CHECK(nvml.status().find("NVML loaded from") == 0);
  const auto installed = nvml.installed();
  REQUIRE(installed);
  CHECK(installed->count == 2);
  CHECK(installed->uuids == std::vector<std::string>{"GPU-11111111-2222-3333-4444-555555555555",
                                                     "GPU-99999999-8888-7777-6666-555555555555"});
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

TEST_CASE("a MIG instance NVML does not find by its MIG UUID is unknown, not its parent GPU found by PCI bus id") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  // An instance whose MIG UUID lookup fails (a driver that does not take MIG- UUIDs): only its parent's bus id is
  // left, and the parent's 60 GiB free are not the instance's.
  const auto instance = described("GPU-0badc0de-2345-5678-9abc-def012345678", "0000:1a:00.0");
  set_fake(0, "mig_mode", 1);
  CHECK_FALSE(nvml.memory(instance).has_value());
  CHECK_FALSE(nvml.utilization_percent(instance).has_value());
  CHECK_FALSE(nvml.knows(instance));
  CHECK(nvml.memory(described("GPU-abcdef01-2345-5678-9abc-def012345678", "0000:1a:00.0")));  // by MIG UUID still
  set_fake(0, "mig_mode", -1);  // a GPU without MIG (NVML_ERROR_NOT_SUPPORTED): the bus id names the device
  REQUIRE(nvml.memory(instance));
  CHECK(nvml.memory(instance)->free == (60ull << 30));
  set_fake(0, "mig_mode", 0);  // MIG disabled: the same
  CHECK(nvml.knows(instance));
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

namespace {
bool instance_used = false;
int inits_with_instance = 0;  // the fake's open nvmlInit_v2 calls once the instance was made
// Registered before main, so before the instance exists: exit runs it after the instance's destruction, were the
// instance destroyed. A monitor thread still sampling then would call into an unloaded library.
const int instance_check_at_exit = std::atexit([] {
  if (!instance_used) return;
  void* fake = dlopen(GPUKIT_FAKE_NVML_PATH, RTLD_LAZY | RTLD_NOLOAD);
  auto* initialised = fake == nullptr ? nullptr : reinterpret_cast<int (*)()>(dlsym(fake, "fake_nvml_initialised"));
  if (initialised == nullptr || initialised() < inits_with_instance) {
    std::fputs("nvml::instance() was shut down at exit, before threads that may still use it\n", stderr);
    std::_Exit(1);
  }
});
}  // namespace

TEST_CASE("the process-wide instance honours GPUKIT_NVML_LIBRARY and stays loaded until the process ends") {
  // The instance is created on first use; this test is the first user in this executable.
  gpukit_test::scoped_env path("GPUKIT_NVML_LIBRARY", std::string(GPUKIT_FAKE_NVML_PATH));
  CHECK(gpukit::nvml::instance().available());
  CHECK(&gpukit::nvml::instance() == &gpukit::nvml::instance());
  CHECK(instance_check_at_exit == 0);
  void* fake = dlopen(GPUKIT_FAKE_NVML_PATH, RTLD_LAZY | RTLD_NOLOAD);
  REQUIRE(fake != nullptr);
  auto* initialised = reinterpret_cast<int (*)()>(dlsym(fake, "fake_nvml_initialised"));
  const bool found = initialised != nullptr;
  REQUIRE(found);
  inits_with_instance = initialised();  // at exit: not fewer (the instance's init not shut down)
  instance_used = true;
}

TEST_CASE("a sample has every figure the fake NVML reports, this process's memory found past the first guess") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const auto sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(sample);
  REQUIRE(sample->memory);
  CHECK(sample->memory->used == (20ull << 30) - (512ull << 20));  // the v2 query: without the driver's reserve
  CHECK(sample->memory->free == (60ull << 30));
  CHECK(sample->memory->total == (80ull << 30));
  set_fake(0, "memory_v2", 0);  // a driver whose v2 query refuses (NVML_ERROR_NOT_SUPPORTED): the v1 figures
  const auto v1 = nvml.memory(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(v1);
  CHECK(v1->used == (20ull << 30));
  CHECK(v1->free == (60ull << 30));
  CHECK(sample->gpu_utilization_percent == 35u);
  CHECK(sample->memory_utilization_percent == 5u);
  CHECK(sample->temperature_c == 41u);
  REQUIRE(sample->power_w);
  CHECK(*sample->power_w == doctest::Approx(123.456));
  CHECK(sample->power_limit_w == 700.0);
  CHECK(sample->sm_clock_mhz == 1980u);
  CHECK(sample->memory_clock_mhz == 2619u);
  CHECK(sample->clock_limits == gpukit::nvml::clock_limit::idle);  // through the pre-12.2 entry point's name
  CHECK(sample->pcie_tx_kib_per_s == 2048u);
  CHECK(sample->pcie_rx_kib_per_s == 1024u);
  CHECK(sample->process_memory == (3ull << 30));  // the 11th of 11 processes: gpukit had to ask twice
}

TEST_CASE("without PCIe counters the sample leaves them unknown") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const auto sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""), /*read_pcie=*/false);
  REQUIRE(sample);
  CHECK_FALSE(sample->pcie_tx_kib_per_s.has_value());
  CHECK_FALSE(sample->pcie_rx_kib_per_s.has_value());
  CHECK(sample->temperature_c.has_value());
}

TEST_CASE("unsupported or unavailable figures are unknown, not zero") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  set_fake(0, "self_bytes", -1);  // this process is not in NVML's list (a container's PID namespace)
  set_fake(0, "temperature_c", -1);
  auto sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(sample);
  CHECK_FALSE(sample->process_memory.has_value());
  CHECK_FALSE(sample->temperature_c.has_value());
  set_fake(0, "self_bytes", -2);  // listed, but NVML_VALUE_NOT_AVAILABLE
  set_fake(0, "other_processes", 0);
  sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(sample);
  CHECK_FALSE(sample->process_memory.has_value());
  // Utilisation is not supported on the second GPU: both utilisation figures stay unknown.
  sample = nvml.sample(described("GPU-99999999-8888-7777-6666-555555555555", ""));
  REQUIRE(sample);
  CHECK_FALSE(sample->gpu_utilization_percent.has_value());
  CHECK_FALSE(sample->memory_utilization_percent.has_value());
  CHECK(sample->memory.has_value());
  CHECK_FALSE(nvml.sample(described("GPU-unknown", "0000:99:00.0")).has_value());
}

TEST_CASE("an NVML without the optional entry points still loads, and samples what it has") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_MINIMAL_PATH);
  REQUIRE(nvml.available());
  const auto sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(sample);
  REQUIRE(sample->memory.has_value());
  CHECK(sample->memory->used == (20ull << 30));  // the v1 query of a driver without v2: the reserve counted in
  CHECK(sample->gpu_utilization_percent == 35u);
  CHECK_FALSE(sample->temperature_c.has_value());
  CHECK_FALSE(sample->power_w.has_value());
  CHECK_FALSE(sample->sm_clock_mhz.has_value());
  CHECK_FALSE(sample->clock_limits.has_value());
  CHECK_FALSE(sample->pcie_rx_kib_per_s.has_value());
  CHECK_FALSE(sample->process_memory.has_value());
}

TEST_CASE("clock limit masks read as words") {
  using namespace gpukit::nvml;
  CHECK(describe_clock_limits(0) == "none");
  CHECK(describe_clock_limits(clock_limit::idle) == "idle");
  CHECK(describe_clock_limits(clock_limit::software_power_cap | clock_limit::hardware_thermal) ==
        "power cap, hw thermal");
  CHECK(describe_clock_limits(0x8000 | clock_limit::sync_boost) == "sync boost, other");
}

TEST_CASE("links between GPUs read as nvidia-smi topo -m prints them") {
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const auto first = gpu_at("GPU-11111111-2222-3333-4444-555555555555", 0x1a);
  const auto second = gpu_at("GPU-99999999-8888-7777-6666-555555555555", 0x3b);
  CHECK(nvml.link(first, first) == std::string("X"));
  CHECK(nvml.link(first, second) == std::string("NV2"));  // 2 of its 4 active links end at the other GPU
  set_fake(0, "nvlinks_to_peer", 0);                      // all through an NVSwitch: every active link counts
  CHECK(nvml.link(first, second) == std::string("NV4"));
  set_fake(0, "nvlinks_active", 0);  // no NVLink: the closest common PCIe ancestor names the path
  for (const auto& [level, name] : std::vector<std::pair<int, std::string>>{
           {0, "PIX"}, {10, "PIX"}, {20, "PXB"}, {30, "PHB"}, {40, "NODE"}, {50, "SYS"}}) {
    set_fake(0, "common_ancestor", level);
    CHECK(nvml.link(first, second) == name);
  }
  set_fake(0, "common_ancestor", 35);  // a level NVML does not define
  CHECK_FALSE(nvml.link(first, second).has_value());
  CHECK_FALSE(nvml.link(first, gpu_at("GPU-unknown", 0x99)).has_value());
  const gpukit::nvml::library minimal(GPUKIT_FAKE_NVML_MINIMAL_PATH);
  CHECK_FALSE(minimal.link(first, second).has_value());
  CHECK(minimal.link(first, first) == std::string("X"));
}

TEST_CASE("drivers whose _v3 process list writes 32-byte entries are read through _v2, and right") {
  // Drivers 535.43 to 535.86 export a _v3 that writes an extra field per process; gpukit reads _v2 first.
  gpukit_test::scoped_env driver("FAKE_NVML_DRIVER", std::string("535"));
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  const auto sample = nvml.sample(described("GPU-11111111-2222-3333-4444-555555555555", ""));
  REQUIRE(sample);
  CHECK(sample->process_memory == (3ull << 30));  // the 11th entry: misread if 32-byte entries were read at 24
}
