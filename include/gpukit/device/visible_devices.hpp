// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Says which devices the CUDA runtime makes visible for a value of CUDA_VISIBLE_DEVICES, following the runtime's
/// rules (see docs in README, "CUDA_VISIBLE_DEVICES"):
/// - unset: every installed device; empty: none;
/// - a comma-separated list; the first entry decides its form: integers, `GPU-<uuid>` (full or a unique prefix) or
///   MIG (`MIG-<uuid>` or `MIG-GPU-<uuid>/<gi>/<ci>`, of which CUDA enumerates only the first);
/// - integers are read like strtoul after trimming whitespace (`1gpu2` is 1), at any size (never clamped, so
///   `0,5000000000,1073741824` is three distinct indices and the list ends at the second); an entry that is not a
///   non-negative integer (`-1`, `NoDevFiles`, `abc`, an empty entry) ends the list; so does an index beyond the
///   installed count;
/// - a UUID list ends at its first entry that is not a UUID, that matches no device, or whose prefix is ambiguous;
/// - a repeated device empties the whole set;
/// - the order of the list defines the ordinals: `2,1` makes physical device 2 `cuda:0`.
/// The parser itself is pure (no CUDA call); pass what is installed (from NVML) to apply the range and UUID checks.

#include <gpukit/detail/config.hpp>
#include <gpukit/device/device.hpp>
#include <gpukit/error.hpp>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// Outside the per-mode namespace (detail/config.hpp), as the snapshot it compares against (error.hpp): CUDA reads
// CUDA_VISIBLE_DEVICES once per process, so code built in either default-stream mode warns once between them.
namespace gpukit {
namespace mode_independent {

/// Whether check_visible_devices_unchanged has warned: once per process, not once per shared library or
/// default-stream mode (exported). The name carries the layout's version, as cuda_environment_at_init_v1's does.
GPUKIT_EXPORT inline std::atomic<bool>& visible_devices_warned_v1() noexcept {
  static std::atomic<bool> warned{false};
  return warned;
}

}  // namespace mode_independent
}  // namespace gpukit

GPUKIT_BEGIN_NAMESPACE

/// The physical GPUs installed, regardless of CUDA_VISIBLE_DEVICES, where known (NVML reports them).
struct installed_gpus {
  int count = -1;                  ///< number of installed GPUs, or -1 when unknown
  std::vector<std::string> uuids;  ///< their full UUIDs ("GPU-..."), or empty when unknown
};

/// One device the runtime will make visible, in CUDA ordinal order.
struct visible_device_entry {
  std::string entry;     ///< the list entry as written, whitespace trimmed
  long long index = -1;  ///< integer lists: the index of the installed device (CUDA enumeration order), never
                         ///< clamped (LLONG_MAX for larger values; describe() shows those as written); else -1
  std::string uuid;      ///< UUID lists: the full UUID it resolved to, when the installed UUIDs are known
};

/// The outcome of interpreting CUDA_VISIBLE_DEVICES.
struct visible_devices {
  /// What kind of list the value is, decided by its first entry.
  enum class list_form {
    unset,      ///< the variable is not set: every installed device is visible
    empty,      ///< empty or all whitespace: no device is visible
    ordinals,   ///< integer indices of installed devices
    gpu_uuids,  ///< `GPU-...` UUIDs or unique prefixes
    mig         ///< a MIG instance (`MIG-...`); only the first entry counts
  };

  list_form form = list_form::unset;          ///< the form of the value
  std::string value;                          ///< the variable's value ("" when unset)
  std::vector<visible_device_entry> devices;  ///< devices[i] becomes cuda:i (meaningless when form is unset)
  std::string note;       ///< why entries were dropped or the set emptied; empty when every entry counted
  bool verified = false;  ///< the installed GPUs were known, so range and UUID checks were applied
  int installed = -1;     ///< installed GPU count when known
  /// A repeated entry emptied the set: CUDA then hides every device and answers cudaGetDeviceCount, and every call
  /// naming a device, with cudaErrorInvalidDevice rather than cudaErrorNoDevice. Exact when `verified`: without the
  /// installed GPUs, a repeat after an entry that names none (where CUDA's list ends) counts too, and two prefixes of
  /// one GPU's UUID do not.
  bool emptied_by_repeat = false;

  /// Every installed device is visible (the variable is unset).
  bool all_visible() const noexcept;

  /// How many devices CUDA will report, or nullopt when the variable is unset and the installed count is unknown.
  std::optional<int> count() const;

  /// One or two plain sentences, e.g.
  /// `CUDA_VISIBLE_DEVICES="0,2,-1,1": 2 devices visible: index 0 as cuda:0, index 2 as cuda:1. Entry 3 ("-1") is
  /// not a non-negative integer, so the list ends before it.`
  std::string describe() const;
};

namespace detail {

GPUKIT_INLINE std::vector<std::string_view> split_commas(std::string_view s);

/// Reads an entry the way strtoul does (64-bit unsigned long): an optional sign, then decimal digits; anything after
/// the digits is ignored; a value beyond ULLONG_MAX saturates there, as strtoul's does. Returns nullopt for "no
/// digits" or a negative value. Never clamped to a smaller bound, so distinct large indices stay distinct.
GPUKIT_INLINE std::optional<unsigned long long> read_ordinal_like_strtoul(std::string_view entry);

/// A device index for visible_device_entry::index: the value, or LLONG_MAX beyond it (describe() then shows the
/// entry as written).
GPUKIT_INLINE long long index_for_entry(unsigned long long value) noexcept;

GPUKIT_INLINE bool starts_with(std::string_view s, std::string_view prefix);

GPUKIT_INLINE std::string quoted_entry(std::size_t position, std::string_view entry);

}  // namespace detail

namespace detail {

/// A repeated device: CUDA then hides every device (the set is emptied).
GPUKIT_INLINE visible_devices& empty_for_repeat(visible_devices& result, std::size_t position, std::string_view entry,
                                                const char* what);

/// A MIG instance list: CUDA takes the first entry only; nothing to check it against.
GPUKIT_INLINE void parse_mig_list(const std::vector<std::string_view>& entries, visible_devices& result);

/// A GPU UUID (prefix) list, read in one pass, each entry matched against the installed GPUs' UUIDs where known.
GPUKIT_INLINE void parse_uuid_list(const std::vector<std::string_view>& entries, const installed_gpus& installed,
                                   visible_devices& result);

/// An integer list, read like the runtime's strtoul in one pass, each index checked against the installed count where
/// known.
GPUKIT_INLINE void parse_ordinal_list(const std::vector<std::string_view>& entries, const installed_gpus& installed,
                                      visible_devices& result);

}  // namespace detail

/// Interprets a CUDA_VISIBLE_DEVICES value (nullptr: unset) the way the CUDA runtime does. `installed` enables the
/// checks that need to know the machine (index range, UUID prefixes); without it those entries are taken as valid
/// and the result says it was not verified. Pure: no CUDA call, no environment access.
GPUKIT_INLINE visible_devices parse_visible_devices(const char* value, const installed_gpus& installed = {});

/// The warning text when CUDA_VISIBLE_DEVICES now differs from its value when CUDA was initialised, else empty.
GPUKIT_INLINE std::string visible_devices_changed_message();

namespace detail {
/// mode_independent::visible_devices_warned_v1: one flag for both default-stream modes.
inline std::atomic<bool>& visible_devices_warned() noexcept { return mode_independent::visible_devices_warned_v1(); }
}  // namespace detail

/// Warns once per process (through gpukit::warn) if CUDA_VISIBLE_DEVICES changed after CUDA was initialised.
/// Returns true if the variable is unchanged.
GPUKIT_INLINE bool check_visible_devices_unchanged();

/// Interprets the CUDA_VISIBLE_DEVICES that CUDA uses in this process (the value at initialisation), checked
/// against `installed` when given. Initialises CUDA if nothing has yet (cudaGetDeviceCount), so that the value read
/// here is the one CUDA reads: a later change is in effect for neither. The value is recorded when gpukit first
/// touches CUDA: if the program initialised CUDA itself and changed the variable before that, the value here is the
/// changed one, not CUDA's.
GPUKIT_INLINE visible_devices visible_devices_in_effect(const installed_gpus& installed = {});

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE

GPUKIT_INLINE bool visible_devices::all_visible() const noexcept { return form == list_form::unset; }

GPUKIT_INLINE std::optional<int> visible_devices::count() const {
  if (form == list_form::unset) {
    if (installed < 0) return std::nullopt;
    return installed;
  }
  return static_cast<int>(devices.size());
}

GPUKIT_INLINE std::string visible_devices::describe() const {
  std::string text;
  if (form == list_form::unset) {
    text = "CUDA_VISIBLE_DEVICES is unset: every installed device is visible";
    if (installed >= 0) text += " (" + std::to_string(installed) + " installed)";
    return text + ".";
  }
  text = "CUDA_VISIBLE_DEVICES=\"" + value + "\": ";
  const std::size_t n = devices.size();
  text += n == 0 ? "no device visible" : std::to_string(n) + (n == 1 ? " device visible: " : " devices visible: ");
  for (std::size_t i = 0; i < n; ++i) {
    if (i) text += ", ";
    const auto& d = devices[i];
    if (form == list_form::ordinals) {
      // A saturated index is shown as written, not as the saturated number.
      text += "index " + (d.index == std::numeric_limits<long long>::max() ? d.entry : std::to_string(d.index));
    } else {
      text += d.uuid.empty() ? d.entry : d.uuid;
    }
    text += " as cuda:" + std::to_string(i);
  }
  text += ".";
  if (!note.empty()) text += " " + note;
  if (!verified && form != list_form::empty && n > 0) {
    text += " (Installed GPUs unknown: ranges and UUIDs not checked.)";
  }
  return text;
}
namespace detail {

GPUKIT_INLINE std::vector<std::string_view> split_commas(std::string_view s) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = s.find(',', start);
    parts.push_back(s.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return parts;
}

GPUKIT_INLINE std::optional<unsigned long long> read_ordinal_like_strtoul(std::string_view entry) {
  std::size_t i = 0;
  bool negative = false;
  if (i < entry.size() && (entry[i] == '+' || entry[i] == '-')) {
    negative = entry[i] == '-';
    ++i;
  }
  const std::size_t first_digit = i;
  while (i < entry.size() && entry[i] >= '0' && entry[i] <= '9') ++i;
  const auto value = parse_decimal_saturating(entry.substr(first_digit, i - first_digit));
  if (!value || (negative && *value != 0)) return std::nullopt;
  return value;
}

GPUKIT_INLINE long long index_for_entry(unsigned long long value) noexcept {
  constexpr auto max = static_cast<unsigned long long>(std::numeric_limits<long long>::max());
  return static_cast<long long>(value < max ? value : max);
}

GPUKIT_INLINE bool starts_with(std::string_view s, std::string_view prefix) {
  return s.size() >= prefix.size() && s.substr(0, prefix.size()) == prefix;
}

GPUKIT_INLINE std::string quoted_entry(std::size_t position, std::string_view entry) {
  return "Entry " + std::to_string(position + 1) + " (\"" + std::string(entry) + "\")";
}

GPUKIT_INLINE visible_devices& empty_for_repeat(visible_devices& result, std::size_t position, std::string_view entry,
                                                const char* what) {
  result.devices.clear();
  result.emptied_by_repeat = true;
  result.note = quoted_entry(position, entry) + " repeats " + what +
                " already listed, and a repeated device makes CUDA hide every device.";
  return result;
}

GPUKIT_INLINE void parse_mig_list(const std::vector<std::string_view>& entries, visible_devices& result) {
  result.form = visible_devices::list_form::mig;
  result.devices.push_back({std::string(entries.front()), -1, {}});
  if (entries.size() > 1) {
    result.note = "CUDA enumerates only one MIG instance, so the entries after the first are ignored.";
  }
  result.verified = false;  // MIG instances are not in the installed list
}

GPUKIT_INLINE void parse_uuid_list(const std::vector<std::string_view>& entries, const installed_gpus& installed,
                                   visible_devices& result) {
  result.form = visible_devices::list_form::gpu_uuids;
  result.verified = !installed.uuids.empty();
  // One pass, as the runtime reads it: the list ends at the first entry that is not a UUID or, where the installed
  // GPUs are known, that matches none of them or several (an ambiguous prefix); a repeat before that end (the same
  // entry, or two naming the same GPU) empties the set. A repeat after the end is never read, as for indices.
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string_view entry = entries[i];
    if (!starts_with(entry, "GPU-")) {
      result.note =
          quoted_entry(i, entry) + " is not a GPU UUID; a list that starts with UUIDs ends at its first other entry.";
      return;
    }
    std::string resolved;
    if (result.verified) {
      int matches = 0;
      for (const auto& uuid : installed.uuids) {
        if (starts_with(uuid, entry)) {
          ++matches;
          resolved = uuid;
        }
      }
      if (matches != 1) {
        result.note = quoted_entry(i, entry) +
                      (matches == 0 ? " matches no installed GPU" : " is a prefix of several installed GPUs' UUIDs") +
                      ", so the list ends before it.";
        return;
      }
    }
    for (const auto& d : result.devices) {
      if (d.entry == entry) {
        empty_for_repeat(result, i, entry, "a UUID");
        return;
      }
      if (!resolved.empty() && d.uuid == resolved) {
        empty_for_repeat(result, i, entry, "a GPU");
        return;
      }
    }
    result.devices.push_back({std::string(entry), -1, resolved});
  }
}

GPUKIT_INLINE void parse_ordinal_list(const std::vector<std::string_view>& entries, const installed_gpus& installed,
                                      visible_devices& result) {
  result.form = visible_devices::list_form::ordinals;
  // Like the runtime's reader: the list ends at the first entry that is not a non-negative integer or, where the
  // installed count is known, at the first index beyond it; a repeat before that end empties the set. The order
  // matters for `0,5,0` on fewer than 6 GPUs: one device on an H100 (a repeat after the end is never read), where
  // PyTorch's reading, which looks for repeats first, says none.
  std::vector<unsigned long long> values;  // as strtoul read them: repeats compare these
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto index = read_ordinal_like_strtoul(entries[i]);
    if (!index) {
      result.note = quoted_entry(i, entries[i]) + " is not a non-negative integer, so the list ends before it.";
      return;
    }
    if (installed.count >= 0 && *index >= static_cast<unsigned long long>(installed.count)) {
      result.note = quoted_entry(i, entries[i]) + " is beyond the " + std::to_string(installed.count) +
                    " installed GPU" + (installed.count == 1 ? "" : "s") + ", so the list ends before it.";
      return;
    }
    for (unsigned long long earlier : values) {
      if (earlier == *index) {
        empty_for_repeat(result, i, entries[i], "an index");
        return;
      }
    }
    values.push_back(*index);
    result.devices.push_back({std::string(entries[i]), index_for_entry(*index), {}});
  }
}
}  // namespace detail

GPUKIT_INLINE visible_devices parse_visible_devices(const char* value, const installed_gpus& installed) {
  visible_devices result;
  result.installed = installed.count;
  result.verified = installed.count >= 0;
  if (value == nullptr) return result;  // unset: all devices
  result.value = value;
  const std::string_view text(result.value);
  if (detail::trim_whitespace(text).empty()) {
    result.form = visible_devices::list_form::empty;
    result.note = "An empty value hides every device.";
    return result;
  }
  std::vector<std::string_view> entries;
  for (auto e : detail::split_commas(text)) entries.push_back(detail::trim_whitespace(e));
  if (detail::starts_with(entries.front(), "MIG-")) {
    detail::parse_mig_list(entries, result);
  } else if (detail::starts_with(entries.front(), "GPU-")) {
    detail::parse_uuid_list(entries, installed, result);
  } else {
    detail::parse_ordinal_list(entries, installed, result);
  }
  return result;
}

GPUKIT_INLINE std::string visible_devices_changed_message() {
  if (!detail::visible_devices_variable_changed()) return {};
  return "CUDA_VISIBLE_DEVICES is now " + detail::show_variable_value(mode_independent::read_cuda_environment()) +
         " but was " + detail::show_variable_value(detail::cuda_environment_at_init()) +
         " when CUDA was initialised in this process; CUDA reads it only once, so the earlier value is in effect. "
         "Set it before the process starts (or before the first CUDA call).";
}
GPUKIT_INLINE bool check_visible_devices_unchanged() {
  const std::string message = visible_devices_changed_message();
  if (message.empty()) return true;
  // Not under std::call_once: a handler that checks again (select_device, say) would wait for itself.
  if (!detail::visible_devices_warned().exchange(true)) warn(message);
  return false;
}

GPUKIT_INLINE visible_devices visible_devices_in_effect(const installed_gpus& installed) {
  (void)device_count();  // takes gpukit's snapshot, then lets the runtime read the variable
  check_visible_devices_unchanged();
  const auto& at_init = detail::cuda_environment_at_init();
  return parse_visible_devices(at_init.set ? at_init.value.c_str() : nullptr, installed);
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
