// A reader for the pickles PyTorch's memory snapshots are (torch.cuda.memory._dump_snapshot, and gpukit's
// dump_pytorch_snapshot): Python's binary pickle protocols 2 to 5 restricted to plain data — dicts, lists, tuples,
// strings, bytes (protocol 3 and later; protocol 2 pickles bytes through a class reference), integers, floats,
// booleans and None, with the memo. Anything else (class references, reductions, the text protocols 0 and 1) is
// refused with the opcode and its offset, never executed or guessed. Every value lives in the document's arena and
// containers point into it, so hostile input can neither leak (a container that holds itself) nor overflow the stack
// when freed (deep nesting).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpukit_replay {

/// One unpickled value. Containers point to values in the same document: the memo may make one object appear in
/// several places.
struct pickled {
  enum class kind { none, boolean, integer, floating, string, bytes, list, tuple, dict };
  kind type = kind::none;
  std::int64_t integer = 0;            ///< boolean (0/1) and integer values that fit in 64 bits signed
  std::uint64_t unsigned_integer = 0;  ///< integer values in [2^63, 2^64) (addresses), with `big` set
  bool big = false;
  double floating = 0;
  std::string text;                                                ///< string (UTF-8) and bytes
  std::vector<const pickled*> items;                               ///< list and tuple
  std::vector<std::pair<const pickled*, const pickled*>> entries;  ///< dict, in insertion order

  /// The dict entry whose key is the string `key`, or nullptr.
  const pickled* find(const std::string& key) const {
    for (const auto& e : entries) {
      if (e.first->type == kind::string && e.first->text == key) return e.second;
    }
    return nullptr;
  }
  /// An integer's value as an unsigned 64-bit number (negative values are refused).
  std::uint64_t as_unsigned(const char* what) const {
    if (type != kind::integer) throw std::runtime_error(std::string(what) + " is not an integer");
    if (big) return unsigned_integer;
    if (integer < 0) throw std::runtime_error(std::string(what) + " is negative");
    return static_cast<std::uint64_t>(integer);
  }
};

/// An unpickled document: every value it holds, and the root.
struct pickle_document {
  std::vector<std::unique_ptr<pickled>> values;  // the arena: freed flat, whatever points to what
  const pickled* root = nullptr;
};

/// Unpickles `data`. Throws std::runtime_error naming the offset of what it cannot read.
inline pickle_document unpickle(const std::string& data) {
  using value = pickled*;
  pickle_document document;
  std::vector<value> stack;
  std::vector<std::size_t> marks;
  std::unordered_map<std::uint64_t, value> memo;
  std::size_t at = 0;
  auto fail = [&](const std::string& why) -> void {
    throw std::runtime_error("pickle offset " + std::to_string(at) + ": " + why);
  };
  auto need = [&](std::size_t n) {
    if (n > data.size() - at) fail("truncated");
  };
  auto little_endian = [&](std::size_t n) {
    need(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
    at += n;
    return v;
  };
  auto make = [&](pickled::kind k) {
    document.values.push_back(std::make_unique<pickled>());
    pickled* v = document.values.back().get();
    v->type = k;
    return v;
  };
  auto pop = [&]() {
    if (stack.empty() || (!marks.empty() && stack.size() == marks.back())) fail("stack underflow");
    value v = stack.back();
    stack.pop_back();
    return v;
  };
  auto pop_mark = [&]() {
    if (marks.empty()) fail("no mark");
    const std::size_t from = marks.back();
    marks.pop_back();
    std::vector<value> items(stack.begin() + static_cast<std::ptrdiff_t>(from), stack.end());
    stack.resize(from);
    return items;
  };
  auto top = [&](pickled::kind k, const char* what) -> pickled& {
    if (stack.empty() || stack.back()->type != k) fail(std::string("expected a ") + what + " on the stack");
    return *stack.back();
  };
  auto text = [&](std::size_t n, pickled::kind k) {
    need(n);
    value v = make(k);
    v->text = data.substr(at, n);
    at += n;
    stack.push_back(v);
  };
  auto integer = [&](std::int64_t i) {
    value v = make(pickled::kind::integer);
    v->integer = i;
    stack.push_back(v);
  };
  auto long_integer = [&](std::size_t n) {  // little-endian two's complement
    need(n);
    value v = make(pickled::kind::integer);
    if (n == 9 && data[at + 8] == 0) {  // a positive value in [2^63, 2^64)
      const std::size_t start = at;
      v->unsigned_integer = little_endian(8);
      v->big = (v->unsigned_integer >> 63) != 0;
      v->integer = v->big ? 0 : static_cast<std::int64_t>(v->unsigned_integer);
      at = start + 9;
    } else if (n <= 8) {
      std::uint64_t raw = n == 0 ? 0 : little_endian(n);
      if (n > 0 && n < 8 && (raw >> (8 * n - 1)) != 0) raw |= ~std::uint64_t{0} << (8 * n);  // sign-extend
      std::memcpy(&v->integer, &raw, sizeof raw);
    } else {
      fail("an integer of " + std::to_string(n) + " bytes");
    }
    stack.push_back(v);
  };
  auto tuple_of = [&](const std::vector<value>& items) {
    value v = make(pickled::kind::tuple);
    v->items.assign(items.begin(), items.end());
    stack.push_back(v);
  };
  auto tuple_n = [&](std::size_t n) {
    std::vector<value> items(n);
    for (std::size_t i = n; i-- > 0;) items[i] = pop();
    tuple_of(std::move(items));
  };
  auto memo_get = [&](std::uint64_t key) {
    const auto found = memo.find(key);  // may be a container still being built: cycles are harmless in the arena
    if (found == memo.end()) fail("memo entry " + std::to_string(key) + " was never stored");
    stack.push_back(found->second);
  };
  auto memo_put = [&](std::uint64_t key) {
    if (stack.empty()) fail("nothing to memoize");
    memo[key] = stack.back();
  };

  while (true) {
    need(1);
    const std::size_t opcode_at = at;
    const auto op = static_cast<unsigned char>(data[at++]);
    switch (op) {
      case 0x80:  // PROTO n
        (void)little_endian(1);
        break;
      case 0x95:  // FRAME length: the frames are read as one stream
        (void)little_endian(8);
        break;
      case '.': {  // STOP
        if (stack.size() != 1 || !marks.empty()) fail("the pickle does not end with one value");
        document.root = stack.back();
        return document;
      }
      case '(':
        marks.push_back(stack.size());
        break;
      case '}':
        stack.push_back(make(pickled::kind::dict));
        break;
      case ']':
        stack.push_back(make(pickled::kind::list));
        break;
      case ')':
        tuple_of({});
        break;
      case 'N':
        stack.push_back(make(pickled::kind::none));
        break;
      case 0x88:
      case 0x89: {
        value v = make(pickled::kind::boolean);
        v->integer = op == 0x88 ? 1 : 0;
        stack.push_back(v);
        break;
      }
      case 'J':
        integer(static_cast<std::int32_t>(static_cast<std::uint32_t>(little_endian(4))));
        break;
      case 'K':
        integer(static_cast<std::int64_t>(little_endian(1)));
        break;
      case 'M':
        integer(static_cast<std::int64_t>(little_endian(2)));
        break;
      case 0x8a:
        long_integer(static_cast<std::size_t>(little_endian(1)));
        break;
      case 0x8b:
        long_integer(static_cast<std::size_t>(little_endian(4)));
        break;
      case 'G': {  // BINFLOAT: big-endian IEEE double
        const std::uint64_t big_endian = little_endian(8);
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits |= ((big_endian >> (8 * i)) & 0xff) << (8 * (7 - i));
        value v = make(pickled::kind::floating);
        std::memcpy(&v->floating, &bits, sizeof bits);
        stack.push_back(v);
        break;
      }
      case 0x8c:
        text(static_cast<std::size_t>(little_endian(1)), pickled::kind::string);
        break;
      case 'X':
        text(static_cast<std::size_t>(little_endian(4)), pickled::kind::string);
        break;
      case 0x8d:
        text(static_cast<std::size_t>(little_endian(8)), pickled::kind::string);
        break;
      case 'C':
        text(static_cast<std::size_t>(little_endian(1)), pickled::kind::bytes);
        break;
      case 'B':
        text(static_cast<std::size_t>(little_endian(4)), pickled::kind::bytes);
        break;
      case 0x8e:
        text(static_cast<std::size_t>(little_endian(8)), pickled::kind::bytes);
        break;
      case 't':
        tuple_of(pop_mark());
        break;
      case 0x85:
        tuple_n(1);
        break;
      case 0x86:
        tuple_n(2);
        break;
      case 0x87:
        tuple_n(3);
        break;
      case 'a': {
        value item = pop();
        top(pickled::kind::list, "list").items.push_back(item);
        break;
      }
      case 'e': {
        std::vector<value> items = pop_mark();
        auto& list = top(pickled::kind::list, "list").items;
        list.insert(list.end(), items.begin(), items.end());
        break;
      }
      case 's': {
        value v = pop();
        value k = pop();
        top(pickled::kind::dict, "dict").entries.emplace_back(k, v);
        break;
      }
      case 'u': {
        std::vector<value> items = pop_mark();
        if (items.size() % 2 != 0) fail("SETITEMS with an odd number of items");
        auto& dict = top(pickled::kind::dict, "dict").entries;
        for (std::size_t i = 0; i < items.size(); i += 2) dict.emplace_back(items[i], items[i + 1]);
        break;
      }
      case 0x94:
        memo_put(memo.size());
        break;  // MEMOIZE
      case 'q':
        memo_put(little_endian(1));
        break;
      case 'r':
        memo_put(little_endian(4));
        break;
      case 'h':
        memo_get(little_endian(1));
        break;
      case 'j':
        memo_get(little_endian(4));
        break;
      default: {
        at = opcode_at;
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        fail(std::string("opcode ") + hex +
             " is not plain data (a memory snapshot holds only dicts, lists, strings and numbers)");
      }
    }
  }
}

}  // namespace gpukit_replay
