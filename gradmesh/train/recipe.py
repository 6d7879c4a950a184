"""The one recipe that makes a model parallel: `gradmesh train`, a script's
`gradmesh.parallelize(model, layout)` and the planner's real steps (`gradmesh.plan.calibrate`)
all run `parallelize`, and the planner's profile and the simulator's meta-device counts run its
steps on one rank's slice (`rank_slice`), in one order (torchtitan's `parallelize_llama`
orders its steps the same way, for the same reasons):

0. What to cut is decided on the whole model: a sequence of layers is balanced on its whole
   layers' measured times (averaged over the world, so that every rank cuts alike).
1. fp8: torchao swaps whole `nn.Linear`s for `Float8Linear`s, so before anything splits them.
2. Tensor parallelism (the tp axis): each module of the model's plan becomes this rank's slice,
   or a hybrid plan places each layer (`gradmesh.layout.tensor`).
3. Recomputation: each block's forward recomputed in backward (`gradmesh.layout.memory`), after
   the split, so that the recomputed forward is the split one, its exchanges included.
4. Compilation: each block compiled (`gradmesh.layout.compile`), after the split and the
   recomputation it must trace, before sharding wraps the blocks; the whole model at a world
   of one without recomputation or sharding, where the blocks' seams carry nothing.
5. The pipeline cut (the pp axis): this rank's stages and the engine that runs the schedule,
   or, without a pipeline, the whole (split) model and a plain engine (`gradmesh.layout.engine`).
   - Context parallelism (the cp axis, `gradmesh.layout.context`): the engine's steps on this
     rank's chunks of each sequence, the model's attention over the ring; it wraps the engine,
     so it follows the cut (it refuses a pipeline), and takes the split, recomputed model as
     it is (a recomputed block's attention runs over the ring again in backward).
   - Expert parallelism (the ep axis, `gradmesh.layout.expert`): this rank's experts of each
     mixture kept, tokens dispatched to them by all-to-all; after the tensor split (which
     leaves the experts whole on every tp rank), on the model the engine runs.
6. Sharding (the dp axis): ZeRO stages 2 and 3 make each block an FSDP2 unit
   (`gradmesh.sync.sharded`); stage 1 shards the optimizer when it is built
   (`shard_optimizer`), so it is the caller's next step.

Each axis's own package holds its step; this function only orders them, so a new axis adds one
step here (docs/architecture.md, "Adding an axis").
"""

from __future__ import annotations

from typing import Any, overload

from torch import nn

from gradmesh.data.batch import Batch
from gradmesh.errors import GradmeshError
from gradmesh.layout.compile import compile_model
from gradmesh.layout.config import LayoutConfig
from gradmesh.layout.context import context_parallel
from gradmesh.layout.engine import (
    Split,
    check_run,
    cut_pipeline,
    layer_cut,
    layout_info,
    split_by_plan,
    split_tensor,
)
from gradmesh.layout.expert import expert_parallel
from gradmesh.layout.fp8 import to_float8
from gradmesh.layout.loss import LossFn
from gradmesh.layout.memory import checkpoint_blocks
from gradmesh.layout.tensor.hybrid import Plan, load_plan
from gradmesh.layout.tensor.hybrid import parallelize as tensor_step
from gradmesh.runtime.axes import PP
from gradmesh.runtime.world import Runtime, get_runtime
from gradmesh.sync.config import check_stage
from gradmesh.sync.sharded.model import shard_model


@overload
def parallelize(
    model: nn.Module,
    layout: LayoutConfig,
    *,
    example: Batch | None = None,
    loss_fn: LossFn | None = None,
    zero_stage: int = 0,
    name: str = "",
    rt: Runtime | None = None,
) -> Split: ...


@overload
def parallelize(
    model: nn.Module, layout: Plan | dict[str, str] | str | None = None
) -> nn.Module: ...


def parallelize(
    model: nn.Module,
    layout: LayoutConfig | Plan | dict[str, str] | str | None = None,
    *,
    example: Batch | None = None,
    loss_fn: LossFn | None = None,
    zero_stage: int = 0,
    name: str = "",
    rt: Runtime | None = None,
) -> Split | nn.Module:
    """`gradmesh.parallelize`: this rank's part of `model` under `layout` (a `LayoutConfig`,
    `gradmesh.LayoutConfig`) on the runtime's mesh, and the engine that runs it, the recipe's
    steps in order (the module docstring): returns a `Split` (`.module`, whose parameters the
    optimizer takes; `.step(x, y, scale)`; `.backward_passes`). The layout's sizes must be the
    mesh's. `example`: a batch like the ones `step` will get (a pipeline traces and cuts on it);
    `loss_fn`: the batch's mean loss (default cross-entropy); `zero_stage` 2 or 3 shards the
    model over the replicas (1: give it to `DistributedOptimizer(zero_stage=1)`).

    Given a tensor-parallel plan instead (module name -> style, a hybrid `Plan`, a plan file,
    or nothing: the model's own `tp_plan`), only the tensor step runs and the split module is
    returned, for a script that cuts its pipeline itself (`gradmesh.pipeline_stage`)."""
    if not isinstance(layout, LayoutConfig):
        if example is not None or loss_fn is not None or zero_stage:
            raise GradmeshError(
                "parallelize: example=, loss_fn= and zero_stage= go with a layout "
                "(gradmesh.LayoutConfig); a plan alone runs the tensor step only"
            )
        return tensor_step(model, layout)
    rt = rt or get_runtime()
    pp = rt.mesh[PP].size
    name = name or type(model).__name__
    check_run(layout, rt.mesh.shape.as_dict(), zero_stage)
    check_stage(zero_stage, pp, "allreduce", "none", plan=bool(layout.plan))
    if example is None and pp > 1:
        raise GradmeshError(
            "parallelize: a pipeline needs example=, a batch like the ones step() will get"
        )
    info = layout_info(layout, rt)
    plan = load_plan(layout.plan) if layout.plan else None
    if plan is not None:
        info["plan"] = dict(plan.layers)
    # 0. the cut of a sequence of layers, decided on its whole layers
    starts = layer_cut(model, name, layout, example, rt) if example is not None else None
    if layout.precision == "fp8":  # 1. fp8: whole nn.Linear layers swapped
        info["fp8_layers"] = len(to_float8(model))
    model = split_tensor(model, name, layout, plan, rt)  # 2. tensor parallelism
    # (context parallelism: here)
    info |= _recompute(model, layout.activation_checkpointing, name)  # 3. recomputation
    if layout.compile:  # 4. compilation
        seamless = rt.size == 1 and not layout.activation_checkpointing and zero_stage < 2
        names = compile_model(model, whole=seamless)
        info["compiled"] = "the whole model" if names == [""] else f"{len(names)} blocks"
    split = cut_pipeline(model, name, layout, rt, (example, loss_fn, starts), info)  # 5. the cut
    split = context_parallel(split, name, layout.context_attention, rt)  # context parallelism
    info |= expert_parallel(split.module, name, rt)  # expert parallelism
    shard_model(split.module, zero_stage, rt)  # 6. sharding: ZeRO 2 and 3 (1: the optimizer's)
    return split  # type: ignore[no-any-return]


def rank_slice(model: nn.Module, layout: LayoutConfig, name: str = "") -> nn.Module:
    """The recipe's steps on one rank's part that need no peer, for tp index 0 in a process of
    its own: fp8, the tensor split by the model's plan, recomputation, in the recipe's order
    (in place). What the planner times (`gradmesh.planner.mesh`) and the simulator counts on
    the meta device (`gradmesh.simulate.meta_count`), under `dry_exchanges`, so that both
    price the slice the trainer runs; the pipeline cut and sharding they price from per-block
    figures instead."""
    name = name or type(model).__name__
    if layout.precision == "fp8":
        to_float8(model)
    model = split_by_plan(model, name, layout, layout.tensor_parallel, 0)
    _recompute(model, layout.activation_checkpointing, name)
    return model


def _recompute(model: nn.Module, spec: str, name: str) -> dict[str, Any]:
    """Step 3, and the report's entries on it."""
    if not spec:
        return {}
    chosen = checkpoint_blocks(model, spec, name)
    return {
        "recomputed_blocks": len(chosen),
        "recomputed": {"attention": "attention modules", "ops": "blocks (per operation)"}.get(
            spec, "blocks"
        ),
    }
