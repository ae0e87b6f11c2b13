#!/bin/bash
# Model M's steps/s in paired rounds: one run of each configuration per round, back to back, so
# that a VM whose speed drifts within minutes affects every configuration of a round alike.
#
#   bench/train/paired_rounds.sh ROUNDS NAME:VAR=VALUE...
#
# A NAME starting with 1p runs on 1 process, one starting with 2x1p runs two 1-process runs at once
# (no collectives between them; their mean steps/s is printed), any other under accel-launch
# -n 2; VAR=VALUE is put in that run's environment (X=1 for none), a --flag=value word (one word,
# with =) is given to bench_train. Prints each run, then per configuration the median
# steps/s and the median of the rounds' ratios to the first configuration. Example (the split
# optimizer step against the whole step on every process, docs/benchmarks.md):
#
#   bench/train/paired_rounds.sh 8 1p:X=1 split:X=1 whole:ACCEL_SPLIT_OPTIMIZER_STEP=0
#
# and two processes without collectives against one alone:
#
#   bench/train/paired_rounds.sh 4 1p:X=1 2x1p:X=1 2p:X=1
set -euo pipefail
build=${BUILD:-build}
# A configuration's words: those that start with -- are bench_train's flags, the rest env's.
words() {
  local w kind
  for w in $2; do
    kind=env
    [[ $w == --* ]] && kind=flags
    [[ $kind == "$1" ]] && printf '%s ' "$w"
  done
  return 0
}
rounds=$1
shift
export OMP_NUM_THREADS=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for _ in $(seq "$rounds"); do
  for cfg in "$@"; do
    name=${cfg%%:*}
    vars=${cfg#*:}
    if [[ $name == 1p* || $name == 2x1p* ]]; then
      run=("$build/bin/bench_train")
    else
      run=("$build/bin/accel-launch" -n 2 -- "$build/bin/bench_train")
    fi
    copies=1
    [[ $name == 2x1p* ]] && copies=2
    for _ in $(seq "$copies"); do
      # shellcheck disable=SC2046  # VAR=VALUE and --flag=value words, split on purpose
      env $(words env "$vars") "${run[@]}" --model M --steps 150 --warmup 15 $(words flags "$vars") 2>/dev/null |
        grep -o '{.*' &
    done | python3 -c "
import json, sys
rates = [json.loads(line)['steps_per_s'] for line in sys.stdin]
print('$name', round(sum(rates) / len(rates), 2))" | tee -a "$out"
  done
done
python3 - "$out" "$@" <<'PY'
import statistics, sys
names = [c.split(":", 1)[0] for c in sys.argv[2:]]
runs = [line.split() for line in open(sys.argv[1])]
rounds = [dict((n, float(v)) for n, v in runs[i:i + len(names)]) for i in range(0, len(runs), len(names))]
print(f"\n| configuration | median steps/s | median of the rounds' ratio to {names[0]} |")
print("|---|---:|---:|")
for n in names:
    med = statistics.median(r[n] for r in rounds)
    ratio = statistics.median(r[n] / r[names[0]] for r in rounds)
    print(f"| {n} | {med:.2f} | {ratio:.3f} |")
PY
