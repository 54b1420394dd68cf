// The doctest main of tests that run on the simulated CUDA runtime. Each ctest test runs one test case in its own
// process; when the case has passed but left a CUDA rule violation recorded (a call from a host function, a
// destroyed handle used, a context on a device the test did not name, an illegal call during capture, ...), the
// violations are printed and the process fails. Tests that break a rule on purpose take the violations they expect
// with cudasim::take_violations().
//
// Run by hand with filters that select several cases (or none), a binary runs each case in a process of its own as
// ctest does, since cases leave process-wide state behind (the simulator's pools, gpukit's singletons, deliberate
// leaks). CUDASIM_IN_PROCESS=1 runs them all in this process instead.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cudasim.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr const char* child_variable = "CUDASIM_CASE_CHILD";

/// Whether the arguments ask doctest a question (list, count, help, version) rather than to run cases.
bool is_query(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string option = arg.substr(0, arg.find('='));  // not its value: a filter may contain "count"
    for (const char* word : {"list", "count", "help", "version"}) {
      if (option.find(word) != std::string::npos) return true;
    }
    for (const char* flag : {"-c", "-h", "-?", "-v", "-ltc", "-lts", "-lr"}) {
      if (arg == flag) return true;
    }
  }
  return false;
}

/// The names of the cases the arguments select, in the order doctest runs them.
std::vector<std::string> selected_cases(int argc, char** argv) {
  std::vector<const char*> args(argv, argv + argc);
  args.push_back("--list-test-cases");
  args.push_back("--no-colors=true");
  std::ostringstream out;
  doctest::Context listing(static_cast<int>(args.size()), args.data());
  listing.setCout(&out);
  (void)listing.run();
  std::istringstream lines(out.str());
  std::vector<std::string> names;
  bool in_list = false;
  bool past_separator = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("listing all test case names") != std::string::npos) {
      in_list = true;
      continue;
    }
    if (!in_list) continue;
    const bool separator = line.rfind("=====", 0) == 0;
    if (!past_separator) {
      past_separator = separator;
      continue;
    }
    if (separator) break;
    names.push_back(line);
  }
  return names;
}

/// Runs the `k`-th selected case (1-based) in a child process with the same arguments; its exit status.
int run_alone(int argc, char** argv, std::size_t k) {
  std::vector<std::string> args(argv, argv + argc);
  args.push_back("--first=" + std::to_string(k));
  args.push_back("--last=" + std::to_string(k));
  args.push_back("--minimal=true");
  std::vector<char*> child_argv;
  for (std::string& arg : args) child_argv.push_back(arg.data());
  child_argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return 127;
  if (pid == 0) {
    setenv(child_variable, "1", 1);
    execv("/proc/self/exe", child_argv.data());
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return 127;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/// Each selected case in a process of its own; a summary, and the names of the cases that failed.
int run_each_alone(int argc, char** argv, const std::vector<std::string>& names) {
  std::vector<std::string> failed;
  for (std::size_t k = 1; k <= names.size(); ++k) {
    if (run_alone(argc, argv, k) != 0) failed.push_back(names[k - 1]);
  }
  std::printf("[cudasim] %zu test case(s), each in a process of its own: %zu passed, %zu failed\n", names.size(),
              names.size() - failed.size(), failed.size());
  for (const std::string& name : failed) std::printf("[cudasim] failed: %s\n", name.c_str());
  return failed.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* in_process = std::getenv("CUDASIM_IN_PROCESS");
  const bool forced_in_process = in_process != nullptr && std::string(in_process) == "1";
  if (std::getenv(child_variable) == nullptr && !forced_in_process && !is_query(argc, argv)) {
    const std::vector<std::string> names = selected_cases(argc, argv);
    if (names.size() > 1) return run_each_alone(argc, argv, names);
  }
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (context.shouldExit()) return result;
  const auto left = cudasim::violations();
  if (left.empty()) return result;
  std::fprintf(stderr, "cudasim: %zu CUDA rule violation(s) left by the test:\n", left.size());
  for (const auto& v : left) {
    std::fprintf(stderr, "  %s -> %s: %s\n", v.call.c_str(), cudaGetErrorName(v.error), v.message.c_str());
  }
  return result != 0 ? result : 1;
}
