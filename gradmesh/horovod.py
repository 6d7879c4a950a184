"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun).

Differences, all deliberate: `broadcast_object` sends JSON, not pickle; `Adasum` raises
NotImplementedError; `allgather` concatenates along dimension 0 like Horovod's.
"""

from __future__ import annotations

from typing import Any

import torch

from gradmesh.collectives import broadcast as _broadcast_in_place
from gradmesh.collectives import broadcast_object
from gradmesh.compression import FP16Compression, NoCompression
from gradmesh.data_parallel.api import (
    Handle,
    broadcast_optimizer_state,
    poll,
    synchronize,
)
from gradmesh.data_parallel.api import allgather_tensor as allgather
from gradmesh.data_parallel.api import (
    allreduce_async as _allreduce_async,
)
from gradmesh.data_parallel.optimizer import (
    Adasum,
    Average,
    DistributedOptimizer,
    Sum,
    broadcast_parameters,
)
from gradmesh.errors import GradmeshError
from gradmesh.runtime import (
    cross_rank,
    cross_size,
    get_runtime,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from gradmesh.runtime import init as _init

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]


class Compression:
    """`hvd.Compression.none` / `hvd.Compression.fp16`."""

    none = NoCompression()
    fp16 = FP16Compression()


def init(*_args: Any, **_kwargs: Any) -> None:
    """Join the job (Horovod's init takes optional communicators; gradmesh ignores them)."""
    _init()


def _op(average: bool | None, op: str | None) -> str:
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in gradmesh; use Average or Sum")
    if average is not None and op is not None:
        raise GradmeshError("give either average= or op=, not both")
    if op is None:
        return Sum if average is False else Average
    return op


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    compression: Any = Compression.none,
) -> Handle:
    return _allreduce_async(tensor, op=_op(average, op), compression=compression, name=name)  # type: ignore[arg-type]


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
) -> torch.Tensor:
    """The reduced value of `tensor` (a new tensor; the argument is left as it was)."""
    return synchronize(allreduce_async(tensor, average, name, op, compression))


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
) -> torch.Tensor:
    """In-place `allreduce`."""
    return tensor.copy_(allreduce(tensor, average, name, op=op))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    with torch.no_grad():
        return _broadcast_in_place(tensor, root=root_rank)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Root's value of `tensor`, as a new tensor."""
    return broadcast_(tensor.detach().clone(), root_rank)


def join(device: int = -1) -> int:
    """Wait, taking part in the others' gradient reductions, until every rank has joined (for
    the most recently created DistributedOptimizer). Returns -1: gradmesh does not track which
    rank joined last."""
    joinable = get_runtime().joinable
    if joinable is not None:
        joinable()
    return -1
