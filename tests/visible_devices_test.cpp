// CUDA_VISIBLE_DEVICES: a table of cases covering every rule the runtime follows (see visible_devices.hpp).
#include <gpukit/device/visible_devices.hpp>

#include "support.hpp"

#include <atomic>
#include <optional>
#include <string>
#include <vector>

namespace {

using form = gpukit::visible_devices::list_form;

const gpukit::installed_gpus eight_gpus{
    8,
    {"GPU-0a1b2c3d-0000-1111-2222-333344445555", "GPU-0a1b9999-0000-1111-2222-333344445555",
     "GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-80000000-aaaa-bbbb-cccc-ddddeeeeffff",
     "GPU-90000000-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-a0000000-aaaa-bbbb-cccc-ddddeeeeffff",
     "GPU-b0000000-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-c0000000-aaaa-bbbb-cccc-ddddeeeeffff"}};

struct visibility_case {
  const char* name;
  std::optional<std::string> value;  // nullopt: unset
  form expected_form;
  std::vector<long long> expected_indices;  // ordinal lists: physical indices in ordinal order
  std::vector<std::string> expected_uuids;  // UUID lists: resolved UUIDs in ordinal order
  std::optional<int> expected_count;
  const char* note_contains;  // "" when the note must be empty
};

const std::vector<visibility_case> cases = {
    {"unset: all devices", std::nullopt, form::unset, {}, {}, 8, ""},
    {"empty string: none", std::string(""), form::empty, {}, {}, 0, "hides every device"},
    {"whitespace only: none", std::string("  "), form::empty, {}, {}, 0, "hides every device"},
    {"single ordinal", std::string("3"), form::ordinals, {3}, {}, 1, ""},
    {"order defines ordinals", std::string("2,1"), form::ordinals, {2, 1}, {}, 2, ""},
    {"first invalid entry truncates", std::string("0,2,-1,1"), form::ordinals, {0, 2}, {}, 2, "Entry 3 (\"-1\")"},
    {"word truncates", std::string("1,abc,0"), form::ordinals, {1}, {}, 1, "Entry 2 (\"abc\")"},
    {"-1 hides all", std::string("-1"), form::ordinals, {}, {}, 0, "not a non-negative integer"},
    {"NoDevFiles hides all", std::string("NoDevFiles"), form::ordinals, {}, {}, 0, "NoDevFiles"},
    {"abc hides all", std::string("abc"), form::ordinals, {}, {}, 0, "not a non-negative integer"},
    {"index beyond installed count", std::string("16"), form::ordinals, {}, {}, 0, "beyond the 8 installed GPUs"},
    {"out of range truncates later", std::string("1,8,2"), form::ordinals, {1}, {}, 1, "Entry 2 (\"8\")"},
    {"repeat empties the set", std::string("0,0"), form::ordinals, {}, {}, 0, "repeated device"},
    {"repeat after others empties", std::string("3,1,3"), form::ordinals, {}, {}, 0, "Entry 3 (\"3\") repeats"},
    {"invalid before repeat only truncates", std::string("0,-1,0"), form::ordinals, {0}, {}, 1, "Entry 2"},
    // Measured on an H100: the list ends at the index beyond the installed GPUs, so the repeat after it is not read.
    {"index beyond installed before repeat only truncates",
     std::string("0,8,0"),
     form::ordinals,
     {0},
     {},
     1,
     "Entry 2 (\"8\") is beyond"},
    {"strtoul reads leading digits", std::string("1gpu2,2ampere"), form::ordinals, {1, 2}, {}, 2, ""},
    {"whitespace around entries", std::string(" 1 , 2\t"), form::ordinals, {1, 2}, {}, 2, ""},
    {"plus sign accepted", std::string("+1"), form::ordinals, {1}, {}, 1, ""},
    {"minus zero is zero", std::string("-0,1"), form::ordinals, {0, 1}, {}, 2, ""},
    {"empty entry truncates", std::string("0,,1"), form::ordinals, {0}, {}, 1, "Entry 2 (\"\")"},
    {"trailing comma truncates nothing valid", std::string("4,"), form::ordinals, {4}, {}, 1, "Entry 2"},
    {"huge number is out of range", std::string("99999999999999999999999"), form::ordinals, {}, {}, 0, "beyond"},
    {"huge indices are not clamped into repeats",
     std::string("0,5000000000,1073741824"),
     form::ordinals,
     {0},
     {},
     1,
     "Entry 2 (\"5000000000\") is beyond"},
    {"indices past 2^32 stay distinct",
     std::string("1,4294967297,4294967296"),
     form::ordinals,
     {1},
     {},
     1,
     "Entry 2 (\"4294967297\") is beyond"},
    {"uuid after ordinal truncates", std::string("0,GPU-7f000000"), form::ordinals, {0}, {}, 1, "Entry 2"},
    {"full uuid",
     std::string("GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"),
     form::gpu_uuids,
     {},
     {"GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"},
     1,
     ""},
    {"unique uuid prefixes",
     std::string("GPU-9,GPU-7f"),
     form::gpu_uuids,
     {},
     {"GPU-90000000-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"},
     2,
     ""},
    {"ambiguous prefix truncates",
     std::string("GPU-7f,GPU-0a1b,GPU-8"),
     form::gpu_uuids,
     {},
     {"GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"},
     1,
     "prefix of several"},
    {"unknown uuid truncates", std::string("GPU-ffff,GPU-7f"), form::gpu_uuids, {}, {}, 0, "matches no installed GPU"},
    {"uuid list stops at non-uuid",
     std::string("GPU-7f,1,GPU-8"),
     form::gpu_uuids,
     {},
     {"GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"},
     1,
     "not a GPU UUID"},
    {"repeated uuid empties", std::string("GPU-7f,GPU-8,GPU-7f"), form::gpu_uuids, {}, {}, 0, "repeats a UUID"},
    {"two prefixes of one gpu empty", std::string("GPU-7f,GPU-7f00"), form::gpu_uuids, {}, {}, 0, "repeats a GPU"},
    // As for indices (measured on an H100 for those): the list ends at the unknown UUID, the repeat is never read.
    {"an unknown uuid ends the list before a repeat",
     std::string("GPU-7f,GPU-ffff,GPU-7f"),
     form::gpu_uuids,
     {},
     {"GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff"},
     1,
     "Entry 2 (\"GPU-ffff\") matches no installed GPU"},
    {"mig uuid: first only",
     std::string("MIG-5c6a2b9e-1111-2222-3333-444455556666,MIG-other"),
     form::mig,
     {},
     {},
     1,
     "only one MIG instance"},
    {"mig gpu/gi/ci form", std::string("MIG-GPU-7f000000-aaaa-bbbb-cccc-ddddeeeeffff/1/0"), form::mig, {}, {}, 1, ""},
};

}  // namespace

TEST_CASE("CUDA_VISIBLE_DEVICES rules table") {
  REQUIRE(cases.size() >= 25);
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const auto v = gpukit::parse_visible_devices(c.value ? c.value->c_str() : nullptr, eight_gpus);
    CHECK(v.form == c.expected_form);
    CHECK(v.count() == c.expected_count);
    if (c.expected_form == form::ordinals) {
      std::vector<long long> indices;
      for (const auto& d : v.devices) indices.push_back(d.index);
      CHECK(indices == c.expected_indices);
    }
    if (c.expected_form == form::gpu_uuids) {
      std::vector<std::string> uuids;
      for (const auto& d : v.devices) uuids.push_back(d.uuid);
      CHECK(uuids == c.expected_uuids);
    }
    if (std::string(c.note_contains).empty()) {
      CHECK(v.note.empty());
    } else {
      CHECK(v.note.find(c.note_contains) != std::string::npos);
    }
    // The rows whose note names a repeat are those where it empties the set (CUDA then answers 101).
    CHECK(v.emptied_by_repeat == (std::string(c.note_contains).find("repeat") != std::string::npos));
    if (v.emptied_by_repeat) CHECK(v.devices.empty());
  }
}

TEST_CASE("CUDA_VISIBLE_DEVICES without knowledge of the installed GPUs") {
  SUBCASE("range checks need the installed count") {
    const auto v = gpukit::parse_visible_devices("16,3");
    CHECK_FALSE(v.verified);
    REQUIRE(v.count() == 2);
    CHECK(v.devices[0].index == 16);
    CHECK(v.describe().find("not checked") != std::string::npos);
  }
  SUBCASE("uuid prefixes are kept unresolved") {
    const auto v = gpukit::parse_visible_devices("GPU-7f,GPU-8");
    CHECK_FALSE(v.verified);
    REQUIRE(v.devices.size() == 2);
    CHECK(v.devices[0].uuid.empty());
    CHECK(v.devices[1].entry == "GPU-8");
  }
  SUBCASE("unset with an unknown count has no count") {
    const auto v = gpukit::parse_visible_devices(nullptr);
    CHECK(v.all_visible());
    CHECK_FALSE(v.count().has_value());
  }
  SUBCASE("rules that need no machine still apply") {
    CHECK(gpukit::parse_visible_devices("0,0").count() == 0);
    CHECK(gpukit::parse_visible_devices("0,0").emptied_by_repeat);
    CHECK_FALSE(gpukit::parse_visible_devices("").emptied_by_repeat);
    CHECK(gpukit::parse_visible_devices("2,x,1").count() == 1);
  }
}

TEST_CASE("CUDA_VISIBLE_DEVICES descriptions are plain sentences") {
  const auto v = gpukit::parse_visible_devices("0,2,-1,1", eight_gpus);
  CHECK(v.describe() ==
        "CUDA_VISIBLE_DEVICES=\"0,2,-1,1\": 2 devices visible: index 0 as cuda:0, index 2 as cuda:1. Entry 3 "
        "(\"-1\") is not a non-negative integer, so the list ends before it.");
  CHECK(gpukit::parse_visible_devices(nullptr, eight_gpus).describe() ==
        "CUDA_VISIBLE_DEVICES is unset: every installed device is visible (8 installed).");
  CHECK(gpukit::parse_visible_devices("", eight_gpus).describe().find("no device visible") != std::string::npos);
  const auto uuids = gpukit::parse_visible_devices("GPU-9", eight_gpus);
  CHECK(uuids.describe().find("GPU-90000000-aaaa-bbbb-cccc-ddddeeeeffff as cuda:0") != std::string::npos);
}

TEST_CASE("a changed CUDA_VISIBLE_DEVICES is reported once, and the value at initialisation stays in effect") {
  // Take the snapshot now (as gpukit's first CUDA call would), then change the variable.
  const auto& at_init = gpukit::detail::cuda_environment_at_init();
  const std::string changed = at_init.set ? at_init.value + ",7" : std::string("5");
  gpukit_test::scoped_env env("CUDA_VISIBLE_DEVICES", changed);
  CHECK(gpukit::visible_devices_changed_message().find("when CUDA was initialised") != std::string::npos);
  gpukit_test::captured_warnings warnings;
  CHECK_FALSE(gpukit::check_visible_devices_unchanged());
  CHECK_FALSE(gpukit::check_visible_devices_unchanged());
  CHECK(warnings.messages().size() == 1);  // once per process
  CHECK(warnings.contains("CUDA reads it only once"));
  const auto in_effect = gpukit::visible_devices_in_effect();
  CHECK(in_effect.value == (at_init.set ? at_init.value : std::string()));
  // A CUDA error names the value CUDA read, and the one set since.
  const std::string read =
      at_init.set ? "CUDA_VISIBLE_DEVICES=\"" + at_init.value + "\"" : "CUDA_VISIBLE_DEVICES unset";
  const std::string message = gpukit::detail::cuda_failure_message(cudaErrorInvalidDevice, "cudaSetDevice", 3);
  CHECK(message.find(read + " when CUDA read it (\"" + changed + "\" now, which CUDA does not read again)") !=
        std::string::npos);
}

TEST_CASE("a changed CUDA_VISIBLE_DEVICES is reported once for both default-stream modes") {
  // The flag is outside the per-mode namespace: code built in the other mode (nvcc --default-stream per-thread) that
  // warned has set the very flag this mode reads, and this mode warns no more.
  std::atomic<bool>& warned = gpukit::mode_independent::visible_devices_warned_v1();
  CHECK(&gpukit::detail::visible_devices_warned() == &warned);
  const bool before = warned.exchange(true);  // as the other mode's check_visible_devices_unchanged leaves it
  const auto& at_init = gpukit::detail::cuda_environment_at_init();
  gpukit_test::scoped_env env("CUDA_VISIBLE_DEVICES", at_init.set ? at_init.value + ",6" : std::string("4"));
  gpukit_test::captured_warnings warnings;
  CHECK_FALSE(gpukit::check_visible_devices_unchanged());
  CHECK(warnings.messages().empty());
  warned.store(before);
}

TEST_CASE("a CUDA error names CUDA_VISIBLE_DEVICES as CUDA read it, alone while it is unchanged") {
  const auto& at_init = gpukit::detail::cuda_environment_at_init();
  const std::string message = gpukit::detail::cuda_failure_message(cudaErrorInvalidDevice, "cudaSetDevice", 3);
  const std::string read =
      at_init.set ? "CUDA_VISIBLE_DEVICES=\"" + at_init.value + "\"" : "CUDA_VISIBLE_DEVICES unset";
  CHECK(message.find(read) != std::string::npos);
  CHECK(message.find("when CUDA read it") == std::string::npos);
}

TEST_CASE("CUDA_VISIBLE_DEVICES indices are read without clamping and described as written") {
  const auto v = gpukit::parse_visible_devices("0,5000000000,1073741824");
  CHECK_FALSE(v.verified);
  REQUIRE(v.devices.size() == 3);
  CHECK(v.devices[1].index == 5000000000LL);
  CHECK(v.devices[2].index == 1073741824LL);
  CHECK(v.describe().find("index 0 as cuda:0, index 5000000000 as cuda:1, index 1073741824 as cuda:2.") !=
        std::string::npos);
  // Beyond 64 bits the value saturates (strtoul does too); the description shows the entry as written.
  const auto huge = gpukit::parse_visible_devices("99999999999999999999999");
  REQUIRE(huge.devices.size() == 1);
  CHECK(huge.describe().find("index 99999999999999999999999 as cuda:0") != std::string::npos);
}
