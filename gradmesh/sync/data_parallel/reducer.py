"""The gradient reducer behind `DistributedOptimizer`: fusion buckets reduced as backward fills
them, on the backend's asynchronous path (`native`) or the communication thread (gradmesh's own
algorithms, compression), with a join count riding along for uneven data."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from gradmesh.collectives import Op, allreduce
from gradmesh.collectives.agreement import FixedLayout
from gradmesh.compression.base import (
    Compressor,
    Link,
    NoCompression,
    State,
    load_states,
    save_states,
)
from gradmesh.compression.registry import reduce
from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import span
from gradmesh.runtime.axes import REPLICAS
from gradmesh.runtime.passes import defer
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.data_parallel.buckets import Bucket, NativeWork, check_models_agree, plan_buckets
from gradmesh.sync.data_parallel.sparse import SparseGradients
from gradmesh.sync.nonfinite import FINITE_AGAIN, NONFINITE_EVERY, DeferredFlag

Average: Op = "average"
Sum: Op = "sum"
Min: Op = "min"
Max: Op = "max"
Product: Op = "product"
Adasum = "adasum"
OnNonfinite = Literal["error", "skip", "pass"]


@dataclass(frozen=True)
class ReduceOptions:
    """How a `GradientReducer` averages: DistributedOptimizer's options."""

    algorithm: str
    op: Op
    fusion_mb: float
    backward_passes_per_step: int
    on_nonfinite: OnNonfinite
    predivide: float = 1.0


class GradientReducer:
    """The long-lived state of one DistributedOptimizer: buckets, hooks, in-flight reductions."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        options: ReduceOptions,
        compression: Compressor,
        group: dist.ProcessGroup | None = None,
        keep_sparse: bool = False,
    ) -> None:
        algorithm, op, fusion_mb = options.algorithm, options.op, options.fusion_mb
        backward_passes_per_step, on_nonfinite = (
            options.backward_passes_per_step,
            options.on_nonfinite,
        )
        predivide = options.predivide
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
        own = self._own_group() if group is None else group
        self._group = weakref.ref(own) if own is not None else None  # the runtime owns it
        self.fusion_bytes, self.codec = int(fusion_mb * (1 << 20)), compression
        self._plan(params)
        self.sparse = SparseGradients(params) if keep_sparse else None
        """Sparse gradients kept sparse (else densified into the buckets)."""
        self.counts = [0] * len(params)
        self.index = {id(p): i for i, (_, p) in enumerate(params)}
        self.next_launch = 0
        self.passes = 0
        self.in_backward = False
        self.backward_started = 0.0
        self.checked = False
        self.steps = 0
        self.skipped_steps = 0
        self.defer_nonfinite = self.rt.device.type == "cuda"
        """The "error" check reads its flag every `NONFINITE_EVERY` steps, not every step."""
        self.nonfinite = DeferredFlag()
        """The deferred check's flag: whether a step since the last read was not finite."""
        self.skip_sync = False
        self.synced = False
        self.announce: Callable[[], Future[Any]] | None = None
        """Called before a step's first reduction leaves on a rank that trains (Horovod's join
        learns from it that a step follows); its future is checked at `synchronize`."""
        self.announced: Future[Any] | None = None
        self.average_all = False
        """Averages divide by all replicas, joined ones too (the drop-in), not the active ones."""
        self.also: list[GradientReducer] = []
        """Reducers of other parameters of the same optimizer (a hybrid plan's batch-sharded
        layers, over the batch group), synchronized and reset with this one."""
        if self.replicas > 1:  # alone, nothing overlaps: the step packs every bucket at once
            for _, p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def _plan(self, params: list[tuple[str, nn.Parameter]]) -> None:
        """Buckets for `params` (the parameters whose gradients travel dense)."""
        self.buckets = plan_buckets(params, self.fusion_bytes)
        self.states: list[State] = [
            self.codec.new_state(b.grad_numel, [tuple(p.shape) for _, p in b.params])
            for b in self.buckets
        ]
        """Each bucket's compressor state (error-feedback residual, PowerSGD's Q)."""
        self.where = {id(p): (b, j) for b in self.buckets for j, (_, p) in enumerate(b.params)}
        self.futures: list[Future[None] | NativeWork | None] = [None] * len(self.buckets)

    def state_dict(self) -> dict[str, Any]:
        """Step counters and each bucket's compressor state (residuals), for a checkpoint; never
        of weights a deferred non-finite check has not cleared."""
        if (name := self.seen_nonfinite()) is not None:
            raise GradmeshError(
                f"rank {self.rt.rank}: step {self.steps}: non-finite gradient in parameter "
                f"{name!r}, found before a checkpoint (--on-nonfinite skip skips such steps)"
            )
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
        if self.replicas == 1:
            return None
        return self.rt.new_group("DistributedOptimizer", self.rt.mesh.shape.spanned(REPLICAS))

    # -- during backward -------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.backward_started = time.perf_counter()
            if not defer(self._end_of_backward):  # a zero-bubble W's runs: once, at its end
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        i = self.index[id(p)]
        self.counts[i] += 1
        if self.counts[i] == self.passes_per_step and id(p) in self.where:  # else sent sparse
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
        if active and self.announce is not None and self.announced is None:
            self.announced = self.announce()  # before any collective of the step
        if not self.checked and self.group is not None:  # before the first bucket, once
            check_models_agree(self.rt, self.params, self.group)
        self.checked = True
        # buckets leave in index order on every rank, whatever order their gradients came in
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].complete():
            bucket = self.buckets[self.next_launch]
            if self.sparse is not None and not self.sparse.decided:  # the first step
                self.sparse.designate(bucket, active, self.group if self.replicas > 1 else None)
                if bucket.skip:  # remade without them, in its place
                    bucket = self.buckets[bucket.index] = bucket.without_skipped()
                    shapes = [tuple(p.shape) for _, p in bucket.params]
                    self.states[bucket.index] = self.codec.new_state(bucket.grad_numel, shapes)
            with span("pack", "comm", bucket=bucket.index):
                bucket.pack(active)
                if self.predivide != 1.0:
                    bucket.buffer[: bucket.grad_numel].div_(self.predivide)
            self.futures[bucket.index] = self._submit(bucket)
            self.next_launch += 1

    def _submit(self, bucket: Bucket) -> Future[None] | NativeWork:
        if self.replicas == 1 or not bucket.buffer.numel():
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
        if self.announced is not None:
            self.announced.result()  # a peer's different operation: said before the wait
        self.unpack_all(self._wait_all() if self.replicas > 1 else 1.0)
        for other in self.also:
            other.synchronize()

    def watch_nonfinite(self) -> str | None:
        """The "error" check where reading a value stalls the device (CUDA): whether this
        step's reduced gradients are finite is folded into a flag on the device, read every
        `NONFINITE_EVERY` steps and before a checkpoint (`state_dict`); the parameter named is
        the first non-finite one at that read. None until then, and while all were finite."""
        self.nonfinite.fold([b.buffer[: b.grad_numel].sum() for b in self.buckets if b.grad_numel])
        return None if self.steps % NONFINITE_EVERY else self.seen_nonfinite()

    def seen_nonfinite(self) -> str | None:
        """Read (and clear) the deferred flag: the parameter to name when a step since the last
        read had a non-finite gradient, else None."""
        if not self.nonfinite.take():
            return None
        return self.nonfinite_parameter() or FINITE_AGAIN

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
        self.announced = None
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
        return float(self._wait_all())  # a joined rank's loop reads it: when every rank joined

    def _wait_all(self) -> torch.Tensor:
        """Wait for every bucket of the step; returns the count of ranks still training, left
        on the device (the steady step divides by it there, never reading it)."""
        for future in self.futures:
            assert future is not None
            future.result()
        return self.buckets[-1].buffer[-1]

    def unpack_all(self, active: float | torch.Tensor, mine: bool = True) -> None:
        """Write the reduced gradients back (`mine` False on a rank that has joined); sparse
        ones kept sparse are reduced now, after the buckets."""
        group = self.group if self.replicas > 1 else None
        found = self.sparse is not None and not self.sparse.decided and self.sparse.settle()
        if self.average_all:
            active = float(self.replicas)
        average: float | torch.Tensor = 1.0
        if self.op == "average":
            average = (
                active.clamp(min=1.0) if isinstance(active, torch.Tensor) else max(active, 1.0)
            )
        for bucket in self.buckets:
            with span("unpack", "comm", bucket=bucket.index):
                bucket.unpack(average / self.predivide if self.op == "average" else 1.0)
        if self.sparse is not None and group is not None:
            with span("sparse", "comm"):
                self.sparse.reduce(mine, float(average), group)  # sparse ones: on the host
        if found:  # from the next step on, the sparse parameters leave the buckets
            assert self.sparse is not None
            self._plan(self.sparse.dense)
        self.synced = True
