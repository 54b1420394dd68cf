// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Exports of a memory_history (and a snapshot) for the tools people already use:
///
/// - pytorch_snapshot_pickle / dump_pytorch_snapshot: the dictionary torch.cuda.memory._snapshot() returns
///   ("segments" with "blocks", "device_traces" with "action", "addr", "size", "stream", "time_us", "frames"), as a
///   pickle that PyTorch's memory viewer (pytorch.org/memory_viz) opens. A memory_tag shows as the single frame of
///   an event or block.
/// - rmm_log_csv: RMM's logging_resource_adaptor format (Thread,Time,Action,Pointer,Size,Stream), which RMM's
///   replay benchmark and gpukit_replay read.
/// - history_json: every event and the snapshot's segments, for scripts.
/// - live_allocations / leak_report: allocations the history saw made and not freed, grouped by tag and size;
///   report_leaks_at_exit prints the report when the process exits, if anything is still allocated.
///
///     auto history = gpukit::record_memory_history(d);
///     run_workload();
///     gpukit::dump_pytorch_snapshot("snapshot.pickle", gpukit::default_allocator(d).snapshot(), *history);

#include <gpukit/detail/config.hpp>
#include <gpukit/error.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/memory_history.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

GPUKIT_BEGIN_NAMESPACE

namespace detail {

/// Writes Python pickle protocol 2: dictionaries, lists, strings, non-negative integers, booleans, pairs. Like
/// Python's pickle, it appends to a list (APPENDS) and sets a dictionary's items (SETITEMS) in batches of at most
/// `batch` items: PyTorch's memory viewer (MemoryViz.js) pushes a whole batch as function arguments, which overflows
/// JavaScript's stack for some hundred thousand of them.
class pickle_writer {
 public:
  static constexpr std::size_t batch = 1000;  ///< as Python's pickle (pickle._BATCHSIZE)

  pickle_writer() { out_ += "\x80\x02"; }  // PROTO 2

  void begin_dict() { open('}', false); }  // EMPTY_DICT, MARK
  void end_dict() { close('u'); }          // SETITEMS
  void begin_list() { open(']', true); }   // EMPTY_LIST, MARK
  void end_list() { close('e'); }          // APPENDS

  /// A str (BINUNICODE); bytes that are not UTF-8 become '?'.
  void text(std::string_view s) {
    const std::string valid = utf8_or_question_marks(s);
    item();
    out_ += 'X';
    put_le(valid.size(), 4);
    out_ += valid;
  }
  /// An int: BININT up to 2^31 - 1, else LONG1 (little-endian two's complement).
  void integer(std::uint64_t v) {
    item();
    put_integer(v);
  }
  void boolean(bool b) {
    item();
    out_ += b ? '\x88' : '\x89';
  }
  /// A tuple of two ints (TUPLE2).
  void pair(std::uint64_t a, std::uint64_t b) {
    item();
    put_integer(a);
    put_integer(b);
    out_ += '\x86';
  }
  void key(std::string_view k) { text(k); }
  /// A dictionary item: key and value.
  void entry(std::string_view k, std::uint64_t v) {
    key(k);
    integer(v);
  }
  void entry(std::string_view k, const char* v) {
    key(k);
    text(v);
  }
  void entry(std::string_view k, const std::string& v) {
    key(k);
    text(v);
  }
  void entry_bool(std::string_view k, bool v) {
    key(k);
    boolean(v);
  }

  /// The pickle, ended with STOP.
  std::string finish() {
    out_ += '.';
    return std::move(out_);
  }

  /// `s` with every byte that is not part of a well-formed UTF-8 sequence (RFC 3629: no overlong forms, no
  /// surrogates, nothing above U+10FFFF) replaced by '?', so Python decodes it.
  static std::string utf8_or_question_marks(std::string_view s) {
    std::string r(s);
    const auto byte = [&r](std::size_t i) { return static_cast<unsigned char>(r[i]); };
    for (std::size_t i = 0; i < r.size();) {
      const unsigned char c = byte(i);
      std::size_t n = 0;
      unsigned char low = 0x80, high = 0xbf;  // the range of the second byte
      if (c < 0x80) {
        n = 1;
      } else if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
      } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        if (c == 0xe0) low = 0xa0;   // overlong
        if (c == 0xed) high = 0x9f;  // surrogates
      } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        if (c == 0xf0) low = 0x90;   // overlong
        if (c == 0xf4) high = 0x8f;  // above U+10FFFF
      }
      bool ok = n != 0 && i + n <= r.size();
      for (std::size_t k = 1; ok && k < n; ++k) {
        const unsigned char lo = k == 1 ? low : 0x80, hi = k == 1 ? high : 0xbf;
        ok = byte(i + k) >= lo && byte(i + k) <= hi;
      }
      if (!ok) {
        r[i] = '?';
        ++i;
      } else {
        i += n;
      }
    }
    return r;
  }

 private:
  struct open_container {
    bool list;
    std::size_t values;  // written since the last MARK (a dictionary's keys and values both count)
  };
  // Before each value: one that would make the open batch longer than `batch` items ends it and starts another.
  void item() {
    if (open_.empty()) return;
    open_container& c = open_.back();
    if (c.values == (c.list ? batch : 2 * batch)) {  // a dictionary's batch ends before a key, never inside an item
      out_ += c.list ? "e(" : "u(";                  // APPENDS / SETITEMS, MARK
      c.values = 0;
    }
    ++c.values;
  }
  void open(char empty, bool list) {
    item();
    out_ += empty;
    out_ += '(';
    open_.push_back(open_container{list, 0});
  }
  void close(char op) {
    out_ += op;
    open_.pop_back();
  }
  void put_integer(std::uint64_t v) {
    if (v <= 0x7fffffffu) {
      out_ += 'J';
      put_le(v, 4);
      return;
    }
    std::size_t n = 0;
    for (std::uint64_t x = v; x != 0; x >>= 8) ++n;
    const bool top_bit = ((v >> (8 * (n - 1))) & 0x80u) != 0;  // would read as negative: add a zero byte
    out_ += '\x8a';
    out_ += static_cast<char>(n + (top_bit ? 1 : 0));
    put_le(v, n);
    if (top_bit) out_ += '\0';
  }
  void put_le(std::uint64_t v, std::size_t bytes) {
    for (std::size_t i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xffu);
  }
  std::string out_;
  std::vector<open_container> open_;
};

inline std::string json_string(std::string_view s) {
  std::string r = "\"";
  for (const char c : pickle_writer::utf8_or_question_marks(s)) {
    switch (c) {
      case '"':
        r += "\\\"";
        break;
      case '\\':
        r += "\\\\";
        break;
      case '\n':
        r += "\\n";
        break;
      case '\r':
        r += "\\r";
        break;
      case '\t':
        r += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char u[8];
          std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(c));
          r += u;
        } else {
          r += c;
        }
    }
  }
  return r + "\"";
}

/// Throws the invalid_argument_error of `who` (an export, or the picture) when `place` says the history's ring dropped
/// the snapshot's own event, on which `what` is anchored: no trace cut elsewhere would be right.
inline void refuse_dropped_snapshot_event(const char* who, const char* what, const snapshot_event_place& place,
                                          const allocator_snapshot& snapshot, const memory_history_contents& contents) {
  if (place.kind != snapshot_event_place::dropped) return;
  throw invalid_argument_error(std::string(who) + ": the history no longer holds the snapshot's event (event " +
                               std::to_string(snapshot.history_position.recorded) + "; of " +
                               std::to_string(contents.recorded) + " events recorded, the first " +
                               std::to_string(contents.dropped) +
                               " were dropped): its ring is too small for what was recorded after the snapshot (give "
                               "the history more max_entries, or take the snapshot just before " +
                               what + ")");
}

/// A stream key as the viewer can read it: CPU streams' keys carry the top bit (cpu_stream_id_bit), which would make
/// a 9-byte integer, and the memory viewer's unpickler reads at most 8. CUDA streams' keys (cudaStreamGetId numbers)
/// are far below it.
inline std::uint64_t pytorch_stream(std::uint64_t key) noexcept { return key & ~(std::uint64_t{1} << 63); }

/// A stream key as a JSON value that readers taking numbers as doubles read exactly (below 2^53, RFC 8259 section 6):
/// null for a block of no stream (the allocator's no_stream_key: its stream was destroyed and its work is done); else
/// the key without the CPU-stream bit (as pytorch_stream), and with gpukit's own-id bit (bit 62, own_stream_id_bit:
/// ids gpukit gives streams CUDA would not name during a capture) moved down to bit 52, above any cudaStreamGetId
/// number, so that such ids stay apart from CUDA's and from one another.
inline std::string json_stream(std::uint64_t key) {
  constexpr std::uint64_t no_stream = ~std::uint64_t{0};        // caching_allocator::no_stream_key
  constexpr std::uint64_t own_id_bit = std::uint64_t{1} << 62;  // cuda_backend::own_stream_id_bit
  constexpr std::uint64_t below_bit_52 = (std::uint64_t{1} << 52) - 1;
  if (key == no_stream) return "null";
  return std::to_string((key & below_bit_52) | ((key & own_id_bit) != 0 ? below_bit_52 + 1 : 0));
}

inline const char* pytorch_block_state(block_state s) noexcept {
  switch (s) {
    case block_state::allocated:
      return "active_allocated";
    case block_state::pending:
      return "active_pending_free";
    default:
      return "inactive";  // free, or cached in a front cache (reusable)
  }
}

/// Writes `bytes` through `f` and closes it (with `sync`, flushed to the disk first: a full disk may show only there).
/// Returns 0, or the system's reason for the first failure (EIO when it set none).
inline int write_and_close(std::FILE* f, const std::string& bytes, bool sync) noexcept {
  errno = 0;
  bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
#if defined(__unix__) || defined(__APPLE__)
  if (written && sync) written = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
#else
  (void)sync;
#endif
  const int write_reason = errno;
  const bool closed = std::fclose(f) == 0;  // a full disk may show only here
  if (written && closed) return 0;
  const int reason = written ? errno : write_reason;
  return reason == 0 ? EIO : reason;  // a short write or a failed close that set no errno: still an I/O error
}

/// Writes `bytes` to `path`; throws std::system_error with the system's reason (errno, generic category), its text
/// naming the path. An I/O failure (a full disk, a missing directory) is not a bad argument: code() says which.
/// A regular file of the caller's with no other name, or a path where nothing is, is written to a new file beside it
/// that then replaces it, so a failed write leaves the old file (or none), not a truncated one. Anything else (a
/// device such as /dev/full, a FIFO, a symbolic link, a hard-linked file or another user's) is written in place, as is
/// a file in a directory where no new file can be made.
inline void write_file(const std::string& path, const std::string& bytes, const char* who) {
  const auto fail = [&](int reason) {
    throw std::system_error(
        reason, std::generic_category(),
        std::string(who) + ": writing " + std::to_string(bytes.size()) + " bytes to " + path + " failed");
  };
#if defined(__unix__) || defined(__APPLE__)
  struct ::stat now {};
  const bool exists = ::lstat(path.c_str(), &now) == 0;
  // A read-only file is refused as before (a rename would replace it). A file with other names (hard links) or of
  // another owner is written in place too: a new file would leave the links with the old bytes, change the owner,
  // or be refused (another user's file in a sticky directory such as /tmp).
  const bool replaceable = exists ? S_ISREG(now.st_mode) && now.st_nlink == 1 && now.st_uid == ::geteuid() &&
                                        ::access(path.c_str(), W_OK) == 0
                                  : errno == ENOENT;
  if (replaceable) {
    static std::atomic<unsigned> made{0};
    std::string temporary;
    int fd = -1;
    for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
      temporary = path + ".gpukit-" + std::to_string(::getpid()) + "-" + std::to_string(made.fetch_add(1)) + ".tmp";
      // 0666 less the umask, as fopen would create `path`; an existing file's permissions are copied below.
      fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno != EEXIST) break;
    }
    if (fd >= 0) {
      if (exists) (void)::fchmod(fd, now.st_mode & 07777);
      std::FILE* f = ::fdopen(fd, "wb");
      if (f == nullptr) {
        const int reason = errno;
        ::close(fd);
        ::unlink(temporary.c_str());
        fail(reason);
      }
      int reason = write_and_close(f, bytes, true);
      if (reason == 0 && std::rename(temporary.c_str(), path.c_str()) != 0) reason = errno == 0 ? EIO : errno;
      if (reason != 0) {
        ::unlink(temporary.c_str());
        fail(reason);
      }
      return;
    }
    // No new file in that directory (a missing one, or one not writable): in place, which says why if it fails.
  }
#endif
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    const int reason = errno;
    throw std::system_error(reason, std::generic_category(),
                            std::string(who) + ": cannot open " + path + " for writing");
  }
  if (const int reason = write_and_close(f, bytes, false); reason != 0) fail(reason);
}

}  // namespace detail

/// The snapshot and history as the pickle torch.cuda.memory._dump_snapshot() writes (see the file comment).
/// `device_traces` has one list per device up to the snapshot's; the history goes to the snapshot's device (the
/// CPU device counts as 0). The viewer replays the trace backwards from the snapshot's state, so the trace ends at
/// the snapshot's own `snapshot` event, which the allocator records when the snapshot is taken with the history
/// attached (allocator_snapshot::history_position): events after it (other threads' meanwhile, later work, later
/// snapshots) would undo blocks the snapshot does not hold. Throws invalid_argument_error when the history no longer
/// holds that event (its ring dropped it: more than max_entries events were recorded after the snapshot). A
/// snapshot taken with no history attached, another one, or before the history's clear() carries no position in it:
/// the trace then ends at the history's last `snapshot` event, or is the whole history when it holds none. Take the
/// snapshot last, with the history still attached.
///
/// An event's frames are one frame naming its memory_tag ("(untagged)" when it has none); an allocated block's, or
/// one whose free waits for other streams, the same from its alloc event, and none when the trace does not hold
/// that (the viewer then says it was allocated before the history began). The pages an expandable segment maps and
/// unmaps, and the mapped ranges it is shown as, have stream 0: the viewer merges adjacent ranges of one stream.
inline std::string pytorch_snapshot_pickle(const allocator_snapshot& snapshot, const memory_history& history) {
  memory_history_contents contents = history.contents();
  std::vector<memory_event>& events = contents.events;
  const detail::snapshot_event_place place = detail::find_snapshot_event(snapshot, contents);
  detail::refuse_dropped_snapshot_event("gpukit::pytorch_snapshot_pickle", "the export", place, snapshot, contents);
  if (place.kind == detail::snapshot_event_place::held) {
    events.erase(events.begin() + static_cast<std::ptrdiff_t>(place.index) + 1, events.end());
  } else {
    const auto last_snapshot = std::find_if(events.rbegin(), events.rend(),
                                            [](const memory_event& e) { return e.action == memory_action::snapshot; });
    if (last_snapshot != events.rend()) events.erase(last_snapshot.base(), events.end());  // keeps the snapshot event
  }
  const auto active = detail::active_allocations(events);  // allocated or pending at the snapshot
  const std::uint64_t device = snapshot.device.is_cuda() ? static_cast<std::uint64_t>(snapshot.device.ordinal()) : 0;
  detail::pickle_writer w;
  const auto frames = [&w](bool known, std::uint32_t tag) {
    w.key("frames");
    w.begin_list();
    if (known) {  // the tag as the one frame the viewer shows
      w.begin_dict();
      w.entry("filename", tag != 0 ? "gpukit::memory_tag" : "gpukit");
      w.entry("line", std::uint64_t{0});
      w.entry("name", tag != 0 ? memory_tag_name(tag) : std::string("(untagged)"));
      w.end_dict();
    }
    w.end_list();
  };
  // The bytes requested and the tag of an allocated block or one waiting for other streams, from its alloc event.
  const auto traced = [&active](const block_info& b) -> const detail::traced_allocation* {
    if (b.state != block_state::allocated && b.state != block_state::pending) return nullptr;
    const auto found = active.find(b.address);
    return found == active.end() ? nullptr : &found->second;
  };
  const auto requested_of = [&traced](const block_info& b) -> std::uint64_t {
    if (b.requested != 0 || b.state != block_state::pending) return b.requested;
    const detail::traced_allocation* t = traced(b);  // a snapshot may not keep a pending block's request
    return t != nullptr ? t->requested : 0;
  };
  w.begin_dict();
  w.key("segments");
  w.begin_list();
  // PyTorch shows an expandable segment as its mapped ranges, each a segment of the blocks (clipped) inside it.
  const auto write_segment = [&](const segment_info& seg, std::uintptr_t begin, std::uintptr_t end) {
    std::vector<block_info> blocks;
    for (const block_info& b : seg.blocks) {
      const std::uintptr_t from = std::max(b.address, begin), to = std::min(b.address + b.size, end);
      if (from >= to) continue;
      block_info clipped = b;
      clipped.address = from;
      clipped.size = to - from;
      clipped.requested = requested_of(b);
      blocks.push_back(clipped);
    }
    std::uint64_t allocated = 0, active_bytes = 0, requested = 0;
    for (const block_info& b : blocks) {
      if (b.state == block_state::allocated) allocated += b.size;
      if (b.state == block_state::allocated || b.state == block_state::pending) {
        active_bytes += b.size;
        requested += b.requested;
      }
    }
    w.begin_dict();
    w.entry("device", device);
    w.entry("address", begin);
    w.entry("total_size", end - begin);
    w.entry("allocated_size", allocated);
    w.entry("active_size", active_bytes);
    w.entry("requested_size", requested);
    // An expandable segment's ranges: the stream of its segment_map and segment_unmap events (below).
    w.entry("stream", seg.expandable || blocks.empty() ? 0 : detail::pytorch_stream(blocks.front().stream));
    w.entry("segment_type", seg.small_pool ? "small" : "large");
    w.key("segment_pool_id");
    w.pair(0, 0);
    w.entry_bool("is_expandable", seg.expandable);
    frames(false, 0);
    w.key("blocks");
    w.begin_list();
    for (const block_info& b : blocks) {
      w.begin_dict();
      w.entry("address", b.address);
      w.entry("size", b.size);
      w.entry("requested_size", b.requested);
      w.entry("state", detail::pytorch_block_state(b.state));
      const detail::traced_allocation* t = traced(b);
      frames(t != nullptr, t != nullptr ? t->tag : 0);
      w.end_dict();
    }
    w.end_list();
    w.end_dict();
  };
  for (const segment_info& seg : snapshot.segments) {
    if (!seg.expandable) {
      write_segment(seg, seg.address, seg.address + seg.size);
      continue;
    }
    for (const auto& range : seg.mapped_ranges) write_segment(seg, range.first, range.first + range.second);
  }
  w.end_list();
  w.key("device_traces");
  w.begin_list();
  for (std::uint64_t d = 0; d <= device; ++d) {
    w.begin_list();
    if (d == device) {
      for (const memory_event& e : events) {
        w.begin_dict();
        w.entry("action", memory_action_name(e.action));
        if (e.action == memory_action::oom) {
          w.entry("device_free", e.device_free);
        } else {
          w.entry("addr", e.address);
        }
        w.entry("size", e.size);
        const bool pages = e.action == memory_action::segment_map || e.action == memory_action::segment_unmap;
        w.entry("stream", pages ? 0 : detail::pytorch_stream(e.stream));
        w.key("time_us");
        const std::int64_t us = history.unix_time_us(e);
        w.integer(us < 0 ? 0 : static_cast<std::uint64_t>(us));
        frames(true, e.tag);
        w.end_dict();
      }
    }
    w.end_list();
  }
  w.end_list();
  w.end_dict();
  return w.finish();
}

/// Writes pytorch_snapshot_pickle to `path`. Throws std::system_error when it cannot (code(): the system's reason,
/// e.g. std::errc::no_space_on_device; what(): the path and that reason). A failed write leaves a regular file at
/// `path` as it was, or no file where there was none: the pickle goes to a new file beside it, which then replaces
/// it. A device or a FIFO (e.g. /dev/stdout) is written in place.
inline void dump_pytorch_snapshot(const std::string& path, const allocator_snapshot& snapshot,
                                  const memory_history& history) {
  detail::write_file(path, pytorch_snapshot_pickle(snapshot, history), "gpukit::dump_pytorch_snapshot");
}

/// Whether rmm_log_csv writes a row for each out-of-memory failure.
enum class rmm_failure_rows {
  omit,     ///< none: RMM's replay benchmark accepts only "allocate" and "free" rows
  include,  ///< "allocate failure" rows, as RMM's logging_resource_adaptor writes them (gpukit_replay counts them)
};

/// The allocations and frees of the history in RMM's log format: "Thread,Time,Action,Pointer,Size,Stream", one row
/// per alloc ("allocate") and free_requested ("free"), and with rmm_failure_rows::include one per oom ("allocate
/// failure", pointer 0x0); Time is the UTC time of day as HH:MM:SS:microseconds, Stream the allocator's stream key
/// in decimal.
inline std::string rmm_log_csv(const memory_history& history, rmm_failure_rows failures = rmm_failure_rows::omit) {
  const bool with_failures = failures == rmm_failure_rows::include;
  std::string out = "Thread,Time,Action,Pointer,Size,Stream\n";
  for (const memory_event& e : history.events()) {
    const char* action = e.action == memory_action::alloc                  ? "allocate"
                         : e.action == memory_action::free_requested       ? "free"
                         : e.action == memory_action::oom && with_failures ? "allocate failure"
                                                                           : nullptr;
    if (action == nullptr) continue;
    const std::int64_t us = history.unix_time_us(e);
    const std::int64_t of_day = ((us % 86400000000LL) + 86400000000LL) % 86400000000LL;
    char row[160];
    std::snprintf(row, sizeof row, "%llu,%02lld:%02lld:%02lld:%06lld,%s,0x%llx,%zu,%llu\n",
                  static_cast<unsigned long long>(e.thread), static_cast<long long>(of_day / 3600000000LL),
                  static_cast<long long>(of_day / 60000000LL % 60), static_cast<long long>(of_day / 1000000LL % 60),
                  static_cast<long long>(of_day % 1000000LL), action, static_cast<unsigned long long>(e.address),
                  e.size, static_cast<unsigned long long>(e.stream));
    out += row;
  }
  return out;
}

/// The history (and, when given, a snapshot's segments) as JSON: {"recorded", "dropped", "events": [{"action",
/// "address", "size", "stream", "time_us", "thread", "tag"}, ...], "segments": [...]}. Every number is below 2^53, so
/// that readers that take JSON numbers as doubles (JavaScript, jq) read them exactly (RFC 8259, section 6): streams
/// as detail::json_stream writes them (null for a block of no stream; one history has one device's streams, so they
/// stay distinct), and thread numbers in their low 53 bits.
inline std::string history_json(const memory_history& history, const allocator_snapshot* snapshot = nullptr) {
  const memory_history_contents contents = history.contents();
  std::string out = "{\"recorded\":" + std::to_string(contents.recorded) +
                    ",\"dropped\":" + std::to_string(contents.dropped) + ",\"events\":[";
  bool first = true;
  for (const memory_event& e : contents.events) {
    out += first ? "" : ",";
    first = false;
    out += "{\"action\":\"" + std::string(memory_action_name(e.action)) +
           "\",\"address\":" + std::to_string(e.address) + ",\"size\":" + std::to_string(e.size) +
           ",\"stream\":" + detail::json_stream(e.stream) + ",\"time_us\":" + std::to_string(history.unix_time_us(e)) +
           ",\"thread\":" + std::to_string(e.thread & ((std::uint64_t{1} << 53) - 1));
    if (e.tag != 0) out += ",\"tag\":" + detail::json_string(memory_tag_name(e.tag));
    if (e.action == memory_action::oom) out += ",\"device_free\":" + std::to_string(e.device_free);
    out += "}";
  }
  out += "]";
  if (snapshot != nullptr) {
    out += ",\"device\":" + detail::json_string(snapshot->device.to_string()) + ",\"segments\":[";
    for (std::size_t i = 0; i < snapshot->segments.size(); ++i) {
      const segment_info& seg = snapshot->segments[i];
      out += i == 0 ? "" : ",";
      out += "{\"address\":" + std::to_string(seg.address) + ",\"size\":" + std::to_string(seg.size) +
             ",\"mapped\":" + std::to_string(seg.mapped) + ",\"expandable\":" + (seg.expandable ? "true" : "false") +
             ",\"pool\":\"" + (seg.small_pool ? "small" : "large") + "\",\"blocks\":[";
      for (std::size_t k = 0; k < seg.blocks.size(); ++k) {
        const block_info& b = seg.blocks[k];
        out += k == 0 ? "" : ",";
        out += "{\"address\":" + std::to_string(b.address) + ",\"size\":" + std::to_string(b.size) +
               ",\"requested\":" + std::to_string(b.requested) + ",\"state\":\"" +
               detail::pytorch_block_state(b.state) + "\",\"stream\":" + detail::json_stream(b.stream) + "}";
      }
      out += "]}";
    }
    out += "]";
  }
  return out + "}";
}

/// Allocations of one tag and size that the history saw made and not freed.
struct live_allocation_group {
  std::string tag;        ///< "" when untagged
  std::size_t size = 0;   ///< the bytes requested by each allocation
  std::size_t count = 0;  ///< how many such allocations are live
  std::size_t bytes = 0;  ///< size × count
};

namespace detail {
/// live_allocations of these events.
inline std::vector<live_allocation_group> live_allocations_of(const std::vector<memory_event>& events) {
  std::unordered_map<std::uintptr_t, std::pair<std::uint32_t, std::size_t>> live;  // address -> (tag, size)
  for (const memory_event& e : events) {
    if (e.action == memory_action::alloc) live[e.address] = {e.tag, e.size};
    if (e.action == memory_action::free_requested) live.erase(e.address);
  }
  std::map<std::pair<std::uint32_t, std::size_t>, std::size_t> counts;
  for (const auto& entry : live) ++counts[entry.second];
  std::vector<live_allocation_group> groups;
  for (const auto& c : counts) {
    groups.push_back({memory_tag_name(c.first.first), c.first.second, c.second, c.first.second * c.second});
  }
  std::sort(groups.begin(), groups.end(), [](const live_allocation_group& a, const live_allocation_group& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : (a.tag != b.tag ? a.tag < b.tag : a.size < b.size);
  });
  return groups;
}
}  // namespace detail

/// The history's allocations not freed by its end, grouped by tag and size, largest total first. Allocations made
/// before the history began, or whose alloc event the ring dropped, are not seen.
inline std::vector<live_allocation_group> live_allocations(const memory_history& history) {
  return detail::live_allocations_of(history.events());
}

/// live_allocations as a table: one line per group, then the total.
inline std::string leak_report(const memory_history& history) {
  const memory_history_contents contents = history.contents();
  const auto groups = detail::live_allocations_of(contents.events);
  std::size_t total = 0, count = 0;
  std::string out;
  for (const live_allocation_group& g : groups) {
    // Written to a terminal or a log: bytes that are not UTF-8, and control characters, become '?'.
    std::string tag = g.tag.empty() ? "(untagged)" : detail::pickle_writer::utf8_or_question_marks(g.tag);
    for (char& c : tag) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
    if (tag.size() < 24) tag.resize(24, ' ');
    char figures[96];
    std::snprintf(figures, sizeof figures, " %12zu B x %-8zu = %zu B\n", g.size, g.count, g.bytes);
    out += "  " + tag + figures;
    total += g.bytes;
    count += g.count;
  }
  std::string head =
      "live allocations seen by the history: " + std::to_string(count) + " (" + std::to_string(total) + " B)";
  if (contents.dropped != 0) head += "; " + std::to_string(contents.dropped) + " older events were dropped";
  return head + "\n" + out;
}

namespace detail {

struct leak_watch {
  std::shared_ptr<const memory_history> history;
  std::string label;
  std::FILE* out;
};
struct leak_watch_registry {
  std::mutex mutex;
  std::vector<leak_watch> watches;
  bool handler_registered = false;
};
// Never destroyed: the handler runs during exit, after function-local statics may have been destroyed.
GPUKIT_EXPORT inline leak_watch_registry& leak_watches() {
  static leak_watch_registry* registry = new leak_watch_registry();
  return *registry;
}

// The std::atexit handler: reads the histories (no CUDA call) and writes a report for each that saw leaks.
inline void report_leaks_now() noexcept {
  std::vector<leak_watch> watches;
  {
    std::lock_guard<std::mutex> lock(leak_watches().mutex);
    watches.swap(leak_watches().watches);
  }
  for (std::size_t i = 0; i < watches.size(); ++i) {
    const leak_watch& w = watches[i];
    bool repeated = false;  // the same history registered twice is reported once
    for (std::size_t j = 0; j < i; ++j) repeated = repeated || watches[j].history == w.history;
    if (repeated) continue;
    try {
      const std::string report = leak_report(*w.history);  // one read of the history: it may still be changing
      if (report.rfind("live allocations seen by the history: 0 ", 0) == 0) continue;
      const std::string text = "gpukit: still allocated at exit (" + w.label + "): " + report;
      std::fputs(text.c_str(), w.out);
      std::fflush(w.out);
    } catch (...) {  // out of memory while reporting: nothing to be done at exit
    }
  }
}

}  // namespace detail

/// At process exit (std::atexit), writes leak_report(*history) to `out`, headed by `label`, if the history saw
/// allocations that were never freed; writes nothing when everything was freed. Makes no CUDA call. Objects that
/// are still alive when the handler runs count as leaks: those with static storage created before the first call
/// here are destroyed after it (std::atexit's order), so call it early, e.g. right after record_memory_history. A
/// history registered twice is reported once; one registered after the report ran (during exit) is not reported.
///
///     gpukit::report_leaks_at_exit(gpukit::record_memory_history(d), "cuda:0");
inline void report_leaks_at_exit(std::shared_ptr<const memory_history> history, std::string label = "memory history",
                                 std::FILE* out = stderr) {
  if (!history) throw invalid_argument_error("gpukit::report_leaks_at_exit: the history is null");
  if (out == nullptr) throw invalid_argument_error("gpukit::report_leaks_at_exit: the output stream is null");
  auto& registry = detail::leak_watches();
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (!registry.handler_registered) {
    if (std::atexit(&detail::report_leaks_now) != 0) {
      throw out_of_memory_error("gpukit::report_leaks_at_exit: std::atexit could not register the report");
    }
    registry.handler_registered = true;
  }
  registry.watches.push_back(detail::leak_watch{std::move(history), std::move(label), out});
}

GPUKIT_END_NAMESPACE
