// Fuzz target: device::parse and select_device over hand-made system_snapshots (include/gpukit/device/select.hpp).
// Never a crash: either a selection that obeys the policy or a gpukit::error of the documented type. device::parse
// and GPUKIT_DEVICE / local-rank resolution are compared with a model of their documented rules.
#include <gpukit/device/select.hpp>

#include "fuzz_support.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

bool is_c_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string trim(const std::string& s, bool all_space) {
  auto space = [&](char c) { return all_space ? is_c_space(c) : (c == ' ' || c == '\t'); };
  std::size_t b = 0;
  std::size_t e = s.size();
  while (b < e && space(s[b])) ++b;
  while (e > b && space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

bool begins_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

/// "cpu", "cuda", "cuda:N" after trimming whitespace. nullopt: must be rejected; `unsure`: an ordinal too large for
/// any machine, which the parser may reject.
std::optional<gpukit::device> model_parse(const std::string& text, bool& unsure) {
  unsure = false;
  const std::string t = trim(text, true);
  if (t == "cpu") return gpukit::device::cpu();
  if (t == "cuda") return gpukit::device::cuda(0);
  if (!begins_with(t, "cuda:") || t.size() == 5) return std::nullopt;
  unsigned long long v = 0;
  for (std::size_t i = 5; i < t.size(); ++i) {
    if (t[i] < '0' || t[i] > '9') return std::nullopt;
    if (v <= 1'000'000'000) v = v * 10 + static_cast<unsigned>(t[i] - '0');
  }
  if (v > 1'000'000) {
    unsure = true;
    return std::nullopt;
  }
  return gpukit::device::cuda(static_cast<int>(v));
}

/// Texts that reach device::parse: templates the dictionary does not find quickly, and raw bytes.
std::string device_text(gpukit_fuzz::input& in) {
  static const char* const spaces[] = {"", " ", "\t", "\n", " \r\n", "\v", "\f"};
  const std::uint8_t kind = in.byte();
  std::string core;
  switch (kind % 6) {
    case 0:
      core = "cpu";
      break;
    case 1:
      core = "cuda";
      break;
    case 2:
      core = "cuda:" + std::to_string(in.in_range(0, 12));
      break;
    case 3:
      core = "cuda:" + std::to_string(in.u64());
      break;
    case 4:
      core = "GPU-" + in.text(6);
      break;
    default:
      return in.text(24);
  }
  return spaces[(kind / 6) % 7] + core + spaces[(kind / 42) % 7];
}

bool surrounded_by_other_whitespace(const std::string& s) { return trim(s, true) != trim(s, false); }

void check_parse(const std::string& text) {
  bool unsure = false;
  const std::optional<gpukit::device> want = model_parse(text, unsure);
  std::optional<gpukit::device> got;
  try {
    got = gpukit::device::parse(text);
  } catch (const gpukit::invalid_argument_error&) {
  }
  const std::string where = "device::parse(\"" + text + "\")";
  if (got) GPUKIT_FUZZ_CHECK(gpukit::device::parse(got->to_string()) == *got, where);
  if (unsure) {
    if (got) GPUKIT_FUZZ_CHECK(got->is_cuda() && got->ordinal() > 1'000'000, where);
    return;
  }
  if (!GPUKIT_FUZZ_FIXED_DEFECT_10 && surrounded_by_other_whitespace(text)) return;  // "cuda:1\n" is rejected
  GPUKIT_FUZZ_CHECK(got.has_value() == want.has_value(), where);
  if (got) GPUKIT_FUZZ_CHECK(*got == *want, where);
}

gpukit::system_snapshot make_snapshot(gpukit_fuzz::input& in) {
  gpukit::system_snapshot system;
  const int n = in.byte() % 7;
  const bool shuffled = GPUKIT_FUZZ_FIXED_DEFECT_7 && in.flag();
  static const char alphabet[] = "ab01";
  for (int i = 0; i < n; ++i) {
    gpukit::gpu_snapshot g;
    g.device = gpukit::device::cuda(shuffled ? static_cast<int>(in.in_range(0, 9)) : i);
    g.name = "gpu" + std::to_string(i);
    g.uuid = "GPU-";
    for (int k = in.byte() % 4; k > 0; --k) g.uuid.push_back(alphabet[in.byte() % 4]);
    g.uuid += "-" + std::to_string(i);
    const std::uint8_t scale = in.byte();
    g.total_memory = (scale & 0x80) ? in.u64() : static_cast<std::size_t>(in.in_range(0, 96)) << 30;
    g.compute_capability = static_cast<int>(in.in_range(0, 120));
    if (scale & 1) {
      g.free_memory = (scale & 2) ? in.u64() : std::min<std::size_t>(g.total_memory, in.in_range(0, 96) << 30);
    }
    if (scale & 4) g.free_memory_source = "NVML";
    if (scale & 8) g.utilization_percent = static_cast<unsigned>(in.in_range(0, 100));
    system.gpus.push_back(g);
  }
  const std::uint8_t env = in.byte();
  if (env & 1) system.no_gpu_reason = in.text(8);
  if (env & 2) system.telemetry = in.text(8);
  if (env & 4) system.gpukit_device = device_text(in);
  if (env & 8) {
    static const char* const names[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"};
    system.local_rank_variable = names[(env >> 4) % 4];
    system.local_rank = (env & 0x40) ? in.text(12) : std::to_string(in.in_range(0, 1ULL << 40));
  }
  return system;
}

gpukit::selection_policy make_policy(gpukit_fuzz::input& in) {
  gpukit::selection_policy p;
  const std::uint8_t bits = in.byte();
  p.prefer = static_cast<gpukit::device_preference>(bits % 3);
  p.require_gpu = (bits & 4) != 0;
  p.use_environment = (bits & 8) != 0;
  p.allow_context_probe = (bits & 16) != 0;  // no effect on a snapshot
  if (bits & 32) p.min_free_bytes = (bits & 64) ? in.u64() : static_cast<std::size_t>(in.in_range(0, 96)) << 30;
  p.min_compute_capability = static_cast<int>(in.in_range(0, 120));
  return p;
}

std::size_t usable(const gpukit::gpu_snapshot& g) { return g.free_memory ? *g.free_memory : g.total_memory; }

bool eligible(const gpukit::gpu_snapshot& g, const gpukit::selection_policy& p) {
  return g.compute_capability >= p.min_compute_capability && !(p.min_free_bytes > 0 && usable(g) < p.min_free_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpukit_fuzz::input in(data, size);
  check_parse(device_text(in));
  const gpukit::selection_policy policy = make_policy(in);
  const gpukit::system_snapshot system = make_snapshot(in);

  using decided = gpukit::device_selection::decided_by;
  const bool override_used =
      policy.use_environment && system.gpukit_device && !trim(*system.gpukit_device, true).empty();
  // A malformed local rank may be refused whether or not a GPU is visible; it picks the device only when one is.
  const bool rank_checked = !override_used && policy.use_environment && system.local_rank.has_value();
  const bool rank_used = rank_checked && !system.gpus.empty();
  bool any_eligible = false;
  for (const auto& g : system.gpus) any_eligible = any_eligible || eligible(g, policy);

  std::optional<gpukit::device_selection> result;
  std::string error_text;
  try {
    result = gpukit::select_device(policy, system);
  } catch (const gpukit::invalid_argument_error& e) {
    error_text = std::string("invalid_argument_error: ") + e.what();
  } catch (const gpukit::no_device_error& e) {
    error_text = std::string("no_device_error: ") + e.what();
  } catch (const gpukit::error& e) {
    gpukit_fuzz::fail(std::string("select_device threw an undocumented gpukit::error: ") + e.what());
  }
  // Any other exception escapes and aborts the fuzzer: it is not a documented outcome.
  const std::string where = result ? result->report() : error_text;

  bool ordered = true;  // gpus[i] is cuda:i, as take_system_snapshot makes it
  for (std::size_t i = 0; i < system.gpus.size(); ++i) {
    ordered = ordered && system.gpus[i].device == gpukit::device::cuda(static_cast<int>(i));
  }
  if (!ordered) {  // defect 7: refused with a clear error, never read out of bounds
    GPUKIT_FUZZ_CHECK(!result && error_text.rfind("invalid_argument_error", 0) == 0, where);
    return 0;
  }

  if (!result) {
    // Errors come only from the override, the local rank or a required GPU.
    GPUKIT_FUZZ_CHECK(override_used || rank_checked || policy.require_gpu, where);
    if (!override_used && !rank_checked) GPUKIT_FUZZ_CHECK(!any_eligible, where);
    if (override_used) {  // a valid override naming a visible device must be taken
      const std::string text = trim(*system.gpukit_device, true);
      bool unsure = false;
      const auto want = begins_with(text, "GPU-") ? std::nullopt : model_parse(text, unsure);
      const bool in_range = want && (want->is_cpu() || want->ordinal() < static_cast<int>(system.gpus.size()));
      GPUKIT_FUZZ_CHECK(!in_range || (want->is_cpu() && policy.require_gpu), where);
    }
    if (rank_checked) {  // a valid rank is accepted; with GPUs, it must be taken when its device is eligible
      const std::string text = trim(*system.local_rank, true);
      bool digits = !text.empty() && text.size() <= 18;
      unsigned long long rank = 0;
      for (char c : text) {
        digits = digits && c >= '0' && c <= '9';
        if (digits) rank = rank * 10 + static_cast<unsigned>(c - '0');
      }
      const bool modelled = digits && rank <= 0x7fffffffULL && (GPUKIT_FUZZ_FIXED_DEFECT_10 || text.size() <= 9);
      if (rank_used) {
        GPUKIT_FUZZ_CHECK(!modelled || !eligible(system.gpus[rank % system.gpus.size()], policy), where);
      } else if (GPUKIT_FUZZ_FIXED_DEFECT_10) {
        GPUKIT_FUZZ_CHECK(!modelled || policy.require_gpu, where);
      }
    }
    return 0;
  }
  const gpukit::device_selection& s = *result;
  GPUKIT_FUZZ_CHECK(s.candidates.size() == system.gpus.size(), where);
  for (std::size_t i = 0; i < system.gpus.size(); ++i) {
    GPUKIT_FUZZ_CHECK(s.candidates[i].device == system.gpus[i].device, where);
    GPUKIT_FUZZ_CHECK(s.candidates[i].eligible == eligible(system.gpus[i], policy), where);
  }
  if (policy.require_gpu) GPUKIT_FUZZ_CHECK(s.device.is_cuda(), where);
  if (s.device.is_cuda()) {
    bool listed = false;
    for (const auto& g : system.gpus) listed = listed || g.device == s.device;
    GPUKIT_FUZZ_CHECK(listed, where);
  }
  switch (s.source) {
    case decided::environment_override:
      GPUKIT_FUZZ_CHECK(override_used, where);
      break;
    case decided::local_rank: {
      GPUKIT_FUZZ_CHECK(rank_used, where);
      const std::string rank_text = trim(*system.local_rank, true);
      unsigned long long rank = 0;
      for (char c : rank_text) {
        GPUKIT_FUZZ_CHECK(c >= '0' && c <= '9', where);
        rank = std::min<unsigned long long>(rank * 10 + static_cast<unsigned>(c - '0'), 1ULL << 62);
      }
      GPUKIT_FUZZ_CHECK(!rank_text.empty(), where);
      const std::size_t expected = static_cast<std::size_t>(rank % system.gpus.size());
      GPUKIT_FUZZ_CHECK(s.device == system.gpus[expected].device, where);
      GPUKIT_FUZZ_CHECK(eligible(system.gpus[expected], policy), where);
      break;
    }
    case decided::policy: {
      GPUKIT_FUZZ_CHECK(!override_used && !rank_used, where);
      const gpukit::gpu_snapshot* chosen = nullptr;
      for (const auto& g : system.gpus) {
        if (g.device == s.device && eligible(g, policy)) chosen = &g;
      }
      GPUKIT_FUZZ_CHECK(chosen != nullptr, where);
      for (const auto& g : system.gpus) {
        if (!eligible(g, policy)) continue;
        if (policy.prefer == gpukit::device_preference::first) {
          GPUKIT_FUZZ_CHECK(&g == chosen || &g > chosen, where + " (not the first eligible)");
        } else if (policy.prefer == gpukit::device_preference::most_free_memory) {
          // A device whose free memory is known ranks above one whose free memory is not.
          GPUKIT_FUZZ_CHECK(!g.free_memory || chosen->free_memory, where + " (free memory unknown chosen)");
          GPUKIT_FUZZ_CHECK(
              g.free_memory.has_value() != chosen->free_memory.has_value() || usable(g) <= usable(*chosen),
              where + " (not the most memory)");
        } else if (chosen->utilization_percent && g.utilization_percent) {
          GPUKIT_FUZZ_CHECK(*g.utilization_percent >= *chosen->utilization_percent, where + " (not the least used)");
        }
      }
      break;
    }
    case decided::cpu_fallback:
      GPUKIT_FUZZ_CHECK(!override_used && !rank_used && !any_eligible && !policy.require_gpu, where);
      GPUKIT_FUZZ_CHECK(s.device.is_cpu(), where);
      break;
  }
  if (override_used && s.source == decided::environment_override) {
    const std::string text = trim(*system.gpukit_device, true);
    if (!begins_with(text, "GPU-")) {
      bool unsure = false;
      const auto want = model_parse(text, unsure);
      GPUKIT_FUZZ_CHECK(want && *want == s.device, where);
    } else {
      int matches = 0;
      for (const auto& g : system.gpus) matches += begins_with(g.uuid, text) ? 1 : 0;
      GPUKIT_FUZZ_CHECK(matches == 1, where);
    }
  }
  return 0;
}
