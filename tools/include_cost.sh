#!/usr/bin/env bash
# Compile cost of gpukit, measured in one run, with issue 10's targets beside the figures:
# 1. parse time of gpukit's headers (g++ -std=c++17 -O0 -fsyntax-only, best of N runs, default 5), header-only and in
#    the compiled mode (GPUKIT_SEPARATE_COMPILATION: declarations only, the bodies are gpukit::compiled's), beside the
#    baseline of the standard and CUDA headers gpukit.hpp includes, parsed alone (target for gpukit.hpp in the
#    compiled mode: <= 1.5x);
# 2. the full -O0 compile (to an object file) of a translation unit that uses device_buffer and copy_async
#    (tests/compiled/compiled_probe.cpp), header-only and in the compiled mode (GPUKIT_SEPARATE_COMPILATION, the
#    engines then come from gpukit::compiled) (target: <= 50 % of the header-only time).
#   tools/include_cost.sh [header ...]        (paths under include/, e.g. gpukit/memory/pmr.hpp; default: a set)
# Environment: CXX (g++), RUNS (5), CCCL (the toolkit's include/cccl, for headers that need CCCL), TU (1; 0 skips 2),
# BASE (a git revision: its headers are measured in the same run, in columns of their own, both modes, for
# before/after tables).
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

# Wall time of one compile of the translation unit $1 (parse only unless more flags follow), in seconds, against the
# headers under $tree/include ($tree: this checkout, or BASE's).
tree="$root"
time_once() {
  local tu="$1"
  shift
  local flags=("$@")
  [ ${#flags[@]} -gt 0 ] || flags=(-fsyntax-only)
  local start end
  start=$(date +%s.%N)
  "$cxx" -std=c++17 -O0 "${flags[@]}" -I"$tree/include" -I"$cccl" -isystem "$cuda_include" "$tu"
  end=$(date +%s.%N)
  echo "$end - $start" | bc -l
}
# Best of $runs compiles (time_once's arguments).
best_of() {
  local best="" t
  for _ in $(seq "$runs"); do
    t=$(time_once "$@")
    if [ -z "$best" ] || [ "$(echo "$t < $best" | bc -l)" = 1 ]; then best=$t; fi
  done
  printf '%.2f' "$best"
}

# The baseline: the standard and CUDA headers that gpukit.hpp's headers include directly, without gpukit.
"$cxx" -std=c++17 -O0 -E -H -I"$root/include" -isystem "$cuda_include" -x c++ - <<<'#include <gpukit/gpukit.hpp>' \
  2>&1 >/dev/null | grep -E '^\.+ ' | sed -E 's/^\.+ //' | grep "^$root/include/" | sort -u |
  xargs grep -hE '^#include <' | grep -v '<gpukit/' | sort -u >"$work/baseline.cpp"
base=""
if [ -n "${BASE:-}" ]; then
  base="$work/base"
  mkdir -p "$base"
  git -C "$root" archive "$BASE" include tests/compiled | tar -x -C "$base"
fi

# The parse times, in rounds: each round compiles the baseline and every header once, in each mode (and at BASE), so
# that a slower or faster spell of the machine affects all of them alike; each keeps its best of the rounds.
declare -A best
keep_best() {  # keep_best <key> <seconds>
  if [ -z "${best[$1]:-}" ] || [ "$(echo "$2 < ${best[$1]}" | bc -l)" = 1 ]; then best[$1]=$2; fi
}
for i in "${!headers[@]}"; do printf '#include <%s>\n' "${headers[$i]}" >"$work/tu$i.cpp"; done
for _ in $(seq "$runs"); do
  keep_best baseline "$(time_once "$work/baseline.cpp")"
  for i in "${!headers[@]}"; do
    keep_best "h$i" "$(time_once "$work/tu$i.cpp")"
    # The compiled mode (GPUKIT_SEPARATE_COMPILATION): the headers without the bodies gpukit::compiled defines.
    keep_best "c$i" "$(time_once "$work/tu$i.cpp" -fsyntax-only -DGPUKIT_SEPARATE_COMPILATION)"
    if [ -n "$base" ] && [ -f "$base/include/${headers[$i]}" ]; then
      keep_best "b$i" "$(tree="$base" && time_once "$work/tu$i.cpp")"
      keep_best "bc$i" "$(tree="$base" && time_once "$work/tu$i.cpp" -fsyntax-only -DGPUKIT_SEPARATE_COMPILATION)"
    fi
  done
done
baseline=$(printf '%.2f' "${best[baseline]}")
# The table.
ratio_of() { echo "$1 / ${best[baseline]}" | bc -l; }
printf '%-40s %8s %10s %9s %10s' header seconds "x baseline" compiled "x baseline"
[ -z "$base" ] || printf ' %8s %10s %9s %10s' "$BASE" "x baseline" compiled "x baseline"
echo
printf '%-40s %8s %10s %9s %10s\n' "(standard + CUDA headers, $(wc -l <"$work/baseline.cpp") of them)" "$baseline" "1.00" \
  "$baseline" "1.00"
for i in "${!headers[@]}"; do
  h="${headers[$i]}"
  compiled_ratio=$(ratio_of "${best[c$i]}")
  target=""
  if [ "$h" = gpukit/gpukit.hpp ]; then
    target="target <= 1.50 (compiled): $([ "$(echo "$compiled_ratio <= 1.5" | bc -l)" = 1 ] && echo met || echo 'not met')"
  fi
  printf '%-40s %8.2f %10.2f %9.2f %10.2f' "$h" "${best[h$i]}" "$(ratio_of "${best[h$i]}")" "${best[c$i]}" \
    "$compiled_ratio"
  if [ -n "$base" ]; then
    if [ -z "${best[b$i]:-}" ]; then
      printf ' %8s %10s %9s %10s' - - - -
    else
      printf ' %8.2f %10.2f %9.2f %10.2f' "${best[b$i]}" "$(ratio_of "${best[b$i]}")" "${best[bc$i]}" \
        "$(ratio_of "${best[bc$i]}")"
    fi
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
  base_header_only=$(tree="$base" && best_of "$base/tests/compiled/compiled_probe.cpp" -c -o "$work/probe.o")
  printf '%-40s %8s %10.2f\n' "header-only at $BASE" "$base_header_only" "$(echo "$base_header_only / $header_only" | bc -l)"
fi
printf '%-40s %8s %10.2f  target <= 0.50: %s\n' "compiled (gpukit::compiled)" "$compiled" "$ratio" \
  "$([ "$(echo "$ratio <= 0.5" | bc -l)" = 1 ] && echo met || echo 'not met')"
