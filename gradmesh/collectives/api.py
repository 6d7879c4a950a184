"""The entry points every strategy calls; algorithms plug in through `@algorithm(name, cost=...)`.

`allreduce` works on a flat contiguous view of the caller's tensor (a non-contiguous tensor is
reduced through a copy), checks once per shape and dtype that every rank brings the same kind of
tensor (on every call with GRADMESH_DEBUG=1), runs the named algorithm on a `Channel`, and counts
the bytes it sent and the time it took in the runtime's `CommStats`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from gradmesh.collectives.channel import Channel, resolve_group
from gradmesh.collectives.cost import COSTS, CostFn
from gradmesh.errors import GradmeshError, first_line
from gradmesh.registry import Registry
from gradmesh.runtime import Runtime, get_runtime

Op = Literal["sum", "average"]

AllreduceFn = Callable[[torch.Tensor, Channel], None]
"""An algorithm sums a flat contiguous tensor in place over the channel's group."""

ALGORITHMS: Registry[AllreduceFn] = Registry("allreduce algorithm")

DEBUG_ENV = "GRADMESH_DEBUG"
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def algorithm(name: str, cost: CostFn) -> Callable[[AllreduceFn], AllreduceFn]:
    """Register an allreduce algorithm together with its alpha-beta-gamma cost formula."""

    def add(fn: AllreduceFn) -> AllreduceFn:
        COSTS.register(name)(cost)
        return ALGORITHMS.register(name)(fn)

    return add


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "other"


def check_agreement(rt: Runtime, group: dist.ProcessGroup, operation: str, t: torch.Tensor) -> None:
    """Raise on every rank, naming ranks and shapes, if the ranks' tensors differ in size or dtype.

    Done once per (group, size, dtype) and on every call when GRADMESH_DEBUG=1: a small
    all-gather of (numel, dtype) instead of a hang or a silently wrong sum."""
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    key = (id(group), operation, t.numel(), code)
    if key in rt.checked and os.environ.get(DEBUG_ENV) != "1":
        return
    mine = torch.tensor([t.numel(), code], dtype=torch.int64, device=t.device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as exc:
        raise GradmeshError(
            f"rank {rt.rank}: {operation}: checking tensor shapes with the group failed: "
            f"{first_line(exc)}"
        ) from None
    kinds = [(int(r[0]), int(r[1])) for r in rows]
    if any(k != kinds[0] for k in kinds):
        ranks = dist.get_process_group_ranks(group)
        which = ", ".join(
            f"rank {ranks[i]} has {n} x {_dtype_name(c)}" for i, (n, c) in enumerate(kinds)
        )
        raise GradmeshError(f"rank {rt.rank}: {operation}: ranks disagree on the tensor: {which}")
    rt.checked.add(key)


def run_collective(
    tensor: torch.Tensor,
    operation: str,
    body: Callable[[torch.Tensor, Channel], None],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Run `body` on a flat contiguous view of `tensor` with accounting; copy back if needed."""
    rt = get_runtime()
    pg = resolve_group(group)
    if dist.get_world_size(pg) == 1:
        return tensor
    check_agreement(rt, pg, operation, tensor)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    channel = Channel(rt, pg, operation)
    started = time.perf_counter()
    body(work.view(-1), channel)
    rt.comm.add(channel.sent, time.perf_counter() - started)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


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
        raise GradmeshError(f"unknown reduction op {op!r} (valid: average, sum)")
    run_collective(tensor, f"{algorithm} allreduce", ALGORITHMS.get(algorithm), group)
    if op == "average":
        p = dist.get_world_size(resolve_group(group))
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(p)
        else:
            tensor.floor_divide_(p)
    return tensor
