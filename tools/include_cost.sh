#!/usr/bin/env bash
# Compile cost of gpukit, measured in one run, with issue 10's targets beside the figures:
# 1. parse time of gpukit's headers (g++ -std=c++17 -O0 -fsyntax-only, best of N runs, default 5) beside the baseline
#    of the standard and CUDA headers gpukit.hpp includes, parsed alone (target for gpukit.hpp: <= 1.5x);
# 2. the full -O0 compile (to an object file) of a translation unit that uses device_buffer and copy_async
#    (tests/compiled/compiled_probe.cpp), header-only and in the compiled mode (GPUKIT_SEPARATE_COMPILATION, the
#    engines then come from gpukit::compiled) (target: <= 50 % of the header-only time).
#   tools/include_cost.sh [header ...]        (paths under include/, e.g. gpukit/memory/pmr.hpp; default: a set)
# Environment: CXX (g++), RUNS (5), CCCL (the toolkit's include/cccl, for headers that need CCCL), TU (1; 0 skips 2),
# BASE (a git revision: its headers are measured in the same run, in a column of their own, for before/after tables).
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

# Best wall time of $runs compiles of the translation unit $1 (parse only unless more flags follow), in seconds,
# against the headers under $tree/include ($tree: this checkout, or BASE's).
tree="$root"
best_of() {
  local tu="$1"
  shift
  local flags=("$@")
  [ ${#flags[@]} -gt 0 ] || flags=(-fsyntax-only)
  local best=""
  for _ in $(seq "$runs"); do
    local start end t
    start=$(date +%s.%N)
    "$cxx" -std=c++17 -O0 "${flags[@]}" -I"$tree/include" -I"$cccl" -isystem "$cuda_include" "$tu"
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
base=""
if [ -n "${BASE:-}" ]; then
  base="$work/base"
  mkdir -p "$base"
  git -C "$root" archive "$BASE" include tests/compiled | tar -x -C "$base"
fi
# BASE's time for the translation unit $1 (with the flags that follow), or "-" when it has no such header.
base_best_of() {
  if [ -z "$base" ]; then return; fi
  local header="$1"
  shift
  if [ -n "$header" ] && [ ! -f "$base/include/$header" ]; then
    printf '%8s' -
    return
  fi
  (tree="$base" && best_of "$@")
}
printf '%-40s %8s %10s' header seconds "x baseline"
[ -z "$base" ] || printf ' %8s %10s' "$BASE" "x baseline"
echo
printf '%-40s %8s %10s\n' "(standard + CUDA headers, $(wc -l <"$work/baseline.cpp") of them)" "$baseline" "1.00"
for h in "${headers[@]}"; do
  printf '#include <%s>\n' "$h" >"$work/tu.cpp"
  t=$(best_of "$work/tu.cpp")
  ratio=$(echo "$t / $baseline" | bc -l)
  target=""
  if [ "$h" = gpukit/gpukit.hpp ]; then
    target="target <= 1.50: $([ "$(echo "$ratio <= 1.5" | bc -l)" = 1 ] && echo met || echo 'not met')"
  fi
  printf '%-40s %8s %10.2f' "$h" "$t" "$ratio"
  if [ -n "$base" ]; then
    b=$(base_best_of "$h" "$work/tu.cpp")
    if [ "$b" = "       -" ]; then printf ' %8s %10s' - -; else printf ' %8s %10.2f' "$b" "$(echo "$b / $baseline" | bc -l)"; fi
  fi
  printf '  %s\n' "$target"
done

[ "${TU:-1}" = 0 ] && exit 0
probe="$root/tests/compiled/compiled_probe.cpp"
header_only=$(best_of "$probe" -c -o "$work/probe.o")
compiled=$(best_of "$probe" -c -o "$work/probe.o" -DGPUKIT_SEPARATE_COMPILATION)
ratio=$(echo "$compiled / $header_only" | bc -l)
echo
echo "translation unit using device_buffer and copy_async (tests/compiled/compiled_probe.cpp), $cxx -O0 -c:"
printf '%-40s %8s %10s\n' mode seconds "x header-only"
printf '%-40s %8s %10s\n' "header-only (the default)" "$header_only" "1.00"
if [ -n "$base" ]; then
  base_header_only=$(base_best_of "" "$base/tests/compiled/compiled_probe.cpp" -c -o "$work/probe.o")
  printf '%-40s %8s %10.2f\n' "header-only at $BASE" "$base_header_only" "$(echo "$base_header_only / $header_only" | bc -l)"
fi
printf '%-40s %8s %10.2f  target <= 0.50: %s\n' "compiled (gpukit::compiled)" "$compiled" "$ratio" \
  "$([ "$(echo "$ratio <= 0.5" | bc -l)" = 1 ] && echo met || echo 'not met')"
