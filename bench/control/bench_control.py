#!/usr/bin/env python3
"""Control-plane benchmarks, against torchrun in the same run.

1. Launch (whole command, 2 workers running /bin/true) and crash -> replacement started, for:
   accel-launch local mode, accel with 2 standing agents (mode 3, submit from accel-launch),
   accel with every node running accel-launch (mode 2, 2 nodes on this machine), torchrun
   --standalone, and torchrun with c10d rendezvous over 2 nodes on this machine.
2. Coordinator scale: N simulated agents (bench_coordinator) registering, completing one
   rendezvous and polling as agents without workers' progress do (a parked Sync of the idle wait
   the coordinator offers, 30 s), then at 1 Hz, against a real coordinator process (accel-agent
   --serve-coordinator --coordinator-only); its CPU and memory, and the 16,384-agent targets.
3. Agent memory (RSS of an idle and of a working accel-agent) and lost-node detection time.

With --metrics every accel process serves /metrics and its status page (metrics_address), and
part 2 scrapes the coordinator's /metrics and / once a second while the agents run: the same
figures with an operator watching.

Usage, from the repo root after scripts/build.sh:
    python3 bench/control/bench_control.py [--runs 5] [--agents 64,256,1024,4096] [--build build]
        [--metrics]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
from bench_launch import PYTHON, median_of  # noqa: E402  (shared with the local launch benchmark)

TOKEN = "bench-token"
METRICS = False  # --metrics: every accel process serves /metrics (a free port each)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    e["ACCEL_TOKEN"] = TOKEN
    if METRICS:
        e["ACCEL_METRICS_ADDRESS"] = "127.0.0.1:0"
    e.update(extra)
    return e


def timed(cmds, extra_env=None, timeout=180):
    """Starts every command at once; returns seconds until all have exited 0."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env(**(extra_env or {})), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for c in cmds]
    for p, c in zip(procs, cmds):
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            sys.exit(f"command failed ({p.returncode}): {' '.join(c)}\n{err.decode()[-3000:]}")
    return time.perf_counter() - t0


def crash_to_respawn(cmds):
    with tempfile.TemporaryDirectory() as out:
        timed(cmds, {"BENCH_OUT": out})
        with open(os.path.join(out, "crash")) as f:
            crash = int(f.read())
        with open(os.path.join(out, "start_0")) as f:
            start = int(f.read())
        return (start - crash) / 1e6


class Agents:
    """A coordinator-serving agent and more agents, standing like systemd ones."""

    def __init__(self, bindir, count, lease="10s"):
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.procs = [subprocess.Popen(
            [f"{bindir}/accel-agent", "--serve-coordinator", self.target, "--node-id", "a0", "-q",
             "--lease-timeout", lease], env=env(), stderr=subprocess.DEVNULL)]
        for i in range(1, count):
            self.procs.append(subprocess.Popen(
                [f"{bindir}/accel-agent", "--coordinator", self.target, "--node-id", f"a{i}", "-q"],
                env=env(), stderr=subprocess.DEVNULL))
        time.sleep(1.0)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(timeout=20)


def rss_kb(pid, field="VmRSS"):
    """A memory figure of /proc/PID/status in KiB: VmRSS, RssAnon (the process's own memory) or
    RssFile (mapped files: shared libraries' code, mostly)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def torchrun_nodes(port, nnodes, rank, extra):
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(rank),
            "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
            "--rdzv_id", f"bench{port}", "--no_python", "--redirects", "9:0", "--tee", "9:0",
            "--monitor_interval", "0.1"] + extra


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--agents", default="64,256,1024,4096")
    ap.add_argument("--build", default="build")
    ap.add_argument("--skip-torchrun", action="store_true")
    ap.add_argument("--only-scale", action="store_true", help="run part 2 (coordinator scale) alone")
    ap.add_argument("--metrics", action="store_true",
                    help="serve /metrics from every accel process and scrape the coordinator at 1 Hz")
    args = ap.parse_args()
    global METRICS
    METRICS = args.metrics
    b = os.path.abspath(os.path.join(args.build, "bin"))
    launch = f"{b}/accel-launch"
    crash = f"{b}/bench_crash_worker"
    for path in (launch, crash, f"{b}/accel-agent", f"{b}/bench_coordinator"):
        if not os.access(path, os.X_OK):
            sys.exit(f"{path} not found: run scripts/build.sh first")
    print(f"# accel control plane vs torchrun, {args.runs} runs each (medians), {os.cpu_count()} CPUs"
          + (", metrics served (the coordinator scraped at 1 Hz)" if METRICS else ""))
    print()
    if args.only_scale:
        scale_targets(coordinator_scale(b, args))
        return
    rows = []

    # 1. launch and crash -> replacement
    rows.append(("launch 2 x /bin/true", "accel-launch -n 2 (local, mode 1)",
                 1e3 * median_of(args.runs, lambda: timed([[launch, "-q", "-n", "2", "/bin/true"]]))))
    agents = Agents(b, 2)
    try:
        rows.append(("launch 2 x /bin/true", "accel, 2 standing agents (mode 3)",
                     1e3 * median_of(args.runs, lambda: timed([[launch, "-q", "--coordinator", agents.target,
                                                                "--nodes", "2", "-n", "1", "/bin/true"]]))))
        mode3_crash = median_of(args.runs, lambda: crash_to_respawn(
            [[launch, "-q", "--coordinator", agents.target, "--nodes", "2", "-n", "1", "--max-restarts", "1",
              "--env", "BENCH_OUT", crash]]))
    finally:
        agents.close()

    def mode2(extra_args, worker):
        port = free_port()
        return [[launch, "-q", "--nodes", "2", "--machine-rank", str(r), "-n", "1", "--coordinator-port",
                 str(port)] + extra_args + [worker] for r in (0, 1)]
    rows.append(("launch 2 x /bin/true", "accel-launch on each of 2 nodes (mode 2)",
                 1e3 * median_of(args.runs, lambda: timed(mode2([], "/bin/true")))))
    local_crash = median_of(args.runs, lambda: crash_to_respawn([[launch, "-q", "-n", "2", "--max-restarts", "1",
                                                                  crash]]))
    mode2_crash = median_of(args.runs, lambda: crash_to_respawn(mode2(["--max-restarts", "1"], crash)))
    if not args.skip_torchrun:
        standalone = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no_python",
                      "--redirects", "9:0", "--tee", "9:0", "--monitor_interval", "0.1"]
        rows.append(("launch 2 x /bin/true", "torchrun --standalone -n 2",
                     1e3 * median_of(args.runs, lambda: timed([standalone + ["/bin/true"]]))))

        def tr2(extra):
            port = free_port()
            return [torchrun_nodes(port, 2, r, extra) for r in (0, 1)]
        rows.append(("launch 2 x /bin/true", "torchrun c10d rendezvous, 2 nodes",
                     1e3 * median_of(args.runs, lambda: timed(tr2(["/bin/true"])))))
    rows.append(("crash -> replacement started", "accel-launch -n 2 (local, mode 1)", local_crash))
    rows.append(("crash -> replacement started", "accel, 2 standing agents (mode 3)", mode3_crash))
    rows.append(("crash -> replacement started", "accel-launch on each of 2 nodes (mode 2)", mode2_crash))
    if not args.skip_torchrun:
        rows.append(("crash -> replacement started", "torchrun c10d rendezvous, 2 nodes",
                     median_of(args.runs, lambda: crash_to_respawn(tr2(["--max_restarts", "1", crash])))))
    print("| what | launcher | median (ms) |")
    print("|---|---|---:|")
    for what, who, ms in rows:
        print(f"| {what} | {who} | {ms:.1f} |")
    print()

    results = coordinator_scale(b, args)
    agent_memory(b, launch)
    scale_targets(results)


def scale_targets(results):
    """The scale targets, for the sizes this run measured."""
    for n in (1024, 16384):
        if n not in results:
            continue
        r = results[n]["rendezvous_ms"]
        print(f"{n}-agent rendezvous: {r:.0f} ms (target < 2000 ms: {'met' if r < 2000 else 'NOT met'})")
    if 16384 in results:
        c = results[16384]["steady_cpu_pct"]
        print(f"16384 agents' polls (liveness within the lease): {c:.0f}% of a core "
              f"(target <= 25%: {'met' if c <= 25 else 'NOT met'})")


def coordinator_scale(b, args):
    """Part 2: N simulated agents against a real coordinator process."""
    print("| simulated agents | register all (ms) | rendezvous (ms) | coordinator CPU, rendezvous (s) | "
          "coordinator CPU, agents' own polls | coordinator CPU at 1 Hz polls | "
          "coordinator RSS (MB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    results = {}
    notes = []
    for n in [int(x) for x in args.agents.split(",")]:
        port = free_port()
        extra = []
        if METRICS:
            metrics_port = free_port()
            extra = ["--metrics-address", f"127.0.0.1:{metrics_port}"]
        coord = subprocess.Popen([f"{b}/accel-agent", "--serve-coordinator", f"127.0.0.1:{port}", "--coordinator-only",
                                  "-q", "--coordinator-max-nodes", str(max(8192, n + 64))] + extra,
                                 env=env(), stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        done = threading.Event()
        scrapes = []

        def scrape():
            # Why both: Prometheus asks for /metrics, a person watching the page for /.
            while not done.wait(1.0):
                t0 = time.perf_counter()
                for path in ("/metrics", "/"):
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=5).read()
                    except OSError as e:
                        scrapes.append(f"error: {e}")
                scrapes.append(time.perf_counter() - t0)
        scraper = threading.Thread(target=scrape) if METRICS else None
        if scraper:
            scraper.start()
        try:
            out = subprocess.run([f"{b}/bench_coordinator", "--target", f"127.0.0.1:{port}", "--token", TOKEN,
                                  "--agents", str(n), "--coordinator-pid", str(coord.pid), "--steady-s", "5"],
                                 capture_output=True, text=True, timeout=300)
        finally:
            done.set()
            if scraper:
                scraper.join()
            coord.terminate()
            coord.wait(timeout=20)
        if METRICS:
            times = [s for s in scrapes if not isinstance(s, str)]
            errors = [s for s in scrapes if isinstance(s, str)]
            notes.append(f"{n} agents: {len(times)} scrapes of the coordinator's /metrics and /, the slowest "
                         f"{1e3 * max(times, default=0):.0f} ms, {len(errors)} errors {errors[:1]}")
        if out.returncode != 0:
            print(f"| {n} | failed: {out.stderr.strip()[-200:]} | | | | | |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[n] = r
        if r.get("errors", 0) > 0:
            said = [line for line in out.stderr.splitlines() if line.startswith(("failed calls", "the submit"))]
            notes.append(f"{n} agents: {r['errors']} failed calls ({'; '.join(said)[:600]})")
        print(f"| {n} | {r['register_ms']:.0f} | {r['rendezvous_ms']:.0f} | {r['rendezvous_cpu_s']:.2f} | "
              f"{r['steady_cpu_pct']:.0f}% ({r['steady_syncs_per_s']:.0f} syncs/s, wait "
              f"{r['agent_wait_ms'] / 1000:.1f} s) | {r['cpu_1hz_pct']:.0f}% ({r['syncs_1hz_per_s']:.0f} syncs/s) | "
              f"{r['rss_mb']:.0f} |")
    print()
    for note in notes:
        print(note)
    if notes:
        print()
    return results


def agent_memory(b, launch):
    """Part 3: agent memory, lost-node detection."""
    agents = Agents(b, 2, lease="10s")
    try:
        idle = rss_kb(agents.procs[1].pid)
        idle_anon = rss_kb(agents.procs[1].pid, "RssAnon")
        idle_file = rss_kb(agents.procs[1].pid, "RssFile")
        worker_dir = tempfile.mkdtemp()
        job = subprocess.Popen([launch, "-q", "--coordinator", agents.target, "--nodes", "2", "-n", "2", "--",
                                "sleep", "2"], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        busy = rss_kb(agents.procs[1].pid)
        job.wait(timeout=60)
        agents.procs[1].kill()
        t_kill = time.perf_counter()
        lost_s = None
        not_yet_s = 0.0  # when the last accel status call that still saw a1 alive began
        while time.perf_counter() - t_kill < 30:
            began = time.perf_counter() - t_kill
            st = subprocess.run([f"{b}/accel", "status", "--coordinator", agents.target], env=env(),
                                capture_output=True, text=True)
            if " a1 " in st.stdout and "LOST" in st.stdout:
                lost_s = time.perf_counter() - t_kill
                break
            not_yet_s = began
            time.sleep(0.05)
    finally:
        agents.close()
    print(f"accel-agent RSS: idle {idle / 1024:.1f} MB, running a 2-worker job {busy / 1024:.1f} MB (target < 20 MB); "
          f"idle: its own memory (RssAnon) {idle_anon / 1024:.1f} MB, mapped files (RssFile) {idle_file / 1024:.1f} MB")
    # Why both times: each accel status call is a process of its own (a TLS handshake, the token's
    # key derived): about 0.1 s, so the loss happened between the two.
    print(f"lost node detected {lost_s:.1f} s after kill -9 with lease_timeout 10 s (target <= lease): "
          f"between {not_yet_s:.2f} s (an accel status call began that still saw it alive) and {lost_s:.2f} s"
          if lost_s else "lost node NOT detected within 30 s")


if __name__ == "__main__":
    main()
