"""Hybrid layouts: each layer with weights placed on its own, the same ranks serving as a
data-parallel group for some layers and a tensor-parallel group for others (Krizhevsky's
"one weird trick": convolutions data-parallel, fully connected layers split).

A plan gives every layer with weights one of four placements on the mesh's `tp` axis (T ranks):

- `data`: the layer whole on every rank, each rank computing on its own 1/T of the replica's
  batch (batch-sharded: DTensor's `Shard(0)` of the activation, `Replicate` of the weight); its
  gradients are averaged over the batch group (every rank of the world: dp x tp).
- `replicate`: the layer whole on every rank, every rank computing on the replica's whole batch
  (what the layers a tensor-parallel plan leaves whole do); gradients averaged over `dp`.
- `colwise` / `rowwise`: the layer split over `tp` (`gradmesh.layout.tensor.layers`); a
  colwise layer must be followed by a rowwise one (the pair's exchange is one allreduce each way).

Between layers, the activation is in one of three states: S (batch-sharded over tp), R (the
replica's whole batch on every tp rank), C (features split: between a colwise and a rowwise
layer). Where consecutive layers want different states, a conversion is put before the second:
S -> R gathers the batch (all-gather over tp; backward: this rank's slice of the gradient), R -> S
keeps this rank's slice (backward: all-gather of the gradients). The model's input (each tp rank
holds the replica's batch) is R, so a first `data` layer only slices; its output is made R
again before the loss, so every tp rank computes the same loss and logits.

Gradient scale. The trainer scales each replica's loss as the mean over the replica's batch. A
batch-sharded rank's share is 1/T of that batch, so the gather's backward multiplies its slice
by T (and the slice's backward divides the gathered gradients by T): a `data` layer's gradient is
then its shard's mean-loss gradient, and averaging over the T x dp ranks of the batch group gives
the replica average, exactly as for a data-parallel job of T x dp ranks.

Conversions hang on the layers as forward pre-hooks, so parameter names are the whole model's.
A model that is not a sequence of layers is planned by module name (wildcards as in a
tensor-parallel plan: `blocks.*.conv1`), its layers being the modules that hold parameters, in
the order it registers them; the states chain along that order, so a residual block lies wholly
in one state (a residual CNN's convolutions `data`, its classifier pair split, as Krizhevsky
did), and a cut inside a block fails on the first step with mismatched batch sizes, not quietly.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradmesh.collectives import allgather
from gradmesh.collectives.agreement import FixedLayout
from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.schedules import layers_of
from gradmesh.layout.tensor.plan import apply_tp_plan, check_plan, matches
from gradmesh.runtime.axes import PP, TP
from gradmesh.runtime.mesh import BATCH_SHARDED
from gradmesh.runtime.world import Runtime, get_runtime

CHOICES = ("data", "replicate", "colwise", "rowwise")
NEEDS = {"data": "S", "replicate": "R", "colwise": "R", "rowwise": "C"}
"""The activation state each placement takes as input."""
GIVES = {"data": "S", "replicate": "R", "colwise": "C", "rowwise": "R"}
"""The state of its output."""


@dataclass
class Plan:
    """A placement for every layer with weights of `model` on a mesh with `tensor_parallel`
    ranks per replica; `predicted` holds the planner's figures (for the reader, unused)."""

    model: str
    tensor_parallel: int
    layers: dict[str, str]
    workers: int = 0
    """The world the plan was made for (0: any that `tensor_parallel` divides)."""
    predicted: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def load_plan(text_or_path: str) -> Plan:
    """A plan from a JSON object given inline or a file (.json or .toml), or one line."""
    where = "the plan"
    if text_or_path.lstrip().startswith("{"):
        raw = text_or_path
    else:
        where = f"plan {text_or_path}"
        try:
            raw = Path(text_or_path).read_text()
        except OSError as exc:
            raise GradmeshError(f"cannot read plan {text_or_path}: {exc.strerror}") from None
    try:
        values = tomllib.loads(raw) if text_or_path.endswith(".toml") else json.loads(raw)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise GradmeshError(f"cannot read {where}: {exc}") from None
    if not isinstance(values, dict):
        raise GradmeshError(f"{where}: expected a table with model, tensor_parallel, layers")
    try:
        plan = Plan(
            model=str(values["model"]),
            tensor_parallel=int(values["tensor_parallel"]),
            layers={str(k): str(v) for k, v in dict(values["layers"]).items()},
            workers=int(values.get("workers", 0)),
            predicted=dict(values.get("predicted", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise GradmeshError(
            f"{where}: expected model, tensor_parallel and a layers table ({exc!s})"
        ) from None
    return plan


def weighted(model: nn.Module, model_name: str) -> list[str]:
    """The names of the model's layers with weights, in order (a plan's rows): the layers of a
    sequence; of any other model, every module holding parameters of its own, in the order the
    model registers them (which must be the order its forward runs them: the activation's
    state chains from one to the next)."""
    if isinstance(model, nn.Sequential):
        return [n for n, m in layers_of(model, model_name) if any(True for _ in m.parameters())]
    return [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(False))]


def placements(plan: Plan, names: list[str]) -> dict[str, str]:
    """Each layer's placement: the plan's entry naming it, or the first whose pattern fits it
    (`blocks.*.conv1`); one line for an entry that fits no layer with weights."""
    unknown = [p for p in plan.layers if not any(matches(p, n) for n in names)]
    if unknown:
        raise GradmeshError(
            f"plan: model {plan.model} has no layer {unknown[0]!r} with weights "
            f"(its layers with weights: {', '.join(names)})"
        )
    out = {}
    for name in names:
        pattern = (
            name
            if name in plan.layers
            else next((p for p in plan.layers if matches(p, name)), None)
        )
        if pattern is None:
            raise GradmeshError(f"plan: no placement for layer {name} of model {plan.model}")
        out[name] = plan.layers[pattern]
    return out


def conversions(choices: list[str]) -> tuple[list[str], str]:
    """For each layer, the conversion before it ('' / 'gather' / 'slice'), and the one after the
    last ('' or 'gather'); the states must chain (a ValueError names the layer position)."""
    state, before = "R", []
    for i, choice in enumerate(choices):
        need = NEEDS[choice]
        if state == "C" and need != "C":
            raise ValueError(f"{i - 1}: a colwise layer must be followed by a rowwise one")
        if need == "C" and state != "C":
            raise ValueError(f"{i}: a rowwise layer must follow a colwise one")
        before.append({("S", "R"): "gather", ("R", "S"): "slice"}.get((state, need), ""))
        state = GIVES[choice]
    if state == "C":
        raise ValueError(f"{len(choices) - 1}: the last colwise layer has no rowwise partner")
    return before, "gather" if state == "S" else ""


def check(plan: Plan, model: nn.Module, workers: int) -> None:
    """One line, before any process starts, unless `plan` fits `model` and `workers`: names
    every layer with weights and nothing else, placements chain, splits divide."""
    names = weighted(model, plan.model)
    tp = plan.tensor_parallel
    placed = placements(plan, names)
    for name, choice in plan.layers.items():
        if choice not in CHOICES:
            raise GradmeshError(
                f"plan: layer {name}: unknown placement {choice!r} (valid: {', '.join(CHOICES)})"
            )
    if tp < 1 or workers % tp:
        raise GradmeshError(f"plan: tensor_parallel {tp} does not divide the {workers} workers")
    choices = [placed[n] for n in names]
    try:
        conversions(choices)
    except ValueError as exc:
        position, why = str(exc).split(": ", 1)
        raise GradmeshError(f"plan: layer {names[int(position)]}: {why}") from None
    split = {n: c for n, c in placed.items() if c in ("colwise", "rowwise")}
    if tp > 1 and not split:
        raise GradmeshError(
            f"plan: tensor_parallel {tp} but no layer is split; use tensor_parallel 1 for pure "
            "data parallelism"
        )
    if tp == 1 and split:
        raise GradmeshError(f"plan: layer {next(iter(split))} is split but tensor_parallel is 1")
    try:
        check_plan(model, split, tp, plan.model)
    except GradmeshError as exc:
        raise GradmeshError(f"plan: {exc}") from None


def _sizes(n: int, parts: int) -> list[int]:
    return [len(c) for c in torch.arange(n, device="cpu").tensor_split(parts)]


def _gather(x: torch.Tensor, n: int) -> torch.Tensor:
    """The replica's whole batch from every tp rank's slice (slices as `tensor_split` cuts)."""
    rt = get_runtime()
    axis = rt.mesh[TP]
    sizes = _sizes(n, axis.size)
    most = max(sizes)
    padded = x
    if x.shape[0] < most:  # the backend's all-gather wants equal pieces
        padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    check = FixedLayout.post(rt, axis.group, "hybrid batch gather")
    rows = allgather(
        padded.contiguous(), group=axis.group, check=check, kind="tensor_parallel", backend=True
    )
    return torch.cat([rows[i, : sizes[i]] for i in range(axis.size)])


def _mine(x: torch.Tensor) -> torch.Tensor:
    axis = get_runtime().mesh[TP]
    return x.tensor_split(axis.size)[axis.index]


class _Gather(torch.autograd.Function):
    """S -> R: all-gather the batch over tp; backward: this rank's slice, times T."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:
        return _gather(x, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _mine(grad) * get_runtime().mesh[TP].size, None


class _Slice(torch.autograd.Function):
    """R -> S: this rank's slice of the batch; backward: all-gather the gradients, over T."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.n = x.shape[0]
        return _mine(x).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad.contiguous(), ctx.n) / get_runtime().mesh[TP].size


class _Batch:
    """The replica's batch size in the forward under way (a gather needs every slice's size)."""

    n = 0

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.n = int(args[0].shape[0])

    def convert(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        if kind == "gather":
            return _Gather.apply(x, self.n)  # type: ignore[no-untyped-call,no-any-return]
        return _Slice.apply(x)  # type: ignore[no-untyped-call,no-any-return]


def apply_plan(model: nn.Module, plan: Plan, rt: Runtime) -> nn.Module:
    """This rank's part of `model` under `plan` on the runtime's mesh (tp = the plan's, pp 1):
    split layers become their slices, conversions are hooked before the layers that need them,
    the `data` layers' parameters are marked batch-sharded. In place; returns `model`."""
    tp = rt.mesh[TP]
    if tp.size != plan.tensor_parallel or rt.mesh[PP].size != 1:
        raise GradmeshError(
            f"plan for tensor_parallel {plan.tensor_parallel} on a mesh with tp {tp.size}, "
            f"pp {rt.mesh[PP].size} (a hybrid plan needs pp 1)"
        )
    check(plan, model, rt.size)
    names = weighted(model, plan.model)
    placed = placements(plan, names)
    choices = [placed[n] for n in names]
    split = {n: c for n, c in placed.items() if c in ("colwise", "rowwise")}
    apply_tp_plan(model, split, tp.size, tp.index, plan.model)
    if tp.size == 1:
        return model
    before, after = conversions(choices)
    batch = _Batch()
    model.register_forward_pre_hook(batch.enter)
    for name, kind, choice in zip(names, before, choices, strict=True):
        layer = model.get_submodule(name)
        if kind:
            layer.register_forward_pre_hook(
                lambda _m, args, kind=kind: (batch.convert(kind, args[0]),)
            )
        if choice == "data":
            for p in layer.parameters():
                setattr(p, BATCH_SHARDED, True)
    if after:
        model.register_forward_hook(lambda _m, _args, out: batch.convert(after, out))
    return model


def parallelize(model: nn.Module, plan: Plan | dict[str, str] | str | None = None) -> nn.Module:
    """`gradmesh.parallelize`: this rank's part of `model` on the initialised runtime's mesh.

    `plan` is a tensor-parallel plan (module name, wildcards allowed -> style, see
    `gradmesh.layout.tensor.plan`; by default the model's own `tp_plan` attribute), split over the
    mesh's tp axis; or a hybrid `Plan` (a plan file's path, or its JSON), whose tp must be the
    mesh's. Build the optimizer over the returned module's parameters, then wrap it with
    `DistributedOptimizer`, which averages each parameter over the ranks that hold it."""
    rt = get_runtime()
    if plan is None:
        plan = getattr(model, "tp_plan", None)
        if not isinstance(plan, dict):
            raise GradmeshError(
                f"parallelize: {type(model).__name__} declares no tp_plan; pass a plan "
                "(module name -> colwise, rowwise, embedding, ...)"
            )
    if isinstance(plan, dict):
        tp = rt.mesh[TP]
        return apply_tp_plan(model, plan, tp.size, tp.index, type(model).__name__)
    return apply_plan(model, load_plan(plan) if isinstance(plan, str) else plan, rt)
