#!/usr/bin/env bash
# The whole test suite, as CI runs it (see README, "Testing"). Builds and tests gpukit in several configurations
# that together cover both compilers, both standards and the sanitizers:
#   gcc-cxx17      g++     C++17  Debug   tests + examples + benchmarks (smoke run) + packaging consumers + lint,
#                                         header-only, every header alone (as C++ and as CUDA under nvcc)
#   clang-cxx20    clang++ C++20  Debug   tests + examples, AddressSanitizer + UndefinedBehaviorSanitizer, every
#                                         header alone
#   gcc-cxx20-tsan g++     C++20  Debug   tests, ThreadSanitizer
#   clang-cxx17    clang++ C++17  Release tests
# Every GPU test runs on the simulated runtime in all four. Its build against the real runtime (reported Skipped on
# a machine without a GPU) is made only in gcc-cxx17: the other three set GPUKIT_BUILD_GPU_TESTS=OFF, for CI time.
# Only gcc-cxx17 builds the tests header-only (the default users get); the others build them in the compiled mode
# (GPUKIT_TESTS_USE_COMPILED: gpukit.hpp's function bodies and the engines are compiled once, with that
# configuration's flags and sanitizers), which roughly halves the compile time of an engine-heavy test. The code is
# the same in both modes (moved, not changed), and gcc-cxx17 also runs the compiled mode's own tests.
# Environment: GPUKIT_CONFIGS="gcc-cxx17 clang-cxx20" runs a subset; GPUKIT_BUILD_ROOT (default build-ci) holds
# the build trees; GPUKIT_JOBS sets parallelism (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
build_root="${GPUKIT_BUILD_ROOT:-$root/build-ci}"
jobs="${GPUKIT_JOBS:-$(nproc)}"
configs="${GPUKIT_CONFIGS:-gcc-cxx17 clang-cxx20 gcc-cxx20-tsan clang-cxx17}"
export CUDAToolkit_ROOT="${CUDAToolkit_ROOT:-/usr/local/cuda}"
export PATH="$CUDAToolkit_ROOT/bin:$PATH"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

# run_config <name> <compiler> <standard> <build type> <sanitizers> <ctest arguments> [<cmake arguments>...]
run_config() {
  local name="$1" cxx="$2" std="$3" type="$4" sanitize="$5" extra_ctest="$6"
  shift 6
  local dir="$build_root/$name" main=OFF compiled=ON start
  [ "$name" = gcc-cxx17 ] && main=ON compiled=OFF
  start=$SECONDS
  echo "::: [$name] configure ($cxx, C++$std, $type${sanitize:+, sanitize=$sanitize})"
  cmake -S "$root" -B "$dir" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_STANDARD="$std" \
    -DCMAKE_CXX_STANDARD_REQUIRED=ON -DCMAKE_BUILD_TYPE="$type" -DGPUKIT_SANITIZE="$sanitize" \
    -DGPUKIT_BUILD_BENCHMARKS="$main" -DGPUKIT_TEST_PACKAGING="$main" -DGPUKIT_TESTS_USE_COMPILED="$compiled" \
    -DGPUKIT_BUILD_GPU_TESTS="$main" "$@" >/dev/null
  echo "::: [$name] build"
  cmake --build "$dir" -j "$jobs"
  echo "::: [$name] test (built in $((SECONDS - start)) s)"
  start=$SECONDS
  # The source lints (format, tidy, docs, warning calls) read the sources, not the build: gcc-cxx17 runs them.
  [ $main = ON ] || extra_ctest="$extra_ctest -E ^lint\.(format|tidy|docs|warning_calls)\$"
  # shellcheck disable=SC2086
  (cd "$dir" && ctest --output-on-failure -j "$jobs" $extra_ctest)
  echo "::: [$name] tested in $((SECONDS - start)) s"
}

# allocator_may_return_null=1: the host out-of-memory tests ask for 1 PiB; without it the sanitizers' allocators abort
# instead of failing the allocation, so gpukit's out_of_memory_error path would never run under them (issue 12).
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=1:suppressions=$root/tests/sanitizers/asan.supp"
export LSAN_OPTIONS="suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$root/tests/sanitizers/tsan.supp"

for config in $configs; do
  case "$config" in
    gcc-cxx17)      run_config gcc-cxx17 g++ 17 Debug "" "" ;;
    clang-cxx20)    run_config clang-cxx20 clang++ 20 Debug "address;undefined" "-LE packaging" ;;
    # The examples run in gcc-cxx17 and clang-cxx20; the tools (run by test_replay) still build without them.
    gcc-cxx20-tsan) run_config gcc-cxx20-tsan g++ 20 Debug "thread" "-LE packaging|example" \
                      -DGPUKIT_BUILD_EXAMPLES=OFF -DGPUKIT_BUILD_TOOLS=ON -DGPUKIT_CHECK_HEADERS=OFF ;;
    clang-cxx17)    run_config clang-cxx17 clang++ 17 Release "" "-LE packaging|example" -DGPUKIT_CHECK_HEADERS=OFF \
                      -DGPUKIT_BUILD_EXAMPLES=OFF -DGPUKIT_BUILD_TOOLS=ON ;;
    *) echo "unknown configuration: $config" >&2; exit 2 ;;
  esac
done

if [[ " $configs " == *" gcc-cxx17 "* ]] && [ -d "$build_root/gcc-cxx17/bench" ]; then
  echo "::: benchmarks (smoke run: each benchmark briefly, to prove they run and print their figures)"
  for b in "$build_root"/gcc-cxx17/bench/bench_*; do
    [ -x "$b" ] || continue
    echo "--- $(basename "$b")"
    seeds=""
    # Its tables replay every trace family at 5 seeds: ~10 minutes in Debug, ~2.5 with one seed.
    [ "$(basename "$b")" = bench_fragmentation ] && seeds="--seeds 1"
    "$b" --benchmark_min_time=0.01 $seeds ${GPUKIT_BENCH_ARGS:-}
  done
fi
echo "::: all configurations passed: $configs"
