#!/usr/bin/env bash
# Builds gpukit's libFuzzer targets (clang, ASan + UBSan, optimised) in their own build directory and runs each to
# RUNS executions (default 1,000,000) on a copy of its seed corpus, then prints target -> executions, time, result.
#
#   bash tests/fuzz/run.sh [target...]        (default: every target)
#   RUNS=100000 BUILD_DIR=/tmp/fuzz JOBS=2 bash tests/fuzz/run.sh caching_allocator
#
# A failing target leaves its input in $BUILD_DIR/fuzz-work/artifacts-<target>/ (see README.md to keep it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${BUILD_DIR:-$root/build-fuzz}"
runs="${RUNS:-1000000}"
jobs="${JOBS:-2}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(visible_devices select caching_allocator pinned_pool copy); fi

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DGPUKIT_SANITIZE="address;undefined" -DGPUKIT_BUILD_BENCHMARKS=OFF \
  -DGPUKIT_TEST_PACKAGING=OFF >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]/#/fuzz_}"

max_len() {
  case "$1" in
    visible_devices|select) echo 256 ;;
    *) echo 192 ;;
  esac
}

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
work="$build/fuzz-work"
mkdir -p "$work"
rows=()
status=0
for t in "${targets[@]}"; do
  corpus="$work/corpus-$t"
  artifacts="$work/artifacts-$t/"
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp "$here/corpus/$t/"* "$corpus/"
  dict=()
  if [ -f "$here/$t.dict" ]; then dict=("-dict=$here/$t.dict"); fi
  log="$work/$t.log"
  start=$(date +%s)
  if "$build/tests/fuzz/fuzz_$t" "${dict[@]}" -runs="$runs" -max_len="$(max_len "$t")" -timeout=60 \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$artifacts" "$corpus" >"$log" 2>&1; then
    result="ok"
  else
    result="FAILED (input in $artifacts)"
    status=1
  fi
  seconds=$(( $(date +%s) - start ))
  executions=$(grep -a -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
  if [ -z "$executions" ]; then executions=$(grep -a -o '^#[0-9]*' "$log" | tail -1 | tr -d '#'); fi
  rows+=("$(printf '%-18s %12s %8ss  %s' "$t" "$executions" "$seconds" "$result")")
  echo "${rows[-1]}  (log: $log)"
done
echo
printf '%-18s %12s %9s  %s\n' target executions time result
for r in "${rows[@]}"; do echo "$r"; done
exit $status
