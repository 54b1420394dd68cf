#!/usr/bin/env bash
# Parse time of gpukit's headers: g++ -std=c++17 -O0 -fsyntax-only, best of N runs (default 5), beside the
# baseline of the standard and CUDA headers gpukit.hpp includes, parsed alone in the same run.
#   tools/include_cost.sh [header ...]        (paths under include/, e.g. gpukit/memory/pmr.hpp; default: a set)
# Environment: CXX (g++), RUNS (5), CCCL (the toolkit's include/cccl, for headers that need CCCL).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cxx="${CXX:-g++}"
runs="${RUNS:-5}"
cuda_include="${CUDA_INCLUDE:-/usr/local/cuda/include}"
cccl="${CCCL:-$cuda_include/cccl}"
headers=("$@")
if [ ${#headers[@]} -eq 0 ]; then
  headers=(gpukit/error.hpp gpukit/device/device.hpp gpukit/stream/stream.hpp gpukit/memory/device_allocator.hpp
           gpukit/memory/device_buffer.hpp gpukit/memory/pmr.hpp gpukit/memory/memory_resource.hpp
           gpukit/memory/thrust_allocator.hpp gpukit/transfer/copy.hpp gpukit/gpukit.hpp)
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Best wall time of $runs parses of the translation unit $1, in seconds.
best_of() {
  local best=""
  for _ in $(seq "$runs"); do
    local start end t
    start=$(date +%s.%N)
    "$cxx" -std=c++17 -O0 -fsyntax-only -I"$root/include" -I"$cccl" -isystem "$cuda_include" "$1"
    end=$(date +%s.%N)
    t=$(echo "$end - $start" | bc -l)
    if [ -z "$best" ] || [ "$(echo "$t < $best" | bc -l)" = 1 ]; then best=$t; fi
  done
  printf '%.2f' "$best"
}

# The baseline: the standard and CUDA headers that gpukit.hpp's headers include directly, without gpukit.
"$cxx" -std=c++17 -O0 -E -H -I"$root/include" -isystem "$cuda_include" -x c++ - <<<'#include <gpukit/gpukit.hpp>' \
  2>&1 >/dev/null | grep -E '^\.+ ' | sed -E 's/^\.+ //' | grep "^$root/include/" | sort -u |
  xargs grep -hE '^#include <' | grep -v '<gpukit/' | sort -u >"$work/baseline.cpp"
baseline=$(best_of "$work/baseline.cpp")
printf '%-40s %8s %10s\n' header seconds "x baseline"
printf '%-40s %8s %10s\n' "(standard + CUDA headers, $(wc -l <"$work/baseline.cpp") of them)" "$baseline" "1.00"
for h in "${headers[@]}"; do
  printf '#include <%s>\n' "$h" >"$work/tu.cpp"
  t=$(best_of "$work/tu.cpp")
  printf '%-40s %8s %10.2f\n' "$h" "$t" "$(echo "$t / $baseline" | bc -l)"
done
