// Fuzz target: parse_visible_devices (include/gpukit/device/visible_devices.hpp) against an independent model of
// the CUDA runtime's CUDA_VISIBLE_DEVICES rules (the header's comment; /work/shared/docs/facts.md; PyTorch's
// _parse_visible_devices), over machines with 0-8 GPUs whose UUIDs share prefixes, or unknown machines.
//
// Input: byte 0 = installed count + 1 (mod 10: -1 unknown .. 8), byte 1 bit 0 = UUIDs known, bit 1 = unset; then a
// short hex-ish suffix per installed UUID; the rest is the value (up to the first NUL, as getenv would see it).
#include <gpukit/device/visible_devices.hpp>

#include "fuzz_support.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace {

using form = gpukit::visible_devices::list_form;

struct model_device {
  std::string entry;
  unsigned long long index = 0;  // ordinals: the exact value strtoul gives (ULLONG_MAX on overflow)
  std::string uuid;
};

struct model_result {
  form list_form = form::unset;
  std::vector<model_device> devices;
  bool verified = false;
  bool emptied_by_repeat = false;
};

bool is_c_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string trimmed(const std::string& s) {
  std::size_t b = 0;
  std::size_t e = s.size();
  while (b < e && is_c_space(s[b])) ++b;
  while (e > b && is_c_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

bool begins_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

/// strtoul(entry, &end, 10) on an LP64 machine, with the runtime's extra rule that a negative value (other than
/// "-0") or an entry without digits is invalid. Returns false for invalid entries.
bool strtoul_like(const std::string& entry, unsigned long long& value) {
  std::size_t i = 0;
  bool minus = false;
  if (i < entry.size() && (entry[i] == '+' || entry[i] == '-')) minus = entry[i++] == '-';
  const std::size_t digits_from = i;
  value = 0;
  bool overflow = false;
  for (; i < entry.size() && entry[i] >= '0' && entry[i] <= '9'; ++i) {
    const unsigned digit = static_cast<unsigned>(entry[i] - '0');
    if (value > (~0ULL - digit) / 10) overflow = true;
    if (!overflow) value = value * 10 + digit;
  }
  if (i == digits_from) return false;
  if (overflow) value = ~0ULL;  // ERANGE: ULONG_MAX
  return !(minus && value != 0);
}

model_result model(const char* value, int installed_count, const std::vector<std::string>& uuids) {
  model_result r;
  if (value == nullptr) {
    r.verified = installed_count >= 0;
    return r;
  }
  const std::string text(value);
  if (trimmed(text).empty()) {
    r.list_form = form::empty;
    r.verified = installed_count >= 0;
    return r;
  }
  std::vector<std::string> entries;
  std::string current;
  for (char c : text) {
    if (c == ',') {
      entries.push_back(trimmed(current));
      current.clear();
    } else {
      current.push_back(c);
    }
  }
  entries.push_back(trimmed(current));

  if (begins_with(entries[0], "MIG-")) {  // only the first MIG instance is enumerated; nothing to verify
    r.list_form = form::mig;
    r.devices.push_back({entries[0], 0, {}});
    return r;
  }
  // The runtime reads the list in one pass (measured on an H100 for indices), which this model states in two steps,
  // differently from the parser's loop: (1) the list is cut at its first unusable entry; (2) the part kept shows
  // no device when two of its entries name one GPU, else every entry's device. Entries after the cut, repeats
  // included, play no part.
  const bool uuid_list = begins_with(entries[0], "GPU-");
  r.list_form = uuid_list ? form::gpu_uuids : form::ordinals;
  r.verified = uuid_list ? !uuids.empty() : installed_count >= 0;
  std::vector<model_device> kept;
  for (const auto& e : entries) {
    model_device d{e, 0, {}};
    if (uuid_list) {
      if (!begins_with(e, "GPU-")) break;  // a UUID list ends at its first other entry
      if (r.verified) {
        std::vector<std::string> matching;
        for (const auto& u : uuids) {
          if (begins_with(u, e)) matching.push_back(u);
        }
        if (matching.size() != 1) break;  // no match or an ambiguous prefix ends the list
        d.uuid = matching.front();
      }
    } else {
      if (!strtoul_like(e, d.index)) break;  // the first invalid entry ends the list
      if (installed_count >= 0 && d.index >= static_cast<unsigned long long>(installed_count)) break;
    }
    kept.push_back(d);
  }
  for (std::size_t i = 0; i < kept.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      const bool same = uuid_list ? kept[i].entry == kept[j].entry || (r.verified && kept[i].uuid == kept[j].uuid)
                                  : kept[i].index == kept[j].index;
      if (same) {  // a repeat among the kept entries hides every device
        r.emptied_by_repeat = true;
        return r;
      }
    }
  }
  r.devices = kept;
  return r;
}

/// Inputs on which defect 8 (indices clamped to 2^30, read saturating at 2^40) can change the outcome: two valid
/// entries of at least 2^30 before the list ends (the clamp makes distinct ones a repeat). Confined until the fix
/// lands.
bool hits_defect_8(const char* value) {
  if (value == nullptr) return false;
  const std::string text(value);
  std::vector<unsigned long long> big;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    const std::size_t length = comma == std::string::npos ? std::string::npos : comma - start;
    const std::string entry = trimmed(text.substr(start, length));
    unsigned long long v = 0;
    if (!strtoul_like(entry, v)) break;
    if (v >= (1ULL << 30)) big.push_back(v);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return big.size() >= 2;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpukit_fuzz::input in(data, size);
  const int installed_count = static_cast<int>(in.byte() % 10) - 1;
  const std::uint8_t mode = in.byte();
  const bool uuids_known = (mode & 1) != 0 && installed_count > 0;
  const bool unset = (mode & 2) != 0;
  std::vector<std::string> uuids;
  if (uuids_known) {
    // Short suffixes from a small alphabet, so prefixes collide; the index keeps the UUIDs distinct, as on a real
    // machine.
    static const char alphabet[] = "ab01";
    for (int i = 0; i < installed_count; ++i) {
      std::string u = "GPU-";
      const int n = in.byte() % 4;
      for (int k = 0; k < n; ++k) u.push_back(alphabet[in.byte() % 4]);
      uuids.push_back(u + "-" + std::to_string(i));
    }
  }
  std::string value = in.rest();
  value = value.substr(0, value.find('\0'));  // what getenv would return
  const char* value_ptr = unset ? nullptr : value.c_str();
  if (!GPUKIT_FUZZ_FIXED_DEFECT_8 && hits_defect_8(value_ptr)) return 0;

  gpukit::installed_gpus installed;
  installed.count = installed_count;
  installed.uuids = uuids;
  const gpukit::visible_devices got = gpukit::parse_visible_devices(value_ptr, installed);
  const model_result want = model(value_ptr, installed_count, uuids);

  const std::string where = "CUDA_VISIBLE_DEVICES=\"" + value + "\"" + (unset ? " (unset)" : "") + ", " +
                            std::to_string(installed_count) + " installed: " + got.describe();
  GPUKIT_FUZZ_CHECK(got.form == want.list_form, where);
  // A UUID list emptied by a textual repeat says nothing about the machine: `verified` (which only changes what
  // describe() adds about a non-empty list) may be either there.
  const bool verified_matters = !(want.list_form == form::gpu_uuids && want.devices.empty());
  if (verified_matters) GPUKIT_FUZZ_CHECK(got.verified == want.verified, where);
  GPUKIT_FUZZ_CHECK(got.installed == installed_count, where);
  GPUKIT_FUZZ_CHECK(got.emptied_by_repeat == want.emptied_by_repeat, where + " (emptied_by_repeat)");
  GPUKIT_FUZZ_CHECK(got.all_visible() == unset, where);
  if (unset) {
    GPUKIT_FUZZ_CHECK(got.count() == (installed_count < 0 ? std::nullopt : std::optional<int>(installed_count)), where);
    return 0;
  }
  GPUKIT_FUZZ_CHECK(got.devices.size() == want.devices.size(),
                    where + " (model: " + std::to_string(want.devices.size()) + " devices)");
  GPUKIT_FUZZ_CHECK(got.count() == static_cast<int>(want.devices.size()), where);
  for (std::size_t i = 0; i < want.devices.size(); ++i) {
    const auto& g = got.devices[i];
    const auto& w = want.devices[i];
    const std::string at = where + " (device " + std::to_string(i) + ")";
    GPUKIT_FUZZ_CHECK(g.entry == w.entry, at);
    if (want.list_form == form::ordinals) {
      if (w.index < (1ULL << 30)) {
        GPUKIT_FUZZ_CHECK(g.index >= 0 && static_cast<unsigned long long>(g.index) == w.index, at);
      } else {
        // Only unverified lists keep such an index; it must not look like a real ordinal.
        GPUKIT_FUZZ_CHECK(!want.verified && static_cast<long long>(g.index) >= (1LL << 30), at);
      }
    } else {
      GPUKIT_FUZZ_CHECK(g.index == -1, at);
      GPUKIT_FUZZ_CHECK(g.uuid == w.uuid, at);
    }
  }
  GPUKIT_FUZZ_CHECK(!got.describe().empty(), where);
  return 0;
}
