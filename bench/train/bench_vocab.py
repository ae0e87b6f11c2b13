#!/usr/bin/env python3
"""Large CPU tensors at every step: libaccel's kept blocks against libtorch's allocator and PyTorch.

Model V (bench_train --model V, ddp_bench.py --model V): 512 tokens through an embedding of 32,000
words by 256, a 256x256 layer and a linear head back to 32,000 words, cross-entropy, AdamW, one
process, OMP_NUM_THREADS=1. Its logits, their log-softmax and the gradients of both are 65.5 MB
each, allocated and freed at every step: glibc's malloc maps such an allocation afresh (its heap
has no free memory that large) and unmaps it when freed, so without a cache each step faults
those pages in again.

Each run times, in turns (their order rotating from run to run):
  accel                     bench_train under accel-launch -n 1: libaccel's CPU allocator, which
                            serves blocks of 32 MiB and more from those freed before
  accel, libtorch allocator the same with --large-blocks libtorch (libtorch's own allocator put
                            back after the Accelerator is made; libaccel's malloc thresholds stay)
  PyTorch                   ddp_bench.py in Debian's python3-torch, one process, with libaccel's
                            malloc thresholds (as bench_train.py runs its PyTorch side)
  PyTorch as it comes       the same with glibc's own thresholds
and prints a Markdown table of medians: steps/s, peak resident memory, and for accel how many
large blocks were made and reused. Target: accel >= 1.1x PyTorch's steps/s (the row with the
thresholds), the 1-process margin bench_train.py asks of model M.

Usage, from the repo root after scripts/build.sh:

    python3 bench/train/bench_vocab.py [--runs 3] [--build build] [--steps 12] [--warmup 3]
"""
import argparse
import os
import statistics
import sys

from bench_train import HEAP_ENV, PYTHON, run_json

HERE = os.path.dirname(os.path.abspath(__file__))
# What would change either side's allocator; both run without it, as from a bare shell.
USER_VARS = ("ACCEL_CONFIG_FILE", "ACCEL_KEEP_FREED_MEMORY", "GLIBC_TUNABLES", "LD_PRELOAD", *HEAP_ENV,
             "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--build", default="build")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    if a.runs < 1 or a.steps < 1 or a.warmup < 0:
        sys.exit("bench_vocab: --runs and --steps must be at least 1, --warmup at least 0")
    for var in USER_VARS:
        os.environ.pop(var, None)
    counts = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    accel = [f"{a.build}/bin/accel-launch", "-n", "1", "--", f"{a.build}/bin/bench_train", "--model", "V", *counts]
    torch = [PYTHON, os.path.join(HERE, "ddp_bench.py"), "--model", "V", *counts]
    sides = [
        ("accel", lambda: run_json(accel)),
        ("accel, libtorch allocator", lambda: run_json(accel + ["--large-blocks", "libtorch"])),
        ("PyTorch", lambda: run_json(torch, HEAP_ENV)),
        ("PyTorch as it comes", lambda: run_json(torch)),
    ]
    rows = {name: [] for name, _ in sides}
    for run in range(a.runs):
        for i in range(len(sides)):
            name, side = sides[(run + i) % len(sides)]
            rows[name].append(side())
            print(f"run {run + 1}/{a.runs}: {name}: {rows[name][-1]['steps_per_s']} steps/s", file=sys.stderr)

    def med(name, key):
        return statistics.median(r[key] for r in rows[name])

    base = med("PyTorch", "steps_per_s")
    print(f"model V (512 tokens, 32,000 words, width 256), 1 process, OMP_NUM_THREADS=1, "
          f"medians of {a.runs} runs of {a.steps} steps\n")
    print("| side | steps/s | vs PyTorch | peak RSS MB | large blocks made / reused |")
    print("|---|---|---|---|---|")
    for name, _ in sides:
        blocks = "-"
        if name.startswith("accel"):
            made = statistics.median(r["large_blocks"]["made"] for r in rows[name])
            reused = statistics.median(r["large_blocks"]["reused"] for r in rows[name])
            blocks = f"{made:.0f} / {reused:.0f}"
        sps = med(name, "steps_per_s")
        print(f"| {name} | {sps:.2f} | {sps / base:.2f}x | {med(name, 'peak_rss_bytes') / 1e6:.0f} | {blocks} |")
    ratio = med("accel", "steps_per_s") / base
    print(f"\ntarget: model V, accel >= 1.1x PyTorch steps/s: {ratio:.2f}x ({'met' if ratio >= 1.1 else 'NOT met'})")


if __name__ == "__main__":
    main()
