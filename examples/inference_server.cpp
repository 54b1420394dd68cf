// inference_server: the memory and stream side of a GPU inference server. A client thread sends requests at a fixed
// rate into a queue; worker threads take them; memory-budget admission bounds the device memory requests may hold at
// once (a request waits until its bytes fit, one larger than the whole budget is refused); each admitted request
// takes a stream from a pool shared by the workers, copies its input from pooled pinned memory to a device buffer
// from the caching allocator, runs its "model" on the stream, copies the result back and waits for its own event.
// A reporter prints throughput and memory once a second, with the GPU monitor's line where NVML is present. At the
// end: p50/p99 latency, throughput, the allocator's memory_summary, and proof that nothing leaked (allocated device
// and pinned bytes back to 0, the cache emptied to 0 reserved).
//
// The client sends at a steady rate, then a burst of a quarter as many requests at once, so admission is seen
// holding requests back; latency is reported for each phase.
//
// The model is one layer, out = 2 * in + 1: a CUDA kernel on the request's stream where this file is compiled as CUDA
// (inference_server_cuda, built from inference_server.cu where nvcc is available), a host function on the stream on
// the CPU device, and, in the g++ build on a CUDA device, a device-to-device copy standing in for it (the simulated
// runtime that runs that build in CI runs no kernels). Without a GPU it runs on the CPU device with the same code and
// says so.
//
//   inference_server [requests] [requests per second] [workers] [streams] [budget MiB]
#include <gpukit/gpukit.hpp>
#include <gpukit/device/gpu_monitor.hpp>  // opt-in: not in gpukit.hpp

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct settings {
  std::size_t requests = 2000;
  double rate = 1000.0;  // requests per second sent by the client
  std::size_t workers = 6;
  std::size_t streams = 3;
  std::size_t budget = std::size_t{2} << 20;  // device bytes all admitted requests may hold together
};

struct request {
  std::size_t id = 0;
  std::size_t elements = 0;  // floats in, as many out
  clock_type::time_point sent;
  bool burst = false;
};

/// The queue between the client and the workers; close() ends it once drained.
class request_queue {
 public:
  void push(request r) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(r);
    }
    ready_.notify_one();
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
    }
    ready_.notify_all();
  }
  std::optional<request> pop() {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return closed_ || !queue_.empty(); });
    if (queue_.empty()) return std::nullopt;
    request r = queue_.front();
    queue_.pop_front();
    return r;
  }
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.size();
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<request> queue_;
  bool closed_ = false;
};

/// Memory-budget admission: a request holds its bytes from admission until its result is back on the host.
class memory_admission {
 public:
  explicit memory_admission(std::size_t budget) : budget_(budget) {}
  /// Waits until `bytes` fit; false (at once) for a request larger than the whole budget.
  bool admit(std::size_t bytes) {
    if (bytes > budget_) return false;
    std::unique_lock<std::mutex> lock(mutex_);
    if (in_use_ + bytes > budget_) ++waits_;
    fits_.wait(lock, [&] { return in_use_ + bytes <= budget_; });
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return true;
  }
  void release(std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ -= bytes;
    }
    fits_.notify_all();
  }
  std::size_t in_use() {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  std::size_t peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  std::size_t waits() {
    std::lock_guard<std::mutex> lock(mutex_);
    return waits_;
  }

 private:
  const std::size_t budget_;
  std::mutex mutex_;
  std::condition_variable fits_;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
  std::size_t waits_ = 0;
};

float input_value(std::size_t id, std::size_t k) { return static_cast<float>((id * 131 + k) % 4093); }

#ifdef __CUDACC__
__global__ void layer_kernel(float* out, const float* in, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t k = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride) {
    out[k] = 2.0f * in[k] + 1.0f;
  }
}
#endif

/// Whether run_model computes the layer on `d` (else a copy stands in for it: the g++ build on a CUDA device).
bool model_computes(gpukit::device d) {
#ifdef __CUDACC__
  (void)d;
  return true;
#else
  return d.is_cpu();
#endif
}

/// What the model gives for `x` on `d`.
float model_output(gpukit::device d, float x) { return model_computes(d) ? 2.0f * x + 1.0f : x; }

/// The model on `s`: out = 2 * in + 1 (see model_computes).
void run_model(gpukit::device d, float* out, const float* in, std::size_t n, gpukit::stream_view s) {
  if (d.is_cpu()) {  // the CPU device's stream runs host functions in order
    s.enqueue_host([out, in, n] {
      for (std::size_t k = 0; k < n; ++k) out[k] = 2.0f * in[k] + 1.0f;
    });
    return;
  }
#ifdef __CUDACC__
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 1024));
  layer_kernel<<<blocks, 256, 0, s.cuda_handle()>>>(out, in, n);
  GPUKIT_CUDA_TRY(cudaGetLastError());
#else
  gpukit::copy_async(gpukit::device_span<float>(out, n, d), gpukit::device_span<const float>(in, n, d), s);
#endif
}

struct results {
  std::mutex mutex;
  std::vector<double> latencies_ms;        // requests sent at the steady rate
  std::vector<double> burst_latencies_ms;  // requests of the final burst
  std::atomic<std::size_t> done{0};
  std::atomic<std::size_t> wrong{0};
  std::atomic<std::size_t> refused{0};
  std::atomic<std::size_t> failed{0};  // requests that threw (the first error is kept)
  std::string first_error;             // guarded by mutex
};

/// Holds a request's admitted bytes; gives them back however the request ends.
class admitted_bytes {
 public:
  admitted_bytes(memory_admission& admission, std::size_t bytes) : admission_(admission), bytes_(bytes) {}
  admitted_bytes(const admitted_bytes&) = delete;
  admitted_bytes& operator=(const admitted_bytes&) = delete;
  ~admitted_bytes() { admission_.release(bytes_); }

 private:
  memory_admission& admission_;
  std::size_t bytes_;
};

/// One worker: serves requests until the queue closes. `done_event` is this worker's own event, recorded after each
/// request's work, so it waits for its request and not for the other work on a shared stream.
void serve(gpukit::device d, request_queue& queue, memory_admission& admission, gpukit::stream_pool& streams,
           results& out) {
  gpukit::event done_event(d);
  while (std::optional<request> r = queue.pop()) {
    const std::size_t bytes = 2 * r->elements * sizeof(float);
    if (!admission.admit(bytes)) {
      ++out.refused;
      continue;
    }
    try {
      admitted_bytes held(admission, bytes);
      gpukit::stream_view s = streams.next();
      gpukit::pooled_pinned_buffer<float> host_in(r->elements, d);
      for (std::size_t k = 0; k < r->elements; ++k) host_in.data()[k] = input_value(r->id, k);
      gpukit::device_buffer<float> input(r->elements, s);
      gpukit::device_buffer<float> output(r->elements, s);
      gpukit::pooled_pinned_buffer<float> host_out(r->elements, d);
      // Before the copies: if one throws, the buffers go back to their pool only after the work already enqueued
      // on `s` (an upload that still reads host_in) has completed.
      host_in.record_stream(s);
      host_out.record_stream(s);
      gpukit::copy_async(gpukit::device_span<float>(input.data(), r->elements, d),
                         gpukit::pinned_span<const float>(host_in.data(), r->elements), s);
      run_model(d, output.data(), input.data(), r->elements, s);
      gpukit::copy_async(gpukit::pinned_span<float>(host_out.data(), r->elements),
                         gpukit::device_span<const float>(output.data(), r->elements, d), s);
      done_event.record(s);
      done_event.synchronize();
      bool right = true;
      for (std::size_t k = 0; k < r->elements; k += 97) {
        right = right && host_out.data()[k] == model_output(d, input_value(r->id, k));
      }
      if (!right) ++out.wrong;
    } catch (const std::exception& e) {  // buffers went back to their pools, the bytes to the admission
      std::lock_guard<std::mutex> lock(out.mutex);
      if (out.failed++ == 0) out.first_error = e.what();
      continue;
    }
    const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - r->sent).count();
    {
      std::lock_guard<std::mutex> lock(out.mutex);
      (r->burst ? out.burst_latencies_ms : out.latencies_ms).push_back(ms);
    }
    ++out.done;
  }
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

std::string mib(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  if (argc > 1) cfg.requests = std::max<std::size_t>(1, std::strtoul(argv[1], nullptr, 10));
  if (argc > 2) cfg.rate = std::max(1.0, std::strtod(argv[2], nullptr));
  if (argc > 3) cfg.workers = std::max<std::size_t>(1, std::strtoul(argv[3], nullptr, 10));
  if (argc > 4) cfg.streams = std::max<std::size_t>(1, std::strtoul(argv[4], nullptr, 10));
  if (argc > 5) cfg.budget = std::max<std::size_t>(1, std::strtoul(argv[5], nullptr, 10)) << 20;
  try {
    const gpukit::device_selection selection = gpukit::select_device();
    const gpukit::device d = selection.device;
    std::printf("device: %s (%s)\n", d.to_string().c_str(), selection.reason.c_str());
    if (d.is_cpu()) std::printf("no GPU: serving on the CPU device, same code, host memory\n");
    std::printf("model: %s\n", !model_computes(d) ? "a device-to-device copy stands in (built without nvcc)"
                               : d.is_cuda()      ? "out = 2 * in + 1, a CUDA kernel"
                                                  : "out = 2 * in + 1, a host function on the stream");
    std::printf("%zu requests at %.0f/s, %zu workers, %zu streams, memory budget %s\n\n", cfg.requests, cfg.rate,
                cfg.workers, cfg.streams, mib(cfg.budget).c_str());

    gpukit::stream_pool streams(d, cfg.streams);
    request_queue queue;
    memory_admission admission(cfg.budget);
    results out;
    gpukit::gpu_monitor_options monitor_options;
    monitor_options.devices = d.is_cuda() ? std::vector<gpukit::device>{d} : std::vector<gpukit::device>{};
    monitor_options.read_pcie = false;
    std::optional<gpukit::gpu_monitor> monitor;
    if (d.is_cuda()) monitor.emplace(monitor_options);

    const auto start = clock_type::now();
    std::vector<std::thread> workers;
    for (std::size_t i = 0; i < cfg.workers; ++i) {
      workers.emplace_back([&] { serve(d, queue, admission, streams, out); });
    }
    // The reporter: once a second, until the workers are done.
    std::atomic<bool> finished{false};
    std::thread reporter([&] {
      std::size_t last_done = 0;
      try {  // an exception leaving a thread would end the process (std::terminate)
        for (int second = 1; !finished; ++second) {
          const auto wake = start + std::chrono::seconds(second);
          while (!finished && clock_type::now() < wake) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          if (finished) break;
          const std::size_t done = out.done;
          std::printf("[%2d s] %zu done (%zu/s), queue %zu, admitted %s, allocated %s, reserved %s%s%s\n", second, done,
                      done - last_done, queue.size(), mib(admission.in_use()).c_str(),
                      mib(gpukit::memory_allocated(d)).c_str(), mib(gpukit::memory_reserved(d)).c_str(),
                      monitor && monitor->active() ? " | " : "", monitor ? monitor->status_line().c_str() : "");
          last_done = done;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "inference_server: the reporter stopped: %s\n", e.what());
      }
    });
    // The client: requests of 16 to 256 KiB (in, and as much out) at the chosen rate; one larger than the budget.
    std::mt19937_64 random(42);
    std::uniform_int_distribution<std::size_t> elements(std::size_t{4} << 10, std::size_t{64} << 10);
    for (std::size_t i = 0; i < cfg.requests; ++i) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<clock_type::duration>(
                                                std::chrono::duration<double>(static_cast<double>(i) / cfg.rate)));
      const std::size_t n = (i == cfg.requests / 2) ? cfg.budget : elements(random);  // the oversized one
      queue.push(request{i, n, clock_type::now(), false});
    }
    // Then a burst: a quarter as many requests at once. Admission holds back what does not fit in the budget.
    const std::size_t burst = cfg.requests / 4;
    for (std::size_t i = 0; i < burst; ++i)
      queue.push(request{cfg.requests + i, elements(random), clock_type::now(), true});
    queue.close();
    for (auto& w : workers) w.join();
    const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    finished = true;
    reporter.join();

    std::printf("\nserved %zu, refused %zu (larger than the budget), wrong %zu in %.2f s: %.0f requests/s\n",
                out.done.load(), out.refused.load(), out.wrong.load(), seconds,
                static_cast<double>(out.done.load()) / seconds);
    for (const auto* lat : {&out.latencies_ms, &out.burst_latencies_ms}) {
      std::printf("latency %-26s p50 %7.2f ms, p99 %7.2f ms, max %7.2f ms\n",
                  lat == &out.latencies_ms ? "at the steady rate:" : "of the burst (queued):", percentile(*lat, 50),
                  percentile(*lat, 99), percentile(*lat, 100));
    }
    std::printf("admission: peak %s of %s, %zu requests waited for memory\n\n", mib(admission.peak()).c_str(),
                mib(cfg.budget).c_str(), admission.waits());
    std::printf("%s\n", gpukit::memory_summary(d).c_str());

    // Proof that nothing leaked: every device and pinned byte came back, and the caches empty completely.
    for (std::size_t i = 0; i < cfg.streams; ++i) streams.next().synchronize();
    const std::size_t device_allocated = gpukit::memory_allocated(d);
    const std::size_t pinned_allocated = gpukit::default_pinned_pool(d).stats().allocated_bytes;
    gpukit::empty_cache(d);
    const std::size_t device_reserved = gpukit::memory_reserved(d);
    const bool leak_free =
        device_allocated == 0 && pinned_allocated == 0 && device_reserved == 0 && admission.in_use() == 0;
    std::printf("leak check: device allocated %zu B, pinned allocated %zu B, reserved after empty_cache %zu B: %s\n",
                device_allocated, pinned_allocated, device_reserved, leak_free ? "nothing leaked" : "LEAK");
    if (out.failed != 0)
      std::printf("%zu requests failed; the first: %s\n", out.failed.load(), out.first_error.c_str());
    const bool all_answered = out.done + out.refused == cfg.requests + burst;
    return (leak_free && all_answered && out.wrong == 0 && out.refused == 1) ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inference_server: %s\n", e.what());
    return 1;
  }
}
