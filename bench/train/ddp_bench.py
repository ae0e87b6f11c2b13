"""The anchor for bench_train: the same loop in PyTorch, wrapped in DistributedDataParallel when
run under torchrun with more than one process. Prints one JSON line from rank 0."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="T", choices=["T", "M"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    a = p.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    big = a.model == "M"
    if big:
        model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
        batch = 64
    else:
        model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
        batch = 8
    if world > 1:
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = []
    for _ in range(16):
        x = torch.randn(batch, 784 if big else 10)
        y = torch.randint(10, (batch,)) if big else torch.randn(batch, 1)
        batches.append((x, y))

    def step(i):
        x, y = batches[i % 16]
        pred = model(x)
        loss = F.cross_entropy(pred, y) if big else F.mse_loss(pred, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for i in range(a.warmup):
        step(i)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for i in range(a.steps):
        step(i)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        sps = a.steps / seconds
        print(json.dumps({"steps_per_s": round(sps, 2), "samples_per_s": round(sps * batch * world, 1),
                          "processes": world}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
