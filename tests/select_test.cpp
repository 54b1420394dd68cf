// Device auto-selection: precedence, policies, fallbacks and errors, on synthetic systems and on this machine.
#include <gpukit/device/select.hpp>

#include "support.hpp"

#include <string>

namespace {

constexpr std::size_t GiB = std::size_t{1} << 30;

gpukit::gpu_snapshot gpu(int ordinal, const char* uuid, int cc, std::size_t total_gib,
                         std::optional<std::size_t> free_gib = std::nullopt,
                         std::optional<unsigned> busy = std::nullopt) {
  gpukit::gpu_snapshot g;
  g.device = gpukit::device::cuda(ordinal);
  g.name = "Test GPU " + std::to_string(ordinal);
  g.uuid = uuid;
  g.compute_capability = cc;
  g.total_memory = total_gib * GiB;
  if (free_gib) {
    g.free_memory = *free_gib * GiB;
    g.free_memory_source = "NVML";
  }
  g.utilization_percent = busy;
  return g;
}

gpukit::system_snapshot three_gpus() {
  gpukit::system_snapshot s;
  s.gpus.push_back(gpu(0, "GPU-aaaa0000-0000-0000-0000-000000000000", 80, 40, 2, 90));
  s.gpus.push_back(gpu(1, "GPU-bbbb0000-0000-0000-0000-000000000000", 90, 80, 70, 10));
  s.gpus.push_back(gpu(2, "GPU-bbbc0000-0000-0000-0000-000000000000", 90, 80, 30, 50));
  s.telemetry = "NVML loaded from test";
  return s;
}

gpukit::system_snapshot no_gpus() {
  gpukit::system_snapshot s;
  s.no_gpu_reason = "no NVIDIA driver is loaded";
  return s;
}

using decided_by = gpukit::device_selection::decided_by;

}  // namespace

TEST_CASE("policy preferences") {
  gpukit::selection_policy policy;
  auto s = three_gpus();
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(0));
  CHECK(gpukit::select_device(policy, s).source == decided_by::policy);
  policy.prefer = gpukit::device_preference::most_free_memory;
  const auto by_memory = gpukit::select_device(policy, s);
  CHECK(by_memory.device == gpukit::device::cuda(1));
  CHECK(by_memory.reason.find("most free memory (70.00 GiB, from NVML)") != std::string::npos);
  policy.prefer = gpukit::device_preference::least_utilized;
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(1));
  s.gpus[1].utilization_percent = 95;
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(2));
}

TEST_CASE("requirements reject devices and say why") {
  gpukit::selection_policy policy;
  policy.min_compute_capability = 90;
  policy.min_free_bytes = 20 * GiB;
  const auto selection = gpukit::select_device(policy, three_gpus());
  CHECK(selection.device == gpukit::device::cuda(1));
  REQUIRE(selection.candidates.size() == 3);
  CHECK_FALSE(selection.candidates[0].eligible);
  CHECK(selection.candidates[0].note.find("compute capability 8.0 is below the required 9.0") != std::string::npos);
  CHECK(selection.candidates[0].note.find("free memory 2.00 GiB is below the required 20.00 GiB") != std::string::npos);
  CHECK(selection.candidates[2].eligible);
  CHECK(selection.report().find("cuda:0 (Test GPU 0): rejected") != std::string::npos);
}

TEST_CASE("no eligible device: CPU fallback, or an error listing every rejection") {
  gpukit::selection_policy policy;
  policy.min_compute_capability = 100;
  const auto fallback = gpukit::select_device(policy, three_gpus());
  CHECK(fallback.device == gpukit::device::cpu());
  CHECK(fallback.source == decided_by::cpu_fallback);
  CHECK(fallback.reason.find("using the CPU") != std::string::npos);
  policy.require_gpu = true;
  try {
    (void)gpukit::select_device(policy, three_gpus());
    FAIL("no error");
  } catch (const gpukit::no_device_error& e) {
    const std::string what = e.what();
    CHECK(what.find("select_device: a GPU is required, but no visible device meets the policy") == 0);
    CHECK(what.find("cuda:0 (Test GPU 0): compute capability 8.0 is below the required 10.0") != std::string::npos);
    CHECK(what.find("cuda:2 (Test GPU 2): compute capability 9.0") != std::string::npos);
  }
}

TEST_CASE("a snapshot whose CUDA failed to initialise: the CPU with a warning, or an error carrying the result") {
  gpukit::system_snapshot s;
  s.device_count_result = cudaErrorSystemDriverMismatch;
  s.no_gpu_reason = gpukit::detail::describe_device_count(s.device_count_result, 0);
  CHECK(s.no_gpu_reason.find("CUDA failed to initialise, so no GPU is usable: cudaGetDeviceCount returned "
                             "cudaErrorSystemDriverMismatch (803): ") == 0);
  CHECK(s.no_gpu_reason.find("driver upgrade without a reboot") != std::string::npos);
  gpukit::selection_policy policy;
  policy.use_environment = false;
  {
    gpukit_test::captured_warnings warnings;
    const auto selection = gpukit::select_device(policy, s);
    CHECK(selection.device == gpukit::device::cpu());
    CHECK(selection.reason == s.no_gpu_reason + "; using the CPU");
    REQUIRE(warnings.messages().size() == 1);
    CHECK(warnings.messages()[0] ==
          "select_device: " + s.no_gpu_reason + "; using the CPU (selection_policy::require_gpu makes this an error)");
  }
  policy.require_gpu = true;
  try {
    (void)gpukit::select_device(policy, s);
    FAIL("no error");
  } catch (const gpukit::no_device_error& e) {
    CHECK(std::string(e.what()) == "select_device: a GPU is required, but " + s.no_gpu_reason);
    CHECK(e.cuda_result() == cudaErrorSystemDriverMismatch);
    CHECK(e.call() == "cudaGetDeviceCount");
  }
  // A GPU asked for through GPUKIT_DEVICE (an ordinal, any GPU, a UUID) carries the same result.
  for (const char* asked : {"cuda:0", "cuda", "GPU-0123"}) {
    CAPTURE(asked);
    gpukit::system_snapshot with_override = s;
    with_override.gpukit_device = asked;
    gpukit::selection_policy from_environment;
    try {
      (void)gpukit::select_device(from_environment, with_override);
      FAIL("no error");
    } catch (const gpukit::no_device_error& e) {
      CHECK(std::string(e.what()).find("asks for a GPU, but none is usable: " + s.no_gpu_reason) != std::string::npos);
      CHECK(e.cuda_result() == cudaErrorSystemDriverMismatch);
      CHECK(e.call() == "cudaGetDeviceCount");
    }
  }
  // No driver, the stub library, no GPU: nothing is broken, so no warning.
  policy.require_gpu = false;
  gpukit_test::captured_warnings warnings;
  for (const cudaError_t none : {cudaErrorInsufficientDriver, cudaErrorStubLibrary, cudaErrorNoDevice, cudaSuccess}) {
    s.device_count_result = none;
    CHECK(gpukit::select_device(policy, s).device == gpukit::device::cpu());
  }
  CHECK(warnings.messages().empty());
}

TEST_CASE("without free-memory telemetry, total memory stands in and the reason says so") {
  auto s = three_gpus();
  for (auto& g : s.gpus) g.free_memory.reset();
  s.gpus[2].total_memory = 141 * GiB;
  s.telemetry = "NVML not loaded: libnvidia-ml.so.1: cannot open shared object file";
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  policy.min_free_bytes = 50 * GiB;
  const auto selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(2));
  CHECK(selection.reason.find("free memory unknown") != std::string::npos);
  CHECK(selection.candidates[0].note.find("total memory (free unknown) 40.00 GiB") != std::string::npos);
  CHECK(selection.candidates[1].note == "free memory unknown; compared total memory");
}

TEST_CASE("most_free_memory ranks devices whose free memory is known above those whose free memory is not") {
  // NVML answered for some devices only: a device's total memory says nothing of what others use there.
  auto s = three_gpus();
  s.gpus[1].free_memory.reset();  // 80 GiB in total, free unknown
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  const auto selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(2));  // 30 GiB free, known
  CHECK(selection.reason.find("the most free memory (30.00 GiB, from NVML)") != std::string::npos);
  CHECK(selection.reason.find("free memory of cuda:1 unknown, so not compared") != std::string::npos);
  s.gpus[2].free_memory.reset();
  s.gpus[0].free_memory.reset();  // none known: total memory decides
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(1));
}

TEST_CASE("GPUKIT_DEVICE overrides everything") {
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;
  auto s = three_gpus();
  s.local_rank_variable = "LOCAL_RANK";
  s.local_rank = "1";
  s.gpukit_device = "cuda:2";
  auto selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(2));
  CHECK(selection.source == decided_by::environment_override);
  s.gpukit_device = "cpu";
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cpu());
  s.gpukit_device = " GPU-bbbc ";
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(2));
  s.gpukit_device = "GPU-aaaa0000-0000-0000-0000-000000000000";
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(0));
  s.gpukit_device = "cuda";
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(0));
  SUBCASE("an override of a device that fails the policy still wins, and says so") {
    policy.min_compute_capability = 90;
    s.gpukit_device = "cuda:0";
    selection = gpukit::select_device(policy, s);
    CHECK(selection.device == gpukit::device::cuda(0));
    CHECK(selection.reason.find("although compute capability 8.0") != std::string::npos);
  }
  SUBCASE("an empty GPUKIT_DEVICE is ignored") {
    s.gpukit_device = "  ";
    CHECK(gpukit::select_device(policy, s).source == decided_by::local_rank);
  }
  SUBCASE("use_environment = false ignores it") {
    policy.use_environment = false;
    CHECK(gpukit::select_device(policy, s).source == decided_by::policy);
  }
}

TEST_CASE("bad GPUKIT_DEVICE values throw clear errors") {
  gpukit::selection_policy policy;
  auto s = three_gpus();
  auto message_for = [&](const char* value) -> std::string {
    s.gpukit_device = value;
    try {
      (void)gpukit::select_device(policy, s);
    } catch (const gpukit::error& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(message_for("gpu0") ==
        "GPUKIT_DEVICE=\"gpu0\" is not a device: expected \"cpu\", \"cuda\", \"cuda:N\" or a GPU UUID (GPU-...)");
  CHECK(message_for("cuda:3").find("GPUKIT_DEVICE=\"cuda:3\" names cuda:3, but only 3 devices visible") == 0);
  CHECK(message_for("GPU-cccc")
            .find("GPUKIT_DEVICE=\"GPU-cccc\" matches no visible device (3 devices visible: "
                  "cuda:0 GPU-aaaa0000") == 0);
  CHECK(message_for("GPU-bbb").find("is ambiguous: it is a prefix of 2 visible devices' UUIDs") != std::string::npos);
  s = no_gpus();
  CHECK(message_for("cuda:0") ==
        "GPUKIT_DEVICE=\"cuda:0\" asks for a GPU, but none is usable: no NVIDIA driver is loaded");
  // A UUID asks for a GPU too: the same error, with the reason, not "matches no visible device".
  CHECK(message_for("GPU-1234") ==
        "GPUKIT_DEVICE=\"GPU-1234\" asks for a GPU, but none is usable: no NVIDIA driver is loaded");
  s.gpukit_device = "GPU-1234";
  CHECK_THROWS_AS(gpukit::select_device(policy, s), gpukit::no_device_error);
  policy.require_gpu = true;
  s = three_gpus();
  CHECK(message_for("cpu") == "GPUKIT_DEVICE=\"cpu\" selects the CPU, but the policy requires a GPU");
}

TEST_CASE("the launcher's local rank maps onto the visible devices") {
  gpukit::selection_policy policy;
  policy.prefer = gpukit::device_preference::most_free_memory;  // ignored: the rank decides
  auto s = three_gpus();
  s.local_rank_variable = "SLURM_LOCALID";
  s.local_rank = "2";
  auto selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(2));
  CHECK(selection.source == decided_by::local_rank);
  CHECK(selection.reason == "SLURM_LOCALID=2 maps to cuda:2 (rank % 3 visible)");
  s.local_rank = "4";
  selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(1));
  CHECK(selection.reason.find("more ranks than devices") != std::string::npos);
  SUBCASE("a rank whose device fails the policy is an error, not a silent change of device") {
    policy.min_compute_capability = 90;
    s.local_rank = "0";
    CHECK_THROWS_WITH_AS(gpukit::select_device(policy, s),
                         doctest::Contains("SLURM_LOCALID=0 maps to cuda:0 (rank % 3 visible), which does not"),
                         gpukit::no_device_error);
  }
  SUBCASE("malformed ranks are errors") {
    for (const char* bad : {"", "-1", "one", "1.5", "99999999999"}) {
      s.local_rank = bad;
      CHECK_THROWS_AS(gpukit::select_device(policy, s), gpukit::invalid_argument_error);
    }
  }
  SUBCASE("without GPUs a rank is ignored and the CPU is used") {
    auto none = no_gpus();
    none.local_rank_variable = "LOCAL_RANK";
    none.local_rank = "3";
    CHECK(gpukit::select_device(policy, none).device == gpukit::device::cpu());
  }
}

TEST_CASE("on this machine without a driver: the CPU, or an error that says why") {
  if (gpukit::device_count() != 0) {
    std::printf("GPUKIT_TEST_SKIPPED: this test checks behaviour without a GPU\n");
    return;
  }
  gpukit_test::scoped_env no_override("GPUKIT_DEVICE", std::nullopt);
  gpukit_test::scoped_env no_rank1("LOCAL_RANK", std::nullopt);
  gpukit_test::scoped_env no_rank2("OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt);
  gpukit_test::scoped_env no_rank3("SLURM_LOCALID", std::nullopt);
  gpukit_test::scoped_env no_rank4("MPI_LOCALRANKID", std::nullopt);
  const auto selection = gpukit::select_device();
  CHECK(selection.device == gpukit::device::cpu());
  CHECK(selection.source == decided_by::cpu_fallback);
  CHECK(selection.reason ==
        "no NVIDIA driver is loaded (cudaGetDeviceCount returned cudaErrorInsufficientDriver), so no CUDA device "
        "is usable; using the CPU");
  gpukit::selection_policy require;
  require.require_gpu = true;
  CHECK_THROWS_WITH_AS(gpukit::select_device(require),
                       "select_device: a GPU is required, but no NVIDIA driver is loaded (cudaGetDeviceCount "
                       "returned cudaErrorInsufficientDriver), so no CUDA device is usable",
                       gpukit::no_device_error);
  gpukit_test::scoped_env override_cpu("GPUKIT_DEVICE", std::string("cpu"));
  CHECK(gpukit::select_device().source == decided_by::environment_override);
}

TEST_CASE("a device that cannot be used is rejected with why, beside any other reason") {
  gpukit::selection_policy policy;
  policy.min_compute_capability = 85;
  auto s = three_gpus();
  s.gpus[1].unusable = "its memory could not be queried: busy";
  const auto selection = gpukit::select_device(policy, s);
  CHECK(selection.device == gpukit::device::cuda(2));
  CHECK(selection.candidates[0].note.find("compute capability 8.0 is below") != std::string::npos);
  CHECK_FALSE(selection.candidates[1].eligible);
  CHECK(selection.candidates[1].note == "its memory could not be queried: busy");
  s.gpus[0].unusable = "unreachable";
  const auto again = gpukit::select_device(policy, s);
  CHECK(again.candidates[0].note.find("unreachable; compute capability 8.0 is below") == 0);
  // A device in prohibited compute mode is refused, whatever else it offers.
  s = three_gpus();
  s.gpus[1].compute_mode = cudaComputeModeProhibited;
  policy.min_compute_capability = 0;
  policy.prefer = gpukit::device_preference::most_free_memory;
  const auto drained = gpukit::select_device(policy, s);
  CHECK(drained.device == gpukit::device::cuda(2));  // cuda:1 has the most free memory, but may not be used
  CHECK(drained.candidates[1].note.find("compute mode is prohibited") != std::string::npos);
}

TEST_CASE("a blank launcher variable is not a rank: the next one set decides") {
  // `export LOCAL_RANK=$SLURM_LOCALID` outside Slurm leaves LOCAL_RANK empty, as GPUKIT_DEVICE blank is unset.
  gpukit_test::scoped_env blank("LOCAL_RANK", std::string("  "));
  gpukit_test::scoped_env no_rank2("OMPI_COMM_WORLD_LOCAL_RANK", std::nullopt);
  gpukit_test::scoped_env rank("SLURM_LOCALID", std::string("1"));
  gpukit::system_snapshot s = gpukit::take_system_snapshot({});
  CHECK(s.local_rank_variable == "SLURM_LOCALID");
  CHECK(s.local_rank == std::optional<std::string>("1"));
  gpukit_test::scoped_env no_rank3("SLURM_LOCALID", std::string(""));
  gpukit_test::scoped_env no_rank4("MPI_LOCALRANKID", std::nullopt);
  s = gpukit::take_system_snapshot({});
  CHECK(s.local_rank_variable.empty());
  CHECK_FALSE(s.local_rank.has_value());
}

TEST_CASE("a hand-made snapshot whose gpus are not cuda:0, cuda:1, ... in order is rejected clearly") {
  gpukit::selection_policy policy;
  auto expect_rejected = [&](const gpukit::system_snapshot& s, const char* expected) {
    CHECK_THROWS_WITH_AS(gpukit::select_device(policy, s), doctest::Contains(expected), gpukit::invalid_argument_error);
  };
  auto swapped = three_gpus();
  std::swap(swapped.gpus[0], swapped.gpus[1]);
  expect_rejected(swapped, "select_device: system_snapshot::gpus[0] is cuda:1; gpus[i] must be cuda:i");
  auto cpu_entry = three_gpus();
  cpu_entry.gpus[2].device = gpukit::device::cpu();
  expect_rejected(cpu_entry, "gpus[2] is cpu");
  // Before the check, this one read past the end of the candidate list.
  gpukit::system_snapshot gap;
  gap.gpus.push_back(gpu(5, "GPU-eeee0000-0000-0000-0000-000000000000", 90, 80, 70, 10));
  gap.gpukit_device = "GPU-eeee";
  expect_rejected(gap, "gpus[0] is cuda:5");
  gap.gpukit_device.reset();
  gap.local_rank_variable = "LOCAL_RANK";
  gap.local_rank = "0";
  expect_rejected(gap, "gpus[0] is cuda:5");
}

TEST_CASE("local ranks of any length within int are read, leading zeros included") {
  gpukit::selection_policy policy;
  auto s = three_gpus();
  s.local_rank_variable = "LOCAL_RANK";
  s.local_rank = "1234567890";  // 1234567890 % 3 == 0
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(0));
  s.local_rank = "0000000001";
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(1));
  s.local_rank = " 2147483647\n";  // 2147483647 % 3 == 1
  CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(1));
  for (const char* too_big : {"2147483648", "99999999999", "000000000000000000000099999999999999999999"}) {
    s.local_rank = too_big;
    CHECK_THROWS_WITH_AS(gpukit::select_device(policy, s),
                         doctest::Contains(("LOCAL_RANK=\"" + std::string(too_big) + "\" is not a local rank").c_str()),
                         gpukit::invalid_argument_error);
  }
}

TEST_CASE("a malformed local rank is an error with or without GPUs, a valid one without GPUs is ignored") {
  gpukit::selection_policy policy;
  for (auto s : {three_gpus(), no_gpus()}) {
    CAPTURE(s.gpus.size());
    s.local_rank_variable = "OMPI_COMM_WORLD_LOCAL_RANK";
    for (const char* bad : {"", " ", "-1", "one", "1.5", "1 2"}) {
      CAPTURE(bad);
      s.local_rank = bad;
      CHECK_THROWS_WITH_AS(gpukit::select_device(policy, s),
                           doctest::Contains(("OMPI_COMM_WORLD_LOCAL_RANK=\"" + std::string(bad) + "\"").c_str()),
                           gpukit::invalid_argument_error);
    }
  }
  auto none = no_gpus();
  none.local_rank_variable = "LOCAL_RANK";
  none.local_rank = "7";
  CHECK(gpukit::select_device(policy, none).device == gpukit::device::cpu());
  SUBCASE("GPUKIT_DEVICE wins, so the rank is not read") {
    auto s = three_gpus();
    s.local_rank_variable = "LOCAL_RANK";
    s.local_rank = "bad";
    s.gpukit_device = "cuda:1";
    CHECK(gpukit::select_device(policy, s).device == gpukit::device::cuda(1));
  }
}

TEST_CASE("GPUKIT_DEVICE edge values each have one documented outcome") {
  gpukit::selection_policy policy;
  auto s = three_gpus();
  auto outcome = [&](const char* value) -> std::string {
    s.gpukit_device = value;
    try {
      return gpukit::select_device(policy, s).device.to_string();
    } catch (const gpukit::invalid_argument_error& e) {
      return std::string("invalid_argument_error: ") + e.what();
    }
  };
  CHECK(outcome("cuda:1\n") == "cuda:1");
  CHECK(outcome("\tcpu\r\n") == "cpu");
  CHECK(outcome("") == "cuda:0");     // empty: ignored, the policy decides
  CHECK(outcome(" \n") == "cuda:0");  // whitespace only: ignored too
  CHECK(outcome("cuda:-1") ==
        "invalid_argument_error: GPUKIT_DEVICE=\"cuda:-1\" is not a device: expected \"cpu\", \"cuda\", \"cuda:N\" or "
        "a GPU UUID (GPU-...)");
  CHECK(outcome("cuda:99999999999")
            .find("invalid_argument_error: GPUKIT_DEVICE=\"cuda:99999999999\" names an "
                  "ordinal beyond every device, but only 3 devices visible") == 0);
  CHECK(outcome("cuda:2147483647")
            .find("invalid_argument_error: GPUKIT_DEVICE=\"cuda:2147483647\" names "
                  "cuda:2147483647, but only 3 devices visible") == 0);
  CHECK(outcome("cuda:3").find("names cuda:3, but only 3 devices visible") != std::string::npos);
}

TEST_CASE("a negative minimum compute capability means no requirement") {
  gpukit::selection_policy policy;
  policy.min_compute_capability = -1;
  policy.require_gpu = true;
  const auto selection = gpukit::select_device(policy, three_gpus());
  CHECK(selection.device == gpukit::device::cuda(0));
  for (const auto& c : selection.candidates) CHECK(c.eligible);
}
