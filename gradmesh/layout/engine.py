"""The step engines and the layout's steps: `split_tensor` (a model split over the tp axis by
its plan, or a hybrid plan's placement per layer) and `cut_pipeline` (this rank's stages on the
pp axis and the engine that runs them: `PlainEngine`, forward and backward, or the pipeline's),
with the checks before them. `gradmesh.train.recipe.parallelize` runs them in the recipe's one
order, with recomputation, compilation and sharding between and after."""

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
    LayoutConfig,
    check_compile,
    check_context_layout,
    check_expert_layout,
    check_fp8,
    check_sequence_parallel,
)
from gradmesh.layout.context import check_context
from gradmesh.layout.expert import check_expert
from gradmesh.layout.loss import LossFn, logits_of, summed
from gradmesh.layout.pipeline.engine import HALF, PipelineEngine, forward_precision, single_input
from gradmesh.layout.pipeline.graph import candidates, check_points
from gradmesh.layout.pipeline.order import check_schedule, rank_of, stage_of
from gradmesh.layout.pipeline.schedules import (
    cut_stages,
    layers_of,
    parse_stages,
    sample_shapes,
    stage_module,
)
from gradmesh.layout.pipeline.split import check_splittable
from gradmesh.layout.pipeline.stages import graph_pipeline
from gradmesh.layout.pipeline.zero_bubble import SPLIT
from gradmesh.layout.tensor.hybrid import Plan, apply_plan
from gradmesh.layout.tensor.plan import apply_tp_plan, check_plan
from gradmesh.models.registry import TP_PLANS
from gradmesh.observe.timeline import span
from gradmesh.runtime.axes import PP, TP
from gradmesh.runtime.world import Runtime


class Engine(Protocol):
    """What the training loop and evaluation call instead of `model(x)` / `backward()`."""

    def step(self, x: Batch, y: Batch, scale: float | torch.Tensor) -> torch.Tensor:
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

    @property
    def device(self) -> torch.device:
        """Where the module's parameters are now (a pretrained model's are made on its device
        after the engine: `gradmesh.train.pretrained`)."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    @property
    def device_type(self) -> str:
        return self.device.type

    def _forward(self) -> Any:
        return forward_precision(self.half, self.device_type)

    @property
    def backward_passes(self) -> int:
        return self.microbatches

    def step(self, x: Batch, y: Batch, scale: float | torch.Tensor) -> torch.Tensor:
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


def admitted_degrees(model: nn.Module, model_name: str, tps: list[int]) -> list[int]:
    """The tensor-parallel degrees of `tps` the model's plan can split it over (1 always)."""
    fits = []
    for tp in tps:
        if tp > 1:
            try:
                check_plan(model, tp_plan(model_name, model), tp, model_name)
            except GradmeshError:
                continue
        fits.append(tp)
    return fits


@dataclass
class Split:
    """This rank's part of the model and how to run it (`gradmesh.parallelize(model, layout)`
    returns one: build the optimizer over `module.parameters()`, call `step(x, y, scale)`)."""

    module: nn.Module
    engine: Engine
    info: dict[str, Any]
    """For the report: the layout, and the stage's layers under pipeline parallelism."""
    owns_output: bool
    """Whether this rank's loss and logits are the replica's (the last stage, tp index 0):
    the others' are not counted, so that sums over the world count each replica once."""

    def step(self, x: Batch, y: Batch, scale: float | torch.Tensor) -> torch.Tensor:
        """The engine's step: forward and backward of (x, y), the loss scaled by `scale`."""
        return self.engine.step(x, y, scale)

    @property
    def backward_passes(self) -> int:
        return self.engine.backward_passes


def check_layout(
    model: nn.Module, model_name: str, layout: LayoutConfig, sample: Batch | None = None
) -> None:
    """One line, before launch, unless this layout can split `model`: its plan fits the tp
    degree, its layers make pp stages of the chunks each rank holds, its sequences (`sample`:
    a batch like the training data's) and attention split over cp, its experts over ep (the
    flags alone are checked by `gradmesh.train.checks`)."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel * layout.chunks
    check_expert(model, model_name, layout.expert_parallel, pp)
    if layout.pipeline_parallel > 1 and layout.schedule in SPLIT and sample is not None:
        check_splittable(model, lambda: batch.call(model, sample))
    if layout.context_parallel > 1 and sample is not None:
        cp, attention = layout.context_parallel, layout.context_attention
        check_context(model, model_name, cp, attention, sample, tp)
    if tp > 1:
        check_plan(model, tp_plan(model_name, model, layout.sequence_parallel), tp, model_name)
    if pp > 1 and not isinstance(model, nn.Sequential):  # cut on the graph at module names
        if layout.stages:
            check_points(model, layout.stages.split(","), pp, model_name)
        else:
            advice = "; give split points with --stages (module names)"
            check_stage_count(len(candidates(model)) + 1, pp, model_name, advice)
    elif pp > 1:
        parse_stages(layout.stages, layers_of(model, model_name), pp)


def check_stage_count(blocks: int, stages: int, model_name: str, advice: str = "") -> None:
    """One line unless a model of `blocks` blocks cuts into `stages` pipeline stages."""
    if blocks < stages:
        raise GradmeshError(
            f"a pipeline of {stages} stages: model {model_name} has {blocks} blocks to cut into "
            "stages (--pipeline-parallel times the stages each rank holds: 2 under zbv, "
            f"--virtual-stages under interleaved){advice}"
        )


def check_run(layout: LayoutConfig, mesh: dict[str, int], zero_stage: int = 0) -> None:
    """One line unless `layout` can run on a mesh of these sizes (axis -> size): its sizes are
    the mesh's, the schedule can run, the precision is known (fp16 runs on any device here, a
    script's choice; `gradmesh train` asks for a GPU, `check_precision`), the axes compose."""
    asked = layout.mesh_sizes()
    if any(mesh.get(axis, 1) != size for axis, size in asked.items()):
        wanted = ", ".join(f"{axis} {size}" for axis, size in asked.items())
        has = ", ".join(f"{axis} {mesh.get(axis, 1)}" for axis in asked)
        raise GradmeshError(
            f"the layout asks for {wanted}; the mesh has {has}: initialise gradmesh "
            "with the layout's sizes (gradmesh.init(mesh={...}))"
        )
    tp, pp = asked[TP], asked[PP]
    check_schedule(layout.schedule, pp, layout.microbatches, layout.chunks)
    if layout.precision != "fp32" and layout.precision not in HALF:
        raise GradmeshError(
            f"unknown precision {layout.precision!r} (valid: fp32, {', '.join(HALF)})"
        )
    check_sequence_parallel(layout.sequence_parallel, tp, pp)
    if layout.precision == "fp8":
        check_fp8(tp, pp, layout.plan)
    if layout.compile:
        check_compile(pp, layout.plan)
    check_context_layout(layout, pp, zero_stage)
    check_expert_layout(layout, pp, zero_stage)


def layout_info(layout: LayoutConfig, rt: Runtime) -> dict[str, Any]:
    """The report's entries on the layout: the mesh's sizes and the pipeline's settings."""
    piped = rt.mesh[PP].size > 1
    info: dict[str, Any] = rt.mesh.shape.as_dict()
    info["microbatches"] = layout.microbatches if piped else 1
    info["schedule"] = layout.schedule if piped else None
    info["chunks"] = layout.chunks if piped else 1
    info["precision"] = layout.precision
    info["sequence_parallel"] = layout.sequence_parallel
    return info


def split_tensor(
    model: nn.Module, model_name: str, layout: LayoutConfig, plan: Plan | None, rt: Runtime
) -> nn.Module:
    """The recipe's tensor step: `model` split over the tp axis by its plan (by module name,
    or a hybrid `plan`'s placement per layer), in place; the model as it is at tp 1."""
    if plan is not None:
        return apply_plan(model, plan, rt)
    tp = rt.mesh[TP]
    return split_by_plan(model, model_name, layout, tp.size, tp.index)


def split_by_plan(
    model: nn.Module, model_name: str, layout: LayoutConfig, size: int, index: int
) -> nn.Module:
    """Slice `index` of `size` of `model` by its tensor-parallel plan (its `sp_plan` with
    sequence parallelism), in place; the model as it is at size 1."""
    if size == 1:
        return model
    styles = tp_plan(model_name, model, layout.sequence_parallel)
    return apply_tp_plan(model, styles, size, index, model_name)


def cut_pipeline(
    model: nn.Module,
    model_name: str,
    layout: LayoutConfig,
    rt: Runtime,
    run: tuple[Batch, LossFn | None, list[int] | None],
    info: dict[str, Any],
) -> Split:
    """The recipe's pipeline step: this rank's stages of `model` on the pp axis and the engine
    that runs them (the whole model and a `PlainEngine` at pp 1). `run` is (a batch like the
    ones to come, the loss, where a sequence of layers is cut: decided on the whole model)."""
    sample, loss_fn, starts = run
    tp, pp = rt.mesh[TP], rt.mesh[PP]
    half = HALF.get(layout.precision)
    last = pp.size * layout.chunks - 1  # the pipeline's last stage: its rank sees the logits
    owns = tp.index == 0 and pp.index == rank_of(layout.schedule, last, pp.size)
    if pp.size == 1:
        m = layout.microbatches
        if m > 1:  # an elastic job's accumulation (pipelines refuse it otherwise)
            info["accumulation"] = m
        if "plan" in info:  # every tp rank ends with the replica's logits: the first counts them
            owns, m = tp.index == 0, 1
        return Split(model, PlainEngine(model, m, loss_fn, half), info, owns)
    if starts is None:  # any model: cut on its graph at module names
        graph = graph_pipeline(model, rt, sample, layout, loss_fn, model_name)
        info["stage_points"] = graph.graph.points
        graph.half = half
        return Split(graph.stage_module, graph, info, owns)
    ends = [*starts[1:], len(list(model.children()))]
    info["stage_layers"] = [[s, e] for s, e in zip(starts, ends, strict=True)]
    run_ = (layout.microbatches, layout.schedule, loss_fn)
    first = batch.leaves(sample)[0][:1]
    split = _layer_pipeline(model, model_name, rt, starts, first, run_, info, owns)
    cast(PipelineEngine, split.engine).half = half
    return split


def layer_cut(
    model: nn.Module, model_name: str, layout: LayoutConfig, sample: Batch, rt: Runtime
) -> list[int] | None:
    """Where a sequence of layers is cut into the pipeline's stages (given, or balanced on its
    whole layers' measured times, averaged over the world: every rank cuts alike); None for a
    model cut on its graph, or without a pipeline."""
    pp = rt.mesh[PP].size
    if pp == 1 or not isinstance(model, nn.Sequential):
        return None
    first = batch.leaves(sample)[0][:1]
    return cut_stages(model, model_name, pp * layout.chunks, layout.stages, first, rt)


def _layer_pipeline(
    module: nn.Module,
    model_name: str,
    rt: Runtime,
    starts: list[int],
    sample: torch.Tensor,
    run: tuple[int, str, LossFn | None],
    info: dict[str, Any],
    owns: bool,
) -> Split:
    """This rank's stages of a sequence of layers cut at `starts` (p x chunks stages; rank s
    holds s, s + p, ..., or s and 2 p - 1 - s in a V: `stage_of`) and the engine that runs
    them: `run` is (micro-batches, schedule, loss)."""
    pp = rt.mesh[PP]
    chunks = len(starts) // pp.size
    shapes = sample_shapes(layers_of(module, model_name), sample)
    where = [stage_of(run[1], c, pp.index, pp.size) for c in range(chunks)]
    mine = [stage_module(module, starts, g) for g in where]
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    entering = [shapes[first] for first in starts]
    engine = PipelineEngine(rt, list(mine), single_input(entering, dtype), *run)
    # one module holding every chunk's layers under their own names: what the optimizer steps
    stage = mine[0] if chunks == 1 else nn.Sequential(OrderedDict(_layers(mine)))
    return Split(stage, engine, info, owns)


def _layers(chunks: list[nn.Sequential]) -> list[tuple[str, nn.Module]]:
    return [pair for chunk in chunks for pair in chunk.named_children()]
