"""The engine of a pipeline cut on a model's graph (`gradmesh.layout.pipeline.graph`): this
rank's stages run by `PipelineEngine`, the tied weights' gradients summed after each step, and
`gradmesh.pipeline_stage`, the script's entry."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch
from gradmesh.layout.config import LayoutConfig
from gradmesh.layout.loss import LossFn
from gradmesh.layout.pipeline.engine import PipelineEngine
from gradmesh.layout.pipeline.graph import (
    GraphStages,
    balanced_points,
    check_points,
    first_part,
)
from gradmesh.layout.pipeline.order import check_schedule, stage_of
from gradmesh.runtime.axes import PP
from gradmesh.runtime.world import Runtime


class Dispatch(nn.Module):
    """Runs stage `index` of `stages` on what its cut carried and on its micro-batch."""

    takes_batch = True
    """The engine hands it the micro-batch too (a later stage may read the model's inputs)."""

    def __init__(self, stages: GraphStages, index: int) -> None:
        super().__init__()
        self._stages, self.index = stages, index

    def forward(self, values: list[torch.Tensor], part: Batch) -> Any:
        return self._stages.run(self.index, values, part)


class GraphPipelineEngine(PipelineEngine):
    """`PipelineEngine` on this rank's graph stages; after each step's backwards, the tied
    parameters' gradients are summed over the stages that hold them."""

    def __init__(
        self,
        rt: Runtime,
        stages: GraphStages,
        example: Batch,
        microbatches: int,
        schedule: str,
        loss_fn: LossFn | None,
    ) -> None:
        axis = rt.mesh[PP]
        part = first_part(example, microbatches)
        stages.specs(batch.size(part))  # traced now: a cut that cannot carry its values fails here
        chunks = (len(stages.points) + 1) // axis.size
        mine = [stage_of(schedule, c, axis.index, axis.size) for c in range(chunks)]
        super().__init__(
            rt,
            [Dispatch(stages, g) for g in mine],
            lambda g, n: stages.specs(n)[g],
            microbatches,
            schedule,
            loss_fn,
        )
        self.graph = stages
        self.output_of = stages.output_of
        stages.tied()  # marked before the caller wraps its optimizer
        traced = stages.stages(part)
        self.stage_module = traced[mine[0]] if len(mine) == 1 else merged([traced[g] for g in mine])
        """This rank's stages (their parameters, under the model's names): what the optimizer
        steps."""

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        loss = super().step(x, y, scale)
        self.graph.sync_tied(self.rt, {self._global(c) for c in range(len(self.modules))})
        return loss


def merged(parts: list[nn.Module]) -> nn.Module:
    """One module holding the parameters and buffers of `parts` under their own names (a
    weight two parts share, once): a rank's chunks under the interleaved schedule, for its
    optimizer and its checkpoints."""
    whole = nn.Module()
    for part in parts:
        named = [
            *part.named_parameters(remove_duplicate=False),
            *part.named_buffers(remove_duplicate=False),
        ]
        for name, tensor in named:
            parent, _, leaf = name.rpartition(".")
            owner = whole
            for piece in parent.split(".") if parent else []:
                if piece not in owner._modules:
                    owner.add_module(piece, nn.Module())
                owner = owner._modules[piece]  # type: ignore[assignment]
            if isinstance(tensor, nn.Parameter):
                owner.register_parameter(leaf, tensor)
            else:
                owner.register_buffer(leaf, tensor)
    return whole


def graph_pipeline(
    model: nn.Module,
    rt: Runtime,
    example: Batch,
    layout: LayoutConfig,
    loss_fn: LossFn | None = None,
    model_name: str = "model",
) -> GraphPipelineEngine:
    """This rank's stages of `model` on the mesh's pp axis and the engine that runs them: cut
    into pp x `layout.chunks` stages (more than pp: the interleaved schedule) at the module
    names `layout.stages` (default: balanced by forward FLOPs on `example`, a batch like the
    ones `step` will get), run in `layout.microbatches` by `layout.schedule`.
    `engine.stage_module` holds the rank's parameters."""
    axis, chunks, m = rt.mesh[PP].size, layout.chunks, layout.microbatches
    pp = axis * chunks
    check_schedule(layout.schedule, axis, m, chunks)
    part = first_part(example, m)
    points = [p for p in layout.stages.split(",") if p]
    if not points:
        points = balanced_points(model, part, pp, model_name)
    check_points(model, points, pp, model_name)
    stages = GraphStages(model, points, model_name, example)
    return GraphPipelineEngine(rt, stages, example, m, layout.schedule, loss_fn)


def pipeline_stage(
    model: nn.Module,
    example: Batch,
    split: list[str] | None = None,
    microbatches: int = 1,
    schedule: str = "1f1b",
    loss_fn: LossFn | None = None,
    virtual_stages: int = 2,
) -> GraphPipelineEngine:
    """`gradmesh.pipeline_stage`: this rank's stage of `model` on the initialised runtime's pp
    axis (`virtual_stages` of them under `schedule="interleaved"`, two under "zbv"), cut at the
    module names `split` (default: balanced by forward FLOPs on `example`, a batch like the
    ones to come).
    Build the optimizer over `.stage_module.parameters()` (wrap it with
    `DistributedOptimizer(..., backward_passes_per_step=engine.backward_passes)` when there
    are replicas), then call `.step(x, y, scale)` each step: it runs the schedule and returns,
    on the last stage, the loss summed over the samples before `scale` (`loss_fn(outputs,
    targets)` is the batch's mean, as torch's losses give it; `gradmesh.layout.loss`)."""
    from gradmesh.runtime.world import get_runtime

    rt = get_runtime()
    layout = LayoutConfig(
        pipeline_parallel=rt.mesh[PP].size,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        stages=",".join(split or []),
    )
    return graph_pipeline(model, rt, example, layout, loss_fn, type(model).__name__)
