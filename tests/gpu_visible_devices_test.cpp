// GPU test: gpukit's reading of CUDA_VISIBLE_DEVICES against the runtime's own. For each value of a table, a child
// process (visible_devices_probe.cpp, linked against the same runtime as this test) says which devices the runtime
// makes visible, and gpukit::parse_visible_devices predicts it from the installed devices' UUIDs. On a GPU every row
// is checked: it is the truth both gpukit's parser and the simulator's model (tests/cudasim/README.md) are written
// from. On the simulator, the rows where the two readings differ (gpukit follows PyTorch's _parse_visible_devices)
// are printed, not checked, until a GPU run settles them.
#include <gpukit/device/visible_devices.hpp>

#include "support.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace {

/// The devices the runtime made visible, as UUIDs in ordinal order; `answer` is the probe's output as printed.
struct runtime_view {
  std::vector<std::string> uuids;
  std::string answer;
};

/// Runs the probe with CUDA_VISIBLE_DEVICES set to `value` (unset when nullopt).
runtime_view ask_runtime(const std::optional<std::string>& value) {
  // The child's environment is built here: after fork, a threaded parent's child may only exec.
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "CUDA_VISIBLE_DEVICES=", 21) != 0) env_text.emplace_back(*e);
  }
  if (value) env_text.push_back("CUDA_VISIBLE_DEVICES=" + *value);
  std::vector<char*> env;
  for (std::string& e : env_text) env.push_back(e.data());
  env.push_back(nullptr);
  char probe[] = GPUKIT_VISIBLE_DEVICES_PROBE;
  char* argv[] = {probe, nullptr};
  int out[2];
  REQUIRE(pipe(out) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    execve(probe, argv, env.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buffer[512];
  for (ssize_t n; (n = read(out[0], buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<std::size_t>(n));
  close(out[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  INFO("probe output: " << text);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  runtime_view view;
  std::istringstream lines(text);
  std::string first;
  std::getline(lines, first);
  view.answer = first;
  for (std::string line; std::getline(lines, line);) view.uuids.push_back(line);
  // No device visible: cudaGetDeviceCount fails (cudaErrorNoDevice) or says 0.
  if (first.rfind("error ", 0) == 0) REQUIRE(view.uuids.empty());
  return view;
}

/// gpukit's prediction, as UUIDs in ordinal order.
std::vector<std::string> gpukit_view(const gpukit::visible_devices& v, const gpukit::installed_gpus& installed) {
  if (v.all_visible()) return installed.uuids;
  std::vector<std::string> uuids;
  for (const gpukit::visible_device_entry& e : v.devices) {
    uuids.push_back(e.index >= 0 && e.index < installed.count ? installed.uuids[static_cast<std::size_t>(e.index)]
                                                              : e.uuid);
  }
  return uuids;
}

std::string joined(const std::vector<std::string>& uuids) {
  std::string text = "[";
  for (const std::string& u : uuids) text += (text.size() > 1 ? ", " : "") + u.substr(0, 12);
  return text + "]";
}

}  // namespace

TEST_CASE("gpu: CUDA_VISIBLE_DEVICES makes visible what gpukit's reading of it says") {
  GPUKIT_REQUIRE_GPU();
  gpukit::installed_gpus installed;
  installed.uuids = ask_runtime(std::nullopt).uuids;
  installed.count = static_cast<int>(installed.uuids.size());
  REQUIRE(installed.count >= 1);
  const std::string n = std::to_string(installed.count);
  const std::string u0 = installed.uuids[0];
  // Every row is checked, on the simulator and on a GPU. The last four were settled by an H100 run (2026-12-05): an
  // index beyond the installed devices ends the list before a repeat after it (PyTorch's reading empties the set),
  // an index list ends at a UUID, and a sign is read as strtoul reads it.
  std::vector<std::string> rows = {
      "0",
      n,
      "0,0",
      "-1",
      "",
      "  ",
      "NoDevFiles",
      "0,abc,0",
      "0,-1,0",
      "0gpu",
      " 0 , ",
      u0,
      u0.substr(0, 12),
      u0 + "," + u0,
      u0 + ",0",
      "GPU-ffffffff-0000",
      u0 + ",GPU-ffffffff-0000," + u0,  // ends at the unknown UUID before the repeat, as indices do (not measured)
      "0," + n + ",0",
      "0," + u0,
      "+0",
      "-0",
      "0x1",  // base 10, as gpukit reads it: device 0; base 0 (strtoul's auto-detect) would read 1 (not measured)
      "00",
  };
  if (installed.count >= 2) {
    const std::string u1 = installed.uuids[1];
    rows.insert(rows.end(), {"1", "1,0", "0,1,0", u1 + "," + u0, "0," + u1});
  }
  int differences = 0;
  for (const std::string& value : rows) {
    const runtime_view runtime = ask_runtime(value);
    const gpukit::visible_devices reading = gpukit::parse_visible_devices(value.c_str(), installed);
    const std::vector<std::string> predicted = gpukit_view(reading, installed);
    const bool same = runtime.uuids == predicted && reading.count() == static_cast<int>(runtime.uuids.size());
    std::printf("CUDA_VISIBLE_DEVICES=\"%s\": runtime %s (%s), gpukit %s%s\n", value.c_str(),
                joined(runtime.uuids).c_str(), runtime.answer.c_str(), joined(predicted).c_str(),
                same ? "" : "  DIFFER");
    INFO("CUDA_VISIBLE_DEVICES=\"" << value << "\": " << reading.describe());
    CHECK(runtime.uuids == predicted);
    CHECK(reading.count() == static_cast<int>(runtime.uuids.size()));
    // A device named twice hides every one, and cudaGetDeviceCount then fails with cudaErrorInvalidDevice, not
    // ...NoDevice (H100, 2026-12-05): describe_no_gpu() explains both as CUDA_VISIBLE_DEVICES's doing.
    CHECK((runtime.answer == "error 101") == reading.emptied_by_repeat);
    differences += same ? 0 : 1;
  }
  std::printf("%zu values, %d where gpukit's reading differs from the %s\n", rows.size(), differences,
              gpukit_test::on_simulator() ? "simulated runtime's" : "runtime's");
}
