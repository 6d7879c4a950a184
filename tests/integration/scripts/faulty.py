"""A user's script that goes wrong in one chosen way on one rank: the failure tests run it under
`gradmesh run -np 2`. Usage: faulty.py MODE [ALGORITHM]."""

from __future__ import annotations

import os
import sys
import time

import torch

import gradmesh
import gradmesh.horovod as hvd

mode = sys.argv[1]
algorithm = sys.argv[2] if len(sys.argv) > 2 else "hvd"
gradmesh.init()
rank = gradmesh.rank()


def reduce(t: torch.Tensor) -> torch.Tensor:
    if algorithm == "hvd":
        return hvd.allreduce(t)
    from gradmesh.collectives import allreduce

    return allreduce(t, algorithm=algorithm)


for _ in range(3):  # calls that agree
    reduce(torch.ones(2, 3))
print(f"rank {rank} agreed", flush=True)
if mode == "shape":  # same element count, another shape
    reduce(torch.ones(2, 3) if rank == 0 else torch.ones(3, 2))
elif mode == "skip":  # rank 1 skips a call, then stays busy
    if rank == 0:
        reduce(torch.ones(2, 3))
    else:
        time.sleep(60)
elif mode == "raise" and rank == 0:
    raise ValueError("the user's own bug")
elif mode == "exit3" and rank == 0:
    sys.exit(3)
elif mode in ("train", "raise", "exit3"):  # keep reducing until stopped
    print(f"rank {rank} pid {os.getpid()} training", flush=True)
    for _ in range(100000):
        reduce(torch.ones(1000))
        time.sleep(0.01)
print(f"rank {rank} finished", flush=True)
