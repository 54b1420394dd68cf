#!/usr/bin/env bash
# Builds the API reference (docs/Doxyfile: the public headers, undocumented entities warned about) into OUT_DIR
# (default: a temporary directory) and fails on any doxygen warning. Exit status 2: no doxygen.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
command -v doxygen >/dev/null || { echo "check_docs: needs doxygen" >&2; exit 2; }
out="${OUT_DIR:-}"
if [ -z "$out" ]; then
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
cd "$root"
warnings=$( (cat docs/Doxyfile; echo "OUTPUT_DIRECTORY=$out") | doxygen - 2>&1 >/dev/null || true)
if [ -n "$warnings" ]; then
  printf '%s\n' "$warnings" >&2
  echo "check_docs: $(printf '%s\n' "$warnings" | grep -c 'warning:') doxygen warnings (doxygen $(doxygen --version))" >&2
  exit 1
fi
echo "check_docs: the public headers are documented (doxygen $(doxygen --version)); reference in $out/html"
