// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device auto-selection, so the same program runs on a laptop, in CI and on a GPU node. Precedence:
///  1. GPUKIT_DEVICE in the environment ("cpu", "cuda", "cuda:N" or a GPU UUID / unique UUID prefix): always wins.
///     Surrounding whitespace is ignored; an empty or all-whitespace value counts as unset. Anything else that is
///     not one of those forms ("cuda:-1", "gpu0"), or that names no visible device ("cuda:99999999999"), is an
///     invalid_argument_error naming the value (a CUDA device asked for where there is no GPU: no_device_error);
///  2. the launcher's local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID, first set
///     wins), mapped onto the visible devices as rank % device_count, so every rank of a node gets a distinct GPU
///     when there are enough; the mapped device must satisfy the policy's requirements or selection fails. The
///     value must be a decimal integer in [0, 2147483647] (leading zeros and surrounding whitespace allowed), else
///     select_device throws invalid_argument_error naming the variable and value — with or without a GPU, so a bad
///     value shows on a laptop too. Without a GPU a valid rank is ignored (the CPU is used). Not read when
///     GPUKIT_DEVICE decides, nor with use_environment = false;
///  3. the policy: devices meeting its requirements (minimum compute capability, minimum free memory), ranked by its
///     preference (first, most free memory, least utilised);
///  4. the CPU — unless the policy requires a GPU, then no_device_error listing every device and why it was rejected.
///     A CUDA that is installed but fails to initialise (cudaGetDeviceCount fails with anything but
///     cudaErrorInsufficientDriver, cudaErrorStubLibrary or cudaErrorNoDevice: e.g. cudaErrorSystemDriverMismatch
///     after a driver upgrade without a reboot) leaves no GPU usable: the CPU is used, as PyTorch's is_available()
///     does, but with a warning (gpukit::warn) naming the failure, so a broken GPU node is not silently a CPU one;
///     with require_gpu it is a no_device_error carrying the CUDA result.
/// Free memory and utilisation come from NVML, which creates no CUDA context. Without NVML, free memory is unknown:
/// min_free_bytes and most_free_memory use total memory instead (said in the reason; where only some devices' free
/// memory is known, most_free_memory ranks those first), unless
/// allow_context_probe is set, which permits cudaMemGetInfo on each candidate (creating its context, ~300 MB each;
/// only on the device GPUKIT_DEVICE or the local rank chooses, when they do);
/// least_utilized falls back to the first eligible device.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/detail/warning_text.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/device/nvml.hpp>
#include <gpukit/device/properties.hpp>
#include <gpukit/device/visible_devices.hpp>
#include <gpukit/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

/// How to rank the devices that meet the requirements.
enum class device_preference {
  first,             ///< the lowest ordinal
  most_free_memory,  ///< the most free memory (NVML; see the file comment for the fallback)
  least_utilized,    ///< the lowest NVML GPU utilisation
};

/// What select_device looks for.
struct selection_policy {
  /// How to rank the devices that meet the requirements.
  device_preference prefer = device_preference::first;
  std::size_t min_free_bytes = 0;    ///< reject devices with less free memory than this
  int min_compute_capability = 0;    ///< reject devices below this, as major*10+minor (80 = sm_80); 0 or less: none
  bool require_gpu = false;          ///< fail instead of falling back to the CPU
  bool use_environment = true;       ///< honour GPUKIT_DEVICE and the launcher's local rank
  bool allow_context_probe = false;  ///< without NVML, read free memory with cudaMemGetInfo (creates contexts)
};

/// One visible CUDA device, as the selection sees it.
struct gpu_snapshot {
  gpukit::device device;                        ///< cuda:i for gpus[i]
  std::string name;                             ///< device_properties::name
  std::string uuid;                             ///< "GPU-...", as device_properties::uuid
  std::size_t total_memory = 0;                 ///< bytes of global memory
  int compute_capability = 0;                   ///< major*10+minor
  int compute_mode = 0;                         ///< device_properties::compute_mode (2: prohibited, refused)
  std::optional<std::size_t> free_memory;       ///< bytes free, if read (else policies count total memory)
  std::string free_memory_source;               ///< "NVML", "cudaMemGetInfo" or empty
  std::optional<unsigned> utilization_percent;  ///< NVML GPU utilisation, when read
  std::string unusable;                         ///< why the device cannot be used (its probe failed), or empty
};

/// Everything selection depends on, gathered once. take_system_snapshot() reads it from the machine; tests and
/// simulations build one by hand: gpus[i].device must be cuda:i (select_device checks, and throws
/// invalid_argument_error otherwise).
struct system_snapshot {
  std::vector<gpu_snapshot> gpus;            ///< the visible CUDA devices, by ordinal
  std::string no_gpu_reason;                 ///< when gpus is empty: why, in one plain sentence
  std::string telemetry;                     ///< where free memory / utilisation came from, or why not
  std::optional<std::string> gpukit_device;  ///< GPUKIT_DEVICE, if set
  std::string local_rank_variable;           ///< the launcher variable that was set, if any
  std::optional<std::string> local_rank;     ///< its value
  /// What cudaGetDeviceCount returned. A failure other than "no GPU" (cudaErrorInsufficientDriver,
  /// cudaErrorStubLibrary, cudaErrorNoDevice) means CUDA failed to initialise: select_device warns before it falls
  /// back to the CPU, and a required GPU's error carries it.
  cudaError_t device_count_result = cudaSuccess;
};

/// The verdict on one candidate device.
struct candidate_verdict {
  gpukit::device device;  ///< the candidate
  std::string name;       ///< its name, for the report
  bool eligible = false;  ///< it meets the policy's requirements
  std::string note;       ///< why it was rejected, or what was assumed about it
};

/// The outcome of select_device: the device, what decided it, and why.
struct device_selection {
  /// Which step of the precedence (see the file comment) chose the device.
  enum class decided_by {
    environment_override,  ///< GPUKIT_DEVICE
    local_rank,            ///< the launcher's local rank
    policy,                ///< the policy's requirements and preference
    cpu_fallback           ///< no GPU qualified (or none is visible), so the CPU
  };
  gpukit::device device;                         ///< the selected device
  decided_by source = decided_by::cpu_fallback;  ///< what chose it
  std::string reason;                            ///< one sentence
  std::vector<candidate_verdict> candidates;     ///< every visible CUDA device, by ordinal, with its verdict

  /// A multi-line report: the reason, then each candidate with its verdict.
  std::string report() const;
};

namespace detail {

GPUKIT_INLINE std::string capability_text(int cc);

/// Memory the policy may count on: free memory when known, else total memory.
GPUKIT_INLINE std::size_t usable_memory(const gpu_snapshot& g);

/// For most_free_memory: whether `a` ranks above `b`. A device whose free memory is known ranks above one whose free
/// memory is not (its total memory says nothing of what others use there); otherwise the more usable memory.
GPUKIT_INLINE bool ranks_above_by_memory(const gpu_snapshot& a, const gpu_snapshot& b);

/// Empty when `g` meets the policy's requirements, else the reasons it does not.
GPUKIT_INLINE std::string rejection_reason(const gpu_snapshot& g, const selection_policy& policy);

GPUKIT_INLINE std::string describe_gpu_list(const system_snapshot& system);

/// GPUKIT_DEVICE: "cpu", "cuda", "cuda:N" or a GPU UUID (or unique prefix) among the visible devices.
GPUKIT_INLINE device resolve_override(const std::string& raw, const system_snapshot& system);
/// The ordinal GPUKIT_DEVICE or the local rank will choose (INT_MAX: the CPU, or a value that will be refused), or
/// -1 when the policy decides; the context probe reads only the device chosen.
GPUKIT_INLINE int device_the_environment_chooses(const selection_policy& policy, const system_snapshot& system);

/// The launcher's local rank: decimal digits (any number of them, leading zeros included) for a value in
/// [0, INT_MAX], whitespace around ignored. Throws invalid_argument_error naming the variable and value otherwise.
GPUKIT_INLINE int parse_local_rank(const system_snapshot& system);

/// Throws invalid_argument_error unless gpus[i].device is cuda:i for every i (selection indexes by ordinal).
GPUKIT_INLINE void check_snapshot(const system_snapshot& system);

/// Whether cudaGetDeviceCount's `result` says CUDA is there but failed to initialise, rather than that there is no
/// GPU to use (cudaSuccess, no driver, the stub library, no device, or cudaErrorInvalidDevice: cudaGetDeviceCount
/// takes no ordinal, and an H100 answered it for CUDA_VISIBLE_DEVICES naming a device twice, which hides every one).
constexpr bool is_cuda_initialisation_failure(cudaError_t result) noexcept {
  return result != cudaSuccess && result != cudaErrorInsufficientDriver && result != cudaErrorStubLibrary &&
         result != cudaErrorNoDevice && result != cudaErrorInvalidDevice;
}

/// For is_cuda_initialisation_failure: "CUDA failed to initialise, so no GPU is usable: cudaGetDeviceCount returned
/// <name> (<number>): <description>[; <hint>]".
GPUKIT_INLINE std::string describe_cuda_initialisation_failure(cudaError_t result);

/// One answer of cudaGetDeviceCount: its result, and the count (0 unless it succeeded).
struct device_count_answer {
  cudaError_t result = cudaSuccess;
  int count = 0;
};

/// Asks cudaGetDeviceCount once; its failure is not left as the thread's last error.
GPUKIT_INLINE device_count_answer ask_device_count();

/// describe_no_gpu for one answer of cudaGetDeviceCount (`result`, and `count` when it succeeded); empty when that
/// answer names a device.
GPUKIT_INLINE std::string describe_device_count(cudaError_t result, int count);

}  // namespace detail

namespace detail {

/// Step 0: every visible GPU judged against the policy (eligible, or the reason it is not).
GPUKIT_INLINE std::vector<candidate_verdict> judge_candidates(const selection_policy& policy,
                                                              const system_snapshot& system);

/// Step 1: GPUKIT_DEVICE, when set, decides.
GPUKIT_INLINE bool select_by_override(const selection_policy& policy, const system_snapshot& system,
                                      device_selection& selection);

/// Step 2: the launcher's local rank, validated with or without GPUs, decides when there are GPUs.
GPUKIT_INLINE bool select_by_local_rank(const selection_policy& policy, const system_snapshot& system,
                                        device_selection& selection);

/// Step 3: the policy's preference among the eligible GPUs, if any is.
GPUKIT_INLINE bool select_by_policy(const selection_policy& policy, const system_snapshot& system,
                                    device_selection& selection);

/// Step 4: the CPU, or (a GPU required) an error listing every rejection. Warns when the CPU is used because CUDA
/// failed to initialise (system_snapshot::device_count_result).
GPUKIT_INLINE void select_cpu_fallback(const selection_policy& policy, const system_snapshot& system,
                                       device_selection& selection);

}  // namespace detail

/// Selects a device from a snapshot of the system, following the precedence in this file's comment. Reads nothing
/// from the machine: use it to test or simulate policies (its one effect: the warning when it falls back to the CPU
/// because the snapshot's cudaGetDeviceCount failed to initialise CUDA). Throws invalid_argument_error for a
/// malformed GPUKIT_DEVICE or local rank, an override naming no visible device, or a snapshot whose gpus[i] is not
/// cuda:i; no_device_error when a GPU is required and none qualifies.
GPUKIT_INLINE device_selection select_device(const selection_policy& policy, const system_snapshot& system);

/// One plain sentence saying why no CUDA device is usable (for device_count() == 0), from one cudaGetDeviceCount:
/// no driver, the stub library, no GPU (with CUDA_VISIBLE_DEVICES where it hides them), or CUDA failing to
/// initialise (the error's name and number). Empty when that call finds a device.
GPUKIT_INLINE std::string describe_no_gpu();

/// Reads what selection needs from the machine and the environment. Free memory and utilisation are read only when
/// the policy needs them, from NVML (or cudaMemGetInfo if allowed). CUDA is asked for the device count once: the
/// devices and no_gpu_reason describe that one answer.
GPUKIT_INLINE system_snapshot take_system_snapshot(const selection_policy& policy = {});

/// Selects a device for this process: take_system_snapshot(policy), then select_device(policy, snapshot).
/// Typical use: `gpukit::device d = gpukit::select_device().device;`
GPUKIT_INLINE device_selection select_device(const selection_policy& policy = {});

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE std::string device_selection::report() const {
  std::string text = "selected " + device.to_string() + ": " + reason + "\n";
  for (const auto& c : candidates) {
    text += "  " + c.device.to_string() + " (" + c.name + "): " + (c.eligible ? "eligible" : "rejected");
    if (!c.note.empty()) text += " - " + c.note;
    text += "\n";
  }
  return text;
}
namespace detail {

GPUKIT_INLINE std::string capability_text(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

GPUKIT_INLINE std::size_t usable_memory(const gpu_snapshot& g) {
  return g.free_memory ? *g.free_memory : g.total_memory;
}

GPUKIT_INLINE bool ranks_above_by_memory(const gpu_snapshot& a, const gpu_snapshot& b) {
  if (a.free_memory.has_value() != b.free_memory.has_value()) return a.free_memory.has_value();
  return usable_memory(a) > usable_memory(b);
}

GPUKIT_INLINE std::string rejection_reason(const gpu_snapshot& g, const selection_policy& policy) {
  std::string why = g.unusable;
  const auto add = [&why](const std::string& reason) { why += (why.empty() ? "" : "; ") + reason; };
  if (g.compute_mode == cudaComputeModeProhibited) {
    add("its compute mode is prohibited: no process may use it (nvidia-smi -c)");
  }
  if (g.compute_capability < policy.min_compute_capability) {
    add("compute capability " + capability_text(g.compute_capability) + " is below the required " +
        capability_text(policy.min_compute_capability));
  }
  if (policy.min_free_bytes > 0 && usable_memory(g) < policy.min_free_bytes) {
    add((g.free_memory ? "free memory " : "total memory (free unknown) ") + format_bytes(usable_memory(g)) +
        " is below the required " + format_bytes(policy.min_free_bytes));
  }
  return why;
}

GPUKIT_INLINE std::string describe_gpu_list(const system_snapshot& system) {
  return std::to_string(system.gpus.size()) + (system.gpus.size() == 1 ? " device visible" : " devices visible");
}

GPUKIT_INLINE device resolve_override(const std::string& raw, const system_snapshot& system) {
  const std::string text(trim_whitespace(raw));
  const std::string what = "GPUKIT_DEVICE=\"" + raw + "\"";
  const auto refuse_without_gpus = [&] {
    if (system.gpus.empty()) {  // the count's failure carried, as select_cpu_fallback does (803 or no driver)
      const cudaError_t cause = system.device_count_result;
      throw no_device_error(what + " asks for a GPU, but none is usable: " + system.no_gpu_reason, cause,
                            cause == cudaSuccess ? std::string() : std::string("cudaGetDeviceCount"));
    }
  };
  if (starts_with(text, "GPU-")) {
    refuse_without_gpus();
    std::vector<device> matches;
    for (const auto& g : system.gpus) {
      if (starts_with(g.uuid, text)) matches.push_back(g.device);
    }
    if (matches.size() == 1) return matches.front();
    std::string listing;
    for (const auto& g : system.gpus) listing += (listing.empty() ? "" : ", ") + g.device.to_string() + " " + g.uuid;
    if (matches.empty()) {
      throw invalid_argument_error(what + " matches no visible device (" + describe_gpu_list(system) +
                                   (listing.empty() ? "" : ": " + listing) + ")");
    }
    throw invalid_argument_error(what + " is ambiguous: it is a prefix of " + std::to_string(matches.size()) +
                                 " visible devices' UUIDs (" + listing + "); give more of the UUID");
  }
  device d;
  try {
    d = device::parse(text);
  } catch (const invalid_argument_error&) {
    // "cuda:" and digits that do not fit an int: a well-formed request for a device that cannot exist.
    if (starts_with(text, "cuda:") && parse_decimal_saturating(std::string_view(text).substr(5))) {
      refuse_without_gpus();
      throw invalid_argument_error(what + " names an ordinal beyond every device, but only " +
                                   describe_gpu_list(system) + " (" + describe_visible_devices_variable() + ")");
    }
    throw invalid_argument_error(what +
                                 " is not a device: expected \"cpu\", \"cuda\", \"cuda:N\" or a GPU UUID (GPU-...)");
  }
  if (d.is_cuda() && d.ordinal() >= static_cast<int>(system.gpus.size())) {
    refuse_without_gpus();
    throw invalid_argument_error(what + " names " + d.to_string() + ", but only " + describe_gpu_list(system) + " (" +
                                 describe_visible_devices_variable() + ")");
  }
  return d;
}

GPUKIT_INLINE int parse_local_rank(const system_snapshot& system) {
  const auto value = parse_decimal_saturating(trim_whitespace(*system.local_rank));
  if (!value || *value > static_cast<unsigned long long>(std::numeric_limits<int>::max())) {
    throw invalid_argument_error(system.local_rank_variable + "=\"" + *system.local_rank +
                                 "\" is not a local rank (a non-negative integer up to 2147483647)");
  }
  return static_cast<int>(*value);
}

GPUKIT_INLINE void check_snapshot(const system_snapshot& system) {
  for (std::size_t i = 0; i < system.gpus.size(); ++i) {
    const device d = system.gpus[i].device;
    if (d.is_cuda() && static_cast<std::size_t>(d.ordinal()) == i) continue;
    throw invalid_argument_error("select_device: system_snapshot::gpus[" + std::to_string(i) + "] is " + d.to_string() +
                                 "; gpus[i] must be cuda:i (the visible devices in ordinal order)");
  }
}

GPUKIT_INLINE std::vector<candidate_verdict> judge_candidates(const selection_policy& policy,
                                                              const system_snapshot& system) {
  std::vector<candidate_verdict> candidates;
  for (const auto& g : system.gpus) {
    candidate_verdict v{g.device, g.name, false, rejection_reason(g, policy)};
    v.eligible = v.note.empty();
    if (v.eligible && policy.min_free_bytes > 0 && !g.free_memory) {
      v.note = "free memory unknown; compared total memory";
    }
    candidates.push_back(std::move(v));
  }
  return candidates;
}

GPUKIT_INLINE int device_the_environment_chooses(const selection_policy& policy, const system_snapshot& system) {
  if (!policy.use_environment) return -1;
  try {
    if (system.gpukit_device && !trim_whitespace(*system.gpukit_device).empty()) {
      const device d = resolve_override(*system.gpukit_device, system);
      return d.is_cuda() ? d.ordinal() : std::numeric_limits<int>::max();  // the CPU: no GPU's figure matters
    }
    if (system.local_rank && !system.gpus.empty()) {
      return parse_local_rank(system) % static_cast<int>(system.gpus.size());
    }
  } catch (const error&) {  // a bad value: select_device reports it; no GPU's figure matters meanwhile
    return std::numeric_limits<int>::max();
  }
  return -1;
}

GPUKIT_INLINE bool select_by_override(const selection_policy& policy, const system_snapshot& system,
                                      device_selection& selection) {
  if (!policy.use_environment || !system.gpukit_device || trim_whitespace(*system.gpukit_device).empty()) {
    return false;
  }
  const device d = resolve_override(*system.gpukit_device, system);
  if (d.is_cpu() && policy.require_gpu) {
    throw no_device_error("GPUKIT_DEVICE=\"" + *system.gpukit_device +
                          "\" selects the CPU, but the policy requires a GPU");
  }
  selection.device = d;
  selection.source = device_selection::decided_by::environment_override;
  selection.reason = "GPUKIT_DEVICE=\"" + *system.gpukit_device + "\" overrides the policy";
  if (d.is_cuda()) {
    const auto& verdict = selection.candidates[static_cast<std::size_t>(d.ordinal())];
    if (!verdict.eligible) selection.reason += " (although " + verdict.note + ")";
  }
  return true;
}

GPUKIT_INLINE bool select_by_local_rank(const selection_policy& policy, const system_snapshot& system,
                                        device_selection& selection) {
  const std::optional<int> rank =
      policy.use_environment && system.local_rank ? std::optional<int>(parse_local_rank(system)) : std::nullopt;
  if (!rank || system.gpus.empty()) return false;
  const int count = static_cast<int>(system.gpus.size());
  const int ordinal = *rank % count;
  const auto& verdict = selection.candidates[static_cast<std::size_t>(ordinal)];
  const std::string mapping = system.local_rank_variable + "=" + std::to_string(*rank) +
                              " maps to cuda:" + std::to_string(ordinal) + " (rank % " + std::to_string(count) +
                              " visible)";
  if (!verdict.eligible) {
    throw no_device_error(mapping + ", which does not satisfy the policy: " + verdict.note +
                          "; each rank must use its own device, so no other device is chosen");
  }
  selection.device = device::cuda(ordinal);
  selection.source = device_selection::decided_by::local_rank;
  selection.reason = mapping;
  if (*rank >= count) selection.reason += "; more ranks than devices, so ranks share devices";
  return true;
}

GPUKIT_INLINE bool select_by_policy(const selection_policy& policy, const system_snapshot& system,
                                    device_selection& selection) {
  const gpu_snapshot* best = nullptr;
  for (std::size_t i = 0; i < system.gpus.size(); ++i) {
    if (!selection.candidates[i].eligible) continue;
    const gpu_snapshot& g = system.gpus[i];
    if (best == nullptr) {
      best = &g;
      continue;
    }
    switch (policy.prefer) {
      case device_preference::first:
        break;
      case device_preference::most_free_memory:
        if (ranks_above_by_memory(g, *best)) best = &g;
        break;
      case device_preference::least_utilized:
        if (g.utilization_percent &&
            (!best->utilization_percent || *g.utilization_percent < *best->utilization_percent)) {
          best = &g;
        }
        break;
    }
  }
  if (best == nullptr) return false;
  selection.device = best->device;
  selection.source = device_selection::decided_by::policy;
  switch (policy.prefer) {
    case device_preference::first:
      selection.reason = "the first visible device that meets the policy";
      break;
    case device_preference::most_free_memory: {
      if (!best->free_memory) {
        selection.reason = "the most total memory (" + format_bytes(best->total_memory) +
                           "; free memory unknown: " + system.telemetry + ")";
        break;
      }
      selection.reason =
          "the most free memory (" + format_bytes(*best->free_memory) + ", from " + best->free_memory_source + ")";
      std::string unknown;  // eligible devices left out of the comparison
      for (std::size_t i = 0; i < system.gpus.size(); ++i) {
        if (selection.candidates[i].eligible && !system.gpus[i].free_memory) {
          unknown += (unknown.empty() ? "" : ", ") + system.gpus[i].device.to_string();
        }
      }
      if (!unknown.empty()) {
        selection.reason += "; free memory of " + unknown +
                            " unknown, so not compared (allow_context_probe reads it with cudaMemGetInfo)";
      }
      break;
    }
    case device_preference::least_utilized:
      selection.reason = best->utilization_percent
                             ? "the least utilised (" + std::to_string(*best->utilization_percent) + "% busy)"
                             : "the first eligible device (utilisation unknown: " + system.telemetry + ")";
      break;
  }
  return true;
}

GPUKIT_INLINE void select_cpu_fallback(const selection_policy& policy, const system_snapshot& system,
                                       device_selection& selection) {
  std::string why;
  if (system.gpus.empty()) {
    why = system.no_gpu_reason.empty() ? std::string("no CUDA device is visible") : system.no_gpu_reason;
  } else {
    why = "no visible device meets the policy:";
    for (const auto& c : selection.candidates) why += " " + c.device.to_string() + " (" + c.name + "): " + c.note + ";";
    why.pop_back();
  }
  // Without a device, the count's failure is the cause: carried, so a handler can tell 803 from no driver.
  const cudaError_t cause = system.gpus.empty() ? system.device_count_result : cudaSuccess;
  if (policy.require_gpu) {
    throw no_device_error("select_device: a GPU is required, but " + why, cause,
                          cause == cudaSuccess ? std::string() : std::string("cudaGetDeviceCount"));
  }
  selection.device = device::cpu();
  selection.source = device_selection::decided_by::cpu_fallback;
  selection.reason = why + "; using the CPU";
  // A GPU node whose driver is broken must not pass for a CPU-only machine with nothing but a reason string.
  if (is_cuda_initialisation_failure(cause)) {
    warn_parts("select_device: ", describe_cuda_initialisation_failure(cause),
               "; using the CPU (selection_policy::require_gpu makes this an error)");
  }
}

GPUKIT_INLINE std::string describe_cuda_initialisation_failure(cudaError_t result) {
  std::string text = std::string("CUDA failed to initialise, so no GPU is usable: cudaGetDeviceCount returned ") +
                     cudaGetErrorName(result) + " (" + std::to_string(static_cast<int>(result)) +
                     "): " + cudaGetErrorString(result);
  if (const char* hint = cuda_result_hint(result)) text += std::string("; ") + hint;
  return text;
}

GPUKIT_INLINE device_count_answer ask_device_count() {
  note_cuda_use();
  device_count_answer asked;  // count: not written by CUDA on error
  asked.result = cudaGetDeviceCount(&asked.count);
  forget_failure(asked.result);
  return asked;
}

GPUKIT_INLINE std::string describe_device_count(cudaError_t result, int count) {
  if (result == cudaErrorNoDevice || result == cudaErrorInvalidDevice) {  // the driver runs and shows no device
    const auto visible = visible_devices_in_effect();
    // The variable hides them all, for the reason the reading gives: read without the installed GPUs, a repeat after
    // an entry that names no installed GPU looks like one that empties the set (CUDA's answer tells them apart).
    if (!visible.all_visible() && visible.devices.empty() &&
        visible.emptied_by_repeat == (result == cudaErrorInvalidDevice)) {
      return visible.describe();
    }
    if (result == cudaErrorInvalidDevice) {  // CUDA_VISIBLE_DEVICES naming a device twice (measured on an H100)
      return "CUDA hides every device (cudaGetDeviceCount returned cudaErrorInvalidDevice), as it does when " +
             describe_visible_devices_variable() + " names a device twice";
    }
    if (!visible.all_visible()) {  // entries that look valid but name no installed GPU (an index, a UUID typo)
      return "the driver reports no CUDA-capable GPU among those " + describe_visible_devices_variable() +
             " names (cudaErrorNoDevice): check its entries against nvidia-smi -L";
    }
    return "the driver reports no CUDA-capable GPU (cudaErrorNoDevice)";
  }
  switch (result) {
    case cudaErrorInsufficientDriver:
      return "no NVIDIA driver is loaded (cudaGetDeviceCount returned cudaErrorInsufficientDriver), so no CUDA "
             "device is usable";
    case cudaErrorStubLibrary:
      return "only the toolkit's stub libcuda.so was found, not the driver (cudaErrorStubLibrary)";
    case cudaSuccess:
      return count <= 0 ? "no CUDA device is visible" : "";
    default:
      return describe_cuda_initialisation_failure(result);
  }
}
}  // namespace detail

GPUKIT_INLINE device_selection select_device(const selection_policy& policy, const system_snapshot& system) {
  detail::check_snapshot(system);
  device_selection selection;
  selection.candidates = detail::judge_candidates(policy, system);
  if (detail::select_by_override(policy, system, selection)) return selection;
  if (detail::select_by_local_rank(policy, system, selection)) return selection;
  if (detail::select_by_policy(policy, system, selection)) return selection;
  detail::select_cpu_fallback(policy, system, selection);
  return selection;
}

GPUKIT_INLINE std::string describe_no_gpu() {
  const detail::device_count_answer asked = detail::ask_device_count();
  return detail::describe_device_count(asked.result, asked.count);
}

GPUKIT_INLINE system_snapshot take_system_snapshot(const selection_policy& policy) {
  check_visible_devices_unchanged();
  system_snapshot system;
  if (const char* value = std::getenv("GPUKIT_DEVICE")) system.gpukit_device = value;
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && !detail::trim_whitespace(value).empty()) {  // blank, as for GPUKIT_DEVICE: not set
      system.local_rank_variable = name;
      system.local_rank = value;
      break;
    }
  }
  // One question: a second cudaGetDeviceCount could answer otherwise (a transient failure), and the reason would
  // then describe another answer than the devices listed.
  const detail::device_count_answer asked = detail::ask_device_count();
  const int count = asked.count;
  system.device_count_result = asked.result;
  if (system.device_count_result != cudaSuccess || count <= 0) {
    system.no_gpu_reason = detail::describe_device_count(system.device_count_result, count);
    return system;
  }
  const bool need_free = policy.min_free_bytes > 0 || policy.prefer == device_preference::most_free_memory;
  const bool need_utilization = policy.prefer == device_preference::least_utilized;
  const nvml::library* nvml_library = nullptr;
  if (need_free || need_utilization) {
    nvml_library = &nvml::instance();
    system.telemetry = nvml_library->status();
    if (!nvml_library->available()) nvml_library = nullptr;
  }
  int known_to_nvml = 0;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    const device d = device::cuda(ordinal);
    gpu_snapshot g;
    g.device = d;
    const device_properties* read = nullptr;
    try {
      read = &properties(d);
    } catch (const error& e) {  // one device that cannot answer is rejected with the reason; the others may do
      g.unusable = std::string("its properties could not be read: ") + e.what();
      system.gpus.push_back(std::move(g));
      continue;
    }
    const device_properties& p = *read;
    g.name = p.name;
    g.uuid = p.uuid;
    g.total_memory = p.total_memory;
    g.compute_capability = p.compute_capability_major * 10 + p.compute_capability_minor;
    g.compute_mode = p.compute_mode;
    if (need_free && nvml_library != nullptr) {
      if (auto m = nvml_library->memory(p)) {
        g.free_memory = static_cast<std::size_t>(m->free);
        g.free_memory_source = "NVML";
      }
    }
    if (need_utilization && nvml_library != nullptr) g.utilization_percent = nvml_library->utilization_percent(p);
    if (nvml_library != nullptr && nvml_library->knows(p)) ++known_to_nvml;
    system.gpus.push_back(std::move(g));
  }
  if (nvml_library != nullptr && known_to_nvml == 0) {  // "NVML loaded from ..." would not say why nothing came
    system.telemetry = "NVML knows none of the " + std::to_string(count) +
                       (count == 1 ? " visible device" : " visible devices") + " (looked up by UUID and PCI bus id; " +
                       system.telemetry + ")";
  }
  if (need_free && policy.allow_context_probe) {
    const int only = detail::device_the_environment_chooses(policy, system);
    for (gpu_snapshot& g : system.gpus) {
      if (g.free_memory || !g.unusable.empty() || (only >= 0 && g.device.ordinal() != only)) continue;
      // Not a device the policy rejects anyway: the probe creates a context, which holds memory.
      if (g.compute_capability < policy.min_compute_capability || g.compute_mode == cudaComputeModeProhibited) {
        continue;
      }
      try {
        g.free_memory = query_memory_info(g.device).free_bytes;  // creates the device's context
        g.free_memory_source = "cudaMemGetInfo";
      } catch (const error& e) {  // e.g. a device in prohibited or busy exclusive compute mode: the others may do
        g.unusable = std::string("its memory could not be queried: ") + e.what();
      }
    }
  }
  return system;
}

GPUKIT_INLINE device_selection select_device(const selection_policy& policy) {
  return select_device(policy, take_system_snapshot(policy));
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
