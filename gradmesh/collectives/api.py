"""The entry points every strategy calls; algorithms plug in through `ALGORITHMS`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from gradmesh.registry import Registry
from gradmesh.runtime import get_runtime

Op = Literal["sum", "average"]

AllreduceFn = Callable[[torch.Tensor, dist.ProcessGroup | None], int]
"""An algorithm sums a contiguous tensor in place over a group and returns the bytes it sent."""

ALGORITHMS: Registry[AllreduceFn] = Registry("allreduce algorithm")


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    algorithm: str = "native",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce `tensor` in place over `group` (default: the whole world) and return it.

    `op="average"` divides the sum by the group size (floor division for integer tensors).
    """
    if op not in ("sum", "average"):
        raise ValueError(f"unknown reduction op {op!r} (valid: average, sum)")
    reduce = ALGORITHMS.get(algorithm)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    started = time.perf_counter()
    sent = reduce(work, group) if _world(group) > 1 else 0
    get_runtime().comm.add(sent, time.perf_counter() - started)
    if op == "average":
        if work.is_floating_point() or work.is_complex():
            work.div_(_world(group))
        else:
            work.floor_divide_(_world(group))
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast(
    tensor: torch.Tensor, root: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Copy the tensor of global rank `root` into `tensor` on every rank of `group`, in place."""
    p = _world(group)
    if p == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    started = time.perf_counter()
    dist.broadcast(work, src=root, group=group)
    # Modelled as a flat broadcast: the root sends the tensor to each of the other ranks.
    sent = work.numel() * work.element_size() * (p - 1) if dist.get_rank() == root else 0
    get_runtime().comm.add(sent, time.perf_counter() - started)
    if work is not tensor:
        tensor.copy_(work)
    return tensor
