#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for tests: munged, slurmctld and two slurmd
# (-N n1, -N n2) on 127.0.0.1, every file under one work folder.
#   cluster.sh start WORKDIR   installs slurm-wlm and munge if missing (root, apt-get), writes
#                              WORKDIR/slurm.conf, starts the daemons, waits (bounded) until
#                              both nodes are idle; prints `export SLURM_CONF=...`
#   cluster.sh stop WORKDIR    cancels every job, stops the daemons, removes the /etc/hosts lines
# Exit 77 when it cannot run here (not root, no apt-get and no Slurm): the test is skipped.
set -euo pipefail

cmd=${1:?usage: cluster.sh start|stop WORKDIR}
W=${2:?usage: cluster.sh start|stop WORKDIR}
HOSTS_MARK="# accel-slurm-test"

log() { echo "slurm-cluster: $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2
  shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      log "gave up after ${limit}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

stop_cluster() {
  export SLURM_CONF="$W/slurm.conf"
  if [[ -f "$W/slurm.conf" ]]; then scancel --full --quiet --partition=test 2>/dev/null || true; fi
  for pidfile in "$W"/slurmd-n1.pid "$W"/slurmd-n2.pid "$W"/slurmctld.pid "$W"/munged.pid; do
    [[ -f "$pidfile" ]] || continue
    local pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "$W"/slurmd-n1.pid "$W"/slurmd-n2.pid "$W"/slurmctld.pid "$W"/munged.pid; do
    [[ -f "$pidfile" ]] || continue
    local pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    [[ -n "$pid" ]] && kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  if grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
    grep -v "$HOSTS_MARK" /etc/hosts >"$W/hosts.new" && cat "$W/hosts.new" >/etc/hosts
  fi
}

if [[ "$cmd" == stop ]]; then
  stop_cluster
  exit 0
fi
[[ "$cmd" == start ]] || { log "unknown command $cmd"; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    log "slurm-wlm and munge are not installed and cannot be installed here (needs root and apt-get)"
    exit 77
  fi
  log "installing slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q slurm-wlm munge >"$W/apt.log" 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get update -q >>"$W/apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q slurm-wlm munge >>"$W/apt.log" 2>&1; } ||
    { log "apt-get failed: see $W/apt.log"; exit 1; }
fi
if [[ $(id -u) -ne 0 ]]; then
  log "slurmd runs as root here; not root: skipped"
  exit 77
fi

mkdir -p "$W/munge" "$W/ctld" "$W/spool-n1" "$W/spool-n2"
if [[ ! -s /etc/munge/munge.key ]]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
fi
chown munge:munge "$W/munge" /etc/munge/munge.key 2>/dev/null || true
chmod 0755 "$W/munge"
chmod 0755 "$W"
chmod 0400 /etc/munge/munge.key
host=$(hostname -s)

cat >"$W/slurm.conf" <<CONF
ClusterName=accel-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=17000
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$W/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$W/ctld
SlurmdSpoolDir=$W/spool-%n
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd-%n.pid
SlurmctldLogFile=$W/slurmctld.log
SlurmdLogFile=$W/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# A requeued job starts within seconds (cred_expire above: Slurm's delay before a requeued job
# may run again, 120 s by default; sched_interval: how often pending jobs are looked at).
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait=10
MinJobAge=300
SlurmdTimeout=60
InactiveLimit=0
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17002 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$W/slurm.conf"

# The node names resolve to this machine (a job's first node is its rendezvous host).
if ! grep -q "$HOSTS_MARK" /etc/hosts; then
  echo "127.0.0.1 n1 n2 $HOSTS_MARK" >>/etc/hosts
fi

log "starting munged, slurmctld, slurmd n1 and n2 (logs in $W)"
sudo_munge=()
if id munge >/dev/null 2>&1 && command -v runuser >/dev/null; then sudo_munge=(runuser -u munge --); fi
"${sudo_munge[@]}" munged --socket="$W/munge/munge.socket" --pid-file="$W/munge/munged.pid" \
  --log-file="$W/munge/munged.log" --seed-file="$W/munge/munged.seed"
cp "$W/munge/munged.pid" "$W/munged.pid" 2>/dev/null || true
wait_for 20 "munged" test -S "$W/munge/munge.socket"
slurmctld -i
wait_for 30 "slurmctld" scontrol ping
slurmd -N n1
slurmd -N n2
wait_for 60 "both nodes idle" bash -c "[[ \$(sinfo -h -N -t idle -o %N | sort -u | wc -l) -eq 2 ]]"
log "up: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
echo "export SLURM_CONF=$W/slurm.conf"
