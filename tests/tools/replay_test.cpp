// gpukit_replay (issue 11): a history recorded live, exported as RMM's CSV log or gpukit's JSON, is read back and
// replayed to the live run's peaks exactly; the minimum capacity runs and a smaller one does not; malformed logs are
// reported with their line; the command-line tool prints the fit table.
#include "replay.hpp"

#include <gpukit/memory/history_export.hpp>
#include <gpukit/memory/memory_history.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace gpukit_replay;

namespace {

/// A live run: 3 streams, random sizes from 256 B to 24 MiB, frees of random live blocks; returns the engine's
/// statistics, with its history in `history`.
gpukit::allocator_stats live_run(std::shared_ptr<gpukit::memory_history>& history) {
  engine a(gpukit::device::cpu(), gpukit::allocator_options{}, std::size_t{1} << 46);
  history = std::make_shared<gpukit::memory_history>(1 << 20);
  a.set_memory_history(history);
  std::vector<std::unique_ptr<gpukit::stream>> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(std::make_unique<gpukit::stream>(gpukit::device::cpu()));
  std::mt19937_64 rng(5);
  std::vector<void*> live;
  for (int i = 0; i < 4000; ++i) {
    if (live.size() < 60 && rng() % 3 != 0) {
      const std::size_t bytes = rng() % 4 == 0 ? 1 * MiB + rng() % (24 * MiB) : 256 + rng() % (256 * 1024);
      live.push_back(a.allocate(bytes, *streams[rng() % 3]));
    } else if (!live.empty()) {
      const std::size_t k = rng() % live.size();
      a.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  const auto stats = a.stats();
  for (void* p : live) a.deallocate(p);
  return stats;
}

}  // namespace

TEST_CASE("replay: a history read back from RMM's CSV log or gpukit's JSON reproduces the live run's peaks") {
  std::shared_ptr<gpukit::memory_history> history;
  const gpukit::allocator_stats live = live_run(history);
  std::istringstream csv(gpukit::rmm_log_csv(*history));
  const recorded_trace from_csv = read_rmm_csv(csv);
  std::istringstream json(gpukit::history_json(*history));
  const recorded_trace from_json = read_history_json(json);
  for (const recorded_trace* r : {&from_csv, &from_json}) {
    CHECK(r->unknown_frees == 0);
    CHECK(r->ops.streams == 3);
    CHECK(r->ops.peak_requested == static_cast<std::size_t>(live.requested_bytes.all().peak));
    const replay_result replayed = replay_gpukit(r->ops, gpukit::allocator_options{}, std::size_t{1} << 46);
    CHECK(replayed.completed);
    CHECK(replayed.peak_requested == static_cast<std::size_t>(live.requested_bytes.all().peak));
    // The same engine, the same calls on the same streams: the same segments.
    CHECK(replayed.peak_reserved == static_cast<std::size_t>(live.reserved_bytes.all().peak));
    CHECK(replayed.upstream_allocs == static_cast<std::size_t>(live.num_device_alloc));
  }
  CHECK(from_csv.ops.ops.size() == from_json.ops.ops.size());
}

TEST_CASE("replay: the minimum capacity runs the whole history, and the peak requested alone does not") {
  std::shared_ptr<gpukit::memory_history> history;
  (void)live_run(history);
  std::istringstream csv(gpukit::rmm_log_csv(*history));
  const trace t = read_rmm_csv(csv).ops;
  const gpukit::allocator_options defaults;
  const std::size_t minimum =
      minimum_capacity(t, [&](std::size_t c) { return replay_gpukit(t, defaults, c).completed; });
  CHECK(minimum >= t.peak_requested);
  CHECK(replay_gpukit(t, defaults, minimum).completed);
  CHECK_FALSE(replay_gpukit(t, defaults, t.peak_requested - 1).completed);
  const std::size_t pytorch = minimum_capacity(t, [&](std::size_t c) { return runs_under_pytorch(t, c); });
  CHECK(pytorch >= t.peak_requested);
  CHECK(runs_under_pytorch(t, pytorch));
}

TEST_CASE("replay: malformed logs are reported with their line, frees of unknown pointers are counted") {
  std::istringstream no_header("");
  CHECK_THROWS_WITH_AS(read_rmm_csv(no_header), "empty log: no header line", std::runtime_error);
  std::istringstream missing("Thread,Time,Action,Pointer,Size\n");
  CHECK_THROWS_WITH_AS(read_rmm_csv(missing), "the header lacks the column Stream", std::runtime_error);
  std::istringstream bad_size("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00:000001,allocate,0x10,12x,0\n");
  CHECK_THROWS_WITH_AS(read_rmm_csv(bad_size), "line 2: size \"12x\" is not a number", std::runtime_error);
  std::istringstream bad_action("Thread,Time,Action,Pointer,Size,Stream\n1,t,resize,0x10,12,0\n");
  CHECK_THROWS_WITH_AS(read_rmm_csv(bad_action), "line 2: unknown action \"resize\"", std::runtime_error);
  std::istringstream ok(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,t,free,0x99,8,0\n"
      "1,t,allocate,0x10,100,7\n"
      "1,t,allocate failure,0x0,1000000,7\n"
      "1,t,allocate,0x20,50,9\n"
      "1,t,free,0x10,100,7\n");
  const recorded_trace r = read_rmm_csv(ok);
  CHECK(r.unknown_frees == 1);
  CHECK(r.failures == 1);
  CHECK(r.ops.streams == 2);
  CHECK(r.ops.peak_requested == 150);
  std::istringstream not_json("{\"something\":1}");
  CHECK_THROWS_AS(read_history_json(not_json), std::runtime_error);
}

TEST_CASE("replay: the command-line tool prints the minimum capacities and the fit table") {
  std::shared_ptr<gpukit::memory_history> history;
  (void)live_run(history);
  const std::string log = "gpukit_replay_test.csv", out = "gpukit_replay_test.out";
  std::ofstream(log) << gpukit::rmm_log_csv(*history);
  const std::string command =
      std::string("\"") + GPUKIT_REPLAY_TOOL + "\" " + log + " --gpu tiny=64 --gpu big=81920 > " + out;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MESSAGE(text);
  CHECK(text.find("peak requested:") != std::string::npos);
  CHECK(text.find("PyTorch's rules") != std::string::npos);
  CHECK(text.find("tiny") != std::string::npos);
  CHECK(text.find("no (short by") != std::string::npos);  // 64 MiB minus the context holds nothing
  CHECK(text.find("yes (") != std::string::npos);         // 80 GiB holds it
  const std::string bad = std::string("\"") + GPUKIT_REPLAY_TOOL + "\" /nonexistent.csv > " + out + " 2>&1";
  CHECK(std::system(bad.c_str()) != 0);
  std::remove(log.c_str());
  std::remove(out.c_str());
}

TEST_CASE("replay: tags with braces, CRLF logs, negative and absurd sizes") {
  engine a(gpukit::device::cpu(), gpukit::allocator_options{}, std::size_t{1} << 40);
  auto history = std::make_shared<gpukit::memory_history>();
  a.set_memory_history(history);
  const auto s = gpukit::stream_view::default_stream(gpukit::device::cpu());
  void* p = nullptr;
  {
    gpukit::memory_tag tag("cache}{0}\"x\\");
    p = a.allocate(9 * MiB, s);
  }
  a.deallocate(p);
  std::istringstream json(gpukit::history_json(*history));
  const recorded_trace from_json = read_history_json(json);
  CHECK(from_json.ops.ops.size() == 2);  // the tag's braces and quote are inside a string
  CHECK(from_json.ops.peak_requested == 9 * MiB);
  std::istringstream crlf(
      "Thread,Time,Action,Pointer,Size,Stream\r\n1,t,allocate,0x10,100,0\r\n1,t,free,0x10,100,0\r\n");
  CHECK(read_rmm_csv(crlf).ops.peak_requested == 100);
  std::istringstream negative("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,-1,0\n");
  CHECK_THROWS_WITH_AS(read_rmm_csv(negative), "line 2: size \"-1\" is not a number", std::runtime_error);
  std::istringstream huge("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,9223372036854775808,0\n");
  CHECK_THROWS_AS(read_rmm_csv(huge), std::runtime_error);
  std::istringstream big("Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,1125899906842624,0\n");  // 1 PiB
  const trace t = read_rmm_csv(big).ops;
  CHECK_THROWS_WITH_AS(
      minimum_capacity(t, [&](std::size_t c) { return replay_gpukit(t, gpukit::allocator_options{}, c).completed; }),
      doctest::Contains("does not run even on"), std::runtime_error);
}

TEST_CASE("replay: a PyTorch snapshot pickle (gpukit's own) reproduces the live run's peaks like the other formats") {
  std::shared_ptr<gpukit::memory_history> history;
  const gpukit::allocator_stats live = live_run(history);
  std::istringstream pickle(gpukit::pytorch_snapshot_pickle(gpukit::allocator_snapshot{}, *history));
  const recorded_trace r = read_pytorch_snapshot(pickle, "run");
  CHECK(r.ops.name == "run (device 0)");
  CHECK(r.unknown_frees == 0);
  CHECK(r.ops.streams == 3);
  CHECK(r.ops.peak_requested == static_cast<std::size_t>(live.requested_bytes.all().peak));
  const replay_result replayed = replay_gpukit(r.ops, gpukit::allocator_options{}, std::size_t{1} << 46);
  CHECK(replayed.peak_reserved == static_cast<std::size_t>(live.reserved_bytes.all().peak));
  std::istringstream csv(gpukit::rmm_log_csv(*history));
  CHECK(r.ops.ops.size() == read_rmm_csv(csv).ops.ops.size());
}

namespace {
/// Runs python3 with `script` (which writes the pickle file `path`) and returns the file's bytes.
std::string python_pickle(const std::string& script, const std::string& path) {
  const std::string script_path = path + ".py";
  std::ofstream(script_path) << script;
  const int status = std::system(("python3 " + script_path).c_str());
  std::remove(script_path.c_str());
  REQUIRE(status == 0);
  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  return data;
}
}  // namespace

TEST_CASE("replay: snapshots pickled by Python itself, protocols 2 to 5, with shared frames and large addresses") {
  // What torch.cuda.memory._snapshot() returns, in miniature: two devices (the second busier), frames shared
  // between events (pickle memoizes them), an address above 2^63, free_requested and free_completed, an oom.
  const std::string script = R"(
import pickle, sys
frames = [{'filename': 'model.py', 'line': 12, 'name': 'forward'}]
big = 2**63 + 4096
busy = [
  {'action': 'segment_alloc', 'addr': big, 'size': 2097152, 'stream': 0, 'time_us': 1, 'frames': frames},
  {'action': 'alloc', 'addr': big, 'size': 1024, 'stream': 0, 'time_us': 2, 'frames': frames},
  {'action': 'alloc', 'addr': big + 1024, 'size': 3000000, 'stream': 7, 'time_us': 3, 'frames': frames},
  {'action': 'free_requested', 'addr': big, 'size': 1024, 'stream': 0, 'time_us': 4, 'frames': frames},
  {'action': 'free_completed', 'addr': big, 'size': 1024, 'stream': 0, 'time_us': 5, 'frames': frames},
  {'action': 'oom', 'addr': 0, 'size': 1 << 40, 'stream': 0, 'time_us': 6, 'frames': []},
  {'action': 'alloc', 'addr': 4096, 'size': 512, 'stream': 0, 'time_us': 7, 'frames': frames, 'ratio': 0.5},
]
quiet = [{'action': 'alloc', 'addr': 8192, 'size': 64, 'stream': 0, 'time_us': 1, 'frames': frames}]
snapshot = {'segments': [], 'device_traces': [quiet, busy], 'allocator_settings': {'expandable_segments': False}}
for protocol in (2, 3, 4, 5):
    with open(sys.argv[0][:-3] + '.' + str(protocol), 'wb') as f:
        pickle.dump(snapshot, f, protocol=protocol)
with open(sys.argv[0][:-3], 'wb') as f:
    pickle.dump(snapshot, f)
)";
  const std::string base = "gpukit_replay_python.pickle";
  const std::string default_protocol = python_pickle(script, base);  // also writes base.2 ... base.5
  for (int protocol = 2; protocol <= 5; ++protocol) {
    CAPTURE(protocol);
    const std::string path = base + "." + std::to_string(protocol);
    std::ifstream in(path, std::ios::binary);
    REQUIRE(in.good());
    const recorded_trace r = read_pytorch_snapshot(in, "python");
    std::remove(path.c_str());
    CHECK(r.ops.name == "python (device 1)");  // the device with the most events
    CHECK(r.failures == 1);
    CHECK(r.unknown_frees == 0);
    CHECK(r.ops.streams == 2);
    CHECK(r.ops.peak_requested == 3000000 + 1024);
    CHECK(r.ops.ops.size() == 4);  // 3 allocations, 1 free (free_requested; free_completed is not a second free)
  }
  std::istringstream quiet(default_protocol);
  CHECK(read_pytorch_snapshot(quiet, "python", 0).ops.peak_requested == 64);
  std::istringstream beyond(default_protocol);
  CHECK_THROWS_WITH_AS(read_pytorch_snapshot(beyond, "python", 2),
                       "the snapshot has traces for 2 devices; device 2 was asked for", std::runtime_error);
}

TEST_CASE("replay: pickles that are not plain snapshots are refused, never executed") {
  const std::string script = R"(
import pickle, os, sys
base = sys.argv[0][:-3]
class Evil:
    def __reduce__(self):
        return (os.system, ('echo pwned',))
with open(base + '.evil', 'wb') as f: pickle.dump({'device_traces': [[Evil()]]}, f, protocol=4)
with open(base + '.empty', 'wb') as f: pickle.dump({'segments': []}, f, protocol=4)
with open(base + '.list', 'wb') as f: pickle.dump([1, 2], f, protocol=2)
with open(base + '.negative', 'wb') as f:
    pickle.dump({'device_traces': [[{'action': 'alloc', 'addr': -5, 'size': 8, 'stream': 0}]]}, f, protocol=4)
with open(base, 'wb') as f: pickle.dump(0, f)
)";
  const std::string base = "gpukit_replay_bad.pickle";
  (void)python_pickle(script, base);
  auto read = [&](const std::string& suffix) {
    std::ifstream in(base + suffix, std::ios::binary);
    REQUIRE(in.good());
    std::ostringstream data;
    data << in.rdbuf();
    std::remove((base + suffix).c_str());
    std::istringstream stream(data.str());
    return read_pytorch_snapshot(stream);
  };
  CHECK_THROWS_WITH_AS(read(".evil"), doctest::Contains("is not plain data"), std::runtime_error);
  CHECK_THROWS_WITH_AS(read(".empty"), doctest::Contains("has no device_traces"), std::runtime_error);
  CHECK_THROWS_WITH_AS(read(".list"), "not a memory snapshot: the pickle is not a dict", std::runtime_error);
  CHECK_THROWS_WITH_AS(read(".negative"), "device_traces[0][0].addr is negative", std::runtime_error);
  std::istringstream truncated(
      std::string("\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x05"
                  "ab",
                  17));
  CHECK_THROWS_WITH_AS(read_pytorch_snapshot(truncated), "pickle offset 15: truncated", std::runtime_error);
}

TEST_CASE("replay: the command-line tool reads a PyTorch snapshot pickle") {
  std::shared_ptr<gpukit::memory_history> history;
  (void)live_run(history);
  const std::string pickle = "gpukit_replay_test.pickle", out = "gpukit_replay_pickle.out";
  gpukit::dump_pytorch_snapshot(pickle, gpukit::allocator_snapshot{}, *history);
  const std::string command = std::string("\"") + GPUKIT_REPLAY_TOOL + "\" " + pickle + " --gpu big=81920 > " + out;
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find("(device 0)") != std::string::npos);
  CHECK(text.find("yes (") != std::string::npos);
  std::remove(pickle.c_str());
  std::remove(out.c_str());
}

TEST_CASE("replay: hostile pickles: deep nesting, a list that holds itself, a huge dict shared by every event") {
  // 200000 nested tuples: parsed without recursion, and freed without it (the values live in one arena).
  std::string deep = "\x80\x04)";
  deep.append(200000, '\x85');
  deep += '.';
  const pickle_document nested = unpickle(deep);
  REQUIRE(nested.root != nullptr);
  CHECK(nested.root->type == pickled::kind::tuple);
  CHECK(nested.values.size() == 200001);
  // ] MEMOIZE BINGET 0 APPEND STOP: a list that contains itself (the sanitizers' leak check would see a cycle).
  const pickle_document cycle =
      unpickle(std::string("\x80\x04]\x94h\x00"
                           "a.",
                           8));
  REQUIRE(cycle.root->items.size() == 1);
  CHECK(cycle.root->items[0] == cycle.root);
  // Every event the same dict of 100 keys (the memo makes that small): refused before any quadratic lookup.
  const std::string script = R"(
import pickle, sys
d = {('k%d' % i): i for i in range(100)}
d['action'] = 'alloc'
with open(sys.argv[0][:-3], 'wb') as f: pickle.dump({'device_traces': [[d] * 1000]}, f, protocol=4)
)";
  std::istringstream shared(python_pickle(script, "gpukit_replay_shared.pickle"));
  CHECK_THROWS_WITH_AS(read_pytorch_snapshot(shared), "device_traces[0][0] has 101 keys: not a memory event",
                       std::runtime_error);
}
