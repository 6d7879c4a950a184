"""The mesh planner: data, tensor and pipeline degrees for any model (a transformer with a tied
head, a residual CNN, a user's factory), where `search` places each layer of a sequence of
layers. It prices every layout the recipe (`gradmesh.train.recipe`) can run on W ranks and
returns them fastest first.

**Profile** (`profile_mesh`), on this machine under the job's own contention (in as many
processes at once as ranks share its cores, each with a rank's threads, medians over them, as
`profile` does): for each tp degree T the model's tensor-parallel plan admits, rank 0's slice of
the model (the plan applied as on a mesh, run under `dry_exchanges`: every tp exchange is
recorded, not made) is timed forward and backward with the job's loss at each micro-batch size a
candidate runs, and one optimizer step over the slice's parameters; the recorded exchanges give
the tp bytes per sample. Per block of the model (`block_list`): its share of the forward FLOPs
(the balanced cut the pipeline makes), its parameter bytes at each T, and the bytes per sample
leaving it (what crosses a stage boundary).

**Predict** (`mesh_cost.predict_mesh`), for dp x tp x pp = W (context and expert parallelism:
`axes_cost`, whose terms add to these), m micro-batches and v stages
per pipeline rank, N samples a step, b = N / (dp m) a micro-batch; s is the largest part of the
FLOPs one pipeline rank holds (its v stages of the p v balanced ones; 1 without a pipeline), g
that rank's parameter bytes (the embeddings and head count on both end stages: a tied weight
lives on both):
- one micro-batch on that rank: u = s (t_T(b) + x_T(b)) + v (2 h(b) + e_m), with t_T(b) the
  measured compute, x_T(b) the recorded exchanges priced on the tp group (`Links.allreduce_s`,
  the allgather formula) plus e_x each, and h(b) one point-to-point message of the boundary's
  bytes;
- the pipeline: m u / (1 - bubble), bubble = (p - 1) / (v m + p - 1) (`bubble_formula`);
- after it, the gradient sync of g bytes over the dp group (not overlapped: a pipeline syncs
  after its flush, and so the comparison stays even; ZeRO-1 adds the gather of the updated
  parts; ZeRO-2 and 3 exchange a unit at a time instead, each unit's all-gathers and
  reduce-scatter priced as collectives of their own plus e_u each), the optimizer step on g
  bytes (g / dp with ZeRO), and the step's own work e_s.
The e terms are the `Calibration`, fitted on real steps of pure data parallelism, tp 2, pp 2
and, where a memory limit searches it, ZeRO-3 (`fit_calibration`; zero when the links are not
probed): what the formulas leave out (the trainer's loop and the loss, a tp group's ranks
reaching an exchange at different moments, a pipeline engine's work per micro-batch, FSDP2's
work per exchange). Routes that carry a model input or a residual past
a stage are priced as the block outputs only. `gradmesh bench layout` prints each prediction
beside its measurement, the calibration layouts marked.
"""

from __future__ import annotations

import inspect
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch
from gradmesh.layout.config import Layout, LayoutConfig
from gradmesh.layout.loss import LossFn
from gradmesh.layout.memory import Saved, peak_bytes, saved_activations
from gradmesh.layout.pipeline.graph import block_flops
from gradmesh.layout.pipeline.order import stage_of
from gradmesh.layout.pipeline.schedules import balance
from gradmesh.layout.pipeline.zero_bubble import fewest_microbatches
from gradmesh.layout.tensor.layers import dry_exchanges
from gradmesh.models.blocks import block_list
from gradmesh.planner.axes_cost import Experts, Sequences, context_fits, record_axes
from gradmesh.planner.links import STATED_ERROR
from gradmesh.planner.profiling import _timed, sharing_threads
from gradmesh.runtime.axes import divisors

__all__ = [
    "STATED_ERROR",
    "Layout",
    "MeshProfile",
    "Workload",
    "block_outputs",
    "layouts",
    "profile_mesh",
    "rank_blocks",
]


class Workload(Protocol):
    """What the planner measures: built anew in each measuring process (so it must pickle:
    a dataclass of plain values whose `build` makes the rest)."""

    name: str

    def build(self) -> tuple[nn.Module, Batch, Batch, LossFn, Any]:
        """(whole model, at least the largest micro-batch of inputs and of targets, the summed
        loss, a function making the job's optimizer over parameters)."""
        ...


def rank_blocks(prof: MeshProfile, lay: Layout) -> list[list[list[int]]]:
    """The blocks (indices into `prof.blocks`) of each pipeline rank's chunks under `lay`'s
    balanced cut (chunk c of rank r is stage `stage_of(schedule, c, r, p)`); without a
    pipeline, one rank, one chunk, every block."""
    flops = list(prof.blocks.values())
    depth = lay.pp * lay.chunks
    if lay.pp == 1:
        return [[list(range(len(prof.block_names)))]]
    starts = [*balance(flops, depth), len(flops)]
    return [
        [
            list(range(starts[g], starts[g + 1]))
            for g in (stage_of(lay.schedule or "1f1b", c, r, lay.pp) for c in range(lay.chunks))
        ]
        for r in range(lay.pp)
    ]


@dataclass
class Slice:
    """Rank 0's slice at one tp degree."""

    seconds: dict[int, float]
    """Forward and backward with the loss, by micro-batch samples."""
    exchanges: dict[int, list[tuple[int, str]]]
    """(bytes, kind) of every tp exchange of a micro-batch, by its samples."""
    update_s: float
    block_param_bytes: dict[str, int]
    rest_param_bytes: int
    """Parameters outside the blocks (embeddings, head, final norm)."""
    saved: Saved | None = None
    """What one micro-batch of `saved_samples` saves for backward, and its step's peak."""
    saved_samples: int = 1
    optimizer_bytes: int = 0
    """The optimizer's state over the slice's parameters after one step."""
    optimizer_step_bytes: int = 0
    """The most bytes one optimizer step adds beyond the state (its temporaries)."""
    mixed: bool = False
    """Parameters in 16 bits with fp32 master copies (`mesh_memory`'s mixed precision)."""


@dataclass(frozen=True)
class Overlap:
    """What runs beside the compute (a GPU's streams; the CPU's gloo runs none): FSDP2's
    all-gathers and reduce-scatters (each unit's gathered while the one before computes, its
    gradient reduced while the one after does: the first gather and the last reduction stay
    exposed), and the tensor-parallel exchanges' `tp_hidden` fraction of their time (async TP
    splits them with the products they feed; a compiled step waits where results are read)."""

    fsdp: bool = False
    tp_hidden: float = 0.0


@dataclass
class MeshProfile:
    model: str
    workers: int
    batch: int
    threads: int
    concurrent: int
    blocks: dict[str, float]
    """Each block's forward FLOPs (`block_flops`), in order."""
    boundary_bytes: dict[str, int]
    """Bytes per sample out of each block."""
    slices: dict[int, Slice] = field(default_factory=dict)
    sequences: Sequences | None = None
    """The attention calls context parallelism splits (`axes_cost`); None: no attention."""
    experts: Experts | None = None
    """The mixtures expert parallelism spreads; None: no experts."""

    @property
    def block_names(self) -> list[str]:
        """The model's blocks in order: those of `blocks`, or, for a model of one block (whose
        FLOPs are not split: no pipeline cuts it), the slices' one."""
        return list(self.blocks) or list(next(iter(self.slices.values())).block_param_bytes)


def layouts(
    workers: int,
    batch_: int,
    blocks: int,
    tps: list[int],
    cps: Sequence[int] = (1,),
    eps: Sequence[int] = (1,),
) -> list[Layout]:
    """Every layout to price: tp from `tps`, pp up to the blocks, 1F1B and ZB-H1 with m in
    (p, 2p, 4p) micro-batches, and interleaved 1F1B and ZBV (2 stages a rank) where the
    blocks allow (ZBV from 2 (p - 1) micro-batches on); without a
    pipeline, context parallelism from `cps` (ring and all-to-all) and expert parallelism from
    `eps` (the degrees the model admits)."""
    found = []
    for tp in tps:
        for pp in divisors(workers // tp):
            dp = workers // (tp * pp)
            if batch_ % dp:
                continue
            if pp == 1:
                found.append(Layout(dp, tp, 1))
                found += _sequence_and_experts(dp, tp, cps, eps)
                continue
            for m in (pp, 2 * pp, 4 * pp):
                if (batch_ // dp) % m:
                    continue
                if pp <= blocks:
                    found.append(Layout(dp, tp, pp, m, "1f1b"))
                    found.append(Layout(dp, tp, pp, m, "zb-h1"))
                if 2 * pp <= blocks:
                    found.append(Layout(dp, tp, pp, m, "interleaved", 2))
                if 2 * pp <= blocks and m >= fewest_microbatches("zbv", pp):
                    found.append(Layout(dp, tp, pp, m, "zbv", 2))
    return found


def _sequence_and_experts(dp: int, tp: int, cps: Sequence[int], eps: Sequence[int]) -> list[Layout]:
    """The layouts of `dp` x `tp` ranks that give some of the replicas to cp or to ep."""
    found = []
    for cp in (c for c in cps if c > 1 and dp % c == 0):
        for attention in ("ring", "alltoall"):
            found.append(Layout(dp // cp, tp, 1, cp=cp, attention=attention))
    for ep in (e for e in eps if e > 1 and dp % e == 0):
        found.append(Layout(dp // ep, tp, 1, ep=ep))
    return found


def _slice_of(work: Workload, tp: int, sizes: list[int], rounds: int) -> Slice:
    from gradmesh.train.recipe import rank_slice

    model, x, y, loss_fn, make_optimizer = work.build()
    model = rank_slice(model, LayoutConfig(tensor_parallel=tp), work.name)  # the recipe's slice
    optimizer = make_optimizer(list(model.parameters()))
    seconds, exchanges = {}, {}
    with dry_exchanges(tp) as dry:
        for b in sizes:
            xb, yb = batch.rows(x, slice(0, b)), batch.rows(y, slice(0, b))

            def step(xb: Batch = xb, yb: Batch = yb) -> None:
                model.zero_grad(set_to_none=True)
                loss: torch.Tensor = loss_fn(batch.call(model, xb), yb)
                loss.backward()  # type: ignore[no-untyped-call]

            dry.made.clear()
            step()
            exchanges[b] = [(n, kind) for _, n, kind in dry.made]
            seconds[b] = _timed(step, rounds)
    update = _timed(optimizer.step, rounds)
    most = max(sizes)
    xb, yb = batch.rows(x, slice(0, most)), batch.rows(y, slice(0, most))
    with dry_exchanges(tp):
        saved = saved_activations(model, lambda: loss_fn(batch.call(model, xb), yb), (xb, yb))
    held = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    names = block_list(model)
    per_block = dict.fromkeys(names, 0)
    rest = 0
    for name, p in model.named_parameters():
        owner = next((b for b in names if name.startswith(b + ".")), None)
        n = p.numel() * p.element_size()
        if owner is None:
            rest += n
        else:
            per_block[owner] += n
    temporaries = peak_bytes(optimizer.step)
    return Slice(seconds, exchanges, update, per_block, rest, saved, most, held, temporaries)


def _measure(
    work: Workload, needs: dict[int, list[int]], threads: int, rounds: int
) -> dict[int, Slice]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        return {tp: _slice_of(work, tp, sizes, rounds) for tp, sizes in needs.items()}
    finally:
        torch.set_num_threads(before)


def _median_slices(runs: list[dict[int, Slice]]) -> dict[int, Slice]:
    first = runs[0]
    for tp, s in first.items():
        for b in s.seconds:
            s.seconds[b] = statistics.median(r[tp].seconds[b] for r in runs)
        s.update_s = statistics.median(r[tp].update_s for r in runs)
    return first


def block_outputs(model: nn.Module, sample: Batch) -> dict[str, int]:
    """Bytes per sample leaving each block (tensors among its outputs)."""
    out: dict[str, int] = {}
    hooks = []
    for name in block_list(model):

        def hook(_m: Any, _i: Any, o: Any, name: str = name) -> None:
            tensors = [o] if isinstance(o, torch.Tensor) else [t for t in o if torch.is_tensor(t)]
            out[name] = sum(t.numel() * t.element_size() for t in tensors)

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            batch.call(model, sample)
    finally:
        for h in hooks:
            h.remove()
    return out


def profile_mesh(
    work: Workload,
    workers: int,
    batch_: int,
    tps: list[int],
    sharing: int,
    also: Sequence[Layout] = (),
    rounds: int = 5,
    search: bool = True,
) -> tuple[MeshProfile, list[Layout]]:
    """The profile every layout of `workers` ranks at global `batch_` needs (tp from `tps`,
    those the model's plan admits), and those layouts; `also` names layouts to profile for
    beside them (a benchmark's), and without `search` only those."""
    model, x, _, _, _ = work.build()
    names = block_list(model)
    sample = batch.rows(x, slice(0, 1))
    flops = block_flops(model, sample, 1, work.name) if len(names) > 1 else {}
    from gradmesh.layout.engine import admitted_degrees

    admitted = sorted({1, *admitted_degrees(model, work.name, tps)})
    seqs, experts = record_axes(model, sample, batch.call)
    cps = context_degrees(model, seqs, batch.leaves(sample)[0], workers)
    eps = [e for e in divisors(workers) if experts is not None and experts.experts % e == 0]
    cut = len(flops) if experts is None else 0  # a mixture's routing: no pipeline cuts it
    found = layouts(workers, batch_, cut, admitted, cps, eps or [1]) if search else []
    found = [lay for lay in found if context_fits(seqs, lay)]
    needs: dict[int, set[int]] = {}
    for lay in [*found, *also]:
        needs.setdefault(lay.tp, set()).add(lay.micro(batch_))
    sizes = {tp: sorted(s) for tp, s in needs.items()}
    threads = sharing_threads(sharing)
    if sharing * threads <= (os.cpu_count() or 1):
        slices = _measure(work, sizes, threads, rounds)
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(sharing) as pool:
            runs = pool.starmap(_measure, [(work, sizes, threads, rounds)] * sharing)
        slices = _median_slices(runs)
    prof = MeshProfile(work.name, workers, batch_, threads, sharing, flops, {}, slices)
    prof.boundary_bytes = {k: v for k, v in block_outputs(model, sample).items() if k in flops}
    prof.sequences, prof.experts = seqs, experts
    return prof, found


def context_degrees(
    model: nn.Module, seqs: Sequences | None, ids: torch.Tensor, workers: int
) -> list[int]:
    """The cp degrees of `workers` whose 2 x cp chunks divide the sequence, where the model
    attends causally with torch's attention and takes positions; [1] otherwise."""
    from gradmesh.layout.context.parallel import POSITION_ARGUMENTS

    taken = inspect.signature(model.forward).parameters
    if seqs is None or ids.dim() < 2 or not any(a in taken for a in POSITION_ARGUMENTS):
        return [1]
    return [c for c in divisors(workers) if ids.shape[1] % (2 * c) == 0]
