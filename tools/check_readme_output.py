#!/usr/bin/env python3
"""Fails when output the README quotes from an example program is no longer what the program prints.

The README introduces a quoted output with a marker (for memory_summary: "output of `examples/memory_stats`"); the
first ```text block after the marker is the quote. Each of its table rows (lines starting with "|", except the
"| ..." rows that stand for rows left out) must appear, verbatim, in the program's standard output.
Usage: check_readme_output.py README MARKER PROGRAM [ARGUMENTS...]
"""
import subprocess
import sys


def quoted_rows(readme, marker):
    text = open(readme, encoding="utf-8").read()
    at = text.find(marker)
    if at < 0:
        sys.exit(f"check_readme_output: {readme} has no {marker!r}")
    start = text.find("```text\n", at)
    end = text.find("\n```", start + 1)
    if start < 0 or end < 0:
        sys.exit(f"check_readme_output: no ```text block after {marker!r}")
    block = text[start + len("```text\n"):end].splitlines()
    return [line for line in block if line.startswith("|") and not line.startswith("| ...")]


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    readme, marker, program = sys.argv[1], sys.argv[2], sys.argv[3:]
    rows = quoted_rows(readme, marker)
    if not rows:  # a quote that checks nothing would pass whatever the program prints
        sys.exit(f"check_readme_output: the ```text block after {marker!r} has no table row (a line starting with |)")
    printed = subprocess.run(program, check=True, capture_output=True, text=True).stdout.splitlines()
    missing = [row for row in rows if row not in printed]
    for row in missing:
        print(f"check_readme_output: the README quotes a row {program[0]} does not print:\n  {row}")
    if missing:
        sys.exit(1)
    print(f"check_readme_output: the {len(rows)} rows the README quotes after {marker!r} are what {program[0]} prints")


if __name__ == "__main__":
    main()
