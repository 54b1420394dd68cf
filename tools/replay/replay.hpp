// gpukit_replay's engine: reads a recorded allocation history (RMM's CSV log, which gpukit's rmm_log_csv writes,
// gpukit's history JSON, or a PyTorch memory snapshot pickle, which torch.cuda.memory._dump_snapshot and gpukit's
// dump_pytorch_snapshot write), replays it through gpukit's caching allocator over a capacity-limited address space,
// and answers "will it fit": the smallest device capacity on which it runs (binary search), under gpukit's defaults and
// under PyTorch's rules (bench/pytorch_allocator_model.hpp), for a table of GPUs.
#pragma once

#include "alloc_traces.hpp"
#include "pickle_reader.hpp"
#include "pytorch_allocator_model.hpp"

#include <gpukit/memory/caching_allocator.hpp>
#include <gpukit/memory/upstream.hpp>
#include <gpukit/stream/stream.hpp>
#include <gpukit/memory/caching_allocator_impl.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpukit_replay {

using gpukit_bench::GiB;
using gpukit_bench::MiB;
using gpukit_bench::trace;

/// A recorded history as a trace: allocations and frees in order, each on one of `streams` streams (numbered in
/// order of first use). Frees of pointers the history never saw allocated (made before it began) are skipped and
/// counted.
struct recorded_trace {
  trace ops;
  std::size_t unknown_frees = 0;
  std::size_t failures = 0;  ///< "allocate failure" rows (out of memory in the recorded run)
};

namespace detail {

class trace_assembler {
 public:
  void alloc(std::uintptr_t pointer, std::size_t bytes, std::uintptr_t stream) {
    if (bytes == 0) return;
    if (bytes > (std::size_t{1} << 50)) {
      throw std::runtime_error("an allocation of " + std::to_string(bytes) + " bytes: more than any device holds");
    }
    const auto s = stream_index(stream);
    live_[pointer] = builder_.alloc(bytes, s);
  }
  void free(std::uintptr_t pointer) {
    const auto it = live_.find(pointer);
    if (it == live_.end()) {
      ++result_.unknown_frees;
      return;
    }
    builder_.free(it->second);
    live_.erase(it);
  }
  void failure() { ++result_.failures; }
  recorded_trace finish(const std::string& name) {
    result_.ops = builder_.finish();
    result_.ops.name = name;
    result_.ops.warmup_ops = 0;
    return std::move(result_);
  }

 private:
  std::uint8_t stream_index(std::uintptr_t stream) {
    const auto found = streams_.find(stream);
    if (found != streams_.end()) return found->second;
    // More than 255 streams share the last index (their order is kept; only reuse across them is approximated).
    const auto index = static_cast<std::uint8_t>(std::min<std::size_t>(streams_.size(), 255));
    streams_.emplace(stream, index);
    return index;
  }
  gpukit_bench::trace_builder builder_{"recorded"};
  std::unordered_map<std::uintptr_t, std::uint32_t> live_;
  std::unordered_map<std::uintptr_t, std::uint8_t> streams_;
  recorded_trace result_;
};

inline std::uintptr_t parse_number(const std::string& text, int base, const std::string& what, std::size_t line) {
  try {
    if (text.empty() || text[0] == '-' || text[0] == '+' || text[0] == ' ') throw std::invalid_argument(text);
    std::size_t used = 0;
    const unsigned long long v = std::stoull(text, &used, base);
    if (used != text.size()) throw std::invalid_argument(text);
    return static_cast<std::uintptr_t>(v);
  } catch (const std::exception&) {
    throw std::runtime_error("line " + std::to_string(line) + ": " + what + " \"" + text + "\" is not a number");
  }
}

/// The number after `"key":` in `object` (gpukit's history JSON writes numbers plainly).
inline bool json_number(const std::string& object, const char* key, std::uintptr_t& out) {
  const std::string k = std::string("\"") + key + "\":";
  const std::size_t at = object.find(k);
  if (at == std::string::npos) return false;
  if (object.compare(at + k.size(), 4, "null") == 0) {  // a stream key: a block of no stream
    out = ~std::uintptr_t{0};
    return true;
  }
  out = static_cast<std::uintptr_t>(std::stoull(object.substr(at + k.size())));
  return true;
}

}  // namespace detail

/// Parses RMM's log: a header naming at least Action, Pointer, Size and Stream; actions allocate, free and
/// "allocate failure". Throws std::runtime_error naming the line of a malformed row.
inline recorded_trace read_rmm_csv(std::istream& in, const std::string& name = "recorded") {
  std::string line;
  if (!std::getline(in, line)) throw std::runtime_error("empty log: no header line");
  if (!line.empty() && line.back() == '\r') line.pop_back();  // a log written on Windows
  std::vector<std::string> header;
  {
    std::stringstream h(line);
    for (std::string cell; std::getline(h, cell, ',');) header.push_back(cell);
  }
  const auto column = [&](const char* label) {
    const auto it = std::find(header.begin(), header.end(), label);
    if (it == header.end()) throw std::runtime_error(std::string("the header lacks the column ") + label);
    return static_cast<std::size_t>(it - header.begin());
  };
  const std::size_t action = column("Action"), pointer = column("Pointer"), size = column("Size"),
                    stream = column("Stream");
  detail::trace_assembler a;
  for (std::size_t number = 2; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    std::vector<std::string> cells;
    std::stringstream row(line);
    for (std::string cell; std::getline(row, cell, ',');) cells.push_back(cell);
    if (cells.size() < header.size()) throw std::runtime_error("line " + std::to_string(number) + ": too few columns");
    const std::string& act = cells[action];
    if (act == "allocate failure") {
      a.failure();
      continue;
    }
    const std::string& p = cells[pointer];
    const std::uintptr_t address =
        p == "(nil)" ? 0 : detail::parse_number(p.rfind("0x", 0) == 0 ? p.substr(2) : p, 16, "pointer", number);
    if (act == "allocate") {
      a.alloc(address, detail::parse_number(cells[size], 10, "size", number),
              detail::parse_number(cells[stream], 10, "stream", number));
    } else if (act == "free") {
      a.free(address);
    } else {
      throw std::runtime_error("line " + std::to_string(number) + ": unknown action \"" + act + "\"");
    }
  }
  return a.finish(name);
}

/// Parses gpukit's history JSON (history_json): its alloc, free_requested and oom events.
inline recorded_trace read_history_json(std::istream& in, const std::string& name = "recorded") {
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t events = text.find("\"events\":[");
  if (events == std::string::npos) throw std::runtime_error("not a gpukit history: no \"events\" array");
  detail::trace_assembler a;
  // Each event is a flat object; a '}' or '{' inside a string (a tag) is not a boundary.
  std::size_t at = events + 10;
  while (at < text.size()) {
    while (at < text.size() && (text[at] == ',' || text[at] == ' ' || text[at] == '\n')) ++at;
    if (at >= text.size() || text[at] != '{') break;  // the end of the events array
    std::size_t end = at + 1;
    bool in_string = false;
    for (; end < text.size(); ++end) {
      const char c = text[end];
      if (in_string) {
        if (c == '\\') {
          ++end;
        } else if (c == '"') {
          in_string = false;
        }
      } else if (c == '"') {
        in_string = true;
      } else if (c == '}') {
        break;
      }
    }
    if (end >= text.size()) throw std::runtime_error("a history event is not terminated");
    const std::string object = text.substr(at, end - at + 1);
    std::uintptr_t address = 0, size = 0, stream = 0;
    detail::json_number(object, "address", address);
    detail::json_number(object, "size", size);
    detail::json_number(object, "stream", stream);
    if (object.rfind("{\"action\":\"alloc\"", 0) == 0) a.alloc(address, size, stream);
    if (object.rfind("{\"action\":\"free_requested\"", 0) == 0) a.free(address);
    if (object.rfind("{\"action\":\"oom\"", 0) == 0) a.failure();
    at = end + 1;
  }
  return a.finish(name);
}

/// Parses a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes after
/// _record_memory_history, or gpukit's dump_pytorch_snapshot): the "device_traces" of `device`, or of the device with
/// the most events when `device` is -1. Its alloc and free_requested events (free_completed where a trace has no
/// free_requested), and oom. Throws std::runtime_error for a snapshot without traces or a malformed one.
inline recorded_trace read_pytorch_snapshot(std::istream& in, const std::string& name = "recorded", int device = -1) {
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const pickle_document document = unpickle(data);
  const pickled* root = document.root;
  if (root->type != pickled::kind::dict) throw std::runtime_error("not a memory snapshot: the pickle is not a dict");
  const pickled* traces = root->find("device_traces");
  if (traces == nullptr || traces->type != pickled::kind::list) {
    throw std::runtime_error(
        "the snapshot has no device_traces: record it with "
        "torch.cuda.memory._record_memory_history() before dumping");
  }
  if (device < -1) throw std::runtime_error("device " + std::to_string(device) + " was asked for");
  if (device >= static_cast<int>(traces->items.size())) {
    throw std::runtime_error("the snapshot has traces for " + std::to_string(traces->items.size()) +
                             " devices; device " + std::to_string(device) + " was asked for");
  }
  if (device < 0) {
    std::size_t most = 0;
    for (std::size_t d = 0; d < traces->items.size(); ++d) {
      if (traces->items[d]->type == pickled::kind::list && traces->items[d]->items.size() > most) {
        most = traces->items[d]->items.size();
        device = static_cast<int>(d);
      }
    }
    if (device < 0) throw std::runtime_error("the snapshot's device_traces are all empty");
  }
  const pickled& events = *traces->items[static_cast<std::size_t>(device)];
  if (events.type != pickled::kind::list)
    throw std::runtime_error("device_traces[" + std::to_string(device) + "] is not a list");
  auto text_of = [](const pickled* v) {
    return v != nullptr && v->type == pickled::kind::string ? v->text : std::string();
  };
  // An event is a dict of a handful of keys; a huge dict shared by every event (through the memo) would make the
  // lookups quadratic, so larger ones are refused before any lookup.
  constexpr std::size_t most_keys = 64;
  bool has_free_requested = false;
  for (std::size_t i = 0; i < events.items.size(); ++i) {
    const pickled* e = events.items[i];
    const std::string where = "device_traces[" + std::to_string(device) + "][" + std::to_string(i) + "]";
    if (e->type != pickled::kind::dict) throw std::runtime_error(where + " is not a dict");
    if (e->entries.size() > most_keys) {
      throw std::runtime_error(where + " has " + std::to_string(e->entries.size()) + " keys: not a memory event");
    }
    has_free_requested = has_free_requested || text_of(e->find("action")) == "free_requested";
  }
  const char* free_action = has_free_requested ? "free_requested" : "free_completed";
  detail::trace_assembler a;
  std::size_t index = 0;
  for (const auto& e : events.items) {
    const std::string where = "device_traces[" + std::to_string(device) + "][" + std::to_string(index++) + "]";
    const std::string action = text_of(e->find("action"));
    auto number = [&](const char* key) -> std::uintptr_t {
      const pickled* v = e->find(key);
      if (v == nullptr) throw std::runtime_error(where + " has no \"" + key + "\"");
      return static_cast<std::uintptr_t>(v->as_unsigned((where + "." + key).c_str()));
    };
    if (action == "alloc") {
      a.alloc(number("addr"), number("size"), e->find("stream") != nullptr ? number("stream") : 0);
    } else if (action == free_action) {
      a.free(number("addr"));
    } else if (action == "oom") {
      a.failure();
    }
  }
  return a.finish(name + " (device " + std::to_string(device) + ")");
}

/// Reads a file in any of the formats: a pickle (starts with the PROTO opcode 0x80), gpukit's JSON (starts with '{'),
/// else RMM's CSV log.
inline recorded_trace read_trace_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  const int first = in.peek();
  if (first == 0x80) return read_pytorch_snapshot(in, path);
  return first == '{' ? read_history_json(in, path) : read_rmm_csv(in, path);
}

/// One replay through gpukit's engine on an address space of `capacity` bytes.
struct replay_result {
  bool completed = true;  ///< false: out of memory; the replay stopped there
  std::size_t peak_requested = 0;
  std::size_t peak_reserved = 0;
  std::size_t upstream_allocs = 0;
  std::size_t upstream_frees = 0;
  /// (operation index, requested bytes live, reserved bytes, largest free block) at up to 20 points.
  struct sample {
    std::size_t op = 0, requested = 0, reserved = 0, largest_free = 0;
  };
  std::vector<sample> timeline;
};

using engine = gpukit::basic_caching_allocator<gpukit::address_space_upstream>;

/// Replays `t` through gpukit's engine with `options` on `capacity` bytes, each recorded stream on a CPU stream of
/// its own (streams keep their own free blocks, as on the GPU).
inline replay_result replay_gpukit(const trace& t, const gpukit::allocator_options& options, std::size_t capacity,
                                   bool with_timeline = false) {
  engine a(gpukit::device::cpu(), options, capacity);
  std::vector<std::unique_ptr<gpukit::stream>> streams;
  for (int i = 0; i < t.streams; ++i) streams.push_back(std::make_unique<gpukit::stream>(gpukit::device::cpu()));
  std::vector<void*> pointers(t.ids, nullptr);
  replay_result r;
  std::size_t live = 0;
  const std::size_t every = std::max<std::size_t>(1, t.ops.size() / 20);
  for (std::size_t i = 0; i < t.ops.size(); ++i) {
    const auto& op = t.ops[i];
    if (op.allocate) {
      try {
        pointers[op.id] = a.allocate(op.bytes, *streams[op.stream]);
      } catch (const gpukit::out_of_memory_error&) {
        r.completed = false;
        break;
      }
      live += op.bytes;
      r.peak_requested = std::max(r.peak_requested, live);
    } else {
      a.deallocate(pointers[op.id]);
      pointers[op.id] = nullptr;
      live -= op.bytes;
    }
    if (with_timeline && (i % every == every - 1 || i + 1 == t.ops.size())) {
      r.timeline.push_back({i + 1, live, a.memory_reserved(), a.free_space().largest_free_block});
    }
  }
  const auto s = a.stats();
  r.peak_reserved = static_cast<std::size_t>(s.reserved_bytes.all().peak);
  r.upstream_allocs = static_cast<std::size_t>(s.num_device_alloc);
  r.upstream_frees = static_cast<std::size_t>(s.num_device_free);
  for (void* p : pointers) {
    if (p != nullptr) a.deallocate(p);
  }
  return r;
}

/// The same trace under PyTorch's rules (one stream: the model has no streams).
inline bool runs_under_pytorch(const trace& t, std::size_t capacity) {
  gpukit_bench::pytorch_allocator_model m(capacity);
  std::vector<void*> pointers(t.ids, nullptr);
  std::vector<std::size_t> sizes(t.ids, 0);
  bool ok = true;
  for (const auto& op : t.ops) {
    if (op.allocate) {
      pointers[op.id] = m.allocate(op.bytes);
      sizes[op.id] = op.bytes;
      if (pointers[op.id] == nullptr) {
        ok = false;
        break;
      }
    } else {
      m.deallocate(pointers[op.id], op.bytes);
      pointers[op.id] = nullptr;
    }
  }
  for (std::size_t id = 0; id < t.ids; ++id) {
    if (pointers[id] != nullptr) m.deallocate(pointers[id], sizes[id]);
  }
  return ok;
}

/// The smallest capacity (to 64 KiB or 0.1 % of the peak) on which `runs` succeeds: a binary search between the peak
/// requested (too small unless nothing is allocated) and a capacity that runs.
/// Throws std::runtime_error when it does not run even on max_capacity (the address space replays use).
constexpr std::size_t max_capacity = std::size_t{1} << 46;

template <class Runs>
std::size_t minimum_capacity(const trace& t, Runs&& runs) {
  if (t.peak_requested == 0) return 0;
  if (t.peak_requested >= max_capacity || !runs(max_capacity)) {
    throw std::runtime_error("the history does not run even on " + std::to_string(max_capacity >> 30) +
                             " GiB (peak requested " + std::to_string(t.peak_requested) + " bytes)");
  }
  const std::size_t resolution = std::max<std::size_t>(64 * 1024, t.peak_requested / 1000);
  std::size_t fails = t.peak_requested - 1;
  std::size_t succeeds = std::min(max_capacity, 2 * t.peak_requested + 64 * MiB);
  while (!runs(succeeds)) {
    fails = succeeds;
    succeeds = std::min(max_capacity, succeeds + succeeds / 2);
  }
  while (succeeds - fails > resolution) {
    const std::size_t mid = fails + (succeeds - fails) / 2;
    if (runs(mid)) {
      succeeds = mid;
    } else {
      fails = mid;
    }
  }
  return succeeds;
}

/// A GPU and the memory the runtime reports as its total (nvidia-smi's "Total", MiB).
struct gpu_model {
  std::string name;
  std::size_t total_mib;
};

/// Common GPUs with their nominal memory as nvidia-smi reports it; override or extend with --gpu NAME=MIB.
inline std::vector<gpu_model> common_gpus() {
  return {{"T4 16GB", 15360},   {"L4 24GB", 23034},     {"RTX 4090 24GB", 24564}, {"A10G 24GB", 23028},
          {"V100 32GB", 32768}, {"A100 40GB", 40960},   {"L40S 48GB", 46068},     {"A100 80GB", 81920},
          {"H100 80GB", 81559}, {"H200 141GB", 143771}, {"B200 180GB", 184320}};
}

}  // namespace gpukit_replay
