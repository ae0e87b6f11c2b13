#!/usr/bin/env python3
"""What a worker's SIGKILL costs: in-memory snapshots at every step against disk checkpoints, in one run.

A job of 2 nodes x 2 processes (two standing accel-agents on this machine, one serving the
coordinator) trains bench_recovery (model M: 784->2048->2048->10, AdamW, batch 64 per process, on
a prepared DataLoader). For each way of keeping the state, a worker of node 1 is SIGKILLed once
rank 0 has printed step --kill-at; the group restarts and resumes. Measured, from rank 0's
"STEP <n> <unix ms>" lines and its "accel: resumed from ..." line:
  first step: from the SIGKILL to the end of the first step of the restarted group (the restart,
            libtorch's start, the rendezvous, the load, and one step)
  back: from the SIGKILL until the group finishes a step past the last one finished before it
            (the first step, and the steps trained again): what the kill cost
  steps retrained: the last step rank 0 finished before the kill minus the step resumed at
  final weights: bitwise those of a run never killed (their sum printed with 17 digits)
and, without kills, steps/s with snapshots at every step (and every --sparse steps) against none.
Ways: --snapshot-interval 1 (memory), and --checkpoint-interval C to a folder on this disk, in
the foreground and --async-checkpoints (disk). Then a lost node: node 1's agent SIGKILLed (its
workers die with it, and its snapshots go) and started again, as systemd would, with snapshots
(the restarted node is sent node 0's) and with checkpoints. Then the same with a state of
--state-mb MB (parameters and AdamW state; fewer steps).

Usage, from the repo root after building (scripts/build.sh):
    python3 bench/checkpoint/bench_recovery.py [--build build] [--steps 240] [--kill-at 140]
        [--checkpoint-interval 50] [--state-mb 500] [--runs 1]
Targets printed: a kill with snapshots at every step costs < 2 s and 0 steps retrained (model M);
the snapshots cost <= 5% of the steps/s.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "control"))
from bench_control import free_port  # noqa: E402  (shared with the control-plane benchmark)

TOKEN = "bench-recovery-token"
STEP = re.compile(r"STEP (\d+) (\d+)")
RESUMED = re.compile(r"accel: resumed from (the in-memory snapshot )?\S+ at step (\d+)")
SENT = re.compile(r"accel: the in-memory snapshot of step \d+ came from the memory of")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    e.update(ACCEL_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    e.update(extra)
    return e


def children(pid):
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            out.append(int(name))
    return out


class Cluster:
    """Two standing agents: node 0 also serves the coordinator (a 3 s lease)."""

    def __init__(self, bindir, tmp):
        self.target = f"127.0.0.1:{free_port()}"
        self.args = [
            [f"{bindir}/accel-agent", "--serve-coordinator", self.target, "--lease-timeout", "3s",
             "--node-id", "n0", "-q", "--state-dir", os.path.join(tmp, "s0")],
            [f"{bindir}/accel-agent", "--coordinator", self.target, "--node-id", "n1", "-q",
             "--state-dir", os.path.join(tmp, "s1")]]
        self.agents = [self.start(i) for i in range(2)]
        time.sleep(1.5)

    def start(self, i):
        return subprocess.Popen(self.args[i], env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def lose_node(self, i):
        """SIGKILLs agent i (its workers die with it) and starts it again, as systemd would."""
        self.agents[i].kill()
        self.agents[i].wait(timeout=10)
        self.agents[i] = self.start(i)

    def close(self):
        for p in self.agents:
            p.terminate()
        for p in self.agents:
            p.wait(timeout=30)


def run_job(b, cluster, tmp, flags, steps, state_mb, kill_at=None, node=False):
    """One job; returns its figures: steps/s, final weights' sum, and with kill_at the kill's (of a
    worker of node 1; with node, of node 1's agent, started again at once)."""
    cmd = [f"{b}/accel-launch", "--coordinator", cluster.target, "--nodes", "2", "-n", "2",
           "--max-restarts", "3", *flags, "--", f"{b}/bench_recovery", "--steps", str(steps),
           "--state-mb", str(state_mb)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp)
    err_lines = []
    threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True).start()
    out = {"kill_ms": None, "last_before": None, "resumed_at": None, "from_memory": None,
           "from_peer": False, "first_after_ms": None, "back_ms": None, "sps": None, "weights": None}
    last_step = 0
    resumed = False
    for line in proc.stdout:
        m = STEP.search(line)
        if m:
            n, t = int(m.group(1)), int(m.group(2))
            if resumed and out["first_after_ms"] is None:
                out["first_after_ms"] = t
            if resumed and out["back_ms"] is None and n > out["last_before"]:
                out["back_ms"] = t
            if not resumed:
                last_step = max(last_step, n)
            if kill_at is not None and out["kill_ms"] is None and n >= kill_at:
                victims = children(cluster.agents[1].pid)
                if victims:
                    out["kill_ms"] = time.time() * 1000.0
                    if node:
                        cluster.lose_node(1)
                    else:
                        os.kill(victims[-1], 9)
            continue
        if SENT.search(line) and out["kill_ms"] is not None:
            out["from_peer"] = True
            continue
        m = RESUMED.search(line)
        if m and out["kill_ms"] is not None:
            resumed = True
            out["last_before"] = last_step
            out["resumed_at"] = int(m.group(2))
            out["from_memory"] = m.group(1) is not None
            continue
        if line.lstrip().startswith("{") or "{\"steps_per_s\"" in line:
            body = line[line.find("{"):]
            out["sps"] = float(re.search(r'"steps_per_s": ([0-9.]+)', body).group(1))
            out["weights"] = re.search(r'"weights_sum": (\S+)}', body).group(1)
    proc.wait(timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"job failed ({proc.returncode}): {' '.join(cmd)}\n{''.join(err_lines)[-4000:]}")
    if kill_at is not None and (out["kill_ms"] is None or out["first_after_ms"] is None):
        sys.exit(f"no kill and resume seen in: {' '.join(cmd)}\n{''.join(err_lines)[-4000:]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--kill-at", type=int, default=140)
    ap.add_argument("--checkpoint-interval", type=int, default=50)
    ap.add_argument("--state-mb", type=int, default=500)
    ap.add_argument("--big-steps", type=int, default=16)
    ap.add_argument("--big-kill-at", type=int, default=11)
    ap.add_argument("--big-checkpoint-interval", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--sparse", type=int, default=10,
                    help="also the steps/s with a snapshot every this many steps")
    a = ap.parse_args()
    b = os.path.abspath(os.path.join(a.build, "bin"))
    with open("/proc/cpuinfo") as f:
        cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} vCPUs; 2 nodes x 2 processes on this machine\n")
    tmp = tempfile.mkdtemp(prefix="bench_recovery_")
    cluster = Cluster(b, tmp)
    rows, checks = [], []
    try:
        def ck(name):
            return ["--checkpoint-dir", os.path.join(tmp, name)]

        # Steps/s without kills: none, snapshots every step (alternating, --runs times each).
        plain, snap, sparse = [], [], []
        reference = None
        for _ in range(a.runs):
            r = run_job(b, cluster, tmp, [], a.steps, 0)
            plain.append(r["sps"])
            reference = r["weights"]
            snap.append(run_job(b, cluster, tmp, ["--snapshot-interval", "1"], a.steps, 0)["sps"])
            sparse.append(run_job(b, cluster, tmp, ["--snapshot-interval", str(a.sparse)], a.steps,
                                  0)["sps"])
        overhead = 1.0 - statistics.median(snap) / statistics.median(plain)
        sparse_overhead = 1.0 - statistics.median(sparse) / statistics.median(plain)
        print("| model M, no kill | steps/s (median) | cost |\n|---|---:|---:|")
        print(f"| nothing kept | {statistics.median(plain):.2f} | |")
        print(f"| snapshot every step | {statistics.median(snap):.2f} | {overhead * 100:.1f}% |")
        print(f"| snapshot every {a.sparse} steps | {statistics.median(sparse):.2f} | "
              f"{sparse_overhead * 100:.1f}% |\n")
        checks.append(("snapshots every step cost <= 5% of model M's steps/s",
                       f"{overhead * 100:.1f}%", overhead <= 0.05))

        def kills(label, steps, kill_at, interval, state_mb, ref):
            ways = [("snapshot every step", ["--snapshot-interval", "1"], False),
                    (f"checkpoint every {interval} steps", ck("ck") +
                     ["--checkpoint-interval", str(interval)], False),
                    (f"background checkpoint every {interval} steps", ck("ck") +
                     ["--checkpoint-interval", str(interval), "--async-checkpoints"], False),
                    ("node lost: snapshot every step", ["--snapshot-interval", "1"], True),
                    (f"node lost: checkpoint every {interval} steps", ck("ck") +
                     ["--checkpoint-interval", str(interval)], True)]
            for i, (name, flags, node) in enumerate(ways):
                results = []
                for run in range(a.runs):
                    shutil.rmtree(os.path.join(tmp, "ck"), ignore_errors=True)
                    results.append(run_job(b, cluster, tmp, flags, steps, state_mb, kill_at, node))
                rec = statistics.median([(r["first_after_ms"] - r["kill_ms"]) / 1000.0 for r in results])
                back = statistics.median([(r["back_ms"] - r["kill_ms"]) / 1000.0 for r in results])
                lost = max(r["last_before"] - r["resumed_at"] for r in results)
                same = all(r["weights"] == ref for r in results) if ref else None
                source = "disk"
                if all(r["from_memory"] for r in results):
                    source = "a peer's memory" if all(r["from_peer"] for r in results) else "memory"
                rows.append((label, name, rec, back, lost, source, same))
                if i == 0 and label == "model M":
                    checks.append(("model M, kill with snapshots every step: recovery < 2 s",
                                   f"{rec:.2f} s", rec < 2.0))
                    checks.append(("model M, kill with snapshots every step: 0 steps retrained",
                                   str(lost), lost == 0))
                if node and flags[0] == "--snapshot-interval":
                    checks.append((f"{label}, node lost with snapshots every step: resumed from a "
                                   "peer's memory", source, source == "a peer's memory"))
                if same is not None:
                    checks.append((f"{label}, {name}: final weights those of the run never killed",
                                   "yes" if same else "NO", same))

        kills("model M", a.steps, a.kill_at, a.checkpoint_interval, 0, reference)
        if a.state_mb > 0:
            big_ref = run_job(b, cluster, tmp, [], a.big_steps, a.state_mb)["weights"]
            kills(f"{a.state_mb} MB state", a.big_steps, a.big_kill_at, a.big_checkpoint_interval,
                  a.state_mb, big_ref)
    finally:
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"SIGKILL of a worker of node 1 (node lost: of node 1's agent, started again at once) once "
          f"rank 0 finished step {a.kill_at} (model M) or {a.big_kill_at} ({a.state_mb} MB); "
          f"median of {a.runs}:\n")
    print("| state | kept by | first step after the kill (s) | back past the killed step (s) | "
          "steps retrained | resumed from | weights = unkilled run |")
    print("|---|---|---:|---:|---:|---|---|")
    for label, name, rec, back, lost, source, same in rows:
        print(f"| {label} | {name} | {rec:.2f} | {back:.2f} | {lost} | {source} | "
              f"{'-' if same is None else ('yes' if same else 'NO')} |")
    print("\n| target | measured | met |\n|---|---:|---|")
    for name, value, ok in checks:
        print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
