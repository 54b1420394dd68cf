// prefetch_pipeline: a data-loading loop with gpukit::prefetcher. A producer callback "reads" batches of samples
// (here: generates them, as a file reader or decoder would) into pinned memory on the prefetcher's thread; each
// batch is copied to the device on a copy stream while the consumer stream still works on the previous one. The
// consumer's "training step" is enqueued on its stream and sees each batch because the prefetcher makes the stream
// wait for the batch's copy. The same code runs on a GPU and, without one, on the CPU device.
//
//   prefetch_pipeline [batches] [samples per batch]
#include <gpukit/gpukit.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

/// Sample k of batch i: a value the consumer can check.
std::uint32_t sample(std::size_t batch, std::size_t k) { return static_cast<std::uint32_t>(batch * 2654435761u + k); }

}  // namespace

int main(int argc, char** argv) {
  const std::size_t batches = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 64;
  const std::size_t per_batch = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : (std::size_t{1} << 20);
  try {
    const gpukit::device_selection selection = gpukit::select_device();
    const gpukit::device d = selection.device;
    std::printf("device: %s\n", d.to_string().c_str());
    gpukit::stream consumer(d);

    // Producer: runs on the prefetcher's thread; writes at most out.size() samples and says how many (0 = done).
    gpukit::prefetcher<std::uint32_t> loader(
        consumer, per_batch,
        [&](std::size_t index, gpukit::span<std::uint32_t> out) -> std::size_t {
          if (index == batches) return 0;
          for (std::size_t k = 0; k < out.size(); ++k) out[k] = sample(index, k);
          return out.size();
        },
        gpukit::prefetch_options{3});  // triple buffering

    // The "training step": copies the batch's first and last samples back and checks them on the stream (a real
    // program would launch kernels on consumer.cuda_handle()).
    gpukit::pinned_buffer<std::uint32_t> probe(2 * batches, d);
    std::atomic<std::size_t> wrong{0};
    const auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0;
    while (auto batch = loader.next()) {
      const gpukit::device_span<std::uint32_t> data = batch->data();
      const std::size_t i = batch->index();
      gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * i, 1), data.first(1), consumer);
      gpukit::copy_async(gpukit::pinned_span<std::uint32_t>(probe.data() + 2 * i + 1, 1), data.last(1), consumer);
      const std::size_t n = data.size();
      std::uint32_t* p = probe.data();
      consumer.enqueue_host([p, i, n, &wrong] {
        if (p[2 * i] != sample(i, 0) || p[2 * i + 1] != sample(i, n - 1)) ++wrong;
      });
      ++seen;
    }  // each batch is released at the end of its iteration: its buffer is refilled once the stream has used it
    consumer.synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double gb = static_cast<double>(seen * per_batch * sizeof(std::uint32_t)) / 1e9;
    std::printf("%zu batches of %zu samples (%.2f GB) in %.3f s: %.2f GB/s through the loader; %zu wrong\n", seen,
                per_batch, gb, seconds, gb / seconds, wrong.load());
    return (seen == batches && wrong.load() == 0) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefetch_pipeline: %s\n", e.what());
    return 1;
  }
}
