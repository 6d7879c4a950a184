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
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
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
    if process_set is not None:
        raise NotImplementedError("process sets are not implemented in gradmesh yet")
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


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> Handle:
    return _allreduce_async(
        tensor,
        op=_op(average, op),  # type: ignore[arg-type]
        compression=compression,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
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
    done: Handle = Future()

    def write_back(handle: Handle) -> None:
        try:
            done.set_result(tensor.copy_(handle.result()))
        except BaseException as exc:  # the reduction's own error, raised at synchronize
            done.set_exception(exc)

    reduced.add_done_callback(write_back)
    return done


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
