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

import json
import math
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives import ALGORITHMS, Op, allreduce, broadcast
from gradmesh.collectives.agreement import FixedLayout
from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.collectives.native import modelled_bytes_sent
from gradmesh.compression.base import (
    Compressor,
    Link,
    NoCompression,
    State,
    load_states,
    save_states,
)
from gradmesh.compression.registry import reduce, resolve
from gradmesh.errors import GradmeshError, PeerFailure, first_line
from gradmesh.observe.timeline import span
from gradmesh.runtime.mesh import BATCH_SHARDED
from gradmesh.runtime.world import Runtime, get_runtime
from gradmesh.sync.data_parallel.buckets import Bucket, plan_buckets
from gradmesh.sync.wrapping import wrap_optimizer

Average: Op = "average"
Sum: Op = "sum"
Min: Op = "min"
Max: Op = "max"
Product: Op = "product"
Adasum = "adasum"
OnNonfinite = Literal["error", "skip", "pass"]


def describe(params: list[tuple[str, nn.Parameter]]) -> list[str]:
    return [f"{n} {list(p.shape)} {str(p.dtype).removeprefix('torch.')}" for n, p in params]


def check_models_agree(
    rt: Runtime, params: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup
) -> None:
    """Raise, naming the first differing parameter and the ranks, unless every rank has the
    same parameter names, shapes and dtypes. Compares checksums first; text only on mismatch."""
    mine = describe(params)
    ranks = dist.get_process_group_ranks(group)
    digest = torch.tensor([zlib.crc32("\n".join(mine).encode()), len(mine)], dtype=torch.int64)
    rows = [torch.empty_like(digest) for _ in ranks]
    try:
        dist.all_gather(rows, digest, group=group)
    except RuntimeError as exc:
        raise PeerFailure(
            f"rank {rt.rank}: comparing the model's parameters on {rt.group_label(group)} "
            f"failed: {first_line(exc)}"
        ) from None
    if all(torch.equal(r, rows[0]) for r in rows):
        return
    text = torch.tensor(list(json.dumps(mine).encode()), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
    dist.all_gather(lengths, torch.tensor([text.numel()]), group=group)
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: text.numel()] = text
    texts = [torch.empty_like(padded) for _ in ranks]
    dist.all_gather(texts, padded, group=group)
    listings = [
        json.loads(bytes(t[: int(n)].tolist()).decode())
        for t, n in zip(texts, lengths, strict=True)
    ]
    for i in range(max(len(x) for x in listings)):
        entries = [x[i] if i < len(x) else "(none)" for x in listings]
        if len(set(entries)) > 1:
            which = "; ".join(f"rank {r}: {e}" for r, e in zip(ranks, entries, strict=True))
            raise GradmeshError(
                f"rank {rt.rank}: models differ across ranks at parameter #{i}: {which}"
            )


class NativeWork:
    """A bucket reduced by the backend's asynchronous allreduce, issued from the training thread
    on the optimizer's group (as torch DDP does): no thread handoff on the hot path."""

    def __init__(self, rt: Runtime, bucket: Bucket, label: str, group: dist.ProcessGroup) -> None:
        self.rt, self.bucket, self.label = rt, bucket, label
        self.started = time.perf_counter()
        try:
            self.work = dist.all_reduce(bucket.buffer, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._error(exc) from None
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        rt.comm.add(modelled_bytes_sent(dist.get_world_size(group), nbytes), 0.0)

    def _error(self, exc: BaseException) -> PeerFailure:
        return PeerFailure(
            f"rank {self.rt.rank}: {self.label} (bucket {self.bucket.index}) failed: "
            f"{first_line(exc)}"
        )

    def result(self) -> None:
        waited = time.perf_counter()
        try:
            self.work.wait(self.rt.timeout)
        except RuntimeError as exc:
            raise self._error(exc) from None
        done = time.perf_counter()
        self.rt.comm.add(0, done - waited)
        if self.rt.timeline is not None:
            self.rt.timeline.add("reduce", "comm", self.started, done, bucket=self.bucket.index)


class GradientReducer:
    """The long-lived state of one DistributedOptimizer: buckets, hooks, in-flight reductions."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        algorithm: str,
        op: Op,
        fusion_mb: float,
        compression: Compressor,
        backward_passes_per_step: int,
        on_nonfinite: OnNonfinite,
        predivide: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rt = get_runtime()
        self.predivide = predivide
        """Gradients are divided by this before the sum and the average's divisor after it."""
        self.replicas = self.rt.dp.size if group is None else dist.get_world_size(group)
        """The replicas this optimizer averages over: the data-parallel axis, or `group`'s."""
        self.params = params
        self.algorithm = algorithm
        self.op = op
        self.compressor = None if isinstance(compression, NoCompression) else compression
        """None: buckets travel as they are (the backend's async allreduce for native)."""
        self.passes_per_step = backward_passes_per_step
        self.on_nonfinite = on_nonfinite
        self.buckets = plan_buckets(params, int(fusion_mb * (1 << 20)))
        own = self._own_group() if group is None else group
        self._group = weakref.ref(own) if own is not None else None  # the runtime owns it
        self.states: list[State] = [
            compression.new_state(b.grad_numel, [tuple(p.shape) for _, p in b.params])
            for b in self.buckets
        ]
        """Each bucket's compressor state (error-feedback residual, PowerSGD's Q)."""
        self.where = {id(p): (b, j) for b in self.buckets for j, (_, p) in enumerate(b.params)}
        self.counts = [0] * len(params)
        self.index = {id(p): i for i, (_, p) in enumerate(params)}
        self.futures: list[Future[None] | NativeWork | None] = [None] * len(self.buckets)
        self.next_launch = 0
        self.passes = 0
        self.in_backward = False
        self.backward_started = 0.0
        self.checked = False
        self.steps = 0
        self.skipped_steps = 0
        self.skip_sync = False
        self.synced = False
        self.also: list[GradientReducer] = []
        """Reducers of other parameters of the same optimizer (a hybrid plan's batch-sharded
        layers, over the batch group), synchronized and reset with this one."""
        for _, p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def state_dict(self) -> dict[str, Any]:
        """Step counters and each bucket's compressor state (residuals), for a checkpoint."""
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "compressor": save_states({str(i): s for i, s in enumerate(self.states)}),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        load_states({str(i): s for i, s in enumerate(self.states)}, saved["compressor"])
        self.steps, self.skipped_steps = int(saved["steps"]), int(saved["skipped_steps"])

    @property
    def group(self) -> dist.ProcessGroup | None:
        """This optimizer's own group; an error once `gradmesh.shutdown()` freed it."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise GradmeshError(
                f"rank {self.rt.rank}: DistributedOptimizer used after gradmesh.shutdown()"
            )
        return group

    def _own_group(self) -> dist.ProcessGroup | None:
        """A process group for this optimizer's buckets alone. Their layout is fixed and checked
        once, so every call on the group agrees by construction and needs no per-call check;
        and a rank that steps two optimizers in another order than its peers times out naming
        the optimizer instead of reducing one's buckets with the other's (Gloo aborts the
        process on such a size mismatch)."""
        return self.rt.new_group("DistributedOptimizer", "dp") if self.replicas > 1 else None

    # -- during backward -------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.backward_started = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        i = self.index[id(p)]
        self.counts[i] += 1
        if self.counts[i] == self.passes_per_step:
            bucket, j = self.where[id(p)]
            bucket.ready.add(j)
            self._launch_ready()

    def _end_of_backward(self) -> None:
        self.in_backward = False
        timeline = self.rt.timeline
        if timeline is not None and "backward" not in timeline.open:  # a user's own backward
            timeline.add("backward", "compute", self.backward_started, time.perf_counter())
        self.passes += 1
        if self.passes == self.passes_per_step:
            self._flush()

    def _flush(self) -> None:
        """Everything not yet sent goes now: parameters without a gradient count as zero."""
        for bucket in self.buckets:
            bucket.ready.update(range(len(bucket.params)))
        self._launch_ready()

    def _launch_ready(self, active: bool = True) -> None:
        if not self.checked and self.group is not None:  # before the first bucket, once
            check_models_agree(self.rt, self.params, self.group)
        self.checked = True
        # buckets leave in index order on every rank, whatever order their gradients came in
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].complete():
            bucket = self.buckets[self.next_launch]
            with span("pack", "comm", bucket=bucket.index):
                bucket.pack(active)
                if self.predivide != 1.0:
                    bucket.buffer[: bucket.grad_numel].div_(self.predivide)
            self.futures[bucket.index] = self._submit(bucket)
            self.next_launch += 1

    def _submit(self, bucket: Bucket) -> Future[None] | NativeWork:
        if self.replicas == 1:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        assert self.group is not None
        if self.compressor is not None:  # every algorithm, native too, through the compressor
            return self.rt.comm_executor().submit(self._reduce_compressed, bucket, self.compressor)
        # numbered here, in bucket order on the training thread, on every rank alike
        check = FixedLayout.post(self.rt, self.group, f"{self.algorithm} allreduce")
        if self.algorithm == "native":  # the backend's own asynchronous collective: no handoff
            return NativeWork(self.rt, bucket, check.label, self.group)
        return self.rt.comm_executor().submit(self._reduce, bucket, check)

    def _reduce(self, bucket: Bucket, check: FixedLayout) -> None:
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        with span("reduce", "comm", bucket=bucket.index, bytes=nbytes):
            allreduce(bucket.buffer, "sum", self.algorithm, self.group, check=check)

    def _reduce_compressed(self, bucket: Bucket, compressor: Compressor) -> None:
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        # a link per call: the optimizer holds its group only weakly (see `group`)
        link = Link(self.group, self.algorithm, "sync", fixed=True)
        with span("reduce", "comm", bucket=bucket.index, bytes=nbytes):
            grads = bucket.buffer[: bucket.grad_numel]
            reduce(grads, compressor, self.states[bucket.index], link)
            if bucket.has_flag:  # the count of ranks still training is summed exactly
                link.allreduce(bucket.buffer[bucket.grad_numel :])

    # -- at step ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every bucket of this step and write the averaged gradients back."""
        if self.synced:
            return
        if self.next_launch < len(self.buckets):  # no (or an unfinished) backward this step
            self._flush()
        self.unpack_all(self._wait_all() if self.replicas > 1 else 1.0)
        for other in self.also:
            other.synchronize()

    def nonfinite_parameter(self) -> str | None:
        """The first parameter whose reduced gradient has a NaN or Inf (the same on every rank)."""
        for bucket in self.buckets:
            # one cheap reduction per bucket; only a non-finite sum (NaN/Inf, or an overflow)
            # pays for the per-parameter search
            if not math.isfinite(float(bucket.buffer[: bucket.grad_numel].sum())):
                for name, p in bucket.params:
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                        return name
        return next((n for o in self.also if (n := o.nonfinite_parameter())), None)

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
        self.futures = [None] * len(self.buckets)
        self.counts = [0] * len(self.params)
        self.next_launch = 0
        self.passes = 0
        self.synced = False
        for other in self.also:
            other.reset()

    def join_round(self) -> float:
        """One step's reductions with zero gradients from this rank; returns how many ranks are
        still training (0 once every rank has joined). The buffers hold the reduced sums."""
        self.reset()
        if self.replicas == 1:
            return 0.0
        for bucket in self.buckets:
            bucket.ready.update(range(len(bucket.params)))
        self._launch_ready(active=False)
        return self._wait_all()

    def _wait_all(self) -> float:
        """Wait for every bucket of the step; returns the count of ranks still training."""
        for future in self.futures:
            assert future is not None
            future.result()
        return float(self.buckets[-1].buffer[-1])

    def unpack_all(self, active: float) -> None:
        divisor = max(active, 1.0) / self.predivide if self.op == "average" else 1.0
        for bucket in self.buckets:
            with span("unpack", "comm", bucket=bucket.index):
                bucket.unpack(divisor)
        self.synced = True


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class."""

    _gm: GradientReducer

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
        if gm.on_nonfinite != "pass" and (name := gm.nonfinite_parameter()) is not None:
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
                warnings.warn(
                    "step() after synchronize() outside skip_synchronize(): the gradients "
                    "synchronize() reduced are used; wrap step() in "
                    "optimizer.skip_synchronize() to say so",
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
        try:
            while (active := gm.join_round()) > 0:
                gm.unpack_all(active)
                self._apply()
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
) -> Optimizer:
    """Wrap `optimizer` so gradients are averaged over all ranks, overlapped with backward.

    `named_parameters` names the parameters (the same on every rank; each of the optimizer's
    parameters once); by default the optimizer's own order is used with generated names.
    `on_nonfinite`: "error" stops at a NaN or Inf in a reduced gradient, "skip" skips that step
    on every rank, "pass" steps on it as plain torch would. `gradient_predivide_factor` f
    (average only): gradients are divided by f before the sum and by size / f after it.
    `group`: average over this group's ranks (one the runtime made, such as a Horovod process
    set's, used by this optimizer alone) instead of the data-parallel axis.
    """
    ALGORITHMS.get(allreduce)  # fail early on an unknown algorithm name
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented in gradmesh; use Average or Sum")
    if op not in (Average, Sum):
        raise GradmeshError(f"unknown reduction op {op!r} (valid: average, sum)")
    if backward_passes_per_step < 1:
        raise GradmeshError(
            f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
        )
    if on_nonfinite not in ("error", "skip", "pass"):
        raise GradmeshError(f"unknown on_nonfinite {on_nonfinite!r} (valid: error, skip, pass)")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise GradmeshError("gradient_predivide_factor needs op=Average")
    if not gradient_predivide_factor > 0:
        raise GradmeshError(
            f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    named = (
        [(f"param.{i}", p) for i, p in enumerate(params)]
        if named_parameters is None
        else _check_named(list(named_parameters), params)
    )
    trainable = [(n, p) for n, p in named if p.requires_grad]
    batch = [(n, p) for n, p in trainable if getattr(p, BATCH_SHARDED, False)]
    reducer = GradientReducer(
        [(n, p) for n, p in trainable if not getattr(p, BATCH_SHARDED, False)],
        allreduce,
        op,
        fusion_mb,
        resolve(compression),
        backward_passes_per_step,
        on_nonfinite,
        gradient_predivide_factor,
        group,
    )
    if batch:  # their layers saw 1/tp of the replica's batch: averaged over dp x tp ranks
        if group is not None or reducer.rt.mesh["pp"].size > 1:
            raise GradmeshError("batch-sharded parameters need the mesh's dp group and pp 1")
        reducer.also.append(
            GradientReducer(
                batch,
                allreduce,
                op,
                fusion_mb,
                NoCompression(),
                backward_passes_per_step,
                on_nonfinite,
                gradient_predivide_factor,
                reducer.rt.new_group("hybrid batch"),
            )
        )
    wrapped = wrap_optimizer(optimizer, _DistributedMixin, _gm=reducer)
    wrapped._parameter_names = {p: n for n, p in named}  # type: ignore[attr-defined]  # Horovod's
    reducer.rt.joinable = cast(_DistributedMixin, wrapped).join  # what gradmesh.join() joins
    return wrapped


def _check_named(
    named: list[tuple[str, torch.nn.Parameter]], params: list[torch.nn.Parameter]
) -> list[tuple[str, torch.nn.Parameter]]:
    """The named parameters the optimizer updates, or one line: a repeated name, or an
    optimizer parameter it does not name (its gradient would never be averaged)."""
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        again = sorted({n for n in names if names.count(n) > 1})
        raise GradmeshError(f"named_parameters repeats the name(s) {', '.join(again)}")
    given = {id(p) for _, p in named}
    missing = sum(1 for p in params if id(p) not in given)
    if missing:
        raise GradmeshError(
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
