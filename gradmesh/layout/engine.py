"""The step engine and the layout's order: `split_model` splits one replica over the mesh (tensor
parallelism, then pipeline stages, or a hybrid plan's placement per layer) and returns this
rank's part with the engine that runs it: `PlainEngine` (forward, backward) or the pipeline's."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch
from gradmesh.errors import GradmeshError
from gradmesh.layout.config import (
    SCHEDULES,
    check_interleaved,
    check_sequence_parallel,
)
from gradmesh.layout.loss import LossFn, logits_of, summed
from gradmesh.layout.pipeline.engine import HALF, PipelineEngine, forward_precision, single_input
from gradmesh.layout.pipeline.graph import candidates, check_points
from gradmesh.layout.pipeline.schedules import (
    cut_stages,
    layers_of,
    parse_stages,
    sample_shapes,
    stage_module,
)
from gradmesh.layout.pipeline.stages import graph_pipeline
from gradmesh.layout.tensor.hybrid import Plan, apply_plan
from gradmesh.layout.tensor.plan import apply_tp_plan, check_plan
from gradmesh.models.registry import TP_PLANS
from gradmesh.observe.timeline import span
from gradmesh.runtime.axes import PP, TP
from gradmesh.runtime.world import Runtime


class Engine(Protocol):
    """What the training loop and evaluation call instead of `model(x)` / `backward()`."""

    def step(self, x: Batch, y: Batch, scale: float) -> torch.Tensor:
        """Forward and backward of (x, y) (each a tensor, or a tuple or dict of tensors:
        `gradmesh.data.batch`), the loss scaled by `scale` before backward; returns the
        unscaled loss summed over the samples (zero on ranks that do not see it)."""
        ...

    def predict(self, x: Batch) -> torch.Tensor | None:
        """Logits of `x` (None on ranks that do not produce them)."""
        ...

    @property
    def backward_passes(self) -> int:
        """Backward calls per `step` (a data-parallel optimizer reduces after the last)."""
        ...


class PlainEngine:
    """The whole replica on this rank (or its tensor-parallel slice): one forward, one backward
    per micro-batch (more than one: an elastic job's gradient accumulation). With `half` (bf16
    or fp16), each forward and its loss run under autocast (matmuls and convolutions in it);
    weights, gradients, the optimizer's state and every reduction stay fp32, and backward runs
    outside autocast, as torch advises."""

    def __init__(
        self,
        module: nn.Module,
        microbatches: int = 1,
        loss_fn: LossFn | None = None,
        half: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.microbatches = microbatches
        self.loss_fn = summed(loss_fn)
        self.half = half
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.device_type = self.device.type

    def _forward(self) -> Any:
        return forward_precision(self.half, self.device_type)

    @property
    def backward_passes(self) -> int:
        return self.microbatches

    def step(self, x: Batch, y: Batch, scale: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        m = self.microbatches
        for xs, ys in zip(batch.split(x, m), batch.split(y, m), strict=True):
            with span("forward"), self._forward():
                loss = self.loss_fn(batch.call(self.module, xs), ys).float()
            with span("backward"):
                (loss * scale).backward()  # type: ignore[no-untyped-call]
            total += loss.detach().double()
        return total

    @torch.no_grad()
    def predict(self, x: Batch) -> torch.Tensor | None:
        with self._forward():
            return logits_of(batch.call(self.module, x)).float()


def tp_plan(
    model_name: str, model: nn.Module | None = None, sequence_parallel: bool = False
) -> dict[str, str]:
    """The model's tensor-parallel plan: registered with its name, or declared by the model
    itself (a `tp_plan` attribute, module name -> style, as `gradmesh.models.gpt.GPT`'s); with
    `sequence_parallel`, its `sp_plan` attribute (the plan with the sequence styles)."""
    if sequence_parallel:
        declared = getattr(model, "sp_plan", None)
        if isinstance(declared, dict):
            return declared
        raise GradmeshError(
            f"model {model_name} declares no sequence-parallel plan: give it an sp_plan "
            "attribute (its tp_plan with rowwise(seq) and sequence styles; docs/your_model.md)"
        )
    if model_name in TP_PLANS:
        return TP_PLANS.get(model_name)
    declared = getattr(model, "tp_plan", None)
    if isinstance(declared, dict):
        return declared
    raise GradmeshError(
        f"model {model_name} has no tensor-parallel plan: give it a tp_plan attribute (module "
        f"name -> colwise, rowwise, embedding, ...; see docs/your_model.md) or use one of "
        f"{', '.join(TP_PLANS.names())}"
    )


@dataclass
class Split:
    """This rank's part of the model and how to run it."""

    module: nn.Module
    engine: Engine
    info: dict[str, Any]
    """For the report: the layout, and the stage's layers under pipeline parallelism."""
    owns_output: bool
    """Whether this rank's loss and logits are the replica's (the last stage, tp index 0):
    the others' are not counted, so that sums over the world count each replica once."""


def check_layout(
    model: nn.Module,
    model_name: str,
    tp: int,
    pp: int,
    stages: str,
    chunks: int = 1,
    sequence_parallel: bool = False,
) -> None:
    """One line, before launch, unless this layout can split `model`: its plan fits `tp`, its
    layers make `pp` stages of `chunks` chunks each (the flags alone are checked by
    `TrainConfig.validate`)."""
    pp *= chunks
    if tp > 1:
        check_plan(model, tp_plan(model_name, model, sequence_parallel), tp, model_name)
    if pp > 1 and not isinstance(model, nn.Sequential):  # cut on the graph at module names
        if stages:
            check_points(model, stages.split(","), pp, model_name)
        elif len(candidates(model)) + 1 < pp:
            raise GradmeshError(
                f"a pipeline of {pp} stages: model {model_name} has {len(candidates(model)) + 1} "
                "blocks to cut into stages; give split points with --stages (module names)"
            )
    elif pp > 1:
        parse_stages(stages, layers_of(model, model_name), pp)


def split_model(
    model: nn.Module,
    model_name: str,
    rt: Runtime,
    microbatches: int,
    schedule: str,
    stages: str,
    sample: torch.Tensor,
    plan: Plan | None = None,
    loss_fn: LossFn | None = None,
    chunks: int = 1,
    precision: str = "fp32",
    sequence_parallel: bool = False,
) -> Split:
    """This rank's part of `model` under the runtime's mesh: tensor split, then pipeline cut
    (`chunks` stages per rank: more than one under the interleaved schedule), or a hybrid
    `plan`'s placement per layer. Collective over the world when stages are balanced (the layer
    times are averaged)."""
    tp, pp = rt.mesh[TP], rt.mesh[PP]
    _check_run(pp.size, microbatches, schedule, chunks, precision)
    check_sequence_parallel(sequence_parallel, tp.size, pp.size)
    piped = pp.size > 1
    info: dict[str, Any] = rt.mesh.shape.as_dict()
    info |= {"microbatches": microbatches if piped else 1, "schedule": schedule if piped else None}
    info |= {"chunks": chunks if piped else 1, "precision": precision}
    info["sequence_parallel"] = sequence_parallel
    half = HALF.get(precision)
    if plan is not None:  # every tp rank ends with the replica's logits: the first counts them
        info["plan"] = dict(plan.layers)
        module = apply_plan(model, plan, rt)
        return Split(module, PlainEngine(module, 1, loss_fn, half), info, tp.index == 0)
    if pp.size > 1 and not isinstance(model, nn.Sequential):  # split, then cut on the graph
        if tp.size > 1:
            model = apply_tp_plan(model, tp_plan(model_name, model), tp.size, tp.index, model_name)
        points = [p for p in stages.split(",") if p] or None
        graph = graph_pipeline(
            model, rt, sample, points, microbatches, schedule, loss_fn, model_name, chunks
        )
        info["stage_points"] = graph.graph.points
        graph.half = half
        owns = tp.index == 0 and pp.index == pp.size - 1
        return Split(graph.stage_module, graph, info, owns)
    depth = pp.size * chunks
    starts = cut_stages(model, model_name, depth, stages, sample[:1], rt) if pp.size > 1 else None
    module = model
    if tp.size > 1:  # checked here too: a script calling split_model skips check_layout
        plan_ = tp_plan(model_name, model, sequence_parallel)
        module = apply_tp_plan(model, plan_, tp.size, tp.index, model_name)
    owns = tp.index == 0 and pp.index == pp.size - 1
    if starts is None:
        if microbatches > 1:  # an elastic job's accumulation (pipelines refuse it otherwise)
            info["accumulation"] = microbatches
        return Split(module, PlainEngine(module, microbatches, loss_fn, half), info, owns)
    ends = [*starts[1:], len(list(module.children()))]
    info["stage_layers"] = [[s, e] for s, e in zip(starts, ends, strict=True)]
    split = _layer_pipeline(
        module, model_name, rt, starts, sample[:1], (microbatches, schedule, loss_fn), info
    )
    cast(PipelineEngine, split.engine).half = half
    return split


def _check_run(pp: int, microbatches: int, schedule: str, chunks: int, precision: str) -> None:
    """One line unless the schedule can run on `pp` pipeline ranks and the precision is known
    (fp16 runs on any device here, a script's choice; `gradmesh train` asks for a GPU,
    `check_precision`)."""
    if schedule not in SCHEDULES:
        raise GradmeshError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)})")
    if pp > 1:
        check_interleaved(schedule, pp, microbatches, chunks)
    if precision != "fp32" and precision not in HALF:
        raise GradmeshError(f"unknown precision {precision!r} (valid: fp32, {', '.join(HALF)})")


def _layer_pipeline(
    module: nn.Module,
    model_name: str,
    rt: Runtime,
    starts: list[int],
    sample: torch.Tensor,
    run: tuple[int, str, LossFn | None],
    info: dict[str, Any],
) -> Split:
    """This rank's stages of a sequence of layers cut at `starts` (p x chunks stages; rank s
    holds s, s + p, ...) and the engine that runs them: `run` is (micro-batches, schedule,
    loss)."""
    pp = rt.mesh[PP]
    chunks = len(starts) // pp.size
    shapes = sample_shapes(layers_of(module, model_name), sample)
    mine = [stage_module(module, starts, c * pp.size + pp.index) for c in range(chunks)]
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    entering = [shapes[first] for first in starts]
    engine = PipelineEngine(rt, list(mine), single_input(entering, dtype), *run)
    # one module holding every chunk's layers under their own names: what the optimizer steps
    stage = mine[0] if chunks == 1 else nn.Sequential(OrderedDict(_layers(mine)))
    owns = rt.mesh[TP].index == 0 and pp.index == pp.size - 1
    return Split(stage, engine, info, owns)


def _layers(chunks: list[nn.Sequential]) -> list[tuple[str, nn.Module]]:
    return [pair for chunk in chunks for pair in chunk.named_children()]
