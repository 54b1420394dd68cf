#!/usr/bin/env bash
# GPU truth in one command. On a machine with an NVIDIA GPU and driver: builds gpukit against the real CUDA runtime
# (Release), runs every GPU test (ctest -L gpu: none may skip for want of a usable GPU), every example, and the allocator, trace-replay,
# pinned-pool and transfer benchmarks, and writes a report (device, driver, commands, results) to bench/results/.
#
#   bash tests/gpu/run.sh                      # on the GPU machine
#   GPUKIT_GPU_RUNTIME=sim bash tests/gpu/run.sh   # the same steps on the simulated runtime (no GPU needed): a dry run
#
# Dependencies: CUDA toolkit, CMake, a C++17 compiler, doctest and Google Benchmark. Where no package registry is
# reachable, stage the last two here with tests/gpu/stage_deps.sh and carry .gpudeps along (found automatically).
# Environment: GPUKIT_GPU_BUILD (build directory, default build-gpu), GPUKIT_GPU_REPORT (report path),
# GPUKIT_GPU_BENCH_MIN_TIME (seconds per benchmark, default 0.2), GPUKIT_JOBS, GPUKIT_GPU_STEP_TIMEOUT (seconds each
# test, example or benchmark may run before it counts as hung, default 120: a lent machine's time is short; the
# stacks of a test or example still running 15 s before that go into the report).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
runtime="${GPUKIT_GPU_RUNTIME:-real}"
build="${GPUKIT_GPU_BUILD:-$root/build-gpu}"
jobs="${GPUKIT_JOBS:-$(nproc)}"
min_time="${GPUKIT_GPU_BENCH_MIN_TIME:-0.2}"
step_timeout="${GPUKIT_GPU_STEP_TIMEOUT:-120}"
stamp=$(date -u +%Y%m%d-%H%M%S)
export CUDAToolkit_ROOT="${CUDAToolkit_ROOT:-/usr/local/cuda}"
export PATH="$CUDAToolkit_ROOT/bin:$PATH"
prefix_path=()
if [ -d "$root/.gpudeps/usr" ]; then
  prefix_path=(-DCMAKE_PREFIX_PATH="$root/.gpudeps/usr")
  export LD_LIBRARY_PATH="$root/.gpudeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi

if [ "$runtime" = sim ]; then
  suffix=_sim
  label=cudasim
  report="${GPUKIT_GPU_REPORT:-$build/gpu-report-simulated-$stamp.md}"
else
  suffix=
  label=gpu
  if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "tests/gpu/run.sh: no NVIDIA GPU or driver here (nvidia-smi failed); GPUKIT_GPU_RUNTIME=sim runs the same steps on the simulator" >&2
    exit 2
  fi
  gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr ' ' '-' | tr -cd 'A-Za-z0-9_.-')
  report="${GPUKIT_GPU_REPORT:-$root/bench/results/gpu-$stamp-$gpu_name.md}"
fi
mkdir -p "$(dirname "$report")" "$build"
# Absolute, since the examples run from the build directory (they write their outputs to the working directory).
report="$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
build="$(cd "$build" && pwd)"
log="$build/gpu-run.log"
: >"$log"
status=0
last_output=

section() { printf '\n## %s\n\n' "$1" >>"$report"; }
# run <title> <command...>: runs a step, appends its command and output (in a code block) to the report.
run() {
  local title="$1"; shift
  echo "::: $title" | tee -a "$log"
  section "$title"
  printf '```text\n$' >>"$report"
  printf ' %q' "$@" >>"$report"  # quoted: the line can be pasted into a shell
  printf '\n' >>"$report"
  local rc
  last_output=$("$@" 2>&1); rc=$?
  printf '%s\n' "$last_output" | tee -a "$log" >>"$report"
  printf '(exit %d)\n```\n' "$rc" >>"$report"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{
  echo "# gpukit GPU run ($runtime runtime), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "- host: $(uname -srm), $(nproc) cores"
  # Whether the cores are physical or hardware threads of fewer cores decides what thread scaling can reach.
  command -v lscpu >/dev/null &&
    echo "- CPU: $(LC_ALL=C lscpu | sed -n 's/^\(Model name\|Socket(s)\|Core(s) per socket\|Thread(s) per core\): *\(.*\)/\1: \2/p' | paste -sd ';' - | sed 's/;/; /g')"
  echo "- CUDA toolkit: $("$CUDAToolkit_ROOT/bin/nvcc" --version 2>/dev/null | tail -n1)"
  echo "- command: GPUKIT_GPU_RUNTIME=$runtime bash tests/gpu/run.sh"
} >"$report"
if [ "$runtime" = real ]; then
  run "Device and driver" nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
fi

run "Configure (Release, real CUDA runtime for the gpu label)" cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGPUKIT_BUILD_BENCHMARKS=ON -DGPUKIT_TEST_PACKAGING=OFF -DGPUKIT_BUILD_GPU_TESTS=ON \
  -DGPUKIT_GPU_TEST_TIMEOUT="$step_timeout" "${prefix_path[@]}" || exit 1
# Only what this script runs (the gpu_checks target: GPU tests, examples, the three benchmarks), not the CPU suite.
# Ninja goes on past a failed target (-k 0): whatever did build still runs, and the report names what did not.
run "Build" cmake --build "$build" -j "$jobs" --target "gpu_checks$suffix" -- -k 0

# A test or example that runs so long it will be counted as hung: its threads' stacks, taken before it is killed, so
# that a hang on a lent machine says where it waits (gdb, or the toolkit's cuda-gdb; otherwise each thread's wait
# channel). Not the benchmarks: attaching would skew their times.
stacks="$build/hung-stacks.txt"
stacks_after=$((step_timeout > 20 ? step_timeout - 15 : step_timeout / 2))
: >"$stacks"
sample_hung_steps() {
  local seen=" " pid age debugger
  debugger=$(command -v gdb || command -v cuda-gdb || true)
  while sleep 5; do
    for pid in $(pgrep -f -- "$build/(tests|examples)/"); do
      case "$seen" in *" $pid "*) continue ;; esac
      age=$(ps -o etimes= -p "$pid" 2>/dev/null | tr -d ' ')
      if [ -z "$age" ] || [ "$age" -lt "$stacks_after" ]; then continue; fi
      seen="$seen$pid "
      {
        echo "### pid $pid, running for ${age} s: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
        if [ -n "$debugger" ]; then
          timeout 60 "$debugger" -batch -p "$pid" -ex "thread apply all bt" 2>&1 | grep -v '^\[New LWP' | tail -n 400
        else
          for task in /proc/"$pid"/task/*; do
            echo "thread $(basename "$task") ($(cat "$task/comm" 2>/dev/null)): waits in $(cat "$task/wchan" 2>/dev/null)"
          done
        fi
      } >>"$stacks" 2>&1
    done
  done
}
sample_hung_steps &
sampler=$!
trap 'kill "$sampler" 2>/dev/null' EXIT  # never left behind, whatever ends the script

run "GPU tests (ctest -L $label)" ctest --test-dir "$build" -L "$label" --output-on-failure -j 1
# A GPU test skips with GPUKIT_TEST_SKIPPED when no device is usable (a failure here), and with
# GPUKIT_TEST_NOT_APPLICABLE when it cannot apply to this machine (two devices needed, simulator only): listed only.
test_log="$build/Testing/Temporary/LastTest.log"
if grep -q "Not Run" <<<"$last_output" || grep -q "GPUKIT_TEST_SKIPPED" "$test_log" 2>/dev/null; then
  echo "tests/gpu/run.sh: some GPU tests did not run (Skipped: GPUKIT_TEST_SKIPPED, or Not Run): the GPU is not usable" |
    tee -a "$log" "$report"
  status=1
fi
not_applicable=$(grep -c "GPUKIT_TEST_NOT_APPLICABLE" "$test_log" 2>/dev/null)
[ "${not_applicable:-0}" -gt 0 ] &&
  printf '%s GPU tests do not apply to this machine (GPUKIT_TEST_NOT_APPLICABLE):\n%s\n' "$not_applicable" \
    "$(grep -o "GPUKIT_TEST_NOT_APPLICABLE: .*" "$test_log" | sort | uniq -c)" | tee -a "$log" >>"$report"

# What the runtime makes visible for each CUDA_VISIBLE_DEVICES value of the table, beside gpukit's reading: the
# rows where gpukit and the simulator read a value differently are settled here.
[ -x "$build/tests/test_gpu_visible_devices$suffix" ] &&
  run "CUDA_VISIBLE_DEVICES: the runtime's reading and gpukit's" timeout "$step_timeout" \
    "$build/tests/test_gpu_visible_devices$suffix"

cd "$build" || exit 1
for example in device_query memory_stats memory_history tenant_budgets bandwidth_test prefetch_pipeline \
    train_input_pipeline graph_replay inference_server inference_server_cuda stream_timing; do
  [ -x "$build/examples/$example$suffix" ] && run "Example $example" timeout "$step_timeout" "$build/examples/$example$suffix"
done
for bench in bench_allocator bench_trace_replay bench_pinned_pool bench_transfer; do
  [ -x "$build/bench/$bench$suffix" ] &&
    run "Benchmark $bench" timeout "$step_timeout" "$build/bench/$bench$suffix" --benchmark_min_time="$min_time"
done
# Thread scaling again with each thread pinned to a physical core of its own: beside the run above, it tells the
# allocator's scaling apart from where the scheduler put the threads (hardware threads of one core share its units).
[ -x "$build/bench/bench_allocator$suffix" ] &&
  run "Benchmark bench_allocator, thread scaling with pinned threads" env GPUKIT_BENCH_PIN_THREADS=1 timeout \
    "$step_timeout" "$build/bench/bench_allocator$suffix" --benchmark_min_time="$min_time" \
    --benchmark_filter='^BM_(gpukit|malloc)/(256|65536)/[1-8]/0/|^BM_gpukit_cpu_queue/(256|65536)/|^BM_line_pair_writes/'

kill "$sampler" 2>/dev/null
wait "$sampler" 2>/dev/null
if [ -s "$stacks" ]; then
  section "Stacks of steps that ran past $stacks_after s"
  { echo "\`\`\`text"; cat "$stacks"; echo "\`\`\`"; } >>"$report"
  echo "tests/gpu/run.sh: stacks of steps that seemed hung are in the report" | tee -a "$log"
fi

section "Summary"
echo "status: $([ "$status" -eq 0 ] && echo 'every step passed' || echo 'SOME STEPS FAILED (see above)')" >>"$report"
echo "report: $report"
exit "$status"
