#!/usr/bin/env bash
# gpukit's release procedure, and the check CI makes of the vcpkg registry port (README, "Releasing").
#
#   packaging/release.sh VERSION            cut release VERSION on a clean main (each step below must agree)
#   packaging/release.sh --check            the registry port's SHA512 is that of its release's archive
#   packaging/release.sh --verify-download  after pushing: GitHub's archive of the tag has that SHA512 (network)
#
# Cutting VERSION: refuses unless the tree is clean, on main, VERSION is MAJOR.MINOR.PATCH, newer than the last
# release, not older than include/gpukit/version.hpp, untagged, and CHANGELOG.md's "## [Unreleased]" section says
# something. Then: version.hpp (the one place the version lives; CMake and Conan read it) and the development port's
# vcpkg.json get VERSION, the Unreleased section becomes "## [VERSION] - <date>", every consumer test runs
# (ctest -L packaging, conan create included) and must pass, the release commit is made and tagged vVERSION, the
# archive is built from the tag as GitHub serves it, and its SHA512 and VERSION go into the registry port, committed.
# Nothing is pushed. --skip-consumer-tests exists for the script's own test (packaging.release), not for releases.
set -euo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
port=packaging/vcpkg/ports/gpukit
dev_port=packaging/vcpkg/dev-ports/gpukit
version_header=include/gpukit/version.hpp
build_dir=${GPUKIT_RELEASE_BUILD_DIR:-$root/build-release}

die() { echo "release.sh: $*" >&2; exit 1; }

json_version() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' "$1/vcpkg.json"; }
set_json_version() {
  python3 - "$1/vcpkg.json" "$2" <<'PY'
import json, sys
path, version = sys.argv[1], sys.argv[2]
manifest = json.load(open(path))
manifest["version"] = version
open(path, "w").write(json.dumps(manifest, indent=2) + "\n")
PY
}
header_version() {  # from the working tree, or from commit $1
  local text
  if [ $# -eq 1 ]; then text=$(git show "$1:$version_header"); else text=$(cat "$version_header"); fi
  local v=() part
  for part in MAJOR MINOR PATCH; do
    v+=("$(sed -n "s/^#define GPUKIT_VERSION_$part \([0-9][0-9]*\)$/\1/p" <<<"$text")")
  done
  (IFS=.; echo "${v[*]}")
}
port_sha512() { sed -n 's/^ *SHA512 \([0-9A-Za-z]*\)$/\1/p' "$port/portfile.cmake"; }
version_le() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]; }
released_versions() { sed -n 's/^## \[\([0-9][0-9.]*\)\] - .*/\1/p' CHANGELOG.md; }

# The commit of release $1: the one whose CHANGELOG.md gained "## [$1] - ", which the tag v$1 points to. Found from
# the history because tags need not travel with a clone of main (CI clones main).
release_commit() {  # sed, not head, reads git log to its end: a cut pipe (SIGPIPE) fails under pipefail
  git log --reverse --format=%H -S"## [$1] - " -- CHANGELOG.md | sed -n 1p
}

# The archive GitHub serves for tag v$1 (https://github.com/gpukit/gpukit/archive/v$1.tar.gz): git archive's tar with
# the prefix gpukit-$1/, compressed by gzip without a name or time stamp. Written to stdout.
archive() { git archive --format=tar --prefix="gpukit-$1/" "$2" | gzip -cn; }

check() {
  local version sha commit tag_commit actual
  version=$(json_version "$port")
  sha=$(port_sha512)
  [[ "$sha" =~ ^[0-9a-f]{128}$ ]] ||
    die "$port/portfile.cmake: SHA512 \"$sha\" is not the SHA512 of a release archive (128 hex digits); cut a release with packaging/release.sh VERSION"
  commit=$(release_commit "$version")
  if [ -z "$commit" ]; then
    if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
      echo "GPUKIT_TEST_SKIPPED: a shallow clone does not hold the commit of release $version"
      exit 77
    fi
    die "the registry port is at $version, which was never released: CHANGELOG.md's history has no \"## [$version] - \" heading"
  fi
  if tag_commit=$(git rev-parse -q --verify "refs/tags/v$version^{commit}"); then
    [ "$tag_commit" = "$commit" ] || die "tag v$version is $tag_commit, but the release commit (CHANGELOG.md) is $commit"
  fi
  [ "$(header_version "$commit")" = "$version" ] ||
    die "release commit $commit has $version_header at $(header_version "$commit"), not $version"
  actual=$(archive "$version" "$commit" | sha512sum | cut -d' ' -f1)
  [ "$actual" = "$sha" ] ||
    die "$port/portfile.cmake: SHA512 $sha is not that of the archive of release $version (commit $commit): $actual"
  [ "$(json_version "$dev_port")" = "$(header_version)" ] ||
    die "$dev_port/vcpkg.json is at $(json_version "$dev_port"), the checkout at $(header_version) ($version_header)"
  echo "vcpkg registry port: gpukit $version, SHA512 of the archive of commit ${commit:0:12} ($actual)"
}

verify_download() {
  local version url actual
  version=$(json_version "$port")
  url="https://github.com/gpukit/gpukit/archive/v$version.tar.gz"
  actual=$(curl -fsSL "$url" | sha512sum | cut -d' ' -f1) || die "could not download $url"
  [ "$actual" = "$(port_sha512)" ] || die "$url has SHA512 $actual; the port says $(port_sha512)"
  echo "$url matches the port's SHA512"
}

unreleased_notes() {  # the non-blank lines between "## [Unreleased]" and the next "## " heading
  awk '/^## \[Unreleased\]/ { inside = 1; next } /^## / { inside = 0 } inside && NF' CHANGELOG.md
}

release() {
  local version="$1" skip_tests="$2" current last date commit sha
  [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "\"$version\" is not MAJOR.MINOR.PATCH"
  [ -z "$(git status --porcelain)" ] || die "the working tree has changes; commit or stash them first"
  [ "$(git symbolic-ref -q --short HEAD)" = main ] || die "releases are cut on main, not on $(git symbolic-ref -q --short HEAD || echo 'a detached HEAD')"
  ! git rev-parse -q --verify "refs/tags/v$version" >/dev/null || die "tag v$version exists already"
  current=$(header_version)
  version_le "$current" "$version" || die "$version is older than the checkout's $current ($version_header)"
  last=$(released_versions | sort -V | tail -n 1)
  if [ -n "$last" ]; then
    { version_le "$last" "$version" && [ "$last" != "$version" ]; } || die "$version is not newer than the last release, $last"
  fi
  [ -n "$(unreleased_notes)" ] || die "CHANGELOG.md's \"## [Unreleased]\" section is missing or empty: say what changed"

  echo "release.sh: gpukit $version (checkout at $current, last release ${last:-none})"
  local major minor patch
  IFS=. read -r major minor patch <<<"$version"
  sed -i -e "s/^#define GPUKIT_VERSION_MAJOR [0-9]*$/#define GPUKIT_VERSION_MAJOR $major/" \
         -e "s/^#define GPUKIT_VERSION_MINOR [0-9]*$/#define GPUKIT_VERSION_MINOR $minor/" \
         -e "s/^#define GPUKIT_VERSION_PATCH [0-9]*$/#define GPUKIT_VERSION_PATCH $patch/" "$version_header"
  [ "$(header_version)" = "$version" ] || { git checkout -- .; die "could not set the version in $version_header"; }
  set_json_version "$dev_port" "$version"
  date=$(date -u +%Y-%m-%d)
  sed -i "s/^## \[Unreleased\]$/## [Unreleased]\n\n## [$version] - $date/" CHANGELOG.md

  if [ "$skip_tests" = 0 ]; then
    echo "release.sh: consumer tests (ctest -L packaging) in $build_dir"
    if ! { cmake -S . -B "$build_dir" -DGPUKIT_TEST_PACKAGING=ON >/dev/null &&
           ctest --test-dir "$build_dir" -L packaging -E '^packaging\.(release|vcpkg_release)$' --output-on-failure; }; then
      git checkout -- .
      die "a consumer test failed; nothing was committed"
    fi
  fi

  git commit -q -m "Release gpukit $version" -- "$version_header" "$dev_port/vcpkg.json" CHANGELOG.md
  git tag -a "v$version" -m "gpukit $version"
  commit=$(git rev-parse HEAD)
  mkdir -p "$build_dir"
  archive "$version" "v$version" >"$build_dir/gpukit-$version.tar.gz"
  sha=$(sha512sum "$build_dir/gpukit-$version.tar.gz" | cut -d' ' -f1)
  sed -i "s/^\( *SHA512 \)[0-9A-Za-z]*$/\1$sha/" "$port/portfile.cmake"
  cp "$dev_port/vcpkg.json" "$port/vcpkg.json"  # the release's manifest: its version and its features
  git commit -q -m "vcpkg port: gpukit $version (SHA512 of the release archive)" -- "$port/portfile.cmake" "$port/vcpkg.json"
  check
  cat <<EOF
release.sh: released gpukit $version: commit ${commit:0:12}, tag v$version, archive $build_dir/gpukit-$version.tar.gz
Next: git push origin main v$version, then packaging/release.sh --verify-download, then copy $port into the registry.
EOF
}

case "${1:-}" in
  --check) check ;;
  --verify-download) verify_download ;;
  ""|-h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' ;;
  -*) die "unknown option $1" ;;
  *)
    skip=0
    [ "${2:-}" = --skip-consumer-tests ] && skip=1
    [ $# -le $((1 + skip)) ] || die "unexpected arguments after $1"
    release "$1" "$skip"
    ;;
esac
