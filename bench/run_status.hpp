// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

// Whether a benchmark run produced figures, across Google Benchmark's versions: before 1.8 a failed run has
// error_occurred and error_message; from 1.8 on, skipped and skip_message (SkipWithError and SkipWithMessage).

#include <benchmark/benchmark.h>

#include <string>

namespace gpukit_bench {
namespace detail {
template <class Run>
auto run_failed(const Run& run, int) -> decltype(static_cast<bool>(run.error_occurred)) {
  return run.error_occurred;
}
template <class Run>
bool run_failed(const Run& run, long) {
  return static_cast<bool>(run.skipped);
}
template <class Run>
auto run_message(const Run& run, int) -> decltype(std::string(run.error_message)) {
  return run.error_message;
}
template <class Run>
std::string run_message(const Run& run, long) {
  return run.skip_message;
}
}  // namespace detail

/// True when `run` failed or was skipped: it has no figures.
template <class Run>
bool run_failed(const Run& run) {
  return detail::run_failed(run, 0);
}

/// Why `run` failed or was skipped.
template <class Run>
std::string run_message(const Run& run) {
  return detail::run_message(run, 0);
}
}  // namespace gpukit_bench
