#!/usr/bin/env bash
# Copies the test and benchmark dependencies (doctest, Google Benchmark) from this machine's Debian packages into
# .gpudeps/ (git-ignored), keeping their layout, so tests/gpu/run.sh can build on a GPU machine that has CUDA, CMake
# and ninja but no package registry. Run it here, then carry .gpudeps to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpudeps && mkdir -p .gpudeps
packages="doctest-dev libbenchmark-dev $(dpkg -l 'libbenchmark1*' 2>/dev/null | awk '/^ii/ {print $2}')"
for package in $packages; do
  dpkg -L "$package" | while read -r path; do
    case "$path" in /usr/share/doc/*|/usr/share/lintian/*) continue ;; esac
    if [ -f "$path" ] || [ -L "$path" ]; then
      mkdir -p ".gpudeps$(dirname "$path")"
      cp -P "$path" ".gpudeps$path"
    fi
  done
done
echo "staged into .gpudeps: $packages ($(du -sh .gpudeps | cut -f1))"
