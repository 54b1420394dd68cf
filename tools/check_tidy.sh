#!/usr/bin/env bash
# Runs clang-tidy (.clang-tidy's checks, warnings are errors) over every public header of include/gpukit, in one
# translation unit that includes them all, as C++17 against the CUDA toolkit's headers and its CCCL. Environment:
# CLANG_TIDY (clang-tidy-14, else clang-tidy), CUDA_INCLUDE (/usr/local/cuda/include). Exit status 2: no clang-tidy.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cuda_include="${CUDA_INCLUDE:-/usr/local/cuda/include}"
tool="${CLANG_TIDY:-}"
if [ -z "$tool" ]; then
  for candidate in clang-tidy-14 clang-tidy; do
    if command -v "$candidate" >/dev/null; then tool="$candidate"; break; fi
  done
fi
if [ -z "$tool" ]; then
  echo "check_tidy: needs clang-tidy" >&2
  exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$root/include" && find gpukit -name '*.hpp' | sort | sed 's/.*/#include <&>/') >"$work/all_headers.cpp"
"$tool" --quiet --config-file="$root/.clang-tidy" "$work/all_headers.cpp" -- -std=c++17 -I"$root/include" \
  -I"$cuda_include/cccl" -isystem "$cuda_include"
echo "check_tidy: $(wc -l <"$work/all_headers.cpp") headers pass .clang-tidy ($("$tool" --version | grep -o 'version [0-9.]*'))"
