#!/usr/bin/env bash
# Multi-host scenarios on a bed of network namespaces (bed.sh: hosts h1..hN at 10.77.0.N, each
# with its own /etc/hosts, host name and TMPDIR; faults made with iptables and signals):
#  bed        the bed itself: nothing in the root namespace, names, partitions (both ways, one
#             way, one port, all but one port), loss, freeze/thaw, crash;
#  baseline   3 hosts x 2 processes (mode 2), train_classifier with checkpoints and --save-model;
#             every launcher exits 0; its model is the reference;
#  kill       the same job, a worker on h2 SIGKILLed (by pid) after the first checkpoint, with
#             --max-restarts 1: the group resumes from the checkpoint and the model is byte for
#             byte the baseline's;
#  partition  the same job with --max-restarts 0; after the first checkpoint, h2 and h3 cannot reach
#             each other (both ways; h1 and the coordinator on it stay reachable) for 30 s: with the
#             default network_timeout (10 s) the launchers report it within 15 s naming both
#             hosts, the restart is not counted, the next round's nodes say they wait to reach
#             each other and start no worker until the heal, and the model is the baseline's;
#  lasting    the same partition, never healed, with --join-timeout 8s and --max-restarts 0: the
#             first report restarts the job uncounted, the next round's nodes wait 8 s for each
#             other and then fail that round, which counts: the launchers exit 1 with the
#             summary's root cause "network: ... (hN's workers of the round never started)";
#  loopback   Debian's `127.0.1.1 hI` in every /etc/hosts, --main-process-ip h1: node 0's launcher
#             fails within 5 s with exit code 2, naming 127.0.1.1 / loopback and the fix (node 1,
#             to which h1 is 10.77.0.1, gives up after its join_timeout with 125);
#  debian     the same /etc/hosts, --main-process-ip 10.77.0.1: the 2-node job succeeds, since
#             accel gives the workers GLOO_SOCKET_IFNAME=eth0 (with it set empty, the control, gloo
#             takes 127.0.1.1 from the host name and the job fails, the summary saying how long
#             the connection took and suggesting GLOO_SOCKET_IFNAME);
#  outage     mode 3: a coordinator on h1, standing agents on h2 and h3, the launcher on h4; h1 and
#             h4 partitioned for 75 s while the job runs (it ends during the outage): the launcher
#             keeps following, says the coordinator is back, prints the job's output and end, and
#             exits 0;
#  nodeloss   mode 3 with in-memory snapshots at every step (--snapshot-interval 1, no checkpoints):
#             a coordinator (3 s lease) and the launcher on h1, standing agents on h2 and h3; the
#             job once through, its model the reference; then again, h3 crashed (every process
#             SIGKILLed) once epoch 0 is done and a new agent started there: the restarted group
#             gets h2's snapshot over the bed's network (h3's went with its agent), resumes in
#             epoch 1 or later, and ends with the reference's model, byte for byte.
#   tests/multihost/run.sh BIN_DIR [SCENARIO...]    (exit 77: cannot run here, skipped)
#   MULTIHOST_KEEP=1 tests/multihost/run.sh ...      keeps the logs, checkpoints and models
#   MULTIHOST_OUTAGE=20 ... outage                     a shorter outage (default 75 s), to try it
# Each scenario prints `PASS name (Ns)` or `FAIL name: why (Ns)` and the tails of its logs.
#
# Adding a scenario: write scenario_NAME (it runs in a subshell: `fail WHY` ends it, and its bed
# is taken down whatever happens) and add NAME to SCENARIOS. For example:
#   scenario_split() {
#     bed_up 3
#     start_mode2 job h1 -n 2 "$bin/train_classifier" --epochs 50
#     wait_log "$SC/job-h1.log" 'all 6 workers of round 0 started' 30 "the job's start"
#     bed_partition h2 h3                 # the coordinator on h1 stays reachable
#     wait_log "$SC/job-h1.log" 'network: h2 cannot reach h3' 15 "the partition report"
#   }
# Helpers: start_mode2, wait_job, expect_job_rcs, wait_log, worker_pids, same_model, fail, and
# every bed_* function of bed.sh.
# The scenarios are called by name (scenario_$name), which shellcheck cannot follow (SC2317);
# bed_heal without arguments heals every host (SC2119).
# shellcheck disable=SC2317,SC2119
set -uo pipefail
bin=$(cd "${1:?usage: run.sh BIN_DIR [SCENARIO...]}" && pwd)
shift
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/multihost/bed.sh
source "$here/bed.sh"

SCENARIOS=(bed baseline kill partition lasting loopback debian outage nodeloss)
(($# > 0)) && SCENARIOS=("$@")

if ! why=$(bed_preflight); then
  echo "skipped: $why"
  exit 77
fi
for x in accel-launch accel-agent train_classifier; do
  [[ -x "$bin/$x" ]] || { echo "FAIL: no $bin/$x"; exit 1; }
done

TOP=$(mktemp -d "${TMPDIR:-/tmp}/accel-multihost-$$-run-XXXXXX")
chmod 0755 "$TOP"
# MULTIHOST_KEEP=1 keeps the scenarios' folders (logs, checkpoints, models) and says where.
if [[ ${MULTIHOST_KEEP:-0} == 1 ]]; then
  trap 'bed_down; echo "kept $TOP"' EXIT
else
  trap 'bed_down; rm -rf "$TOP"' EXIT
fi
sc_pid=""
# Ctrl-C or SIGTERM: the running scenario is stopped (its subshell takes its bed down), then this
# shell exits (and removes $TOP).
forward_stop() {
  echo "multihost: stopped by SIG$([[ $1 == 130 ]] && echo INT || echo TERM)"
  if [[ -n "$sc_pid" ]]; then
    kill -TERM "$sc_pid" 2>/dev/null
    wait "$sc_pid" 2>/dev/null
  fi
  exit "$1"
}
trap 'forward_stop 130' INT
trap 'forward_stop 143' TERM
ACCEL_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
export ACCEL_TOKEN
# The job of baseline and kill: 4 epochs of 12000 samples, 63 steps each on 6 processes (about
# 4 s on 2 vCPUs); a checkpoint every 50 steps.
CLASSIFIER=(--epochs 4 --train-samples 12000)
CHECKPOINT_INTERVAL=50
REFERENCE=$TOP/reference/model.safetensors

# ---- helpers (used inside a scenario's subshell; SC is the scenario's folder, also its cwd)

fail() {
  echo "$*" >"$SC/why"
  exit 1
}

# wait_log FILE REGEX SECONDS WHAT: fail unless FILE has a line matching REGEX within SECONDS.
wait_log() {
  bed_wait_log "$1" "$2" "$3" || fail "waited $3 s for $4 in vain (no line matching '$2' in $(basename "$1"))"
}

# start_mode2 NAME MAIN ACCEL_LAUNCH_ARGS...: one `accel-launch --nodes N --machine-rank I
# --main-process-ip MAIN ARGS...` on each host of JOB_HOSTS (default h1..hN of the bed), machine
# rank I on JOB_HOSTS[I]; logs in $SC/NAME-<host>.log, pids in JOB_PIDS (same order).
start_mode2() {
  local name=$1 main=$2 i
  shift 2
  ((${#JOB_HOSTS[@]} > 0)) || for ((i = 1; i <= BED_N; i++)); do JOB_HOSTS+=("h$i"); done
  JOB_PIDS=()
  JOB_LOGS=()
  for i in "${!JOB_HOSTS[@]}"; do
    JOB_LOGS+=("$SC/$name-${JOB_HOSTS[$i]}.log")
    bed_spawn "${JOB_HOSTS[$i]}" "${JOB_LOGS[$i]}" "$bin/accel-launch" --nodes "${#JOB_HOSTS[@]}" \
      --machine-rank "$i" --main-process-ip "$main" "$@"
    JOB_PIDS+=("$BED_PID")
  done
}
JOB_HOSTS=()

# wait_job SECONDS: waits (SECONDS in all) for every launcher of start_mode2; their exit codes
# in JOB_RCS (124: still running).
wait_job() {
  local end=$((SECONDS + $1)) i left
  JOB_RCS=()
  for i in "${!JOB_PIDS[@]}"; do
    left=$((end - SECONDS))
    ((left > 0)) || left=0
    bed_wait "${JOB_PIDS[$i]}" "$left"
    JOB_RCS+=("$?")
  done
}

# expect_job_rcs CODE SECONDS: fail unless every launcher exits with CODE within SECONDS.
expect_job_rcs() {
  wait_job "$2"
  local i bad=""
  for i in "${!JOB_RCS[@]}"; do
    [[ ${JOB_RCS[$i]} == "$1" ]] || bad+=" ${JOB_HOSTS[$i]}:${JOB_RCS[$i]}"
  done
  [[ -z "$bad" ]] || fail "launchers' exit codes (want $1 within $2 s; 124 = still running):$bad"
}

# worker_pids HOST: the train_classifier processes on HOST.
worker_pids() { bed_find_pids "$1" "^$bin/train_classifier( |\$)"; }

same_model() { cmp -s "$1" "$2"; }

# expect_resumed_to_reference: fail unless the restarted group resumed from a checkpoint and
# the saved model is the baseline's, byte for byte.
expect_resumed_to_reference() {
  grep -qE 'resumed from .*checkpoint_[0-9]+ at step [1-9]' "$SC/job-h1.log" ||
    fail "the restarted group did not resume from a checkpoint"
  [[ -s "$SC/model/model.safetensors" ]] || fail "no model/model.safetensors"
  same_model "$SC/model/model.safetensors" "$REFERENCE" ||
    fail "the model differs from the baseline's ($(cmp "$SC/model/model.safetensors" "$REFERENCE" 2>&1))"
}

# ---- scenarios

# The root namespace's interfaces, addresses and routes, one a line.
root_net() { { ip -o link show | awk -F': ' '{ print $2 }'; ip -o addr show; ip route show; } | sort; }

scenario_bed() {
  local before added
  before=$(root_net)
  bed_up 3
  added=$(comm -13 <(echo "$before") <(root_net) | grep -E "(^|[ @])(h[0-9]+|eth0|br0)([ @:]|$)|$BED_SUBNET\.")
  [[ -z "$added" ]] || fail "the bed added to the root namespace: $added"
  [[ $(bed_run h2 hostname) == h2 ]] || fail "h2's host name is $(bed_run h2 hostname)"
  [[ $(bed_run h2 getent hosts h3) == "$BED_SUBNET.3"* ]] || fail "h3 from h2: $(bed_run h2 getent hosts h3)"
  # shellcheck disable=SC2016 # expanded on h1
  [[ $(bed_run h1 sh -c 'echo $TMPDIR') == "$BED_DIR/h1/tmp" ]] || fail "h1's TMPDIR"
  local p
  p=$(bed_probe h1 h2 9 1)
  [[ $p == refused ]] || fail "h1 -> h2 before any fault: $p (want refused: reachable, no listener)"
  bed_partition h1 h2
  [[ $(bed_probe h1 h2 9 1) == dropped && $(bed_probe h2 h1 9 1) == dropped ]] ||
    fail "h1 and h2 partitioned, yet a probe got through"
  [[ $(bed_probe h1 h3 9 1) == refused ]] || fail "partitioning h1 and h2 cut h1 from h3"
  bed_heal
  [[ $(bed_probe h1 h2 9 1) == refused ]] || fail "h1 -> h2 after bed_heal"
  # One way, packets from h1 to h2: h2's SYN reaches h1 (nothing dropped coming in), h1's reply
  # is dropped going out.
  bed_partition h1 h2 oneway
  bed_probe h2 h1 9 1 >/dev/null
  [[ $(bed_dropped h1 in) == 0 && $(bed_dropped h1 out) -gt 0 ]] ||
    fail "one-way h1 -> h2: dropped in $(bed_dropped h1 in), out $(bed_dropped h1 out)"
  bed_heal
  bed_partition_port h1 h2 9
  [[ $(bed_probe h1 h2 9 1) == dropped && $(bed_probe h1 h2 10 1) == refused ]] || fail "--port 9"
  bed_heal
  bed_partition_except h1 h2 9
  [[ $(bed_probe h1 h2 9 1) == refused && $(bed_probe h2 h1 9 1) == refused &&
    $(bed_probe h1 h2 10 1) == dropped ]] || fail "--except-port 9"
  bed_heal
  bed_loss h3 100
  [[ $(bed_probe h1 h3 9 1) == dropped ]] || fail "100 % loss on h3"
  bed_heal
  [[ $(bed_probe h1 h3 9 1) == refused ]] || fail "h1 -> h3 after healing the loss"
  bed_spawn h3 "$SC/sleep.log" sleep 60
  local pid=$BED_PID state
  bed_wait_for 5 test -n "$(bed_pids h3)" || fail "no process on h3"
  [[ $(bed_pids h3) == "$pid" ]] || fail "h3's pids: $(bed_pids h3), spawned $pid"
  bed_freeze h3
  state=$(awk '{ print $3 }' "/proc/$pid/stat")
  [[ $state == T ]] || fail "frozen h3: state $state"
  bed_thaw h3
  state=$(awk '{ print $3 }' "/proc/$pid/stat")
  [[ $state == S ]] || fail "thawed h3: state $state"
  bed_crash h3
  bed_wait "$pid" 5
  p=$?
  [[ $p == 137 ]] || fail "crashed h3: exit code $p"
  return 0
}

scenario_baseline() {
  bed_up 3
  start_mode2 job h1 -n 2 --checkpoint-dir "$SC/ck" --checkpoint-interval "$CHECKPOINT_INTERVAL" \
    "$bin/train_classifier" "${CLASSIFIER[@]}" --save-model "$SC/model"
  expect_job_rcs 0 90
  grep -q 'all 6 workers of round 0 started' "$SC/job-h1.log" || fail "h1: no 'all 6 workers of round 0 started'"
  grep -q 'restarting' "$SC/job-h1.log" && fail "h1: the fault-free job restarted"
  [[ -d "$SC/ck/checkpoints" ]] || fail "no checkpoint was saved"
  [[ -s "$SC/model/model.safetensors" ]] || fail "no model/model.safetensors"
  mkdir -p "$(dirname "$REFERENCE")"
  cp "$SC/model/model.safetensors" "$REFERENCE"
}

scenario_kill() {
  [[ -s "$REFERENCE" ]] || fail "no reference model: the baseline scenario did not pass, or did not run first (run.sh BIN_DIR baseline kill)"
  bed_up 3
  start_mode2 job h1 -n 2 --max-restarts 1 --checkpoint-dir "$SC/ck" \
    --checkpoint-interval "$CHECKPOINT_INTERVAL" "$bin/train_classifier" "${CLASSIFIER[@]}" \
    --save-model "$SC/model"
  bed_wait_for 60 test -d "$SC/ck/checkpoints/checkpoint_0" || fail "no first checkpoint within 60 s"
  local pids victim
  pids=$(worker_pids h2)
  victim=$(echo "$pids" | head -n 1)
  [[ -n "$victim" ]] || fail "no train_classifier on h2 once the first checkpoint was saved"
  bed_running "${JOB_PIDS[0]}" || fail "the job ended before the kill"
  kill -KILL "$victim"
  echo "killed worker pid $victim on h2 (h2's workers: $(echo "$pids" | tr '\n' ' '))" >"$SC/kill.txt"
  expect_job_rcs 0 120
  grep -qE "restarting: rank [0-9]+ on h2 \(pid $victim\) failed: SIGKILL" "$SC/job-h1.log" ||
    fail "h1's launcher does not say it restarts after rank on h2 (pid $victim) got SIGKILL"
  expect_resumed_to_reference
}

scenario_partition() {
  [[ -s "$REFERENCE" ]] || fail "no reference model: the baseline scenario did not pass, or did not run first (run.sh BIN_DIR baseline partition)"
  local hold=30
  bed_up 3
  start_mode2 job h1 -n 2 --max-restarts 0 --checkpoint-dir "$SC/ck" \
    --checkpoint-interval "$CHECKPOINT_INTERVAL" "$bin/train_classifier" "${CLASSIFIER[@]}" \
    --save-model "$SC/model"
  bed_wait_for 60 test -d "$SC/ck/checkpoints/checkpoint_0" || fail "no first checkpoint within 60 s"
  bed_running "${JOB_PIDS[0]}" || fail "the job ended before the partition"
  bed_partition h2 h3
  local cut=$SECONDS t_report t_wait
  wait_log "$SC/job-h1.log" 'network: h[23] cannot reach h[23] \(10\.77\.0\.[23]\) since' 15 \
    "the partition's report naming h2 and h3 (network_timeout 10 s)"
  t_report=$((SECONDS - cut))
  wait_log "$SC/job-h1.log" 'restarting: network: h[23] cannot reach h[23].*not counted against max_restarts' \
    10 "an uncounted restart for the partition"
  bed_wait_for $((hold - (SECONDS - cut))) grep -qE 'waiting to reach every node before starting the workers: h[23] cannot reach h[23]' \
    "$SC/job-h2.log" "$SC/job-h3.log" || fail "no node of the next round said it waits to reach the others"
  t_wait=$((SECONDS - cut))
  while ((SECONDS - cut < hold)); do
    bed_running "${JOB_PIDS[0]}" || fail "the job ended during the partition"
    sleep 0.5
  done
  grep -q 'all 6 workers of round 1 started' "$SC/job-h1.log" &&
    fail "round 1's workers all started while h2 and h3 could not reach each other"
  bed_heal
  local healed=$SECONDS
  wait_log "$SC/job-h2.log" 'every node answers again; starting the workers' 15 "h2 starting its workers after the heal"
  expect_job_rcs 0 120
  printf 'partition h2 | h3 for %s s: reported after %s s, waiting line after %s s; job ended %s s after the heal\n' \
    "$((healed - cut))" "$t_report" "$t_wait" "$((SECONDS - healed))" >"$SC/partition.txt"
  expect_resumed_to_reference
}

scenario_lasting() {
  bed_up 3
  start_mode2 job h1 -n 2 --max-restarts 0 --join-timeout 8s "$bin/train_classifier" \
    --epochs 400 --train-samples 12000
  wait_log "$SC/job-h1.log" 'all 6 workers of round 0 started' 60 "the job's start"
  bed_partition h2 h3
  local cut=$SECONDS
  wait_log "$SC/job-h1.log" 'not counted against max_restarts' 20 "an uncounted restart for the partition"
  expect_job_rcs 1 60
  grep -qE '^\* .*network: h[23] cannot reach h[23] .*\(h[23].s workers of the round never started\)' "$SC/job-h1.log" ||
    fail "the summary's root cause is not the partition that kept the round's workers from starting"
  grep -q 'no restarts left (max_restarts 0)' "$SC/job-h1.log" || fail "h1 does not say no restarts were left"
  echo "partition h2 | h3, never healed: the job failed $((SECONDS - cut)) s after the cut" >"$SC/lasting.txt"
}

scenario_loopback() {
  bed_up 2 --debian-hosts
  [[ $(bed_run h1 getent hosts h1) == 127.0.1.1* ]] || fail "h1 does not resolve its own name to 127.0.1.1"
  local t0=$SECONDS rc
  bed_spawn h1 "$SC/node0.log" "$bin/accel-launch" --nodes 2 --machine-rank 0 --main-process-ip h1 \
    -n 2 "$bin/train_classifier" --epochs 1
  local p0=$BED_PID
  bed_spawn h2 "$SC/node1.log" "$bin/accel-launch" --nodes 2 --machine-rank 1 --main-process-ip h1 \
    --join-timeout 3s -n 2 "$bin/train_classifier" --epochs 1
  local p1=$BED_PID
  bed_wait "$p0" 5
  rc=$?
  [[ $rc != 124 ]] || fail "node 0's launcher still runs after 5 s"
  [[ $rc == 2 ]] || fail "node 0's launcher exited with $rc after $((SECONDS - t0)) s, not 2"
  if ! grep -q '127\.0\.1\.1' "$SC/node0.log" || ! grep -q 'loopback' "$SC/node0.log"; then
    fail "node 0's message does not mention 127.0.1.1 and loopback"
  fi
  grep -q 'Give the address of the interface the other machines reach' "$SC/node0.log" ||
    fail "node 0's message does not give the fix"
  bed_wait "$p1" 20
  rc=$?
  [[ $rc == 125 ]] || fail "node 1 (join_timeout 3s, no coordinator) exited with $rc, not 125"
}

scenario_debian() {
  bed_up 2 --debian-hosts
  # shellcheck disable=SC2016 # expanded by the workers' sh
  local prog=(sh -c 'echo "GLOO_SOCKET_IFNAME=[$GLOO_SOCKET_IFNAME]"; exec "$0" --epochs 1'
    "$bin/train_classifier")
  # The control: GLOO_SOCKET_IFNAME set (empty) in the launchers' environment, which accel
  # leaves alone: gloo takes its address from the host name (127.0.1.1), the job fails.
  GLOO_SOCKET_IFNAME="" start_mode2 control "$BED_SUBNET.1" -n 1 -- "${prog[@]}"
  wait_job 60
  [[ " ${JOB_RCS[*]} " != *" 124 "* ]] || fail "the control (GLOO_SOCKET_IFNAME empty) still runs after 60 s"
  [[ " ${JOB_RCS[*]} " != *" 0 "* ]] ||
    fail "the control (GLOO_SOCKET_IFNAME empty) succeeded (exit codes ${JOB_RCS[*]}): does the bed reproduce Debian's 127.0.1.1?"
  grep -q '127\.0\.1\.1' "$SC/control-h1.log" "$SC/control-h2.log" ||
    fail "the control failed without naming 127.0.1.1 (exit codes ${JOB_RCS[*]})"
  # The summary says how long the connection really took (not gloo's whole timeout) and what to set.
  grep -qE 'could not connect to the other 1 rank\(s\) after [0-9]+\.[0-9] s \(collective_timeout' \
    "$SC/control-h1.log" || fail "the control's summary does not say how long the connection took"
  grep -q 'set GLOO_SOCKET_IFNAME to the interface the other machines reach' "$SC/control-h1.log" ||
    fail "the control's summary does not suggest GLOO_SOCKET_IFNAME"
  start_mode2 job "$BED_SUBNET.1" -n 2 -- "${prog[@]}"
  expect_job_rcs 0 60
  local h
  for h in h1 h2; do
    grep -q 'GLOO_SOCKET_IFNAME=\[eth0\]' "$SC/job-$h.log" || fail "$h's workers did not get GLOO_SOCKET_IFNAME=eth0"
  done
}

scenario_outage() {
  local outage=${MULTIHOST_OUTAGE:-75} port=29400 coord
  bed_up 4
  coord=$(bed_ip h1):$port
  bed_spawn h1 "$SC/coordinator.log" "$bin/accel-agent" --serve-coordinator "$coord" --coordinator-only
  wait_log "$SC/coordinator.log" 'coordinator listening' 15 "the coordinator to listen"
  bed_spawn h2 "$SC/agent-h2.log" "$bin/accel-agent" --coordinator "$coord"
  bed_spawn h3 "$SC/agent-h3.log" "$bin/accel-agent" --coordinator "$coord"
  wait_log "$SC/agent-h2.log" 'registered with coordinator' 15 "h2's agent to register"
  wait_log "$SC/agent-h3.log" 'registered with coordinator' 15 "h3's agent to register"
  bed_spawn h4 "$SC/launcher.log" "$bin/accel-launch" --coordinator "$coord" --nodes 2 -n 2 \
    "$bin/train_classifier" --epochs 3
  local launcher=$BED_PID
  wait_log "$SC/launcher.log" 'all 4 workers of round 0 started' 30 "the job's start"
  bed_partition h1 h4
  local cut=$SECONDS t_end t_lost t_back t_exit
  # The job ends during the outage: the agents still reach the coordinator.
  wait_log "$SC/agent-h2.log" 'ended: SUCCEEDED' 60 "the job's end on h2's agent during the outage"
  t_end=$((SECONDS - cut))
  wait_log "$SC/launcher.log" 'lost the coordinator' $((outage - (SECONDS - cut))) \
    "'lost the coordinator' from the launcher during the outage"
  t_lost=$((SECONDS - cut))
  while ((SECONDS - cut < outage)); do
    bed_running "$launcher" || fail "the launcher exited during the outage (after $((SECONDS - cut)) s)"
    sleep 0.5
  done
  bed_heal
  local healed=$SECONDS
  wait_log "$SC/launcher.log" "coordinator at $coord is back" 60 "'the coordinator is back' after the outage"
  t_back=$((SECONDS - healed))
  bed_wait "$launcher" 60
  local rc=$?
  t_exit=$((SECONDS - healed))
  printf 'partition h1 | h4 for %s s; job ended on the agents %s s after the cut, launcher lost the coordinator after %s s; after the heal: back %s s, launcher exit %s s\n' \
    $((healed - cut)) "$t_end" "$t_lost" "$t_back" "$t_exit" >"$SC/outage.txt"
  [[ $rc == 0 ]] || fail "the launcher exited with $rc after the outage (124: still running 60 s after it)"
  # In order: lost, back, the job's output (both nodes), its end.
  local lost back out2 out3 end
  lost=$(grep -n 'lost the coordinator' "$SC/launcher.log" | head -n 1 | cut -d: -f1)
  back=$(grep -n "coordinator at $coord is back" "$SC/launcher.log" | head -n 1 | cut -d: -f1)
  out2=$(grep -n '^\[h2:[0-9]\] epoch 2 ' "$SC/launcher.log" | head -n 1 | cut -d: -f1)
  out3=$(grep -n '^\[h3:[0-9]\] epoch 2 ' "$SC/launcher.log" | head -n 1 | cut -d: -f1)
  end=$(grep -n 'job .* succeeded' "$SC/launcher.log" | tail -n 1 | cut -d: -f1)
  [[ -n "$back" ]] || fail "the launcher never said the coordinator is back"
  [[ -n "$out2" && -n "$out3" ]] || fail "the launcher did not print the last epoch of both nodes"
  [[ -n "$end" ]] || fail "the launcher did not print the job's end"
  ((lost < back && back < out2 && back < out3 && out2 < end && out3 < end)) ||
    fail "out of order: lost line $lost, back $back, h2's output $out2, h3's $out3, end $end"
}

scenario_nodeloss() {
  local port=29410 coord launcher rc
  bed_up 3
  coord=$(bed_ip h1):$port
  bed_spawn h1 "$SC/coordinator.log" "$bin/accel-agent" --serve-coordinator "$coord" \
    --coordinator-only --lease-timeout 3s
  wait_log "$SC/coordinator.log" 'coordinator listening' 15 "the coordinator to listen"
  bed_spawn h2 "$SC/agent-h2.log" "$bin/accel-agent" --coordinator "$coord"
  bed_spawn h3 "$SC/agent-h3.log" "$bin/accel-agent" --coordinator "$coord"
  wait_log "$SC/agent-h2.log" 'registered with coordinator' 15 "h2's agent to register"
  wait_log "$SC/agent-h3.log" 'registered with coordinator' 15 "h3's agent to register"
  local job=(--coordinator "$coord" --nodes 2 -n 2 --snapshot-interval 1 "$bin/train_classifier"
    "${CLASSIFIER[@]}")
  bed_spawn h1 "$SC/reference.log" "$bin/accel-launch" --max-restarts 0 "${job[@]}" \
    --save-model "$SC/reference"
  bed_wait "$BED_PID" 120
  rc=$?
  [[ $rc == 0 ]] || fail "the uninterrupted job exited with $rc (124: still running after 120 s)"
  bed_spawn h1 "$SC/launcher.log" "$bin/accel-launch" --max-restarts 1 "${job[@]}" \
    --save-model "$SC/model"
  launcher=$BED_PID
  wait_log "$SC/launcher.log" '^\[h[23]:[0-9]\] epoch 0 ' 60 "the end of epoch 0"
  bed_crash h3 || fail "h3's processes survived the crash"
  local crashed resumed
  crashed=$(date +%s.%N)
  bed_spawn h3 "$SC/agent-h3-again.log" "$bin/accel-agent" --coordinator "$coord"
  wait_log "$SC/launcher.log" 'resumed from the in-memory snapshot' 60 "the resume after h3's crash"
  resumed=$(date +%s.%N)
  printf 'h3 crashed after epoch 0; resumed from memory %s s later (a 3 s lease); %s\n' \
    "$(awk -v a="$crashed" -v b="$resumed" 'BEGIN { printf "%.1f", b - a }')" \
    "$(grep -oE 'the in-memory snapshot of step [0-9]+ came from .*' "$SC/launcher.log" | head -n 1)" \
    >"$SC/nodeloss.txt"
  bed_wait "$launcher" 120
  rc=$?
  [[ $rc == 0 ]] || fail "the launcher exited with $rc after h3's crash (124: still running after 120 s)"
  grep -qE 'in-memory snapshot of step [0-9]+ came from the memory of rank [0-9]+.s node to 1 node that lacked it' \
    "$SC/launcher.log" || fail "no snapshot was sent to h3's new agent's node"
  grep -qE 'resumed from the in-memory snapshot \S+ at step [0-9]+ \(epoch [1-9]' "$SC/launcher.log" ||
    fail "the restarted group did not resume from memory after epoch 0"
  same_model "$SC/model/model.safetensors" "$SC/reference/model.safetensors" ||
    fail "the model differs from the uninterrupted run's"
}

# ---- run

failed=0
for name in "${SCENARIOS[@]}"; do
  if ! declare -F "scenario_$name" >/dev/null; then
    echo "FAIL $name: no such scenario (${SCENARIOS[*]})"
    failed=1
    continue
  fi
  SC=$TOP/$name
  mkdir -p "$SC"
  start=$SECONDS
  # In the background, so that a signal to this shell is handled at once (forward_stop), not
  # once the scenario ends.
  (
    trap bed_down EXIT
    trap 'exit 143' TERM
    cd "$SC" || exit 1
    "scenario_$name"
  ) </dev/null &
  sc_pid=$!
  wait "$sc_pid"
  rc=$?
  took=$((SECONDS - start))
  if ((rc == 0)); then
    echo "PASS $name (${took}s)"
    [[ -f "$SC/$name.txt" ]] && sed 's/^/  /' "$SC/$name.txt"
  else
    failed=1
    why="exit code $rc"
    [[ -s "$SC/why" ]] && why=$(cat "$SC/why")
    echo "FAIL $name: $why (${took}s)"
    for f in "$SC"/*.log "$SC"/*.txt; do
      [[ -f "$f" ]] || continue
      echo "----- $(basename "$f") (last 25 lines)"
      tail -n 25 "$f"
    done
    echo "-----"
  fi
  sc_pid=""
done
echo "multihost: $([[ $failed == 0 ]] && echo all passed || echo FAILED) in ${SECONDS}s"
exit "$failed"
