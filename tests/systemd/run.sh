#!/usr/bin/env bash
# configs/systemd/accel-agent.service under a real systemd: systemd runs as PID 1 of a new PID and
# mount namespace on this machine, with a private copy of /etc (holding the unit's `accel` user,
# /etc/accel/agent.yaml and the token), and only this test's units on its unit path. Checks:
#  1. `systemctl start accel-agent` returns once the agent is registered (Type=notify, READY=1),
#     and `systemctl show` has its STATUS= line;
#  2. a job submitted to the coordinator runs on it, as the `accel` user, and cannot read the token
#     (only the unit's accel-token group can; the agent drops it before any worker starts);
#  3. a wedged agent (SIGSTOP) is killed by the watchdog and restarted (Restart=on-failure);
#  4. `systemctl stop accel-agent` stops it cleanly.
# The unit is the repository's, with ExecStart's binary where this build has it and a drop-in
# setting WatchdogSec=3 (30 s in the unit) to keep the test short. Every wait is bounded.
#   tests/systemd/run.sh BIN_DIR      (exit 77: cannot run here, skipped)
set -euo pipefail
bin=$(cd "${1:?usage: run.sh BIN_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
SYSTEMD=/lib/systemd/systemd
if [[ $(id -u) -ne 0 || ! -x $SYSTEMD ]] || ! command -v unshare >/dev/null ||
  ! command -v nsenter >/dev/null; then
  echo "skipped: needs root, $SYSTEMD, unshare and nsenter"
  exit 77
fi

W=$(mktemp -d /tmp/accel-systemd.XXXXXX)
chmod 0755 "$W"
state_dir_existed=0
[[ -e /var/lib/accel-agent ]] && state_dir_existed=1
ns_pid=""
coord_pid=""
failed=1
cleanup() {
  set +e
  if [[ $failed -ne 0 && -n "$ns_pid" ]]; then
    echo "----- systemctl status accel-agent"
    nsenter -t "$ns_pid" -m -p systemctl status --no-pager accel-agent 2>&1 | tail -n 20
  fi
  [[ -n "$ns_pid" ]] && kill -9 "$ns_pid" 2>/dev/null
  [[ -n "$coord_pid" ]] && kill "$coord_pid" 2>/dev/null
  sleep 0.5
  [[ -n "$coord_pid" ]] && kill -9 "$coord_pid" 2>/dev/null
  [[ $state_dir_existed -eq 0 ]] && rm -rf /var/lib/accel-agent
  rm -rf "$W"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local end=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || fail "gave up after waiting for $what"
    sleep 0.2
  done
}

# A private /etc: the host's, plus the unit's user and its configuration.
cp -a /etc "$W/etc"
if getent passwd accel >/dev/null && getent group accel >/dev/null; then
  id=$(getent group accel | cut -d: -f3) # the host has one (accel's .deb creates it): use it
else
  id=990
  while getent passwd "$id" >/dev/null || getent group "$id" >/dev/null; do id=$((id - 1)); done
  echo "accel:x:$id:$id:accel agent:/var/lib/accel-agent:/usr/sbin/nologin" >>"$W/etc/passwd"
  echo "accel:x:$id:" >>"$W/etc/group"
fi
# The group that alone may read the token (the unit's SupplementaryGroups=).
if getent group accel-token >/dev/null; then
  token_gid=$(getent group accel-token | cut -d: -f3)
else
  token_gid=$((id - 1))
  while getent group "$token_gid" >/dev/null; do token_gid=$((token_gid - 1)); done
  echo "accel-token:x:$token_gid:" >>"$W/etc/group"
fi
port=$((29500 + RANDOM % 400))
token=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
mkdir -p "$W/etc/accel"
printf '%s\n' "$token" >"$W/etc/accel/token"
chown "root:$token_gid" "$W/etc/accel/token"
chmod 0640 "$W/etc/accel/token"
printf 'coordinator: 127.0.0.1:%s\ntoken_file: /etc/accel/token\n' "$port" >"$W/etc/accel/agent.yaml"

mkdir -p "$W/units/accel-agent.service.d"
sed "s|/usr/local/bin/accel-agent|$bin/accel-agent|" "$root/configs/systemd/accel-agent.service" \
  >"$W/units/accel-agent.service"
grep -q "ExecStart=$bin/accel-agent" "$W/units/accel-agent.service" || fail "ExecStart not found"
# Why BindReadOnlyPaths: the unit's /tmp is private (PrivateTmp=yes), and a build under /tmp (a CI
# clone) would not be there for systemd to exec.
printf '[Service]\nWatchdogSec=3\nBindReadOnlyPaths=%s\n' "$bin" >"$W/units/accel-agent.service.d/test.conf"
printf '[Unit]\nDescription=accel systemd test\n' >"$W/units/accel-test.target"
# Empty stand-ins for the targets a service is ordered against by default (no machine services
# start in the namespace).
for t in sysinit basic shutdown network-online multi-user; do
  printf '[Unit]\nDescription=%s (test stand-in)\nDefaultDependencies=no\n' "$t" >"$W/units/$t.target"
done

# The coordinator, outside the namespace (the network is shared).
ACCEL_TOKEN=$token "$bin/accel-agent" -q --serve-coordinator "127.0.0.1:$port" --coordinator-only \
  >"$W/coordinator.log" 2>&1 &
coord_pid=$!

unshare --fork --pid --mount --mount-proc --propagation private \
  bash -c "mount --bind '$W/etc' /etc && exec env SYSTEMD_UNIT_PATH='$W/units' $SYSTEMD --system --unit=accel-test.target" \
  >"$W/systemd.log" 2>&1 &
unshare_pid=$!
wait_for 20 "systemd as PID 1 of the namespace" bash -c "pgrep -P $unshare_pid -f systemd"
ns_pid=$(pgrep -P "$unshare_pid" -f systemd)
sctl() { nsenter -t "$ns_pid" -m -p systemctl "$@"; }
wait_for 30 "systemd to be running" bash -c \
  "nsenter -t $ns_pid -m -p systemctl is-system-running | grep -qE 'running|degraded'"
show() { sctl show -p "$1" --value accel-agent; }

echo "== 1. systemctl start returns once the agent is registered"
timeout 60 nsenter -t "$ns_pid" -m -p systemctl start accel-agent || fail "systemctl start failed"
[[ $(show ActiveState) == active ]] || fail "ActiveState is $(show ActiveState)"
status=$(show StatusText)
echo "active; STATUS=$status"
[[ "$status" == "idle, registered with the coordinator at 127.0.0.1:$port"* ]] ||
  fail "unexpected STATUS: $status"
pid1=$(show MainPID)
[[ $(nsenter -t "$ns_pid" -m -p ps -o user= -p "$pid1") == accel ]] || fail "the agent is not running as accel"

echo "== 2. a job runs on it, as the accel user"
out=$(ACCEL_TOKEN=$token timeout 60 "$bin/accel-launch" -q --coordinator "127.0.0.1:$port" -n 1 -- \
  /bin/sh -c 'echo "rank $RANK runs as $(id -un)"' 2>&1) || fail "the job failed: $out"
echo "$out"
grep -q "rank 0 runs as accel" <<<"$out" || fail "no output from the job"
out=$(ACCEL_TOKEN=$token timeout 60 "$bin/accel-launch" -q --coordinator "127.0.0.1:$port" -n 1 -- \
  /bin/sh -c 'if cat /etc/accel/token >/dev/null 2>&1; then echo "token READ"; else echo "token DENIED"; fi' 2>&1) ||
  fail "the job failed: $out"
echo "$out"
grep -q "token DENIED" <<<"$out" || fail "a worker could read /etc/accel/token"

echo "== 3. a wedged agent is restarted by the watchdog"
nsenter -t "$ns_pid" -m -p kill -STOP "$pid1"  # pids from systemctl are the namespace's
wait_for 30 "a restart" bash -c "[[ \$(nsenter -t $ns_pid -m -p systemctl show -p NRestarts --value accel-agent) -ge 1 ]]"
wait_for 30 "the restarted agent to be registered" bash -c \
  "nsenter -t $ns_pid -m -p systemctl show -p StatusText --value accel-agent | grep -q '^idle, registered'"
pid2=$(show MainPID)
[[ "$pid2" != "$pid1" && $(show ActiveState) == active ]] || fail "not restarted: pid $pid2"
echo "restarted: pid $pid1 -> $pid2, NRestarts=$(show NRestarts), $(sctl show -p Result --value accel-agent)"

echo "== 4. systemctl stop"
timeout 60 nsenter -t "$ns_pid" -m -p systemctl stop accel-agent || fail "systemctl stop failed"
[[ $(show ActiveState) == inactive ]] || fail "ActiveState after stop: $(show ActiveState)"
echo "stopped: ActiveState=$(show ActiveState) Result=$(show Result)"
[[ $(show Result) == success ]] || fail "the agent did not stop cleanly: Result=$(show Result)"

failed=0
echo "PASS: accel-agent.service under systemd (ready, status, job, watchdog restart, stop)"
