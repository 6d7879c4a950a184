"""Pipeline stages of any model, cut at module names on its captured forward graph.

A model that is not a sequence of layers (a GPT: embeddings, a list of blocks with residuals, a
norm, a head tied to the embedding) is cut where the user says (`blocks.2`: stage 1 starts
there) or where its forward FLOPs balance. The cut is made by torch's
`torch.distributed.pipelining.pipeline` on the `torch.export` graph, so whatever the forward
computes between two cuts (the residual stream, position embeddings added to token
embeddings, a final norm) lands in the right stage and only the values that cross a cut travel.
The stages then run on gradmesh's own `PipelineEngine` (its schedules, timeouts naming the
peer stage, byte counts), not torch's schedules (see `gradmesh.layout.pipeline.schedules`
for why). A model split by its tensor-parallel plan first is cut the same way: its exchanges
are torch custom operators, which the export keeps whole (`gradmesh.layout.tensor.layers`), and its
head counts are already each rank's when the graph is captured.

What is ours, and why:
- Parameters are the model's own. torch's split copies every parameter into the stage that
  uses it, and a weight used by two stages (a head tied to the embedding) into both; here each
  stage's attributes are pointed back at the model's Parameter objects, so a tied weight stays
  one parameter within a stage, and its gradient is summed over the stages that hold it after
  every step (`GraphStages.sync_tied`), so the copies on different stages take the same steps
  and stay equal.
- An exported graph has the batch size it was traced with baked into its reshapes, and an
  epoch's micro-batches are not all the same size: a stage is traced again for each micro-batch
  size it meets (cached; every trace shares the same parameters).
- What crosses a cut may be several tensors (a transformer's residual stream, its rotary
  embeddings and its attention mask), not all with the batch first: a dry run of every stage
  per micro-batch size says what each cut carries (`GraphStages.specs`).
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

import gradmesh.data.batch as batch
from gradmesh.collectives import allreduce
from gradmesh.data.batch import Batch
from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.engine import Boundary, as_values
from gradmesh.layout.pipeline.routes import Routes, routes_of
from gradmesh.layout.pipeline.schedules import balance
from gradmesh.models.blocks import block_list
from gradmesh.runtime.axes import PP
from gradmesh.runtime.mesh import LAYOUT_SYNCED
from gradmesh.runtime.world import Runtime


def candidates(model: nn.Module) -> list[str]:
    """Where a stage may start when the cut is balanced: each block of the block list but the
    first (`blocks.1`, `blocks.2`, ...)."""
    return block_list(model)[1:]


def check_points(model: nn.Module, points: list[str], pp: int, model_name: str) -> None:
    """One line unless `points` are `pp - 1` distinct modules of the model, in forward order."""
    if len(points) != pp - 1:
        raise GradmeshError(
            f"--stages gives {len(points)} split points for a pipeline of {pp} stages "
            f"(needs {pp - 1}: the module each stage after the first starts at)"
        )
    names = [n for n, _ in model.named_modules()]
    for p in points:
        if p not in names or not p:
            near = [n for n in candidates(model) if n.rsplit(".", 1)[0] == p.rsplit(".", 1)[0]]
            raise GradmeshError(
                f"split point {p!r} is not a module of model {model_name}"
                + (f" (split points that fit: {', '.join(near[:6])})" if near else "")
            )
    if len(set(points)) != len(points):
        raise GradmeshError(f"split points {','.join(points)} would leave a stage empty")


def block_flops(model: nn.Module, sample: Batch, pp: int, model_name: str) -> dict[str, float]:
    """Each block's forward FLOPs on `sample` (counted by torch's FLOP counter), in forward
    order, what comes before the first block counted with it and what follows the last with
    the last; one line when the model has fewer blocks than `pp` stages need."""
    blocks = block_list(model)
    if len(blocks) < max(pp, 2):
        raise GradmeshError(
            f"a pipeline of {pp} stages: model {model_name} has {len(blocks)} blocks to cut "
            "into stages; give split points with --stages (module names)"
        )
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        batch.call(model, sample)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    per_block = [float(sum(counts.get(f"{root}.{b}", {}).values())) for b in blocks]
    total = float(sum(counts.get("Global", {}).values()))
    rest = total - sum(per_block)
    per_block[0] += rest / 2  # embeddings before, head after: half the rest each
    per_block[-1] += rest / 2
    return dict(zip(blocks, per_block, strict=True))


def balanced_points(model: nn.Module, sample: Batch, pp: int, model_name: str) -> list[str]:
    """Split points that balance the stages' forward FLOPs (`block_flops`)."""
    flops = block_flops(model, sample, pp, model_name)
    blocks = list(flops)
    return [blocks[i] for i in balance(list(flops.values()), pp)[1:]]


def _point_back(stage: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Make `stage`'s parameters and buffers the model's own objects (by name)."""
    for name, _ in list(stage.named_parameters(remove_duplicate=False)):
        parent, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(parent) if parent else stage, leaf, originals[name])
    for name, _ in list(stage.named_buffers(remove_duplicate=False)):
        parent, _, leaf = name.rpartition(".")
        owner = stage.get_submodule(parent) if parent else stage
        owner._buffers[leaf] = originals[name]


class GraphStages:
    """Every stage of `model` cut at `points`, traced per micro-batch size on demand."""

    def __init__(
        self, model: nn.Module, points: list[str], model_name: str, example: Batch
    ) -> None:
        self.model, self.points, self.model_name = model, points, model_name
        self.example = example
        """A model input like the ones this pipeline runs (each size's trace runs its rows)."""
        self._specs: dict[int, list[Boundary]] = {}
        self.routes: dict[tuple[tuple[int, ...], ...], Routes] = {}
        """Each trace's routes (`gradmesh.layout.pipeline.routes`)."""
        self.originals: dict[str, torch.Tensor] = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        self.traces: dict[tuple[tuple[int, ...], ...], list[nn.Module]] = {}
        self._holders: dict[str, set[int]] | None = None
        self._out_spec: TreeSpec | None = None
        self._out_leaves = 0

    def stages(
        self, sample: Batch, key: tuple[tuple[int, ...], ...] | None = None
    ) -> list[nn.Module]:
        """The stage modules for inputs shaped like `sample` (`key`: their shapes, when the
        caller has them; traced on first use)."""
        key = key or _shapes(sample)
        if key not in self.traces:
            from torch.distributed.pipelining import SplitPoint, pipeline

            spec = {p: SplitPoint.BEGINNING for p in self.points}
            try:
                with warnings.catch_warnings():  # torch's own deprecations, not the user's
                    warnings.simplefilter("ignore", FutureWarning)
                    args, kwargs = batch.arguments(sample)
                    pipe = pipeline(self._copy(), mb_args=args, mb_kwargs=kwargs, split_spec=spec)
            except Exception as exc:  # noqa: BLE001 - torch's reasons vary; one line for the user
                cause = exc.__cause__ or exc
                why = (str(cause).splitlines() or [type(cause).__name__])[0]
                found = re.search(r"Found <class '([\w.]+)'> in output", why)
                if found:  # a value torch cannot flatten: name it and what to change
                    what = found.group(1).rpartition(".")[2]
                    why = (
                        f"its forward returns a {what}, which a stage cannot pass on: return "
                        "tensors (a tuple, a dict or a ModelOutput of them)"
                    )
                raise GradmeshError(
                    f"cannot cut model {self.model_name} at {','.join(self.points)}: {why}"
                ) from None
            if pipe.num_stages != len(self.points) + 1:
                raise GradmeshError(
                    f"cutting model {self.model_name} at {','.join(self.points)} gave "
                    f"{pipe.num_stages} stages, not {len(self.points) + 1} (a split point the "
                    "forward does not call, or two at the same place)"
                )
            stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
            for stage in stages:
                _point_back(stage, self.originals)
            self.routes[key] = routes_of(pipe.split_gm, self.model_name)
            self.traces[key] = stages
        return self.traces[key]

    def _copy(self) -> nn.Module:
        """A copy of the model to trace (the split wraps the forward of the modules it cuts at,
        so a model cut once cannot be traced again; the copy's weights are pointed back), with a
        Hugging Face model's key/value cache off: a cache object cannot cross a stage, and
        training has no use for it."""
        model = copy.deepcopy(self.model)
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False  # type: ignore[union-attr]
        return model

    def output_of(self, values: list[torch.Tensor]) -> Any:
        """The model's output, in the structure its forward returns (a tensor, a tuple, a
        `ModelOutput`), from the last stage's values: what the loss is given, as it would be
        given the whole model's output."""
        if self._out_spec is None:
            with torch.no_grad():
                out = batch.call(self._copy(), self.sample(1))
            leaves, self._out_spec = tree_flatten(out)
            self._out_leaves = len(leaves)
        if self._out_leaves != len(values):  # the stage returned other values: give them whole
            return values[0] if len(values) == 1 else values
        return tree_unflatten(values, self._out_spec)

    def sample(self, n: int) -> Batch:
        """A model input of `n` samples like the pipeline's (the example's first row)."""
        return tree_map(lambda t: t[:1].expand(n, *t.shape[1:]).contiguous(), self.example)

    def specs(self, n: int) -> list[Boundary]:
        """What enters each stage for a micro-batch of `n` samples: every tensor a cut carries
        (shape, dtype, whether its gradient goes back), from a dry run of every stage with
        autograd on (so that each flag is what the real run will have); cached per size."""
        if n not in self._specs:
            sample = self.sample(n)
            values: list[torch.Tensor] = []
            found: list[Boundary] = [[(t.shape, t.dtype, False) for t in batch.leaves(sample)]]
            with torch.enable_grad():
                for i in range(len(self.points) + 1):
                    if i:
                        found.append([(v.shape, v.dtype, v.requires_grad) for v in values])
                    outs = as_values(self.run(i, values, sample))
                    values = [v.detach().requires_grad_(v.requires_grad) for v in outs]
            self._specs[n] = found
        return self._specs[n]

    def run(self, index: int, values: list[torch.Tensor], part: Batch) -> Any:
        """Stage `index` on what its cut carried and on the micro-batch `part` (traced for its
        size): what the next cut carries, or the model's output from the last stage."""
        key = _shapes(part)
        stage = self.stages(part, key)[index]  # traced for the shapes of `part` (cached)
        return self.routes[key].run(index, stage, values, part)

    def holders(self) -> dict[str, set[int]]:
        """Each parameter (by one of its names) and the stages that hold it (every trace cuts
        alike: read off the first, once)."""
        if self._holders is not None:
            return self._holders
        any_trace = next(iter(self.traces.values()))
        held: dict[int, set[int]] = {}
        names: dict[int, str] = {}
        for i, stage in enumerate(any_trace):
            for name, p in stage.named_parameters():
                held.setdefault(id(p), set()).add(i)
                names.setdefault(id(p), name)
        self._holders = {names[k]: v for k, v in held.items()}
        return self._holders

    def tied(self) -> list[str]:
        """Names of the parameters that several stages hold (tied weights), sorted: the same
        list on every rank. Each is marked `LAYOUT_SYNCED`: `sync_tied` makes its gradient."""
        shared = sorted(n for n, held in self.holders().items() if len(held) > 1)
        for name in shared:
            setattr(self.originals[name], LAYOUT_SYNCED, True)
        return shared

    def sync_tied(self, rt: Runtime, mine: set[int]) -> None:
        """Give every copy of a tied weight its whole gradient: summed over the stages that hold
        it (an allreduce over the pp axis, zeros from a rank whose stages do not hold it; a rank
        holding it on two of its stages has summed them in its own gradient already), then
        averaged over the replicas (the dp axis). Under tensor parallelism each tp rank sums its
        own slice with the stages of its own tp index. Every rank calls it after its step's
        backwards with the stages it holds (`mine`); the data-parallel sync leaves these
        parameters alone (`LAYOUT_SYNCED`)."""
        shared = self.tied()
        if not shared:
            return
        params = [self.originals[n] for n in shared]
        flat = torch.cat(
            [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        )
        allreduce(flat, group=rt.mesh[PP].group, kind="pipeline")  # over the stages
        if rt.dp.size > 1:  # and the replicas
            allreduce(flat, op="average", group=rt.dp.group, kind="pipeline")
        held = self.holders()
        sizes = [p.numel() for p in params]
        for name, p, piece in zip(shared, params, torch.split(flat, sizes), strict=True):
            if mine & held[name]:
                p.grad = piece.view_as(p).clone()


def first_part(example: Batch, microbatches: int) -> Batch:
    """A micro-batch of `example` (a batch like the ones to come) cut in `microbatches`."""
    return batch.rows(example, slice(0, max(1, batch.size(example) // microbatches)))


def _shapes(sample: Batch) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in batch.leaves(sample))
