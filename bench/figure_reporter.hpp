// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

// The console reporter, keeping every counter of every run for the tables a benchmark prints after its runs
// (bench_allocator, bench_trace_replay): a run's median when it is repeated, else its last repetition.

#include "run_status.hpp"

#include <benchmark/benchmark.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace gpukit_bench {

class figure_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      const std::string key = run.run_name.str();
      if (run_failed(run)) {
        errors_.push_back(key + ": " + run_message(run));
        continue;
      }
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type != Run::RT_Iteration && !median) continue;
      if (!median && has_median_.count(key) != 0) continue;
      if (median) has_median_.insert(key);
      for (const auto& [counter, value] : run.counters) figures_[key + ":" + counter] = value.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  /// Counter `counter` of run `name` (the median of its repetitions when repeated); -1 when it did not run.
  double figure(const std::string& name, const std::string& counter) const {
    const auto it = figures_.find(name + ":" + counter);
    return it == figures_.end() ? -1.0 : it->second;
  }
  /// "<run>: <message>" for each run that failed.
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::map<std::string, double> figures_;  // "<run>:<counter>"
  std::set<std::string> has_median_;
  std::vector<std::string> errors_;
};

}  // namespace gpukit_bench
