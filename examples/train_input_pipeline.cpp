// train_input_pipeline: the input side of a training loop. Each batch is "decoded" by a producer (here: generated,
// then a sleep standing in for decoding or augmentation) and each training step runs on the consumer stream (a copy
// of two samples back, then a host function that checks them and sleeps, standing in for the kernels). The same loop
// runs three ways in one process:
//
//   serial       produce a batch, copy it, run the step, wait for it; then the next batch (the baseline)
//   prefetcher   gpukit::prefetcher with 1 producer thread: decoding overlaps the steps
//   prefetcher   with N producer threads: decoding runs N at a time, so the step time is all that remains
//
// and prints each time, the bound the overlap can reach (batches × the slower side), and the prefetcher's statistics:
// how long the training loop waited for data, how long the producers waited (for pinned memory, i.e. the device, or
// for a device buffer, i.e. the training loop), and the pinned memory it held. Without a GPU it runs on the CPU
// device with the same code.
//
//   train_input_pipeline [batches] [producer threads] [decode ms] [step ms]
#include <gpukit/gpukit.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace {

using clock_type = std::chrono::steady_clock;

struct workload {
  std::size_t batches = 48;
  std::size_t producer_threads = 3;
  std::chrono::microseconds decode{6000};
  std::chrono::microseconds step{2000};
  std::size_t samples = std::size_t{1} << 18;  // 1 MiB of uint32 per batch
};

/// Sample k of batch i: a value the step can check.
std::uint32_t sample(std::size_t batch, std::size_t k) { return static_cast<std::uint32_t>(batch * 2654435761u + k); }

/// Decodes batch `index` into `out`: writes the samples, then sleeps for the rest of the decode time.
std::size_t decode(const workload& w, std::size_t index, gpukit::span<std::uint32_t> out) {
  if (index == w.batches) return 0;
  const auto start = clock_type::now();
  for (std::size_t k = 0; k < out.size(); ++k) out[k] = sample(index, k);
  std::this_thread::sleep_until(start + w.decode);
  return out.size();
}

/// The training step on `s`: copies the batch's first and last samples into `probe` and checks them in a host
/// function that then sleeps for the step time (a real step would launch kernels on s.cuda_handle()).
void train_step(const workload& w, gpukit::device_span<std::uint32_t> data, std::size_t index,
                gpukit::pinned_buffer<std::uint32_t>& probe, gpukit::stream& s, std::atomic<std::size_t>& wrong) {
  std::uint32_t* p = probe.data() + 2 * index;
  gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(p, 1), data.first(1), s);
  gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(p + 1, 1), data.last(1), s);
  const std::size_t n = data.size();
  const auto step = w.step;
  s.enqueue_host([p, index, n, step, &wrong] {
    if (p[0] != sample(index, 0) || p[1] != sample(index, n - 1)) ++wrong;
    std::this_thread::sleep_for(step);
  });
}

double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

/// The baseline: no overlap at all.
double run_serial(const workload& w, gpukit::stream& s, gpukit::pinned_buffer<std::uint32_t>& probe,
                  std::atomic<std::size_t>& wrong) {
  gpukit::pinned_buffer<std::uint32_t> host(w.samples, s.device());
  gpukit::device_buffer<std::uint32_t> batch(w.samples, s);
  const auto start = clock_type::now();
  for (std::size_t i = 0; i < w.batches; ++i) {
    const std::size_t n = decode(w, i, host.span());
    gpukit::copy_async(gpukit::device_span<std::uint32_t>(batch.data(), n, s.device()),
                       gpukit::pinned_span<const std::uint32_t>(host.data(), n), s);
    train_step(w, gpukit::device_span<std::uint32_t>(batch.data(), n, s.device()), i, probe, s, wrong);
    s.synchronize();  // the host buffer is refilled next: wait for its copy (and, with it, the step)
  }
  return ms_since(start);
}

/// The same loop through a prefetcher with `options`; fills `stats`.
double run_prefetched(const workload& w, const gpukit::prefetch_options& options, gpukit::stream& s,
                      gpukit::pinned_buffer<std::uint32_t>& probe, std::atomic<std::size_t>& wrong,
                      gpukit::prefetch_stats& stats, std::size_t& seen) {
  const auto start = clock_type::now();
  gpukit::prefetcher<std::uint32_t> loader(
      s, w.samples, [&w](std::size_t index, gpukit::span<std::uint32_t> out) { return decode(w, index, out); },
      options);
  seen = 0;
  while (auto batch = loader.next()) {
    train_step(w, batch->data(), batch->index(), probe, s, wrong);
    ++seen;
  }  // each batch is released at the end of its iteration: its device buffer is refilled after the step
  s.synchronize();
  const double elapsed = ms_since(start);
  stats = loader.stats();
  return elapsed;
}

}  // namespace

int main(int argc, char** argv) {
  workload w;
  if (argc > 1) w.batches = std::strtoul(argv[1], nullptr, 10);
  if (argc > 2) w.producer_threads = std::max<std::size_t>(1, std::strtoul(argv[2], nullptr, 10));
  if (argc > 3) w.decode = std::chrono::microseconds(std::strtoul(argv[3], nullptr, 10) * 1000);
  if (argc > 4) w.step = std::chrono::microseconds(std::strtoul(argv[4], nullptr, 10) * 1000);
  try {
    const gpukit::device_selection selection = gpukit::select_device();
    std::printf("device: %s (%s)\n", selection.device.to_string().c_str(), selection.reason.c_str());
    gpukit::stream s(selection.device);
    gpukit::pinned_buffer<std::uint32_t> probe(2 * w.batches, selection.device);
    std::atomic<std::size_t> wrong{0};
    const double decode_ms = std::chrono::duration<double, std::milli>(w.decode).count();
    const double step_ms = std::chrono::duration<double, std::milli>(w.step).count();
    const double n = static_cast<double>(w.batches);
    std::printf("%zu batches of %zu samples; decode %.1f ms, step %.1f ms per batch\n\n", w.batches, w.samples,
                decode_ms, step_ms);

    const double serial = run_serial(w, s, probe, wrong);
    std::printf("%-34s %8.1f ms  (decode + step: %.0f ms)\n", "serial, no prefetcher", serial,
                n * (decode_ms + step_ms));
    bool all_seen = true;
    for (const std::size_t threads : {std::size_t{1}, w.producer_threads}) {
      gpukit::prefetch_stats stats;
      std::size_t seen = 0;
      gpukit::prefetch_options options;
      options.producer_threads = threads;
      const double t = run_prefetched(w, options, s, probe, wrong, stats, seen);
      all_seen = all_seen && seen == w.batches;
      char label[64];
      std::snprintf(label, sizeof label, "prefetcher, %zu producer thread%s", threads, threads == 1 ? "" : "s");
      const double bound = n * std::max(decode_ms / static_cast<double>(threads), step_ms);
      std::printf("%-34s %8.1f ms  (%.2fx serial; the slower side alone: %.0f ms)\n", label, t, serial / t, bound);
      std::printf("  %s\n", stats.to_string().c_str());
      if (threads == w.producer_threads) break;  // asked for 1 thread: one prefetched run
    }

    // The device behind: steps 8 times longer than decoding, and the host never waits for the stream. Without a bound
    // (prefetch_factor 0) the producer runs ahead of the device and each batch waits for its copy in its own pinned
    // buffer; with the default bound it waits for the device instead, and the run takes as long.
    workload behind = w;
    behind.decode = w.step / 4;
    behind.step = w.step * 2;
    std::printf("\ndevice behind: decode %.1f ms, step %.1f ms per batch, 1 producer thread\n",
                std::chrono::duration<double, std::milli>(behind.decode).count(),
                std::chrono::duration<double, std::milli>(behind.step).count());
    for (const std::size_t factor : {std::size_t{0}, std::size_t{2}}) {
      gpukit::prefetch_options options;
      options.prefetch_factor = factor;
      gpukit::prefetch_stats stats;
      std::size_t seen = 0;
      const double t = run_prefetched(behind, options, s, probe, wrong, stats, seen);
      all_seen = all_seen && seen == w.batches;
      std::printf("%-34s %8.1f ms, pinned memory held: %.1f MiB\n",
                  factor == 0 ? "prefetch_factor 0 (unbounded)" : "prefetch_factor 2 (default)", t,
                  static_cast<double>(stats.pinned_bytes) / (1024.0 * 1024.0));
      std::printf("  %s\n", stats.to_string().c_str());
    }
    std::printf("\n%zu wrong batches\n", wrong.load());
    return (all_seen && wrong.load() == 0) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_input_pipeline: %s\n", e.what());
    return 1;
  }
}
