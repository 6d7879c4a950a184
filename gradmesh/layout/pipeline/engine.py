"""The engine of one pipeline stage: `step` runs the schedule (`schedule_actions`) over a
replica's micro-batches, `predict` runs forwards only; only the last stage sees the loss and
the logits (see `gradmesh.layout.pipeline.schedules` for the schedules and the bubble).

What crosses between two stages is a list of tensors: one activation for a sequence of layers,
several for a model cut on its graph (a transformer's residual stream with its rotary
embeddings and attention mask). `Boundary` describes them for a micro-batch of a given size:
each tensor's whole shape (not every tensor has the batch first), dtype, and whether a gradient
travels back for it. Every rank knows every boundary from a dry run of the whole model, so
nothing is described on the wire. Tensor j entering pipeline stage g for micro-batch i travels
with tag `((2 i + d) * G + g) * MAX_VALUES + j` (d: 0 forward, 1 backward; G stages in all),
so that under the interleaved schedule, where a rank holds several stages and two neighbours
exchange messages for several of them, no two messages share a tag.

Under a V-shaped schedule (`zbv`) a rank holds two neighbouring stages (p - 1 and p on rank
p - 1): what crosses between them stays on the rank (`_Step.local`), no message. Under the
zero-bubble schedules a backward is two actions: B (`split.backward_input`) sends the input's
gradient upstream at once, W (`WeightWork.run`) computes the weights' gradients when the
schedule says.

Receives are posted ahead of need (the next micro-batch's inputs while this one computes; an
output's gradient as soon as the output is sent): Gloo moves a message only once its receive is
posted, so a receive posted late puts a round trip between neighbours on the pipeline's critical
path at every hop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import gradmesh.data.batch as batch
from gradmesh.collectives.channel import Channel
from gradmesh.data.batch import Batch
from gradmesh.errors import GradmeshError
from gradmesh.layout.loss import LossFn, logits_of, summed
from gradmesh.layout.pipeline.order import rank_of, schedule_actions, stage_of
from gradmesh.layout.pipeline.schedules import BubbleClock
from gradmesh.layout.pipeline.split import WeightWork, backward_input
from gradmesh.layout.pipeline.zero_bubble import SPLIT
from gradmesh.observe.timeline import span
from gradmesh.runtime.axes import PP
from gradmesh.runtime.passes import one_backward
from gradmesh.runtime.world import Runtime

Boundary = list[tuple[torch.Size, torch.dtype, bool]]
"""The tensors entering a stage for one micro-batch: (shape, dtype, whether a gradient goes
back for it)."""
MAX_VALUES = 64
"""The most tensors a cut can carry (they share a micro-batch's range of tags)."""


def as_values(out: Any) -> list[torch.Tensor]:
    values = list(out) if isinstance(out, tuple | list) else [out]
    if not all(isinstance(v, torch.Tensor) for v in values) or len(values) > MAX_VALUES:
        raise GradmeshError(
            f"a pipeline stage's output must be up to {MAX_VALUES} tensors, got "
            + ", ".join(type(v).__name__ for v in values)
        )
    return values


@dataclass
class _Step:
    """One step's state on a stage: what each (chunk, micro-batch) took in and gave out, the
    receives posted ahead, the sends to wait for at the end, the loss and the compute time."""

    xs: list[Batch]
    ys: list[Batch]
    scale: float | torch.Tensor
    ch: Channel
    losses: torch.Tensor
    """The micro-batches' loss sum (float64, on the stage's device)."""
    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    posted: dict[tuple[str, int, int], list[tuple[torch.Tensor, dist.Work]]] = field(
        default_factory=dict
    )
    sends: list[tuple[dist.Work, int]] = field(default_factory=list)
    busy: float = 0.0
    local: dict[tuple[str, int, int], list[torch.Tensor]] = field(default_factory=dict)
    """What one of this rank's stages hands the next (or the one before) on the same rank:
    ('F', stage entered, micro-batch) -> activations, ('B', stage left, micro-batch) -> the
    gradients of what it sent."""
    weights: dict[tuple[int, int], WeightWork] = field(default_factory=dict)
    """(chunk, micro-batch) -> the W its B left."""


class PipelineEngine:
    """This rank's chunks of a pipeline: `modules[c]` is stage c * p + s of the whole pipeline
    (p ranks on the pp axis, s this rank's index; one chunk but under the interleaved schedule)
    and runs on the values `inputs_of(stage, n)` describes for a micro-batch of n samples (the
    pipeline's first stage takes the batch itself)."""

    def __init__(
        self,
        rt: Runtime,
        modules: list[Callable[..., Any]],
        inputs_of: Callable[[int, int], Boundary],
        microbatches: int,
        schedule: str,
        loss_fn: LossFn | None = None,
    ) -> None:
        axis = rt.mesh[PP]
        self.rt, self.modules, self.loss_fn = rt, modules, summed(loss_fn)
        self.output_of: Callable[[list[torch.Tensor]], Any] = lambda values: values[0]
        """The model's output from the last stage's values (what the loss is given)."""
        self.inputs_of = inputs_of
        self.stage, self.stages = axis.index, axis.size
        self.depth = self.stages * len(modules)
        """Stages of the whole pipeline."""
        self.group = axis.group
        self.m, self.schedule = microbatches, schedule
        self.clock = BubbleClock()
        self.steps = 0
        self.half: torch.dtype | None = None
        """Stages run under this autocast; what crosses a stage boundary keeps the dtype the
        next stage expects (the weights', fp32), so gradients come back in it too."""

    def _autocast(self) -> Any:
        return forward_precision(self.half, self.rt.device.type)

    def _boundary(self, g: int, n: int, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stage `g`'s outputs in the dtypes stage g + 1 receives (a differentiable cast)."""
        if self.half is None or g == self.depth - 1:
            return outs
        wanted = self.inputs_of(g + 1, n)
        return [v.to(dtype) for v, (_, dtype, _) in zip(outs, wanted, strict=True)]

    @property
    def backward_passes(self) -> int:
        """Backward calls per `step`: one per micro-batch and chunk (give it to
        `DistributedOptimizer(backward_passes_per_step=...)` when there are replicas)."""
        return self.m * len(self.modules)

    def _global(self, chunk: int) -> int:
        return stage_of(self.schedule, chunk, self.stage, self.stages)

    def _rank(self, stage: int) -> int:
        """The pp rank holding pipeline stage `stage`."""
        return rank_of(self.schedule, stage, self.stages)

    def _tag(self, i: int, backward: bool, stage: int, j: int) -> int:
        """Tensor j entering pipeline stage `stage` (or its gradient) for micro-batch i."""
        return ((2 * i + int(backward)) * self.depth + stage) * MAX_VALUES + j

    def _channel(self, what: str) -> Channel:
        return Channel(
            self.rt, self.group, f"pipeline stage {self.stage} {what} (step {self.steps})"
        )

    def _post_inputs(
        self, ch: Channel, stage: int, i: int, n: int
    ) -> list[tuple[torch.Tensor, dist.Work]]:
        """Buffers for micro-batch `i`'s inputs (`n` samples) to pipeline stage `stage`, and their
        receives, posted now."""
        posted = []
        for j, (shape, dtype, _) in enumerate(self.inputs_of(stage, n)):
            buf = torch.empty(shape, dtype=dtype, device=self.rt.device)
            tag = self._tag(i, False, stage, j)
            posted.append((buf, ch.irecv(buf, self._rank(stage - 1), tag=tag)))
        return posted

    def _received(
        self, ch: Channel, posted: list[tuple[torch.Tensor, dist.Work]], peer: int
    ) -> list[torch.Tensor]:
        for _, work in posted:
            ch.wait(work, peer, "receive from")
        return [buf for buf, _ in posted]

    def step(self, x: Batch, y: Batch, scale: float | torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of (x, y) (tensors, or tuples or dicts of
        them: `gradmesh.data.batch`); the loss (summed over samples, times `scale`, before
        scaling) on the last stage, zero elsewhere."""
        self.steps += 1
        xs, ys = batch.split(x, self.m), batch.split(y, self.m)
        total = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        st = _Step(xs, ys, scale, self._channel("forward/backward"), total)
        sizes = [batch.size(part) for part in st.ys]
        plan = schedule_actions(self.schedule, self.stage, self.stages, self.m, len(self.modules))
        actions = [(a, c, i) for a, c, i in plan if sizes[i]]
        forwards = [(c, i) for a, c, i in actions if a == "F"]
        started = time.perf_counter()

        def post_input(k: int) -> None:  # the k-th forward's inputs, unless posted already
            if k < len(forwards):
                c, i = forwards[k]
                g = self._global(c)
                if g and self._rank(g - 1) != self.stage and ("F", c, i) not in st.posted:
                    st.posted["F", c, i] = self._post_inputs(st.ch, g, i, sizes[i])

        k = 0
        for action, c, i in actions:
            if action == "F":
                post_input(k)
                post_input(k + 1)
                k += 1
                self._forward(st, c, i)
            elif action == "B":
                self._backward(st, c, i)
            else:
                t0 = time.perf_counter()
                with span("weights", microbatch=i), one_backward():
                    st.weights.pop((c, i)).run()
                st.busy += time.perf_counter() - t0
        for work, peer in st.sends:
            st.ch.wait(work, peer, "send to")
        self.clock.step_s += time.perf_counter() - started
        self.clock.busy_s += st.busy
        self.rt.comm.add(st.ch.sent, 0.0, "pipeline")
        return st.losses

    def _forward(self, st: _Step, c: int, i: int) -> None:
        g = self._global(c)
        ins: list[torch.Tensor] = []  # what came from the stage before (the batch: nothing)
        if g and self._rank(g - 1) == self.stage:
            ins = st.local.pop(("F", g, i))
        elif g:
            ins = self._received(st.ch, st.posted.pop(("F", c, i)), self._rank(g - 1))
        for v, (_, _, grad) in zip(
            ins, self.inputs_of(g, batch.size(st.ys[i])) if g else [], strict=True
        ):
            v.requires_grad_(grad)
        t0 = time.perf_counter()
        with span("forward", microbatch=i), self._autocast():
            outs = as_values(_run_stage(self.modules[c], g, ins, st.xs[i]))
            outs = self._boundary(g, batch.size(st.ys[i]), outs)
            if g == self.depth - 1:
                loss = self.loss_fn(self.output_of(outs), st.ys[i]).float()
                st.losses += loss.detach().double()
                outs = [loss * st.scale]
        st.busy += time.perf_counter() - t0
        st.inputs[c, i], st.outputs[c, i] = ins, outs
        down = self._rank(g + 1) if g < self.depth - 1 else None
        if down == self.stage:
            st.local["F", g + 1, i] = [v.detach() for v in outs]
        elif down is not None:
            back = []
            for j, v in enumerate(outs):
                tag = self._tag(i, False, g + 1, j)
                st.sends.append((st.ch.isend(v.detach(), down, tag=tag), down))
                if v.requires_grad:
                    buf = torch.empty(v.shape, dtype=v.dtype, device=self.rt.device)
                    tag = self._tag(i, True, g + 1, j)
                    back.append((buf, st.ch.irecv(buf, down, tag=tag)))
            st.posted["B", c, i] = back

    def _backward(self, st: _Step, c: int, i: int) -> None:
        """B: the gradients of the stage's inputs, sent to the stage before at once; under a
        schedule that does not split backward, the weights' too."""
        g = self._global(c)
        outputs = st.outputs.pop((c, i))
        outs = [v for v in outputs if v.requires_grad]
        grads = self._output_grads(st, c, g, i)
        ins = st.inputs.pop((c, i))
        t0 = time.perf_counter()
        with span("backward", microbatch=i):
            if self.schedule in SPLIT:
                found, st.weights[c, i] = backward_input(outs, grads, ins)
            else:
                torch.autograd.backward(outs, grads)
                found = [v.grad for v in ins]
        st.busy += time.perf_counter() - t0
        if not g:
            return
        sent = [
            grad if grad is not None else torch.zeros_like(v)
            for v, grad in zip(ins, found, strict=True)
            if v.requires_grad
        ]
        up = self._rank(g - 1)
        if up == self.stage:
            st.local["B", g - 1, i] = sent
            return
        for j, grad in zip([j for j, v in enumerate(ins) if v.requires_grad], sent, strict=True):
            st.sends.append((st.ch.isend(grad, up, tag=self._tag(i, True, g, j)), up))

    def _output_grads(self, st: _Step, c: int, g: int, i: int) -> list[torch.Tensor] | None:
        """The gradients of stage `g`'s (chunk `c`'s) outputs that take one (None: the loss,
        on the last)."""
        if g == self.depth - 1:
            return None
        if self._rank(g + 1) == self.stage:
            return st.local.pop(("B", g, i))
        return self._received(st.ch, st.posted.pop(("B", c, i)), self._rank(g + 1))

    @torch.no_grad()
    def predict(self, x: Batch) -> torch.Tensor | None:
        """The logits of `x` on the rank holding the last stage (None on the others), forward
        only: every chunk in turn runs every micro-batch."""
        ch = self._channel("evaluation")
        out = None
        pending = []
        parts = [(i, part) for i, part in enumerate(batch.split(x, self.m)) if batch.size(part)]
        posted = {}  # every receive up front (see the module's docstring)
        local: dict[tuple[int, int], list[torch.Tensor]] = {}  # a V's turn on this rank
        for c in range(len(self.modules)):
            g = self._global(c)
            if g and self._rank(g - 1) != self.stage:
                for i, part in parts:
                    posted[c, i] = self._post_inputs(ch, g, i, batch.size(part))
        for c, module in enumerate(self.modules):
            g = self._global(c)
            for i, part in parts:
                if (g, i) in local:
                    ins = local.pop((g, i))
                else:
                    ins = self._received(ch, posted.pop((c, i)), self._rank(g - 1)) if g else []
                with self._autocast():
                    result = as_values(_run_stage(module, g, ins, part))
                result = self._boundary(g, batch.size(part), result)
                if g == self.depth - 1:
                    logits = logits_of(self.output_of(result))
                    out = logits if out is None else torch.cat([out, logits])
                elif self._rank(g + 1) == self.stage:
                    local[g + 1, i] = result
                else:
                    for j, v in enumerate(result):
                        tag = self._tag(i, False, g + 1, j)
                        pending.append((ch.isend(v, self._rank(g + 1), tag=tag), self._rank(g + 1)))
        for work, peer in pending:
            ch.wait(work, peer, "send to")
        self.rt.comm.add(ch.sent, 0.0, "pipeline")
        return out


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The autocast dtype of each `--precision` that has one (fp8's products are its converted
linear layers' own, `gradmesh.layout.fp8`; the rest of its forward runs as bf16's)."""


def forward_precision(half: torch.dtype | None, device_type: str) -> Any:
    """The context a forward runs in: autocast to `half`, or nothing."""
    if half is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=half)


def _run_stage(module: Callable[..., Any], g: int, ins: list[torch.Tensor], part: Batch) -> Any:
    """Pipeline stage `g` on what its cut carried (`ins`): a graph stage (`takes_batch`) also
    gets its micro-batch, the first stage of a layer sequence gets the micro-batch alone."""
    if getattr(module, "takes_batch", False):
        return module(ins, part)
    return batch.call(module, part) if g == 0 else module(*ins)


def single_input(
    per_sample: list[torch.Size], dtype: torch.dtype | None
) -> Callable[[int, int], Boundary]:
    """A sequence of layers' boundaries: one activation entering each stage (`per_sample[s]`
    per sample), batch first, its gradient sent back."""
    kind = dtype or torch.get_default_dtype()
    return lambda stage, n: [(torch.Size((n, *per_sample[stage])), kind, True)]
