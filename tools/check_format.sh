#!/usr/bin/env bash
# Checks (default) or applies (--fix) .clang-format on gpukit's C++ and CUDA sources: include/, src/, tests/, tools/,
# bench/, examples/. The style is pinned to clang-format 14 (Debian 12's), since other versions format some constructs
# differently: set CLANG_FORMAT to another binary of version 14, or run --fix with it. Exit status 1 lists the files
# that differ; 2 means no clang-format 14 was found.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fix=0
[ "${1:-}" = --fix ] && fix=1
tool="${CLANG_FORMAT:-}"
if [ -z "$tool" ]; then
  for candidate in clang-format-14 clang-format; do
    if command -v "$candidate" >/dev/null; then tool="$candidate"; break; fi
  done
fi
if [ -z "$tool" ] || ! "$tool" --version | grep -qE 'version 14\.'; then
  echo "check_format: needs clang-format 14 (found: ${tool:-none}${tool:+, $("$tool" --version)})" >&2
  exit 2
fi
cd "$root"
mapfile -t files < <(find include src tests tools bench examples -type f \
  \( -name '*.hpp' -o -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) | sort)
if [ "$fix" = 1 ]; then
  "$tool" -i "${files[@]}"
  echo "check_format: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$tool" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check_format: not formatted (run tools/check_format.sh --fix):\n' >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted as .clang-format says ($("$tool" --version))"
