#!/usr/bin/env bash
# Runs one fuzz target for a bounded time over its seed corpus (fuzz/corpus/<name>), in a scratch
# copy so the repository's corpus is never written. Exit 0: no crash; otherwise the fuzzer's code,
# with the crashing input printed (as hex) to turn into a unit test.
#   fuzz/run.sh BUILD_DIR NAME SECONDS
set -euo pipefail
build=$1 name=$2 seconds=$3
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$work/artifacts"
cp -r "$here/corpus/$name/." "$work/corpus/" 2>/dev/null || true
set +e
"$build/fuzz_$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=262144 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" 2>"$work/log"
rc=$?
set -e
tail -n 12 "$work/log"
if [ $rc -ne 0 ]; then
  for f in "$work"/artifacts/*; do
    [ -f "$f" ] || continue
    echo "fuzz_$name: crashing input $(basename "$f") ($(stat -c %s "$f") bytes):"
    od -An -tx1 -v "$f" | head -40
  done
  grep -m1 -A30 "ERROR:" "$work/log" || true
fi
exit $rc
