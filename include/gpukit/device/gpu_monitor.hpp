// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// gpu_monitor: what nvidia-smi shows, sampled from inside the program. A background thread reads NVML
/// (device/nvml.hpp) for each CUDA device at a chosen period and keeps a bounded history; latest(), history(),
/// status_line() and table() read it from any thread. Devices are CUDA ordinals (CUDA_VISIBLE_DEVICES honoured),
/// mapped to NVML by UUID, never by index. Where NVML is absent, or knows none of the devices, the monitor is
/// inactive: no thread, no samples, no output, and status() says why. It makes no CUDA call that creates a context.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/error.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/device/nvml.hpp>
#include <gpukit/device/properties.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// One device's reading at one time.
struct device_sample {
  gpukit::device device;                       ///< the CUDA device (visible ordinal)
  std::chrono::steady_clock::time_point time;  ///< when it was taken
  nvml::gpu_sample values;                     ///< NVML's figures; each optional
};

/// How a gpu_monitor samples.
struct gpu_monitor_options {
  /// Time between samples on the background thread. Zero (or negative): no thread; the program calls sample_now().
  /// Periods longer than a year count as a year.
  std::chrono::milliseconds period{1000};
  /// Samples kept per device (at least 1); older ones are dropped.
  std::size_t history_length = 600;
  /// The devices to watch; empty: every visible CUDA device.
  std::vector<device> devices;
  /// Read the PCIe throughput counters (NVML takes about 20 ms per counter per device to sample them).
  bool read_pcie = true;
  /// Called on the sampling thread after each round with the monitor and the round's samples (one per device NVML
  /// found). It may call any member of the monitor, and may destroy it once the constructor has returned (a server
  /// shutting its monitoring down from a sample): the callable itself lives on until it returns, and the thread then
  /// ends without touching the monitor. Exceptions are caught and reported through status().
  std::function<void(const class gpu_monitor&, const std::vector<device_sample>&)> on_sample;
};

/// Samples NVML for a set of CUDA devices, on a background thread or on demand. Thread-safe; not copyable.
class gpu_monitor {
 public:
  /// Resolves the devices (cudaGetDeviceProperties: no context is created) and, where NVML is available and knows
  /// at least one of them (by UUID or PCI bus id), starts sampling. `nvml` must outlive the monitor. Throws
  /// invalid_argument_error for a CPU device, a repeated device or an ordinal that is not visible in options.devices,
  /// no_device_error for a CUDA device without a driver.
  explicit gpu_monitor(gpu_monitor_options options = {}, const nvml::library& nvml = nvml::instance())
      : options_(std::move(options)), nvml_(nvml) {
    options_.history_length = std::max<std::size_t>(options_.history_length, 1);
    if (options_.devices.empty()) {
      for (device d : cuda_devices()) options_.devices.push_back(d);
    }
    for (std::size_t i = 0; i < options_.devices.size(); ++i) {
      const device d = options_.devices[i];
      if (!d.is_cuda()) throw invalid_argument_error("gpu_monitor: " + d.to_string() + " is not a CUDA device");
      for (std::size_t j = 0; j < i; ++j) {
        if (options_.devices[j] == d)
          throw invalid_argument_error("gpu_monitor: " + d.to_string() + " is listed twice");
      }
      watched_.push_back(watched{properties(d), {}});
    }
    if (!nvml_.available()) {
      status_ = "GPU monitor inactive: " + nvml_.status();
      return;
    }
    if (watched_.empty()) {
      status_ = "GPU monitor inactive: no CUDA device is visible";
      return;
    }
    std::size_t known = 0;
    for (const auto& w : watched_) known += nvml_.knows(w.properties) ? std::size_t{1} : std::size_t{0};
    if (known == 0) {
      status_ = "GPU monitor inactive: NVML knows none of the " + std::to_string(watched_.size()) +
                " device(s) (looked up by UUID and PCI bus id)";
      return;
    }
    active_ = true;
    status_ = "GPU monitor: " + std::to_string(known) + " device" + (known == 1 ? "" : "s") + " through NVML";
    if (known < watched_.size()) status_ += " (" + std::to_string(watched_.size() - known) + " unknown to NVML)";
    constexpr std::chrono::milliseconds a_year = std::chrono::hours(24 * 365);
    options_.period = std::min(options_.period, a_year);  // wait_for with a huge period would overflow
    if (options_.period.count() > 0) {
      shared_ = std::make_shared<sampler_shared>();
      shared_->on_sample = std::move(options_.on_sample);
      sampler_ = std::thread([this] { run(); });
    }
  }

  gpu_monitor(const gpu_monitor&) = delete;
  gpu_monitor& operator=(const gpu_monitor&) = delete;

  /// Stops the sampling thread: waits for a round in progress (about 40 ms per device with PCIe counters) and for an
  /// on_sample call in progress. Called from on_sample (the sampling thread itself), it cannot wait for that thread:
  /// the thread is told to end as soon as on_sample returns, and is detached.
  ~gpu_monitor() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (!sampler_.joinable()) return;
    if (sampler_.get_id() == std::this_thread::get_id()) {
      shared_->monitor_destroyed.store(true, std::memory_order_release);
      sampler_.detach();
      return;
    }
    sampler_.join();
  }

  /// NVML is available and the monitor samples (or can sample) at least one device.
  bool active() const noexcept { return active_; }

  /// What is monitored or why nothing is; then devices NVML did not find in the last round, and the last error the
  /// sampling thread caught, if any.
  std::string status() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string text = status_;
    std::string missing;
    for (const auto& w : watched_) {
      if (w.missing) missing += (missing.empty() ? "" : ", ") + w.properties.device.to_string();
    }
    if (!missing.empty()) text += "; not found by NVML in the last round: " + missing;
    if (!last_error_.empty()) text += "; last error: " + last_error_;
    return text;
  }

  /// The devices watched, in order.
  const std::vector<device>& devices() const noexcept { return options_.devices; }

  /// Takes one sample of every device now, appends it to the history and returns it (devices NVML does not find are
  /// left out). Inactive monitors return an empty vector. Callable from on_sample.
  std::vector<device_sample> sample_now() {
    std::lock_guard<std::mutex> one_round_at_a_time(sampling_);
    return sample_round();
  }

  /// The newest sample of each device that NVML found in the last round (a device that has since disappeared, e.g.
  /// fallen off the bus, is left out rather than shown with old figures; its history keeps them).
  std::vector<device_sample> latest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<device_sample> out;
    for (const auto& w : watched_) {
      if (!w.history.empty() && !w.missing) out.push_back(w.history.back());
    }
    return out;
  }

  /// The samples kept for `d`, oldest first (empty for a device not watched).
  std::vector<device_sample> history(device d) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& w : watched_) {
      if (w.properties.device == d) return {w.history.begin(), w.history.end()};
    }
    return {};
  }

  /// Sampling rounds completed since construction.
  std::uint64_t rounds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return rounds_;
  }

  /// One line for a log: each device's utilisation, memory, this process's memory, temperature, power, SM clock and
  /// clock limits; figures NVML does not report are left out. Empty when there is no sample yet.
  std::string status_line() const { return format_status_line(latest()); }

  /// An nvidia-smi-like table of the latest samples, one row per device (name from CUDA), or status() when there is
  /// no sample.
  std::string table() const {
    const auto samples = latest();
    if (samples.empty()) return status() + "\n";
    std::vector<std::string> names;
    for (const auto& s : samples) {
      for (const auto& w : watched_) {
        if (w.properties.device == s.device) names.push_back(w.properties.name);
      }
    }
    return format_table(samples, names);
  }

  /// The line status_line() prints, for any samples.
  static std::string format_status_line(const std::vector<device_sample>& samples) {
    std::string line;
    for (const auto& s : samples) {
      const auto& v = s.values;
      if (!line.empty()) line += " | ";
      line += s.device.to_string();
      if (v.gpu_utilization_percent) line += " " + std::to_string(*v.gpu_utilization_percent) + "% busy";
      if (v.memory) line += " " + used_of_total(*v.memory);
      if (v.process_memory) line += " (this process " + bytes(*v.process_memory) + ")";
      if (v.temperature_c) line += " " + std::to_string(*v.temperature_c) + " C";
      if (v.power_w) line += " " + watts(*v.power_w, v.power_limit_w);
      if (v.sm_clock_mhz) line += " " + std::to_string(*v.sm_clock_mhz) + " MHz";
      if (v.clock_limits && (*v.clock_limits & ~nvml::clock_limit::idle) != 0)
        line += " [" + nvml::describe_clock_limits(*v.clock_limits) + "]";
    }
    return line;
  }

  /// The table table() prints, for any samples and device names (same order).
  static std::string format_table(const std::vector<device_sample>& samples, const std::vector<std::string>& names) {
    std::vector<std::vector<std::string>> rows{{"device", "name", "temp", "power / limit", "memory used / total",
                                                "this process", "GPU / mem util", "SM / mem clock", "PCIe rx / tx",
                                                "clock limits"}};
    const std::string unknown = "-";
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto& v = samples[i].values;
      std::vector<std::string> row;
      row.push_back(samples[i].device.to_string());
      row.push_back(i < names.size() ? names[i] : unknown);
      row.push_back(v.temperature_c ? std::to_string(*v.temperature_c) + " C" : unknown);
      row.push_back(v.power_w ? watts(*v.power_w, v.power_limit_w) : unknown);
      row.push_back(v.memory ? used_of_total(*v.memory) : unknown);
      row.push_back(v.process_memory ? bytes(*v.process_memory) : unknown);
      row.push_back(pair_or_unknown(v.gpu_utilization_percent, v.memory_utilization_percent, "%"));
      row.push_back(pair_or_unknown(v.sm_clock_mhz, v.memory_clock_mhz, " MHz"));
      row.push_back(pcie(v));
      row.push_back(v.clock_limits ? nvml::describe_clock_limits(*v.clock_limits) : unknown);
      rows.push_back(std::move(row));
    }
    std::vector<std::size_t> width(rows[0].size(), 0);
    for (const auto& row : rows) {
      for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
    }
    std::string rule = "+";
    for (std::size_t w : width) rule += std::string(w + 2, '-') + "+";
    rule += "\n";
    std::string out = rule;
    for (std::size_t r = 0; r < rows.size(); ++r) {
      out += "|";
      for (std::size_t c = 0; c < rows[r].size(); ++c)
        out += " " + rows[r][c] + std::string(width[c] - rows[r][c].size(), ' ') + " |";
      out += "\n";
      if (r == 0) out += rule;
    }
    return out + rule;
  }

 private:
  struct watched {
    device_properties properties;
    std::deque<device_sample> history;
    bool missing = false;  // NVML did not find it in the last round
  };

  static std::string bytes(unsigned long long n) { return detail::format_bytes(static_cast<std::size_t>(n)); }
  static std::string used_of_total(const nvml::gpu_memory& m) { return bytes(m.used) + " / " + bytes(m.total); }
  static std::string watts(double now, const std::optional<double>& limit) {
    char text[48];
    if (limit) {
      std::snprintf(text, sizeof text, "%.0f / %.0f W", now, *limit);
    } else {
      std::snprintf(text, sizeof text, "%.0f W", now);
    }
    return text;
  }
  static std::string pair_or_unknown(const std::optional<unsigned>& a, const std::optional<unsigned>& b,
                                     const char* unit) {
    if (!a && !b) return "-";
    return (a ? std::to_string(*a) : "-") + " / " + (b ? std::to_string(*b) : "-") + unit;
  }
  static std::string pcie(const nvml::gpu_sample& v) {
    if (!v.pcie_rx_kib_per_s && !v.pcie_tx_kib_per_s) return "-";
    auto rate = [](const std::optional<unsigned>& kib) {
      return kib ? bytes(static_cast<unsigned long long>(*kib) * 1024) + "/s" : std::string("-");
    };
    return rate(v.pcie_rx_kib_per_s) + " / " + rate(v.pcie_tx_kib_per_s);
  }

  // Caller holds sampling_. NVML is read without mutex_, so readers never wait for a round's ~40 ms per device.
  std::vector<device_sample> sample_round() {
    std::vector<device_sample> round;
    if (!active_) return round;
    for (const auto& w : watched_) {
      if (auto values = nvml_.sample(w.properties, options_.read_pcie)) {
        round.push_back(device_sample{w.properties.device, std::chrono::steady_clock::now(), *values});
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : watched_) w.missing = true;
    for (const auto& s : round) {
      for (auto& w : watched_) {
        if (w.properties.device != s.device) continue;
        w.missing = false;
        w.history.push_back(s);
        if (w.history.size() > options_.history_length) w.history.pop_front();
      }
    }
    ++rounds_;
    return round;
  }

  void run() noexcept {
    // Outlives the monitor: on_sample may destroy it, after which nothing of it may be touched.
    const std::shared_ptr<sampler_shared> shared = shared_;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      lock.unlock();
      const char* stage = "sampling failed";
      bool failed = false;
      std::string error;
      try {
        std::vector<device_sample> round;
        {
          std::lock_guard<std::mutex> one_round_at_a_time(sampling_);
          round = sample_round();
        }
        stage = "on_sample threw";
        if (shared->on_sample) shared->on_sample(*this, round);
      } catch (const std::exception& e) {
        failed = true;
        try {
          error = e.what();
        } catch (...) {  // no memory for the text: the failure is still noted
        }
      } catch (...) {
        failed = true;
        try {
          error = "an unknown exception";
        } catch (...) {
        }
      }
      if (shared->monitor_destroyed.load(std::memory_order_acquire)) return;  // by on_sample: `this` is gone
      lock.lock();
      if (failed) {
        try {
          last_error_ = std::string(stage) + ": " + error;
        } catch (...) {  // no memory: the previous error stays
        }
      }
      wake_.wait_for(lock, options_.period, [this] { return stopping_; });
    }
  }

  gpu_monitor_options options_;
  const nvml::library& nvml_;
  std::vector<watched> watched_;  // fixed after construction; histories guarded by mutex_
  bool active_ = false;
  mutable std::mutex mutex_;
  std::mutex sampling_;
  std::condition_variable wake_;
  std::string status_;
  std::string last_error_;
  std::uint64_t rounds_ = 0;
  bool stopping_ = false;
  /// What the sampling thread keeps beyond the monitor's life: on_sample may destroy the monitor.
  struct sampler_shared {
    std::atomic<bool> monitor_destroyed{false};  // by on_sample: the thread must leave the monitor alone
    decltype(gpu_monitor_options::on_sample) on_sample;
  };
  std::shared_ptr<sampler_shared> shared_;  // set when the thread starts
  std::thread sampler_;                     // last: starts after every member it uses exists
};

GPUKIT_END_NAMESPACE
