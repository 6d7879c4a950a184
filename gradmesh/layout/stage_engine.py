"""The engine of one pipeline stage: `step` runs the schedule (`schedule_actions`) over a
replica's micro-batches, `predict` runs forwards only; only the last stage sees the loss and
the logits (see `gradmesh.layout.pipeline` for the schedules and the bubble).

What crosses between two stages is a list of tensors: one activation for a sequence of layers,
several for a model cut on its graph (a transformer's residual stream with its rotary
embeddings and attention mask). `Boundary` describes them for a micro-batch of a given size:
each tensor's whole shape (not every tensor has the batch first), dtype, and whether a gradient
travels back for it. Every rank knows every boundary from a dry run of the whole model, so
nothing is described on the wire. Tensor j of micro-batch i travels with tag
`(2 i + d) * MAX_VALUES + j` (d: 0 forward, 1 backward).

Receives are posted ahead of need (the next micro-batch's inputs while this one computes; an
output's gradient as soon as the output is sent): Gloo moves a message only once its receive is
posted, so a receive posted late puts a round trip between neighbours on the pipeline's critical
path at every hop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives.channel import Channel
from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline import BubbleClock, LossFn, schedule_actions, sum_cross_entropy
from gradmesh.observe.timeline import span
from gradmesh.runtime.world import Runtime

Boundary = list[tuple[torch.Size, torch.dtype, bool]]
"""The tensors entering a stage for one micro-batch: (shape, dtype, whether a gradient goes
back for it)."""
MAX_VALUES = 64
"""The most tensors a cut can carry (they share a micro-batch's range of tags)."""


def _tag(i: int, backward: bool, j: int) -> int:
    return (2 * i + int(backward)) * MAX_VALUES + j


def as_values(out: Any) -> list[torch.Tensor]:
    values = list(out) if isinstance(out, tuple | list) else [out]
    if not all(isinstance(v, torch.Tensor) for v in values) or len(values) > MAX_VALUES:
        raise GradmeshError(
            f"a pipeline stage's output must be up to {MAX_VALUES} tensors, got "
            + ", ".join(type(v).__name__ for v in values)
        )
    return values


class PipelineEngine:
    """One stage of a pipeline: `module` runs on the values `inputs_of(n)` describes (a
    micro-batch of n samples; the first stage takes the batch itself)."""

    def __init__(
        self,
        rt: Runtime,
        module: Callable[..., Any],
        inputs_of: Callable[[int], Boundary],
        microbatches: int,
        schedule: str,
        loss_fn: LossFn = sum_cross_entropy,
    ) -> None:
        axis = rt.mesh["pp"]
        self.rt, self.module, self.loss_fn = rt, module, loss_fn
        self.inputs_of = inputs_of
        self.stage, self.stages = axis.index, axis.size
        self.group = axis.group
        self.m, self.schedule = microbatches, schedule
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.clock = BubbleClock()
        self.steps = 0

    def _channel(self, what: str) -> Channel:
        return Channel(
            self.rt, self.group, f"pipeline stage {self.stage} {what} (step {self.steps})"
        )

    def _post_inputs(self, ch: Channel, i: int, n: int) -> list[tuple[torch.Tensor, dist.Work]]:
        """Buffers for micro-batch `i`'s inputs (`n` samples) and their receives, posted now."""
        posted = []
        for j, (shape, dtype, _) in enumerate(self.inputs_of(n)):
            buf = torch.empty(shape, dtype=dtype, device=self.rt.device)
            posted.append((buf, ch.irecv(buf, self.stage - 1, tag=_tag(i, False, j))))
        return posted

    def _received(
        self, ch: Channel, posted: list[tuple[torch.Tensor, dist.Work]], peer: int
    ) -> list[torch.Tensor]:
        for _, work in posted:
            ch.wait(work, peer, "receive from")
        return [buf for buf, _ in posted]

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch of (x, y); the loss (summed over samples,
        times `scale`, before scaling) on the last stage, zero elsewhere."""
        self.steps += 1
        xs, ys = x.tensor_split(self.m), y.tensor_split(self.m)
        sizes = [len(part) for part in ys]
        inputs: dict[int, list[torch.Tensor]] = {}
        outputs: dict[int, list[torch.Tensor]] = {}
        posted: dict[tuple[str, int], list[tuple[torch.Tensor, dist.Work]]] = {}
        losses = torch.zeros((), dtype=torch.float64)
        sends: list[tuple[dist.Work, int]] = []  # waited for at the end of the step
        started, busy = time.perf_counter(), 0.0
        ch = self._channel("forward/backward")
        up, down = self.stage - 1, self.stage + 1

        def post_input(i: int) -> None:
            if not self.first and i < self.m and sizes[i] and ("F", i) not in posted:
                posted["F", i] = self._post_inputs(ch, i, sizes[i])

        for action, i in schedule_actions(self.schedule, self.stage, self.stages, self.m):
            if sizes[i] == 0:
                continue
            if action == "F":
                post_input(i)
                post_input(i + 1)
                ins = [xs[i]] if self.first else self._received(ch, posted.pop(("F", i)), up)
                if not self.first:
                    for v, (_, _, grad) in zip(ins, self.inputs_of(sizes[i]), strict=True):
                        v.requires_grad_(grad)
                t0 = time.perf_counter()
                with span("forward", microbatch=i):
                    outs = as_values(self.module(*ins))
                    if self.last:
                        loss = self.loss_fn(outs[0], ys[i])
                        losses += loss.detach().double()
                        outs = [loss * scale]
                busy += time.perf_counter() - t0
                inputs[i], outputs[i] = ins, outs
                if not self.last:
                    back = []
                    for j, v in enumerate(outs):
                        sends.append((ch.isend(v.detach(), down, tag=_tag(i, False, j)), down))
                        if v.requires_grad:
                            buf = torch.empty(v.shape, dtype=v.dtype, device=self.rt.device)
                            back.append((buf, ch.irecv(buf, down, tag=_tag(i, True, j))))
                    posted["B", i] = back
            else:
                outs = [v for v in outputs.pop(i) if v.requires_grad]
                grads = None if self.last else self._received(ch, posted.pop(("B", i)), down)
                t0 = time.perf_counter()
                with span("backward", microbatch=i):
                    torch.autograd.backward(outs, grads)
                busy += time.perf_counter() - t0
                ins = inputs.pop(i)
                if not self.first:
                    for j, v in enumerate(ins):
                        if v.requires_grad:
                            g = v.grad if v.grad is not None else torch.zeros_like(v)
                            sends.append((ch.isend(g, up, tag=_tag(i, True, j)), up))
        for work, peer in sends:
            ch.wait(work, peer, "send to")
        self.clock.step_s += time.perf_counter() - started
        self.clock.busy_s += busy
        self.rt.comm.add(ch.sent, 0.0, "pipeline")
        return losses

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits of `x` on the last stage (None on the others), forward only."""
        ch = self._channel("evaluation")
        out = None
        pending = []
        parts = [(i, part) for i, part in enumerate(x.tensor_split(self.m)) if len(part)]
        posted = {}  # every receive up front (see the module's docstring)
        if not self.first:
            for i, part in parts:
                posted[i] = self._post_inputs(ch, i, len(part))
        for i, part in parts:
            ins = [part] if self.first else self._received(ch, posted.pop(i), self.stage - 1)
            result = as_values(self.module(*ins))
            if self.last:
                out = result[0] if out is None else torch.cat([out, result[0]])
            else:
                for j, v in enumerate(result):
                    pending.append(ch.isend(v, self.stage + 1, tag=_tag(i, False, j)))
        for work in pending:
            ch.wait(work, self.stage + 1, "send to")
        self.rt.comm.add(ch.sent, 0.0, "pipeline")
        return out


def single_input(per_sample: torch.Size, dtype: torch.dtype | None) -> Callable[[int], Boundary]:
    """A sequence of layers' boundary: one activation, batch first, its gradient sent back."""
    kind = dtype or torch.get_default_dtype()
    return lambda n: [(torch.Size((n, *per_sample)), kind, True)]
