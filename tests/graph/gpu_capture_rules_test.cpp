// Which runtime calls a stream capture permits, measured: for each call, a capture in global mode (thread-local or
// relaxed where a row says so) is begun on one stream, the call is made (from another thread, or from the capturing
// thread itself), and the call's result and whether the capture survived are compared with a table. The same table is
// what the simulated runtime enforces (tests/cudasim), so this test, run on a real GPU by tests/gpu/run.sh, is the
// proof that the simulator's rules are CUDA's; on the simulator (test_gpu_capture_rules_sim) it keeps the two from
// drifting apart. Every observation is printed, one line per call, so a GPU run's output is the table itself.
#include "support.hpp"

#ifdef GPUKIT_TEST_ON_CUDASIM
#include "cudasim/cudasim.hpp"
#endif

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using namespace gpukit_test;

namespace {

constexpr std::size_t buffer_bytes = std::size_t{1} << 20;

/// A thread that runs one task at a time for the caller and waits for it; its CUDA context is bound before any
/// capture begins, so that no first-use initialisation happens during one.
class worker {
 public:
  worker() : thread_([this] { loop(); }) {
    run([] { GPUKIT_CUDA_TRY(cudaSetDevice(0)); });
  }
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;
  ~worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void run(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = std::move(task);
    wake_.notify_all();
    wake_.wait(lock, [this] { return !task_; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || task_; });
      if (stopping_) return;
      task_();
      task_ = nullptr;
      wake_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<void()> task_;
  bool stopping_ = false;
  std::thread thread_;
};

/// What a call may use, made before the capture; whatever the call did not consume is released after it.
struct objects {
  cudaStream_t other = nullptr;     // a non-blocking stream, not captured
  cudaStream_t blocking = nullptr;  // a blocking stream, not captured
  cudaStream_t captured = nullptr;  // the stream being captured (set once the capture began)
  cudaEvent_t event = nullptr;      // recorded on `other` and complete
  void* device = nullptr;           // cudaMalloc
  void* pooled = nullptr;           // cudaMallocAsync on `other`
  void* pinned = nullptr;           // cudaMallocHost
  std::vector<char> pageable = std::vector<char>(buffer_bytes);
  std::vector<char> registered = std::vector<char>(buffer_bytes);  // cudaHostRegister'ed
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  // What the call made, released after the capture.
  void* made_device = nullptr;
  void* made_pooled = nullptr;
  void* made_pinned = nullptr;
  cudaStream_t made_stream = nullptr;
  cudaEvent_t made_event = nullptr;
  cudaEvent_t fork = nullptr;  // the forked-and-joined probe's events, destroyed once the capture ended
  cudaEvent_t join = nullptr;
  cudaGraphExec_t made_exec = nullptr;
  bool made_registration = false;
  bool unregistered = false;
};

/// Passes `result` on, and forgets `p` when the call that freed it succeeded.
template <class T>
cudaError_t forget_on_success(cudaError_t result, T*& p) {
  if (result == cudaSuccess) p = nullptr;
  return result;
}

void make(objects& o) {
  GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&o.other, cudaStreamNonBlocking));
  GPUKIT_CUDA_TRY(cudaStreamCreate(&o.blocking));
  GPUKIT_CUDA_TRY(cudaEventCreateWithFlags(&o.event, cudaEventDisableTiming));
  GPUKIT_CUDA_TRY(cudaMalloc(&o.device, buffer_bytes));
  GPUKIT_CUDA_TRY(cudaMallocAsync(&o.pooled, buffer_bytes, o.other));
  GPUKIT_CUDA_TRY(cudaMallocHost(&o.pinned, buffer_bytes));
  GPUKIT_CUDA_TRY(cudaHostRegister(o.registered.data(), buffer_bytes, cudaHostRegisterDefault));
  GPUKIT_CUDA_TRY(cudaStreamBeginCapture(o.other, cudaStreamCaptureModeGlobal));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(o.device, 0, buffer_bytes, o.other));
  GPUKIT_CUDA_TRY(cudaStreamEndCapture(o.other, &o.graph));
  GPUKIT_CUDA_TRY(cudaGraphInstantiate(&o.exec, o.graph, 0));
  GPUKIT_CUDA_TRY(cudaEventRecord(o.event, o.other));
  GPUKIT_CUDA_TRY(cudaStreamSynchronize(o.other));
}

void release(objects& o) {
  (void)cudaDeviceSynchronize();
  if (o.made_exec != nullptr) (void)cudaGraphExecDestroy(o.made_exec);
  if (o.exec != nullptr) (void)cudaGraphExecDestroy(o.exec);
  if (o.graph != nullptr) (void)cudaGraphDestroy(o.graph);
  if (o.made_registration) (void)cudaHostUnregister(o.pageable.data());
  if (!o.unregistered) (void)cudaHostUnregister(o.registered.data());
  if (o.made_pinned != nullptr) (void)cudaFreeHost(o.made_pinned);
  if (o.pinned != nullptr) (void)cudaFreeHost(o.pinned);
  if (o.made_pooled != nullptr) (void)cudaFreeAsync(o.made_pooled, nullptr);
  if (o.pooled != nullptr) (void)cudaFreeAsync(o.pooled, nullptr);
  if (o.made_device != nullptr) (void)cudaFree(o.made_device);
  if (o.device != nullptr) (void)cudaFree(o.device);
  if (o.made_event != nullptr) (void)cudaEventDestroy(o.made_event);
  if (o.fork != nullptr) (void)cudaEventDestroy(o.fork);
  if (o.join != nullptr) (void)cudaEventDestroy(o.join);
  if (o.event != nullptr) (void)cudaEventDestroy(o.event);
  if (o.made_stream != nullptr) (void)cudaStreamDestroy(o.made_stream);
  if (o.other != nullptr) (void)cudaStreamDestroy(o.other);
  if (o.blocking != nullptr) (void)cudaStreamDestroy(o.blocking);
  (void)cudaDeviceSynchronize();
  (void)cudaGetLastError();
}

void CUDART_CB nothing(void*) {}

/// Where the call is made from, and in which mode.
enum class caller {
  other_thread,
  other_thread_relaxed,
  other_thread_thread_local,  // its mode cudaStreamCaptureModeThreadLocal: other threads' captures are ignored
  capturing_thread,
  capturing_thread_relaxed
};

/// What CUDA does with the call while the capture runs.
enum class rule {
  permitted,   // the call succeeds and the capture goes on
  prohibited,  // the call fails (900, or 906 for the legacy stream) and the capture is invalidated
  refused,     // the call fails and the capture goes on
};

struct probe {
  const char* call;
  caller from;
  bool blocking_capture;  // the captured stream is a blocking one (synchronizes with the legacy default stream)
  rule expected;
  std::function<cudaError_t(objects&)> make_call;
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;  // the mode the capture is begun in
  cudaError_t end_after = cudaSuccess;  // what the capturing thread's cudaStreamEndCapture returns afterwards
  cudaError_t refused_with = cudaErrorStreamCaptureWrongThread;  // rule::refused: what the call returns
};

const char* name_of(caller c) {
  switch (c) {
    case caller::other_thread:
      return "another thread";
    case caller::other_thread_relaxed:
      return "another thread, relaxed";
    case caller::other_thread_thread_local:
      return "another thread, thread-local";
    case caller::capturing_thread:
      return "the capturing thread";
    case caller::capturing_thread_relaxed:
      return "the capturing thread, relaxed";
  }
  return "?";
}

std::vector<probe> probes() {
  const auto other = caller::other_thread;
  const auto relaxed = caller::other_thread_relaxed;
  const auto thread_local_mode = caller::other_thread_thread_local;
  const auto self = caller::capturing_thread;
  const auto self_relaxed = caller::capturing_thread_relaxed;
  const auto ok = rule::permitted;
  const auto no = rule::prohibited;
  const auto refused = rule::refused;
  const auto thread_local_capture = cudaStreamCaptureModeThreadLocal;
  const auto relaxed_capture = cudaStreamCaptureModeRelaxed;
  const auto device_synchronize = [](objects&) { return cudaDeviceSynchronize(); };
  const auto end_capture = [](objects& o) {
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(o.captured, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    return e;
  };
  // An event recorded in the capture, waited for by the legacy default stream, which CUDA never captures.
  const auto legacy_waits_for_captured_event = [](objects& o) {
    cudaError_t e = cudaEventCreateWithFlags(&o.fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(o.fork, o.captured);
    return e != cudaSuccess ? e : cudaStreamWaitEvent(cudaStreamLegacy, o.fork, 0);
  };
  const auto destroy_exec = [](objects& o) { return forget_on_success(cudaGraphExecDestroy(o.exec), o.exec); };
  // clang-format off
  return {
    {"cudaMalloc", other, false, no, [](objects& o) { return cudaMalloc(&o.made_device, buffer_bytes); }},
    {"cudaMalloc", relaxed, false, ok, [](objects& o) { return cudaMalloc(&o.made_device, buffer_bytes); }},
    {"cudaFree", other, false, no, [](objects& o) { return forget_on_success(cudaFree(o.device), o.device); }},
    {"cudaFree", relaxed, false, ok, [](objects& o) { return forget_on_success(cudaFree(o.device), o.device); }},
    {"cudaMallocHost", other, false, no, [](objects& o) { return cudaMallocHost(&o.made_pinned, buffer_bytes); }},
    {"cudaFreeHost", other, false, no, [](objects& o) { return forget_on_success(cudaFreeHost(o.pinned), o.pinned); }},
    // The pinned pool pins, frees and unregisters in relaxed mode beside other threads' captures (assumed from
    // cudaFree's row; these rows measure it: helper-175).
    {"cudaMallocHost", relaxed, false, ok, [](objects& o) { return cudaMallocHost(&o.made_pinned, buffer_bytes); }},
    {"cudaFreeHost", relaxed, false, ok, [](objects& o) {
      return forget_on_success(cudaFreeHost(o.pinned), o.pinned); }},
    {"cudaHostUnregister", relaxed, false, ok, [](objects& o) {
      const cudaError_t e = cudaHostUnregister(o.registered.data());
      o.unregistered = e == cudaSuccess;
      return e; }},
    {"cudaHostRegister", other, false, no, [](objects& o) {
      const cudaError_t e = cudaHostRegister(o.pageable.data(), buffer_bytes, cudaHostRegisterDefault);
      o.made_registration = e == cudaSuccess;
      return e; }},
    {"cudaHostUnregister", other, false, no, [](objects& o) {
      const cudaError_t e = cudaHostUnregister(o.registered.data());
      o.unregistered = e == cudaSuccess;
      return e; }},
    {"cudaMallocAsync (another stream)", other, false, no, [](objects& o) {
      return cudaMallocAsync(&o.made_pooled, buffer_bytes, o.other); }},
    {"cudaFreeAsync (another stream)", other, false, no, [](objects& o) {
      return forget_on_success(cudaFreeAsync(o.pooled, o.other), o.pooled); }},
    {"cudaMemPoolTrimTo", other, false, no, [](objects&) {
      cudaMemPool_t pool = nullptr;
      const cudaError_t e = cudaDeviceGetDefaultMemPool(&pool, 0);
      return e != cudaSuccess ? e : cudaMemPoolTrimTo(pool, 0); }},
    {"cudaMemGetInfo", other, false, ok, [](objects&) {
      std::size_t free_bytes = 0, total = 0;
      return cudaMemGetInfo(&free_bytes, &total); }},
    {"cudaDeviceSynchronize", other, false, no, [](objects&) { return cudaDeviceSynchronize(); }},
    {"cudaStreamSynchronize (another stream)", other, false, no, [](objects& o) {
      return cudaStreamSynchronize(o.other); }},
    {"cudaStreamQuery (another stream)", other, false, no, [](objects& o) { return cudaStreamQuery(o.other); }},
    {"cudaEventQuery", other, false, no, [](objects& o) { return cudaEventQuery(o.event); }},
    {"cudaEventQuery", relaxed, false, ok, [](objects& o) { return cudaEventQuery(o.event); }},
    {"cudaEventSynchronize", other, false, no, [](objects& o) { return cudaEventSynchronize(o.event); }},
    {"cudaEventCreateWithFlags", other, false, ok, [](objects& o) {
      return cudaEventCreateWithFlags(&o.made_event, cudaEventDisableTiming); }},
    {"cudaEventRecord (another stream)", other, false, ok, [](objects& o) {
      return cudaEventRecord(o.event, o.other); }},
    {"cudaEventDestroy", other, false, ok, [](objects& o) {
      return forget_on_success(cudaEventDestroy(o.event), o.event); }},
    {"cudaStreamWaitEvent (another stream)", other, false, ok, [](objects& o) {
      return cudaStreamWaitEvent(o.other, o.event, 0); }},
    {"cudaStreamCreateWithFlags (non-blocking)", other, false, ok, [](objects& o) {
      return cudaStreamCreateWithFlags(&o.made_stream, cudaStreamNonBlocking); }},
    {"cudaStreamCreate (blocking)", other, false, ok, [](objects& o) { return cudaStreamCreate(&o.made_stream); }},
    {"cudaStreamCreateWithPriority", other, false, ok, [](objects& o) {
      int least = 0, greatest = 0;
      const cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
      return e != cudaSuccess ? e : cudaStreamCreateWithPriority(&o.made_stream, cudaStreamNonBlocking, greatest); }},
    {"cudaStreamDestroy (another stream)", other, false, ok, [](objects& o) {
      return forget_on_success(cudaStreamDestroy(o.other), o.other); }},
    {"cudaMemsetAsync (another stream)", other, false, ok, [](objects& o) {
      return cudaMemsetAsync(o.device, 1, buffer_bytes, o.other); }},
    {"cudaMemcpyAsync pinned (another stream)", other, false, ok, [](objects& o) {
      return cudaMemcpyAsync(o.device, o.pinned, buffer_bytes, cudaMemcpyHostToDevice, o.other); }},
    {"cudaMemcpyAsync pageable (another stream)", other, false, ok, [](objects& o) {
      return cudaMemcpyAsync(o.device, o.pageable.data(), buffer_bytes, cudaMemcpyHostToDevice, o.other); }},
    {"cudaLaunchHostFunc (another stream)", other, false, ok, [](objects& o) {
      return cudaLaunchHostFunc(o.other, nothing, nullptr); }},
    {"cudaGraphInstantiate", other, false, no, [](objects& o) {
      return cudaGraphInstantiate(&o.made_exec, o.graph, 0); }},
    {"cudaGraphLaunch (another stream)", other, false, ok, [](objects& o) { return cudaGraphLaunch(o.exec, o.other); }},
    {"cudaGraphExecDestroy", other, false, no, destroy_exec},
    {"cudaGraphExecDestroy", relaxed, false, ok, destroy_exec},
    {"cudaGraphExecDestroy", self, false, no, destroy_exec},
    {"cudaGraphExecDestroy", self_relaxed, false, ok, destroy_exec},
    {"cudaGraphDestroy", other, false, ok, [](objects& o) {
      return forget_on_success(cudaGraphDestroy(o.graph), o.graph); }},
    {"cudaMemsetAsync (legacy default stream)", other, false, ok, [](objects& o) {
      return cudaMemsetAsync(o.device, 1, buffer_bytes, cudaStreamLegacy); }},
    {"cudaMemsetAsync (legacy default stream)", other, true, no, [](objects& o) {
      return cudaMemsetAsync(o.device, 1, buffer_bytes, cudaStreamLegacy); }},
    {"cudaMemsetAsync (legacy default stream)", relaxed, true, no, [](objects& o) {
      return cudaMemsetAsync(o.device, 1, buffer_bytes, cudaStreamLegacy); }},
    {"cudaMallocAsync (legacy default stream)", relaxed, false, ok, [](objects& o) {
      return cudaMallocAsync(&o.made_pooled, buffer_bytes, cudaStreamLegacy); }},
    {"cudaMallocAsync (legacy default stream)", relaxed, true, no, [](objects& o) {
      return cudaMallocAsync(&o.made_pooled, buffer_bytes, cudaStreamLegacy); }},
    {"cudaStreamQuery (another stream)", self, false, no, [](objects& o) { return cudaStreamQuery(o.other); }},
    {"cudaEventQuery", self_relaxed, false, ok, [](objects& o) { return cudaEventQuery(o.event); }},
    {"cudaSetDevice", other, false, ok, [](objects&) { return cudaSetDevice(0); }},
    {"cudaStreamSynchronize (another stream)", relaxed, false, ok, [](objects& o) {
      return cudaStreamSynchronize(o.other); }},
    {"cudaStreamQuery (another stream)", relaxed, false, ok, [](objects& o) { return cudaStreamQuery(o.other); }},
    {"cudaDeviceSynchronize", relaxed, false, no, [](objects&) { return cudaDeviceSynchronize(); }},
    {"cudaMallocHost", relaxed, false, ok, [](objects& o) { return cudaMallocHost(&o.made_pinned, buffer_bytes); }},
    {"cudaHostUnregister", relaxed, false, ok, [](objects& o) {
      const cudaError_t e = cudaHostUnregister(o.registered.data());
      o.unregistered = e == cudaSuccess;
      return e; }},
    // A thread in thread-local mode ignores other threads' captures (cuda_runtime_api.h,
    // cudaThreadExchangeStreamCaptureMode); a device-wide wait is assumed refused as in relaxed mode. Not measured yet.
    {"cudaMalloc", thread_local_mode, false, ok, [](objects& o) { return cudaMalloc(&o.made_device, buffer_bytes); }},
    {"cudaEventQuery", thread_local_mode, false, ok, [](objects& o) { return cudaEventQuery(o.event); }},
    {"cudaDeviceSynchronize", thread_local_mode, false, no, [](objects&) { return cudaDeviceSynchronize(); }},
    {"cudaMemcpy (device to pageable host)", other, false, ok, [](objects& o) {
      return cudaMemcpy(o.pageable.data(), o.device, buffer_bytes, cudaMemcpyDeviceToHost); }},
    {"cudaPointerGetAttributes", other, false, ok, [](objects& o) {
      cudaPointerAttributes attributes{};
      return cudaPointerGetAttributes(&attributes, o.device); }},
    {"cudaStreamIsCapturing (another stream)", other, false, ok, [](objects& o) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      return cudaStreamIsCapturing(o.other, &status); }},
    {"cudaEventRecord (legacy default stream)", other, false, ok, [](objects& o) {
      return cudaEventRecord(o.event, cudaStreamLegacy); }},
    {"cudaEventRecord (legacy default stream)", other, true, no, [](objects& o) {
      return cudaEventRecord(o.event, cudaStreamLegacy); }},
    {"cudaGraphLaunch (another stream)", self, false, ok, [](objects& o) { return cudaGraphLaunch(o.exec, o.other); }},
    // The ids gpukit looks up (stream_view::id): of a stream not captured, and of the legacy stream while a blocking
    // stream is captured, which joins the capture and fails (an H200, 2026-12-04): gpukit asks the legacy stream's
    // id once per process, never during a blocking capture.
    {"cudaStreamGetId (another stream)", self, false, ok, [](objects& o) {
      unsigned long long id = 0;
      return cudaStreamGetId(o.other, &id); }},
    {"cudaStreamGetId (legacy default stream)", self, true, no, [](objects&) {
      unsigned long long id = 0;
      return cudaStreamGetId(cudaStreamLegacy, &id); }},
    {"cudaStreamGetId (legacy default stream)", other, true, no, [](objects&) {
      unsigned long long id = 0;
      return cudaStreamGetId(cudaStreamLegacy, &id); }},
    {"cudaGraphDestroy", self, false, ok, [](objects& o) {
      return forget_on_success(cudaGraphDestroy(o.graph), o.graph); }},
    // Blocking streams synchronize with the legacy default stream, not with each other: work on one that is not
    // captured does not join a captured one (gpukit records and waits on such streams during captures).
    {"cudaEventRecord (another blocking stream)", other, true, ok, [](objects& o) {
      return cudaEventRecord(o.event, o.blocking); }},
    {"cudaStreamWaitEvent (another blocking stream)", other, true, ok, [](objects& o) {
      return cudaStreamWaitEvent(o.blocking, o.event, 0); }},
    // The legacy default stream's own wait and query (stream_view::synchronize and ready on it, relaxed): both cover
    // the blocking streams' work, the captured one's included, so both are refused during a blocking capture (an
    // implicit join; measured on an H200, 2026-12-04, which corrected the simulator's query).
    {"cudaStreamSynchronize (legacy default stream)", relaxed, false, ok, [](objects&) {
      return cudaStreamSynchronize(cudaStreamLegacy); }},
    {"cudaStreamSynchronize (legacy default stream)", relaxed, true, no, [](objects&) {
      return cudaStreamSynchronize(cudaStreamLegacy); }},
    {"cudaStreamQuery (legacy default stream)", relaxed, false, ok, [](objects&) {
      const cudaError_t e = cudaStreamQuery(cudaStreamLegacy);
      return e == cudaErrorNotReady ? cudaSuccess : e; }},
    {"cudaStreamQuery (legacy default stream)", relaxed, true, no, [](objects&) {
      const cudaError_t e = cudaStreamQuery(cudaStreamLegacy);
      return e == cudaErrorNotReady ? cudaSuccess : e; }},
    // How gpukit asks before using the legacy stream: the header says this answers cudaErrorStreamCaptureImplicit
    // during a blocking capture and leaves the capture intact. This probe succeeds only if it does.
    {"cudaStreamIsCapturing (legacy default stream)", other, true, ok, [](objects&) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      const cudaError_t e = cudaStreamIsCapturing(cudaStreamLegacy, &status);
      if (e == cudaSuccess) std::printf("  (the legacy stream's status: %d)\n", static_cast<int>(status));
      return e == cudaErrorStreamCaptureImplicit ? cudaSuccess : (e == cudaSuccess ? cudaErrorIllegalState : e); }},
    {"cudaStreamIsCapturing (legacy default stream)", other, false, ok, [](objects&) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      return cudaStreamIsCapturing(cudaStreamLegacy, &status); }},
    // A stream forked into the capture and joined back stays part of it until the capture ends (the simulator's
    // rule; gpukit asks cudaStreamIsCapturing before recording on a stream): this probe succeeds only if it reads
    // cudaStreamCaptureStatusActive.
    {"cudaStreamIsCapturing (forked and joined)", self, false, ok, [](objects& o) {
      cudaError_t e = cudaEventCreateWithFlags(&o.fork, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&o.join, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(o.fork, o.captured);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(o.other, o.fork, 0);
      if (e == cudaSuccess) e = cudaMemsetAsync(o.device, 3, buffer_bytes, o.other);
      if (e == cudaSuccess) e = cudaEventRecord(o.join, o.other);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(o.captured, o.join, 0);
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (e == cudaSuccess) e = cudaStreamIsCapturing(o.other, &status);
      if (e == cudaSuccess && status != cudaStreamCaptureStatusActive) {
        std::printf("  (the forked and joined stream's status: %d)\n", static_cast<int>(status));
        e = cudaErrorIllegalState;  // not the status expected
      }
      return e; }},
    // The programming guide: it is invalid to "synchronize a broader handle which encompasses an active stream
    // capture, such as a device or context handle when any associated stream is in capture mode". Measured on an
    // H100 (2026-12-05): refused (900) and the capture invalidated in every mode of the capture and of the caller.
    {"cudaDeviceSynchronize", other, false, no, device_synchronize, thread_local_capture},
    {"cudaDeviceSynchronize", relaxed, false, no, device_synchronize, thread_local_capture},
    {"cudaDeviceSynchronize", thread_local_mode, false, no, device_synchronize, thread_local_capture},
    {"cudaDeviceSynchronize", self, false, no, device_synchronize, thread_local_capture},
    {"cudaDeviceSynchronize", other, false, no, device_synchronize, relaxed_capture},
    {"cudaDeviceSynchronize", relaxed, false, no, device_synchronize, relaxed_capture},
    {"cudaDeviceSynchronize", self, false, no, device_synchronize, relaxed_capture},
    {"cudaDeviceSynchronize", self_relaxed, false, no, device_synchronize, relaxed_capture},
    // A graph launched into the captured stream: 900 (onnxruntime PR #32081, an H200, CUDA 12.6), not nested as a
    // child graph node; that the capture is invalidated, and in every mode, is the programming guide's rule for a
    // refused operation, not measured yet (graph::launch refuses such a launch itself first).
    {"cudaGraphLaunch (the captured stream)", self, false, no,
     [](objects& o) { return cudaGraphLaunch(o.exec, o.captured); }},
    {"cudaGraphLaunch (the captured stream)", self_relaxed, false, no,
     [](objects& o) { return cudaGraphLaunch(o.exec, o.captured); }, relaxed_capture},
    // CUDA never captures the legacy default stream (cudaStreamBeginCapture, cudaStreamIsCapturing), so it cannot
    // join a capture by waiting for an event recorded in it. Measured on an H100: cudaErrorStreamCaptureImplicit
    // (906), the capture invalidated, whether the captured stream is blocking or not.
    {"cudaStreamWaitEvent (legacy, captured event)", self, false, no,
     legacy_waits_for_captured_event},
    {"cudaStreamWaitEvent (legacy, captured event)", self, true, no, legacy_waits_for_captured_event},
    {"cudaStreamWaitEvent (legacy, captured event)", self, false, no,
     legacy_waits_for_captured_event, relaxed_capture},
    // cudaFreeAsync in a capture makes a free node, which "must therefore be passed the address of a graph
    // allocation" (cuda_runtime_api.h). Memory of a pool (allocated outside any capture) is refused; whether the
    // capture survives decides if async_allocator must refuse such a free itself first (the simulator's model: it
    // does, cudaErrorInvalidValue). Not measured yet.
    {"cudaFreeAsync (pool memory, captured stream)", self, false, refused, [](objects& o) {
      return forget_on_success(cudaFreeAsync(o.pooled, o.captured), o.pooled); },
     cudaStreamCaptureModeGlobal, cudaSuccess, cudaErrorInvalidValue},
    // cudaStreamBeginCapture: "If mode is not cudaStreamCaptureModeRelaxed, cudaStreamEndCapture must be called on
    // this stream from the same thread". Measured on an H100: 908 (cudaErrorStreamCaptureWrongThread), the capture
    // still active, and its own thread's cudaStreamEndCapture then fails with cudaErrorIllegalState, giving no graph.
    {"cudaStreamEndCapture", other, false, refused, end_capture, cudaStreamCaptureModeGlobal, cudaErrorIllegalState},
    {"cudaStreamEndCapture", other, false, refused, end_capture, thread_local_capture, cudaErrorIllegalState},
  };
  // clang-format on
}

const char* name_of(cudaStreamCaptureMode mode);

struct observation {
  cudaError_t returned = cudaSuccess;
  bool capture_invalidated = false;
  cudaError_t ended = cudaSuccess;  ///< what the capturing thread's cudaStreamEndCapture returned afterwards
  cudaStreamCaptureStatus after_end = cudaStreamCaptureStatusNone;  ///< the stream's capture status after that
};

/// Runs `p` during a capture of a fresh stream (the capturing thread is this one) and says what happened.
observation observe(const probe& p, worker& other_thread) {
  objects o;
  make(o);
  cudaStream_t captured = nullptr;
  if (p.blocking_capture) {
    GPUKIT_CUDA_TRY(cudaStreamCreate(&captured));
  } else {
    GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking));
  }
  GPUKIT_CUDA_TRY(cudaStreamBeginCapture(captured, p.capture_mode));
  GPUKIT_CUDA_TRY(cudaMemsetAsync(o.device, 2, buffer_bytes, captured));
  o.captured = captured;
  observation seen;
  const auto make_call = [&] {
    const bool relax = p.from == caller::other_thread_relaxed || p.from == caller::capturing_thread_relaxed;
    const bool own_mode = relax || p.from == caller::other_thread_thread_local;
    cudaStreamCaptureMode mode = relax ? cudaStreamCaptureModeRelaxed : cudaStreamCaptureModeThreadLocal;
    if (own_mode) GPUKIT_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
    seen.returned = p.make_call(o);
    if (own_mode) GPUKIT_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
    (void)cudaGetLastError();
  };
  if (p.from == caller::other_thread || p.from == caller::other_thread_relaxed ||
      p.from == caller::other_thread_thread_local) {
    other_thread.run(make_call);
  } else {
    make_call();
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GPUKIT_CUDA_TRY(cudaStreamIsCapturing(captured, &status));
  seen.capture_invalidated = status == cudaStreamCaptureStatusInvalidated;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(captured, &graph);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  seen.ended = ended;
  if (cudaStreamIsCapturing(captured, &seen.after_end) != cudaSuccess) seen.after_end = cudaStreamCaptureStatusNone;
  if (!seen.capture_invalidated) {
    INFO("cudaStreamEndCapture after " << std::string(p.call) << " from " << std::string(name_of(p.from))
                                       << " returned " << std::string(cudaGetErrorName(ended)));
    CHECK(ended == p.end_after);
  }
  (void)cudaGetLastError();
  (void)cudaStreamDestroy(captured);
  release(o);
  return seen;
}

}  // namespace

TEST_CASE("gpu: the calls a capture in global mode permits, from another thread and its own, are the simulator's") {
  GPUKIT_REQUIRE_GPU();
  worker other_thread;
  std::printf("capture rules (%s):\n", on_simulator() ? "simulated runtime" : "real runtime");
  for (const probe& p : probes()) {
    const observation seen = observe(p, other_thread);
    const bool permitted = seen.returned == cudaSuccess && !seen.capture_invalidated;
    std::printf("  %-46s from %-30s %-12s %-12s capture: returned %-36s capture %s\n", p.call, name_of(p.from),
                p.blocking_capture ? "blocking" : "non-blocking", name_of(p.capture_mode),
                cudaGetErrorName(seen.returned), seen.capture_invalidated ? "INVALIDATED" : "intact");
    if (seen.ended != cudaSuccess) {
      std::printf("    then cudaStreamEndCapture: %s; the stream then %s\n", cudaGetErrorName(seen.ended),
                  seen.after_end == cudaStreamCaptureStatusNone ? "captures no more" : "STILL CAPTURES");
    }
    std::fflush(stdout);  // each row as it is measured: ctest interleaves it with doctest's failures
    const std::string what = std::string(p.call) + " from " + name_of(p.from) + " (" +
                             (p.blocking_capture ? "blocking " : "") + name_of(p.capture_mode) +
                             " capture): returned " + cudaGetErrorName(seen.returned) + ", capture " +
                             (seen.capture_invalidated ? "invalidated" : "intact");
    INFO(what);
    // The codes are those an H100 and an H200 returned (bench/results/gpu-20261205-1937-H100.md): a call the
    // capture prohibits fails with 900, one that makes the legacy default stream join it with 906; the one refused,
    // ending another thread's capture, with 908 (a refused row may say otherwise: refused_with).
    if (p.expected == rule::permitted) {
      CHECK(permitted);
    } else if (p.expected == rule::refused) {
      CHECK(seen.returned == p.refused_with);
      CHECK_FALSE(seen.capture_invalidated);
    } else {
      const bool joins_legacy = std::strstr(p.call, "legacy") != nullptr;  // the probes name the stream they use
      CHECK(seen.returned == (joins_legacy ? cudaErrorStreamCaptureImplicit : cudaErrorStreamCaptureUnsupported));
      CHECK(seen.capture_invalidated);
    }
#ifdef GPUKIT_TEST_ON_CUDASIM
    // The simulator records each refused call as a rule violation, and only those.
    CHECK(cudasim::take_violations().size() == (p.expected == rule::permitted ? 0u : 1u));
#endif
  }
  std::fflush(stdout);
}

TEST_CASE("gpu: capturing, instantiating and launching do not wait for a host function that holds the stream") {
  // gpukit::capture may run while earlier work on its stream waits (a host function, or a stream it waits for).
  // The simulator makes none of these calls wait; each runs under a watchdog that opens the gate after 10 s, so a
  // call that does wait on a GPU fails its check instead of hanging, and the output names it.
  GPUKIT_REQUIRE_GPU();
  GPUKIT_CUDA_TRY(cudaSetDevice(0));
  cudaStream_t s = nullptr;
  GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* buffer = nullptr;
  GPUKIT_CUDA_TRY(cudaMalloc(&buffer, buffer_bytes));
  std::printf("capture calls behind a held stream (%s):\n", on_simulator() ? "simulated runtime" : "real runtime");
  for (const bool empty : {true, false}) {
    gate g;
    g.hold(gpukit::stream_view(s));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    const auto step = [&](const char* what, const std::function<cudaError_t()>& call) {
      cudaError_t result = cudaSuccess;
      const bool waited = g.opened_to_return([&] { result = call(); }, std::chrono::seconds(10));
      std::printf("  %-34s (%s graph): returned %-28s %s\n", what, empty ? "empty" : "a memset",
                  cudaGetErrorName(result), waited ? "WAITED for the held stream" : "at once");
      INFO(what << (empty ? " (empty graph)" : " (a memset)"));
      CHECK(result == cudaSuccess);
      CHECK_FALSE(waited);
    };
    step("cudaStreamBeginCapture", [&] { return cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal); });
    if (!empty) step("cudaMemsetAsync (captured)", [&] { return cudaMemsetAsync(buffer, 1, buffer_bytes, s); });
    step("cudaStreamEndCapture", [&] { return cudaStreamEndCapture(s, &graph); });
    step("cudaGraphInstantiate", [&] { return cudaGraphInstantiate(&exec, graph, 0); });
    step("cudaGraphLaunch (behind the gate)", [&] { return cudaGraphLaunch(exec, s); });
    g.open();
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    if (exec != nullptr) CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
    if (graph != nullptr) CHECK(cudaGraphDestroy(graph) == cudaSuccess);
  }
  std::fflush(stdout);
  CHECK(cudaFree(buffer) == cudaSuccess);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
#ifdef GPUKIT_TEST_ON_CUDASIM
  CHECK(cudasim::violations().empty());
#endif
}

namespace {

/// A question about a stream, asked of the stream being captured: what gpukit may ask of a raw handle (its device,
/// its id, its flags) to name it, in a free made during the capture (pinned_memory_resource::deallocate).
struct stream_question {
  const char* call;
  rule expected;
  std::function<cudaError_t(cudaStream_t)> ask;  // empty where the driver lacks the entry point
};

/// A driver function of the stream, through the runtime's entry point (gpukit never links libcuda), or null.
template <class Function>
Function* driver_function(const char* symbol, unsigned version) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &function, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function*>(function);
}

/// A driver function's result as the table prints it: cudaErrorUnknown for any failure, whose CUresult is printed
/// (the simulator assumes CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906, for the legacy stream's questions).
cudaError_t driver_answer(const char* call, CUresult result) {
  if (result == CUDA_SUCCESS) return cudaSuccess;
  std::printf("    (%s: CUresult %d)\n", call, static_cast<int>(result));
  return cudaErrorUnknown;
}

std::vector<stream_question> stream_questions() {
  using get_ctx = CUresult CUDAAPI(CUstream, CUcontext*);
  using get_device = CUresult CUDAAPI(CUstream, CUdevice*);
  get_ctx* const stream_get_ctx = driver_function<get_ctx>("cuStreamGetCtx", 12000);
  get_device* const stream_get_device = driver_function<get_device>("cuStreamGetDevice", 12080);
  // clang-format off
  std::vector<stream_question> questions = {
    {"cudaStreamGetDevice", rule::prohibited, [](cudaStream_t s) {
      int ordinal = -1;
      return cudaStreamGetDevice(s, &ordinal); }},
    {"cudaStreamGetId", rule::prohibited, [](cudaStream_t s) {
      unsigned long long id = 0;
      return cudaStreamGetId(s, &id); }},
    {"cudaStreamGetFlags", rule::prohibited, [](cudaStream_t s) {
      unsigned flags = 0;
      return cudaStreamGetFlags(s, &flags); }},
    {"cudaStreamGetPriority", rule::permitted, [](cudaStream_t s) {
      int priority = 0;
      return cudaStreamGetPriority(s, &priority); }},
    {"cudaStreamIsCapturing", rule::permitted, [](cudaStream_t s) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      return cudaStreamIsCapturing(s, &status); }},
  };
  // clang-format on
  questions.push_back({"cuStreamGetCtx", rule::permitted, nullptr});
  if (stream_get_ctx != nullptr) {
    questions.back().ask = [stream_get_ctx](cudaStream_t s) {
      CUcontext context = nullptr;
      return driver_answer("cuStreamGetCtx", stream_get_ctx(s, &context));
    };
  }
  // What gpukit asks of a raw handle during a capture instead of cudaStreamGetDevice (cuda_backend::stream_device).
  using ctx_get_device = CUresult CUDAAPI(CUdevice*, CUcontext);
  ctx_get_device* const context_device = driver_function<ctx_get_device>("cuCtxGetDevice", 13000);
  questions.push_back({"cuStreamGetCtx+cuCtxGetDevice", rule::permitted, nullptr});
  if (stream_get_ctx != nullptr && context_device != nullptr) {
    questions.back().ask = [stream_get_ctx, context_device](cudaStream_t s) {
      CUcontext context = nullptr;
      CUdevice device = -1;
      if (const cudaError_t e = driver_answer("cuStreamGetCtx", stream_get_ctx(s, &context)); e != cudaSuccess)
        return e;
      if (const cudaError_t e = driver_answer("cuCtxGetDevice", context_device(&device, context)); e != cudaSuccess) {
        return e;
      }
      return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
    };
  }
  questions.push_back({"cuStreamGetDevice", rule::prohibited, nullptr});
  if (stream_get_device != nullptr) {
    questions.back().ask = [stream_get_device](cudaStream_t s) {
      CUdevice device = 0;
      return driver_answer("cuStreamGetDevice", stream_get_device(s, &device));
    };
  }
  return questions;
}

const char* name_of(cudaStreamCaptureMode mode) {
  switch (mode) {
    case cudaStreamCaptureModeGlobal:
      return "global";
    case cudaStreamCaptureModeThreadLocal:
      return "thread-local";
    case cudaStreamCaptureModeRelaxed:
      return "relaxed";
  }
  return "?";
}

/// What asking `q` of `asked` did while `s` was captured in `mode`: the answer, and whether the capture survived
/// (still active afterwards, and ended with a graph). The capture is begun and ended here; the last error is cleared.
struct capture_answer {
  cudaError_t returned;
  bool intact;
};
capture_answer ask_during_capture(const stream_question& q, cudaStream_t s, cudaStream_t asked,
                                  cudaStreamCaptureMode mode) {
  GPUKIT_CUDA_TRY(cudaStreamBeginCapture(s, mode));
  const cudaError_t returned = q.ask(asked);
  (void)cudaGetLastError();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GPUKIT_CUDA_TRY(cudaStreamIsCapturing(s, &status));
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  return {returned, status == cudaStreamCaptureStatusActive && ended == cudaSuccess};
}

}  // namespace

TEST_CASE("gpu: asking a captured stream its device, id or flags invalidates the capture, its priority does not") {
  // Measured on an H200 (driver 580, 2026-12-04): a pinned_memory_resource free during a capture, which asked the raw
  // handle its device and id, invalidated a thread-local capture (the simulator then permitted both questions). Each
  // question is asked of a stream being captured, in every mode, of blocking and non-blocking streams, with and
  // without earlier work held on the stream; the capture's state is printed and compared with the table above,
  // which the simulator enforces. The driver's questions are asked where the driver has them (the simulator has
  // cuStreamGetCtx and cuCtxGetDevice, not cuStreamGetDevice).
  GPUKIT_REQUIRE_GPU();
  GPUKIT_CUDA_TRY(cudaSetDevice(0));
  std::printf("questions to a captured stream (%s):\n", on_simulator() ? "simulated runtime" : "real runtime");
  for (const stream_question& q : stream_questions()) {
    if (!q.ask) {
      std::printf("  %-30s not asked: the driver lacks it\n", q.call);
      continue;
    }
    for (const cudaStreamCaptureMode mode :
         {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed}) {
      for (const bool blocking : {false, true}) {
        for (const bool held : {false, true}) {
          cudaStream_t s = nullptr;
          GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&s, blocking ? cudaStreamDefault : cudaStreamNonBlocking));
          gate g;
          if (held) g.hold(gpukit::stream_view(s));
          const auto [returned, intact] = ask_during_capture(q, s, s, mode);
          g.open();
          CHECK(cudaStreamSynchronize(s) == cudaSuccess);
          CHECK(cudaStreamDestroy(s) == cudaSuccess);
          std::printf("  %-30s %-12s %-12s %-9s returned %-30s capture %s\n", q.call, name_of(mode),
                      blocking ? "blocking" : "non-blocking", held ? "held" : "idle", cudaGetErrorName(returned),
                      intact ? "intact" : "INVALIDATED");
          const std::string what = std::string(q.call) + " in a " + name_of(mode) + " capture of a " +
                                   (blocking ? "blocking" : "non-blocking") + (held ? " held" : " idle") +
                                   " stream: returned " + cudaGetErrorName(returned);
          INFO(what);
          if (q.expected == rule::permitted) {
            CHECK(returned == cudaSuccess);
            CHECK(intact);
          } else {
            CHECK(returned != cudaSuccess);
            CHECK_FALSE(intact);
          }
#ifdef GPUKIT_TEST_ON_CUDASIM
          CHECK(cudasim::take_violations().size() == (q.expected == rule::prohibited ? 1u : 0u));
#endif
        }
      }
    }
  }
  std::fflush(stdout);
}

namespace {

/// What a question asked of the legacy default stream returns while another stream of its device is captured.
struct legacy_answer {
  bool refused;  // returns cudaErrorStreamCaptureImplicit (the driver's CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
  bool intact;   // the capture survives the question
};

/// The answers measured on an H200 (driver 580, 2026-12-04) during a blocking capture, which the legacy stream would
/// join: every question fails and invalidates the capture, the priority and the driver's cuStreamGetCtx too, except
/// cudaStreamIsCapturing (the header's documented refusal, which leaves it intact). During a non-blocking capture
/// every question is answered and the capture stays intact.
legacy_answer legacy_answer_in_blocking_capture(const std::string& call) {
  if (call == "cudaStreamIsCapturing") return {true, true};
  return {true, false};
}

}  // namespace

TEST_CASE(
    "gpu: asking the legacy default stream anything but its capture status joins a blocking capture, which fails") {
  // Measured on an H200 (driver 580, 2026-12-04): cudaStreamGetId(cudaStreamLegacy) while a blocking stream was
  // captured returned cudaErrorStreamCaptureImplicit and invalidated the capture (the simulator had permitted it); so
  // did every other question of the legacy stream this test asks. gpukit asks the legacy stream's id once per
  // process and never during a blocking capture (cudaStreamIsCapturing first), nor its device, flags or priority
  // (default handles name the current device and are never wrapped). Each question above is asked of the legacy
  // stream, in every mode, while a blocking or a non-blocking stream of the device is captured.
  GPUKIT_REQUIRE_GPU();
  GPUKIT_CUDA_TRY(cudaSetDevice(0));
  std::printf("questions to the legacy stream during a capture (%s):\n",
              on_simulator() ? "simulated runtime" : "real runtime");
  for (const stream_question& q : stream_questions()) {
    if (!q.ask) {
      std::printf("  %-30s not asked: the driver lacks it\n", q.call);
      continue;
    }
    for (const cudaStreamCaptureMode mode :
         {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed}) {
      for (const bool blocking : {false, true}) {
        cudaStream_t s = nullptr;
        GPUKIT_CUDA_TRY(cudaStreamCreateWithFlags(&s, blocking ? cudaStreamDefault : cudaStreamNonBlocking));
        const auto [returned, intact] = ask_during_capture(q, s, cudaStreamLegacy, mode);
        CHECK(cudaStreamDestroy(s) == cudaSuccess);
        std::printf("  %-30s %-12s %-12s returned %-30s capture %s\n", q.call, name_of(mode),
                    blocking ? "blocking" : "non-blocking", cudaGetErrorName(returned),
                    intact ? "intact" : "INVALIDATED");
        const std::string what = std::string(q.call) + " of the legacy stream in a " + name_of(mode) +
                                 " capture of a " + (blocking ? "blocking" : "non-blocking") + " stream: returned " +
                                 cudaGetErrorName(returned);
        INFO(what);
        const legacy_answer expected =
            blocking ? legacy_answer_in_blocking_capture(q.call) : legacy_answer{false, true};
        CHECK((returned != cudaSuccess) == expected.refused);
        CHECK(intact == expected.intact);
#ifdef GPUKIT_TEST_ON_CUDASIM
        CHECK(cudasim::take_violations().size() == (expected.intact ? 0u : 1u));
#endif
      }
    }
  }
  std::fflush(stdout);
}
