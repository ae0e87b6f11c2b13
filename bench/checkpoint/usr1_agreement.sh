#!/usr/bin/env bash
# What the SIGUSR1 "save and stop" agreement costs: with a checkpoint folder, libaccel's ranks do
# one 4-byte all-reduce per optimizer step to agree on a pending SIGUSR1. This times
# `accel-launch -n 2 train_classifier` with and without --checkpoint-dir (interval 0, so nothing
# is saved), in alternating pairs so both see the same machine, and prints a table.
#
#   bench/checkpoint/usr1_agreement.sh [PAIRS] [EPOCHS]      (defaults: 8 pairs, 20 epochs)
set -euo pipefail
pairs=${1:-8} epochs=${2:-20}
here=$(cd "$(dirname "$0")/../.." && pwd)
bin=$here/build/bin
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--epochs "$epochs" --train-samples 8000)
steps=$((epochs * 8000 / 64))  # 2 processes x batch 32
ms() { local s e; s=$(date +%s%N); "$@" >/dev/null 2>&1; e=$(date +%s%N); echo $(((e - s) / 1000000)); }
printf '%-5s %12s %18s\n' pair "without (ms)" "checkpoint dir (ms)"
total_a=0 total_b=0
for i in $(seq "$pairs"); do
  a=$(ms "$bin/accel-launch" -q -n 2 "$bin/train_classifier" "${args[@]}")
  b=$(ms "$bin/accel-launch" -q -n 2 --checkpoint-dir "$work/ck$i" "$bin/train_classifier" "${args[@]}")
  printf '%-5s %12s %18s\n' "$i" "$a" "$b"
  total_a=$((total_a + a)) total_b=$((total_b + b))
done
awk -v a="$total_a" -v b="$total_b" -v n="$pairs" -v s="$steps" 'BEGIN {
  printf "mean  %12.0f %18.0f   difference %+.1f%%, %+.1f us per step (%d steps)\n",
         a / n, b / n, (b - a) / a * 100, (b - a) / n * 1000 / s, s }'
