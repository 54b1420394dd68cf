// gpu_monitor on the simulator's two devices, read through the fake NVML in its cudasim mode (tests/fake_nvml.cpp):
// devices mapped to NVML by PCI bus id (the fake does not know the simulator's UUIDs), samples, history, the
// background thread, the status line and table, and that monitoring creates no CUDA context. Also select_device's
// view of the simulated machine: CUDA failing to initialise, and NVML telemetry that knows none of the devices.
#include <gpukit/device/gpu_monitor.hpp>
#include <gpukit/device/select.hpp>

#include "cudasim.hpp"
#include "fake_nvml_control.hpp"
#include "support.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

// The fake NVML with the simulator's machine: NVML reads FAKE_NVML_MACHINE at nvmlInit, in the constructor.
struct cudasim_nvml {
  gpukit_test::scoped_env machine{"FAKE_NVML_MACHINE", std::string("cudasim")};
  gpukit::nvml::library library{GPUKIT_FAKE_NVML_PATH};
};

void fake_set(unsigned gpu, const char* field, long long value) {
  gpukit_test::set_fake_nvml(GPUKIT_FAKE_NVML_PATH, gpu, field, value);
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Waits (bounded) until `done` holds; a test fails on the bound, it never measures time.
template <class Predicate>
bool eventually(Predicate done) {
  for (int i = 0; i < 10000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

}  // namespace

TEST_CASE("the monitor samples every simulated device through NVML and creates no context") {
  cudasim_nvml nvml;
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(0);  // sampled by the test only
  gpukit::gpu_monitor monitor(options, nvml.library);
  REQUIRE(monitor.active());
  CHECK(monitor.status() == "GPU monitor: 2 devices through NVML");
  CHECK(monitor.devices().size() == 2);
  CHECK(monitor.latest().empty());
  CHECK(monitor.status_line().empty());

  const auto round = monitor.sample_now();
  REQUIRE(round.size() == 2);
  CHECK(round[0].device == gpukit::device::cuda(0));
  CHECK(round[1].device == gpukit::device::cuda(1));
  REQUIRE(round[0].values.memory);
  CHECK(round[0].values.memory->used == (10ull << 30));
  CHECK(round[0].values.process_memory == (3ull << 30));
  CHECK_FALSE(round[1].values.process_memory.has_value());  // this process does not use the second GPU
  CHECK(round[1].values.clock_limits ==
        (gpukit::nvml::clock_limit::software_power_cap | gpukit::nvml::clock_limit::hardware_thermal));
  CHECK(monitor.rounds() == 1);

  const std::string line = monitor.status_line();
  CHECK(contains(line, "cuda:0 12% busy 10.00 GiB / 80.00 GiB (this process 3.00 GiB) 41 C 123 / 700 W 1980 MHz"));
  CHECK_FALSE(contains(line.substr(0, line.find(" | ")), "["));  // an idle GPU's clock limit is not news
  CHECK(contains(line, " | cuda:1 0% busy 0 B / 80.00 GiB 41 C"));
  CHECK(contains(line, "[power cap, hw thermal]"));

  const std::string table = monitor.table();
  CHECK(contains(table, "| device | name"));
  CHECK(contains(
      table, "| cuda:0 | NVIDIA H100 80GB HBM3 (cudasim) | 41 C | 123 / 700 W   | 10.00 GiB / 80.00 GiB | 3.00 GiB"));
  CHECK(contains(table, "| 12 / 1% "));
  CHECK(contains(table, "| 1980 / 2619 MHz"));
  CHECK(contains(table, "| 1.00 MiB/s / 2.00 MiB/s"));
  CHECK(contains(table, "| power cap, hw thermal |"));
  CHECK(cudasim::context_creations(0) == 0);
  CHECK(cudasim::context_creations(1) == 0);
}

TEST_CASE("the history keeps the newest samples of each device, and changes show in the next sample") {
  cudasim_nvml nvml;
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(0);
  options.history_length = 2;
  options.devices = {gpukit::device::cuda(1)};
  gpukit::gpu_monitor monitor(options, nvml.library);
  for (long long temperature : {50, 60, 70}) {
    fake_set(1, "temperature_c", temperature);
    monitor.sample_now();
  }
  const auto history = monitor.history(gpukit::device::cuda(1));
  REQUIRE(history.size() == 2);
  CHECK(history[0].values.temperature_c == 60u);
  CHECK(history[1].values.temperature_c == 70u);
  CHECK(history[0].time <= history[1].time);
  CHECK(monitor.history(gpukit::device::cuda(0)).empty());  // not watched
  REQUIRE(monitor.latest().size() == 1);
  CHECK(monitor.latest()[0].values.temperature_c == 70u);
}

TEST_CASE("the background thread samples at its period, calls on_sample, and stops with the monitor") {
  cudasim_nvml nvml;
  std::atomic<int> callbacks{0};
  std::atomic<std::size_t> devices_seen{0};
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(1);
  options.history_length = 3;
  options.read_pcie = false;
  options.on_sample = [&](const gpukit::gpu_monitor& monitor, const std::vector<gpukit::device_sample>& round) {
    devices_seen = round.size();
    CHECK(monitor.latest().size() == round.size());  // the monitor is usable from its own callback
    ++callbacks;
  };
  {
    gpukit::gpu_monitor monitor(options, nvml.library);
    REQUIRE(eventually([&] { return monitor.rounds() >= 5 && callbacks >= 5; }));
    CHECK(devices_seen == 2);
    CHECK(monitor.history(gpukit::device::cuda(0)).size() == 3);
    CHECK_FALSE(monitor.latest()[0].values.pcie_rx_kib_per_s.has_value());
    monitor.sample_now();  // concurrent with the thread: rounds are serialized
  }
  const int after_destruction = callbacks;
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(callbacks == after_destruction);
}

TEST_CASE("on_sample may destroy its monitor, and the sampling thread then leaves it alone") {
  // A server shutting monitoring down from a sample: the destructor cannot wait for its own thread (std::thread::join
  // would throw inside it, terminating the process), and the thread must not touch the monitor once on_sample returns.
  cudasim_nvml nvml;
  std::unique_ptr<gpukit::gpu_monitor> monitor;
  std::atomic<bool> destroyed{false};
  std::mutex made;  // on_sample waits until `monitor` holds the monitor
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(1);
  options.read_pcie = false;
  options.on_sample = [&](const gpukit::gpu_monitor&, const std::vector<gpukit::device_sample>&) {
    { const std::lock_guard<std::mutex> wait_until_held(made); }
    monitor.reset();
    destroyed = true;  // the callable's captures outlive the monitor
  };
  {
    const std::lock_guard<std::mutex> hold(made);
    monitor = std::make_unique<gpukit::gpu_monitor>(options, nvml.library);
  }
  REQUIRE(eventually([&] { return destroyed.load(); }));
  CHECK(monitor == nullptr);
}

TEST_CASE("a throwing on_sample is reported in status and sampling goes on") {
  cudasim_nvml nvml;
  std::atomic<int> calls{0};
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(1);
  options.on_sample = [&](const gpukit::gpu_monitor&, const std::vector<gpukit::device_sample>&) {
    ++calls;
    throw std::runtime_error("printer on fire");
  };
  gpukit::gpu_monitor monitor(options, nvml.library);
  REQUIRE(eventually([&] { return calls >= 3; }));
  CHECK(monitor.status() == "GPU monitor: 2 devices through NVML; last error: on_sample threw: printer on fire");
}

TEST_CASE("without NVML the monitor is inactive and silent") {
  const gpukit::nvml::library missing("/nonexistent/libnvidia-ml.so.1");
  gpukit::gpu_monitor monitor({}, missing);
  CHECK_FALSE(monitor.active());
  CHECK(contains(monitor.status(), "GPU monitor inactive: NVML not loaded"));
  CHECK(monitor.sample_now().empty());
  CHECK(monitor.rounds() == 0);
  CHECK(monitor.status_line().empty());
  CHECK(monitor.table() == monitor.status() + "\n");
}

TEST_CASE("a monitor whose devices NVML does not know is inactive and says why") {
  // The fake's default machine has other UUIDs and PCI bus ids than the simulator's devices.
  gpukit_test::scoped_env machine("FAKE_NVML_MACHINE", std::nullopt);
  const gpukit::nvml::library nvml(GPUKIT_FAKE_NVML_PATH);
  gpukit::gpu_monitor monitor({}, nvml);
  CHECK_FALSE(monitor.active());
  CHECK(monitor.status() ==
        "GPU monitor inactive: NVML knows none of the 2 device(s) (looked up by UUID and PCI bus id)");
  CHECK(monitor.sample_now().empty());
  CHECK(monitor.rounds() == 0);
}

TEST_CASE("a device that disappears leaves the latest samples, and the status says so") {
  cudasim_nvml nvml;
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds(0);
  gpukit::gpu_monitor monitor(options, nvml.library);
  REQUIRE(monitor.sample_now().size() == 2);
  fake_set(0, "lost", 1);  // fallen off the bus
  const auto round = monitor.sample_now();
  REQUIRE(round.size() == 1);
  CHECK(round[0].device == gpukit::device::cuda(1));
  REQUIRE(monitor.latest().size() == 1);
  CHECK(monitor.latest()[0].device == gpukit::device::cuda(1));
  CHECK(monitor.history(gpukit::device::cuda(0)).size() == 1);  // its old sample stays in the history
  CHECK(monitor.status_line().rfind("cuda:1", 0) == 0);
  CHECK(contains(monitor.status(), "; not found by NVML in the last round: cuda:0"));
  fake_set(0, "lost", 0);
  CHECK(monitor.sample_now().size() == 2);
  CHECK(monitor.latest().size() == 2);
  CHECK_FALSE(contains(monitor.status(), "not found"));
}

TEST_CASE("a period too long to wait for is a year, not a busy loop") {
  cudasim_nvml nvml;
  gpukit::gpu_monitor_options options;
  options.period = std::chrono::milliseconds::max();
  options.read_pcie = false;
  gpukit::gpu_monitor monitor(options, nvml.library);
  REQUIRE(eventually([&] { return monitor.rounds() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(monitor.rounds() == 1);  // an overflowing wait returned at once: thousands of rounds
}

TEST_CASE("bad device lists are refused by name") {
  cudasim_nvml nvml;
  gpukit::gpu_monitor_options cpu;
  cpu.devices = {gpukit::device::cpu()};
  CHECK_THROWS_WITH_AS(gpukit::gpu_monitor(cpu, nvml.library), "gpu_monitor: cpu is not a CUDA device",
                       gpukit::invalid_argument_error);
  gpukit::gpu_monitor_options twice;
  twice.devices = {gpukit::device::cuda(1), gpukit::device::cuda(1)};
  CHECK_THROWS_WITH_AS(gpukit::gpu_monitor(twice, nvml.library), "gpu_monitor: cuda:1 is listed twice",
                       gpukit::invalid_argument_error);
  gpukit::gpu_monitor_options missing;
  missing.devices = {gpukit::device::cuda(5)};
  CHECK_THROWS_AS(gpukit::gpu_monitor(missing, nvml.library), gpukit::invalid_argument_error);  // as documented
}

TEST_CASE("status line and table format any samples, unknown figures shown as -") {
  gpukit::device_sample bare{gpukit::device::cuda(3), {}, {}};
  CHECK(gpukit::gpu_monitor::format_status_line({bare}) == "cuda:3");
  const std::string table = gpukit::gpu_monitor::format_table({bare}, {"Some GPU"});
  CHECK(contains(table, "| cuda:3 | Some GPU | -    | -"));
  CHECK(table.front() == '+');
  CHECK(table.back() == '\n');
}

namespace {
// select_device as on a machine where only the policy decides.
struct policy_decides {
  gpukit_test::scoped_env no_override{"GPUKIT_DEVICE", std::nullopt};
  gpukit_test::scoped_env no_rank1{"LOCAL_RANK", std::nullopt};
  gpukit_test::scoped_env no_rank2{"OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt};
  gpukit_test::scoped_env no_rank3{"SLURM_LOCALID", std::nullopt};
  gpukit_test::scoped_env no_rank4{"MPI_LOCALRANKID", std::nullopt};
};
}  // namespace

TEST_CASE("select: CUDA failing to initialise falls back to the CPU with a warning, or throws with require_gpu") {
  policy_decides environment;
  // 803: a driver upgraded without a reboot; then other failures that are not "no GPU".
  for (const cudaError_t failure : {cudaErrorSystemDriverMismatch, cudaErrorInitializationError, cudaErrorUnknown,
                                    cudaErrorCompatNotSupportedOnDevice, cudaErrorOperatingSystem}) {
    CAPTURE(failure);
    const std::string named =
        std::string(cudaGetErrorName(failure)) + " (" + std::to_string(static_cast<int>(failure)) + ")";
    {
      gpukit_test::captured_warnings warnings;
      cudasim::fail_call("cudaGetDeviceCount", 1, failure);
      const gpukit::device_selection s = gpukit::select_device();
      CHECK(s.device.is_cpu());
      CHECK(s.source == gpukit::device_selection::decided_by::cpu_fallback);
      CHECK(s.reason.find("CUDA failed to initialise, so no GPU is usable: cudaGetDeviceCount returned " + named) == 0);
      REQUIRE(warnings.messages().size() == 1);
      CHECK(
          warnings.contains("select_device: CUDA failed to initialise, so no GPU is usable: cudaGetDeviceCount "
                            "returned " +
                            named));
      CHECK(warnings.contains("; using the CPU (selection_policy::require_gpu makes this an error)"));
      if (failure == cudaErrorSystemDriverMismatch) CHECK(warnings.contains("driver upgrade without a reboot"));
    }
    gpukit::selection_policy require;
    require.require_gpu = true;
    cudasim::fail_call("cudaGetDeviceCount", 1, failure);
    try {
      (void)gpukit::select_device(require);
      FAIL("a required GPU behind a CUDA that failed to initialise was not an error");
    } catch (const gpukit::no_device_error& e) {
      CHECK(std::string(e.what()).find("select_device: a GPU is required, but CUDA failed to initialise") == 0);
      CHECK(e.cuda_result() == failure);
      CHECK(e.call() == "cudaGetDeviceCount");
    }
    CHECK(cudaPeekAtLastError() == cudaSuccess);  // the failure was gpukit's question, not the program's
  }
  // No driver is no GPU, not a broken one: the CPU without a warning.
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cudaGetDeviceCount", 1, cudaErrorInsufficientDriver);
  CHECK(gpukit::select_device().device.is_cpu());
  CHECK(warnings.messages().empty());
  CHECK(gpukit::select_device().device == gpukit::device::cuda(0));
}

TEST_CASE("select: the devices and the reason come from one answer of cudaGetDeviceCount") {
  policy_decides environment;
  gpukit_test::captured_warnings warnings;
  // A failure that a second question would not see: the reason still describes it.
  cudasim::fail_call("cudaGetDeviceCount", 1, cudaErrorUnknown);
  const std::size_t before = cudasim::calls("cudaGetDeviceCount");
  gpukit::device_selection s = gpukit::select_device();
  CHECK(cudasim::calls("cudaGetDeviceCount") == before + 1);
  CHECK(s.device.is_cpu());
  CHECK(s.reason.find("cudaGetDeviceCount returned cudaErrorUnknown (999)") != std::string::npos);
  CHECK(warnings.messages().size() == 1);
  // Two devices at the first question, a failure at any later one: both devices are still there.
  cudasim::fail_call("cudaGetDeviceCount", 2, cudaErrorUnknown);
  const gpukit::system_snapshot system = gpukit::take_system_snapshot();
  CHECK(system.gpus.size() == 2);
  CHECK(system.device_count_result == cudaSuccess);
  cudasim::clear_faults();
}

TEST_CASE("select: NVML that knows none of the devices is named as the reason their figures are unknown") {
  policy_decides environment;
  // The fake's default machine: other UUIDs and PCI bus ids than the simulator's devices.
  gpukit_test::scoped_env machine("FAKE_NVML_MACHINE", std::nullopt);
  gpukit_test::scoped_env library("GPUKIT_NVML_LIBRARY", std::string(GPUKIT_FAKE_NVML_PATH));
  REQUIRE(gpukit::nvml::instance().available());  // this process's first use: loaded from the fake
  const std::string none =
      "NVML knows none of the 2 visible devices (looked up by UUID and PCI bus id; NVML loaded from " +
      std::string(GPUKIT_FAKE_NVML_PATH) + ")";
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  gpukit::device_selection s = gpukit::select_device(policy);
  CHECK(s.reason == "the most total memory (80.00 GiB; free memory unknown: " + none + ")");
  policy.prefer = gpukit::device_preference::least_utilized;
  s = gpukit::select_device(policy);
  CHECK(s.reason == "the first eligible device (utilisation unknown: " + none + ")");
  CHECK(gpukit::take_system_snapshot(policy).telemetry == none);
}

TEST_CASE("errors: building a failure's message leaves no CUDA error behind, though its device count fails") {
  (void)cudaGetLastError();
  // The message counts the visible devices: that count fails (as it does without a driver), after the failure
  // being reported was cleared.
  cudasim::fail_call("cudaGetDeviceCount", 1, cudaErrorInsufficientDriver);
  CHECK_THROWS_AS(gpukit::detail::throw_cuda_error(cudaErrorInvalidValue, "cudaMemset", 0, __FILE__, __LINE__),
                  gpukit::invalid_argument_error);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  gpukit_test::captured_warnings warnings;
  cudasim::fail_call("cudaGetDeviceCount", 1, cudaErrorInsufficientDriver);
  gpukit::detail::report_cuda_failure(cudaErrorInvalidResourceHandle, "cudaEventDestroy (in ~event)", 1);
  CHECK(warnings.messages().size() == 1);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

// A device named twice hides every device, and cudaGetDeviceCount fails with cudaErrorInvalidDevice (an H100,
// bench/results/gpu-20261205-1943-H100-questions.md), not cudaErrorNoDevice: a mistake in the variable, named as
// such, not a CUDA that failed to start (helper-202: it warned "CUDA failed to initialise" with an ordinal's hint).
TEST_CASE("select: CUDA_VISIBLE_DEVICES naming a device twice is named as the reason, without a warning") {
  policy_decides environment;
  gpukit_test::scoped_env twice{"CUDA_VISIBLE_DEVICES", std::string("0,0")};  // before the first CUDA call
  int count = -1;
  CHECK(cudaGetDeviceCount(&count) == cudaErrorInvalidDevice);  // the simulator answers as the H100 did
  CHECK(cudaGetLastError() == cudaErrorInvalidDevice);
  const std::string why = gpukit::describe_no_gpu();
  INFO("describe_no_gpu(): " << why);
  CHECK_FALSE(contains(why, "failed to initialise"));
  CHECK(contains(why, "CUDA_VISIBLE_DEVICES=\"0,0\""));
  CHECK(contains(why, "repeats"));
  gpukit_test::captured_warnings warnings;
  const gpukit::device_selection s = gpukit::select_device();
  CHECK(s.device.is_cpu());
  CHECK(contains(s.reason, "a repeated device makes CUDA hide every device"));
  CHECK(warnings.messages().empty());
  // Every device call answers so: no GPU (no_device_error, for a CPU fallback's catch), and the message says why.
  try {
    (void)gpukit::current_device();
    FAIL("cudaGetDevice succeeded with every device hidden");
  } catch (const gpukit::no_device_error& e) {
    CHECK(e.cuda_result() == cudaErrorInvalidDevice);
    CHECK(contains(e.what(), "CUDA hides every device, as it does when CUDA_VISIBLE_DEVICES names a device twice"));
    CHECK_FALSE(contains(e.what(), "the ordinal is not below"));
  }
  CHECK_THROWS_AS((void)gpukit::properties(gpukit::device::cuda(0)), gpukit::no_device_error);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  (void)cudasim::take_violations();
}

// Read without the installed GPUs (as describe_no_gpu reads it), "5,5" repeats an entry; CUDA's list ends at index
// 5, beyond the two devices, before the repeat: no device, cudaErrorNoDevice. The reason is the index, not a repeat
// (helper-210: it was called a repeat).
TEST_CASE("select: a repeat after an entry that names no installed GPU is not given as the reason") {
  gpukit_test::scoped_env beyond{"CUDA_VISIBLE_DEVICES", std::string("5,5")};  // before the first CUDA call
  int count = -1;
  CHECK(cudaGetDeviceCount(&count) == cudaErrorNoDevice);
  (void)cudaGetLastError();
  CHECK(gpukit::visible_devices_in_effect().emptied_by_repeat);  // unverified: the repeat is read
  const std::string why = gpukit::describe_no_gpu();
  INFO("describe_no_gpu(): " << why);
  CHECK_FALSE(contains(why, "repeat"));
  CHECK(contains(why, "CUDA_VISIBLE_DEVICES=\"5,5\""));
  CHECK(contains(why, "nvidia-smi -L"));
  (void)cudasim::take_violations();
}

// A wrong ordinal with devices visible stays an invalid argument.
TEST_CASE("errors: cudaErrorInvalidDevice with devices visible is an invalid argument naming the ordinal") {
  try {
    gpukit::set_current_device(gpukit::device::cuda(5));
    FAIL("cudaSetDevice(5) succeeded on two simulated devices");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(e.cuda_result() == cudaErrorInvalidDevice);
    CHECK(contains(e.what(), "the ordinal is not below the number of visible devices"));
  }
  (void)cudasim::take_violations();
}
