"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun).

Differences, all deliberate: `broadcast_object` and `allgather_object` send plain values
(None, bool, 64-bit int, float, str, bytes and lists, tuples and dicts of them, int keys kept)
as MessagePack, never pickle, and refuse other types in one line; `Adasum` raises
NotImplementedError; `allgather` concatenates along dimension 0 like Horovod's. The build
functions (`mpi_built`, `nccl_built`, ...) describe this torch build: no MPI, Gloo always.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

import gradmesh.horovod.elastic as elastic
from gradmesh.collectives import allgather as _gather_rows
from gradmesh.collectives import allgather_object as _allgather_object
from gradmesh.collectives import broadcast_object as _broadcast_object
from gradmesh.compression.registry import make
from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import barrier as _barrier
from gradmesh.runtime.world import (
    cross_rank,
    cross_size,
    get_runtime,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from gradmesh.runtime.world import init as _init
from gradmesh.runtime.world import shutdown as _shutdown
from gradmesh.sync.data_parallel import api as _api
from gradmesh.sync.data_parallel.api import (
    Handle,
    broadcast_optimizer_state,
    poll,
    synchronize,
)
from gradmesh.sync.data_parallel.optimizer import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    broadcast_parameters,
)
from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer as _DistributedOptimizer

__all__ = [
    "Adasum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "Average",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "Compression",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "DistributedOptimizer",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "Max",
    "Min",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "ProcessSet",
    "Product",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "Sum",
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


# -- process sets --------------------------------------------------------------------------


class ProcessSet:
    """Horovod's process set: collectives over some of the ranks. Made from a list of global
    ranks and registered on every rank with `add_process_set` (or `init(process_sets=...)`);
    only its ranks then call collectives with `process_set=` it. gradmesh has no MPI, so a set
    is never made from a communicator."""

    def __init__(self, ranks: Iterable[int]) -> None:
        given = list(ranks)
        if any(type(r) is not int for r in given):
            raise GradmeshError(f"a ProcessSet is made from a list of ranks (ints), got {given!r}")
        self.ranks: list[int] | None = sorted(given)
        self.process_set_id: int | None = None
        self._groups: tuple[Any, Any] | None = None
        """Weak references to (the group its collectives run on, the group its
        DistributedOptimizer reduces on); None on a rank outside the set."""

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self.ranks is not None and rank() in self.ranks

    def size(self) -> int:
        return len(self.ranks or ())

    def rank(self) -> int:
        """This rank's place in the set (-1 outside it)."""
        return self.ranks.index(rank()) if self.ranks and rank() in self.ranks else -1

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._groups = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
"""Every rank of the job (its ranks are filled in by `init`)."""
global_process_set.process_set_id = 0
_sets: dict[int, ProcessSet] = {}
"""The registered process sets other than the global one, by id."""


def init(
    comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None, **_kwargs: Any
) -> None:
    """Join the job (a second call does nothing). `process_sets`: sets to register at once, as
    `add_process_set` does ("dynamic" is accepted: every set here may be added later). `comm`
    (an MPI communicator in Horovod) must be None or a list of all ranks."""
    if comm is not None and list(comm) != list(range(_env_world())):
        raise GradmeshError("init(comm=...): gradmesh has no MPI; run every rank of the job")
    fresh = not is_initialized()
    _init()
    global_process_set.ranks = list(range(size()))
    if fresh and not isinstance(process_sets, str):
        for process_set in process_sets or ():
            add_process_set(process_set)


def _env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def shutdown() -> None:
    """Leave the job; every process set is forgotten (register them again after `init`)."""
    for process_set in _sets.values():
        process_set._invalidate()
    _sets.clear()
    _shutdown()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank calls it with the same ranks, in the same order. Ranks
    that disagree, or bad ranks on any rank, are one error on every rank."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None
    rt = get_runtime()
    problem = ""
    if not ps.ranks:
        problem = "no ranks"
    elif len(set(ps.ranks)) != len(ps.ranks):
        problem = f"a rank twice in {ps.ranks}"
    elif not 0 <= ps.ranks[0] <= ps.ranks[-1] < rt.size:
        problem = f"ranks {ps.ranks} outside 0..{rt.size - 1}"
    elif ps.process_set_id is not None:
        problem = f"a set already registered as id {ps.process_set_id}"
    mask = torch.zeros(rt.size + 1, dtype=torch.int64)
    if problem:
        mask[-1] = 1
    else:
        mask[ps.ranks] = 1
    table = _gather_rows(mask) if rt.size > 1 else mask.unsqueeze(0)
    me = f"rank {rt.rank}: add_process_set"
    bad = [r for r in range(rt.size) if int(table[r, -1])]
    if bad:
        mine = f" ({problem})" if problem else ""
        raise GradmeshError(f"{me}: rank {bad[0]} gave bad ranks{mine}")
    if any(not torch.equal(table[r], table[0]) for r in range(rt.size)):
        given = "; ".join(
            f"rank {r} gave {table[r, :-1].nonzero().reshape(-1).tolist()}" for r in range(rt.size)
        )
        raise GradmeshError(f"{me}: the ranks disagree on the set's members: {given}")
    if any(other.ranks == ps.ranks for other in _sets.values()):
        raise GradmeshError(f"{me}: a process set with ranks {ps.ranks} is already registered")
    ps.process_set_id = max(_sets, default=0) + 1
    label = f"process set {ps.process_set_id}"
    groups = [rt.group_over(f"{label} ({kind})", ps.ranks) for kind in ("ops", "optimizer")]
    ps._groups = None if groups[0] is None else (weakref.ref(groups[0]), weakref.ref(groups[1]))
    _sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank and free its groups; False for the global set."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    _registered(process_set, "remove_process_set")
    if process_set._groups is not None:
        for ref in process_set._groups:
            group = ref()
            if group is not None:
                get_runtime().free_group(group)
    del _sets[process_set.process_set_id]  # type: ignore[arg-type]
    process_set._invalidate()
    return True


def _registered(process_set: Any, what: str) -> ProcessSet:
    if not isinstance(process_set, ProcessSet):
        raise GradmeshError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    known = _sets.get(process_set.process_set_id)  # type: ignore[arg-type]
    if known is not process_set:
        raise GradmeshError(
            f"rank {rank()}: {what}: unknown process set {process_set.ranks} (register it with "
            "hvd.add_process_set on every rank; a removed set cannot be used)"
        )
    return process_set


def _group(process_set: Any, what: str, optimizer: bool = False) -> dist.ProcessGroup | None:
    """The group `what` runs on for `process_set`: None for the global set, else the set's own;
    one line for a set that is not registered or a rank outside it."""
    if process_set is None or process_set is global_process_set:
        return None
    ps = _registered(process_set, what)
    if ps._groups is None:
        raise GradmeshError(
            f"rank {rank()}: {what}: this rank is not in process set {ps.process_set_id} "
            f"(ranks {ps.ranks}); only its ranks call its collectives"
        )
    group = ps._groups[1 if optimizer else 0]()
    if group is None:
        raise GradmeshError(f"rank {rank()}: {what}: process set used after hvd.shutdown()")
    return group  # type: ignore[no-any-return]


def _root(root_rank: int, group: dist.ProcessGroup | None, what: str) -> int:
    members = range(size()) if group is None else dist.get_process_group_ranks(group)
    if root_rank not in members:
        where = "the job" if group is None else f"the process set (ranks {list(members)})"
        raise GradmeshError(f"rank {rank()}: {what}: root rank {root_rank} is not in {where}")
    return root_rank


# -- names in flight -----------------------------------------------------------------------

_in_flight: set[str] = set()
"""Names of operations started and not finished: Horovod refuses a second one of a name."""


def _named(name: str | None, start: Callable[[], Future[Any]]) -> Future[Any]:
    if name is not None and name in _in_flight:
        raise GradmeshError(
            f"rank {rank()}: an operation named {name!r} is still in flight; synchronize it "
            "before starting another of that name"
        )
    handle = start()
    if name is not None and not handle.done():
        _in_flight.add(name)
        handle.add_done_callback(lambda _: _in_flight.discard(name))
    return handle


# -- the optimizer -------------------------------------------------------------------------


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
    `num_groups` / `groups` are accepted, the fusion buffers being sized by bytes instead.
    With `process_set`, gradients are averaged over the set's ranks only (one optimizer per
    set at a time)."""
    return _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        on_nonfinite="pass",
        gradient_predivide_factor=gradient_predivide_factor,
        group=_group(process_set, "DistributedOptimizer", optimizer=True),
    )


def _autograd(function: type[torch.autograd.Function], *args: Any) -> Any:
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
    start: Any,
    tensors: Any,
    average: bool | None,
    op: str | None,
    name: str | None,
    prescale: float,
    postscale: float,
    compression: Any,
    process_set: Any,
    what: str,
) -> Any:
    """Start one of gradmesh's reductions with Horovod's reduction arguments."""
    group = _group(process_set, what)
    return _named(
        name,
        lambda: start(
            tensors,
            op=_op(average, op),
            compression=compression,
            name=name,
            prescale_factor=prescale,
            postscale_factor=postscale,
            group=group,
        ),
    )


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
    return _reduction(  # type: ignore[no-any-return]
        _api.allreduce_async,
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
    """Reduce the tensors as one operation; `synchronize` returns the list of new tensors."""
    return _reduction(  # type: ignore[no-any-return]
        _api.grouped_allreduce_async,
        tensors,
        average,
        op,
        name,
        prescale_factor,
        postscale_factor,
        compression,
        process_set,
        "grouped_allreduce",
    )


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
    return _reduction(  # type: ignore[no-any-return]
        _api.reducescatter_async,
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
    """The gradient of a reduce-scatter: every rank's block gathered (divided by the set's size
    for Average), times the scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.args = args
        return synchronize(reducescatter_async(tensor, *args))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _, op, process_set, pre, post, _ = ctx.args
        gathered = allgather(grad, process_set=process_set)
        scale = pre * post / (_members(process_set) if _op(None, op) == Average else 1)
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


# -- gather, broadcast, all-to-all ---------------------------------------------------------


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> Handle:
    group = _group(process_set, "allgather")
    return _named(name, lambda: _api.allgather_async(tensor, group))


class _Allgather(torch.autograd.Function):
    """Horovod's gradient of allgather: this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: Any) -> torch.Tensor:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        averaged = allreduce(grad, op=Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows]), process_set=ctx.process_set).tolist()
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
    group = _group(process_set, "broadcast")
    root = _root(root_rank, group, "broadcast")
    return _named(name, lambda: _api.broadcast_async(tensor, root, in_place, group))


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
    group = _group(process_set, "alltoall")
    return _named(name, lambda: _api.alltoall_async(tensor, splits, group))


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


# -- objects, barrier, join ----------------------------------------------------------------


def _on_set(process_set: Any, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the world, or on the set's group through the communication thread."""
    group = _group(process_set, what)
    if group is None:
        return fn(*args)
    return _api.submit(fn, *args, group).result()


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Root's object on every rank of the set (plain values, never pickle: see the module)."""
    _root(root_rank, _group(process_set, "broadcast_object"), "broadcast_object")
    return _on_set(process_set, "broadcast_object", _broadcast_object, obj, root_rank)


def allgather_object(
    obj: Any, name: str | None = None, process_set: Any = global_process_set
) -> list[Any]:
    """Every rank's object, in rank order (plain values, never pickle)."""
    return _on_set(process_set, "allgather_object", _allgather_object, obj)  # type: ignore[no-any-return]


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of the set reaches this point."""
    if _group(process_set, "barrier") is None:
        _barrier()
    else:
        _on_set(process_set, "barrier", lambda group: dist.barrier(group=group))


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
