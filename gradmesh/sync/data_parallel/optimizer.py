"""Horovod-style synchronous data parallelism with tensor fusion and overlap with backward.

`DistributedOptimizer(opt, named_parameters)` returns an object of a subclass of `opt`'s own class
(LR schedulers and `isinstance` keep working) sharing `opt`'s parameter groups and state.
A post-accumulate-grad hook on every trainable parameter marks its gradient ready; when every
gradient of a fusion bucket is ready the bucket is packed and its reduction starts while backward
goes on: `native` as the backend's asynchronous allreduce issued from the training thread (as
DDP does), gradmesh's own algorithms on the communication thread over the runtime's second
process group (so they never interleave with collectives the training thread issues). A callback
at the end of backward flushes buckets still waiting on parameters that got no gradient (they
count as zero). `step()` waits only for what is still in flight, unpacks, and runs the wrapped
optimizer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradmesh.collectives import ALGORITHMS, Op, broadcast
from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.compression.base import (
    Compressor,
    NoCompression,
)
from gradmesh.compression.registry import resolve
from gradmesh.errors import GradmeshError, GradmeshValueError
from gradmesh.observe.timeline import span
from gradmesh.runtime.axes import EXPERT_REPLICAS, PP
from gradmesh.runtime.mesh import BATCH_SHARDED, EXPERT_PLACED, LAYOUT_SYNCED
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.data_parallel.reducer import (
    Adasum,
    Average,
    GradientReducer,
    OnNonfinite,
    ReduceOptions,
    Sum,
)
from gradmesh.sync.wrapping import wrap_optimizer


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class."""

    _gm: GradientReducer
    passes_found_inf = True
    """The update is the wrapped optimizer's step: a fused one skips an fp16 overflow itself
    (`gradmesh.train.loss_scale.skips_on_device`)."""

    def synchronize(self) -> None:
        """Reduce every trainable gradient across ranks now (before clipping, for instance)."""
        self._gm.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside this block uses the gradients `synchronize()` already produced."""
        self._gm.skip_sync = True
        try:
            yield
        finally:
            self._gm.skip_sync = False

    def _apply(self, closure: Callable[[], float] | None = None) -> Any:
        """Run the wrapped optimizer on the reduced gradients, unless they are not finite."""
        gm = self._gm
        gm.steps += 1
        if getattr(self, "found_inf", None) is not None:
            name = None  # fp16's loss scale owns non-finite gradients; the step skips them
        elif gm.on_nonfinite == "error" and gm.defer_nonfinite:
            name = gm.watch_nonfinite()  # no host read each step: the GPU keeps running
        elif gm.on_nonfinite != "pass":
            name = gm.nonfinite_parameter()
        else:
            name = None
        if name is not None:
            if gm.on_nonfinite == "error":
                raise GradmeshError(
                    f"rank {gm.rt.rank}: step {gm.steps}: non-finite gradient in parameter "
                    f"{name!r} (on_nonfinite='skip' or --on-nonfinite skip skips such steps)"
                )
            gm.skipped_steps += 1
            return None
        with span("step", "compute"):
            return super().step(closure)  # type: ignore[misc]

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        gm = self._gm
        try:
            if gm.synced and not gm.skip_sync:
                warnings.warn(  # Horovod's words, which scripts' tests look for
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(): the gradients synchronize() reduced are "
                    "used; wrap step() in optimizer.skip_synchronize() to say so",
                    stacklevel=2,
                )
            if not gm.skip_sync or not gm.synced:
                gm.synchronize()
            return self._apply(closure)
        finally:
            gm.reset()

    def join(self) -> None:
        """Call when this rank has no more data. Until every rank has joined, this rank sends
        zero gradients and takes the same steps as the others (averaged over the ranks still
        training), so all replicas stay identical."""
        gm = self._gm
        if gm.also:
            raise GradmeshError(
                f"rank {gm.rt.rank}: join() is not supported with a hybrid plan's "
                "batch-sharded layers"
            )
        while self.join_step() > 0:
            pass

    def join_step(self) -> float:
        """One step of a joined rank: zero gradients into the others' reductions, then the same
        update as theirs; returns how many ranks still train (0: every rank has joined)."""
        gm = self._gm
        try:
            active = gm.join_round()
            if active > 0:
                gm.unpack_all(active, mine=False)
                self._apply()
            return active
        finally:
            gm.reset()


def is_distributed(optimizer: object) -> bool:
    """Whether `optimizer` came from `DistributedOptimizer` (its step reduces, then spans the
    update as `step` on the timeline)."""
    return isinstance(optimizer, _DistributedMixin)


def DistributedOptimizer(  # noqa: N802 - the Horovod name users already know
    optimizer: Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    allreduce: str = "native",
    fusion_mb: float = 64.0,
    compression: Compressor | str | None = None,
    backward_passes_per_step: int = 1,
    op: Op | str = Average,
    on_nonfinite: OnNonfinite = "error",
    gradient_predivide_factor: float = 1.0,
    group: dist.ProcessGroup | None = None,
    sparse_as_dense: bool = True,
    zero_stage: int = 0,
) -> Optimizer:
    """Wrap `optimizer` so gradients are averaged over all ranks, overlapped with backward.

    `named_parameters` names the parameters (the same on every rank; each of the optimizer's
    parameters once); by default the optimizer's own order is used with generated names.
    `on_nonfinite`: "error" stops at a NaN or Inf in a reduced gradient, "skip" skips that step
    on every rank, "pass" steps on it as plain torch would. `gradient_predivide_factor` f
    (average only): gradients are divided by f before the sum and by size / f after it.
    `group`: average over this group's ranks (one the runtime made, such as a Horovod process
    set's, used by this optimizer alone) instead of the data-parallel axis. `sparse_as_dense`
    False: sparse gradients (an `nn.Embedding(sparse=True)`'s) stay sparse, each rank sending
    only its rows (`sparse.py`), for optimizers such as SparseAdam; True: densified into the
    fusion buckets. `zero_stage` 1: each replica keeps its part's optimizer state only (ZeRO
    stage 1, `_sharded`); stages 2 and 3 shard the model instead (`gradmesh.shard`).
    """
    _check_options(allreduce, op, backward_passes_per_step, on_nonfinite, gradient_predivide_factor)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer = _sharded(optimizer, params, zero_stage, group)
    named = _check_named(named_parameters, params)
    trainable = [
        (n, p) for n, p in named if p.requires_grad and not getattr(p, LAYOUT_SYNCED, False)
    ]
    options = ReduceOptions(
        allreduce,
        cast(Op, op),
        fusion_mb,
        backward_passes_per_step,
        on_nonfinite,
        gradient_predivide_factor,
    )
    reducer_of = partial(GradientReducer, options=options)
    placed = {id(p) for _, p in trainable if _placed(p)}
    whole = [(n, p) for n, p in trainable if id(p) not in placed]
    reducer = reducer_of(
        whole, compression=resolve(compression), group=group, keep_sparse=not sparse_as_dense
    )
    if placed:
        _placed_reducers(reducer, reducer_of, trainable, group, resolve(compression))
    wrapped = wrap_optimizer(optimizer, _DistributedMixin, _gm=reducer)
    wrapped._parameter_names = {p: n for n, p in named}  # type: ignore[attr-defined]  # Horovod's
    reducer.rt.joinable = cast(_DistributedMixin, wrapped).join  # what gradmesh.join() joins
    return wrapped


def _placed(p: torch.Tensor) -> bool:
    """Whether the layout placed `p` on a group other than the replicas: a hybrid plan's
    batch-sharded layer, or an expert."""
    return bool(getattr(p, BATCH_SHARDED, False) or getattr(p, EXPERT_PLACED, False))


def _placed_reducers(
    reducer: GradientReducer,
    reducer_of: Callable[..., GradientReducer],
    trainable: list[tuple[str, torch.nn.Parameter]],
    group: dist.ProcessGroup | None,
    compression: Compressor,
) -> None:
    """The reducers of the parameters `_placed` puts elsewhere, after `reducer`'s."""
    if group is not None:
        raise GradmeshError("the layout's placed parameters are averaged over the mesh's groups")
    rt = reducer.rt
    experts = [(n, p) for n, p in trainable if getattr(p, EXPERT_PLACED, False)]
    if experts and rt.mesh.experts.size > 1:  # over the copies of each expert only
        copies = rt.new_group("experts", rt.mesh.shape.spanned(EXPERT_REPLICAS))
        reducer.also.append(reducer_of(experts, compression=compression, group=copies))
    batch = [(n, p) for n, p in trainable if getattr(p, BATCH_SHARDED, False)]
    if batch:  # their layers saw 1/tp of the replica's batch: averaged over dp x tp ranks
        if rt.mesh[PP].size > 1:
            raise GradmeshError("batch-sharded parameters need the mesh's dp group and pp 1")
        hybrid = rt.new_group("hybrid batch")
        reducer.also.append(reducer_of(batch, compression=NoCompression(), group=hybrid))


def _sharded(
    optimizer: Optimizer,
    params: list[torch.nn.Parameter],
    stage: int,
    group: dist.ProcessGroup | None,
) -> Optimizer:
    """`optimizer`, or at ZeRO stage 1 a `ZeroRedundancyOptimizer` of it over the dp axis
    (`zero.shard_optimizer`: each replica steps its part of the parameters and sends it to the
    others); one line for parameters this wrapper must not average, or a stage it does not
    take."""
    if any(hasattr(p, "device_mesh") for p in params):
        raise GradmeshError(
            "DistributedOptimizer: the parameters are sharded by gradmesh.shard (FSDP2), which "
            "averages their gradients itself: step the optimizer as it is"
        )
    if stage not in (0, 1):
        raise GradmeshError(
            f"DistributedOptimizer: zero_stage {stage}: stages 2 and 3 shard the model, with "
            "gradmesh.shard(model, stage) before the optimizer is built (valid here: 0, 1)"
        )
    if stage and group is not None:
        raise GradmeshError("DistributedOptimizer: zero_stage 1 shards over the mesh's dp axis")
    if not stage:
        return optimizer
    from gradmesh.sync.sharded.optimizer import shard_optimizer

    return shard_optimizer(optimizer, 1, get_runtime())


def _check_options(
    allreduce: str, op: str, passes: int, on_nonfinite: str, predivide: float
) -> None:
    """One line for `DistributedOptimizer` arguments no reducer takes."""
    ALGORITHMS.get(allreduce)  # fail early on an unknown algorithm name
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in gradmesh; use Average or Sum")
    if op not in (Average, Sum):
        raise GradmeshError(f"unknown reduction op {op!r} (valid: average, sum)")
    if passes < 1:
        raise GradmeshError(f"backward_passes_per_step must be >= 1, got {passes}")
    if on_nonfinite not in ("error", "skip", "pass"):
        raise GradmeshError(f"unknown on_nonfinite {on_nonfinite!r} (valid: error, skip, pass)")
    if predivide != 1.0 and op != Average:
        raise GradmeshError("gradient_predivide_factor needs op=Average")
    if not predivide > 0:
        raise GradmeshError(f"gradient_predivide_factor must be > 0, got {predivide}")


def _check_named(
    given: Iterable[tuple[str, torch.nn.Parameter]] | None, params: list[torch.nn.Parameter]
) -> list[tuple[str, torch.nn.Parameter]]:
    """The named parameters the optimizer updates (Horovod's generated names where none are
    given), or one line: a repeated name, or an optimizer parameter it does not name (its
    gradient would never be averaged)."""
    if given is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    named = list(given)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        again = sorted({n for n in names if names.count(n) > 1})
        raise GradmeshValueError(f"named_parameters repeats the name(s) {', '.join(again)}")
    ids = {id(p) for _, p in named}
    missing = sum(1 for p in params if id(p) not in ids)
    if missing:
        raise GradmeshValueError(
            f"named_parameters does not name {missing} of the optimizer's {len(params)} "
            "parameters; give every parameter the optimizer updates a name"
        )
    mine = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in mine]  # only what the optimizer steps


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    root_rank: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Overwrite every rank's tensors with `root_rank`'s in place (state_dict or named_parameters),
    over the whole world or over `group` (which holds `root_rank`, a global rank).

    Tensors are sent in the given order, which must be the same on every rank.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    tensors = [t.data if isinstance(t, torch.nn.Parameter) else t for _, t in items]
    members = get_runtime().size if group is None else dist.get_world_size(group)
    if members == 1 or not tensors:
        return
    with torch.no_grad():
        for flat, views in flat_buffers(tensors):
            broadcast(flat, root=root_rank, group=group)
            unpack(flat, views)
