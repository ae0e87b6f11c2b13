#!/bin/bash
# Start-up stress: RUNS launches of a 2-rank Python init_process_group + all_reduce program and
# RUNS of a libaccel training program, each under accel-launch; any failed start-up fails the
# test, with its output. Bounded: each launch is killed after 120 s.
#
# usage: startup.sh ACCEL_LAUNCH PYTHON_WORKER LIBACCEL_PROGRAM [RUNS]
set -u
launch=$1 py_worker=$2 lib_program=$3 runs=${4:-200}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for kind in python libaccel; do
  failed=0
  start=$(date +%s)
  for i in $(seq 1 "$runs"); do
    if [ "$kind" = python ]; then
      cmd=(/usr/bin/python3 "$py_worker")
    else
      cmd=("$lib_program" --epochs 1 --samples 256 --log-every 0)
    fi
    if ! timeout -s KILL 120 "$launch" -n 2 "${cmd[@]}" >"$tmp/out" 2>&1; then
      failed=$((failed + 1))
      echo "--- $kind start-up $i of $runs failed:"
      tail -40 "$tmp/out"
    fi
  done
  echo "$kind: $((runs - failed)) of $runs start-ups succeeded in $(($(date +%s) - start)) s"
  [ "$failed" -eq 0 ] || status=1
done
exit $status
