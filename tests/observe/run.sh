#!/usr/bin/env bash
# Observability, end to end: a coordinator (accel-agent --serve-coordinator --coordinator-only) and
# two standing agents (n1, n2), each with --metrics-address, run a job that accel-launch
# --coordinator submits; beside it a local job (accel-launch -n 2 --metrics-port). A real
# Prometheus scrapes the four every second (the rules of docs/examples/accel-alerts.yml loaded);
# headless Chromium reads the coordinator's status page. Checks:
#  0. promtool check rules docs/examples/accel-alerts.yml, and check config on a copy of
#     docs/examples/prometheus.yml;
#  1. the local job trains (Prometheus sees its ranks' steps/s); the job's worker on n1 SIGKILLed
#     once (--max-restarts 1): the launcher restarts the job, and through Prometheus' API: every
#     target up, sum(accel_job_restarts_total) = 1 for the job,
#     2 nodes not lost, accel_rank_steps_per_second > 0 on both agents, the AccelJobRestarted
#     alert pending or firing;
#  2. every /metrics is text format 0.0.4 with the metrics the endpoint should have (the local
#     launcher's: the coordinator's and the agent's) and passes `promtool check metrics`; every /
#     is HTML;
#  3. agent n2 has --metrics-token-file: 401 without the token or with a wrong one, 200 with it
#     (Prometheus scrapes it with the token);
#  3b. a PyTorch script written as HF users write it (init_process_group, all_reduce; no libaccel)
#     under accel-launch --metrics-port: both workers' memory and CPU series, no step series;
#  4. n2's rank of round 1, slowed with SIGSTOP/SIGCONT bursts (stopped 90% of the time) under
#     --straggler-threshold 1.5 --straggler-window 5s, is a straggler: on the coordinator's page as
#     Chromium builds it (the job's row, both nodes' rows, the rank's row of class `rank straggler`
#     with the word in a cell, the other rank not flagged, a meta refresh, nothing external), in
#     Prometheus (accel_rank_straggler, accel_job_stragglers, accel_job_straggler_reports_total)
#     and in the launcher's output ("rank R on node n2 is N.Nx slower than the median ...");
#  5. SIGTERM to the launcher cancels the job (exit code 143): the coordinator's /metrics then
#     says accel_coordinator_jobs{state="cancelled"} 1 and both nodes idle; the job restarted once.
# Why stopped 90% of the time: the agents measure compute per step over the last 20 s, and the
# further above 1.5x the slowed rank's goes, the sooner that average crosses it. The ratio seen
# is about 2.5x, not the 10x of the stops alone: the other rank's waiting for it counts partly as
# its compute (not all of it is inside the collectives' timed waits).
# Every wait is bounded; every process the test starts runs under `timeout` (none outlives the
# test's ctest TIMEOUT even if the test is SIGKILLed) and is stopped by its pid on exit. About
# 30 s on 2 cores (up to a minute on slower ones), 10-20 s of it waiting for the straggler report.
#   tests/observe/run.sh BIN_DIR      (exit 77: no prometheus, promtool or chromium: skipped)
#   OBSERVE_KEEP=1 tests/observe/run.sh BIN_DIR    keeps the work folder (logs, pages, metrics)
set -euo pipefail
bin=$(cd "${1:?usage: run.sh BIN_DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
missing=""
for tool in prometheus promtool python3 pgrep timeout nice; do
  command -v "$tool" >/dev/null || missing+=" $tool"
done
[[ -n "$CHROMIUM" ]] || missing+=" chromium"
if [[ -n "$missing" ]]; then
  echo "skipped: needs$missing (Debian: apt-get install prometheus chromium procps python3)"
  exit 77
fi
for x in accel-launch accel-agent train_classifier train_mlp; do
  [[ -x "$bin/$x" ]] || { echo "FAIL: no $bin/$x"; exit 1; }
done
for x in accel-launch accel-agent; do
  help=$("$bin/$x" --help 2>&1 || true)
  grep -q -- '--metrics-address' <<<"$help" ||
    { echo "FAIL: $bin/$x --help has no --metrics-address (built before the metrics?)"; exit 1; }
done

# The job under the standing agents: 8 steps per epoch of 4096 samples per rank, about 18 ms a
# step in mode 3 on 2 vCPUs (86% of it compute, so a stopped rank is slow in compute, not in
# collectives), 0.14 s an epoch: 400 epochs are about a minute, more than round 1 needs here (the
# test cancels it once the checks pass).
TRAIN=$bin/train_classifier
TRAIN_ARGS=(--features 128 --batch-size 4096 --train-samples 65536 --epochs 400)
# The local job only needs to train and be scraped: its workers niced (not the launcher, which
# answers the scrapes), so that it takes about a tenth of the CPU once the other job trains.
LOCAL_ARGS=(-- nice -n 10 "$bin/train_mlp" --epochs 6000 --log-every 0)
LIFETIME=290 # seconds: every process started here is killed by then (the ctest TIMEOUT is 300)

W=$(mktemp -d "${TMPDIR:-/tmp}/accel-observe.XXXXXX")
trap 'rm -rf "$W"' EXIT # until the whole clean-up below is defined
export TMPDIR=$W/tmp # the launchers' and Chromium's temporary files, removed with $W
mkdir -p "$TMPDIR"
ACCEL_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
export ACCEL_TOKEN
METRICS_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$METRICS_TOKEN" >"$W/metrics-token"
chmod 0600 "$W/metrics-token"
JOB=observe-$$-$RANDOM
LOCAL_JOB=observe-local-$$-$RANDOM

# Seven free ports (bound to 0, then released): the coordinator, the four metrics endpoints,
# Prometheus, the Python job's launcher.
read -r P_COORD P_CM P_A1 P_A2 P_LOCAL P_PROM P_PY < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(7)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])') || { echo "FAIL: no free ports"; exit 1; }
CM=127.0.0.1:$P_CM       # the coordinator's metrics
A1=127.0.0.1:$P_A1       # agent n1's (given as the port alone: 127.0.0.1 is implied)
A2=127.0.0.1:$P_A2       # agent n2's, with --metrics-token-file
LOCAL=127.0.0.1:$P_LOCAL # the local launcher's (--metrics-port)

# ---- helpers (Python for what bash does badly: JSON, HTML; urllib when there is no curl). Run
# with -I: the script's folder ($W) is then not on sys.path, where a file could shadow a module.

cat >"$W/prom_query.py" <<'EOF'
# prom_query.py BASE value EXPR: the first sample's value ("none": no sample); series EXPR: every
# sample; targets: each target's URL, health and last error.
import json, sys, urllib.parse, urllib.request
base, mode = sys.argv[1], sys.argv[2]
def get(path):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return json.load(r)
try:
    if mode == "targets":
        for t in get("/api/v1/targets")["data"]["activeTargets"]:
            print("  %s %s %s" % (t["scrapeUrl"], t["health"], t.get("lastError", "")))
        sys.exit(0)
    result = get("/api/v1/query?" + urllib.parse.urlencode({"query": sys.argv[3]}))["data"]["result"]
except Exception as e:  # noqa: BLE001 (any failure is reported, the caller retries)
    print("error: %s" % e)
    sys.exit(1)
if mode == "value":
    print(result[0]["value"][1] if result else "none")
else:
    for s in result:
        labels = ",".join('%s="%s"' % kv for kv in sorted(s["metric"].items()))
        print("  {%s} %s" % (labels, s["value"][1]))
EOF

cat >"$W/http_get.py" <<'EOF'
# http_get.py URL OUT [TOKEN]: GET URL, the body into OUT and the headers into OUT.headers;
# prints the HTTP status (000: no answer).
import sys, urllib.error, urllib.request
url, out = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url)
if len(sys.argv) > 3 and sys.argv[3]:
    req.add_header("Authorization", "Bearer " + sys.argv[3])
try:
    r = urllib.request.urlopen(req, timeout=10)
    code, body, headers = r.status, r.read(), r.headers
except urllib.error.HTTPError as e:
    code, body, headers = e.code, e.read(), e.headers
except Exception:  # noqa: BLE001
    print("000")
    sys.exit(0)
open(out, "wb").write(body)
open(out + ".headers", "w").write("".join("%s: %s\n" % kv for kv in headers.items()))
print(code)
EOF

cat >"$W/status_page.py" <<'EOF'
# status_page.py PAGE JOB RANK RANK_NODE NODE...: checks the coordinator's status page (the DOM
# Chromium built); prints "ok: ..." and exits 0, or what is missing and what it saw and exits 1.
import re, sys
from html.parser import HTMLParser
page, job, rank, rank_node, nodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]

class Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self.sections, self.rows, self.row = [], [], [], None
        self.refresh, self.external = False, []
    def handle_starttag(self, tag, attrs):
        a = {k: (v or "") for k, v in attrs}
        cls = a.get("class", "").split()
        if tag == "meta" and a.get("http-equiv", "").lower() == "refresh":
            self.refresh = True
        for k in ("src", "href") if tag == "link" else ("src",):
            if a.get(k, "").strip().lower().startswith(("http:", "https:", "//")):
                self.external.append("<%s %s=%s>" % (tag, k, a[k]))
        if tag == "table":
            self.tables.append((a.get("id", ""), cls))
        elif tag == "section":
            self.sections.append(a.get("data-job") if "job-detail" in cls else None)
        elif tag == "tr":
            table = self.tables[-1] if self.tables else ("", [])
            section = next((s for s in reversed(self.sections) if s is not None), None)
            self.row = {"table": table[0], "table_classes": table[1], "section": section,
                        "classes": cls, "attrs": a, "cells": []}
            self.rows.append(self.row)
        elif tag in ("td", "th") and self.row is not None:
            self.row["cells"].append("")
    def handle_endtag(self, tag):
        if tag == "table" and self.tables:
            self.tables.pop()
        elif tag == "section" and self.sections:
            self.sections.pop()
        elif tag == "tr":
            self.row = None
    def handle_data(self, data):
        if self.row is not None and self.row["cells"]:
            self.row["cells"][-1] += data

def text(row):
    return " | ".join(" ".join(c.split()) for c in row["cells"])

def show(rows):
    return ", ".join("<tr class=%r %s>" % (" ".join(r["classes"]), " ".join(
        "%s=%r" % kv for kv in sorted(r["attrs"].items()) if kv[0].startswith("data-")))
        for r in rows) or "none"

p = Page()
p.feed(open(page, encoding="utf-8", errors="replace").read())
problems = []
jobs = [r for r in p.rows if r["table"] == "jobs" and "job" in r["classes"]]
mine = [r for r in jobs if r["attrs"].get("data-job") == job]
if not mine:
    problems.append("no row for job %s in table#jobs (its rows: %s)" % (job, show(jobs)))
elif mine[0]["attrs"].get("data-state") != "running":
    problems.append("job %s is not running: %s" % (job, show(mine)))
node_rows = [r for r in p.rows if r["table"] == "nodes" and "node" in r["classes"]]
for n in nodes:
    row = [r for r in node_rows if r["attrs"].get("data-node") == n]
    if not row:
        problems.append("no row for node %s in table#nodes (its rows: %s)" % (n, show(node_rows)))
    elif row[0]["attrs"].get("data-state") != "busy":
        problems.append("node %s is not busy: %s" % (n, show(row)))
ranks = [r for r in p.rows if r["section"] == job and "ranks" in r["table_classes"]
         and "rank" in r["classes"]]
slow = [r for r in ranks if r["attrs"].get("data-rank") == rank]
if not slow:
    problems.append("no row for rank %s in section.job-detail[data-job=%s] table.ranks (its rows: %s)"
                    % (rank, job, show(ranks)))
else:
    r = slow[0]
    if r["attrs"].get("data-node") != rank_node:
        problems.append("rank %s is not on node %s: %s" % (rank, rank_node, show(slow)))
    if "straggler" not in r["classes"] or not any(re.search(r"\bstraggler\b", c, re.I)
                                                  for c in r["cells"]):
        problems.append("rank %s is not shown as a straggler (class straggler and the word in a "
                        "cell): %s, cells %s" % (rank, show(slow), text(r)))
flagged = [r for r in ranks if r["attrs"].get("data-rank") != rank and "straggler" in r["classes"]]
if flagged:
    problems.append("ranks not slowed are flagged too: %s" % show(flagged))
if not p.refresh:
    problems.append("no <meta http-equiv=refresh>")
if p.external:
    problems.append("the page loads external resources: %s" % ", ".join(p.external))
if problems:
    print("; ".join(problems))
    sys.exit(1)
print("ok: job %s running, nodes %s busy, rank %s on %s a straggler (%s)"
      % (job, " ".join(nodes), rank, rank_node, text(slow[0])))
EOF

# http URL OUT [TOKEN]: GETs URL (with the bearer TOKEN), the body into OUT, its headers into
# OUT.headers; prints the HTTP status (000: no answer).
if command -v curl >/dev/null; then
  http() {
    local auth=()
    [[ -z "${3:-}" ]] || auth=(-H "Authorization: Bearer $3")
    curl -s --max-time 10 "${auth[@]}" -D "$2.headers" -o "$2" -w '%{http_code}' "$1" || true
  }
else
  http() { python3 -I "$W/http_get.py" "$@"; }
fi
prom() { python3 -I "$W/prom_query.py" "http://127.0.0.1:$P_PROM" "$@"; }

# Processes, by name: spawn runs one under `timeout` (output in $W/NAME.log), so that none outlives
# the test by much even if the test itself is SIGKILLed. PID[NAME] is timeout's pid (waited for:
# it exits with the program's code), REAL[NAME] the program's own (signalled: a SIGTERM sent to
# timeout reaches the program twice, once directly and once through timeout's process group, and
# a second SIGTERM means "now" to accel-agent and accel-launch).
declare -A PID=() REAL=()
spawn() {
  local name=$1 end=$((SECONDS + 10)) p
  shift
  timeout -k 10 "$LIFETIME" "$@" >"$W/$name.log" 2>&1 </dev/null &
  PID[$name]=$!
  while :; do
    p=$(pgrep -P "${PID[$name]}" || true)
    if [[ -n "$p" ]]; then
      REAL[$name]=$p
      return 0
    fi
    kill -0 "${PID[$name]}" 2>/dev/null || fail "$name ended at once: $(tail -n 3 "$W/$name.log")"
    ((SECONDS < end)) || fail "$name did not start within 10 s"
    sleep 0.05
  done
}
# stop NAME...: SIGTERM to each, then up to 20 s in all for them to end, then SIGKILL.
stop() {
  local name end=$((SECONDS + 20))
  for name in "$@"; do
    [[ -z "${PID[$name]:-}" ]] || kill -TERM "${REAL[$name]:-${PID[$name]}}" 2>/dev/null || true
  done
  for name in "$@"; do
    [[ -n "${PID[$name]:-}" ]] || continue
    while kill -0 "${PID[$name]}" 2>/dev/null && ((SECONDS < end)); do sleep 0.1; done
    if kill -0 "${PID[$name]}" 2>/dev/null; then
      echo "$name did not stop within 20 s of SIGTERM: SIGKILL"
      kill -KILL "${PID[$name]}" ${REAL[$name]:+"${REAL[$name]}"} 2>/dev/null || true
    fi
    wait "${PID[$name]}" 2>/dev/null || true
    unset "PID[$name]"
  done
}
# workers_of PID: the train_classifier processes among PID's children.
workers_of() {
  local c arg0
  for c in $(pgrep -P "$1" || true); do
    arg0=""
    IFS= read -r -d '' arg0 2>/dev/null <"/proc/$c/cmdline" || true
    [[ "${arg0##*/}" != "${TRAIN##*/}" ]] || echo "$c"
  done
  return 0
}
rank_of() { tr '\0' '\n' 2>/dev/null <"/proc/$1/environ" | sed -n 's/^RANK=//p'; }

# slow PID SECONDS: SIGSTOP for 0.45 s, SIGCONT for 0.05 s, over and over (run in the background).
slow() {
  local end=$((SECONDS + $2))
  while ((SECONDS < end)); do
    kill -STOP "$1" 2>/dev/null || break
    sleep 0.45
    kill -CONT "$1" 2>/dev/null || break
    sleep 0.05
  done
  kill -CONT "$1" 2>/dev/null || true
}
slow_pid=""
slowed=""
stop_slowing() {
  if [[ -n "$slow_pid" ]]; then
    kill "$slow_pid" 2>/dev/null || true
    wait "$slow_pid" 2>/dev/null || true
    slow_pid=""
  fi
  [[ -z "$slowed" ]] || kill -CONT "$slowed" 2>/dev/null || true
}

# log_tail FILE N: the last N lines of a log, without the workers' epoch lines.
log_tail() { grep -vE '^\[[^]]*\] +epoch ' "$1" 2>/dev/null | tail -n "$2"; }
# What a failure shows: the logs' tails, each endpoint's accel_ samples, Prometheus' targets.
diagnose() {
  set +e
  local name lines addr token f code
  for name in launcher local coordinator agent-n1 agent-n2 prometheus; do
    [[ -s "$W/$name.log" ]] || continue
    lines=12
    [[ $name != launcher ]] || lines=40
    echo "----- $name.log (last $lines lines but the epoch lines)"
    log_tail "$W/$name.log" "$lines"
  done
  for name in coordinator agent-n1 agent-n2 local; do
    case $name in
      coordinator) addr=$CM ;;
      agent-n1) addr=$A1 ;;
      agent-n2) addr=$A2 ;;
      local) addr=$LOCAL ;;
    esac
    token=""
    [[ $name != agent-n2 ]] || token=$METRICS_TOKEN
    f=$W/diag-$name.txt
    code=$(http "http://$addr/metrics" "$f" "$token")
    echo "----- $name's /metrics (HTTP $code; its first 60 accel_ samples)"
    grep '^accel_' "$f" 2>/dev/null | head -n 60
  done
  if [[ -n "${PID[prometheus]:-}" ]]; then
    echo "----- Prometheus' targets"
    prom targets
  fi
  [[ ! -s "$W/dom.txt" ]] || echo "----- the status page's last check: $(cat "$W/dom.txt")"
  echo "-----"
}

diagnosed=0
fail() {
  echo "FAIL: $*"
  if [[ $diagnosed == 0 ]]; then
    diagnosed=1
    diagnose
  fi
  exit 1
}
cleanup() {
  set +e
  stop_slowing
  stop launcher local # first: their jobs are cancelled, the agents stop the workers
  stop agent-n1 agent-n2 coordinator prometheus
  if [[ ${OBSERVE_KEEP:-0} == 1 ]]; then
    echo "kept $W"
  else
    rm -rf "$W"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# wait_log FILE REGEX SECONDS WHAT: fail unless FILE has a line matching REGEX within SECONDS.
wait_log() {
  local end=$((SECONDS + $3))
  until grep -qE -- "$2" "$1" 2>/dev/null; do
    ((SECONDS < end)) || fail "waited $3 s in vain for $4 (no line matching '$2' in $(basename "$1"))"
    sleep 0.2
  done
}
# wait_http URL SECONDS WHAT [TOKEN]: fail unless URL answers 200 within SECONDS.
wait_http() {
  local end=$((SECONDS + $2)) code
  while :; do
    code=$(http "$1" "$W/wait.out" "${4:-}")
    [[ $code != 200 ]] || return 0
    ((SECONDS < end)) || fail "waited $2 s in vain for $3 ($1 answers HTTP $code)"
    sleep 0.2
  done
}
# prom_until SECONDS WHAT EXPR TEST: polls Prometheus until EXPR's value v passes the awk TEST.
prom_until() {
  local end=$((SECONDS + $1)) v
  while :; do
    v=$(prom value "$3" 2>&1 || true)
    if awk -v v="$v" "BEGIN { exit !(v ~ /^[-+]?[0-9.]+([eE][-+]?[0-9]+)?\$/ && ($4)) }"; then
      echo "  $2: $3 = $v"
      return 0
    fi
    if ((SECONDS >= end)); then
      echo "  the series of ${3}:"
      prom series "$3" || true
      fail "$2: after $1 s, $3 = $v (want $4)"
    fi
    sleep 1
  done
}
# metric_value FILE SERIES: the value of SERIES (name and labels as written) in a /metrics text.
metric_value() { awk -v s="$2" '$1 == s { print $2; exit }' "$1"; }
dump_page() { # dump_page URL OUT: the DOM of URL once loaded, as headless Chromium builds it
  timeout -k 5 40 "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run \
    --disable-extensions --disable-background-networking --disable-dev-shm-usage \
    --user-data-dir="$W/chromium" --dump-dom "$1" >"$2" 2>>"$W/chromium.log"
}
declare -A T=()
mark() { T[$1]=$SECONDS; }

echo "== 0. promtool check rules / check config on docs/examples"
out=$(promtool check rules "$root/docs/examples/accel-alerts.yml" 2>&1) ||
  fail "promtool check rules docs/examples/accel-alerts.yml: $out"
echo "  accel-alerts.yml: $(grep -o '[0-9]* rules found' <<<"$out")"
mkdir -p "$W/examples"
cp "$root/docs/examples/prometheus.yml" "$root/docs/examples/accel-alerts.yml" "$W/examples/"
out=$(promtool check config "$W/examples/prometheus.yml" 2>&1) ||
  fail "promtool check config docs/examples/prometheus.yml: $out"
echo "  prometheus.yml: valid (with its rule file)"

echo "== starting a coordinator, agents n1 and n2, a local job and Prometheus"
spawn coordinator "$bin/accel-agent" --serve-coordinator "127.0.0.1:$P_COORD" --coordinator-only \
  --metrics-address "$CM"
wait_log "$W/coordinator.log" 'coordinator listening' 15 "the coordinator to listen"
spawn agent-n1 "$bin/accel-agent" --coordinator "127.0.0.1:$P_COORD" --node-id n1 \
  --state-dir "$W/state-n1" --metrics-address "$P_A1"
spawn agent-n2 "$bin/accel-agent" --coordinator "127.0.0.1:$P_COORD" --node-id n2 \
  --state-dir "$W/state-n2" --metrics-address "$A2" --metrics-token-file "$W/metrics-token"
spawn local "$bin/accel-launch" -n 2 --metrics-port "$P_LOCAL" --job-id "$LOCAL_JOB" "${LOCAL_ARGS[@]}"

cp "$root/docs/examples/accel-alerts.yml" "$W/accel-alerts.yml"
cat >"$W/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [accel-alerts.yml]
scrape_configs:
  - job_name: accel-coordinator
    static_configs: [{targets: ["$CM"]}]
  - job_name: accel-agent
    static_configs: [{targets: ["$A1"]}]
  - job_name: accel-agent-with-token
    authorization: {type: Bearer, credentials_file: "$W/metrics-token"}
    static_configs: [{targets: ["$A2"]}]
  - job_name: accel-local
    static_configs: [{targets: ["$LOCAL"]}]
EOF
spawn prometheus prometheus --config.file="$W/prometheus.yml" --storage.tsdb.path="$W/tsdb" \
  --web.listen-address="127.0.0.1:$P_PROM" --log.level=warn
wait_log "$W/agent-n1.log" 'registered with coordinator' 15 "agent n1 to register"
wait_log "$W/agent-n2.log" 'registered with coordinator' 15 "agent n2 to register"
wait_http "http://$CM/metrics" 10 "the coordinator's /metrics"
wait_http "http://$A1/metrics" 10 "agent n1's /metrics"
wait_http "http://$A2/metrics" 10 "agent n2's /metrics (with the token)" "$METRICS_TOKEN"
wait_log "$W/local.log" 'starting 2 workers' 20 "the local job's workers"
wait_http "http://$LOCAL/metrics" 10 "the local launcher's /metrics"
wait_http "http://127.0.0.1:$P_PROM/-/ready" 30 "Prometheus to be ready"
mark ready
echo "  ready after ${T[ready]} s: coordinator $CM, n1 $A1, n2 $A2 (token), local $LOCAL," \
  "Prometheus :$P_PROM"
# Why before the other job: its niced workers start up (libtorch, data) while the CPU is free.
prom_until 30 "the local job trains" "count(accel_rank_steps_per_second{instance=\"$LOCAL\"} > 0)" \
  'v >= 1'

echo "== 1. the job: a worker SIGKILLed once, one restart"
mark submit
spawn launcher "$bin/accel-launch" --coordinator "127.0.0.1:$P_COORD" --nodes 2 -n 1 \
  --max-restarts 1 --straggler-threshold 1.5 --straggler-window 5s --job-id "$JOB" -- \
  "$TRAIN" "${TRAIN_ARGS[@]}"
wait_log "$W/launcher.log" "job $JOB submitted to coordinator" 20 "the submission of job $JOB"
wait_log "$W/launcher.log" 'all 2 workers of round 0 started' 30 "round 0's workers"
mark round0
# Why wait for Prometheus: the restart counter must be scraped before the restart (at 0) for
# increase(), and so the restart alert, to see it.
prom_until 30 "round 0 trains" "count(accel_rank_steps_per_second{job_id=\"$JOB\"} > 0)" 'v >= 1'
sleep 2
end=$((SECONDS + 10))
victim=""
old_n2=""
until [[ -n "$victim" && -n "$old_n2" ]]; do
  ((SECONDS < end)) ||
    fail "no train_classifier among the children of agent n1 (${REAL[agent-n1]}) and n2 (${REAL[agent-n2]})"
  victim=$(workers_of "${REAL[agent-n1]}" | head -n 1)
  old_n2=$(workers_of "${REAL[agent-n2]}" | head -n 1)
  sleep 0.2
done
kill -0 "${PID[launcher]}" 2>/dev/null || fail "the job ended before the kill"
victim_rank=$(rank_of "$victim")
kill -KILL "$victim"
mark kill
echo "  SIGKILLed n1's worker (pid $victim, rank $victim_rank)"
wait_log "$W/launcher.log" \
  "restarting: rank [0-9]+ on .*\\(pid $victim\\) failed: SIGKILL.*\\(restart 1 of 1\\)" 20 \
  "the launcher's restart after the SIGKILL of pid $victim"
wait_log "$W/launcher.log" 'all 2 workers of round 1 started' 40 "round 1's workers"
mark round1
end=$((SECONDS + 10))
slowed=""
while :; do
  slowed=$(workers_of "${REAL[agent-n2]}" | head -n 1)
  [[ -z "$slowed" || "$slowed" == "$old_n2" ]] || break
  ((SECONDS < end)) || fail "no new train_classifier under agent n2 in round 1 (round 0's was $old_n2)"
  sleep 0.2
done
slowed_rank=$(rank_of "$slowed")
[[ "$slowed_rank" =~ ^[01]$ ]] || fail "n2's worker (pid $slowed) has RANK='$slowed_rank'"
echo "  round 1 after $((T[round1] - T[kill])) s; n2 runs rank $slowed_rank (pid $slowed)"

echo "== 1. Prometheus (scraping every second)"
prom_until 30 "every target up" 'count(up == 1)' 'v == 4'
prom_until 20 "both nodes live" "sum(accel_coordinator_nodes{instance=\"$CM\",state!=\"lost\"})" 'v == 2'
prom_until 20 "one restart" "sum(accel_job_restarts_total{instance=\"$CM\",job_id=\"$JOB\"})" 'v == 1'
prom_until 20 "both agents' ranks train" \
  "count(accel_rank_steps_per_second{job_id=\"$JOB\",instance=~\"$A1|$A2\"} > 0)" 'v >= 2'
# Why a wait of its own: the coordinator hears the ranks' rates with each agent's sync (a few
# seconds apart), after the agents serve them.
prom_until 20 "the coordinator's view of the job's speed" \
  "max(accel_job_steps_per_second{instance=\"$CM\",job_id=\"$JOB\",stat=\"median\"})" 'v > 0'
# Why this can fail while the sum above is 1: a counter whose series first appears at 1 is never
# an increase() to Prometheus; each job's causes must be exported at 0 from the job's start.
prom_until 20 "the restart alert of docs/examples/accel-alerts.yml" \
  "count(ALERTS{alertname=\"AccelJobRestarted\",job_id=\"$JOB\"})" 'v >= 1'
mark prometheus

echo "== 2. every /metrics: format 0.0.4, the expected metrics, promtool check metrics; every / is HTML"
COORD_METRICS="accel_coordinator_jobs accel_coordinator_nodes accel_job_rounds_total
  accel_job_restarts_total accel_job_steps_per_second accel_job_stragglers
  accel_coordinator_rpcs_total accel_coordinator_rpc_duration_seconds_bucket
  accel_coordinator_lease_misses_total"
AGENT_METRICS="accel_agent_workers accel_rank_step accel_rank_steps_per_second
  accel_rank_seconds_since_step accel_rank_collective_wait_seconds_total
  accel_worker_resident_memory_bytes accel_worker_cpu_seconds_total
  accel_agent_log_lines_forwarded_total accel_agent_log_lines_dropped_total"
LOCAL_METRICS="accel_coordinator_jobs accel_coordinator_nodes accel_agent_workers accel_rank_step
  accel_rank_steps_per_second accel_rank_seconds_since_step"
for endpoint in coordinator agent-n1 agent-n2 local; do
  case $endpoint in
    coordinator) addr=$CM names=$COORD_METRICS ;;
    agent-n1) addr=$A1 names=$AGENT_METRICS ;;
    agent-n2) addr=$A2 names=$AGENT_METRICS ;;
    local) addr=$LOCAL names=$LOCAL_METRICS ;;
  esac
  token=""
  [[ $endpoint != agent-n2 ]] || token=$METRICS_TOKEN
  f=$W/metrics-$endpoint.txt
  code=$(http "http://$addr/metrics" "$f" "$token")
  [[ $code == 200 ]] || fail "$endpoint: GET /metrics answered HTTP $code"
  grep -qiE '^content-type: *text/plain; *version=0\.0\.4' "$f.headers" ||
    fail "$endpoint's /metrics is not text format 0.0.4: $(grep -i '^content-type' "$f.headers")"
  absent=""
  for name in $names; do
    grep -qE "^$name(\\{| )" "$f" || absent+=" $name"
  done
  [[ -z "$absent" ]] || fail "$endpoint's /metrics has no sample of:$absent"
  out=$(promtool check metrics <"$f" 2>&1) || fail "promtool check metrics on $endpoint's /metrics: $out"
  code=$(http "http://$addr/" "$W/page-$endpoint.html" "$token")
  [[ $code == 200 ]] || fail "$endpoint: GET / answered HTTP $code"
  grep -qiE '^content-type: *text/html' "$W/page-$endpoint.html.headers" ||
    fail "$endpoint's / is not HTML: $(grep -i '^content-type' "$W/page-$endpoint.html.headers")"
  echo "  $endpoint: $(grep -c '^accel_' "$f") accel_ samples, promtool check metrics passes, / is HTML"
done

echo "== 3. --metrics-token-file (agent n2)"
code=$(http "http://$A2/metrics" "$W/no-token.txt")
[[ $code == 401 ]] || fail "agent n2's /metrics without the token answered HTTP $code, not 401"
code=$(http "http://$A2/metrics" "$W/wrong-token.txt" "x$METRICS_TOKEN")
[[ $code == 401 ]] || fail "agent n2's /metrics with a wrong token answered HTTP $code, not 401"
code=$(http "http://$A2/" "$W/no-token-page.txt")
[[ $code == 401 ]] || fail "agent n2's status page without the token answered HTTP $code, not 401"
echo "  without the token: 401 (/metrics and /), a wrong one: 401, with it: 200 (as Prometheus scrapes)"

echo "== 3b. a PyTorch script as HF users write it (no libaccel): its workers' memory and CPU"
# Why: most users run Python under accel-launch; their workers keep no progress page, and must
# still be seen (RSS, CPU), without a step series that would read 0.
cat >"$W/hf_style.py" <<'PY'
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1000)
end = time.time() + 60
while time.time() < end:
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
PY
spawn pyjob "$bin/accel-launch" -n 2 --metrics-port "$P_PY" -- /usr/bin/python3 "$W/hf_style.py"
end=$((SECONDS + 30))
until http "http://127.0.0.1:$P_PY/metrics" "$W/metrics-py.txt" >/dev/null &&
  [[ $(grep -c '^accel_worker_resident_memory_bytes{.*rank="[01]"' "$W/metrics-py.txt") == 2 ]]; do
  ((SECONDS < end)) || fail "the Python job's /metrics has no memory series for ranks 0 and 1: \
$(grep '^accel_worker\|^accel_agent_workers' "$W/metrics-py.txt" 2>/dev/null)"
  sleep 0.5
done
[[ $(grep -c '^accel_worker_cpu_seconds_total{.*rank="[01]"' "$W/metrics-py.txt") == 2 ]] ||
  fail "the Python job's /metrics has no CPU series for both ranks"
! grep -q '^accel_rank_step{' "$W/metrics-py.txt" ||
  fail "the Python job (no libaccel) has a step series: $(grep '^accel_rank_step{' "$W/metrics-py.txt")"
out=$(promtool check metrics <"$W/metrics-py.txt" 2>&1) || fail "promtool check metrics, Python job: $out"
stop pyjob
echo "  2 Python ranks: memory and CPU series, no step series, promtool check metrics passes"

echo "== 4. rank $slowed_rank (n2) slowed: a straggler on the page, in Prometheus, in the launcher's output"
slow "$slowed" 100 &
slow_pid=$!
mark slow
end=$((SECONDS + 60))
pages=0
until dump_page "http://$CM/" "$W/page.html" && pages=$((pages + 1)) &&
  python3 -I "$W/status_page.py" "$W/page.html" "$JOB" "$slowed_rank" n2 n1 n2 >"$W/dom.txt"; do
  kill -0 "${PID[launcher]}" 2>/dev/null || fail "the job ended while rank $slowed_rank was slowed"
  ((SECONDS < end)) || fail "after 60 s of slowing rank $slowed_rank ($pages pages loaded):" \
    "$(cat "$W/dom.txt" 2>/dev/null || echo "Chromium loaded no page: $(tail -n 3 "$W/chromium.log")")"
  sleep 1
done
mark page
echo "  $(cat "$W/dom.txt")"
echo "  after $((T[page] - T[slow])) s of slowing ($pages page(s) loaded in Chromium)"
prom_until 15 "the straggler gauge" \
  "max(accel_rank_straggler{instance=\"$CM\",job_id=\"$JOB\",rank=\"$slowed_rank\",node=\"n2\"})" 'v == 1'
prom_until 15 "the job's stragglers" "max(accel_job_stragglers{instance=\"$CM\",job_id=\"$JOB\"})" 'v >= 1'
wait_log "$W/launcher.log" "rank $slowed_rank on node n2 is [0-9.]+x slower than the median" 15 \
  "the launcher's straggler line"
echo "  launcher: $(grep -m 1 -E "rank $slowed_rank on node n2 is [0-9.]+x slower" "$W/launcher.log")"
stop_slowing
prom_until 15 "a straggler report" \
  "sum(accel_job_straggler_reports_total{instance=\"$CM\",job_id=\"$JOB\"})" 'v >= 1'
mark straggler

echo "== 5. SIGTERM to the launcher cancels the job"
kill -0 "${PID[launcher]}" 2>/dev/null ||
  fail "the job ended before the checks did (make TRAIN_ARGS' run longer)"
kill -TERM "${REAL[launcher]}"
end=$((SECONDS + 30))
while kill -0 "${PID[launcher]}" 2>/dev/null && ((SECONDS < end)); do sleep 0.2; done
kill -0 "${PID[launcher]}" 2>/dev/null && fail "the launcher still runs 30 s after SIGTERM"
rc=0
wait "${PID[launcher]}" || rc=$?
unset 'PID[launcher]'
[[ $rc == 143 ]] || fail "the launcher exited with $rc after SIGTERM, not 143"
grep -q "received SIGTERM: cancelling job $JOB" "$W/launcher.log" ||
  fail "the launcher exited on SIGTERM without cancelling job $JOB (no 'received SIGTERM: cancelling" \
    "job' line): the signal killed it, as when a thread that does not block it (one gRPC started" \
    "before run_submit's pthread_sigmask) takes it"
end=$((SECONDS + 15))
while :; do
  http "http://$CM/metrics" "$W/metrics-after.txt" >/dev/null
  cancelled=$(metric_value "$W/metrics-after.txt" 'accel_coordinator_jobs{state="cancelled"}')
  idle=$(metric_value "$W/metrics-after.txt" 'accel_coordinator_nodes{state="idle"}')
  if awk -v c="$cancelled" -v i="$idle" 'BEGIN { exit !(c == 1 && i == 2) }'; then break; fi
  ((SECONDS < end)) ||
    fail "15 s after the cancel the coordinator has cancelled jobs '$cancelled', idle nodes '$idle' (want 1, 2)"
  sleep 0.5
done
restarts=$(grep -c 'restarting:' "$W/launcher.log" || true)
[[ $restarts == 1 ]] ||
  fail "the job restarted $restarts times, not once: $(grep 'restarting:' "$W/launcher.log")"
mark end
echo "  launcher exit code 143; accel_coordinator_jobs{state=\"cancelled\"} $cancelled," \
  "accel_coordinator_nodes{state=\"idle\"} $idle"

echo "== summary"
printf '  %-60s %4s s\n' "daemons, metrics endpoints and Prometheus ready" "${T[ready]}" \
  "submission -> round 0 started" "$((T[round0] - T[submit]))" \
  "kill -> round 1 started" "$((T[round1] - T[kill]))" \
  "round 1 -> Prometheus saw the restart, nodes, steps, alert" "$((T[prometheus] - T[round1]))" \
  "slowing -> straggler on the status page" "$((T[page] - T[slow]))" \
  "slowing -> straggler in Prometheus and the launcher's output" "$((T[straggler] - T[slow]))" \
  "total" "$SECONDS"
echo "PASS: observe (Prometheus scrapes 4 endpoints; 1 restart; promtool; 401;" \
  "Chromium shows rank $slowed_rank a straggler)"
