"""A torchrun-style worker: init_process_group("env://") from the environment accel-launch sets."""
import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    print(f"rank {rank}/{world} allreduce={t.item():g} local_rank={os.environ['LOCAL_RANK']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
