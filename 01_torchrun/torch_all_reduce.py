"""A PyTorch script under the course's launcher: gloo through env://, as under torchrun.

    ./build/bin/launch --nproc-per-node 4 -- python3 01_torchrun/torch_all_reduce.py

Each rank all-reduces (rank + 1) * [1, 2, 3] with gloo and prints what it got: every
rank sees n(n+1)/2 * [1, 2, 3]. It reads only torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): rank 0 opens PyTorch's own store on MASTER_PORT, which the
launcher leaves free for it (its own store is on COURSE_STORE_PORT).
"""
import os
import sys

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    dist.all_reduce(values)
    expected = torch.tensor([1.0, 2.0, 3.0]) * (world * (world + 1) / 2)
    print(f"rank {rank} of {world}: all_reduce gave {values.tolist()}, expected {expected.tolist()}", flush=True)
    ok = torch.equal(values, expected)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
