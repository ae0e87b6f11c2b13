#!/usr/bin/env python3
"""Launch and crash-to-respawn times: accel-launch against torchrun, measured in one run.

Prints a Markdown table (medians over --runs runs) and the ratios. Usage, from the repo root
after scripts/build.sh:

    python3 bench/launch/bench_launch.py [--runs 10] [--build build] [--baseline OLD/accel-launch]

torchrun is Debian's python3-torch 1.13 (/usr/bin/python3 -m torch.distributed.run), run with
--redirects 9:0 --tee 9:0 (works around its Python 3.11 start-up crash, see
docs/benchmarks.md) and with both its default --monitor_interval (5 s) and
0.1 s (HF Accelerate's default, the stronger anchor).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PYTHON = "/usr/bin/python3"
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--no_python", "--redirects", "9:0", "--tee", "9:0"]


def timed(cmd, env=None):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=120)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.decode()[-2000:]}")
    return elapsed


def crash_to_respawn(cmd):
    """Runs cmd with bench_crash_worker; returns ms from rank 0's crash to its replacement start."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, BENCH_OUT=out)
        timed(cmd, env)
        with open(os.path.join(out, "crash")) as f:
            crash = int(f.read())
        with open(os.path.join(out, "start_0")) as f:
            start = int(f.read())
        return (start - crash) / 1e6


def median_of(runs, fn):
    fn()  # warm-up: page cache, Python bytecode
    return statistics.median(fn() for _ in range(runs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--build", default="build")
    ap.add_argument("--skip-default-interval", action="store_true",
                    help="skip torchrun with its 5 s default monitor interval (slow)")
    ap.add_argument("--baseline", metavar="ACCEL_LAUNCH",
                    help="also time this accel-launch binary (an older build) in the same run")
    args = ap.parse_args()

    launch = os.path.join(args.build, "bin", "accel-launch")
    worker = os.path.abspath(os.path.join(args.build, "bin", "bench_crash_worker"))
    for path in (launch, worker):
        if not os.access(path, os.X_OK):
            sys.exit(f"{path} not found: run scripts/build.sh first")

    blas = subprocess.run(["readlink", "-f", "/etc/alternatives/libblas.so.3-x86_64-linux-gnu"],
                          capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"# accel-launch vs torchrun, {args.runs} runs each (medians), {os.cpu_count()} CPUs, BLAS {blas}")
    print()

    intervals = ["0.1"] if args.skip_default_interval else ["0.1", "5"]
    rows = []
    accel_launch = median_of(args.runs, lambda: timed([launch, "-q", "-n", "2", "/bin/true"]))
    rows.append(("launch 2 x /bin/true, whole command", "accel-launch", accel_launch * 1e3))
    if args.baseline:
        baseline = median_of(args.runs, lambda: timed([args.baseline, "-q", "-n", "2", "/bin/true"]))
        rows.append(("launch 2 x /bin/true, whole command", f"baseline {args.baseline}", baseline * 1e3))
    torch_launch = {}
    for iv in intervals:
        torch_launch[iv] = median_of(args.runs, lambda iv=iv: timed(
            TORCHRUN + ["--monitor_interval", iv, "/bin/true"]))
        rows.append(("launch 2 x /bin/true, whole command", f"torchrun --monitor_interval {iv}",
                     torch_launch[iv] * 1e3))

    # A real Python job's start-up: both ranks run init_process_group("env://") and one
    # all_reduce, then exit (the store, and where it lives, is on this path).
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                          "integration", "workers", "allreduce.py")
    py_rows = [("accel-launch", [launch, "-q", "-n", "2", PYTHON, script])]
    if args.baseline:
        py_rows.append((f"baseline {args.baseline}", [args.baseline, "-q", "-n", "2", PYTHON, script]))
    torchrun_py = [c for c in TORCHRUN if c != "--no_python"]  # torchrun starts python itself
    py_rows.append(("torchrun --monitor_interval 0.1", torchrun_py + ["--monitor_interval", "0.1", script]))
    py_launch = {}
    for who, cmd in py_rows:
        py_launch[who] = median_of(args.runs, lambda cmd=cmd: timed(cmd))
        rows.append(("2-rank Python init_process_group + all_reduce, whole command", who, py_launch[who] * 1e3))

    accel_crash = median_of(args.runs, lambda: crash_to_respawn(
        [launch, "-q", "-n", "2", "--max-restarts", "1", worker]))
    rows.append(("worker crash -> replacement started", "accel-launch", accel_crash))
    baseline_crash = None
    if args.baseline:
        baseline_crash = median_of(args.runs, lambda: crash_to_respawn(
            [args.baseline, "-q", "-n", "2", "--max-restarts", "1", worker]))
        rows.append(("worker crash -> replacement started", f"baseline {args.baseline}",
                     baseline_crash))
    torch_crash = {}
    for iv in intervals:
        torch_crash[iv] = median_of(args.runs, lambda iv=iv: crash_to_respawn(
            TORCHRUN + ["--max_restarts", "1", "--monitor_interval", iv, worker]))
        rows.append(("worker crash -> replacement started", f"torchrun --monitor_interval {iv}",
                     torch_crash[iv]))

    print("| what | launcher | median (ms) |")
    print("|---|---|---:|")
    for what, who, ms in rows:
        print(f"| {what} | {who} | {ms:.1f} |")
    print()
    if args.baseline:
        print(f"against the baseline: launch {accel_launch / baseline:.2f}x, crash -> respawn "
              f"{accel_crash / baseline_crash:.2f}x (target <= 1.2x)")
    for iv in intervals:
        print(f"launch: accel-launch is {torch_launch[iv] / accel_launch:.1f}x faster than torchrun "
              f"--monitor_interval {iv} (target >= 20x)")
    print(f"python job start-up: accel-launch {py_launch['accel-launch'] * 1e3:.0f} ms vs torchrun "
          f"--monitor_interval 0.1 {py_launch['torchrun --monitor_interval 0.1'] * 1e3:.0f} ms "
          f"({py_launch['torchrun --monitor_interval 0.1'] / py_launch['accel-launch']:.1f}x)")
    for iv in intervals:
        print(f"crash -> respawn: accel-launch {accel_crash:.1f} ms vs torchrun --monitor_interval {iv} "
              f"{torch_crash[iv]:.1f} ms ({torch_crash[iv] / accel_crash:.0f}x); target <= 50 ms: "
              f"{'met' if accel_crash <= 50 else 'NOT met'}")


if __name__ == "__main__":
    main()
