#!/usr/bin/env bash
# The Slurm test: a real slurmctld and two slurmd (n1, n2) on this machine (cluster.sh), then
#  1. sbatch -N 2 configs/slurm/train.sbatch: 2 nodes x 2 processes under accel-launch reach the
#     accuracy of one node running 4 processes;
#  2. srun -N2 -n4 train_classifier, no launcher: libaccel reads Slurm's variables; same accuracy;
#  3. a worker killed mid-run: the group restarts from its checkpoint and the job completes;
#  4. scancel mid-run: the job stops, and no process of it is left;
#  5. SIGUSR1 (scancel --signal=USR1): a checkpoint is saved, the job requeues itself and the
#     requeued run resumes from that step.
# Every wait is bounded; the daemons are stopped and the work folder removed on exit.
#   tests/slurm/run.sh BIN_DIR      (exit 77: cannot run here, skipped)
set -euo pipefail
bin=$(cd "${1:?usage: run.sh BIN_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

# Why a cgroup: every process of this test (the Slurm daemons, the jobs' steps, the launchers and
# workers, which slurmstepd starts outside this shell's process tree) is put in one of its own, so
# the test finds and stops its own processes only, never another job's on this machine.
CG=""
for hierarchy in /sys/fs/cgroup/pids /sys/fs/cgroup/freezer /sys/fs/cgroup/unified /sys/fs/cgroup; do
  [[ -d "$hierarchy" ]] && mkdir "$hierarchy/accel-slurm-$$" 2>/dev/null || continue
  if echo $$ >"$hierarchy/accel-slurm-$$/cgroup.procs" 2>/dev/null; then
    CG="$hierarchy/accel-slurm-$$"
    break
  fi
  rmdir "$hierarchy/accel-slurm-$$"
done
if [[ -z "$CG" ]]; then
  echo "no cgroup this test can create and join: skipped"
  exit 77
fi
# The pids of this test's processes whose program is $bin/NAME, NAME an extended regex. Why
# mapfile: a builtin, so no process of this shell's own is among those read.
ours() {
  local pids pid
  mapfile -t pids <"$CG/cgroup.procs"
  for pid in "${pids[@]}"; do
    [[ "$pid" == "$$" ]] && continue
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE "^$bin/($1)( |$)" && echo "$pid"
  done
  return 0
}
# Every process of the test but this shell: SIGKILLed until none is left (bounded), then this
# shell leaves the cgroup and removes it.
stop_ours() {
  local pids pid tries
  for tries in $(seq 1 50); do
    mapfile -t pids <"$CG/cgroup.procs"
    local others=0
    for pid in "${pids[@]}"; do
      [[ "$pid" == "$$" ]] && continue
      others=1
      kill -9 "$pid" 2>/dev/null
    done
    ((others)) || break
    sleep 0.1
  done
  echo $$ >"$(dirname "$CG")/cgroup.procs" 2>/dev/null
  rmdir "$CG" 2>/dev/null
}

W=$(mktemp -d /tmp/accel-slurm.XXXXXX)
chmod 0755 "$W"
failed=1
cleanup() {
  set +e
  if [[ $failed -ne 0 ]]; then
    for f in "$W"/*.out "$W"/slurmctld.log "$W"/slurmd-n1.log; do
      [[ -f "$f" ]] || continue
      echo "----- $f (last 40 lines)"
      tail -n 40 "$f"
    done
  fi
  bash "$here/cluster.sh" stop "$W" >/dev/null 2>&1
  stop_ours
  rm -rf "$W"
}
trap cleanup EXIT

set +e
bash "$here/cluster.sh" start "$W" >/dev/null
rc=$?
set -e
if [[ $rc -eq 77 ]]; then
  failed=0
  exit 77
fi
[[ $rc -eq 0 ]] || { echo "FAIL: the Slurm cluster did not start"; exit 1; }
export SLURM_CONF="$W/slurm.conf"
cd "$W"

step() { echo "== $*"; }
fail() {
  echo "FAIL: $*"
  exit 1
}
job_state() { scontrol show job -o "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_state() {  # wait_state JOB SECONDS STATE...
  local job=$1 limit=$2
  shift 2
  local end=$((SECONDS + limit)) s
  while ((SECONDS < end)); do
    s=$(job_state "$job")
    for want in "$@"; do [[ "$s" == "$want" ]] && return 0; done
    sleep 0.5
  done
  fail "job $job is ${s:-unknown} after ${limit}s, expected one of: $*"
}
wait_line() {  # wait_line FILE SECONDS PATTERN
  local end=$((SECONDS + $2))
  while ((SECONDS < end)); do
    grep -qE "$3" "$1" 2>/dev/null && return 0
    sleep 0.3
  done
  fail "no line matching '$3' in $1 after $2 s"
}
final_accuracy() { grep -oE 'eval_accuracy [0-9.]+' "$1" | tail -n 1 | cut -d' ' -f2; }
no_process_left() {
  local end=$((SECONDS + 20))
  while ((SECONDS < end)); do
    [[ -z "$(ours 'accel-launch|train_classifier')" ]] && return 0
    sleep 0.5
  done
  ours 'accel-launch|train_classifier' | xargs -r ps -o pid=,args= -p || true
  fail "processes of the job are still running 20 s after it ended"
}

ARGS=(--epochs 4 --train-samples 2000 --seed 3)
LONG=(--epochs 400 --train-samples 2000 --seed 3)
export ACCEL_LAUNCH="$bin/accel-launch" TRAIN="$bin/train_classifier" PROCS_PER_NODE=2

step "reference: one node, 4 processes"
timeout 300 "$bin/accel-launch" -q -n 4 "$bin/train_classifier" "${ARGS[@]}" >ref.out 2>&1 ||
  fail "the reference run failed: $(tail -n 5 ref.out)"
ref=$(final_accuracy ref.out)
[[ -n "$ref" ]] || fail "no accuracy in ref.out"
echo "one node x 4: eval_accuracy $ref"

step "1. sbatch -N 2 configs/slurm/train.sbatch (one accel-launch per node)"
job=$(sbatch --parsable -N 2 --output="$W/job1.out" --export=ALL,CHECKPOINT_DIR="$W/ck1" \
  "$root/configs/slurm/train.sbatch" "${ARGS[@]}")
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL
[[ $(job_state "$job") == COMPLETED ]] || fail "job $job ended $(job_state "$job")"
acc1=$(final_accuracy job1.out)
grep -q "machine rank 1 of 2 nodes" job1.out || fail "job1.out does not show the second node"
echo "2 nodes x 2 (accel-launch): eval_accuracy $acc1"
[[ "$acc1" == "$ref" ]] || fail "2 nodes reached $acc1, one node $ref"

step "2. srun -N2 -n4 train_classifier (no launcher)"
timeout 300 srun -N 2 -n 4 "$bin/train_classifier" "${ARGS[@]}" >job2.out 2>&1 ||
  fail "srun failed: $(tail -n 5 job2.out)"
acc2=$(final_accuracy job2.out)
echo "srun -n4: eval_accuracy $acc2"
[[ "$acc2" == "$ref" ]] || fail "srun -n4 reached $acc2, one node $ref"

step "3. a worker killed mid-run is restarted"
# Why 40 epochs: with 12, the epochs left after "epoch 2" could end before the kill landed (a
# fresh-clone CI killed a worker that was exiting 0, and the job completed without a restart).
job=$(sbatch --parsable -N 2 --output="$W/job3.out" \
  --export=ALL,CHECKPOINT_DIR="$W/ck3",CHECKPOINT_INTERVAL=20 \
  "$root/configs/slurm/train.sbatch" --epochs 40 --train-samples 2000 --seed 3)
wait_line job3.out 120 "^.*epoch 2 "
victim=$(ours train_classifier | tail -n 1)
[[ -n "$victim" ]] || fail "no worker to kill"
# Why stopped first: a process that has begun to exit can no longer stop, so a worker seen
# stopped ("T") is one whose SIGKILL its launcher counts as a failure; the other ranks wait for
# it meanwhile. A run too short to be caught mid-way then fails here, saying so.
kill -STOP "$victim" 2>/dev/null || fail "worker $victim ended before it could be killed"
state=""
for _ in $(seq 1 40); do
  state=$(sed -E 's/^.*\) (.).*/\1/' "/proc/$victim/stat" 2>/dev/null || true)
  [[ "$state" == T ]] && break
  sleep 0.05
done
[[ "$state" == T ]] || fail "worker $victim was exiting (state '${state:-gone}'), not training"
kill -9 "$victim"
echo "killed worker pid $victim"
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL
[[ $(job_state "$job") == COMPLETED ]] || fail "job $job ended $(job_state "$job") after the kill"
grep -q "restarting" job3.out || fail "job3.out does not say the group restarted"
grep -q "resumed from" job3.out || fail "job3.out does not show the resume"
grep -q "epoch 39 " job3.out || fail "job3 did not finish its epochs"
no_process_left

step "4. scancel mid-run stops everything"
job=$(sbatch --parsable -N 2 --output="$W/job4.out" --export=ALL,CHECKPOINT_DIR="$W/ck4" \
  "$root/configs/slurm/train.sbatch" "${LONG[@]}")
wait_line job4.out 120 "^.*epoch 1 "
scancel "$job"
wait_state "$job" 60 CANCELLED COMPLETED FAILED
no_process_left
grep -q "received SIGTERM" job4.out || fail "job4.out does not show the launchers' stop"
echo "cancelled: $(grep -c 'received SIGTERM' job4.out) launcher(s) stopped on SIGTERM"

step "5. SIGUSR1: checkpoint, requeue, resume"
# No periodic saves: the only checkpoint is the one SIGUSR1 asks for. Why 150 epochs: the signal
# goes through slurmctld and slurmd and acts at a step boundary, so the run must outlast that.
job=$(sbatch --parsable -N 2 --output="$W/job5.out" \
  --export=ALL,CHECKPOINT_DIR="$W/ck5",CHECKPOINT_INTERVAL=0 \
  "$root/configs/slurm/train.sbatch" --epochs 150 --train-samples 2000 --seed 3)
wait_line job5.out 120 "^.*epoch 1 "
scancel --signal=USR1 "$job"
restarts() { scontrol show job -o "$job" 2>/dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p'; }
end=$((SECONDS + 60))
until [[ "$(restarts)" == 1 ]]; do
  ((SECONDS < end)) || fail "job $job was not requeued within 60 s of SIGUSR1"
  sleep 0.5
done
manifest="$W/ck5/checkpoints/checkpoint_0/manifest.json"
[[ -f "$manifest" ]] || fail "no checkpoint saved on SIGUSR1 ($manifest)"
saved=$(grep -oE '"step": *[0-9]+' "$manifest" | grep -oE '[0-9]+$')
echo "requeued after SIGUSR1; the checkpoint it saved is at step $saved"
wait_line job5.out 120 "resumed from .*checkpoint_0 at step $saved "
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT
[[ $(job_state "$job") == COMPLETED ]] || fail "the requeued job ended $(job_state "$job")"
grep -q "epoch 149 " job5.out || fail "the requeued job did not finish its epochs"
no_process_left

step "6. SIGUSR1 to the batch script alone (--signal=B:USR1): passed on, checkpoint, requeue"
job=$(sbatch --parsable -N 2 --output="$W/job6b.out" \
  --export=ALL,CHECKPOINT_DIR="$W/ck6",CHECKPOINT_INTERVAL=0 \
  "$root/configs/slurm/train.sbatch" "${LONG[@]}")
wait_line job6b.out 120 "^.*epoch 1 "
scancel --batch --signal=USR1 "$job"
end=$((SECONDS + 60))
until [[ "$(restarts)" == 1 ]]; do
  ((SECONDS < end)) || fail "job $job was not requeued within 60 s of SIGUSR1 to its batch script"
  sleep 0.5
done
[[ -f "$W/ck6/checkpoints/checkpoint_0/manifest.json" ]] || fail "no checkpoint saved"
echo "requeued after SIGUSR1 to the batch script, with a checkpoint"
scancel "$job"
wait_state "$job" 60 CANCELLED COMPLETED FAILED
no_process_left

step "7. accel-launch --slurm-submit from the login node"
mkdir -p "$W/submit"
(cd "$W/submit" && "$bin/accel-launch" --slurm-submit --nodes 2 -n 2 \
  --sbatch-arg=--output="$W/job6.out" "$bin/train_classifier" "${ARGS[@]}") >submit.out 2>&1 ||
  fail "--slurm-submit failed: $(cat submit.out)"
job=$(grep -oE 'Submitted batch job [0-9]+' submit.out | grep -oE '[0-9]+$') ||
  fail "no job id in: $(cat submit.out)"
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL
[[ $(job_state "$job") == COMPLETED ]] || fail "the submitted job $job ended $(job_state "$job")"
acc6=$(final_accuracy job6.out)
echo "--slurm-submit, 2 nodes x 2: eval_accuracy $acc6"
[[ "$acc6" == "$ref" ]] || fail "the submitted job reached $acc6, one node $ref"
no_process_left

for f in job1.out job5.out; do
  echo "----- $f"
  # Why sed, not head: head would exit after 40 lines and fail grep with SIGPIPE under pipefail.
  grep -vE '^\[[^]]*\] epoch [0-9]+ ' "$f" | sed -n '1,40p'
done
failed=0
echo "PASS: Slurm (2 nodes: accel-launch per node, srun per rank, restart, scancel, USR1 requeue, --slurm-submit)"
