// A stand-in for libnvidia-ml.so.1 with two GPUs (and a MIG instance of the first), so gpukit's NVML loader and its
// UUID / PCI-bus-id mapping are tested on machines without a driver. Only the entry points gpukit declares are
// provided.
#include <gpukit/device/nvml.hpp>  // for gpukit::nvml::gpu_memory: signatures must match gpukit's declarations

#include <cstring>

namespace {
struct fake_gpu {
  const char* uuid;
  const char* pci_bus_id;  // NVML's form: 8-digit domain
  unsigned long long total, free, used;
  int utilization;  // -1: not supported (as on MIG)
};
fake_gpu gpus[2] = {
    {"GPU-11111111-2222-3333-4444-555555555555", "00000000:1A:00.0", 80ull << 30, 60ull << 30, 20ull << 30, 35},
    {"GPU-99999999-8888-7777-6666-555555555555", "00000000:3B:00.0", 40ull << 30, 1ull << 30, 39ull << 30, -1},
};
// A MIG instance of the first GPU: NVML finds it only by its MIG UUID (not counted, not found by PCI bus id, which
// names the parent GPU); CUDA reports the same 16 bytes as the device's UUID.
fake_gpu migs[1] = {
    {"MIG-abcdef01-2345-5678-9abc-def012345678", "00000000:1A:00.0", 10ull << 30, 9ull << 30, 1ull << 30, -1},
};
int initialised = 0;

unsigned long long parse_hex(const char*& p) {
  unsigned long long v = 0;
  for (;; ++p) {
    const char c = *p;
    if (c >= '0' && c <= '9') v = v * 16 + static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f') v = v * 16 + static_cast<unsigned>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v = v * 16 + static_cast<unsigned>(c - 'A' + 10);
    else return v;
  }
}
// Compares bus ids numerically, as NVML does: "0000:1a:00.0" equals "00000000:1A:00.0".
bool same_bus(const char* a, const char* b) {
  for (int part = 0; part < 4; ++part) {
    if (parse_hex(a) != parse_hex(b)) return false;
    if (*a != *b) return false;
    if (*a == '\0') return true;
    ++a;
    ++b;
  }
  return true;
}
}  // namespace

extern "C" {
int nvmlInit_v2() {
  initialised = 1;
  return 0;
}
int nvmlShutdown() {
  initialised = 0;
  return 0;
}
const char* nvmlErrorString(int) { return "fake error"; }
int nvmlDeviceGetCount_v2(unsigned* count) {
  *count = 2;
  return initialised ? 0 : 1;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** device) {
  if (index >= 2) return 2;
  *device = &gpus[index];
  return 0;
}
int nvmlDeviceGetHandleByUUID(const char* uuid, void** device) {
  for (auto& g : gpus) {
    if (std::strcmp(g.uuid, uuid) == 0) {
      *device = &g;
      return 0;
    }
  }
  for (auto& m : migs) {
    if (std::strcmp(m.uuid, uuid) == 0) {
      *device = &m;
      return 0;
    }
  }
  return 6;  // NVML_ERROR_NOT_FOUND
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  for (auto& g : gpus) {
    if (same_bus(g.pci_bus_id, bus_id)) {
      *device = &g;
      return 0;
    }
  }
  return 6;
}
int nvmlDeviceGetUUID(void* device, char* text, unsigned length) {
  std::strncpy(text, static_cast<fake_gpu*>(device)->uuid, length);
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* device, gpukit::nvml::gpu_memory* memory) {
  const auto* g = static_cast<fake_gpu*>(device);
  memory->total = g->total;
  memory->free = g->free;
  memory->used = g->used;
  return 0;
}
int nvmlDeviceGetUtilizationRates(void* device, void* rates) {
  const auto* g = static_cast<fake_gpu*>(device);
  if (g->utilization < 0) return 3;  // NVML_ERROR_NOT_SUPPORTED
  unsigned* gpu_and_memory = static_cast<unsigned*>(rates);
  gpu_and_memory[0] = static_cast<unsigned>(g->utilization);
  gpu_and_memory[1] = 5;
  return 0;
}
}
