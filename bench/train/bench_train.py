#!/usr/bin/env python3
"""Training throughput and collective cost: libaccel against PyTorch DDP and c10d gloo, in one run.

Prints Markdown tables (medians over --runs runs; models M and L's accel and DDP rows over
--scaling-rounds back-to-back rounds of a 1- and a 2-process run, each scaling efficiency the
median of its rounds') and checks these targets:
  model T (10->64->1, b=8) 2 processes: accel >= 2x Python DDP steps/s
  model M (784->2048->2048->10, b=64) 2 processes: accel >= 1.0x Python DDP steps/s
  model M 1 process: accel >= 1.1x Python steps/s; 2 processes: scaling efficiency >= 95%
  model L (examples/train_lm.cpp's transformer, batch 16 x 64 tokens): the same two targets
  scaling efficiency (2-process samples/s over 2x 1-process) at least DDP's, per model
  gather/reduce wrapper overhead over calling c10d gloo directly <= 5% at >= 1 MiB
  all-reduce 1/16/64 MiB, 2 processes: the gradient buckets' in-place all-reduce >= 2x the
    all-reduce as it was (ACCEL_SHM_ALLREDUCE=copy: every rank copies its buffer into shared
    memory and reduces all of it), with memcpy of the same size as the yardstick
  ZeRO-1 on 2 processes (model M): steps/s >= 0.95x the unsharded run's; peak RSS per rank; the
    live memory (mallinfo2, plus the block ZeRO's state is mapped in) smaller by half the AdamW state
  2 machines x 2 processes (two accel-launch --nodes 2 on this machine): reduce 1 MiB through the
    hierarchical collectives faster than c10d gloo over all 4 ranks
Usage, from the repo root after scripts/build.sh:

    python3 bench/train/bench_train.py [--runs 3] [--build build]

accel runs with the prepared optimizer's fused step (the default) and, as the "libtorch step"
column, with AcceleratorOptions::fused_optimizer = false (libtorch's AdamW::step, as before it).
Both sides run 1 thread per process (OMP_NUM_THREADS=1) on whatever BLAS libblas.so.3 points
to (printed); where libaccel switches OpenBLAS to newer kernels than it picked by itself
(docs/runtime.md), the PyTorch side gets the same OPENBLAS_CORETYPE (printed too). DDP is Debian's python3-torch 1.13 under torchrun (--redirects 9:0 --tee 9:0, see
docs/benchmarks.md); its 1-process figure is the same loop without DDP. The PyTorch side also
runs with the malloc thresholds libaccel fixes in its workers (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_, as contract/malloc_tuning.h), so that the targets compare the frameworks,
not two allocator settings; "DDP as it comes" (glibc's own moving thresholds) is printed beside
it, not judged: glibc's moving thresholds can make a process fault in its tensors' pages at every
step (on one VM, one process 3.3x slower, each of two 1.3x). Where the environment sets malloc's
thresholds itself (or ACCEL_KEEP_FREED_MEMORY turns libaccel's off), both sides keep them and
that column is "-".
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

PYTHON = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = {"T": (2000, 100), "M": (150, 15), "L": (200, 20)}
PHASES = ("forward", "backward", "step", "zero_grad")  # bench_train's phase_ms
# libaccel's malloc thresholds (runtime/heap_tuning.h: kMmapThreshold, kTrimThreshold), as glibc's
# environment variables for the PyTorch side.
HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
HEAP_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def run_json(cmd, env_extra=None, many=False):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    env.pop("ACCEL_CONFIG_FILE", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = []
    for line in proc.stdout.splitlines():
        start = line.find("{")
        if start >= 0:
            rows.append(json.loads(line[start:]))
    if not rows:
        sys.exit(f"no result from: {' '.join(cmd)}\n{proc.stdout[-2000:]}")
    return rows if many else rows[0]


def accel_train(build, model, n, optimizer_step="fused", zero_stage=0, env_extra=None):
    steps, warmup = STEPS[model]
    return run_json([f"{build}/bin/accel-launch", "-n", str(n), "--", f"{build}/bin/bench_train", "--model", model,
                     "--steps", str(steps), "--warmup", str(warmup), "--optimizer-step", optimizer_step,
                     "--zero-stage", str(zero_stage)], env_extra)


def allreduce_rows(build, runs):
    """bench_collectives allreduce: the split algorithm (default) and the unsplit one, medians."""
    def one(env):
        return run_json([f"{build}/bin/accel-launch", "-n", "2", "--", f"{build}/bin/bench_collectives", "allreduce"],
                        env, many=True)
    rows = {}
    for _ in range(runs):
        for name, env in (("copy", {"ACCEL_SHM_ALLREDUCE": "copy"}), ("split", None)):
            for row in one(env):
                rows.setdefault((row["bytes"], name), []).append(row)
    out = []
    for size in sorted({b for b, _ in rows}):
        med = lambda name, key: statistics.median(r[key] for r in rows[(size, name)])
        out.append({"bytes": size, "before_ms": med("copy", "private_ms"), "private_ms": med("split", "private_ms"),
                    "shared_ms": med("split", "shared_ms"), "memcpy_ms": med("split", "memcpy_ms")})
    return out


def print_allreduce(rows, checks):
    print("\nAll-reduce (sum, in place) of float32 on 2 processes, median ms per call and GB/s (size / time); "
          "'before' is ACCEL_SHM_ALLREDUCE=copy on private memory, the gradient buckets' all-reduce before they "
          "moved into shared memory; memcpy: each rank copying the same size at the same time:\n")
    print("| size | before | private, split | shared buffer (buckets) | speed-up | memcpy |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        size = r["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        gbs = lambda ms: size / ms / 1e6
        speedup = r["before_ms"] / r["shared_ms"]
        print(f"| {label} | {r['before_ms']:.3f} ms, {gbs(r['before_ms']):.1f} GB/s | {r['private_ms']:.3f} ms | "
              f"{r['shared_ms']:.3f} ms, {gbs(r['shared_ms']):.1f} GB/s | {speedup:.1f}x | "
              f"{r['memcpy_ms']:.3f} ms, {gbs(r['memcpy_ms']):.1f} GB/s |")
        if size >= 1 << 20:
            checks.append((f"all-reduce {label} (buckets): >= 2x before", f"{speedup:.1f}x", speedup >= 2.0))


def ddp_train(model, n, env_extra=None):
    steps, warmup = STEPS[model]
    script = [os.path.join(HERE, "ddp_bench.py"), "--model", model, "--steps", str(steps), "--warmup", str(warmup)]
    if n == 1:
        return run_json([PYTHON] + script, env_extra)
    return run_json([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                     "--monitor_interval", "0.1", "--redirects", "9:0", "--tee", "9:0"] + script, env_extra)


def openblas_kernels(build):
    """(the kernels OpenBLAS picks here by itself, the ones libaccel's workers switch it to or None),
    from accel-check --info; (None, None) without OpenBLAS."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return os.environ["OPENBLAS_CORETYPE"], None
    env = dict(os.environ)
    env.pop("ACCEL_CONFIG_FILE", None)
    out = subprocess.run([f"{build}/bin/accel-check", "--info"], env=env, capture_output=True, text=True,
                         timeout=120).stdout
    m = re.search(r"OpenBLAS kernels: (\w+)(?:, made for older CPUs.*?switches its workers to (\w+))?", out)
    return (m.group(1), m.group(2)) if m else (None, None)


def two_machines_collectives(build):
    """bench_collectives on 2 "machines" of 2 ranks: two accel-launch --nodes 2 on this machine."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCEL_TOKEN="bench-two-machines")
    env.pop("ACCEL_CONFIG_FILE", None)
    procs = [subprocess.Popen([f"{build}/bin/accel-launch", "--nodes", "2", "--machine-rank", str(m), "-n", "2",
                               "--coordinator-port", str(port), "--", f"{build}/bin/bench_collectives"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench_collectives on two machines failed ({p.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    return [json.loads(line[line.find("{"):]) for line in outs[0][0].splitlines() if "{" in line]


def blas():
    try:
        return os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")
    except OSError:
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--build", default="build")
    p.add_argument("--two-machines-only", action="store_true",
                   help="only the 2 machines x 2 processes collectives table")
    p.add_argument("--allreduce-only", action="store_true", help="only the all-reduce table")
    p.add_argument("--models", default="T,M,L", help="the training table's models (default T,M,L)")
    p.add_argument("--scaling-rounds", type=int, default=5,
                   help="models M and L: 1- and 2-process runs back to back per side, the scaling "
                        "efficiency being the median of the rounds' (default 5, --runs' included)")
    a = p.parse_args()
    if a.allreduce_only:
        checks = []
        print_allreduce(allreduce_rows(a.build, a.runs), checks)
        for name, value, ok in checks:
            print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
        return
    if a.two_machines_only:
        for row in two_machines_collectives(a.build):
            print(json.dumps(row))
        return
    print(f"BLAS: {blas()}; {os.cpu_count()} CPUs; medians of {a.runs} runs (models M and L's accel and DDP "
          f"rows: of {max(a.runs, a.scaling_rounds)})\n")
    # Why: libaccel's workers switch OpenBLAS away from kernels older than the CPU; PyTorch's
    # side gets the same kernels, so that the table compares the frameworks, not two BLAS.
    found, switched = openblas_kernels(a.build)
    plain_env = {}
    if switched:
        plain_env = {"OPENBLAS_CORETYPE": switched}
        print(f"OpenBLAS picks its {found} kernels on this CPU by itself; libaccel's workers switch to {switched}, "
              f"and the PyTorch side runs with OPENBLAS_CORETYPE={switched}, so both use the same kernels\n")
    elif found:
        print(f"OpenBLAS kernels: {found} (both sides)\n")
    # Why: the same for malloc. libaccel leaves glibc's thresholds alone where the user set them
    # (or ACCEL_KEEP_FREED_MEMORY=0), and then so does this side.
    ddp_env = dict(plain_env)
    users = [v for v in HEAP_USER_VARS if v in os.environ]  # glibc reads an empty one as 0
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        users.append("GLIBC_TUNABLES")
    keep = os.environ.get("ACCEL_KEEP_FREED_MEMORY", "").lower()
    if keep in ("0", "false", "no", "off"):
        users.append(f"ACCEL_KEEP_FREED_MEMORY={keep}")
    if users:
        print(f"malloc: libaccel leaves glibc's thresholds as set here ({', '.join(users)}); so does the "
              f"PyTorch side\n")
    else:
        ddp_env.update(HEAP_ENV)
        print("malloc: the PyTorch side runs with libaccel's thresholds (" +
              " ".join(f"{k}={v}" for k, v in HEAP_ENV.items()) + "); 'DDP as it comes' is without them\n")

    results, phases = {}, {}
    models = a.models.split(",")
    # Why each side's 1- and 2-process runs alternate, back to back: a scaling efficiency divides
    # one by the other, and a VM's speed drifts by more than the targets' margins within minutes.
    def train(model, side, n):
        if side == "ddp":
            return ddp_train(model, n, ddp_env)
        if side == "ddp-plain":
            return ddp_train(model, n, plain_env)
        if side == "accel-libtorch":
            return accel_train(a.build, model, n, "libtorch")
        env = {"accel-copy": {"ACCEL_SHM_ALLREDUCE": "copy"},
               "accel-whole": {"ACCEL_SPLIT_OPTIMIZER_STEP": "0"}}.get(side)
        return accel_train(a.build, model, n, env_extra=env)

    # Why rounds for M and L's scaling: one 1-process run and one 2-process run, a few seconds each,
    # land on this VM's fast and slow minutes at random (their ratio moved from 74% to 96% between
    # runs of the same build); the median of several back-to-back pairs does not.
    scaling = {}
    for model in models:
        for side, ns in (("accel", (1, 2)), ("accel-libtorch", (1, 2)), ("ddp", (1, 2)), ("ddp-plain", (1, 2)),
                         ("accel-copy", (2,)), ("accel-whole", (2,))):
            if side == "ddp-plain" and ddp_env == plain_env:
                continue  # the same runs as "ddp"
            runs = {n: [] for n in ns}
            rounds = a.runs
            if model != "T" and side in ("accel", "ddp", "ddp-plain"):
                rounds = max(a.runs, a.scaling_rounds)
            for _ in range(rounds):
                for n in ns:
                    runs[n].append(train(model, side, n))
            if ns == (1, 2):
                scaling[(model, side)] = [two["samples_per_s"] / (2 * one["samples_per_s"])
                                          for one, two in zip(runs[1], runs[2])]
            for n in ns:
                results[(model, n, side)] = (statistics.median(r["steps_per_s"] for r in runs[n]),
                                             statistics.median(r["samples_per_s"] for r in runs[n]))
                if side == "accel":
                    phases[(model, n)] = {k: statistics.median(r["phase_ms"][k] for r in runs[n]) for k in PHASES}
    print("| model | processes | accel steps/s | accel samples/s | accel, libtorch step: steps/s | "
          "accel, unsplit all-reduce: steps/s | accel, whole optimizer step on every rank: steps/s | "
          "DDP steps/s | DDP samples/s | accel / DDP | DDP as it comes: steps/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for n in (1, 2):
            acc, ddp = results[(model, n, "accel")], results[(model, n, "ddp")]
            lib = results[(model, n, "accel-libtorch")]
            copy = f"{results[(model, n, 'accel-copy')][0]:.1f}" if n == 2 else "-"
            whole = f"{results[(model, n, 'accel-whole')][0]:.1f}" if n == 2 else "-"
            plain = results.get((model, n, "ddp-plain"))
            plain = f"{plain[0]:.1f}" if plain else "-"
            print(f"| {model} | {n} | {acc[0]:.1f} | {acc[1]:.0f} | {lib[0]:.1f} | {copy} | {whole} | {ddp[0]:.1f} | "
                  f"{ddp[1]:.0f} | {acc[0] / ddp[0]:.2f}x | {plain} |")

    print("\nWhere accel's step goes (rank 0, ms per step; backward includes the gradient all-reduce, "
          "which runs in its hooks):\n")
    print("| model | processes | forward + loss | backward | optimizer step | zero_grad | sum |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for n in (1, 2):
            ph = phases[(model, n)]
            print(f"| {model} | {n} | " + " | ".join(f"{ph[k]:.2f}" for k in PHASES) +
                  f" | {sum(ph.values()):.2f} |")

    print("\nScaling efficiency (2-process samples/s over 2x 1-process), per back-to-back round; the checks take "
          "the median:\n")
    print("| model | side | rounds | median |")
    print("|---|---|---|---|")
    for (model, side), effs in scaling.items():
        if side in ("accel", "ddp", "ddp-plain"):
            name = "DDP as it comes" if side == "ddp-plain" else side
            print(f"| {model} | {name} | {', '.join(f'{e:.0%}' for e in effs)} | {statistics.median(effs):.0%} |")

    checks = []
    for model, target in (("T", 2.0), ("M", 1.0), ("L", 1.0)):
        if model not in models:
            continue
        ratio = results[(model, 2, "accel")][0] / results[(model, 2, "ddp")][0]
        checks.append((f"model {model}, 2 processes: accel/DDP steps/s >= {target}", f"{ratio:.2f}x", ratio >= target))
        eff = {side: statistics.median(scaling[(model, side)]) for side in ("accel", "ddp")}
        checks.append((f"model {model}: scaling efficiency >= DDP's", f"{eff['accel']:.0%} vs {eff['ddp']:.0%}",
                       eff["accel"] >= eff["ddp"]))

    for model in [m for m in ("M", "L") if m in models]:
        ratio = results[(model, 1, "accel")][0] / results[(model, 1, "ddp")][0]
        checks.append((f"model {model}, 1 process: accel/Python steps/s >= 1.1", f"{ratio:.2f}x", ratio >= 1.1))
        eff = statistics.median(scaling[(model, "accel")])
        target = 0.95 if model == "M" else 0.9
        checks.append((f"model {model}: accel scaling efficiency >= {target:.0%}", f"{eff:.0%}", eff >= target))

    print("\nCollectives, 2 processes, float32, median ms per call (c10d = ProcessGroupGloo called directly):\n")
    over_gloo = run_json([f"{a.build}/bin/accel-launch", "-n", "2", "--", f"{a.build}/bin/bench_collectives"],
                         {"ACCEL_SHM_COLLECTIVES": "0"}, many=True)
    default = run_json([f"{a.build}/bin/accel-launch", "-n", "2", "--", f"{a.build}/bin/bench_collectives"], many=True)
    print("| op | size | c10d gloo | accel over gloo | overhead | accel (shared memory) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for g, d in zip(over_gloo, default):
        size = g["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        overhead = g["accel_ms"] / g["c10d_ms"] - 1
        print(f"| {g['op']} | {label} | {g['c10d_ms']:.3f} | {g['accel_ms']:.3f} | {overhead:+.1%} | "
              f"{d['accel_ms']:.3f} | {d['c10d_ms'] / d['accel_ms']:.1f}x |")
        if size >= 1 << 20:
            checks.append((f"{g['op']} {label}: wrapper overhead over gloo <= 5%", f"{overhead:+.1%}", overhead <= 0.05))

    print_allreduce(allreduce_rows(a.build, a.runs), checks)

    print("\nZeRO stage 1 and the split step, model M on 2 processes (AdamW state: 2 x 23.3 MB with the whole "
          "step on every rank; 23.3 MB per rank sharded; one 23.3 MB copy per machine split, in shared memory "
          "with the parameters):\n")
    zero_rows = {}
    ways = ((0, "whole step on every rank", {"ACCEL_SPLIT_OPTIMIZER_STEP": "0"}), ("split", "split step (default)", None),
            (1, "ZeRO-1", None))
    for key, _, env in ways:
        runs = [accel_train(a.build, "M", 2, zero_stage=1 if key == 1 else 0, env_extra=env) for _ in range(a.runs)]
        for r in runs:  # live memory: malloc's live allocations and ZeRO's state block, mapped apart
            r["live_bytes"] = r["heap_in_use_bytes"] + r.get("zero_state_mapped_bytes", 0)
        zero_rows[key] = tuple(statistics.median(r[k] for r in runs) for k in
                               ("steps_per_s", "peak_rss_bytes", "live_bytes", "rss_shmem_bytes"))
    print("| zero_stage | steps/s | peak RSS of rank 0, MB | rank 0's live memory (mallinfo2 + ZeRO's state block), MB "
          "| rank 0's shared memory (RssShmem), MB |")
    print("|---|---|---|---|---|")
    for key, name, _ in ways:
        row = zero_rows[key]
        print(f"| {name} | {row[0]:.1f} | {row[1] / 1e6:.0f} | {row[2] / 1e6:.2f} | {row[3] / 1e6:.0f} |")
    saved = (zero_rows[0][2] - zero_rows[1][2]) / 1e6
    checks.append(("ZeRO-1, model M, 2 processes: live memory smaller by half the AdamW state (23.3 MB)",
                   f"{saved:.1f} MB", abs(saved - 23.3) < 1.0))
    ratio = zero_rows[1][0] / zero_rows[0][0]
    checks.append(("ZeRO-1, model M, 2 processes: steps/s >= 0.95x the whole step's", f"{ratio:.2f}x", ratio >= 0.95))
    checks.append(("ZeRO-1, model M, 2 processes: peak RSS below the whole step's",
                   f"{(zero_rows[1][1] - zero_rows[0][1]) / 1e6:+.0f} MB", zero_rows[1][1] < zero_rows[0][1]))

    print("\n2 machines x 2 processes (two accel-launch --nodes 2 on this machine), median ms per call: c10d gloo "
          "over all 4 ranks vs accel's hierarchical collectives (shared memory within a machine, gloo between "
          "the 2 leaders):\n")
    print("| op | size | c10d gloo, 4 ranks | accel hierarchical | speed-up |")
    print("|---|---|---|---|---|")
    for row in two_machines_collectives(a.build):
        size = row["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        speedup = row["c10d_ms"] / row["accel_ms"]
        print(f"| {row['op']} | {label} | {row['c10d_ms']:.3f} | {row['accel_ms']:.3f} | {speedup:.1f}x |")
        if row["op"] == "reduce" and size == 1 << 20:
            checks.append(("2 machines x 2: reduce 1 MiB hierarchical faster than gloo over 4 ranks",
                           f"{speedup:.1f}x", speedup > 1.0))

    print("\n| target | measured | met |")
    print("|---|---|---|")
    for name, value, ok in checks:
        print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
