"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun).

Differences, all deliberate: `broadcast_object` and `allgather_object` send plain values
(None, bool, 64-bit int, float, str, bytes and lists, tuples, sets and dicts of them, int keys
kept) as MessagePack, never pickle, and refuse other types in one line; `Adasum` raises
NotImplementedError; `allgather` concatenates along dimension 0 like Horovod's. The build
functions (`mpi_built`, `nccl_built`, ...) describe this torch build: no MPI, Gloo always.

The rest of the API: `init`, `shutdown`, the optimizer, `barrier`, `join` and the build
flags; with the names gradmesh's runtime and data-parallel engine give Horovod."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives import allgather as gather_equal
from gradmesh.errors import GradmeshError, PeerFailure
from gradmesh.horovod.compression import Compression
from gradmesh.horovod.coordinator import SHUT_DOWN, Coordinator, close_all
from gradmesh.horovod.headers import BARRIER, KINDS, STEP, header
from gradmesh.horovod.process_sets import (
    ProcessSet,
    _group,
    _sets,
    add_process_set,
    global_process_set,
    negotiated,
    submit,
)
from gradmesh.runtime.world import (
    collective_device,
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
from gradmesh.sync.data_parallel.api import broadcast_optimizer_state, poll, synchronize
from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer as _DistributedOptimizer
from gradmesh.sync.data_parallel.optimizer import broadcast_parameters
from gradmesh.sync.data_parallel.reducer import Adasum, Average, Max, Min, Product, Sum
from gradmesh.sync.local_sgd import Averager, LocalSGDOptimizer
from gradmesh.sync.wrapping import wrap_optimizer

HorovodInternalError = PeerFailure
"""Horovod's error for a collective that failed because of other ranks (a lost or silent peer,
ranks that called different operations): gradmesh's `PeerFailure`."""

__all__ = [
    "GradmeshError",
    "HorovodInternalError",
    "Adasum",
    "Average",
    "barrier",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "DistributedOptimizer",
    "DiLoCoOptimizer",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
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
    "Product",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "Sum",
    "synchronize",
]


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


def is_homogeneous() -> bool:
    """Whether every host of the job holds the same number of ranks."""
    return get_runtime().homogeneous


def shutdown() -> None:
    """Leave the job; every process set is forgotten (register them again after `init`)."""
    for process_set in _sets.values():
        process_set._invalidate()
    _sets.clear()
    close_all(SHUT_DOWN)
    _shutdown()


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
    them by default). Sparse gradients stay sparse (indices and values all-gathered) unless
    `sparse_as_dense`; `num_groups` / `groups` are accepted, the fusion buffers being sized by
    bytes instead.
    With `process_set`, gradients are averaged over the set's ranks only (one optimizer per
    set at a time); on a rank outside the set it steps on this rank's own gradients, as
    Horovod's does."""
    if isinstance(process_set, ProcessSet) and process_set.ranks and not process_set.included():
        _group(process_set, "DistributedOptimizer", optimizer=True, outside_ok=True)
        return wrap_optimizer(optimizer, _OutsideSet)
    group = _group(process_set, "DistributedOptimizer", optimizer=True)
    wrapped = _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        on_nonfinite="pass",
        gradient_predivide_factor=gradient_predivide_factor,
        group=group,
        sparse_as_dense=sparse_as_dense,
    )
    found = negotiated(global_process_set, "DistributedOptimizer") if group is None else None
    if found is not None:  # its steps are announced, for `join`
        _register(found, wrapped)
    return wrapped


def DiLoCoOptimizer(  # noqa: N802 - reads like DistributedOptimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    sync_every: int = 500,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    compression: Any = Compression.none,
) -> torch.optim.Optimizer:
    """DiLoCo in a Horovod script (Horovod has none; gradmesh's own, docs/local_sgd.md):
    `optimizer` steps on this rank's own gradients; every `sync_every` steps (H) the ranks' mean
    outer gradient (start minus end parameters), compressed by `compression` (any of
    `hvd.Compression`'s), moves the last average through an outer Nesterov SGD, and every rank
    starts its next H steps there. Broadcast the parameters first (`hvd.broadcast_parameters`),
    as with `DistributedOptimizer`; the ranks of the whole job are the replicas."""
    params = (
        [p for _, p in named_parameters]
        if named_parameters is not None
        else [p for g in optimizer.param_groups for p in g["params"]]
    )
    averager = Averager(
        [p for p in params if p.requires_grad],
        sync_every,
        compressor=compression,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
    )
    return LocalSGDOptimizer(optimizer, averager)


class _OutsideSet:
    """Methods of a DistributedOptimizer over a process set this rank is not in: nothing to
    synchronize; `step` is the optimizer's own, on this rank's gradients."""

    def synchronize(self) -> None:
        return None

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of the set reaches this point: a request every rank submits,
    matched as the others are (it runs nothing once matched)."""
    submit(process_set, "barrier", header(BARRIER), "barrier", lambda *_: None).result()


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, take part in the other ranks'
    Sum and Average allreduces (zeros, still counted in averages) and their DistributedOptimizer
    steps (on zero gradients), as Horovod's join does; returns the last rank to join. When the
    most recent DistributedOptimizer reduces over another process set, only its steps are
    taken part in, and the last of the set's ranks to join is returned."""
    joinable = get_runtime().joinable
    optimizer = getattr(joinable, "__self__", None)
    found = negotiated(global_process_set, "join")
    registered = None if found is None or found.optimizer is None else found.optimizer()
    if optimizer is None or optimizer is registered:
        return rank() if found is None else int(found.join().result())
    gm = optimizer._gm
    entered = gm.steps  # the steps every rank of the set has taken so far, joined or not
    optimizer.join()
    group = gm.group
    if group is None:
        return rank()
    table = gather_equal(torch.tensor([entered, rank()], device=collective_device()), group)
    return int(max(table.tolist())[1])  # the latest to join; of those, the highest rank


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


def _register(found: Coordinator, optimizer: Any) -> None:
    """`optimizer` (over the set) announces each step, so joined ranks take it too."""
    found.optimizer = weakref.ref(optimizer)
    gm = optimizer._gm
    if gm.replicas > 1:
        gm.average_all = True  # Horovod: a joined rank's zeros count in averages
        gm.announce = lambda: found.submit(
            KINDS[STEP], header(STEP), "DistributedOptimizer.step", lambda _: None
        )
