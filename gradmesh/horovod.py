"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun).

Differences, all deliberate: `broadcast_object` and `allgather_object` send plain values
(None, bool, 64-bit int, float, str, bytes and lists, tuples and dicts of them, int keys kept)
as MessagePack, never pickle, and refuse other types in one line; `Adasum` raises
NotImplementedError; `allgather` concatenates along dimension 0 like Horovod's. The build
functions (`mpi_built`, `nccl_built`, ...) describe this torch build: no MPI, Gloo always.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives import allgather_object, broadcast_object
from gradmesh.collectives import broadcast as _broadcast_in_place
from gradmesh.compression import make
from gradmesh.data_parallel import api as _api
from gradmesh.data_parallel.api import (
    Handle,
    broadcast_optimizer_state,
    poll,
    synchronize,
)
from gradmesh.data_parallel.api import allgather_tensor as allgather
from gradmesh.data_parallel.optimizer import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    broadcast_parameters,
)
from gradmesh.data_parallel.optimizer import DistributedOptimizer as _DistributedOptimizer
from gradmesh.errors import GradmeshError
from gradmesh.runtime import (
    barrier,
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
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "gloo_enabled",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]


class Compression:
    """`hvd.Compression.none` / `hvd.Compression.fp16`, and gradmesh's other compressors
    (`bf16`, `int8`, `topk`, `sign`, `powersgd`, with error feedback where they need it)."""

    none = make("none")
    fp16 = make("fp16")
    bf16 = make("bf16")
    int8 = make("int8")
    topk = make("topk")
    sign = make("sign")
    powersgd = make("powersgd")


def init(*_args: Any, **_kwargs: Any) -> None:
    """Join the job (Horovod's init takes optional communicators; gradmesh ignores them)."""
    _init()


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer, in Horovod's argument order and with its behaviour:
    non-finite gradients reach the optimizer as in plain torch (gradmesh's own API stops on
    them by default). Sparse gradients are always reduced dense (`sparse_as_dense`'s result);
    `num_groups` / `groups` are accepted, the fusion buffers being sized by bytes instead."""
    _global_set_only(process_set)
    return _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        on_nonfinite="pass",
        gradient_predivide_factor=gradient_predivide_factor,
    )


def _op(average: bool | None, op: str | None) -> str:
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in gradmesh; use Average or Sum")
    if average is not None and op is not None:
        raise GradmeshError("give either average= or op=, not both")
    if op is None:
        return Sum if average is False else Average
    return op


def _reduction(
    start: Any,
    tensors: Any,
    average: bool | None,
    op: str | None,
    name: str | None,
    prescale: float,
    postscale: float,
    compression: Any,
) -> Any:
    """Start one of gradmesh's reductions with Horovod's reduction arguments."""
    return start(
        tensors,
        op=_op(average, op),
        compression=compression,
        name=name,
        prescale_factor=prescale,
        postscale_factor=postscale,
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    return _reduction(  # type: ignore[no-any-return]
        _api.allreduce_async,
        tensor,
        average,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The reduced value of `tensor` (a new tensor; the argument is left as it was)."""
    return synchronize(
        allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, compression)
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """In-place `allreduce_async`: `synchronize` writes the result into `tensor` and returns it."""
    reduced = allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor)
    return _write_back(reduced, [tensor])


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """In-place `allreduce`."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor)
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


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    compression: Any = Compression.none,
) -> Future[list[torch.Tensor]]:
    """Reduce the tensors as one operation; `synchronize` returns the list of new tensors."""
    _global_set_only(process_set)
    return _reduction(  # type: ignore[no-any-return]
        _api.grouped_allreduce_async,
        tensors,
        average,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
    )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list[torch.Tensor]:
    handle = grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, compression
    )
    return handle.result()  # Horovod's synchronize, typed


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
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
    process_set: Any = None,
) -> list[torch.Tensor]:
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return handle.result()  # Horovod's synchronize, typed


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> Handle:
    _global_set_only(process_set)
    return _api.allgather_async(tensor)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> Handle:
    """Root's value of `tensor` as a new tensor; the argument is left as it was."""
    _global_set_only(process_set)
    return _api.broadcast_async(tensor, root_rank)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> Handle:
    """Root's value written into `tensor`."""
    _global_set_only(process_set)
    return _api.broadcast_async(tensor, root_rank, in_place=True)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    _global_set_only(process_set)
    return _reduction(  # type: ignore[no-any-return]
        _api.reducescatter_async,
        tensor,
        None,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Any = Compression.none,
    op: str = Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The reduction (Average or Sum) of every rank's `tensor`, this rank's block of rows:
    n // size rows each, one more for the first n % size ranks."""
    return synchronize(
        reducescatter_async(
            tensor, name, op, process_set, prescale_factor, postscale_factor, compression
        )
    )


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> Future[tuple[torch.Tensor, torch.Tensor]]:
    """`synchronize` returns (rows received, int32 counts received from each rank)."""
    _global_set_only(process_set)
    return _api.alltoall_async(tensor, splits)


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> Any:
    """Rows of `tensor` sent to each rank (`splits`, or equal parts) and theirs received, in rank
    order; with `splits`, also the counts received from each rank (as Horovod returns)."""
    output, received = alltoall_async(tensor, splits, name, process_set).result()
    return output if splits is None else (output, received)


def _global_set_only(process_set: Any) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not implemented in gradmesh yet")


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


def mpi_built() -> bool:
    """gradmesh runs on torch.distributed: no MPI, DDL or oneCCL, ever."""
    return False


mpi_enabled = mpi_threads_supported = ddl_built = ccl_built = mpi_built


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether the job runs on Gloo (before `init()`: whether it can)."""
    return get_runtime().backend == "gloo" if is_initialized() else gloo_built()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return torch.version.hip is not None
