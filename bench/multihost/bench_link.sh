#!/usr/bin/env bash
# What a slow link costs: training steps/s of models T and M on 2 "hosts" (network namespaces,
# tests/multihost/bed.sh) x 1 process, with h2's packets reaching h1 0, 5 and 50 ms late
# (one-way delay: RTT +D), libaccel (accel-launch --nodes 2 ... bench_train) against PyTorch DDP
# (torchrun --nnodes 2 ... bench/train/ddp_bench.py) in the same run. Prints a Markdown table.
#
#   sudo bench/multihost/bench_link.sh [BUILD_DIR]      (default: build; exit 77: cannot run here)
#   LINK_DELAYS="0 5 50" LINK_MODELS="T M" ...            the delays (ms) and models to measure
#
# Needs root (namespaces, iptables), BUILD_DIR/bin/{accel-launch,bench_train,nfq_delay} and
# /usr/bin/python3 with torch. The kernel may have no sch_netem: the delay is bed_delay's, an
# NFQUEUE rule on h1's INPUT for h2's packets and bench/multihost/nfq_delay (which holds each one
# D ms). Step counts are bench/train/bench_train.py's at 0 ms and fewer with a delay (STEPS below),
# so that each run stays near 20 s; each figure is one run. About 3 minutes on 2 vCPUs.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" 2>/dev/null && pwd) || { echo "skipped: no build folder ${1:-$root/build}"; exit 77; }
PYTHON=/usr/bin/python3
# shellcheck source=tests/multihost/bed.sh
source "$root/tests/multihost/bed.sh"

if ! why=$(bed_preflight); then
  echo "skipped: $why"
  exit 77
fi
for x in accel-launch bench_train nfq_delay; do
  [[ -x "$build/bin/$x" ]] || { echo "skipped: no $build/bin/$x (nfq_delay needs libnetfilter-queue-dev)"; exit 77; }
done
"$PYTHON" -c 'import torch' 2>/dev/null || { echo "skipped: $PYTHON has no torch"; exit 77; }
export BED_NFQ_DELAY=$build/bin/nfq_delay

read -ra DELAYS <<<"${LINK_DELAYS:-0 5 50}"
read -ra MODELS <<<"${LINK_MODELS:-T M}"
# "steps warmup" per model and delay: bench_train.py's (2000/100, 150/15) at 0 ms; with a delay,
# each step waits for the gradient all-reduce's messages across the link, so fewer steps.
declare -A STEPS=([T,0]="2000 100" [T,5]="600 30" [T,50]="100 10"
  [M,0]="150 15" [M,5]="60 6" [M,50]="20 3")
steps_for() { # MODEL DELAY -> "steps warmup"
  local s=${STEPS[$1,$2]:-}
  if [[ -z "$s" ]]; then # another delay: T ~ 1 step per 2 round trips, M ~ 4 steps/s at most
    if [[ $1 == T ]]; then s="$((20000 / ($2 * 4 + 10))) 5"; else s="20 3"; fi
  fi
  echo "$s"
}

CPUS=$(nproc --all)
ACCEL_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
export ACCEL_TOKEN OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0
unset ACCEL_CONFIG_FILE
WORK=$(mktemp -d "${TMPDIR:-/tmp}/accel-bench-link-XXXXXX")
chmod 0755 "$WORK"
trap 'bed_down; rm -rf "$WORK"' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
bed_up 2 || { echo "skipped: cannot make a 2-host bed"; exit 77; }
MAIN=$(bed_ip h1)
RUN_TIMEOUT=${LINK_RUN_TIMEOUT:-180}
port=29400
failed=0

# json_field LOG FIELD: FIELD of the first JSON line of LOG (prefixes such as "[rank 0] " skipped).
json_field() {
  "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys
for line in open(sys.argv[1], errors="replace"):
    if "{" in line:
        print(json.loads(line[line.index("{"):])[sys.argv[2]])
        break
EOF
}

# run_pair NAME CMD_H1... ::: CMD_H2...: both started at once, each bounded by RUN_TIMEOUT;
# SPS = h1's steps/s, or "failed" (and the logs' tails on stderr).
run_pair() {
  local name=$1 i pids=() rcs=() cmd1=() cmd2=()
  shift
  while [[ $1 != ::: ]]; do cmd1+=("$1"); shift; done
  shift
  cmd2=("$@")
  bed_spawn h1 "$WORK/$name-h1.log" "${cmd1[@]}"
  pids+=("$BED_PID")
  bed_spawn h2 "$WORK/$name-h2.log" "${cmd2[@]}"
  pids+=("$BED_PID")
  for i in 0 1; do
    bed_wait "${pids[$i]}" "$RUN_TIMEOUT"
    rcs+=("$?")
    ((rcs[i] == 124)) && bed_kill "${pids[$i]}"
  done
  if [[ ${rcs[*]} == "0 0" ]] && SPS=$(json_field "$WORK/$name-h1.log" steps_per_s) && [[ -n "$SPS" ]]; then
    return 0
  fi
  {
    echo "bench_link: $name failed (exit codes h1 ${rcs[0]}, h2 ${rcs[1]}):"
    for i in h1 h2; do echo "--- $i:"; tail -n 15 "$WORK/$name-$i.log"; done
  } >&2
  SPS=failed
  return 1
}

accel_run() { # DELAY MODEL STEPS WARMUP
  port=$((port + 1))
  local args=(--nodes 2 --main-process-ip "$MAIN" --coordinator-port "$port" -n 1
    --num-cpu-threads-per-process 1 -q -- "$build/bin/bench_train" --model "$2" --steps "$3" --warmup "$4")
  run_pair "accel-$1ms-$2" "$build/bin/accel-launch" --machine-rank 0 "${args[@]}" ::: \
    "$build/bin/accel-launch" --machine-rank 1 "${args[@]}"
}

ddp_run() { # DELAY MODEL STEPS WARMUP
  port=$((port + 1))
  local args=(--nnodes 2 --nproc_per_node 1 --master_addr "$MAIN" --master_port "$port"
    --monitor_interval 0.1 --redirects 9:0 --tee 9:0 "$root/bench/train/ddp_bench.py"
    --model "$2" --steps "$3" --warmup "$4")
  run_pair "ddp-$1ms-$2" "$PYTHON" -m torch.distributed.run --node_rank 0 "${args[@]}" ::: \
    "$PYTHON" -m torch.distributed.run --node_rank 1 "${args[@]}"
}

rtt() { # h1's ping to h2 (user to user: ping's kernel timestamps are taken before the delay)
  bed_run h1 ping -c 1 -q "$(bed_ip h2)" >/dev/null # ARP first
  bed_run h1 ping -U -c 5 -i 0.2 -q "$(bed_ip h2)" | awk -F/ '/^rtt/ { print $5 }'
}

declare -A ACC DDP
notes=()
start=$SECONDS
cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
echo "bench_link: $CPUS CPUs ($cpu), 2 hosts x 1 process, OMP_NUM_THREADS=1" >&2
for d in "${DELAYS[@]}"; do
  if [[ $d == 0 ]]; then bed_undelay h2; else bed_delay h2 "$d" || { echo "bench_link: bed_delay h2 $d failed" >&2; exit 1; }; fi
  r=$(rtt)
  notes+=("delay $d ms: ping RTT h1<->h2 $r ms (mean of 5)")
  echo "bench_link: delay $d ms, RTT $r ms" >&2
  for m in "${MODELS[@]}"; do
    read -r s w <<<"$(steps_for "$m" "$d")"
    t0=$SECONDS
    accel_run "$d" "$m" "$s" "$w" || failed=1
    ACC[$d,$m]=$SPS
    t1=$SECONDS
    ddp_run "$d" "$m" "$s" "$w" || failed=1
    DDP[$d,$m]=$SPS
    echo "bench_link: delay $d ms, model $m, $s steps (+$w warm-up): accel ${ACC[$d,$m]} steps/s ($((t1 - t0)) s), DDP ${DDP[$d,$m]} steps/s ($((SECONDS - t1)) s)" >&2
  done
  if [[ $d != 0 ]]; then
    bed_undelay h2
    notes+=("delay $d ms: $(sed -n 's/^nfq_delay: stopped; //p' "$BED_DIR/h1/nfq_delay-from-h2.log")")
  fi
done

ratio() { # A B -> A/B with 2 decimals, "-" when either is not a number
  awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else printf "-" }'
}
echo
echo "| one-way delay | model | steps (+warm-up) | accel steps/s | DDP steps/s | accel / DDP | accel vs its 0 ms | DDP vs its 0 ms |"
echo "|---|---|---|---|---|---|---|---|"
for d in "${DELAYS[@]}"; do
  for m in "${MODELS[@]}"; do
    read -r s w <<<"$(steps_for "$m" "$d")"
    echo "| $d ms | $m | $s (+$w) | ${ACC[$d,$m]} | ${DDP[$d,$m]} | $(ratio "${ACC[$d,$m]}" "${DDP[$d,$m]}") |" \
      "$(ratio "${ACC[$d,$m]}" "${ACC[0,$m]:-}") | $(ratio "${DDP[$d,$m]}" "${DDP[0,$m]:-}") |"
  done
done
echo
for n in "${notes[@]}"; do echo "* $n"; done
echo "* total $((SECONDS - start)) s"
exit "$failed"
