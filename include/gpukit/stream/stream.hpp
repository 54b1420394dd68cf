// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Streams: stream_view (non-owning, cheap to copy, converts from cudaStream_t) and stream (owning, move-only).
/// A stream belongs to a device. On a CUDA device it is a cudaStream_t. On the CPU device a stream is an in-order
/// asynchronous queue served by a worker thread, and the CPU's default stream runs work synchronously on the
/// calling thread; both behave like CUDA streams, so code written against streams runs on either.
///
/// Destroying a stream with pending work is defined: a CUDA stream's destructor returns at once and the work still
/// completes (cudaStreamDestroy semantics); a CPU stream's destructor waits for its work to finish.

#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>
#include <gpukit/stream/cpu_queue.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace gpukit {

class stream;

namespace detail {
/// True for cuda::stream_ref once <gpukit/stream/stream_ref.hpp> is included (which needs the toolkit's CCCL). A
/// trait rather than a direct mention keeps this header free of CCCL and identical in every translation unit.
template <class T>
struct is_cuda_stream_ref : std::false_type {};
}  // namespace detail

/// A non-owning reference to a stream of some device. It must not outlive the stream it refers to.
///
/// A default-constructed view, or one converted from a raw cudaStream_t, refers to a CUDA stream whose device is
/// looked up when needed (cudaStreamGetDevice; for the null handle, the current device).
class stream_view {
 public:
  /// CUDA's legacy default stream (handle 0) of the calling thread's current device.
  constexpr stream_view() noexcept = default;

  /// A raw CUDA stream handle; implicit so that APIs taking a stream_view accept cudaStream_t.
  constexpr stream_view(cudaStream_t handle) noexcept : cuda_(handle) {}  // NOLINT(google-explicit-constructor)

  /// From cuda::stream_ref (include <gpukit/stream/stream_ref.hpp>).
  template <class StreamRef, std::enable_if_t<detail::is_cuda_stream_ref<StreamRef>::value, int> = 0>
  stream_view(StreamRef ref) noexcept : cuda_(ref.get()) {}  // NOLINT(google-explicit-constructor)

  /// To cuda::stream_ref (include <gpukit/stream/stream_ref.hpp>). Throws invalid_argument_error for a CPU stream.
  template <class StreamRef, std::enable_if_t<detail::is_cuda_stream_ref<StreamRef>::value, int> = 0>
  operator StreamRef() const {  // NOLINT(google-explicit-constructor)
    return StreamRef(cuda_handle());
  }

  /// A raw CUDA stream handle of a known device.
  stream_view(gpukit::device d, cudaStream_t handle) : device_(d), device_known_(true), cuda_(handle) {
    if (d.is_cpu() && handle != nullptr) {
      throw invalid_argument_error("gpukit::stream_view: a CUDA stream handle cannot belong to the CPU device");
    }
  }

  /// The default stream of a device: CUDA's legacy default stream, or for the CPU a stream that runs each task
  /// synchronously on the calling thread.
  static stream_view default_stream(gpukit::device d) noexcept {
    stream_view view;
    view.device_ = d;
    view.device_known_ = true;
    return view;
  }

  /// The device the stream belongs to. For a view made from a raw handle this asks CUDA (cudaStreamGetDevice).
  gpukit::device device() const {
    if (device_known_) return device_;
    int ordinal = 0;
    if (cuda_ == nullptr) {
      GPUKIT_CUDA_TRY(cudaGetDevice(&ordinal));
    } else {
      GPUKIT_CUDA_TRY(cudaStreamGetDevice(cuda_, &ordinal));
    }
    return gpukit::device::cuda(ordinal);
  }

  /// True for streams of the CPU device.
  bool is_cpu() const noexcept { return device_known_ && device_.is_cpu(); }
  /// True for a device's default stream (CUDA's legacy stream, or the CPU's synchronous one).
  bool is_default() const noexcept { return cuda_ == nullptr && cpu_ == nullptr; }

  /// The CUDA handle. Throws invalid_argument_error for a CPU stream.
  cudaStream_t cuda_handle() const {
    if (is_cpu()) throw invalid_argument_error("gpukit::stream_view::cuda_handle: this is a stream of the CPU");
    return cuda_;
  }
  /// The CUDA handle, or nullptr for the CPU. Never throws; for comparisons and logging.
  cudaStream_t native_handle() const noexcept { return cuda_; }
  /// The CPU queue, or nullptr (CUDA streams and the CPU's synchronous default stream).
  detail::cpu_queue* cpu_queue() const noexcept { return cpu_; }

  /// Blocks until all work enqueued on the stream has completed.
  void synchronize() const {
    if (is_cpu()) {
      if (cpu_ != nullptr) cpu_->synchronize();
      return;
    }
    device_guard guard(guard_device());
    GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamSynchronize(cuda_), "cudaStreamSynchronize", known_ordinal());
  }

  /// True when all work enqueued on the stream has completed (cudaStreamQuery).
  bool ready() const {
    if (is_cpu()) return cpu_ == nullptr || cpu_->idle();
    device_guard guard(guard_device());
    const cudaError_t result = cudaStreamQuery(cuda_);
    if (result == cudaSuccess) return true;
    if (result == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    detail::throw_cuda_error(result, "cudaStreamQuery", known_ordinal(), __FILE__, __LINE__);
  }

  /// Enqueues a host function that runs once the work before it has completed, and delays the work after it
  /// (cudaLaunchHostFunc on CUDA). It must not call CUDA or synchronize this stream. An exception escaping it is
  /// reported through gpukit::warn. The callable is moved to the heap until it runs.
  template <class F>
  void enqueue_host(F&& function) const {
    using callable = std::decay_t<F>;
    if (is_cpu()) {
      if (cpu_ != nullptr) {
        cpu_->enqueue(detail::host_task(std::forward<F>(function)));
      } else {
        callable f(std::forward<F>(function));
        detail::run_host_function(f);
      }
      return;
    }
    auto owned = std::make_unique<callable>(std::forward<F>(function));
    const cudaHostFn_t trampoline = [](void* data) {
      std::unique_ptr<callable> f(static_cast<callable*>(data));
      detail::run_host_function(*f);
    };
    device_guard guard(guard_device());
    GPUKIT_CUDA_TRY_DESCRIBED(cudaLaunchHostFunc(cuda_, trampoline, owned.get()), "cudaLaunchHostFunc",
                              known_ordinal());
    (void)owned.release();  // now owned by the trampoline
  }

  /// Views are equal when they refer to the same stream; default streams compare by device.
  friend bool operator==(const stream_view& a, const stream_view& b) noexcept {
    if (a.cuda_ != b.cuda_ || a.cpu_ != b.cpu_) return false;
    if (!a.is_default()) return true;
    return a.device_known_ == b.device_known_ && a.device_ == b.device_;
  }
  friend bool operator!=(const stream_view& a, const stream_view& b) noexcept { return !(a == b); }

 private:
  friend class stream;
  stream_view(gpukit::device d, cudaStream_t handle, detail::cpu_queue* queue) noexcept
      : device_(d), device_known_(true), cuda_(handle), cpu_(queue) {}

  // The legacy default stream is per device: operations on it must run with its device current.
  gpukit::device guard_device() const noexcept {
    return (device_known_ && cuda_ == nullptr) ? device_ : gpukit::device::cpu();
  }
  int known_ordinal() const noexcept { return device_known_ ? device_.ordinal() : -1; }

  gpukit::device device_{};
  bool device_known_ = false;
  cudaStream_t cuda_ = nullptr;
  detail::cpu_queue* cpu_ = nullptr;
};

/// How to create a stream.
struct stream_options {
  /// Do not synchronize with CUDA's legacy default stream (cudaStreamNonBlocking). Ignored on the CPU.
  bool non_blocking = true;
  /// CUDA priority: lower numbers run first. Clamped to the device's range (cudaDeviceGetStreamPriorityRange,
  /// typically [-5, 0]); pass a very negative value for "highest". Ignored on the CPU.
  int priority = 0;
};

/// An owning stream: creates a CUDA stream (or a CPU queue) and destroys it. Move-only; a moved-from stream throws
/// invalid_argument_error on use.
class stream {
 public:
  /// Creates a stream on `d` (a CUDA stream, or a CPU queue with its worker thread).
  explicit stream(gpukit::device d, stream_options options = {}) : device_(d), owns_(true), valid_(true) {
    if (d.is_cpu()) {
      cpu_ = std::make_unique<detail::cpu_queue>();
      return;
    }
    device_guard guard(d);
    int least = 0;
    int greatest = 0;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                              "cudaDeviceGetStreamPriorityRange", d.ordinal());
    priority_ = std::min(std::max(options.priority, greatest), least);
    const unsigned flags = options.non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
    GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamCreateWithPriority(&cuda_, flags, priority_),
                              std::string("cudaStreamCreateWithPriority(") +
                                  (options.non_blocking ? "cudaStreamNonBlocking" : "cudaStreamDefault") + ", " +
                                  std::to_string(priority_) + ")",
                              d.ordinal());
  }

  /// Wraps an existing CUDA stream of device `d`. With `take_ownership`, the wrapper destroys it.
  static stream wrap(cudaStream_t handle, gpukit::device d, bool take_ownership) {
    if (!d.is_cuda()) throw invalid_argument_error("gpukit::stream::wrap: a CUDA handle needs a CUDA device");
    if (handle == nullptr && take_ownership) {
      throw invalid_argument_error("gpukit::stream::wrap: the default stream cannot be owned");
    }
    int priority = 0;
    if (handle != nullptr) {
      GPUKIT_CUDA_TRY_DESCRIBED(cudaStreamGetPriority(handle, &priority), "cudaStreamGetPriority", d.ordinal());
    }
    return stream(d, handle, take_ownership, priority);
  }

  stream(stream&& other) noexcept { take(other); }
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      destroy();
      take(other);
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { destroy(); }

  /// A non-owning view. Throws invalid_argument_error if this stream was moved from.
  stream_view view() const {
    check_valid("view");
    return stream_view(device_, cuda_, cpu_.get());
  }
  operator stream_view() const { return view(); }  // NOLINT(google-explicit-constructor)

  gpukit::device device() const {
    check_valid("device");
    return device_;
  }
  /// The priority in effect after clamping (0 on the CPU).
  int priority() const noexcept { return priority_; }
  bool owns_handle() const noexcept { return owns_; }
  /// False once moved from.
  bool valid() const noexcept { return valid_; }
  cudaStream_t cuda_handle() const { return view().cuda_handle(); }

  void synchronize() const { view().synchronize(); }
  bool ready() const { return view().ready(); }
  template <class F>
  void enqueue_host(F&& function) const {
    view().enqueue_host(std::forward<F>(function));
  }

  /// Gives up ownership of the CUDA handle and returns it; the stream becomes moved-from.
  cudaStream_t release() {
    check_valid("release");
    if (cpu_) throw invalid_argument_error("gpukit::stream::release: a CPU stream has no handle to release");
    cudaStream_t handle = cuda_;
    cuda_ = nullptr;
    owns_ = false;
    valid_ = false;
    return handle;
  }

 private:
  stream(gpukit::device d, cudaStream_t handle, bool owns, int priority) noexcept
      : device_(d), cuda_(handle), priority_(priority), owns_(owns), valid_(true) {}

  void check_valid(const char* what) const {
    if (!valid_) {
      throw invalid_argument_error(std::string("gpukit::stream::") + what + ": use of a moved-from stream");
    }
  }

  void take(stream& other) noexcept {
    device_ = other.device_;
    cuda_ = std::exchange(other.cuda_, nullptr);
    cpu_ = std::move(other.cpu_);
    priority_ = other.priority_;
    owns_ = std::exchange(other.owns_, false);
    valid_ = std::exchange(other.valid_, false);
  }

  void destroy() noexcept {
    if (owns_ && cuda_ != nullptr) {
      detail::report_cuda_failure(cudaStreamDestroy(cuda_), "cudaStreamDestroy (in ~stream)", device_.ordinal());
    }
    cuda_ = nullptr;
    cpu_.reset();  // waits for the queue's pending work, then joins its worker
    owns_ = false;
  }

  gpukit::device device_{};
  cudaStream_t cuda_ = nullptr;
  std::unique_ptr<detail::cpu_queue> cpu_;
  int priority_ = 0;
  bool owns_ = false;
  bool valid_ = false;
};

}  // namespace gpukit
