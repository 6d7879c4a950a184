"""The entry points every strategy calls; algorithms plug in through `@algorithm(name, cost=...)`.

`allreduce` works on a flat contiguous view of the caller's tensor (a non-contiguous tensor is
reduced through a copy), checks on every call that every rank brings the same call (sequence
number, operation, shape, dtype: `agreement`), runs the named algorithm on a `Channel`, and
counts the bytes it sent and the time it took in the runtime's `CommStats`. `exchanged` counts
the same for a collective another library makes (FSDP2's, `ZeroRedundancyOptimizer`'s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist

from gradmesh.collectives.agreement import Check, PendingCheck
from gradmesh.collectives.channel import Channel, resolve_group
from gradmesh.collectives.cost import COSTS, CostFn, load_algorithms
from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import span
from gradmesh.registry import Registry
from gradmesh.runtime.world import get_runtime

Op = Literal["sum", "average", "min", "max", "product"]
OPS = ("average", "sum", "min", "max", "product")

AllreduceFn = Callable[[torch.Tensor, Channel], None]
"""An algorithm sums a flat contiguous tensor in place over the channel's group."""

ALGORITHMS: Registry[AllreduceFn] = Registry("allreduce algorithm", loader=load_algorithms)


def algorithm(name: str, cost: CostFn) -> Callable[[AllreduceFn], AllreduceFn]:
    """Register an allreduce algorithm together with its alpha-beta-gamma cost formula."""

    def add(fn: AllreduceFn) -> AllreduceFn:
        COSTS.register(name)(cost)
        return ALGORITHMS.register(name)(fn)

    return add


def run_collective(
    tensor: torch.Tensor,
    operation: str,
    body: Callable[[torch.Tensor, Channel], None],
    group: dist.ProcessGroup | None,
    name: str | None = None,
    check: Check | None = None,
    kind: str = "sync",
    reduce: str = "sum",
) -> torch.Tensor:
    """Run `body` on a flat contiguous view of `tensor` with accounting; copy back if needed.

    Every rank's signature for the call is checked first (posted here unless the caller gives
    its own `check`); `name` is the caller's name for the tensor, part of the signature; the
    bytes sent are counted under `kind` (see `CommStats.by_kind`)."""
    rt = get_runtime()
    pg = resolve_group(group)
    if dist.get_world_size(pg) == 1:
        return tensor
    check = check or PendingCheck.post(rt, pg, operation, tensor, name)
    check.wait()
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    channel = Channel(rt, pg, check.label, reduce)
    started = time.perf_counter()
    body(work.view(-1), channel)
    rt.comm.add(channel.sent, time.perf_counter() - started, kind)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    algorithm: str = "native",
    group: dist.ProcessGroup | None = None,
    name: str | None = None,
    check: Check | None = None,
    kind: str = "sync",
) -> torch.Tensor:
    """Reduce `tensor` in place over `group` (default: the whole world) and return it.

    `op="average"` divides the sum by the group size (floor division for integer tensors);
    "min", "max" and "product" reduce elementwise with every algorithm.
    `name`, if given, must be the same on every rank (a different name is a mismatch);
    `check` replaces the signature exchange where the caller checks agreement its own way.
    """
    if op not in OPS:
        raise GradmeshError(f"unknown reduction op {op!r} (valid: {', '.join(OPS)})")
    body = ALGORITHMS.get(algorithm)
    reduce = "sum" if op == "average" else op
    # the op is part of the call's signature, so ranks that disagree on it fail the check
    operation = f"{algorithm} allreduce" + ("" if reduce == "sum" else f" ({reduce})")
    run_collective(tensor, operation, body, group, name, check, kind, reduce)
    if op == "average":
        p = dist.get_world_size(resolve_group(group))
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(p)
        else:
            tensor.floor_divide_(p)
    return tensor


@contextmanager
def exchanged(name: str, sent: int, kind: str = "sync") -> Iterator[None]:
    """Count the collective made in the block by another library: `sent` bytes from this rank
    under `kind` and the seconds the block took, in the runtime's `CommStats`, and the block on
    the timeline."""
    rt = get_runtime()
    started = time.perf_counter()
    with span(name, "communication", bytes=sent):
        yield
    rt.comm.add(sent, time.perf_counter() - started, kind)
