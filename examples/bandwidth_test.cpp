// bandwidth_test: host-to-device and device-to-host GB/s, 64 KiB to 1 GiB, for
//   raw cudaMemcpyAsync from/to pinned memory, gpukit from/to pinned memory (one DMA),
//   raw cudaMemcpyAsync from/to pageable memory (the driver stages it), gpukit from/to pageable memory (staged),
// in one run, as a table with ratios against raw pinned. Targets: gpukit pinned ≥ 95% of raw pinned; gpukit
// pageable ≥ 85% of raw pinned.
//
// Without a usable CUDA device it says so and measures the staging pipeline's CPU-side ceiling on the CPU device
// instead (a few seconds), then exits 0.
//
//   bandwidth_test              # every size from 64 KiB to 1 GiB (CPU mode: to 64 MiB)
//   bandwidth_test --max 64M    # stop at 64 MiB
#include <gpukit/gpukit.hpp>
#include <gpukit/transfer/staging_impl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t GiB = 1024 * MiB;

using clock_type = std::chrono::steady_clock;

/// GB/s of `transfer` (which must leave the work finished), repeated until ~`budget` has passed (at least twice)
/// after one warm-up run; the best of three groups, to ride out noise.
double measure(std::size_t bytes, const std::function<void()>& transfer, std::chrono::milliseconds budget) {
  transfer();  // warm-up: ring slots, pool blocks, page faults
  double best = 0;
  for (int group = 0; group < 3; ++group) {
    int reps = 0;
    const auto start = clock_type::now();
    auto now = start;
    do {
      transfer();
      ++reps;
      now = clock_type::now();
    } while (reps < 2 || now - start < budget / 3);
    const double seconds = std::chrono::duration<double>(now - start).count();
    best = std::max(best, static_cast<double>(bytes) * reps / seconds / 1e9);
  }
  return best;
}

std::vector<std::size_t> sizes_up_to(std::size_t max) {
  std::vector<std::size_t> sizes;
  for (std::size_t s = 64 * KiB; s <= max; s *= 4) sizes.push_back(s);
  if (sizes.empty() || sizes.back() != max) sizes.push_back(max);
  return sizes;
}

std::size_t parse_size(const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  std::size_t unit = 1;
  if (end != nullptr && (*end == 'k' || *end == 'K')) unit = KiB;
  if (end != nullptr && (*end == 'm' || *end == 'M')) unit = MiB;
  if (end != nullptr && (*end == 'g' || *end == 'G')) unit = GiB;
  return static_cast<std::size_t>(value * static_cast<double>(unit));
}

void gpu_mode(std::size_t max) {
  const gpukit::device d = gpukit::device::cuda(0);
  const auto& p = gpukit::properties(d);
  std::printf("%s: %s, %d copy engines. Wall-clock GB/s (1 GB = 1e9 bytes), best of 3; %% of raw pinned.\n",
              d.to_string().c_str(), p.name.c_str(), p.copy_engine_count);
  gpukit::stream s(d);
  const cudaStream_t h = s.cuda_handle();
  gpukit::device_buffer<char> dev(max, s);
  gpukit::pinned_buffer<char> pinned(max, d);
  std::vector<char> pageable(max, 1);
  std::memset(pinned.data(), 1, max);
  bool pinned_ok = true;
  bool pageable_ok = true;
  for (const bool h2d : {true, false}) {
    std::printf("\n%s\n%10s %11s %20s %20s %20s\n", h2d ? "host to device" : "device to host", "size", "raw pinned",
                "gpukit pinned", "raw pageable", "gpukit pageable");
    for (std::size_t bytes : sizes_up_to(max)) {
      gpukit::device_span<char> dspan(dev.data(), bytes, d);
      auto run = [&](auto&& enqueue) {
        return [&, enqueue] {
          enqueue();
          s.synchronize();
        };
      };
      auto check = [](cudaError_t e) { GPUKIT_CUDA_TRY(e); };
      const auto budget = std::chrono::milliseconds(bytes >= 256 * MiB ? 1500 : 300);
      const double raw_pinned =
          measure(bytes, run([&] {
                    check(h2d ? cudaMemcpyAsync(dev.data(), pinned.data(), bytes, cudaMemcpyHostToDevice, h)
                              : cudaMemcpyAsync(pinned.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, h));
                  }),
                  budget);
      const double kit_pinned = measure(bytes, run([&] {
                                          gpukit::pinned_span<char> ps(pinned.data(), bytes);
                                          if (h2d) {
                                            gpukit::copy_async(dspan, ps, s);
                                          } else {
                                            gpukit::copy_async(ps, dspan, s);
                                          }
                                        }),
                                        budget);
      const double raw_pageable =
          measure(bytes, run([&] {
                    check(h2d ? cudaMemcpyAsync(dev.data(), pageable.data(), bytes, cudaMemcpyHostToDevice, h)
                              : cudaMemcpyAsync(pageable.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, h));
                  }),
                  budget);
      const double kit_pageable = measure(bytes, run([&] {
                                            gpukit::host_span<char> hs(pageable.data(), bytes);
                                            if (h2d) {
                                              gpukit::copy_async(dspan, hs, s);
                                            } else {
                                              gpukit::copy_async(hs, dspan, s);
                                            }
                                          }),
                                          budget);
      std::printf("%10s %11.2f %12.2f (%4.0f%%) %12.2f (%4.0f%%) %12.2f (%4.0f%%)\n",
                  gpukit::detail::format_bytes(bytes).c_str(), raw_pinned, kit_pinned, 100 * kit_pinned / raw_pinned,
                  raw_pageable, 100 * raw_pageable / raw_pinned, kit_pageable, 100 * kit_pageable / raw_pinned);
      if (bytes >= 64 * MiB) {  // targets apply where the copy is bandwidth-bound
        pinned_ok = pinned_ok && kit_pinned >= 0.95 * raw_pinned;
        pageable_ok = pageable_ok && kit_pageable >= 0.85 * raw_pinned;
      }
    }
  }
  std::printf(
      "\nTargets from 64 MiB up: gpukit pinned >= 95%% of raw pinned: %s; gpukit pageable >= 85%% of raw "
      "pinned: %s.\n",
      pinned_ok ? "met" : "NOT met", pageable_ok ? "met" : "NOT met");
}

/// The device copy step of an infinitely fast device: measures only the host side of staging.
struct null_copier {
  void operator()(void*, const void*, std::size_t, gpukit::copy_direction, gpukit::stream_view) const {}
};

void cpu_mode(std::size_t max) {
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::stream s(cpu);
  gpukit::device_buffer<char> dev(max, s);  // the CPU device's memory is host memory
  std::vector<char> pageable(max, 1);
  std::vector<char> other(max, 2);
  gpukit::pinned_pool pool{gpukit::pinned_upstream(gpukit::device::kind::cpu)};
  gpukit::staging_options one;
  one.threads = 1;
  gpukit::staging_options two;
  two.threads = 2;
  gpukit::basic_staging_engine<null_copier> ring1(pool, one);
  gpukit::basic_staging_engine<null_copier> ring2(pool, two);
  const auto sync = gpukit::stream_view::default_stream(cpu);  // events complete at once: a free-running ring
  std::printf(
      "GB/s (1 GB = 1e9 bytes), best of 3. memcpy: one thread, pageable to pageable. into ring: pageable\n"
      "data copied into the pinned staging slots with a device copy that costs nothing (the host-side\n"
      "ceiling; on a GPU a transfer runs at the lower of this and PCIe). CPU device: copy_async from pageable\n"
      "memory to a CPU device_buffer on a CPU stream, end to end (the ring, then a memcpy on the stream\n"
      "standing in for the DMA).\n\n");
  std::printf("%10s %8s %18s %18s %18s\n", "size", "memcpy", "into ring 1 thr", "into ring 2 thr", "CPU device");
  for (std::size_t bytes : sizes_up_to(max)) {
    const auto budget = std::chrono::milliseconds(50);
    const double base = measure(
        bytes, [&] { std::memcpy(other.data(), pageable.data(), bytes); }, budget);
    const double r1 = measure(
        bytes, [&] { ring1.to_device(dev.data(), pageable.data(), bytes, sync); }, budget);
    const double r2 = measure(
        bytes, [&] { ring2.to_device(dev.data(), pageable.data(), bytes, sync); }, budget);
    const double end_to_end = measure(
        bytes,
        [&] {
          gpukit::copy_async(gpukit::device_span<char>(dev.data(), bytes, cpu),
                             gpukit::host_span<const char>(pageable.data(), bytes), s);
          s.synchronize();
        },
        budget);
    std::printf("%10s %8.2f %10.2f (%4.0f%%) %10.2f (%4.0f%%) %10.2f (%4.0f%%)\n",
                gpukit::detail::format_bytes(bytes).c_str(), base, r1, 100 * r1 / base, r2, 100 * r2 / base, end_to_end,
                100 * end_to_end / base);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t max = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--max") == 0 && i + 1 < argc) {
      max = parse_size(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--max SIZE]   (SIZE like 64M or 1G)\n", argv[0]);
      return 2;
    }
  }
  try {
    if (gpukit::device_count() > 0) {
      gpu_mode(max != 0 ? max : GiB);
    } else {
      int count = 0;
      const cudaError_t result = cudaGetDeviceCount(&count);
      (void)cudaGetLastError();
      std::printf(
          "No CUDA device is usable here (cudaGetDeviceCount: %s), so there is no PCIe to measure;\n"
          "instead, this reports how fast the staging pipeline moves pageable data on the CPU side, on the\n"
          "CPU device.\n\n",
          cudaGetErrorName(result));
      cpu_mode(max != 0 ? max : 64 * MiB);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bandwidth_test: %s\n", e.what());
    return 1;
  }
  return 0;
}
