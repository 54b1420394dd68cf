// allocator_options from text and GPUKIT_ALLOC_CONF (issue 9): normal use, every key, edge cases and bad input,
// each refusal naming the entry; the default allocators are created with the environment's options.
#include "allocator_support.hpp"

#include <gpukit/memory/allocator_config.hpp>
#include <gpukit/memory/default_allocator.hpp>

#include <cstdlib>
#include <string>
#include <string_view>

using namespace gpukit_test;

namespace {

std::string refusal(std::string_view config) {
  try {
    (void)gpukit::parse_allocator_config(config);
  } catch (const gpukit::invalid_argument_error& e) {
    return e.what();
  }
  return "accepted";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("allocator configuration: keys, units, spaces and presets") {
  const gpukit::allocator_options o = gpukit::parse_allocator_config(
      " reserved_limit : 40GiB , max_split_size_mb:256,release_before_grow:true, cross_stream_reuse:1,"
      "medium_size:32MiB, medium_segment_growth:4, rounding:1KiB, max_oversize_waste:0, expandable_segments:false,"
      "front_cache:false");
  CHECK(o.reserved_limit == std::size_t{40} << 30);
  CHECK(o.max_split_size == 256 * MiB);
  CHECK(o.release_before_grow);
  CHECK(o.cross_stream_reuse);
  CHECK_FALSE(o.front_cache);
  CHECK(gpukit::parse_allocator_config("front_cache:true").front_cache);
  // front_cache_large: true (from the start), when_contended (the default), false (never).
  CHECK_FALSE(gpukit::allocator_options{}.front_cache_large);
  CHECK(gpukit::allocator_options{}.front_cache_large_when_contended);
  const auto always = gpukit::parse_allocator_config("front_cache_large:true");
  CHECK(always.front_cache_large);
  CHECK_FALSE(always.front_cache_large_when_contended);
  const auto never = gpukit::parse_allocator_config("front_cache_large:0");
  CHECK_FALSE(never.front_cache_large);
  CHECK_FALSE(never.front_cache_large_when_contended);
  const auto contended = gpukit::parse_allocator_config("front_cache_large : when_contended", always);
  CHECK_FALSE(contended.front_cache_large);
  CHECK(contended.front_cache_large_when_contended);
  CHECK(o.medium_size == 32 * MiB);
  CHECK(o.medium_segment_growth == 4);
  CHECK(o.rounding == 1024);
  CHECK(o.max_oversize_waste == 0);
  CHECK(gpukit::parse_allocator_config("large_split_threshold:2MB").large_split_threshold == 2 * MiB);
  CHECK(gpukit::parse_allocator_config("reserved_limit:512 B").reserved_limit == 512);
  CHECK(gpukit::allocator_options{}.capture_check == gpukit::capture_checks::every_call);
  CHECK(gpukit::parse_allocator_config("capture_check:gpukit_captures").capture_check ==
        gpukit::capture_checks::gpukit_captures);
  CHECK(gpukit::parse_allocator_config(" capture_check : every_call ", o).capture_check ==
        gpukit::capture_checks::every_call);

  // The empty text changes nothing; a preset applies first wherever it stands; other keys apply over the base.
  const gpukit::allocator_options defaults;
  CHECK(gpukit::parse_allocator_config("").medium_size == defaults.medium_size);
  CHECK(gpukit::parse_allocator_config("  ").medium_size == defaults.medium_size);
  const auto pytorch = gpukit::parse_allocator_config("reserved_limit:1GiB,preset:pytorch");
  CHECK(pytorch.medium_size == gpukit::allocator_options::pytorch().medium_size);
  CHECK(pytorch.max_split_size == gpukit::allocator_options::unlimited);
  CHECK(pytorch.reserved_limit == GiB);
  CHECK(gpukit::parse_allocator_config("reserved_limit:none", pytorch).reserved_limit ==
        gpukit::allocator_options::unlimited);
  CHECK(gpukit::parse_allocator_config("max_split_size:none").max_split_size == gpukit::allocator_options::unlimited);
  // PyTorch's booleans, and a configuration file's line breaks around entries.
  CHECK(gpukit::parse_allocator_config("expandable_segments:True").expandable_segments);
  CHECK_FALSE(gpukit::parse_allocator_config("release_before_grow:False", o).release_before_grow);
  CHECK(gpukit::parse_allocator_config("reuse_before_release:true").reuse_before_release);
  CHECK_FALSE(gpukit::parse_allocator_config("reuse_before_release:0").reuse_before_release);
  CHECK_FALSE(gpukit::allocator_options{}.reuse_before_release);  // off by default (README, "Memory pressure")
  const auto from_file = gpukit::parse_allocator_config("reserved_limit:40GiB,\r\n  max_split_size_mb:64\n");
  CHECK(from_file.reserved_limit == std::size_t{40} << 30);
  CHECK(from_file.max_split_size == 64 * MiB);
  // PyTorch's max_split_size_mb:32 keeps blocks of 32 MiB or more whole: below medium_size too.
  CHECK(gpukit::parse_allocator_config("max_split_size_mb:32").own_segment_size() == 32 * MiB);
  // ...and must exceed max_oversize_waste, as PyTorch's must exceed 20 MiB (with 4 MiB, ten 4 MiB requests took
  // 220 MiB of cached 22 MiB blocks, whole: helper-218).
  CHECK(contains(refusal("max_split_size_mb:20"),
                 "max_split_size must be larger than max_oversize_waste (it is "
                 "20971520, max_oversize_waste 20971520)"));
  CHECK(gpukit::parse_allocator_config("max_split_size_mb:4,max_oversize_waste:2MiB").own_segment_size() == 4 * MiB);
  // Shared segments serve requests below max_split_size then: medium_segment_size need not reach medium_size.
  CHECK(gpukit::parse_allocator_config("preset:pytorch,medium_size:64MiB,max_split_size_mb:16,max_oversize_waste:2MiB")
            .own_segment_size() == 16 * MiB);
  CHECK(gpukit::parse_allocator_config("\n\t").medium_size == defaults.medium_size);
  CHECK(gpukit::parse_allocator_config("release_before_grow:false", o).reserved_limit == o.reserved_limit);
}

TEST_CASE("allocator configuration: bad input is refused naming the entry, before anything is used") {
  CHECK(contains(refusal("max_split_size_mb:abc"), "entry \"max_split_size_mb:abc\": expected a whole number"));
  CHECK(contains(refusal("max_split_size_mb:256MiB"), "expected a whole number"));
  CHECK(contains(refusal("reserved_limit:40 GiBs"), "expected a size such as 512, 64MiB or 40GiB, or none"));
  CHECK(contains(refusal("reserved_limit:-1"), "expected a size"));
  // Overflows: said so, with the largest size.
  CHECK(contains(refusal("reserved_limit:99999999999999999999"), "too large: sizes go up to 18446744073709551615"));
  CHECK(contains(refusal("reserved_limit:20000000TiB"), "too large"));  // with its unit
  CHECK(contains(refusal("rounding:99999999999999999999999KiB"), "too large"));
  CHECK(contains(refusal("max_split_size_mb:17592186044416"), "too large: at most 17592186044415 (MiB)"));
  CHECK(contains(refusal("medium_segment_growth:99999999999999999999"), "too large: at most 18446744073709551615"));
  // Past size_t too, the MiB count's bound is given (it was a bare "too large"; helper-214).
  CHECK(contains(refusal("max_split_size_mb:99999999999999999999999"), "too large: at most 17592186044415 (MiB)"));
  // Units: which are accepted, as written.
  CHECK(contains(refusal("rounding:1kb"), "B, KiB, KB, MiB, MB, GiB, GB, TiB or TB as written here"));
  // A key is shown escaped, as the entry is: a control byte cannot make it look like a known key (helper-214:
  // "re\x01served_limit" printed as reserved_limit, and terminal escapes went through).
  CHECK(contains(refusal("re\x01served_limit:1"), "unknown key \"re\\x01served_limit\""));
  CHECK(contains(refusal("x\x1b[2J:1,x\x1b[2J:2"), "\"x\\x1b[2J\" is set twice"));
  CHECK(contains(refusal("rounding:none"), "expected a size such as 512, 64MiB or 2GiB"));  // not a limit
  CHECK(contains(refusal("rounding:1.5KiB"), "expected a size"));
  CHECK(contains(refusal("garbage_collection_threshold:0.6"), "unknown key \"garbage_collection_threshold\""));
  CHECK(contains(refusal("release_before_grow:yes"), "expected true or false"));
  CHECK(contains(refusal("reuse_before_release:sometimes"), "expected true or false"));
  CHECK(contains(refusal("front_cache_large:contended"),
                 "entry \"front_cache_large:contended\": expected true, false or when_contended"));
  CHECK(contains(refusal("reserved_limit"), "expected key:value"));
  CHECK(contains(refusal("reserved_limit:"), "no value"));
  CHECK(contains(refusal("rounding:512,,medium_size:64MiB"), "empty entry"));
  CHECK(contains(refusal("rounding:512,"), "empty entry"));
  CHECK(contains(refusal("rounding:512,rounding:1024"), "\"rounding\" is set twice"));
  // One setting under its two names (PyTorch's in MiB) is given twice too, whichever comes first.
  CHECK(contains(refusal("max_split_size:512MiB,max_split_size_mb:128"),
                 "entry \"max_split_size_mb:128\": \"max_split_size_mb\" sets what \"max_split_size\" set already"));
  CHECK(contains(refusal("max_split_size_mb:128, max_split_size:none"), "set already (max_split_size)"));
  CHECK(contains(refusal("preset:tensorflow"), "preset must be gpukit or pytorch"));
  CHECK(gpukit::parse_allocator_config("expandable_segments:true").expandable_segments);
  CHECK_FALSE(gpukit::parse_allocator_config("expandable_segments:true").expandable_segments_required);
  const gpukit::allocator_options required = gpukit::parse_allocator_config("expandable_segments:required");
  CHECK(required.expandable_segments);
  CHECK(required.expandable_segments_required);
  CHECK(contains(refusal("expandable_segments:maybe"), "expected true, false or required"));
  CHECK(contains(refusal("capture_check:never"),
                 "entry \"capture_check:never\": capture_check must be every_call or "
                 "gpukit_captures"));
  CHECK(contains(refusal("capture_check:true"), "capture_check must be"));
  // Well-formed but inconsistent: allocator_options::validate's reason.
  CHECK(contains(refusal("rounding:1000"), "inconsistent options"));
  CHECK(contains(refusal("rounding:1000"), "rounding must be a power of two"));
  CHECK(contains(refusal("medium_size:2000000"), "medium_size must be a multiple of the rounding"));
  // Each reason gives the figures it compared.
  CHECK(contains(refusal("rounding:1000"), "(it is 1000)"));
  CHECK(contains(refusal("large_segment_rounding:256"), "(it is 256, the rounding 512)"));
  CHECK(contains(refusal("small_size:4MiB"), "(it is 4194304, small_segment_size 2097152)"));
  CHECK(contains(refusal("medium_segment_size:1000000"), "medium_segment_size 1000000 is not"));
  CHECK(contains(refusal("small_segment_size:3000000"), "small_segment_size 3000000 is not"));
  CHECK(contains(refusal("medium_size:512KiB"), "(it is 524288, small_size 1048576)"));
  CHECK(contains(refusal("medium_segment_growth:0,medium_segment_size:16MiB"),
                 "(it is 16777216, medium_size 67108864, max_split_size 268435456)"));
  CHECK(contains(refusal("max_split_size:256"), "(it is 256, the rounding 512)"));
  // The nearest multiple above the largest size does not exist: only the one below is suggested.
  const std::string largest = refusal("medium_size:18446744073709551615");
  CHECK(contains(largest, "use 18446744073709551104"));
  CHECK_FALSE(contains(largest, " or "));
  // Large blocks cached in front without a front cache were ignored silently.
  CHECK(contains(refusal("front_cache:false,front_cache_large:true"), "front_cache_large needs front_cache"));
  CHECK_FALSE(gpukit::parse_allocator_config("front_cache:false").front_cache);  // contended alone is no error
  // The unknown-key message lists every key.
  CHECK(contains(refusal("growth:2"), "medium_segment_growth"));
  // Bytes a terminal would hide or cut the message at are shown: a no-break space after a valid entry, a NUL.
  CHECK(contains(refusal("reserved_limit:1GiB\xc2\xa0"), "entry \"reserved_limit:1GiB\\xc2\\xa0\""));
  const std::string_view with_nul(
      "rounding:5\0"
      "12",
      13);
  CHECK(contains(refusal(with_nul), "\"rounding:5\\x0012\""));
}

TEST_CASE("allocator configuration: among thousands of entries a setting given twice is named as among a few") {
  // Unknown keys are refused only once every entry has been read, so the entries checked for a repeat are not bounded
  // by the known keys: the check is linear in them, and says the same as with a few entries.
  std::string many;
  for (int i = 0; i < 20000; ++i) many += "key" + std::to_string(i) + ":1,";
  CHECK(contains(refusal(many + "max_split_size:512MiB"), "unknown key \"key0\""));
  CHECK(contains(refusal(many + "key19999:2"), "entry \"key19999:2\": \"key19999\" is set twice"));
  CHECK(contains(refusal(many + "max_split_size:512MiB," + many + "max_split_size_mb:128"),
                 "entry \"key0:1\": \"key0\" is set twice"));
  CHECK(contains(refusal("max_split_size:512MiB," + many + "max_split_size_mb:128"),
                 "entry \"max_split_size_mb:128\": \"max_split_size_mb\" sets what \"max_split_size\" set already "
                 "(max_split_size)"));
}

TEST_CASE("allocator configuration: settings that would be ignored or leave no usable segment are refused") {
  // Large blocks cached in front with cross-stream reuse, which turns the front caches off: accepted and ignored.
  const std::string ignored = refusal("cross_stream_reuse:true,front_cache_large:true");
  CHECK(contains(ignored, "front_cache_large cannot be used with cross_stream_reuse (it would be ignored)"));
  CHECK(gpukit::parse_allocator_config("cross_stream_reuse:true").cross_stream_reuse);  // the default front cache
  CHECK(gpukit::parse_allocator_config("cross_stream_reuse:true,front_cache_large:when_contended").cross_stream_reuse);
  // A segment rounding above the largest shared segment (4 x medium_size) makes every segment of a request above
  // small_size at least that large: with 2^63 bytes, every such request was out of memory.
  CHECK(contains(refusal("large_segment_rounding:9223372036854775808"),
                 "large_segment_rounding must be at most 4 x medium_size, the largest shared segment (it is "
                 "9223372036854775808, 4 x medium_size 268435456)"));
  CHECK(gpukit::parse_allocator_config("large_segment_rounding:256MiB").large_segment_rounding == 256 * MiB);
  CHECK(contains(refusal("large_segment_rounding:512MiB"), "(it is 536870912, 4 x medium_size 268435456)"));
  CHECK(contains(refusal("preset:pytorch,large_segment_rounding:64MiB"), "4 x medium_size 41943040)"));
  gpukit::allocator_options o;
  o.large_segment_rounding = std::size_t{1} << 63;
  CHECK_THROWS_AS(o.validate(), gpukit::invalid_argument_error);
  o.medium_size = std::size_t{1} << 62;  // 4 x medium_size does not fit: saturated, not wrapped
  CHECK_NOTHROW(o.validate());
}

TEST_CASE(
    "GPUKIT_ALLOC_CONF's expandable segments are the GPUs': the CPU's default allocator neither warns nor refuses") {
  // Runs before the test below sets the CPU's options in code (which would win over the environment).
  const gpukit::device cpu = gpukit::device::cpu();
  // Expandable segments configure the GPUs' default allocators (as PYTORCH_CUDA_ALLOC_CONF does): the CPU's, over
  // host memory, has none, so it neither warns nor refuses to be made when they are required.
  gpukit_test::captured_warnings warnings;
  ::setenv("GPUKIT_ALLOC_CONF", "expandable_segments:required,reserved_limit:64MiB", 1);
  (void)gpukit::set_default_allocator(cpu, nullptr);
  auto& host = dynamic_cast<gpukit::caching_allocator&>(gpukit::default_allocator(cpu)).engine();
  CHECK(host.options().reserved_limit == 64 * MiB);  // the rest applies
  CHECK_FALSE(host.options().expandable_segments);
  CHECK_FALSE(host.options().expandable_segments_required);
  gpukit::default_allocator(cpu).deallocate(
      gpukit::default_allocator(cpu).allocate(4096, gpukit::stream_view::default_stream(cpu)));
  CHECK(warnings.messages().empty());
  ::unsetenv("GPUKIT_ALLOC_CONF");
  (void)gpukit::set_default_allocator(cpu, nullptr);
}

TEST_CASE("GPUKIT_ALLOC_CONF configures the default allocators, code-set options win, bad text is a clear error") {
  const gpukit::device cpu = gpukit::device::cpu();
  ::setenv("GPUKIT_ALLOC_CONF", "reserved_limit:96MiB,release_before_grow:true", 1);
  (void)gpukit::set_default_allocator(cpu, nullptr);  // the next use creates a fresh one
  CHECK(gpukit::memory_stats(cpu).reserved_limit == 96 * MiB);
  auto& engine = dynamic_cast<gpukit::caching_allocator&>(gpukit::default_allocator(cpu)).engine();
  CHECK(engine.options().release_before_grow);

  ::setenv("GPUKIT_ALLOC_CONF", "reserved_limit:lots", 1);
  (void)gpukit::set_default_allocator(cpu, nullptr);
  try {
    (void)gpukit::default_allocator(cpu);
    FAIL("a malformed GPUKIT_ALLOC_CONF was accepted");
  } catch (const gpukit::invalid_argument_error& e) {
    CHECK(contains(e.what(), "GPUKIT_ALLOC_CONF \"reserved_limit:lots\": entry \"reserved_limit:lots\""));
  }
  CHECK_THROWS_AS(gpukit::memory_allocated(cpu), gpukit::invalid_argument_error);  // every use, until it is fixed

  gpukit::allocator_options code;
  code.reserved_limit = 8 * MiB;
  CHECK(gpukit::set_default_allocator_options(cpu, code));  // options set in code replace the environment's
  CHECK(gpukit::memory_stats(cpu).reserved_limit == 8 * MiB);
  ::unsetenv("GPUKIT_ALLOC_CONF");
}
