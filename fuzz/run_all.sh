#!/usr/bin/env bash
# Runs each named fuzz target for SECONDS, two at a time (a fuzzer keeps one core busy; two
# share a 2-core machine without sharing a core with anything else, since ctest runs this test
# alone). Each target's summary is printed; exit 1 names every target that found a crash.
#   fuzz/run_all.sh BUILD_DIR SECONDS TARGET...
set -euo pipefail
build=$1 seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# Why xargs -P: it waits for every target, and each writes its own log, printed in order below.
printf '%s\n' "$@" | xargs -P 2 -I{} bash -c \
  'bash "$0" "$1" {} "$2" >"$3/{}.log" 2>&1; echo $? >"$3/{}.rc"' \
  "$here/run.sh" "$build" "$seconds" "$logs" || true
failed=()
for target in "$@"; do
  echo "== fuzz_$target"
  cat "$logs/$target.log" 2>/dev/null || true
  rc=$(cat "$logs/$target.rc" 2>/dev/null || echo "not run")
  [ "$rc" = 0 ] || failed+=("$target (exit $rc)")
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz targets that failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: $# targets ran $seconds s each without a crash"
