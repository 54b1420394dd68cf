// gpukit — header-only CUDA device and memory management.
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// memory_picture_html: a snapshot and a memory_history as one self-contained HTML page (inline SVG, no script, no
/// network): a timeline of allocated against reserved bytes and the largest free block over the history, and every
/// segment as a bar (an expandable one as a bar per mapped range) whose blocks are coloured by state (allocated,
/// waiting for other streams, free); hovering a block shows its address, size, requested bytes, stream and tag.
///
///     std::ofstream("memory.html") << gpukit::memory_picture_html(allocator.snapshot(), *history);
///
/// Elements carry classes for tools and tests: `segment` (one per segment, with data-address and data-size; an
/// expandable segment has one per mapped range, with data-segment and data-reserved: the segment's address and
/// reserved bytes), `block` (one per block, or per part of a block in a mapped range, with data-state) and the
/// polylines `allocated`, `reserved` and `largest_free`.

#include <gpukit/detail/config.hpp>
#include <gpukit/detail/format.hpp>
#include <gpukit/memory/allocator_snapshot.hpp>
#include <gpukit/memory/history_export.hpp>
#include <gpukit/memory/memory_history.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

GPUKIT_BEGIN_NAMESPACE

namespace detail {

/// `s` as HTML text or a quoted attribute's value: valid UTF-8 (bytes that are not become '?', as in the JSON and
/// pickle exports), without the control characters HTML does not allow in a document (C0 but tab, line feed and
/// carriage return; DEL; C1), and with & < > " escaped.
inline std::string html_escape(std::string_view s) {
  const std::string valid = pickle_writer::utf8_or_question_marks(s);
  std::string r;
  for (std::size_t i = 0; i < valid.size(); ++i) {
    const char c = valid[i];
    const auto byte = static_cast<unsigned char>(c);
    if ((byte < 0x20 && c != '\t' && c != '\n' && c != '\r') || byte == 0x7f) continue;
    if (byte == 0xc2 && i + 1 < valid.size() && static_cast<unsigned char>(valid[i + 1]) < 0xa0) {  // U+0080-U+009F
      ++i;
      continue;
    }
    switch (c) {
      case '&':
        r += "&amp;";
        break;
      case '<':
        r += "&lt;";
        break;
      case '>':
        r += "&gt;";
        break;
      case '"':
        r += "&quot;";
        break;
      default:
        r += c;
    }
  }
  return r;
}

inline std::string fixed(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", v);
  return text;
}

/// Allocated (requested) and reserved bytes after each event. The history may begin after the allocator did, so the
/// levels are anchored on the snapshot: its totals hold just after its own `snapshot` event (recorded under the
/// allocator's lock; allocator_snapshot::history_position), or, when the history does not hold that, after its last
/// `snapshot` event, or after the last event when it holds none; the levels before are walked back through the
/// events, those after forward.
struct memory_levels {
  std::vector<std::int64_t> allocated, reserved;
};

inline void level_change(const memory_event& e, std::int64_t& allocated, std::int64_t& reserved) noexcept {
  const auto size = static_cast<std::int64_t>(e.size);
  switch (e.action) {
    case memory_action::alloc:
      allocated += size;
      break;
    case memory_action::free_requested:
      allocated -= size;
      break;
    case memory_action::segment_alloc:
    case memory_action::segment_map:
      reserved += size;
      break;
    case memory_action::segment_free:
    case memory_action::segment_unmap:
      reserved -= size;
      break;
    default:
      break;
  }
}

/// `place`: where the snapshot's own event is among `events` (find_snapshot_event), when known; else the levels are
/// anchored at the last `snapshot` event.
inline memory_levels levels_of(const std::vector<memory_event>& events, const allocator_snapshot& snapshot,
                               const snapshot_event_place& place = {}) {
  std::int64_t allocated = 0, reserved = 0;
  for (const segment_info& seg : snapshot.segments) {
    reserved += static_cast<std::int64_t>(seg.mapped);
    for (const block_info& b : seg.blocks) {  // a pending block's free_requested is already in the events
      if (b.state == block_state::allocated) allocated += static_cast<std::int64_t>(b.requested);
    }
  }
  memory_levels l;
  l.allocated.resize(events.size());
  l.reserved.resize(events.size());
  if (events.empty()) return l;
  std::size_t anchor = events.size() - 1;  // the totals hold just after this event
  if (place.kind == snapshot_event_place::held && place.index < events.size()) {
    anchor = place.index;
  } else {
    for (std::size_t i = events.size(); i-- > 0;) {
      if (events[i].action == memory_action::snapshot) {
        anchor = i;
        break;
      }
    }
  }
  std::int64_t a = allocated, r = reserved;
  for (std::size_t i = anchor + 1; i-- > 0;) {  // backwards: undo event i to get the level before it
    l.allocated[i] = a;
    l.reserved[i] = r;
    std::int64_t da = 0, dr = 0;
    level_change(events[i], da, dr);
    a -= da;
    r -= dr;
  }
  a = allocated;
  r = reserved;
  for (std::size_t i = anchor + 1; i < events.size(); ++i) {  // forwards from the anchor
    level_change(events[i], a, r);
    l.allocated[i] = a;
    l.reserved[i] = r;
  }
  return l;
}

/// Removes [address, address + size) from `ranges` (start -> size), trimming the ranges that overlap it: an unmap may
/// cover several pages mapped one by one, or part of a range.
inline void remove_address_range(std::map<std::uintptr_t, std::size_t>& ranges, std::uintptr_t address,
                                 std::size_t size) {
  const std::uintptr_t end = address + size;
  auto r = ranges.upper_bound(address);
  if (r != ranges.begin()) --r;
  while (r != ranges.end() && r->first < end) {
    const std::uintptr_t r_start = r->first, r_end = r->first + r->second;
    if (r_end <= address) {
      ++r;
      continue;
    }
    r = ranges.erase(r);
    if (r_start < address) ranges[r_start] = address - r_start;
    if (r_end > end) r = ranges.emplace(end, r_end - end).first;
  }
}

/// Adds to `ranges` the parts of [begin, end) that no interval of `touched` (start -> size) covers.
inline void add_untouched(std::map<std::uintptr_t, std::size_t>& ranges,
                          const std::map<std::uintptr_t, std::size_t>& touched, std::uintptr_t begin,
                          std::uintptr_t end) {
  std::uintptr_t at = begin;
  auto t = touched.upper_bound(begin);
  if (t != touched.begin()) --t;  // one that starts before may reach in
  for (; t != touched.end() && t->first < end; ++t) {
    const std::uintptr_t t_end = t->first + t->second;
    if (t_end <= at) continue;
    if (t->first > at) ranges[at] = t->first - at;
    at = t_end;
  }
  if (at < end) ranges[at] = end - at;
}

/// The largest free block after event i, for each i in `at` (increasing): the largest run of reserved address space
/// (segments, or the mapped ranges of expandable ones, adjacent ones merged) that no live allocation covers. An
/// allocation occupies its requested bytes from its alloc until its free_completed (its rounding is not known to the
/// history). What existed before the first event is inferred: a segment, range or allocation whose first event frees
/// it, or that the snapshot holds without an event having made it, was there from the start.
inline std::vector<std::int64_t> largest_free_levels(const std::vector<memory_event>& events,
                                                     const allocator_snapshot& snapshot,
                                                     const std::vector<std::size_t>& at) {
  std::map<std::uintptr_t, std::size_t> ranges;  // reserved address ranges by start
  std::map<std::uintptr_t, std::size_t> live;    // live allocations by address
  std::unordered_set<std::uintptr_t> range_touched, alloc_touched;
  std::map<std::uintptr_t, std::size_t> pages_touched;  // what the history mapped or unmapped, by start
  std::map<std::uintptr_t, std::size_t> made;           // ranges the history made, while they last
  for (const memory_event& e : events) {  // what the history frees without having made it existed before it began
    switch (e.action) {
      case memory_action::segment_alloc:
      case memory_action::segment_map:
        range_touched.insert(e.address);
        if (e.action == memory_action::segment_map) pages_touched[e.address] = e.size;
        made[e.address] = e.size;
        break;
      case memory_action::segment_free:
      case memory_action::segment_unmap:
        range_touched.insert(e.address);
        if (e.action == memory_action::segment_unmap) {
          std::size_t& touched = pages_touched[e.address];
          touched = std::max(touched, e.size);
        }
        // What of it the history did not make was there before it began (a run may mix both).
        add_untouched(ranges, made, e.address, e.address + e.size);
        remove_address_range(made, e.address, e.size);
        break;
      case memory_action::alloc:
        alloc_touched.insert(e.address);
        break;
      case memory_action::free_requested:
      case memory_action::free_completed:
        if (alloc_touched.insert(e.address).second) live[e.address] = e.size;
        break;
      default:
        break;
    }
  }
  for (const segment_info& seg : snapshot.segments) {  // untouched by the history: there throughout
    if (seg.expandable) {
      // A mapped range is a run of pages, merged: the pages the history never mapped or unmapped were there
      // throughout (those it touched first are counted from their events above).
      for (const auto& r : seg.mapped_ranges) add_untouched(ranges, pages_touched, r.first, r.first + r.second);
    } else if (range_touched.count(seg.address) == 0) {
      ranges[seg.address] = seg.size;
    }
    for (const block_info& b : seg.blocks) {
      // A block cached in front is free (its free_completed is in the history when the history saw it freed).
      const bool held = b.state == block_state::allocated || b.state == block_state::pending;
      if (held && alloc_touched.count(b.address) == 0) live[b.address] = b.size;
    }
  }
  auto largest_gap = [&]() {
    std::int64_t best = 0;
    for (auto r = ranges.begin(); r != ranges.end();) {
      const std::uintptr_t start = r->first;
      std::uintptr_t end = r->first + r->second;
      for (++r; r != ranges.end() && r->first <= end; ++r) end = std::max(end, r->first + r->second);  // one run
      // The allocations that reach into [start, end), the one starting before it included.
      auto a = live.upper_bound(start);
      if (a != live.begin() && std::prev(a)->first + std::prev(a)->second > start) --a;
      std::uintptr_t cursor = start;
      for (; a != live.end() && a->first < end; ++a) {
        if (a->first > cursor) best = std::max(best, static_cast<std::int64_t>(a->first - cursor));
        cursor = std::max(cursor, a->first + a->second);
      }
      if (end > cursor) best = std::max(best, static_cast<std::int64_t>(end - cursor));
    }
    return best;
  };
  std::vector<std::int64_t> out;
  out.reserve(at.size());
  std::size_t next = 0;
  for (std::size_t i = 0; i < events.size() && next < at.size(); ++i) {
    const memory_event& e = events[i];
    switch (e.action) {
      case memory_action::segment_alloc:
      case memory_action::segment_map:
        ranges[e.address] = e.size;
        break;
      case memory_action::segment_free:
      case memory_action::segment_unmap:
        remove_address_range(ranges, e.address, e.size);
        break;
      case memory_action::alloc:
        live[e.address] = e.size;
        break;
      case memory_action::free_completed:
        live.erase(e.address);
        break;
      default:
        break;
    }
    if (i == at[next]) {
      out.push_back(largest_gap());
      ++next;
    }
  }
  return out;
}

}  // namespace detail

/// The page (see the file comment). `title` heads it. Throws invalid_argument_error when the history no longer holds
/// the snapshot's own event (its ring dropped it: more than max_entries events were recorded after the snapshot), as
/// pytorch_snapshot_pickle does: the levels over time are anchored on that event, and the dropped events recorded
/// after it are lost with it, so no anchor in what is left would be right (the lines went below zero).
inline std::string memory_picture_html(const allocator_snapshot& snapshot, const memory_history& history,
                                       const std::string& title = "gpukit memory") {
  using detail::fixed;
  using detail::format_bytes;
  using detail::html_escape;
  const memory_history_contents contents = history.contents();
  const std::vector<memory_event>& events = contents.events;
  const detail::snapshot_event_place place = detail::find_snapshot_event(snapshot, contents);
  detail::refuse_dropped_snapshot_event("gpukit::memory_picture_html", "the picture", place, snapshot, contents);
  const detail::memory_levels levels = detail::levels_of(events, snapshot, place);
  // Tags and requests of the snapshot's allocations not yet reusable: from the events up to its own, where the history
  // holds it (a block freed after the snapshot, and its address taken again, is not the snapshot's block).
  const auto active = place.kind == detail::snapshot_event_place::held && place.index < events.size()
                          ? detail::active_allocations(std::vector<memory_event>(
                                events.begin(), events.begin() + static_cast<std::ptrdiff_t>(place.index) + 1))
                          : detail::active_allocations(events);

  std::string out;
  out += "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html_escape(title) +
         "</title>\n<style>\n"
         "body{font-family:sans-serif;margin:16px;color:#222}h1{font-size:18px}h2{font-size:15px;margin-top:20px}\n"
         ".allocated{fill:#3b6fd8}.pending{fill:#f0a030}.free{fill:#d8dde3}.cached{fill:#9fd3a6}\n"
         ".block{stroke:#fff;stroke-width:0.5}.segment{fill:none;stroke:#888;stroke-width:0.5}\n"
         "polyline.allocated{fill:none;stroke:#3b6fd8;stroke-width:1.5}"
         "polyline.reserved{fill:none;stroke:#c0392b;stroke-width:1.5}"
         "polyline.largest_free{fill:none;stroke:#2e9e4f;stroke-width:1.5;stroke-dasharray:4 2}\n"
         ".axis{stroke:#999;stroke-width:1}.label{font-size:11px;fill:#444}\n</style></head><body>\n";
  out += "<h1>" + html_escape(title) + " &mdash; " + html_escape(snapshot.device.to_string()) + "</h1>\n";
  out += "<p>allocated " + format_bytes(static_cast<std::size_t>(snapshot.stats.allocated_bytes.all().current)) +
         " (peak " + format_bytes(static_cast<std::size_t>(snapshot.stats.allocated_bytes.all().peak)) +
         "), reserved " + format_bytes(static_cast<std::size_t>(snapshot.stats.reserved_bytes.all().current)) +
         " (peak " + format_bytes(static_cast<std::size_t>(snapshot.stats.reserved_bytes.all().peak)) + "), " +
         std::to_string(snapshot.segments.size()) + " segments, " + std::to_string(events.size()) + " events" +
         (contents.dropped != 0 ? " (" + std::to_string(contents.dropped) + " older ones dropped)" : "") + "</p>\n";

  // The timeline: x is the event index, y the bytes.
  const double width = 900, height = 220, left = 70, top = 10;
  const std::size_t step = std::max<std::size_t>(1, events.size() / 2000);  // at most ~2000 points per line
  std::vector<std::size_t> plotted;
  for (std::size_t i = 0; i < events.size(); i += step) plotted.push_back(i);
  const std::vector<std::int64_t> largest_free = detail::largest_free_levels(events, snapshot, plotted);
  std::int64_t most = 1;
  for (std::size_t i = 0; i < events.size(); ++i) most = std::max({most, levels.allocated[i], levels.reserved[i]});
  for (const std::int64_t v : largest_free) most = std::max(most, v);
  out +=
      "<h2>Allocated (requested), reserved and largest free block over the history</h2>\n<svg class=\"timeline\" "
      "width=\"" +
      fixed(left + width + 10) + "\" height=\"" + fixed(top + height + 30) + "\">\n";
  out += "<line class=\"axis\" x1=\"" + fixed(left) + "\" y1=\"" + fixed(top + height) + "\" x2=\"" +
         fixed(left + width) + "\" y2=\"" + fixed(top + height) + "\"/>\n";
  out += "<text class=\"label\" x=\"2\" y=\"" + fixed(top + 10) + "\">" + format_bytes(static_cast<std::size_t>(most)) +
         "</text><text class=\"label\" x=\"2\" y=\"" + fixed(top + height) + "\">0</text>\n";
  out += "<text class=\"label\" x=\"" + fixed(left) + "\" y=\"" + fixed(top + height + 20) +
         "\">events &rarr; (blue: allocated, red: reserved, green: largest free block)</text>\n";
  for (const char* which : {"allocated", "reserved", "largest_free"}) {
    const std::string line = which;
    out += "<polyline class=\"" + line + "\" points=\"";
    for (std::size_t k = 0; k < plotted.size(); ++k) {
      const std::size_t i = plotted[k];
      const std::int64_t value = line == "allocated"  ? levels.allocated[i]
                                 : line == "reserved" ? levels.reserved[i]
                                                      : largest_free[k];
      const double x =
          left + width * static_cast<double>(i) / static_cast<double>(std::max<std::size_t>(1, events.size() - 1));
      const double y = top + height - height * static_cast<double>(value) / static_cast<double>(most);
      out += fixed(x) + "," + fixed(y) + " ";
    }
    out += "\"/>\n";
  }
  out += "</svg>\n";

  // The segments: one bar each, as wide as its share of the largest. An expandable segment is its mapped ranges,
  // a bar each (as PyTorch's viewer shows it): its reserved range is address space, mostly unmapped.
  struct bar {
    const segment_info* seg;
    std::uintptr_t begin, end;
  };
  std::vector<bar> bars;
  bool any_expandable = false;
  for (const segment_info& seg : snapshot.segments) {
    if (!seg.expandable) {
      bars.push_back(bar{&seg, seg.address, seg.address + seg.size});
      continue;
    }
    any_expandable = true;
    for (const auto& r : seg.mapped_ranges) bars.push_back(bar{&seg, r.first, r.first + r.second});
  }
  std::size_t largest = 1;
  for (const bar& b : bars) largest = std::max(largest, static_cast<std::size_t>(b.end - b.begin));
  const double row = 18;
  const double bar_left = any_expandable ? 150 : left;  // room for "mapped of reserved" labels
  const double bar_width = left + width - bar_left;
  out +=
      "<h2>Segments and their blocks (blue: allocated, orange: waiting for other streams, green: cached for "
      "its stream, grey: free)";
  if (any_expandable)
    out += "; an expandable segment: a bar per mapped range, labelled with its bytes of the reserved range";
  out += "</h2>\n<svg class=\"segments\" width=\"" + fixed(left + width + 10) + "\" height=\"" +
         fixed(row * static_cast<double>(bars.size()) + 10) + "\">\n";
  const auto hex = [](std::uintptr_t a) {
    char text[32];
    std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(a));
    return std::string(text);
  };
  for (std::size_t s = 0; s < bars.size(); ++s) {
    const segment_info& seg = *bars[s].seg;
    const std::uintptr_t begin = bars[s].begin, end = bars[s].end;
    const std::size_t size = end - begin;
    const double y = 4 + row * static_cast<double>(s);
    const double scale = bar_width / static_cast<double>(largest);
    const std::string label =
        seg.expandable ? format_bytes(size) + " of " + format_bytes(seg.size) : format_bytes(size);
    out += "<text class=\"label\" x=\"2\" y=\"" + fixed(y + 12) + "\">" + label + "</text>\n";
    out += "<g class=\"segment-row\">";
    for (const block_info& b : seg.blocks) {
      const std::uintptr_t from = std::max(b.address, begin), to = std::min(b.address + b.size, end);
      if (from >= to) continue;  // an expandable segment's block outside this range (unmapped, or another range)
      const char* state = b.state == block_state::allocated ? "allocated"
                          : b.state == block_state::pending ? "pending"
                          : b.state == block_state::cached  ? "cached"
                                                            : "free";
      const bool in_use = b.state == block_state::allocated || b.state == block_state::pending;
      const auto traced = in_use ? active.find(b.address) : active.end();
      const double x = bar_left + scale * static_cast<double>(from - begin);
      const double w = std::max(0.5, scale * static_cast<double>(to - from));
      out += "<rect class=\"block " + std::string(state) + "\" data-state=\"" + state + "\" x=\"" + fixed(x) +
             "\" y=\"" + fixed(y) + "\" width=\"" + fixed(w) + "\" height=\"" + fixed(row - 4) + "\"><title>";
      if (to - from == b.size) {
        out += hex(b.address) + ": " + format_bytes(b.size) + ", " + state;
      } else {  // the part of the block in this mapped range
        out += hex(from) + ": " + format_bytes(to - from) + " mapped of a block of " + format_bytes(b.size) + " at " +
               hex(b.address) + ", " + state;
      }
      const std::size_t requested = b.requested != 0         ? b.requested
                                    : traced != active.end() ? traced->second.requested
                                                             : 0;
      if (in_use && requested != 0) out += " (" + std::to_string(requested) + " B requested)";
      out += ", stream " + std::to_string(b.stream);
      if (traced != active.end() && traced->second.tag != 0) {
        out += ", tag " + html_escape(memory_tag_name(traced->second.tag));
      }
      out += "</title></rect>";
    }
    out += "<rect class=\"segment\" data-address=\"" + hex(begin) + "\" data-size=\"" + std::to_string(size) + "\"";
    if (seg.expandable) {
      out += " data-segment=\"" + hex(seg.address) + "\" data-reserved=\"" + std::to_string(seg.size) + "\"";
    }
    out += " x=\"" + fixed(bar_left) + "\" y=\"" + fixed(y) + "\" width=\"" +
           fixed(std::max(0.5, scale * static_cast<double>(size))) + "\" height=\"" + fixed(row - 4) + "\"><title>";
    if (seg.expandable) {
      out += "expandable segment " + hex(seg.address) + ": mapped range " + hex(begin) + ", " + format_bytes(size) +
             "; " + format_bytes(seg.mapped) + " mapped of " + format_bytes(seg.size) + " reserved";
    } else {
      out += "segment " + hex(begin) + ": " + format_bytes(size);
    }
    out += std::string(seg.small_pool ? ", small pool" : ", large pool") + "</title></rect></g>\n";
  }
  out += "</svg>\n</body></html>\n";
  return out;
}

GPUKIT_END_NAMESPACE
