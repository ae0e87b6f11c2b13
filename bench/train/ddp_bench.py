"""The anchor for bench_train: the same loop in PyTorch, wrapped in DistributedDataParallel when
run under torchrun with more than one process. Prints one JSON line from rank 0.

--device cuda runs it on the GPU (one process), --mixed-precision bf16 runs the forward pass and
loss under torch.autocast, as bench_train does under ACCEL_MIXED_PRECISION=bf16."""
import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


VOCAB, BLOCK = 64, 64
WORDS, WIDTH, TOKENS = 32000, 256, 512  # model V: bench_train --model V


class TinyLm(nn.Module):
    """examples/train_lm.cpp's model (bench_train --model L): the same modules, sizes and defaults."""

    def __init__(self, vocab=VOCAB, block=BLOCK, dim=64, layers=2, heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim),
                                            layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.triu(torch.full((block, block), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device)).unsqueeze(0)
        x = self.blocks(x.transpose(0, 1), self.causal).transpose(0, 1)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="T", choices=["T", "M", "L", "V"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    p.add_argument("--optimizer", default="default", choices=["default", "for-loop"],
                   help="for-loop: AdamW(foreach=False), one set of kernels per parameter as libtorch's C++ AdamW")
    a = p.parse_args()
    device = torch.device(a.device)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    big, lm, head = a.model == "M", a.model == "L", a.model == "V"
    if head:
        model = nn.Sequential(nn.Embedding(WORDS, WIDTH), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WORDS))
        batch = TOKENS
    elif lm:
        model = TinyLm()
        batch = 16
    elif big:
        model = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
        batch = 64
    else:
        model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1))
        batch = 8
    model = model.to(device)
    if world > 1:
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"foreach": False} if a.optimizer == "for-loop" else {}))
    batches = []
    for _ in range(16):
        if head:
            batches.append((torch.randint(WORDS, (batch,)).to(device), torch.randint(WORDS, (batch,)).to(device)))
            continue
        if lm:
            batches.append((torch.randint(VOCAB, (batch, BLOCK)).to(device),
                            torch.randint(VOCAB, (batch, BLOCK)).to(device)))
            continue
        x = torch.randn(batch, 784 if big else 10)
        y = torch.randint(10, (batch,)) if big else torch.randn(batch, 1)
        batches.append((x.to(device), y.to(device)))

    def wait_for_device():
        if device.type == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

    def step(i):
        x, y = batches[i % 16]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.mixed_precision == "bf16"):
            pred = model(x)
            if lm:
                loss = F.cross_entropy(pred.reshape(-1, VOCAB), y.reshape(-1))
            else:
                loss = F.cross_entropy(pred, y) if big or head else F.mse_loss(pred, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for i in range(a.warmup):
        step(i)
    wait_for_device()
    start = time.perf_counter()
    for i in range(a.steps):
        step(i)
    wait_for_device()
    seconds = time.perf_counter() - start
    if int(os.environ.get("RANK", "0")) == 0:
        sps = a.steps / seconds
        print(json.dumps({"steps_per_s": round(sps, 2), "samples_per_s": round(sps * batch * world, 1),
                          "tokens_per_s": round(sps * batch * BLOCK * world) if lm else 0,
                          "device": str(device), "mixed_precision": a.mixed_precision,
                          "processes": world,
                          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
