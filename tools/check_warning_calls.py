#!/usr/bin/env python3
"""Fails when a header builds a warning's message on the heap.

warn() is called from destructors and catch handlers, where a std::bad_alloc thrown while the message is built
terminates the process. Such messages go through detail::warn_parts (detail/warning_text.hpp), which cannot fail:
its parts are text, integers, byte counts and devices, never a string made for the call. A warn() or warn_parts()
call is flagged when its argument concatenates (`+`) or formats (to_string, format_bytes, append).
Usage: check_warning_calls.py [include directory] (default: the repository's include/).
"""
import pathlib
import re
import sys

CALL = re.compile(r"(?<![\w.>])(?:(?:::)?gpukit::)?(?:detail::)?(warn|warn_parts)\s*\(")
BUILDERS = re.compile(r"\+|\bto_string\s*\(|\bformat_bytes(?:_exact)?\s*\(|\bappend\s*\(")


def blank_literals_and_comments(text):
    """`text` with comments and the contents of string and character literals (raw strings included) blanked,
    lengths and line breaks kept."""
    out = []
    i = 0
    n = len(text)
    while i < n:
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
        elif (raw := re.match(r'R"([^(\s]*)\(', text[i:i + 20])) is not None and (i == 0 or not text[i - 1].isalnum()):
            closing = ")" + raw.group(1) + '"'
            end = text.find(closing, i + len(raw.group(0)))
            end = n if end < 0 else end + len(closing)
        elif text[i] == '"' or (text[i] == "'" and not (i > 0 and text[i - 1].isalnum())):  # not a digit separator
            quote = text[i]
            end = i + 1
            while end < n and text[end] != quote and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            end += 1
        else:
            out.append(text[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:end]))
        i = end
    return "".join(out)


def argument_of(text, open_paren):
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[open_paren + 1:i]
    return text[open_paren + 1:]


def main():
    default = pathlib.Path(__file__).resolve().parent.parent / "include"
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default
    problems = []
    for header in sorted(root.rglob("*.hpp")):
        original = header.read_text()
        text = blank_literals_and_comments(original)
        for match in CALL.finditer(text):
            before = text[max(0, match.start() - 60):match.start()]
            if re.search(r"\b(?:void|GPUKIT_INLINE)\s+$", before):
                continue  # a declaration or definition, not a call
            argument = argument_of(text, match.end() - 1)
            if BUILDERS.search(argument):
                line = text.count("\n", 0, match.start()) + 1
                shown = " ".join(original[match.start():match.end() + len(argument) + 1].split())[:100]
                problems.append(f"{header.relative_to(root.parent)}:{line}: {shown}")
    if problems:
        print("\n".join(problems))
        print(f"check_warning_calls: {len(problems)} warning(s) build their message on the heap; pass the parts to "
              "detail::warn_parts (detail/warning_text.hpp)", file=sys.stderr)
        return 1
    print("check_warning_calls: no warning builds its message on the heap")
    return 0


if __name__ == "__main__":
    sys.exit(main())
