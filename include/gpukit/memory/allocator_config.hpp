// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// allocator_options from text, as PyTorch reads PYTORCH_CUDA_ALLOC_CONF: the environment variable
/// GPUKIT_ALLOC_CONF configures the default allocators, e.g.
///
///     GPUKIT_ALLOC_CONF="reserved_limit:40GiB,max_split_size_mb:256,release_before_grow:true"
///
/// Entries are `key:value`, separated by commas; white space around keys and values (line breaks included) is
/// ignored. Sizes are a whole number with an optional unit (B, KiB, MiB, GiB, TiB; KB/MB/GB/TB are read as the
/// binary units too), or `none` where a limit may be absent (reserved_limit, max_split_size). Booleans are
/// true/false (PyTorch's True/False, or 1/0). Parsing is strict: an unknown key, a setting given twice (under
/// either of its names), or a malformed or too large value throws invalid_argument_error naming the entry; options
/// that are inconsistent together (allocator_options::validate) throw it naming the options and the whole string.

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_options.hpp>

#include <cstddef>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {

GPUKIT_INLINE std::string_view trim_spaces(std::string_view s) noexcept;

/// `s` for an error message: bytes outside printable ASCII as \xHH, so that one a terminal would hide (a
/// no-break space, a NUL) shows where it is.
GPUKIT_INLINE std::string printable(std::string_view s);

/// What parse_config_size found.
enum class config_size_result { ok, malformed, too_large };

/// A size in bytes: digits, then an optional unit.
GPUKIT_INLINE config_size_result parse_config_size(std::string_view text, std::size_t& bytes) noexcept;

}  // namespace detail

/// `base` with the settings of `config` applied (see the file comment for the syntax). Keys:
/// - `preset`: `gpukit` (allocator_options{}) or `pytorch` (allocator_options::pytorch()), applied before the others
///   wherever it appears;
/// - sizes: `rounding`, `small_size`, `small_segment_size`, `medium_size`, `medium_segment_size`,
///   `large_segment_rounding`, `small_split_threshold`, `large_split_threshold`, `max_split_size`,
///   `max_oversize_waste` (`max_split_size` may be `none`); `reserved_limit` (or `none`);
/// - numbers: `medium_segment_growth`, `max_split_size_mb` (PyTorch's spelling, in MiB);
/// - booleans: `release_before_grow`, `reuse_before_release`, `cross_stream_reuse`, `front_cache`;
/// - `expandable_segments`: `true`, `false` or `required` (allocator_options::expandable_segments_required: the
///   allocator refuses to be made where they cannot be had);
/// - `front_cache_large`: `true` (from the start), `when_contended` (the default:
///   allocator_options::front_cache_large_when_contended) or `false` (never);
/// - `capture_check`: `every_call` or `gpukit_captures` (capture_checks);
/// The result is validated (allocator_options::validate). Throws invalid_argument_error naming the entry.
GPUKIT_INLINE allocator_options parse_allocator_config(std::string_view config, allocator_options base = {},
                                                       std::string_view source = "allocator configuration");

/// The options the environment asks for: GPUKIT_ALLOC_CONF parsed over `base` (`base` when it is unset).
GPUKIT_INLINE allocator_options allocator_options_from_environment(allocator_options base = {});

GPUKIT_END_NAMESPACE

#if GPUKIT_DETAIL_DEFINITIONS
GPUKIT_BEGIN_NAMESPACE
namespace detail {

GPUKIT_INLINE std::string_view trim_spaces(std::string_view s) noexcept {
  constexpr std::string_view white = " \t\n\r\v\f";  // a configuration file's line breaks too
  const std::size_t first = s.find_first_not_of(white);
  if (first == std::string_view::npos) return {};
  return s.substr(first, s.find_last_not_of(white) - first + 1);
}

GPUKIT_INLINE std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      constexpr char hex[] = "0123456789abcdef";
      out += {'\\', 'x', hex[byte >> 4], hex[byte & 0xf]};
    }
  }
  return out;
}

GPUKIT_INLINE config_size_result parse_config_size(std::string_view text, std::size_t& bytes) noexcept {
  std::size_t digits = 0;
  std::size_t value = 0;
  bool overflow = false;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    const auto d = static_cast<std::size_t>(text[digits] - '0');
    overflow = overflow || value > (std::numeric_limits<std::size_t>::max() - d) / 10;
    if (!overflow) value = value * 10 + d;
    ++digits;
  }
  if (digits == 0) return config_size_result::malformed;
  const std::string_view unit = trim_spaces(text.substr(digits));
  struct named_unit {
    const char* name;
    unsigned shift;
  };
  static constexpr named_unit units[] = {{"", 0},    {"B", 0},    {"KiB", 10}, {"KB", 10},  {"MiB", 20},
                                         {"MB", 20}, {"GiB", 30}, {"GB", 30},  {"TiB", 40}, {"TB", 40}};
  for (const named_unit& u : units) {
    if (unit != u.name) continue;
    if (overflow || value > (std::numeric_limits<std::size_t>::max() >> u.shift)) return config_size_result::too_large;
    bytes = value << u.shift;
    return config_size_result::ok;
  }
  return config_size_result::malformed;
}
}  // namespace detail

GPUKIT_INLINE allocator_options parse_allocator_config(std::string_view config, allocator_options base,
                                                       std::string_view source) {
  auto fail = [&](std::string_view entry, const std::string& why) -> void {
    throw invalid_argument_error("gpukit: " + std::string(source) + " \"" + detail::printable(config) + "\": entry \"" +
                                 detail::printable(entry) + "\": " + why);
  };
  struct entry_text {
    std::string_view text, key, value;
  };
  std::vector<entry_text> entries;
  // max_split_size_mb is PyTorch's name for max_split_size: one setting, which may be given once.
  const auto setting = [](std::string_view key) {
    return key == "max_split_size_mb" ? std::string_view("max_split_size") : key;
  };
  // Each setting's key as given, to find one given twice in linear time: unknown keys are refused only after every
  // entry has been read, so the entries are not bounded by the number of known keys.
  std::unordered_map<std::string_view, std::string_view> keys_by_setting;
  if (!detail::trim_spaces(config).empty()) {
    std::size_t start = 0;
    for (;;) {
      const std::size_t comma = config.find(',', start);
      const std::string_view text = detail::trim_spaces(
          config.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
      const std::size_t colon = text.find(':');
      if (text.empty()) fail(text, "empty entry (a stray comma?)");
      if (colon == std::string_view::npos) fail(text, "expected key:value");
      const entry_text e{text, detail::trim_spaces(text.substr(0, colon)), detail::trim_spaces(text.substr(colon + 1))};
      if (e.value.empty()) fail(text, "no value");
      const auto given = keys_by_setting.emplace(setting(e.key), e.key);
      if (!given.second) {
        const std::string_view earlier_key = given.first->second;
        fail(text, earlier_key == e.key
                       ? "\"" + detail::printable(e.key) + "\" is set twice"
                       : "\"" + detail::printable(e.key) + "\" sets what \"" + detail::printable(earlier_key) +
                             "\" set already (" + std::string(setting(e.key)) + ")");
      }
      entries.push_back(e);
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
  }

  allocator_options o = base;
  for (const entry_text& e : entries) {
    if (e.key != "preset") continue;
    if (e.value == "gpukit") {
      o = allocator_options{};
    } else if (e.value == "pytorch") {
      o = allocator_options::pytorch();
    } else {
      fail(e.text, "preset must be gpukit or pytorch");
    }
  }
  using size_member = std::size_t allocator_options::*;  // an alias: no -Wparentheses warning under nvcc
  struct size_key {
    const char* name;
    size_member member;
  };
  static constexpr size_key sizes[] = {{"rounding", &allocator_options::rounding},
                                       {"small_size", &allocator_options::small_size},
                                       {"small_segment_size", &allocator_options::small_segment_size},
                                       {"medium_size", &allocator_options::medium_size},
                                       {"medium_segment_size", &allocator_options::medium_segment_size},
                                       {"large_segment_rounding", &allocator_options::large_segment_rounding},
                                       {"small_split_threshold", &allocator_options::small_split_threshold},
                                       {"large_split_threshold", &allocator_options::large_split_threshold},
                                       {"max_split_size", &allocator_options::max_split_size},
                                       {"max_oversize_waste", &allocator_options::max_oversize_waste}};
  auto parse_bool = [&](const entry_text& e, const char* expected = "expected true or false") {
    if (e.value == "true" || e.value == "True" || e.value == "1") return true;  // True, False: PyTorch's spelling
    if (e.value == "false" || e.value == "False" || e.value == "0") return false;
    fail(e.text, expected);
    return false;
  };
  constexpr std::size_t largest = std::numeric_limits<std::size_t>::max();
  // A size, or `none` (allocator_options::unlimited) where `none_allowed`.
  auto parse_size = [&](const entry_text& e, bool none_allowed) {
    if (none_allowed && e.value == "none") return allocator_options::unlimited;
    std::size_t bytes = 0;
    const detail::config_size_result r = detail::parse_config_size(e.value, bytes);
    if (r == detail::config_size_result::too_large) {
      fail(e.text, "too large: sizes go up to " + std::to_string(largest) + " bytes" +
                       (none_allowed ? " (none: no limit)" : ""));
    } else if (r != detail::config_size_result::ok) {
      fail(e.text, std::string(none_allowed ? "expected a size such as 512, 64MiB or 40GiB, or none"
                                            : "expected a size such as 512, 64MiB or 2GiB") +
                       " (digits, then B, KiB, KB, MiB, MB, GiB, GB, TiB or TB as written here: KB is KiB)");
    }
    return bytes;
  };
  // A whole number up to `most` (`unit` names what it counts in the message).
  auto parse_count = [&](const entry_text& e, std::size_t most, const char* unit) {
    std::size_t n = 0;
    const detail::config_size_result r = e.value.find_first_not_of("0123456789") != std::string_view::npos
                                             ? detail::config_size_result::malformed
                                             : detail::parse_config_size(e.value, n);
    if (r == detail::config_size_result::too_large || (r == detail::config_size_result::ok && n > most)) {
      fail(e.text, "too large: at most " + std::to_string(most) + unit);
    }
    if (r != detail::config_size_result::ok) fail(e.text, "expected a whole number");
    return n;
  };
  for (const entry_text& e : entries) {
    if (e.key == "preset") continue;
    bool known = false;
    for (const size_key& k : sizes) {
      if (e.key != k.name) continue;
      known = true;
      o.*k.member = parse_size(e, k.member == &allocator_options::max_split_size);
    }
    if (known) continue;
    if (e.key == "reserved_limit") {
      o.reserved_limit = parse_size(e, true);
    } else if (e.key == "max_split_size_mb") {
      o.max_split_size = parse_count(e, largest >> 20, " (MiB)") << 20;
    } else if (e.key == "medium_segment_growth") {
      o.medium_segment_growth = parse_count(e, largest, "");
    } else if (e.key == "release_before_grow") {
      o.release_before_grow = parse_bool(e);
    } else if (e.key == "reuse_before_release") {
      o.reuse_before_release = parse_bool(e);
    } else if (e.key == "cross_stream_reuse") {
      o.cross_stream_reuse = parse_bool(e);
    } else if (e.key == "front_cache") {
      o.front_cache = parse_bool(e);
    } else if (e.key == "front_cache_large") {
      // true: from the start; when_contended (the default): once threads contend; false: never.
      const bool contended = e.value == "when_contended";
      o.front_cache_large = !contended && parse_bool(e, "expected true, false or when_contended");
      o.front_cache_large_when_contended = contended;
    } else if (e.key == "expandable_segments") {
      // required: as true, and the allocator refuses to be made where they cannot be had.
      const bool required = e.value == "required";
      o.expandable_segments = required || parse_bool(e, "expected true, false or required");
      o.expandable_segments_required = required;
    } else if (e.key == "capture_check") {
      if (e.value == "every_call") {
        o.capture_check = capture_checks::every_call;
      } else if (e.value == "gpukit_captures") {
        o.capture_check = capture_checks::gpukit_captures;
      } else {
        fail(e.text, "capture_check must be every_call or gpukit_captures");
      }
    } else {
      fail(e.text,
           "unknown key \"" + detail::printable(e.key) +
               "\" (known: preset, reserved_limit, max_split_size_mb, release_before_grow, reuse_before_release, "
               "cross_stream_reuse, front_cache, front_cache_large, expandable_segments, capture_check, "
               "medium_segment_growth, and the size options of allocator_options)");
    }
  }
  try {
    o.validate();
  } catch (const invalid_argument_error& e) {
    throw invalid_argument_error("gpukit: " + std::string(source) + " \"" + detail::printable(config) +
                                 "\" gives inconsistent options: " + e.what());
  }
  return o;
}

GPUKIT_INLINE allocator_options allocator_options_from_environment(allocator_options base) {
  const char* config = std::getenv("GPUKIT_ALLOC_CONF");
  if (config == nullptr) return base;
  return parse_allocator_config(config, base, "GPUKIT_ALLOC_CONF");
}

GPUKIT_END_NAMESPACE
#endif  // GPUKIT_DETAIL_DEFINITIONS
