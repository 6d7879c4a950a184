"""Horovod's reductions (allreduce, grouped allreduce, reducescatter), synchronous and
asynchronous, differentiable as Horovod's are; each is matched across ranks by its name
(`coordinator`), which is unique while it is pending."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, cast

import torch
import torch.distributed as dist

from gradmesh.collectives import Op
from gradmesh.collectives.flat import flat_buffers, views
from gradmesh.errors import GradmeshError
from gradmesh.horovod.compression import Compression
from gradmesh.horovod.headers import (
    ALLREDUCE,
    OPS,
    REDUCESCATTER,
    grouped_header,
    header,
    tensors_only,
)
from gradmesh.horovod.process_sets import (
    _group,
    allgather_request,
    global_process_set,
    submit,
)
from gradmesh.runtime.world import size
from gradmesh.sync.data_parallel import api as _api
from gradmesh.sync.data_parallel.api import Handle, synchronize
from gradmesh.sync.data_parallel.reducer import Adasum, Average, Sum

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "reducescatter",
    "reducescatter_async",
]


def _autograd(function: type[torch.autograd.Function], *args: Any) -> Any:
    if function is not _GroupedAllreduce:  # whose tensors follow its settings
        first = args[0]
        listed = isinstance(first, list) and function is _Allreduce  # a grouped one
        tensors_only(function.__name__.strip("_").lower(), first if listed else [first])
    return function.apply(*args)  # type: ignore[no-untyped-call]


# -- reductions ----------------------------------------------------------------------------


def _op(average: bool | None, op: str | None) -> str:
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in gradmesh; use Average or Sum")
    if average is not None and op is not None:
        raise GradmeshError("give either average= or op=, not both")
    if op is None:
        return Sum if average is False else Average
    return op


def _reduction(
    tensors: torch.Tensor | list[torch.Tensor],
    average: bool | None,
    op: str | None,
    name: str | None,
    prescale: float,
    postscale: float,
    compression: Any,
    process_set: Any,
    what: str,
) -> Future[Any]:
    """One reduction submitted to its set's coordinator (matched by name); a joined rank's
    zeros count in averages (Horovod's), and while a rank has joined the reduction travels
    uncompressed. A list of tensors (a grouped allreduce) is one request: one fused buffer per
    dtype, reduced in turn, the results split back."""
    reduce_op = cast(Op, _op(average, op))
    code = OPS.index(reduce_op)
    kind = REDUCESCATTER if what == "reducescatter" else ALLREDUCE
    if isinstance(tensors, list):
        if not tensors:
            raise GradmeshError("grouped allreduce needs at least one tensor")
        tensors_only(what, tensors)
        fused = flat_buffers(tensors)
        buffers = [flat for flat, _ in fused]
        row = grouped_header(buffers, code)
    else:
        buffers, row = [tensors], header(kind, tensors, code)

    def run(group: Any, joined: int) -> Any:
        codec, label = (None, None) if joined else (compression, name)
        out = [_reduce(b, reduce_op, codec, label, prescale, postscale, group) for b in buffers]
        if isinstance(tensors, torch.Tensor):
            return _api.my_rows(out[0], group) if kind == REDUCESCATTER else out[0]
        parts = {}
        for reduced, (_, members) in zip(out, fused, strict=True):
            parts.update({id(t): v for t, v in zip(members, views(reduced, members), strict=True)})
        return [parts[id(t)] for t in tensors]

    return submit(process_set, what, row, name, run)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    compression: Any = Compression.none,
) -> Handle:
    return _reduction(
        tensor,
        average,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
        process_set,
        "allreduce",
    )


class _Allreduce(torch.autograd.Function):
    """Horovod's gradient of allreduce: the same reduction of the gradient (Sum and Average;
    min, max and product have none here)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.args = args
        return synchronize(allreduce_async(tensor, *args))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        average, _, op, pre, post, process_set, _ = ctx.args
        if _op(average, op) not in (Sum, Average):
            raise GradmeshError(f"allreduce with op={op} has no gradient (Average and Sum do)")
        reduced = synchronize(
            allreduce_async(grad, average, None, op, pre, post, process_set, Compression.none)
        )
        return (reduced, *[None] * len(ctx.args))


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """The reduced value of `tensor` (a new tensor; the argument is left as it was),
    differentiable as Horovod's is."""
    return _autograd(  # type: ignore[no-any-return]
        _Allreduce,
        tensor,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        compression,
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Handle:
    """In-place `allreduce_async`: `synchronize` writes the result into `tensor` and returns it."""
    reduced = allreduce_async(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return _write_back(reduced, [tensor])


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """In-place `allreduce`."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def _write_back(source: Future[Any], into: list[torch.Tensor]) -> Future[Any]:
    """A handle that, when `source` is done, copies its result(s) into `into` and returns them
    as Horovod's in-place forms do (one tensor, or the list)."""
    done: Future[Any] = Future()

    def copy(finished: Future[Any]) -> None:
        try:
            result = finished.result()
            results = result if isinstance(result, list) else [result]
            for target, value in zip(into, results, strict=True):
                target.data.copy_(value)
            done.set_result(into if isinstance(result, list) else into[0])
        except BaseException as exc:  # the operation's own error, raised at synchronize
            done.set_exception(exc)

    source.add_done_callback(copy)
    return done


def _reduce(
    tensor: torch.Tensor,
    op: Op,
    codec: Any,
    name: str | None,
    prescale: float,
    postscale: float,
    group: Any,
) -> torch.Tensor:
    """Horovod's reduction: an integer average is the sum scaled by 1 / size in double
    precision and truncated toward zero (gradmesh's own allreduce floors)."""
    if op == Average and not (tensor.is_floating_point() or tensor.is_complex()):
        op, postscale = Sum, postscale / _api.members(group)[2]
    return _api.reduce_copy(tensor, op, codec, name, prescale, postscale, group)


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
    compression: Any = Compression.none,
) -> Future[list[torch.Tensor]]:
    """Reduce the tensors as one operation (one fused buffer per dtype); `synchronize` returns
    the list of new tensors."""
    scale = (prescale_factor, postscale_factor, compression, process_set, "grouped_allreduce")
    return _reduction(list(tensors), average, op, name, *scale)


class _GroupedAllreduce(torch.autograd.Function):
    """The gradients of a grouped allreduce: a grouped allreduce of them."""

    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> Any:
        ctx.args = args
        return tuple(grouped_allreduce_async(list(tensors), *args).result())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        average, _, op, pre, post, process_set, _ = ctx.args
        if _op(average, op) not in (Sum, Average):
            raise GradmeshError(f"allreduce with op={op} has no gradient (Average and Sum do)")
        args = (average, None, op, pre, post, process_set, Compression.none)
        return (None, *grouped_allreduce_async(list(grads), *args).result())


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """The reduced values of `tensors` as new tensors, one operation, differentiable."""
    args = (average, name, op, prescale_factor, postscale_factor, process_set, compression)
    return list(_autograd(_GroupedAllreduce, args, *tensors))


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> Future[list[torch.Tensor]]:
    """In place: `synchronize` writes each result into its tensor and returns the tensors."""
    handle = grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return _write_back(handle, list(tensors))


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return handle.result()  # Horovod's synchronize, typed


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    """Reduce `tensor` over the set's ranks and give each rank its block of rows: with n rows
    over W ranks, rank r gets n // W rows, plus one for the first n % W ranks (Horovod's split).
    The sum is computed whole (an allreduce), then sliced: simple, and twice the bytes a ring
    reduce-scatter would send."""
    if op not in (Average, Sum):
        raise GradmeshError(f"reducescatter reduces with Average or Sum, not {op}")
    if tensor.dim() == 0:
        raise GradmeshError("reducescatter needs a tensor with a first dimension to split")
    return _reduction(
        tensor,
        None,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
        process_set,
        "reducescatter",
    )


class _Reducescatter(torch.autograd.Function):
    """The gradient of a reduce-scatter as Horovod defines it: every rank's block gathered,
    times the set's size for Sum (as the gradient of Horovod's allreduce is the allreduced
    gradient) and as it is for Average, times the scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.args = args
        return synchronize(reducescatter_async(tensor, *args))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _, op, process_set, pre, post, _ = ctx.args
        gathered = synchronize(allgather_request(grad, None, process_set))
        scale = pre * post * (_members(process_set) if _op(None, op) == Sum else 1)
        return (gathered * scale, *[None] * len(ctx.args))


def _members(process_set: Any) -> int:
    group = _group(process_set, "reducescatter")
    return size() if group is None else dist.get_world_size(group)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str = Average,
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The reduction (Average or Sum) of every rank's `tensor`, this rank's block of rows:
    n // size rows each, one more for the first n % size ranks. Differentiable."""
    return _autograd(  # type: ignore[no-any-return]
        _Reducescatter,
        tensor,
        name,
        op,
        process_set,
        prescale_factor,
        postscale_factor,
        compression,
    )
