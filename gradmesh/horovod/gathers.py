"""Horovod's gathers, broadcasts and all-to-all, differentiable as Horovod's are, and the object
collectives (plain values, never pickle)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from gradmesh.collectives import allgather_object as _allgather_object
from gradmesh.collectives import broadcast as _broadcast_tensor
from gradmesh.collectives import broadcast_object as _broadcast_object
from gradmesh.errors import GradmeshError, GradmeshValueError
from gradmesh.horovod.compression import Compression
from gradmesh.horovod.headers import (
    ALLGATHER_OBJECT,
    ALLTOALL,
    BROADCAST,
    BROADCAST_OBJECT,
    SPARSE,
    header,
    tensors_only,
)
from gradmesh.horovod.process_sets import (
    _group,
    _root,
    allgather_request,
    combined,
    global_process_set,
    submit,
)
from gradmesh.horovod.reductions import (
    _autograd,
    allreduce,
    reducescatter,
    reducescatter_async,
)
from gradmesh.runtime.world import rank
from gradmesh.sync.data_parallel import api as _api
from gradmesh.sync.data_parallel.api import Handle, members, synchronize
from gradmesh.sync.data_parallel.reducer import Average, Sum
from gradmesh.sync.data_parallel.sparse import sparse_sum

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "sparse_allreduce_async",
]


# -- gather, broadcast, all-to-all ---------------------------------------------------------


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    return allgather_request(tensor, name, process_set)


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> Future[list[torch.Tensor]]:
    """Each of `tensors` all-gathered (one request each, named `name.i`); `synchronize` returns
    the list."""
    if not tensors:
        raise GradmeshError("grouped_allgather needs at least one tensor")
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    handles = [allgather_request(t, n, process_set) for t, n in zip(tensors, names, strict=True)]
    return combined(handles, list)


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> list[torch.Tensor]:
    """`allgather` of each of `tensors`, in order; differentiable."""
    if not tensors:
        raise GradmeshError("grouped_allgather needs at least one tensor")
    return [allgather(t, None, process_set) for t in tensors]


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: str = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Future[list[torch.Tensor]]:
    """Each of `tensors` reduce-scattered as `reducescatter` does (one request each, named
    `name.i`); `synchronize` returns the list (each rank's block of each)."""
    if not tensors:
        raise GradmeshError("grouped_reducescatter needs at least one tensor")
    scale = (op, process_set, prescale_factor, postscale_factor)
    names = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    parts = [reducescatter_async(t, n, *scale) for t, n in zip(tensors, names, strict=True)]
    return combined(parts, list)


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: str = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """`reducescatter` of each of `tensors`, in order; differentiable."""
    if not tensors:
        raise GradmeshError("grouped_reducescatter needs at least one tensor")
    scale = (op, process_set, prescale_factor, postscale_factor)
    return [reducescatter(t, None, Compression.none, *scale) for t in tensors]


class _Allgather(torch.autograd.Function):
    """Horovod's gradient of allgather: this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: Any) -> torch.Tensor:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = allgather(
            torch.tensor([ctx.rows], device=grad.device), process_set=ctx.process_set
        ).tolist()
        mine = ctx.process_set.rank() if ctx.process_set is not global_process_set else rank()
        start = sum(rows[:mine])
        return averaged[start : start + ctx.rows], None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dimension 0 (first dimensions may differ);
    differentiable."""
    return _autograd(_Allgather, tensor, name, process_set)  # type: ignore[no-any-return]


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Root's value of `tensor` as a new tensor; the argument is left as it was."""
    return _broadcast_async(tensor, root_rank, name, process_set, in_place=False)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Handle:
    """Root's value written into `tensor`."""
    return _broadcast_async(tensor, root_rank, name, process_set, in_place=True)


def _broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any, in_place: bool
) -> Handle:
    tensors_only("broadcast", [tensor])
    root = _root(root_rank, _group(process_set, "broadcast"), "broadcast")
    target = tensor.data if in_place else tensor.detach().clone()

    def run(group: Any, _: int) -> torch.Tensor:
        return _broadcast_tensor(target, root, group) if members(group)[2] > 1 else target

    return submit(process_set, "broadcast", header(BROADCAST, tensor, root), name, run)


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient of broadcast: the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root: int, name: Any, process_set: Any
    ) -> torch.Tensor:
        ctx.root, ctx.process_set = root, process_set
        return synchronize(broadcast_async(tensor, root, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        return averaged if rank() == ctx.root else averaged.zero_(), None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Root's value of `tensor`, as a new tensor; differentiable."""
    return _autograd(_Broadcast, tensor, root_rank, name, process_set)  # type: ignore[no-any-return]


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Root's value written into `tensor`, which is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Future[tuple[torch.Tensor, torch.Tensor]]:
    """`synchronize` returns (rows received, int32 counts received from each rank)."""
    flat = None if splits is None else torch.as_tensor(splits, device="cpu").reshape(-1)
    if flat is not None and (flat.is_floating_point() or flat.is_complex()):
        raise GradmeshValueError(
            f"rank {rank()}: alltoall: splits must be integers (int32, as Horovod's), got "
            f"{flat.dtype}"
        )
    wanted = None if flat is None else [int(s) for s in flat.tolist()]
    row = header(ALLTOALL, tensor)
    return submit(
        process_set, "alltoall", row, name, lambda g, _: _api.alltoall_tensor(tensor, wanted, g)
    )


class _Alltoall(torch.autograd.Function):
    """The gradient of an all-to-all: the gradients sent back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: Any) -> Any:
        output, received = alltoall_async(tensor, splits, name, process_set).result()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        back, _ = alltoall_async(grad, ctx.received, None, ctx.process_set).result()
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> Any:
    """Rows of `tensor` sent to each rank (`splits`, or equal parts) and theirs received, in rank
    order; with `splits`, also the counts received from each rank (as Horovod returns).
    Differentiable."""
    output, received = _autograd(_Alltoall, tensor, splits, name, process_set)
    return output if splits is None else (output, received)


class SparseHandle(Future):  # type: ignore[type-arg]
    """Horovod's sparse handle: a future that is also called (`handle()`) for its result."""

    def __call__(self) -> torch.Tensor:
        return self.result()  # type: ignore[no-any-return]


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: Any = global_process_set,
) -> SparseHandle:
    """Reduce a sparse COO tensor keeping it sparse: every rank's indices and values gathered
    and coalesced (Sum, or Average over the set's ranks); `synchronize(handle)` or `handle()`
    returns the sparse result, equal to a dense allreduce of the dense tensors."""
    if op not in (Average, Sum):
        raise GradmeshError(f"sparse_allreduce reduces with Average or Sum, not {op}")
    if not tensor.is_sparse:
        raise GradmeshError("sparse_allreduce_async takes a sparse tensor (allreduce: dense ones)")
    copy = tensor.detach().coalesce()

    def reduce(group: Any, _: int) -> torch.Tensor:
        summed = sparse_sum(copy, group)
        return summed / members(group)[2] if op == Average else summed

    handle = submit(process_set, "sparse_allreduce", header(SPARSE), name, reduce)
    return combined([handle], lambda results: results[0], SparseHandle())  # type: ignore[return-value]


# -- objects, barrier ----------------------------------------------------------------------


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Root's object on every rank of the set (plain values, never pickle: see the module)."""
    root = _root(root_rank, _group(process_set, "broadcast_object"), "broadcast_object")
    row = header(BROADCAST_OBJECT, extra=root)
    run = lambda g, _: _broadcast_object(obj, root, g)  # noqa: E731
    return submit(process_set, "broadcast_object", row, name, run).result()


def allgather_object(
    obj: Any, name: str | None = None, process_set: Any = global_process_set
) -> list[Any]:
    """Every rank's object, in rank order (plain values, never pickle)."""
    row = header(ALLGATHER_OBJECT)
    run = lambda g, _: _allgather_object(obj, g)  # noqa: E731
    return submit(process_set, "allgather_object", row, name, run).result()  # type: ignore[no-any-return]
