#!/usr/bin/env python3
"""Does work on one CPU slow training's arithmetic on another? Synthetic loads, no libaccel.

A background save runs its copy, checksum and write on another CPU than training's. This script
pins two training-like loops to --train-cpu, one at a time: 256 x 256 matrix products (compute,
in cache) and an Adam-like pass over 400 MB of float32 tensors (memory-bound). On --other-cpu
it runs, in turn: nothing, a shell loop, sha256sum of a cached 1 GB file, copies of 300 MB
tensors, dd oflag=direct writes into --dir (the disk a checkpoint would go to), and the same
loop as the training side. It prints each loop's median rate per load over --rounds rounds and
its ratio to the rate with nothing beside it.

    python3 bench/checkpoint/vcpu_interference.py [--rounds 2] [--dir /tmp] [--seconds 4]

Needs taskset, sha256sum, dd and /usr/bin/python3 with torch (Debian's python3-torch).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PYTHON = "/usr/bin/python3"

LOOPS = {
    "matrix products 256x256": """
import time, torch
torch.set_num_threads(1)
a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)
t, n = time.perf_counter(), 0
while time.perf_counter() - t < {seconds}:
    for _ in range(100): torch.mm(a, b, out=c)
    n += 100
print(n / (time.perf_counter() - t))
""",
    "Adam-like pass over 400 MB": """
import time, torch
torch.set_num_threads(1)
p = torch.ones(25_000_000); m = torch.ones_like(p); v = torch.ones_like(p); g = torch.ones_like(p)
t, n = time.perf_counter(), 0
while time.perf_counter() - t < {seconds}:
    m.mul_(0.9).add_(g, alpha=0.1); v.mul_(0.999).addcmul_(g, g, value=0.001); p.add_(m, alpha=-1e-3)
    n += 1
print(n / (time.perf_counter() - t))
""",
}

COPIES = """
import time, torch
torch.set_num_threads(1)
a = torch.ones(75_000_000); b = torch.empty_like(a)
while True: b.copy_(a)
"""


def loads(tmp, loop_template):
    """(name, argv) of each load for the other CPU; None: nothing."""
    big = os.path.join(tmp, "cached-1GB")
    return [
        ("nothing", None),
        ("a shell loop", ["bash", "-c", "while :; do :; done"]),
        ("sha256sum of a cached 1 GB file", ["bash", "-c", f"while :; do sha256sum {big} >/dev/null; done"]),
        ("copies of 300 MB tensors", [PYTHON, "-c", COPIES]),
        ("dd oflag=direct writes", ["bash", "-c", f"while :; do dd if=/dev/zero of={tmp}/dd-direct bs=1M "
                                                  f"count=2000 oflag=direct status=none; done"]),
        ("the same loop", [PYTHON, "-c", loop_template.replace("{seconds}", "1e9")]),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0, help="how long each loop runs per measurement")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the 1 GB file and dd's writes go")
    p.add_argument("--train-cpu", default="0")
    p.add_argument("--other-cpu", default="1")
    a = p.parse_args()
    if a.rounds < 1 or a.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds above 0")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("vcpu_interference.py: needs 2 CPUs; this process may use "
                 f"{len(os.sched_getaffinity(0))}")
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="vcpu-interference-") as tmp:
        with open(os.path.join(tmp, "cached-1GB"), "wb") as f:
            for _ in range(1024):
                f.write(os.urandom(1 << 20))
        subprocess.run(["cat", os.path.join(tmp, "cached-1GB")], stdout=subprocess.DEVNULL, check=True)
        print(f"CPUs: training loop on {a.train_cpu}, load on {a.other_cpu}; medians of {a.rounds} rounds, "
              f"{a.seconds:g} s each\n")
        print("| training loop | load on the other CPU | rate (per s) | against nothing |")
        print("|---|---|---:|---:|")
        for name, template in LOOPS.items():
            code = template.replace("{seconds}", str(a.seconds))
            rates = {}
            for _ in range(a.rounds):
                for load, argv in loads(tmp, template):
                    other = None
                    if argv:
                        other = subprocess.Popen(["taskset", "-c", a.other_cpu] + argv, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL, start_new_session=True)
                        time.sleep(1.0)  # the load past its start (a tensor's first touch, dd's first file)
                    try:
                        out = subprocess.run(["taskset", "-c", a.train_cpu, PYTHON, "-c", code], capture_output=True,
                                             text=True, check=True, timeout=a.seconds + 120)
                    finally:
                        if other:
                            os.killpg(other.pid, 9)
                            other.wait()
                    rates.setdefault(load, []).append(float(out.stdout.strip()))
            alone = statistics.median(rates["nothing"])
            for load, values in rates.items():
                rate = statistics.median(values)
                print(f"| {name} | {load} | {rate:.1f} | {rate / alone:.3f} |")


if __name__ == "__main__":
    main()
