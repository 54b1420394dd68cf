// The memory history (issue 11): what the allocator records (allocations, frees requested and completed, segments,
// pages, out-of-memory errors, snapshots) with streams, sizes and tags; the bounded ring; and the exports (PyTorch
// snapshot pickle, checked by Python's own pickle module; RMM's CSV log; JSON; the leak report).
#include "allocator_support.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/device_allocator.hpp>
#include <gpukit/memory/history_export.hpp>
#include <gpukit/memory/memory_history.hpp>
#include <gpukit/memory/memory_picture.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace gpukit_test;
using gpukit::memory_action;

namespace {

std::size_t count_of(const std::vector<gpukit::memory_event>& events, memory_action a) {
  return static_cast<std::size_t>(
      std::count_if(events.begin(), events.end(), [a](const gpukit::memory_event& e) { return e.action == a; }));
}

/// The peak of the bytes the history's allocations held (sum of alloc sizes minus freed ones, at its highest).
std::size_t replayed_peak(const std::vector<gpukit::memory_event>& events) {
  std::map<std::uintptr_t, std::size_t> live;
  std::size_t current = 0, peak = 0;
  for (const auto& e : events) {
    if (e.action == memory_action::alloc) {
      live[e.address] = e.size;
      current += e.size;
      peak = std::max(peak, current);
    } else if (e.action == memory_action::free_requested) {
      current -= live.at(e.address);
      live.erase(e.address);
    }
  }
  return peak;
}

/// The shared setup with two streams.
struct world_and_allocator : fake_setup {
  using fake_setup::fake_setup;
  fake_stream s1 = add_stream();
  fake_stream s2 = add_stream();
};

}  // namespace

TEST_CASE(
    "history: allocations, frees and segments are recorded with their stream, size and tag, and nothing without a "
    "history") {
  world_and_allocator w;
  void* before = w.a.allocate(1000, w.s1);  // no history yet
  auto history = std::make_shared<gpukit::memory_history>(1000);
  w.a.set_memory_history(history);
  CHECK(w.a.history() == history);
  void* weights = nullptr;
  {
    gpukit::memory_tag tag("weights");
    weights = w.a.allocate(5000, w.s1);
    {
      gpukit::memory_tag inner("activations");
      w.a.deallocate(w.a.allocate(300, w.s2));
    }
  }
  void* untagged = w.a.allocate(2 * MiB, w.s1);  // a new large segment
  const auto events = history->events();
  REQUIRE(events.size() >= 6);
  // before: never recorded. weights: alloc. activations: alloc, free_requested, free_completed. untagged: alloc.
  CHECK(count_of(events, memory_action::alloc) == 3);
  CHECK(count_of(events, memory_action::free_requested) == 1);
  CHECK(count_of(events, memory_action::free_completed) == 1);
  CHECK(count_of(events, memory_action::segment_alloc) == 2);  // the small pool's, then the large pool's
  const auto alloc_of = [&](void* p) {
    return *std::find_if(events.begin(), events.end(), [p](const gpukit::memory_event& e) {
      return e.action == memory_action::alloc && e.address == reinterpret_cast<std::uintptr_t>(p);
    });
  };
  CHECK(alloc_of(weights).size == 5000);
  CHECK(gpukit::memory_tag_name(alloc_of(weights).tag) == "weights");
  CHECK(alloc_of(weights).stream == w.a.stream_operations().key(w.s1));
  CHECK(alloc_of(untagged).tag == 0);
  const auto freed = std::find_if(events.begin(), events.end(), [](const gpukit::memory_event& e) {
    return e.action == memory_action::free_requested;
  });
  CHECK(freed->size == 300);
  CHECK(gpukit::memory_tag_name(freed->tag) == "activations");
  CHECK(freed->stream == w.a.stream_operations().key(w.s2));
  CHECK((freed + 1)->action == memory_action::free_completed);
  for (std::size_t i = 1; i < events.size(); ++i) CHECK(events[i - 1].time_ns <= events[i].time_ns);

  // Stopping: the history keeps what it holds and gets nothing more.
  w.a.set_memory_history(nullptr);
  CHECK(w.a.history() == nullptr);
  w.a.deallocate(before);
  w.a.deallocate(weights);
  w.a.deallocate(untagged);
  CHECK(history->events().size() == events.size());
}

TEST_CASE("history: a free that waits for another stream completes when that stream's work has") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* p = w.a.allocate(4096, w.s1);
  w.a.record_stream(p, w.s2);
  w.world.enqueue(w.s2.id);  // s2 still works on p
  w.a.deallocate(p);
  CHECK(count_of(history->events(), memory_action::free_requested) == 1);
  CHECK(count_of(history->events(), memory_action::free_completed) == 0);
  w.world.complete(w.s2.id);
  w.a.deallocate(w.a.allocate(4096, w.s1));  // the allocator sees the event complete
  const auto events = history->events();
  const auto completed = std::find_if(events.begin(), events.end(), [p](const gpukit::memory_event& e) {
    return e.action == memory_action::free_completed && e.address == reinterpret_cast<std::uintptr_t>(p);
  });
  REQUIRE(completed != events.end());
  CHECK(completed->size == 4096);  // the bytes requested, as in its alloc and free_requested
}

TEST_CASE("history: with front caches on, every free is recorded after its alloc and before the address is reused") {
  world_and_allocator w;  // front caches are on by default
  auto history = std::make_shared<gpukit::memory_history>(100000);
  w.a.set_memory_history(history);
  std::mt19937 rng(7);
  std::vector<void*> live;
  for (int i = 0; i < 2000; ++i) {
    if (live.size() < 8 && (live.empty() || rng() % 2 == 0)) {
      live.push_back(w.a.allocate(256 * (1 + rng() % 4), rng() % 2 ? w.s1 : w.s2));
    } else {
      const std::size_t k = rng() % live.size();
      w.a.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (void* p : live) w.a.deallocate(p);
  // Per address, the events alternate: alloc, free_requested, (free_completed), alloc, ...
  std::map<std::uintptr_t, memory_action> last;
  int out_of_order = 0;
  for (const auto& e : history->events()) {
    if (e.action == memory_action::alloc) {
      const auto it = last.find(e.address);
      if (it != last.end() && it->second == memory_action::alloc) ++out_of_order;
      last[e.address] = e.action;
    } else if (e.action == memory_action::free_requested) {
      const auto it = last.find(e.address);
      if (it == last.end() || it->second != memory_action::alloc) ++out_of_order;
      last[e.address] = e.action;
    }
  }
  CHECK(out_of_order == 0);
  CHECK(count_of(history->events(), memory_action::alloc) ==
        count_of(history->events(), memory_action::free_requested));
  CHECK(gpukit::live_allocations(*history).empty());
}

TEST_CASE("history: replaying the recorded allocations reproduces the live run's peak of requested bytes") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>(100000);
  w.a.set_memory_history(history);
  std::mt19937_64 rng(11);
  std::vector<void*> live;
  for (int i = 0; i < 3000; ++i) {
    if (live.size() < 40 && rng() % 3 != 0) {
      live.push_back(w.a.allocate(1 + rng() % (3 * MiB), w.s1));
    } else if (!live.empty()) {
      const std::size_t k = rng() % live.size();
      w.a.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  const auto peak = static_cast<std::size_t>(w.a.stats().requested_bytes.all().peak);
  CHECK(replayed_peak(history->events()) == peak);
  for (void* p : live) w.a.deallocate(p);
}

TEST_CASE("history: out of memory, snapshots, and the pages of expandable segments are recorded") {
  gpukit::allocator_options options;
  options.expandable_segments = true;
  world_and_allocator w(options, 64 * MiB);
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* p = w.a.allocate(5 * MiB, w.s1);
  CHECK_THROWS_AS((void)w.a.allocate(200 * MiB, w.s1), gpukit::out_of_memory_error);
  (void)w.a.snapshot();
  w.a.deallocate(p);
  w.a.empty_cache();
  const auto events = history->events();
  CHECK(count_of(events, memory_action::segment_alloc) == 0);  // a reserved range is no memory
  CHECK(count_of(events, memory_action::segment_map) >= 3);    // 5 MiB in 2 MiB pages
  CHECK(count_of(events, memory_action::segment_unmap) >= 1);
  CHECK(count_of(events, memory_action::snapshot) == 1);
  const auto oom = std::find_if(events.begin(), events.end(),
                                [](const gpukit::memory_event& e) { return e.action == memory_action::oom; });
  REQUIRE(oom != events.end());
  CHECK(oom->size == 200 * MiB);
  // RMM's replay benchmark refuses any action but allocate and free: failure rows only when asked for.
  CHECK(gpukit::rmm_log_csv(*history).find("allocate failure") == std::string::npos);
  char failure_row[64];
  std::snprintf(failure_row, sizeof failure_row, ",allocate failure,0x0,%zu,", 200 * MiB);
  CHECK(gpukit::rmm_log_csv(*history, gpukit::rmm_failure_rows::include).find(failure_row) != std::string::npos);
  std::size_t mapped = 0, unmapped = 0;
  for (const auto& e : events) {
    if (e.action == memory_action::segment_map) mapped += e.size;
    if (e.action == memory_action::segment_unmap) unmapped += e.size;
  }
  CHECK(mapped == unmapped);  // empty_cache returned every page
  CHECK(w.a.memory_reserved() == 0);
}

TEST_CASE("history: the ring keeps the latest max_entries events, oldest first, and counts the dropped ones") {
  gpukit::memory_history h(4);
  for (std::uintptr_t i = 1; i <= 10; ++i) h.record(memory_action::alloc, i, i, 0);
  const auto events = h.events();
  REQUIRE(events.size() == 4);
  CHECK(events.front().address == 7);
  CHECK(events.back().address == 10);
  CHECK(h.recorded() == 10);
  CHECK(h.dropped() == 6);
  CHECK(h.max_entries() == 4);
  const gpukit::memory_history_contents contents = h.contents();
  CHECK(contents.recorded == 10);
  CHECK(contents.dropped == 6);
  REQUIRE(contents.events.size() == 4);
  CHECK(contents.events.front().address == 7);
  CHECK(contents.events.back().address == 10);
  h.clear();
  CHECK(h.events().empty());
  CHECK(h.dropped() == 0);
  CHECK_THROWS_WITH_AS(gpukit::memory_history(0), "gpukit::memory_history: max_entries must be positive",
                       gpukit::invalid_argument_error);
  CHECK(gpukit::memory_tag_id("") == 0);
  CHECK(gpukit::memory_tag_id("x") == gpukit::memory_tag_id("x"));
  CHECK(gpukit::memory_tag_name(4000000000u).empty());
}

TEST_CASE("history exports: RMM's CSV log, JSON and the leak report") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* kept = nullptr;
  void* leaked = nullptr;
  {
    gpukit::memory_tag tag("kv \"cache\"");
    kept = w.a.allocate(4096, w.s1);
    leaked = w.a.allocate(4096, w.s1);  // still live when the report is made
  }
  w.a.deallocate(w.a.allocate(100, w.s2));
  const std::string csv = gpukit::rmm_log_csv(*history);
  std::istringstream lines(csv);
  std::string line;
  std::getline(lines, line);
  CHECK(line == "Thread,Time,Action,Pointer,Size,Stream");
  int rows = 0;
  while (std::getline(lines, line)) {
    ++rows;
    CHECK(std::count(line.begin(), line.end(), ',') == 5);
    CHECK((line.find(",allocate,0x") != std::string::npos || line.find(",free,0x") != std::string::npos));
    const std::size_t time_at = line.find(',') + 1;  // HH:MM:SS:microseconds
    const std::string time = line.substr(time_at, line.find(',', time_at) - time_at);
    CHECK(time.size() == 15);
    CHECK(std::count(time.begin(), time.end(), ':') == 3);
    CHECK(time.find_first_not_of("0123456789:") == std::string::npos);
  }
  CHECK(rows == 4);  // 3 allocations, 1 free
  char kept_row[64];
  std::snprintf(kept_row, sizeof kept_row, ",allocate,0x%llx,4096,%llu",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(kept)),
                static_cast<unsigned long long>(w.a.stream_operations().key(w.s1)));
  CHECK(csv.find(kept_row) != std::string::npos);

  const auto snapshot = w.a.snapshot();
  const std::string json = gpukit::history_json(*history, &snapshot);
  CHECK(json.find("\"tag\":\"kv \\\"cache\\\"\"") != std::string::npos);  // escaped
  CHECK(json.find("\"segments\":[{") != std::string::npos);
  std::size_t actions = 0;
  for (std::size_t at = json.find("\"action\""); at != std::string::npos; at = json.find("\"action\"", at + 1))
    ++actions;
  CHECK(actions == history->events().size());

  const auto groups = gpukit::live_allocations(*history);
  REQUIRE(groups.size() == 1);
  CHECK(groups[0].tag == "kv \"cache\"");
  CHECK(groups[0].size == 4096);
  CHECK(groups[0].count == 2);
  CHECK(gpukit::leak_report(*history).find("live allocations seen by the history: 2 (8192 B)") == 0);
  w.a.deallocate(kept);
  w.a.deallocate(leaked);
}

TEST_CASE("history exports: every number in history_json is below 2^53, CPU streams' keys included") {
  // Readers that take JSON numbers as doubles (JavaScript, jq) read them exactly only below 2^53: a CPU stream's key
  // carries bit 63, and two streams were written as numbers they read as one (helper-175).
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::caching_allocator a(cpu);
  auto history = std::make_shared<gpukit::memory_history>();
  a.set_memory_history(history);
  gpukit::stream s1(cpu);
  gpukit::stream s2(cpu);
  void* p = a.allocate(4096, s1);
  void* q = a.allocate(4096, s2);
  const auto snapshot = a.snapshot();
  const std::string json = gpukit::history_json(*history, &snapshot);
  a.deallocate(p);
  a.deallocate(q);
  const std::uint64_t bit63 = std::uint64_t{1} << 63;
  REQUIRE((s1.view().id() & bit63) != 0);
  for (const gpukit::stream* s : {&s1, &s2}) {  // each stream by its own number, without the bit
    CHECK(json.find("\"stream\":" + std::to_string(s->view().id() & ~bit63) + ",") != std::string::npos);
    CHECK(json.find("\"stream\":" + std::to_string(s->view().id() & ~bit63) + "}") != std::string::npos);  // a block's
  }
  std::uint64_t largest = 0;
  for (std::size_t at = json.find_first_of("0123456789"); at != std::string::npos;) {
    const std::size_t end = json.find_first_not_of("0123456789", at);
    const std::string digits = json.substr(at, end - at);
    largest = std::max<std::uint64_t>(largest, digits.size() > 19 ? ~std::uint64_t{0} : std::stoull(digits));
    at = end == std::string::npos ? end : json.find_first_of("0123456789", end);
  }
  CHECK(largest < (std::uint64_t{1} << 53));
}

TEST_CASE("history exports: a block of no stream is written as null in history_json, and read back by the replay") {
  // Free blocks go to no stream once their stream is destroyed and its work is done: the allocator's key for it is
  // ~0, which JSON readers that take numbers as doubles would read as 2^64 (helper-184).
  const gpukit::device cpu = gpukit::device::cpu();
  gpukit::caching_allocator a(cpu);
  auto history = std::make_shared<gpukit::memory_history>();
  a.set_memory_history(history);
  gpukit::stream kept(cpu);
  {
    gpukit::stream gone(cpu);
    a.deallocate(a.allocate(4 << 20, gone));
    gone.synchronize();
  }
  void* q = a.allocate(256, kept);  // notices the destruction: the free block has no stream now
  const auto snapshot = a.snapshot();
  const std::string json = gpukit::history_json(*history, &snapshot);
  a.deallocate(q);
  CHECK(json.find("\"state\":\"inactive\",\"stream\":null}") != std::string::npos);
  CHECK(json.find("\"stream\":" + std::to_string(~std::uint64_t{0} >> 1)) == std::string::npos);
}

TEST_CASE("history exports: the leak report writes tags as printable UTF-8") {
  // It goes to stderr at exit: a tag's line break, escape sequence or invalid byte would garble the terminal or log.
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* leaked = nullptr;
  {
    gpukit::memory_tag tag("caf\xc3\xa9\n\x1b[31m\xff");
    leaked = w.a.allocate(4096, w.s1);
  }
  const std::string report = gpukit::leak_report(*history);
  CHECK(report.find("caf\xc3\xa9??[31m?") != std::string::npos);  // valid UTF-8 kept, the rest '?'
  const std::size_t first_line_end = report.find('\n');
  CHECK(report.find('\n', first_line_end + 1) == report.size() - 1);  // one line per group: no break inside
  w.a.deallocate(leaked);
}

TEST_CASE("history exports: the PyTorch snapshot loads with Python's pickle and has what the memory viewer reads") {
  world_and_allocator w;
  // A CPU stream's key has its top bit set; the viewer reads integers of at most 8 bytes.
  w.world.streams[static_cast<std::size_t>(w.s2.id)].key = (std::uintptr_t{1} << 63) | 0x1234;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  std::vector<void*> live;
  {
    gpukit::memory_tag tag("layer.0");
    for (std::size_t i = 0; i < 6; ++i) live.push_back(w.a.allocate(1000 + i * 700, w.s1));
    live.push_back(w.a.allocate(3 * MiB + 5, w.s2));
  }
  w.a.deallocate(live[1]);
  w.a.deallocate(live[4]);
  const auto snapshot = w.a.snapshot();
  const std::size_t at_snapshot = history->events().size();  // its snapshot event included
  // After the snapshot: not in it, so not in the trace the viewer replays backwards from it.
  void* later = w.a.allocate(8 * MiB, w.s1);
  const std::string path = "gpukit_history_test_snapshot.pickle";
  gpukit::dump_pytorch_snapshot(path, snapshot, *history);
  const std::string command = std::string("python3 \"") + GPUKIT_TEST_PICKLE_CHECK + "\" " + path + " " +
                              std::to_string(snapshot.segments.size()) + " " + std::to_string(at_snapshot) +
                              " 5 layer.0";
  CHECK(std::system(command.c_str()) == 0);
  std::remove(path.c_str());
  // I/O failures are std::system_error, with the system's reason as the code and in the text.
  const auto failure_of = [&](const std::string& where) -> std::optional<std::system_error> {
    try {
      gpukit::dump_pytorch_snapshot(where, snapshot, *history);
    } catch (const std::system_error& e) {
      return e;
    }
    return std::nullopt;
  };
  const auto missing = failure_of("/nonexistent-dir/x.pickle");
  REQUIRE(missing.has_value());
  CHECK(missing->code() == std::errc::no_such_file_or_directory);
  CHECK(std::string(missing->what())
            .find("gpukit::dump_pytorch_snapshot: cannot open /nonexistent-dir/x.pickle for "
                  "writing") == 0);
  CHECK(std::string(missing->what()).find("No such file or directory") != std::string::npos);
  if (std::FILE* full = std::fopen("/dev/full", "wb")) {  // every write fails: ENOSPC
    std::fclose(full);
    const auto no_space = failure_of("/dev/full");
    REQUIRE(no_space.has_value());
    CHECK(no_space->code() == std::errc::no_space_on_device);
    CHECK(std::string(no_space->what()).find("bytes to /dev/full failed") != std::string::npos);
  }
  for (std::size_t i : {0, 2, 3, 5, 6}) w.a.deallocate(live[i]);
  w.a.deallocate(later);
}

namespace {
/// The file size limit the child below writes under: less than the smallest pickle.
constexpr rlim_t write_limit = 16;

std::optional<std::string> file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}
}  // namespace

// Run only as the child of the test below (GPUKIT_HISTORY_WRITE_PATHS set, "existing:absent"): dumps to both with
// files limited to write_limit bytes (RLIMIT_FSIZE, SIGXFSZ ignored), so that each write fails with EFBIG.
TEST_CASE("history exports: writes under a file size limit child" * doctest::skip()) {
  const char* paths = std::getenv("GPUKIT_HISTORY_WRITE_PATHS");
  if (paths == nullptr) return;
  const std::string both(paths);
  const gpukit::memory_history history;
  const gpukit::allocator_snapshot snapshot{};
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit limit{};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &limit) == 0);
  const rlim_t soft = limit.rlim_cur;
  limit.rlim_cur = write_limit;  // the soft limit only: it is raised again below
  REQUIRE(setrlimit(RLIMIT_FSIZE, &limit) == 0);
  for (const std::string& path : {both.substr(0, both.find(':')), both.substr(both.find(':') + 1)}) {
    INFO(path);
    try {
      gpukit::dump_pytorch_snapshot(path, snapshot, history);
      FAIL("the write did not fail");
    } catch (const std::system_error& e) {
      CHECK(e.code() == std::errc::file_too_large);
    }
  }
  limit.rlim_cur = soft;
  CHECK(setrlimit(RLIMIT_FSIZE, &limit) == 0);
}

TEST_CASE("history exports: a failed write leaves the regular file that was there, or none, and no temporary") {
  const gpukit::memory_history history;
  const gpukit::allocator_snapshot snapshot{};
  const std::string pickle = gpukit::pytorch_snapshot_pickle(snapshot, history);
  REQUIRE(pickle.size() > 2 * write_limit);
  const std::string prefix = "gpukit_history_test_write_" + std::to_string(getpid());
  const std::string existing = prefix + "_existing.pickle";
  const std::string absent = prefix + "_absent.pickle";
  std::remove(absent.c_str());
  std::ofstream(existing, std::ios::binary) << "old";
  const child_result child = run_test_case_in_child("GPUKIT_HISTORY_WRITE_PATHS=" + existing + ":" + absent,
                                                    "history exports: writes under a file size limit child");
  CHECK(child.status == 0);
  if (child.status != 0) MESSAGE(child.stderr_text);
  // Written in place, each would hold the pickle's first write_limit bytes.
  CHECK(file_text(existing) == std::optional<std::string>("old"));
  CHECK_FALSE(file_text(absent).has_value());
  std::remove(absent.c_str());  // should it be there
  // The temporaries beside them were removed.
  int leftovers = 0;
  if (DIR* here = opendir(".")) {
    while (const dirent* entry = readdir(here)) {
      leftovers += std::string(entry->d_name).rfind(prefix, 0) == 0 && std::string(entry->d_name) != existing;
    }
    closedir(here);
  }
  CHECK(leftovers == 0);
  // Without a failure the file is replaced whole, keeping its permissions.
  REQUIRE(chmod(existing.c_str(), 0640) == 0);
  gpukit::dump_pytorch_snapshot(existing, snapshot, history);
  CHECK(file_text(existing) == std::optional<std::string>(pickle));
  struct stat after {};
  REQUIRE(stat(existing.c_str(), &after) == 0);
  CHECK((after.st_mode & 07777) == 0640);
  std::remove(existing.c_str());
  // A device is written in place, never replaced by a regular file (as root a rename could replace /dev/full).
  struct stat full {};
  if (lstat("/dev/full", &full) == 0 && S_ISCHR(full.st_mode)) {
    CHECK_THROWS_AS(gpukit::dump_pytorch_snapshot("/dev/full", snapshot, history), std::system_error);
    REQUIRE(lstat("/dev/full", &full) == 0);
    CHECK(S_ISCHR(full.st_mode));
  }
}

TEST_CASE("history exports: pickle integers, strings that are not UTF-8, and large addresses") {
  gpukit::detail::pickle_writer w;
  w.begin_list();
  w.integer(0);
  w.integer(0x7fffffff);
  w.integer(0x80000000ull);
  w.integer(0xffffffffffffffffull);
  w.text("ok\xff");
  w.end_list();
  const std::string bytes = w.finish();
  // PROTO 2, EMPTY_LIST, MARK, BININT 0, BININT 2^31-1, LONG1 5 bytes (2^31 needs a sign byte), LONG1 9 bytes, ...
  CHECK(bytes.substr(0, 4) == std::string("\x80\x02](", 4));
  CHECK(bytes.find(std::string("\x8a\x05\x00\x00\x00\x80\x00", 7)) != std::string::npos);
  CHECK(bytes.find(std::string("\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00", 11)) != std::string::npos);
  CHECK(bytes.find("ok?") != std::string::npos);
  CHECK(bytes.back() == '.');
  using gpukit::detail::pickle_writer;
  CHECK(pickle_writer::utf8_or_question_marks("\xC0\x80") == "??");            // overlong
  CHECK(pickle_writer::utf8_or_question_marks("\xF5\x80\x80\x80") == "????");  // above U+10FFFF
  CHECK(pickle_writer::utf8_or_question_marks("\xE0\x80\xAF") == "???");       // overlong
  CHECK(pickle_writer::utf8_or_question_marks("\xED\xA0\x80") == "???");       // a surrogate
  CHECK(pickle_writer::utf8_or_question_marks("\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80") ==
        "\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80");  // e-acute, euro, an emoji: kept
}

TEST_CASE("history: threads allocating on their own streams while another reads the history and switches it") {
  gpukit::basic_caching_allocator<gpukit::host_upstream> a(gpukit::device::cpu());
  auto first = std::make_shared<gpukit::memory_history>(1 << 15);
  auto second = std::make_shared<gpukit::memory_history>(1 << 15);
  a.set_memory_history(first);
  std::atomic<bool> done{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < 2; ++t) {
    workers.emplace_back([&a, t] {
      gpukit::stream s(gpukit::device::cpu());
      gpukit::memory_tag tag(t == 0 ? "thread 0" : "thread 1");
      std::vector<void*> live;
      for (int i = 0; i < 4000; ++i) {
        live.push_back(a.allocate(static_cast<std::size_t>(64 + (i % 7) * 512), s));
        if (live.size() > 3) {
          a.deallocate(live.front());
          live.erase(live.begin());
        }
      }
      for (void* p : live) a.deallocate(p);
    });
  }
  std::size_t inconsistent = 0;  // contents whose counts do not describe their events
  std::thread reader([&] {
    int switches = 0;
    while (!done.load()) {
      const gpukit::memory_history_contents c = first->contents();
      if (c.recorded - c.dropped != c.events.size()) ++inconsistent;
      if (switches % 16 == 0) {  // the JSON export's counts describe its events too
        const std::string json = gpukit::history_json(*first);
        const auto number_after = [&json](const std::string& key) {
          return std::stoull(json.substr(json.find(key) + key.size()));
        };
        std::size_t events = 0;
        for (std::size_t at = json.find("{\"action\":"); at != std::string::npos;
             at = json.find("{\"action\":", at + 1)) {
          ++events;
        }
        if (number_after("\"recorded\":") - number_after("\"dropped\":") != events) ++inconsistent;
      }
      (void)a.history();
      a.set_memory_history(++switches % 2 ? second : first);
      std::this_thread::yield();
    }
  });
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  // Every alloc either history holds was made by one of the two tagged threads, and across the two histories each
  // address was freed as often as it was allocated: no event was lost in a switch.
  std::map<std::uintptr_t, int> balance;
  for (const auto& h : {first, second}) {
    REQUIRE(h->dropped() == 0);
    for (const auto& e : h->events()) {
      if (e.action == memory_action::alloc) {
        const std::string tag = gpukit::memory_tag_name(e.tag);
        CHECK((tag == "thread 0" || tag == "thread 1"));
        ++balance[e.address];
      } else if (e.action == memory_action::free_requested) {
        --balance[e.address];
      }
    }
  }
  int unbalanced = 0;
  for (const auto& b : balance) unbalanced += b.second != 0 ? 1 : 0;
  CHECK(unbalanced == 0);
  CHECK(inconsistent == 0);
  CHECK(first->recorded() + second->recorded() >= 2 * 2 * 4000);  // an alloc and a free each, at least
  CHECK(a.memory_allocated() == 0);
}

TEST_CASE("history picture: one HTML page whose DOM has a bar per segment, a rectangle per block and the timeline") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  std::vector<void*> live;
  {
    gpukit::memory_tag tag("layer <0> & co");  // escaped in the page
    for (std::size_t i = 0; i < 12; ++i) live.push_back(w.a.allocate(2000 + i * 5000, i % 2 ? w.s1 : w.s2));
    live.push_back(w.a.allocate(5 * MiB, w.s1));
  }
  for (std::size_t i = 0; i < live.size(); i += 3) w.a.deallocate(live[i]);
  const auto snapshot = w.a.snapshot();
  const std::string html = gpukit::memory_picture_html(snapshot, *history, "history test");
  CHECK(html.find("layer &lt;0&gt; &amp; co") != std::string::npos);
  CHECK(html.find("<script") == std::string::npos);  // self-contained, nothing to run
  CHECK(html.find("http") == std::string::npos);     // nothing fetched
  std::size_t blocks = 0, allocated = 0;
  for (const auto& seg : snapshot.segments) {
    blocks += seg.blocks.size();
    for (const auto& b : seg.blocks) allocated += b.state == gpukit::block_state::allocated ? 1 : 0;
  }
  CHECK(allocated == 8);
  const std::string path = "gpukit_history_test_picture.html";
  std::ofstream(path) << html;
  const std::string args = " " + path + " " + std::to_string(snapshot.segments.size()) + " " + std::to_string(blocks) +
                           " " + std::to_string(allocated);
  CHECK(std::system((std::string("python3 \"") + GPUKIT_TEST_PICTURE_CHECK + "\"" + args).c_str()) == 0);
  // In a real browser, where one is installed (CI installs Debian's chromium): the DOM after rendering.
  if (std::system("command -v chromium > /dev/null 2>&1") == 0) {
    const std::string dom = "gpukit_history_test_picture.dom.html";
    const std::string render = "chromium --headless --no-sandbox --disable-gpu --dump-dom \"file://$(pwd)/" + path +
                               "\" > " + dom + " 2>/dev/null";
    CHECK(std::system(render.c_str()) == 0);
    const std::string dom_args = " " + dom + args.substr(args.find(' ', 1)) + " --dom";
    CHECK(std::system((std::string("python3 \"") + GPUKIT_TEST_PICTURE_CHECK + "\"" + dom_args).c_str()) == 0);
    std::remove(dom.c_str());
  } else {
    MESSAGE("chromium is not installed: the page was checked with Python's HTML parser only");
  }
  std::remove(path.c_str());
  for (std::size_t i = 0; i < live.size(); ++i) {
    if (i % 3 != 0) w.a.deallocate(live[i]);
  }
}

TEST_CASE("history: a segment freed while another thread takes its memory is recorded before the new segment") {
  // The segment's memory goes back to the upstream without the allocator's lock; the hook lets another thread
  // allocate it again right then (found by review: the free was recorded after the upstream call, so after the new
  // segment_alloc).
  struct hooked_upstream : gpukit::address_space_upstream {
    explicit hooked_upstream(std::size_t capacity) : gpukit::address_space_upstream(capacity) {}
    void deallocate(void* p, std::size_t bytes) noexcept {
      gpukit::address_space_upstream::deallocate(p, bytes);
      if (after_free) {
        auto f = std::move(after_free);
        after_free = nullptr;
        f();
      }
    }
    std::function<void()> after_free;
  };
  gpukit::basic_caching_allocator<hooked_upstream> a(gpukit::device::cpu(), gpukit::allocator_options{}, 16 * GiB);
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  auto history = std::make_shared<gpukit::memory_history>();
  a.set_memory_history(history);
  void* p = a.allocate(64 * MiB, s);
  a.deallocate(p);
  void* q = nullptr;
  a.upstream().after_free = [&] { std::thread([&] { q = a.allocate(64 * MiB, s); }).join(); };
  a.empty_cache();
  std::vector<std::pair<memory_action, std::uintptr_t>> segments;
  for (const auto& e : history->events()) {
    if (e.action == memory_action::segment_alloc || e.action == memory_action::segment_free) {
      segments.emplace_back(e.action, e.address);
    }
  }
  REQUIRE(segments.size() == 3);
  CHECK(segments[0].first == memory_action::segment_alloc);
  CHECK(segments[1].first == memory_action::segment_free);
  CHECK(segments[2].first == memory_action::segment_alloc);
  CHECK(segments[1].second == segments[2].second);  // the same memory, freed then taken again
  const auto levels = gpukit::detail::levels_of(history->events(), a.snapshot());
  CHECK(*std::max_element(levels.reserved.begin(), levels.reserved.end()) == static_cast<std::int64_t>(64 * MiB));
  a.deallocate(q);
}

TEST_CASE("history picture: levels are anchored at the snapshot, whatever happened after it") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* p = w.a.allocate(8 * MiB, w.s1);
  const auto snapshot = w.a.snapshot();
  w.a.deallocate(p);  // after the snapshot
  const auto events = history->events();
  const auto levels = gpukit::detail::levels_of(events, snapshot);
  REQUIRE(events.size() >= 4);           // segment_alloc, alloc, snapshot, free_requested, free_completed
  CHECK(levels.allocated.front() == 0);  // after segment_alloc, nothing allocated yet
  CHECK(*std::max_element(levels.allocated.begin(), levels.allocated.end()) == static_cast<std::int64_t>(8 * MiB));
  CHECK(levels.allocated.back() == 0);
  CHECK(levels.reserved.front() == static_cast<std::int64_t>(w.a.memory_reserved()));
}

TEST_CASE("history exports: an expandable segment is exported as its mapped ranges, and Python reads it") {
  gpukit::allocator_options options;
  options.expandable_segments = true;
  world_and_allocator w(options, 1 * GiB);
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  std::vector<void*> live;
  {
    gpukit::memory_tag tag("expandable");
    for (std::size_t i = 0; i < 3; ++i) live.push_back(w.a.allocate(3 * MiB + i * 100000, w.s1));
  }
  const auto snapshot = w.a.snapshot();
  std::size_t ranges = 0, mapped = 0;
  for (const auto& seg : snapshot.segments) {
    REQUIRE(seg.expandable);
    ranges += seg.mapped_ranges.size();
    for (const auto& r : seg.mapped_ranges) mapped += r.second;
    CHECK(seg.size > seg.mapped);  // a reserved range far larger than what is mapped
  }
  CHECK(mapped == w.a.memory_reserved());
  const std::string path = "gpukit_history_test_expandable.pickle";
  gpukit::dump_pytorch_snapshot(path, snapshot, *history);
  const std::string command = std::string("python3 \"") + GPUKIT_TEST_PICKLE_CHECK + "\" " + path + " " +
                              std::to_string(ranges) + " " + std::to_string(history->events().size()) + " 3 expandable";
  CHECK(std::system(command.c_str()) == 0);  // segments tile: each mapped range holds its (clipped) blocks
  std::remove(path.c_str());
  for (void* p : live) w.a.deallocate(p);
}

namespace {
// The child's allocator: reachable from here and never destroyed, so its blocks are still allocated at exit (and
// LeakSanitizer does not count them).
world_and_allocator* g_at_exit_allocator = nullptr;
}  // namespace

// Run only as the child of the test below (GPUKIT_LEAK_SCENARIO set): "leaks" keeps a tagged block allocated until
// exit, "clean" frees everything.
TEST_CASE("history: at-exit leak report child" * doctest::skip()) {
  const char* scenario = std::getenv("GPUKIT_LEAK_SCENARIO");
  if (scenario == nullptr) return;
  g_at_exit_allocator = new world_and_allocator();
  auto& w = *g_at_exit_allocator;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  gpukit::report_leaks_at_exit(history, "test allocator");
  void* weights = nullptr;
  {
    gpukit::memory_tag tag("weights");
    weights = w.a.allocate(std::size_t{1} << 20, w.s1);
  }
  w.a.deallocate(w.a.allocate(100, w.s2));
  if (std::string(scenario) == "clean") w.a.deallocate(weights);
}

TEST_CASE("history: report_leaks_at_exit prints what is still allocated at exit, and nothing when all was freed") {
  const auto leaks = run_test_case_in_child("GPUKIT_LEAK_SCENARIO=leaks", "history: at-exit leak report child");
  CHECK(leaks.status == 0);
  CHECK(leaks.stderr_text.find("gpukit: still allocated at exit (test allocator): live allocations seen by the "
                               "history: 1 (1048576 B)\n") == 0);
  CHECK(leaks.stderr_text.find("weights") != std::string::npos);
  const auto clean = run_test_case_in_child("GPUKIT_LEAK_SCENARIO=clean", "history: at-exit leak report child");
  CHECK(clean.status == 0);
  CHECK(clean.stderr_text.empty());
  if (!clean.stderr_text.empty()) MESSAGE(clean.stderr_text);
  CHECK_THROWS_AS(gpukit::report_leaks_at_exit(nullptr), gpukit::invalid_argument_error);
  CHECK_THROWS_AS(gpukit::report_leaks_at_exit(std::make_shared<gpukit::memory_history>(), "x", nullptr),
                  gpukit::invalid_argument_error);
}

namespace {
/// A history event with only what largest_free_levels reads.
gpukit::memory_event event(memory_action a, std::uintptr_t address, std::size_t size) {
  gpukit::memory_event e;
  e.action = a;
  e.address = address;
  e.size = size;
  return e;
}
}  // namespace

TEST_CASE("history picture: the largest free block follows segments, allocations and completed frees") {
  using gpukit::memory_event;
  // A segment already there when the history began (its first event frees it: from the snapshot's point of view it
  // is gone), an allocation made before the history began (first seen freed), a new segment and two allocations.
  const std::vector<memory_event> events = {
      event(memory_action::segment_alloc, 0x100000, 1000),        // 0: [0x100000, +1000) free
      event(memory_action::alloc, 0x100000 + 100, 200),           // 1: gaps 100 and 700
      event(memory_action::free_requested, 0x5000, 50),           // 2: 0x5000 was live at the start (in [0x5000, +400))
      event(memory_action::free_completed, 0x5000, 50),           // 3: [0x5000, +400) entirely free now
      event(memory_action::free_requested, 0x100000 + 100, 200),  // 4: not reusable yet
      event(memory_action::free_completed, 0x100000 + 100, 200),  // 5: the whole 1000 free again
      event(memory_action::segment_map, 0x100000 + 1000, 24),     // 6: an adjacent range: one run of 1024
      event(memory_action::segment_free, 0x5000, 400),            // 7: the old segment goes
  };
  const std::vector<std::size_t> at = {0, 1, 2, 3, 4, 5, 6, 7};
  const auto largest = gpukit::detail::largest_free_levels(events, gpukit::allocator_snapshot{}, at);
  CHECK(largest == std::vector<std::int64_t>{1000, 700, 700, 700, 700, 1000, 1024, 1024});
  // Without the segment at 0x5000 being freed in the history, it only counts if the snapshot holds it.
  const std::vector<memory_event> brief = {event(memory_action::alloc, 0x9000 + 64, 32)};
  gpukit::allocator_snapshot snapshot;
  gpukit::segment_info seg;
  seg.address = 0x9000;
  seg.size = 4096;
  seg.mapped = 4096;
  gpukit::block_info held;  // allocated before the history began: occupies [0x9000 + 2048, +1024)
  held.address = 0x9000 + 2048;
  held.size = 1024;
  held.state = gpukit::block_state::allocated;
  seg.blocks = {held};
  snapshot.segments = {seg};
  CHECK(gpukit::detail::largest_free_levels(brief, snapshot, {0}) == std::vector<std::int64_t>{2048 - 96});
  CHECK(gpukit::detail::largest_free_levels(brief, gpukit::allocator_snapshot{}, {0}) == std::vector<std::int64_t>{0});
}

TEST_CASE("history picture: a block cached in front is free whether or not the history saw it freed") {
  std::int64_t largest[2] = {0, 0};
  for (const bool history_first : {true, false}) {
    CAPTURE(history_first);
    gpukit::allocator_options o;
    o.front_cache_large = true;
    fake_setup f(o, 1024 * MiB);
    const fake_stream s0 = f.add_stream();
    auto history = std::make_shared<gpukit::memory_history>(1000);
    if (history_first) f.a.set_memory_history(history);
    void* keep = f.a.allocate(4 * MiB, s0);
    void* p = f.a.allocate(4 * MiB, s0);
    f.a.deallocate(p);  // cached in front for s0
    if (!history_first) f.a.set_memory_history(history);
    const gpukit::allocator_snapshot snap = f.a.snapshot();
    bool cached = false;
    for (const auto& seg : snap.segments) {
      for (const auto& b : seg.blocks) cached = cached || b.state == gpukit::block_state::cached;
    }
    REQUIRE(cached);
    const std::vector<gpukit::memory_event> events = history->events();
    REQUIRE(!events.empty());
    const std::vector<std::int64_t> levels = gpukit::detail::largest_free_levels(events, snap, {events.size() - 1});
    REQUIRE(levels.size() == 1);
    largest[history_first ? 0 : 1] = levels[0];
    f.a.deallocate(keep);
  }
  CHECK(largest[0] == largest[1]);
  CHECK(largest[0] > static_cast<std::int64_t>(4 * MiB));  // the cached block and the rest of its segment
}

TEST_CASE("history picture: the largest free block with pages unmapped as a run, overlaps and straddling blocks") {
  using gpukit::memory_event;
  const std::uintptr_t base = 0x100000;
  // Pages mapped one by one, one of them allocated, then the three free ones unmapped as one run.
  const std::vector<memory_event> pages = {
      event(memory_action::segment_map, base, 100),       event(memory_action::segment_map, base + 100, 100),
      event(memory_action::segment_map, base + 200, 100), event(memory_action::segment_map, base + 300, 100),
      event(memory_action::alloc, base + 300, 100),       event(memory_action::segment_unmap, base, 300),
  };
  CHECK(gpukit::detail::largest_free_levels(pages, gpukit::allocator_snapshot{}, {3, 4, 5}) ==
        std::vector<std::int64_t>{400, 300, 0});
  // A run that mixes a page the history mapped with one that was there before it began: both count from the start.
  const std::vector<memory_event> mixed = {event(memory_action::segment_map, base, 100),
                                           event(memory_action::segment_unmap, base, 200)};
  CHECK(gpukit::detail::largest_free_levels(mixed, gpukit::allocator_snapshot{}, {0, 1}) ==
        std::vector<std::int64_t>{200, 0});
  const std::vector<memory_event> older_first = {event(memory_action::segment_map, base + 100, 100),
                                                 event(memory_action::segment_unmap, base, 200)};
  CHECK(gpukit::detail::largest_free_levels(older_first, gpukit::allocator_snapshot{}, {0, 1}) ==
        std::vector<std::int64_t>{200, 0});
  // An unmap of the middle of a range leaves both ends.
  const std::vector<memory_event> middle = {event(memory_action::segment_map, base, 1000),
                                            event(memory_action::segment_unmap, base + 100, 500)};
  CHECK(gpukit::detail::largest_free_levels(middle, gpukit::allocator_snapshot{}, {1}) ==
        std::vector<std::int64_t>{400});
  // A range known from the snapshot overlapping one mapped in the history: one run, and its allocation counts.
  gpukit::allocator_snapshot snapshot;
  gpukit::segment_info seg;
  seg.address = base;
  seg.size = 4096;
  seg.mapped = 400;
  seg.expandable = true;
  seg.mapped_ranges = {{base, 400}};
  snapshot.segments = {seg};
  const std::vector<memory_event> overlap = {event(memory_action::segment_map, base + 200, 200),
                                             event(memory_action::alloc, base, 400)};
  CHECK(gpukit::detail::largest_free_levels(overlap, snapshot, {0, 1}) == std::vector<std::int64_t>{400, 0});
  // The snapshot's run merges pages that were there before the history began with one the history mapped at its
  // start: those before count, though the run starts at the history's page.
  snapshot.segments[0].mapped_ranges = {{base, 400}};
  const std::vector<memory_event> grown = {event(memory_action::segment_map, base, 100),
                                           event(memory_action::alloc, base + 100, 100)};
  CHECK(gpukit::detail::largest_free_levels(grown, snapshot, {0, 1}) == std::vector<std::int64_t>{400, 200});
  // An allocation that starts before a range and runs into it (ranges known only from their frees).
  const std::vector<memory_event> straddle = {event(memory_action::alloc, base + 50, 100),
                                              event(memory_action::segment_free, base + 100, 200),
                                              event(memory_action::segment_free, base, 100)};
  CHECK(gpukit::detail::largest_free_levels(straddle, gpukit::allocator_snapshot{}, {0}) ==
        std::vector<std::int64_t>{150});
}

TEST_CASE("history exports: a long tag keeps its group's figures in the leak report") {
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* long_tagged = nullptr;
  void* short_tagged = nullptr;
  {
    gpukit::memory_tag tag(std::string(300, 't'));
    long_tagged = w.a.allocate(64, w.s1);
  }
  {
    gpukit::memory_tag tag("second");
    short_tagged = w.a.allocate(32, w.s1);
  }
  const std::string report = gpukit::leak_report(*history);
  CHECK(report.find(std::string(300, 't') + "           64 B x 1        = 64 B\n") != std::string::npos);
  CHECK(report.find("  second                             32 B x 1        = 32 B\n") != std::string::npos);
  w.a.deallocate(long_tagged);
  w.a.deallocate(short_tagged);
}

namespace {
/// Runs check_pytorch_snapshot.py on the pickle of `snapshot` and `history` (written to `path`, then removed).
bool python_reads_pickle(const std::string& path, const gpukit::allocator_snapshot& snapshot,
                         const gpukit::memory_history& history, std::size_t segments, std::size_t events,
                         std::size_t allocated, const std::string& tag) {
  gpukit::dump_pytorch_snapshot(path, snapshot, history);
  const std::string command = std::string("python3 \"") + GPUKIT_TEST_PICKLE_CHECK + "\" " + path + " " +
                              std::to_string(segments) + " " + std::to_string(events) + " " +
                              std::to_string(allocated) + " " + tag;
  const bool ok = std::system(command.c_str()) == 0;
  std::remove(path.c_str());
  return ok;
}

/// Runs check_memory_picture.py on `html` (written to `path`, then removed) with these arguments after the path.
bool python_reads_picture(const std::string& path, const std::string& html, const std::string& args) {
  std::ofstream(path, std::ios::binary) << html;
  const bool ok =
      std::system((std::string("python3 \"") + GPUKIT_TEST_PICTURE_CHECK + "\" " + path + " " + args).c_str()) == 0;
  std::remove(path.c_str());
  return ok;
}

std::size_t segment_rows(const gpukit::allocator_snapshot& snapshot) {
  std::size_t rows = 0;
  for (const auto& seg : snapshot.segments) rows += seg.expandable ? seg.mapped_ranges.size() : 1;
  return rows;
}
}  // namespace

TEST_CASE("history exports: lists of more than 1000 items are pickled in batches of 1000, as the viewer reads them") {
  // MemoryViz.js's unpickler pushes an APPENDS batch as function arguments: one of some 130,000 items overflows
  // Node's stack (found by review). The check walks the pickle's opcodes and refuses a batch of more than 1000.
  const std::uintptr_t base = 0x10000000;
  const std::size_t blocks = 2000, block = 512;
  gpukit::memory_history history(100000);
  gpukit::allocator_snapshot snapshot;
  snapshot.device = gpukit::device::cpu();
  gpukit::segment_info seg;  // 2000 blocks, the odd ones allocated at the snapshot
  seg.address = base;
  seg.size = seg.mapped = blocks * block;
  history.record(memory_action::segment_alloc, base, seg.size, 0);
  {
    gpukit::memory_tag tag("batched");
    for (std::size_t i = 0; i < blocks; ++i) {
      const std::uintptr_t address = base + i * block;
      history.record(memory_action::alloc, address, 500, 7);
      gpukit::block_info b;
      b.address = address;
      b.size = block;
      b.stream = 7;
      if (i % 2 == 0) {
        history.record(memory_action::free_requested, address, 500, 7);
        history.record(memory_action::free_completed, address, 500, 7);
      } else {
        b.state = gpukit::block_state::allocated;
        b.requested = 500;
      }
      seg.blocks.push_back(b);
    }
  }
  snapshot.segments.push_back(seg);
  for (std::size_t k = 0; k < 1200; ++k) {  // and 1200 more segments, idle, from before the history
    gpukit::segment_info idle;
    idle.address = 0x40000000 + k * 4096;
    idle.size = idle.mapped = 4096;
    gpukit::block_info free_block;
    free_block.address = idle.address;
    free_block.size = idle.size;
    idle.blocks.push_back(free_block);
    snapshot.segments.push_back(idle);
  }
  history.record(memory_action::snapshot, 0, 0, 0);
  const std::size_t events = history.events().size();
  REQUIRE(events == 1 + blocks + blocks + 1);
  CHECK(python_reads_pickle("gpukit_history_test_batches.pickle", snapshot, history, 1201, events, blocks / 2,
                            "batched"));
}

TEST_CASE("history picture: an expandable segment is drawn as its mapped ranges, and the scale is theirs") {
  // Found by review: the page drew the whole reserved range (four times the device's memory) as one free block, and
  // scaled every bar against it.
  gpukit::allocator_options options;
  options.expandable_segments = true;
  world_and_allocator w(options, 8 * GiB);
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  std::vector<void*> live = {w.a.allocate(3 * MiB, w.s1), w.a.allocate(100, w.s1), w.a.allocate(5 * MiB, w.s2)};
  w.a.deallocate(live[2]);
  w.a.empty_cache();  // unmaps s2's pages
  live[2] = w.a.allocate(MiB, w.s1);
  const auto snapshot = w.a.snapshot();
  std::size_t blocks = 0, allocated = 0;
  for (const auto& seg : snapshot.segments) {
    REQUIRE(seg.expandable);
    CHECK(seg.size > 4 * seg.mapped);
    for (const auto& r : seg.mapped_ranges) {
      for (const auto& b : seg.blocks) {
        if (std::max(b.address, r.first) < std::min(b.address + b.size, r.first + r.second)) {
          ++blocks;
          allocated += b.state == gpukit::block_state::allocated ? 1 : 0;
        }
      }
    }
  }
  CHECK(allocated == 3);
  const std::string html = gpukit::memory_picture_html(snapshot, *history);
  CHECK(html.find(" of " + gpukit::detail::format_bytes(snapshot.segments.back().size)) != std::string::npos);
  CHECK(python_reads_picture("gpukit_history_test_expandable_picture.html", html,
                             std::to_string(segment_rows(snapshot)) + " " + std::to_string(blocks) + " " +
                                 std::to_string(allocated) + " --mapped " + std::to_string(w.a.memory_reserved())));
  for (void* p : live) w.a.deallocate(p);
}

TEST_CASE("history exports: a block whose free waits for another stream keeps its request and tag") {
  // PyTorch's active_pending_free blocks keep requested_size and their frames until the free completes (found by
  // review: exported with 0 and no frame).
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* keep = nullptr;
  void* p = nullptr;
  {
    gpukit::memory_tag tag("waiting");
    keep = w.a.allocate(3000, w.s1);
    p = w.a.allocate(5000, w.s1);
  }
  w.a.record_stream(p, w.s2);
  w.world.enqueue(w.s2.id);  // s2 still works on p
  w.a.deallocate(p);
  const auto snapshot = w.a.snapshot();
  std::size_t pending = 0;
  for (const auto& seg : snapshot.segments) {
    for (const auto& b : seg.blocks) pending += b.state == gpukit::block_state::pending ? 1 : 0;
  }
  REQUIRE(pending == 1);
  CHECK(python_reads_pickle("gpukit_history_test_pending.pickle", snapshot, *history, snapshot.segments.size(),
                            history->events().size(), 1, "waiting"));
  const std::string html = gpukit::memory_picture_html(snapshot, *history);
  CHECK(html.find(", pending (5000 B requested), stream ") != std::string::npos);
  CHECK(html.find(", pending (5000 B requested), stream " + std::to_string(w.a.stream_operations().key(w.s1)) +
                  ", tag waiting</title>") != std::string::npos);
  // Its level is no longer allocated (its free_requested is in the history).
  const auto levels = gpukit::detail::levels_of(history->events(), snapshot);
  CHECK(levels.allocated.back() == 3000);
  w.world.complete(w.s2.id);
  w.a.deallocate(keep);
}

TEST_CASE("history exports: untagged events and allocations carry a frame, allocations older than the history none") {
  // An empty frame list makes the viewer say "allocated before _record_memory_history was enabled" (found by
  // review: every untagged event and block said so).
  world_and_allocator w;
  void* before = w.a.allocate(2000, w.s1);  // before the history: no frame is right
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* untagged = w.a.allocate(3000, w.s1);
  void* tagged = nullptr;
  {
    gpukit::memory_tag tag("named");
    tagged = w.a.allocate(4000, w.s2);
  }
  w.a.deallocate(w.a.allocate(500, w.s2));
  const auto snapshot = w.a.snapshot();
  const std::string pickle = gpukit::pytorch_snapshot_pickle(snapshot, *history);
  CHECK(pickle.find("(untagged)") != std::string::npos);
  CHECK(python_reads_pickle("gpukit_history_test_untagged.pickle", snapshot, *history, snapshot.segments.size(),
                            history->events().size(), 3, "named"));
  w.a.deallocate(before);
  w.a.deallocate(untagged);
  w.a.deallocate(tagged);
}

TEST_CASE("history exports: an expandable segment's mapped ranges have the stream of their map and unmap events") {
  // The viewer, replaying the trace backwards, merges a re-mapped range with its neighbours only when their streams
  // are equal (found by review: the ranges took their first block's stream, the events 0, so segments looked split).
  gpukit::allocator_options options;
  options.expandable_segments = true;
  world_and_allocator w(options, 1 * GiB);
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  std::vector<void*> live;
  {
    gpukit::memory_tag tag("pages");
    for (std::size_t i = 0; i < 4; ++i) live.push_back(w.a.allocate(3 * MiB, w.s1));
    w.a.deallocate(live[3]);
    live.pop_back();
    w.a.empty_cache();  // unmaps the last allocation's pages, next to the others
    live.push_back(w.a.allocate(2 * MiB, w.s1));
  }
  const auto snapshot = w.a.snapshot();
  const auto events = history->events();
  CHECK(count_of(events, memory_action::segment_unmap) >= 1);
  CHECK(python_reads_pickle("gpukit_history_test_streams.pickle", snapshot, *history, segment_rows(snapshot),
                            events.size(), 4, "pages"));
  for (void* p : live) w.a.deallocate(p);
}

TEST_CASE("history picture: text is UTF-8 without the control characters HTML forbids") {
  using gpukit::detail::html_escape;
  CHECK(html_escape(std::string("a\x01\x7f<b\0c\td\n", 11)) == "a&lt;bc\td\n");
  CHECK(html_escape("ok\xff \xc3") == "ok? ?");  // not UTF-8: '?', as in the JSON and pickle
  CHECK(html_escape("c1\xc2\x85|\xc2\xa0|\xc3\xa9") == "c1|\xc2\xa0|\xc3\xa9");  // C1 dropped; no-break space, e-acute
  world_and_allocator w;
  auto history = std::make_shared<gpukit::memory_history>();
  w.a.set_memory_history(history);
  void* p = nullptr;
  {
    gpukit::memory_tag tag(std::string("bad\xff\xfe \x01\x1f\x7f\xc2\x9f tag\0", 15));
    p = w.a.allocate(1000, w.s1);
  }
  const auto snapshot = w.a.snapshot();
  const std::string html = gpukit::memory_picture_html(snapshot, *history, "title \xed\xa0\x80\x02");
  CHECK(html.find("tag bad?? ") != std::string::npos);
  CHECK(python_reads_picture("gpukit_history_test_escaping.html", html, "1 2 1"));
  w.a.deallocate(p);
}

TEST_CASE("history exports: the trace ends at the snapshot's own event, whatever was recorded after it") {
  // Found by review: the trace was cut at the history's last snapshot event, so another thread's later snapshot()
  // left events in it that the snapshot does not reflect, and a dropped one cut nothing, silently.
  const std::uintptr_t base = 0x10000000;
  gpukit::memory_history history(100);
  gpukit::allocator_snapshot snapshot;
  gpukit::segment_info seg;
  seg.address = base;
  seg.size = seg.mapped = 4096;
  gpukit::block_info held;
  held.address = base;
  held.size = 1024;
  held.requested = 1000;
  held.state = gpukit::block_state::allocated;
  gpukit::block_info rest;
  rest.address = base + 1024;
  rest.size = 3072;
  seg.blocks = {held, rest};
  snapshot.segments = {seg};
  {
    gpukit::memory_tag tag("mine");
    history.record(memory_action::segment_alloc, base, 4096, 0);
    history.record(memory_action::alloc, base, 1000, 0);
  }
  snapshot.history_position = history.record_snapshot();  // what the allocator's snapshot() stores
  CHECK(snapshot.history_position.history_id == history.id());
  CHECK(snapshot.history_position.recorded == 3);
  history.record(memory_action::alloc, base + 1024, 1000, 0);  // another thread, after the snapshot
  history.record(memory_action::snapshot, 0, 0, 0);            // and its own snapshot
  CHECK(python_reads_pickle("gpukit_history_test_position.pickle", snapshot, history, 1, 3, 1, "mine"));
  // The picture anchors its levels there too.
  const gpukit::memory_history_contents contents = history.contents();
  const auto place = gpukit::detail::find_snapshot_event(snapshot, contents);
  REQUIRE(place.kind == gpukit::detail::snapshot_event_place::held);
  CHECK(place.index == 2);
  const auto levels = gpukit::detail::levels_of(contents.events, snapshot, place);
  CHECK(levels.allocated[2] == 1000);
  CHECK(levels.allocated[3] == 2000);

  // When the ring no longer holds it: a clear error with the numbers, not a trace cut in the wrong place.
  for (std::uintptr_t i = 0; i < 100; ++i) history.record(memory_action::alloc, base + 2048, 1, 0);
  std::string message;
  try {
    (void)gpukit::pytorch_snapshot_pickle(snapshot, history);
  } catch (const gpukit::invalid_argument_error& e) {
    message = e.what();
  }
  CHECK(message.find("gpukit::pytorch_snapshot_pickle: the history no longer holds the snapshot's event (event 3; of "
                     "105 events recorded, the first 5 were dropped)") == 0);
  // So is the picture, whose levels are anchored there: it drew them from the end of the trace, below zero.
  message.clear();
  try {
    (void)gpukit::memory_picture_html(snapshot, history);
  } catch (const gpukit::invalid_argument_error& e) {
    message = e.what();
  }
  CHECK(message.find("gpukit::memory_picture_html: the history no longer holds the snapshot's event (event 3; of "
                     "105 events recorded, the first 5 were dropped)") == 0);
  // A position from before a clear() is not this history's: the trace ends at its last snapshot event, as with none.
  history.clear();
  CHECK(history.id() != snapshot.history_position.history_id);
  history.record(memory_action::alloc, base, 1000, 0);
  history.record(memory_action::snapshot, 0, 0, 0);
  history.record(memory_action::free_requested, base, 1000, 0);
  CHECK(gpukit::detail::find_snapshot_event(snapshot, history.contents()).kind ==
        gpukit::detail::snapshot_event_place::unknown);
  CHECK_NOTHROW((void)gpukit::pytorch_snapshot_pickle(snapshot, history));
}
