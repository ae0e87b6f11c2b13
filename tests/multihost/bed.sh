# shellcheck shell=bash
# A multi-host test bed made of Linux network namespaces (sourced by tests/multihost/run.sh).
#
# `bed_up N` makes hosts h1..hN: one network namespace each (named ${BED_PREFIX}hI, the prefix
# unique per run: amh<pid of the sourcing shell>), plus a "switch" namespace (${BED_PREFIX}sw)
# holding a bridge. Host I has a veth `eth0` with 10.77.0.I/24 plugged into that bridge, `lo` up,
# its own /etc/hosts (/etc/netns/<ns>/hosts, which `ip netns exec` bind-mounts over /etc/hosts),
# its own host name (a UTS namespace per command) and its own TMPDIR ($BED_DIR/hI/tmp). Nothing is
# added to the root namespace: no interface, address or route. The hosts share the file system
# (as nodes on a shared file system do) and the PID namespace (so the test sees every pid).
#
# Processes are found and stopped by pid only, never by name: a host's processes are those
# whose network namespace is the host's (`ip netns pids`). Every wait is bounded.
#
# Usage (root; see bed_preflight):
#   source tests/multihost/bed.sh
#   bed_preflight || exit 77       # root, `ip netns add`, iptables in a namespace (installs it)
#   trap bed_down EXIT
#   bed_up 3 [--debian-hosts]      # h1..h3; --debian-hosts: Debian's `127.0.1.1 hI` for its own name
#   bed_run h1 CMD...              # foreground, bounded by $BED_RUN_TIMEOUT (default 300 s)
#   bed_spawn h2 LOG CMD...        # background; its pid in $BED_PID (and in BED_PIDS)
#   bed_wait "$BED_PID" 60         # its exit code; 124 if still running after 60 s
#   bed_wait_log LOG 'regex' 15    # 0 once LOG has a line matching the regex, 1 after 15 s
#   bed_partition h2 h3            # iptables DROP between h2 and h3 (both ways)
#   bed_delay h2 50                # h2's packets reach the others 50 ms later (RTT +50 ms)
#   bed_heal                       # every fault rule and delay gone, every frozen host thawed
#   bed_down                       # every process of the bed killed, namespaces and files removed
#
# Functions (HOST is h1..hN):
#   bed_preflight                   0 if a bed can be made here (prints why not otherwise);
#                                   installs iptables with apt-get when missing (root)
#   bed_up N [--debian-hosts]       make the bed (calls bed_down first if one is up)
#   bed_hosts_file HOST [--debian-hosts]   (re)write HOST's /etc/hosts; takes effect for the
#                                   commands started after it
#   bed_ns HOST / bed_ip HOST       the namespace's name / the host's address (10.77.0.I)
#   bed_dir HOST                    $BED_DIR/HOST (holds tmp/, free for the test's files)
#   bed_run HOST CMD...             run CMD on HOST in the foreground; its exit code (124 timeout)
#   bed_spawn HOST LOG CMD...       start CMD on HOST in the background, stdout+stderr to LOG;
#                                   sets BED_PID (a child of this shell: `bed_wait` gives its code)
#   bed_wait PID SECONDS            wait for a bed_spawn'ed pid; its exit code, 124 if it still runs
#   bed_running PID                 0 while a bed_spawn'ed pid runs
#   bed_kill PID [SIGNAL]           signal one process (default KILL), without bash's "Killed" line
#   bed_wait_log LOG REGEX SECONDS  wait for an extended regex in a file (grep -E)
#   bed_wait_for SECONDS CMD...     wait until CMD succeeds (polled every 0.1 s)
#   bed_pids HOST                   the pids in HOST's namespace
#   bed_find_pids HOST REGEX        those whose command line (args joined by spaces) matches REGEX
#   bed_probe A B PORT [SECONDS]    from A, connect to B:PORT within SECONDS (default 2): prints
#                                   open, refused or dropped (refused = B reachable, no listener)
#   bed_partition A B [oneway] [--port P | --except-port P]
#                                   drop packets between A and B (both directions; `oneway`: only
#                                   those from A to B). --port P: only TCP to or from port P (cut
#                                   one service, e.g. the coordinator); --except-port P: all but
#                                   TCP to or from port P (e.g. the workers' traffic cut, the
#                                   coordinator still reachable). Rules add up.
#   bed_partition_port A B PORT [oneway]     = bed_partition A B [oneway] --port PORT
#   bed_partition_except A B PORT [oneway]   = bed_partition A B [oneway] --except-port PORT
#   bed_isolate HOST [--except-port P]       partition HOST from every other host
#   bed_loss HOST PCT [in|out|both] drop PCT % (0-100, decimals allowed) of the packets HOST
#                                   receives and/or sends on eth0 (iptables statistic)
#   bed_delay HOST MS               every packet HOST sends on eth0 reaches the other hosts MS ms
#                                   later (decimals allowed; one-way: HOST's RTT to each +MS),
#                                   replacing an earlier delay of HOST. The kernel may have no
#                                   sch_netem, so it is not `tc qdisc add ... netem`: on every
#                                   other host an NFQUEUE rule (chain BED-DELAY, after INPUT's
#                                   fault rules; queue number = HOST's index) hands HOST's packets
#                                   to $BED_NFQ_DELAY (default: nfq_delay on PATH, else
#                                   build/bin/nfq_delay of this checkout;
#                                   bench/multihost/nfq_delay.c) running in that host's namespace
#                                   (log: $BED_DIR/<receiver>/nfq_delay-from-HOST.log). Held at
#                                   the receivers, not on HOST's egress: see bed_delay below.
#                                   A receiver's bed_crash ends its delayers (packets then pass)
#   bed_undelay HOST                remove HOST's delay rules, then stop its delayers (SIGTERM:
#                                   they let the packets they hold go and log statistics)
#   bed_heal [HOST...]              remove the fault rules and delays (bed_undelay) of those hosts
#                                   (default: every host) and thaw them
#   bed_rules HOST                  print HOST's fault and delay rules with packet counters
#   bed_dropped HOST in|out         packets HOST's fault rules matched coming in / going out
#   bed_freeze HOST / bed_thaw HOST SIGSTOP / SIGCONT every process of HOST
#   bed_crash HOST                  SIGKILL every process of HOST (its files stay; spawn again to
#                                   "reboot" it)
#   bed_down                        stop (SIGSTOP) then kill everything in the bed, by pid; delete
#                                   the namespaces, /etc/netns/<ns> and $BED_DIR; safe to call twice
#   bed_sweep_stale                 (bed_up calls it) remove the namespaces, /etc/netns folders and
#                                   work folders of beds whose shell is gone (SIGKILLed)
#
# Variables: BED_PREFIX (default amh$$; set before bed_up to change), BED_ROOT (folder under
# which BED_DIR is made; default ${TMPDIR:-/tmp}), BED_N, BED_DIR, BED_PID, BED_PIDS,
# BED_RUN_TIMEOUT, BED_SUBNET (default 10.77.0), BED_NFQ_DELAY (bed_delay's delayer),
# BED_DELAY_PID (RECEIVER_SENDER -> that delayer's pid).
#
# Environment of a host's commands: this shell's, plus TMPDIR=$BED_DIR/HOST/tmp and
# BED_HOST=HOST. Their working directory is the caller's.

BED_PREFIX=${BED_PREFIX:-amh$$}
BED_SUBNET=${BED_SUBNET:-10.77.0}
BED_RUN_TIMEOUT=${BED_RUN_TIMEOUT:-300}
BED_N=0
BED_DIR=""
BED_PID=""
BED_PIDS=()
declare -gA BED_RC=()
BED_DEBIAN_HOSTS=0
BED_NETNS_DIR_MADE=0  # 1 when bed_up created /etc/netns (then bed_down removes it if empty)
declare -gA BED_DELAY_PID=()
BED_NFQ_DELAY=${BED_NFQ_DELAY:-}
_BED_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_BED_CHAIN_SEQ=0

_bed_err() { echo "bed: $*" >&2; }

bed_ns() { echo "${BED_PREFIX}$1"; }
bed_ip() { echo "${BED_SUBNET}.${1#h}"; }
bed_dir() { echo "$BED_DIR/$1"; }

# _bed_host_ok HOST: HOST names a host of the bed that is up.
_bed_host_ok() {
  [[ "$1" =~ ^h([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1 && BASH_REMATCH[1] <= BED_N)) && return 0
  _bed_err "no host '$1' in the bed (h1..h$BED_N)"
  return 1
}

# 0 when this machine can make a bed. Installs iptables (apt-get) when it is missing.
bed_preflight() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "needs root"
    return 1
  fi
  local probe="${BED_PREFIX}probe"
  if ! command -v ip >/dev/null || ! ip netns add "$probe" 2>/dev/null; then
    echo "cannot make a network namespace (ip netns add)"
    return 1
  fi
  if ! command -v unshare >/dev/null; then
    ip netns del "$probe"
    echo "needs unshare (util-linux)"
    return 1
  fi
  if ! command -v iptables >/dev/null && command -v apt-get >/dev/null; then
    echo "bed: installing iptables (apt-get install -y iptables)" >&2
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q iptables >/dev/null 2>&1 ||
      { timeout 300 apt-get update -q >/dev/null 2>&1 &&
        DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q iptables >/dev/null 2>&1; }
  fi
  local ok=1
  if command -v iptables >/dev/null &&
    ip netns exec "$probe" iptables -w 5 -A OUTPUT -d 192.0.2.1 -m statistic --mode random \
      --probability 0.5 -j DROP 2>/dev/null &&
    ip netns exec "$probe" iptables -w 5 -A INPUT -p tcp --sport 1 -j RETURN 2>/dev/null; then
    ok=0
  fi
  ip netns del "$probe"
  if ((ok)); then
    echo "iptables (with -m statistic) does not work in a network namespace here"
    return 1
  fi
  return 0
}

# Removes what an earlier bed whose shell is gone (SIGKILLed: no trap ran) left: namespaces named
# amh<pid>sw / amh<pid>h<i> whose pid is not running, and their /etc/netns folders.
bed_sweep_stale() {
  local ns pid
  while read -r ns _; do
    [[ "$ns" =~ ^amh([0-9]+)(sw|probe|h[0-9]+)$ ]] || continue
    pid=${BASH_REMATCH[1]}
    [[ -d /proc/$pid ]] && continue
    _bed_kill_ns "$ns"
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done < <(ip netns list 2>/dev/null)
  local d
  for d in "${BED_ROOT:-${TMPDIR:-/tmp}}"/accel-multihost-*; do
    [[ "$d" =~ /accel-multihost-([0-9]+)-[^/]*$ ]] || continue
    [[ -d /proc/${BASH_REMATCH[1]} ]] || rm -rf "$d"
  done
  return 0
}

# bed_hosts_file HOST [--debian-hosts]
bed_hosts_file() {
  local host=$1 debian=${2:-}
  local i=${host#h} j f
  f="/etc/netns/$(bed_ns "$host")/hosts"
  mkdir -p "$(dirname "$f")"
  {
    echo "127.0.0.1 localhost"
    [[ "$debian" == --debian-hosts ]] && echo "127.0.1.1 $host"
    for ((j = 1; j <= BED_N; j++)); do
      # Debian's habit: the host's own name only on 127.0.1.1.
      [[ "$debian" == --debian-hosts && $j -eq $i ]] && continue
      echo "$(bed_ip "h$j") h$j"
    done
  } >"$f.tmp"
  mv "$f.tmp" "$f"
}

# bed_up N [--debian-hosts]
bed_up() {
  local n=${1:?usage: bed_up N [--debian-hosts]} opt=${2:-} i ns
  if ! [[ "$n" =~ ^[0-9]+$ ]] || ((n < 1 || n > 250)); then
    _bed_err "bed_up: N must be 1..250"
    return 1
  fi
  [[ -z "$opt" || "$opt" == --debian-hosts ]] || { _bed_err "bed_up: unknown option $opt"; return 1; }
  ((BED_N > 0)) && bed_down
  bed_sweep_stale
  BED_DEBIAN_HOSTS=0
  [[ "$opt" == --debian-hosts ]] && BED_DEBIAN_HOSTS=1
  [[ -d /etc/netns ]] || { mkdir /etc/netns && BED_NETNS_DIR_MADE=1; }
  BED_DIR=$(mktemp -d "${BED_ROOT:-${TMPDIR:-/tmp}}/accel-multihost-$$-XXXXXX") || return 1
  chmod 0755 "$BED_DIR"
  BED_N=$n # from here on, bed_down undoes whatever was made
  ns=$(bed_ns sw)
  ip netns add "$ns" || { _bed_err "ip netns add $ns failed"; return 1; }
  ip -n "$ns" link add br0 type bridge || return 1
  ip -n "$ns" link set br0 up || return 1
  for ((i = 1; i <= n; i++)); do
    ns=$(bed_ns "h$i")
    ip netns add "$ns" || { _bed_err "ip netns add $ns failed"; return 1; }
    ip -n "$(bed_ns sw)" link add "h$i" type veth peer name eth0 netns "$ns" || return 1
    ip -n "$(bed_ns sw)" link set "h$i" master br0 up || return 1
    ip -n "$ns" addr add "$(bed_ip "h$i")/24" dev eth0 || return 1
    ip -n "$ns" link set eth0 up || return 1
    ip -n "$ns" link set lo up || return 1
    mkdir -p "$BED_DIR/h$i/tmp"
    if ((BED_DEBIAN_HOSTS)); then bed_hosts_file "h$i" --debian-hosts; else bed_hosts_file "h$i"; fi
  done
  # The bridge's ports need a moment to forward: wait until h1 reaches the last host (an RST
  # from a closed port is enough).
  if ((n > 1)); then
    bed_wait_for 10 _bed_reachable h1 "h$n" || { _bed_err "h1 cannot reach h$n"; return 1; }
  fi
  return 0
}

_bed_reachable() { [[ $(bed_probe "$1" "$2" 9 1) != dropped ]]; }

# The command line that runs "$@" on HOST, with its own host name and TMPDIR.
_bed_cmd() {
  local host=$1
  shift
  # shellcheck disable=SC2016 # expanded by that sh
  _BED_CMD=(ip netns exec "$(bed_ns "$host")" env "TMPDIR=$BED_DIR/$host/tmp" "BED_HOST=$host"
    unshare --uts -- sh -c 'echo "$BED_HOST" >/proc/sys/kernel/hostname && exec "$@"' sh "$@")
}

# bed_run HOST CMD...: foreground, bounded by BED_RUN_TIMEOUT; returns CMD's exit code.
bed_run() {
  _bed_host_ok "$1" || return 2
  _bed_cmd "$@"
  timeout -k 5 "$BED_RUN_TIMEOUT" "${_BED_CMD[@]}"
}

# bed_spawn HOST LOG CMD...: background; sets BED_PID. Call it directly (not in $(...)), so that
# the process is this shell's child.
bed_spawn() {
  local host=$1 log=$2
  _bed_host_ok "$host" || return 2
  shift 2
  _bed_cmd "$host" "$@"
  # ip netns exec, env, unshare and sh all exec: BED_PID ends up being CMD itself.
  "${_BED_CMD[@]}" </dev/null >"$log" 2>&1 &
  BED_PID=$!
  BED_PIDS+=("$BED_PID")
}

# _bed_alive PID: running (not a zombie).
_bed_alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ "${stat%% *}" != Z ]]
}

# Collects the exit codes of the spawned processes that ended (into BED_RC). Run with stderr to
# /dev/null: bash reports a background job killed by a signal ("Killed") when it reaps it.
_bed_reap() {
  local pid
  for pid in "${BED_PIDS[@]}"; do
    [[ -n "${BED_RC[$pid]+x}" ]] && continue
    _bed_alive "$pid" && continue
    wait "$pid"
    BED_RC[$pid]=$?
  done
}

# bed_wait PID SECONDS: the exit code of a bed_spawn'ed process; 124 if it still runs after
# SECONDS (it is left running).
bed_wait() {
  local pid=$1 end=$((SECONDS + $2))
  while _bed_alive "$pid"; do
    ((SECONDS < end)) || return 124
    sleep 0.1
  done
  { _bed_reap; } 2>/dev/null
  if [[ -n "${BED_RC[$pid]+x}" ]]; then return "${BED_RC[$pid]}"; fi
  wait "$pid" 2>/dev/null  # not spawned by bed_spawn
}

# bed_running PID: a bed_spawn'ed process still runs.
bed_running() { _bed_alive "$1"; }

# bed_kill PID [SIGNAL]: signal one process (default KILL); quietly, if it is a spawned one.
bed_kill() {
  { kill "-${2:-KILL}" "$1"; sleep 0.05; _bed_reap; } 2>/dev/null
}

# bed_wait_for SECONDS CMD...: until CMD succeeds (0) or SECONDS pass (1).
bed_wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || return 1
    sleep 0.1
  done
  return 0
}

# bed_wait_log FILE REGEX SECONDS
bed_wait_log() { bed_wait_for "$3" grep -qE -- "$2" "$1"; }

# bed_pids HOST: the pids in HOST's namespace (also of a namespace name: bed_pids sw).
bed_pids() { ip netns pids "$(bed_ns "$1")" 2>/dev/null; }

# bed_find_pids HOST REGEX
bed_find_pids() {
  local pid
  for pid in $(bed_pids "$1"); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE -- "$2" && echo "$pid"
  done
  return 0
}

# bed_probe A B PORT [SECONDS]: open, refused or dropped (no answer within SECONDS, default 2).
bed_probe() {
  local err
  err=$(ip netns exec "$(bed_ns "$1")" timeout "${4:-2}" bash -c "exec 3<>/dev/tcp/$(bed_ip "$2")/$3" 2>&1)
  case $? in
  0) echo open ;;
  124) echo dropped ;;
  *) if [[ "$err" == *refused* ]]; then echo refused; else echo dropped; fi ;;
  esac
}

_bed_ipt() {
  local host=$1
  shift
  ip netns exec "$(bed_ns "$host")" iptables -w 5 "$@"
}

# The chains BED-IN / BED-OUT, first in INPUT / OUTPUT, hold a host's fault rules.
_bed_chains() {
  local host=$1
  _bed_ipt "$host" -n -L BED-IN >/dev/null 2>&1 && return 0
  _bed_ipt "$host" -N BED-IN && _bed_ipt "$host" -N BED-OUT &&
    _bed_ipt "$host" -I INPUT 1 -j BED-IN && _bed_ipt "$host" -I OUTPUT 1 -j BED-OUT
}

# _bed_drop HOST in|out PEER MODE PORT
_bed_drop() {
  local host=$1 dir=$2 peer=$3 mode=$4 port=$5 chain match sub
  _bed_chains "$host" || return 1
  if [[ $dir == in ]]; then chain=BED-IN match=(-s "$(bed_ip "$peer")/32"); else chain=BED-OUT match=(-d "$(bed_ip "$peer")/32"); fi
  case $mode in
  all) _bed_ipt "$host" -A "$chain" "${match[@]}" -j DROP ;;
  port)
    _bed_ipt "$host" -A "$chain" "${match[@]}" -p tcp --dport "$port" -j DROP &&
      _bed_ipt "$host" -A "$chain" "${match[@]}" -p tcp --sport "$port" -j DROP
    ;;
  except)
    _BED_CHAIN_SEQ=$((_BED_CHAIN_SEQ + 1))
    sub="BED-X$_BED_CHAIN_SEQ"
    _bed_ipt "$host" -N "$sub" &&
      _bed_ipt "$host" -A "$sub" -p tcp --dport "$port" -j RETURN &&
      _bed_ipt "$host" -A "$sub" -p tcp --sport "$port" -j RETURN &&
      _bed_ipt "$host" -A "$sub" -j DROP &&
      _bed_ipt "$host" -A "$chain" "${match[@]}" -j "$sub"
    ;;
  esac
}

# bed_partition A B [oneway] [--port P | --except-port P]
bed_partition() {
  local a=$1 b=$2 oneway=0 mode=all port=""
  shift 2 || { _bed_err "usage: bed_partition A B [oneway] [--port P | --except-port P]"; return 2; }
  _bed_host_ok "$a" && _bed_host_ok "$b" || return 2
  [[ "$a" != "$b" ]] || { _bed_err "bed_partition: $a and $b are the same host"; return 2; }
  while (($#)); do
    case $1 in
    oneway) oneway=1 ;;
    --port) mode=port port=${2:-} && shift ;;
    --except-port) mode=except port=${2:-} && shift ;;
    *) _bed_err "bed_partition: unknown argument $1"; return 2 ;;
    esac
    shift
  done
  [[ $mode == all || "$port" =~ ^[0-9]+$ ]] || { _bed_err "bed_partition: bad port '$port'"; return 2; }
  # Packets from A to B: dropped as A sends them and as B receives them.
  _bed_drop "$a" out "$b" "$mode" "$port" && _bed_drop "$b" in "$a" "$mode" "$port" || return 1
  ((oneway)) && return 0
  _bed_drop "$b" out "$a" "$mode" "$port" && _bed_drop "$a" in "$b" "$mode" "$port"
}

bed_partition_port() { bed_partition "$1" "$2" ${4:+"$4"} --port "$3"; }
bed_partition_except() { bed_partition "$1" "$2" ${4:+"$4"} --except-port "$3"; }

# bed_isolate HOST [--except-port P]
bed_isolate() {
  local host=$1 j
  shift
  for ((j = 1; j <= BED_N; j++)); do
    [[ "h$j" == "$host" ]] && continue
    bed_partition "$host" "h$j" "$@" || return 1
  done
}

# bed_loss HOST PCT [in|out|both]
bed_loss() {
  local host=$1 pct=$2 dir=${3:-both} p
  _bed_host_ok "$host" || return 2
  p=$(awk -v p="$pct" 'BEGIN { if (p !~ /^[0-9]+(\.[0-9]+)?$/ || p > 100) exit 1; printf "%.6f", p / 100 }') ||
    { _bed_err "bed_loss: PCT must be 0..100, not '$pct'"; return 2; }
  _bed_chains "$host" || return 1
  if [[ $dir == in || $dir == both ]]; then
    _bed_ipt "$host" -A BED-IN -i eth0 -m statistic --mode random --probability "$p" -j DROP || return 1
  fi
  if [[ $dir == out || $dir == both ]]; then
    _bed_ipt "$host" -A BED-OUT -o eth0 -m statistic --mode random --probability "$p" -j DROP || return 1
  fi
}

# bed_delay HOST MS: HOST's packets reach the other hosts MS ms later (one-way; RTT +MS). Held
# at each receiver's INPUT rather than at HOST's OUTPUT: a packet held on its sender's egress
# still counts against its TCP socket (TCP small queues, which netem avoids by orphaning it), so
# a delayed sender would keep only ~2 packets in flight and bulk transfers would crawl (measured
# at 50 ms: one TCP stream sent 1.7 MB in 30 s held on the sender, 64 MiB in 1.5 s held at the
# receiver).
bed_delay() {
  local host=$1 ms=${2:-} bin j peer key log pid i=${1#h}
  _bed_host_ok "$host" || return 2
  [[ "$ms" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { _bed_err "bed_delay: MS must be a number, not '$ms'"; return 2; }
  bin=${BED_NFQ_DELAY:-$(command -v nfq_delay || echo "$_BED_HERE/../../build/bin/nfq_delay")}
  [[ -x "$bin" ]] || {
    _bed_err "bed_delay: no delayer at $bin (set BED_NFQ_DELAY; bench/multihost/nfq_delay.c is built where libnetfilter-queue-dev is installed)"
    return 1
  }
  bed_undelay "$host"
  for ((j = 1; j <= BED_N; j++)); do
    peer=h$j
    [[ "$peer" == "$host" ]] && continue
    key="${peer}_$host"
    log="$BED_DIR/$peer/nfq_delay-from-$host.log"
    # In the receiver's namespace (NFQUEUE queues are per namespace), queue number = the
    # sender's index, SCHED_FIFO so that busy CPUs do not lengthen the delay; `ip netns exec`
    # execs, so $! is the delayer.
    ip netns exec "$(bed_ns "$peer")" "$bin" -r -q "$i" "$ms" </dev/null >"$log" 2>&1 &
    pid=$!
    BED_PIDS+=("$pid")
    BED_DELAY_PID[$key]=$pid
    if ! bed_wait_log "$log" '^nfq_delay: ready' 5; then
      _bed_err "bed_delay: the delayer did not start on $peer: $(cat "$log")"
      bed_undelay "$host"
      return 1
    fi
    # Its own chain, jumped to from the end of INPUT: the fault rules (BED-IN, first) still drop
    # what they drop. --queue-bypass: were the delayer gone, packets would pass undelayed.
    if ! _bed_ipt "$peer" -n -L BED-DELAY >/dev/null 2>&1; then
      { _bed_ipt "$peer" -N BED-DELAY && _bed_ipt "$peer" -A INPUT -j BED-DELAY; } || return 1
    fi
    _bed_ipt "$peer" -A BED-DELAY -i eth0 -s "$(bed_ip "$host")/32" -j NFQUEUE --queue-num "$i" \
      --queue-bypass || { bed_undelay "$host"; return 1; }
  done
}

# bed_undelay HOST: HOST's delay rules removed, then its delayers stopped (SIGTERM: each lets the
# packets it holds go and logs its statistics).
bed_undelay() {
  local host=$1 j peer key pid
  _bed_host_ok "$host" || return 2
  for ((j = 1; j <= BED_N; j++)); do
    peer=h$j
    [[ "$peer" == "$host" ]] && continue
    while _bed_ipt "$peer" -D BED-DELAY -i eth0 -s "$(bed_ip "$host")/32" -j NFQUEUE \
      --queue-num "${host#h}" --queue-bypass 2>/dev/null; do :; done
    key="${peer}_$host"
    pid=${BED_DELAY_PID[$key]:-}
    [[ -n "$pid" ]] || continue
    unset "BED_DELAY_PID[$key]"
    { kill -CONT "$pid"; kill -TERM "$pid"; } 2>/dev/null
    bed_wait "$pid" 5
    (($? == 124)) && bed_kill "$pid"
  done
  return 0
}

# bed_heal [HOST...]: every fault rule and delay removed (and frozen hosts thawed).
bed_heal() {
  local hosts=("$@") host c
  if ((${#hosts[@]} == 0)); then
    for ((c = 1; c <= BED_N; c++)); do hosts+=("h$c"); done
  fi
  for host in "${hosts[@]}"; do
    bed_undelay "$host"
    _bed_ipt "$host" -n -L BED-IN >/dev/null 2>&1 || { bed_thaw "$host"; continue; }
    _bed_ipt "$host" -F BED-IN
    _bed_ipt "$host" -F BED-OUT
    for c in $(_bed_ipt "$host" -S | awk '$1 == "-N" && $2 ~ /^BED-X/ { print $2 }'); do
      _bed_ipt "$host" -F "$c"
      _bed_ipt "$host" -X "$c"
    done
    bed_thaw "$host"
  done
  return 0
}

bed_rules() {
  local chain
  for chain in BED-IN BED-OUT BED-DELAY; do _bed_ipt "$1" -n -v -L "$chain" 2>/dev/null; done
}

# bed_dropped HOST in|out: how many packets HOST's fault rules dropped (or sent to a sub-chain)
# on the way in / out.
bed_dropped() {
  local chain=BED-IN
  [[ $2 == out ]] && chain=BED-OUT
  _bed_ipt "$1" -n -v -x -L "$chain" 2>/dev/null | awk 'NR > 2 { n += $1 } END { print n + 0 }'
}

# _bed_signal_ns NS SIGNAL: signal every pid of NS until no new pid shows up (bounded).
_bed_signal_ns() {
  local ns=$1 sig=$2 pid _
  local -A done_pids=()
  for _ in 1 2 3 4 5; do
    local new=0
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      [[ -n "${done_pids[$pid]:-}" ]] && continue
      done_pids[$pid]=1
      new=1
      kill "-$sig" "$pid" 2>/dev/null
    done
    ((new)) || break
    sleep 0.05
  done
  return 0
}

bed_freeze() { _bed_host_ok "$1" && _bed_signal_ns "$(bed_ns "$1")" STOP; }
bed_thaw() { _bed_host_ok "$1" && _bed_signal_ns "$(bed_ns "$1")" CONT; }

# _bed_kill_ns NS: SIGKILL every pid of NS until none is left (bounded: 10 s); 1 (and the
# survivors in _BED_SURVIVORS) if some are left.
_bed_kill_ns() {
  local ns=$1 pid pids end=$((SECONDS + 10))
  _BED_SURVIVORS=""
  while :; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [[ -z "$pids" ]] && return 0
    for pid in $pids; do kill -KILL "$pid" 2>/dev/null; done
    if ((SECONDS >= end)); then
      _BED_SURVIVORS=$(echo "$pids" | tr '\n' ' ')
      return 1
    fi
    sleep 0.05
  done
}

# bed_crash HOST: SIGKILL every process of HOST (a crashed machine; its files stay).
bed_crash() {
  local rc
  _bed_host_ok "$1" || return 2
  { _bed_kill_ns "$(bed_ns "$1")"; rc=$?; _bed_reap; } 2>/dev/null
  ((rc == 0)) || _bed_err "processes of $1 survive SIGKILL: $_BED_SURVIVORS"
  return "$rc"
}

# bed_down: everything the bed made, gone (the delayers too: they run in the hosts' namespaces).
# Safe to call more than once.
bed_down() {
  local i ns pid
  ((BED_N > 0)) || return 0
  {
    # Everything stopped first, so that no process logs its peers' deaths in the teardown.
    for ((i = 1; i <= BED_N; i++)); do _bed_signal_ns "$(bed_ns "h$i")" STOP; done
    for ((i = 1; i <= BED_N; i++)); do
      _bed_kill_ns "$(bed_ns "h$i")" || echo "bed: processes of h$i survive SIGKILL: $_BED_SURVIVORS" >&3
    done
    _bed_kill_ns "$(bed_ns sw)"
    # A spawned process that had not entered its namespace yet is still this shell's child.
    for pid in "${BED_PIDS[@]}"; do
      [[ -n "${BED_RC[$pid]+x}" ]] || kill -KILL "$pid"
    done
    for pid in "${BED_PIDS[@]}"; do
      [[ -n "${BED_RC[$pid]+x}" ]] || bed_wait "$pid" 5
    done
  } 3>&2 2>/dev/null
  for ((i = 1; i <= BED_N; i++)); do
    ns=$(bed_ns "h$i")
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  ip netns del "$(bed_ns sw)" 2>/dev/null
  if ((BED_NETNS_DIR_MADE)) && rmdir /etc/netns 2>/dev/null; then BED_NETNS_DIR_MADE=0; fi
  [[ -n "$BED_DIR" ]] && rm -rf "$BED_DIR"
  BED_N=0 BED_DIR="" BED_PID="" BED_PIDS=() BED_RC=() BED_DELAY_PID=()
  return 0
}
