"""The mesh planner's prices: each layout's step from a `MeshProfile` (the formulas are in
`gradmesh.planner.mesh`'s docstring), the calibration fitted on a few real steps, and the
search over every layout (`plan_mesh`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradmesh.collectives.ring import allgather_cost
from gradmesh.errors import GradmeshError
from gradmesh.layout.config import Layout
from gradmesh.layout.pipeline.order import bubble_formula
from gradmesh.planner.axes_cost import compute_factor, context_s, expert_bytes_held, expert_s
from gradmesh.planner.mesh import MeshProfile, Overlap, Workload, profile_mesh, rank_blocks
from gradmesh.planner.mesh_memory import (
    MemoryPrediction,
    param_bytes,
    predict_memory,
    recompute_share,
)
from gradmesh.planner.profiling import Links
from gradmesh.runtime.axes import DP, EXPERT_REPLICAS, REPLICAS, divisors

__all__ = [
    "Calibration",
    "MeshPlan",
    "MeshPrediction",
    "Overlap",
    "Search",
    "calibration_layouts",
    "exchange_request",
    "fit_calibration",
    "fitting",
    "preference",
    "plan_mesh",
    "predict_mesh",
    "variants",
]


@dataclass
class MeshPrediction:
    layout: Layout
    step_s: float
    compute_s: float
    tensor_parallel_s: float
    pipeline_s: float
    sync_s: float
    update_s: float
    bubble: float
    param_bytes_per_rank: int
    memory: MemoryPrediction | None = None
    context_s: float = 0.0
    """The attention exchanges over cp not hidden by compute (`axes_cost`)."""
    expert_s: float = 0.0
    """The mixtures' dispatches over ep."""

    def row(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k not in ("layout", "memory")}
        if self.memory is not None:
            out["memory"] = {**vars(self.memory), "total_bytes": self.memory.total_bytes}
        return {"name": self.layout.name, **vars(self.layout), **out}


def _exchange_s(links: Links, ranks: list[int], exchanges: list[tuple[int, str]]) -> float:
    total = 0.0
    for n, kind in exchanges:
        if kind in ("allgather", "reduce_scatter"):  # a ring moves the same bytes in both
            total += allgather_cost(len(ranks), n, links.over(ranks, n))
        else:
            total += links.allreduce_s("native", ranks, n)
    return total


def _unit_exchanges_s(
    prof: MeshProfile, lay: Layout, links: Links, dp_ranks: list[int], cal: Calibration
) -> float:
    """ZeRO stages 2 and 3 (FSDP2, no pipeline): each unit (a block; the root's embeddings and
    head) all-gathered before its forward (stage 3: again before its backward) and its
    gradient reduce-scattered after it, each a collective of its own over the replicas: priced
    on the links (a ring moves the same bytes in both) plus the calibrated excess of one
    (`unit_exchange_s`), which, unit by unit, is most of what sharding costs where ranks share
    cores."""
    if lay.shards <= 1:
        return 0.0
    total = 0.0
    for unit, calls in _unit_collectives(prof, lay):
        link = links.over(dp_ranks, unit)
        total += calls * (allgather_cost(lay.shards, unit, link) + cal.unit_exchange_s)
    return total


def _unit_collectives(prof: MeshProfile, lay: Layout) -> list[tuple[int, int]]:
    """FSDP2's units (bytes) and the collectives each makes a step: an all-gather and a
    reduce-scatter, and at stage 3 a second all-gather for backward, but for the root, which
    FSDP2 keeps gathered from forward to backward; each micro-batch of gradient accumulation
    again (gradmesh's FSDP2 gathers and reduces every micro-batch). In a pipeline (a layout
    gradmesh refuses, priced as torchtitan runs it) once a step: gathered for the step, the
    gradients reduced after the last micro-batch."""
    sl = prof.slices[lay.tp]
    calls = 3 if lay.zero_stage == 3 else 2
    again = lay.microbatches if lay.pp == 1 else 1
    units = [(b, calls * again) for b in sl.block_param_bytes.values()]
    return [*units, (sl.rest_param_bytes, 2 * again)]


def _pipeline_rank(prof: MeshProfile, lay: Layout) -> tuple[float, int, int]:
    """(the largest FLOPs share a pipeline rank holds, that rank's parameter bytes, the
    largest boundary's bytes per sample) under `lay`'s balanced cut."""
    sl = prof.slices[lay.tp]
    if lay.pp == 1:
        return 1.0, sum(sl.block_param_bytes.values()) + sl.rest_param_bytes, 0
    names, flops = list(prof.blocks), list(prof.blocks.values())
    total = sum(flops)
    share, params = 0.0, 0
    cut = rank_blocks(prof, lay)
    for chunks in cut:
        mine = [i for chunk in chunks for i in chunk]
        s = sum(flops[i] for i in mine) / total
        if s > share:
            share, params = s, param_bytes(prof, lay, mine)
    firsts = [chunk[0] for chunks in cut for chunk in chunks if chunk]
    crossing = max(prof.boundary_bytes.get(names[i - 1], 0) for i in firsts if i > 0)
    return share, params, crossing


@dataclass
class Calibration:
    """What the formulas leave out, fitted on a few real steps (`fit_calibration`): a step's
    own work (the trainer's loop, hooks, the loss's reductions; `step_overhead_s`), each tp
    exchange's cost beyond its price on the links (`exchange_s`: the ranks of a tp group do not
    reach an exchange at the same moment, and the slower one is waited for), and each stage's
    work per micro-batch beyond its compute (`microbatch_s`: the engine, its sends and receives,
    waking a stage that waits), and each of FSDP2's exchanges beyond its price on the links
    (`unit_exchange_s`, fitted on ZeRO-3 where a memory limit puts it among the layouts: the
    copies in and out of its buffers, its hooks, and the replicas' skew, every exchange
    blocking). Zero where not fitted."""

    step_overhead_s: float = 0.0
    exchange_s: float = 0.0
    microbatch_s: float = 0.0
    unit_exchange_s: float = 0.0
    fitted_on: dict[str, float] = field(default_factory=dict)
    """Each calibration layout's name and measured step seconds."""


def predict_mesh(
    prof: MeshProfile,
    lay: Layout,
    links: Links,
    algorithm: str = "native",
    calibration: Calibration | None = None,
    overlap: Overlap | None = None,
) -> MeshPrediction:
    """One layout's predicted step (the module docstring's formulas, plus `calibration`'s
    terms, and what `overlap` hides)."""
    cal = calibration or Calibration()
    overlap = overlap or Overlap()
    sl = prof.slices[lay.tp]
    m = lay.microbatches
    b = lay.micro(prof.batch)
    share, params, crossing = _pipeline_rank(prof, lay)
    placed = expert_bytes_held(prof.experts, lay)  # this rank's experts (1 / ep of them)
    params -= expert_bytes_held(prof.experts, Layout(1, 1, 1)) - placed
    tp_ranks = list(range(lay.tp))
    made = _exchanges(prof, lay)
    tensor = _exchange_s(links, tp_ranks, made) + cal.exchange_s * len(made)
    p2p = 0.0
    if lay.pp > 1:
        pair = [0, lay.tp * lay.cp * lay.ep]
        one = links.point_to_point or links.over(pair, crossing * b)
        p2p = lay.chunks * (2 * (one.alpha + crossing * b * one.beta) + cal.microbatch_s)
    bubble = bubble_formula(lay.pp, m, lay.chunks, lay.schedule or "1f1b") if lay.pp > 1 else 0.0
    stretch = m / (1 - bubble)
    sync = _sync_s(prof, lay, links, (algorithm, cal), (params, placed))
    whole = sum(sl.block_param_bytes.values()) + sl.rest_param_bytes
    mine = params / (lay.shards if lay.zero_stage >= 2 else lay.dp if lay.zero_stage else 1)
    update = sl.update_s * mine / whole + cal.step_overhead_s
    again = 1 + recompute_share(sl, lay)
    factor = compute_factor(prof.experts, sum(prof.blocks.values()), lay)
    compute = stretch * share * sl.seconds[b] * again * factor
    tensor = stretch * share * tensor * again
    tensor *= 1 - overlap.tp_hidden
    if overlap.fsdp and lay.zero_stage >= 2 and sync:
        calls = sum(n for _, n in _unit_collectives(prof, lay))
        sync = max(2 * sync / calls, sync - compute)
    rate = 3 * sum(prof.blocks.values()) * b / sl.seconds[b] if prof.blocks else 0.0
    context = context_s(prof.sequences, lay, links, b, rate) * again
    experts = expert_s(prof.experts, lay, links, b)
    step = compute + tensor + stretch * p2p + sync + update + context + experts
    memory = predict_memory(prof, lay) if sl.saved is not None else None
    parts = (compute, tensor, stretch * p2p, sync, update, bubble, params, memory)
    return MeshPrediction(lay, step, *parts, context, experts)


def _sync_s(
    prof: MeshProfile,
    lay: Layout,
    links: Links,
    how: tuple[str, Calibration],
    held: tuple[int, int],
) -> float:
    """The gradient sync after the step: `held` is (this rank's parameter bytes, those of its
    experts); `how` (the allreduce algorithm, the calibration). Over the replicas (dp x ep x
    cp), an expert's over its copies (dp x cp); FSDP2 a unit at a time over dp x cp; ZeRO-1
    adds the gather of the updated parts over dp."""
    (algorithm, cal), (params, placed) = how, held
    if lay.zero_stage >= 2:
        sync = _unit_exchanges_s(prof, lay, links, lay.line(EXPERT_REPLICAS), cal)
    else:
        sync = links.allreduce_s(algorithm, lay.line(REPLICAS), params - placed)
        if placed:
            sync += links.allreduce_s(algorithm, lay.line(EXPERT_REPLICAS), placed)
    if lay.zero_stage == 1 and lay.dp > 1:  # each replica's updated part, to the others
        sync += allgather_cost(lay.dp, params, links.over(lay.line((DP,)), params))
    return sync


def preference(pred: MeshPrediction) -> tuple[int, bool, float]:
    """The planner's order: the lowest ZeRO stage, then no checkpointing, then the fastest
    predicted step: what saves memory is used only as far as the limit needs, since FSDP2's
    per-unit work is priced only where a ZeRO-3 step was measured (`unit_exchange_s`; 1.84-2.21x
    plain data parallelism's step on this CPU, `gradmesh bench memory --world 4`, docs/
    memory.md)."""
    lay = pred.layout
    return lay.zero_stage, lay.checkpointing, pred.step_s


def fitting(preds: Sequence[MeshPrediction], limit: float, workers: int) -> list[MeshPrediction]:
    """The predictions whose memory fits `limit` bytes a rank; one line naming the smallest
    layout, what it needs and its largest part when none does."""
    fits = [p for p in preds if p.memory is not None and p.memory.total_bytes <= limit]
    if fits:
        return fits
    least = min(preds, key=lambda p: p.memory.total_bytes if p.memory else math.inf)
    mem = least.memory
    assert mem is not None
    raise GradmeshError(
        f"no layout of {workers} workers fits --memory-limit {limit / 2**20:.1f} MiB a rank: "
        f"the smallest, {least.layout.name}, needs {mem.total_bytes / 2**20:.1f} MiB, most of "
        f"it {mem.dominant} ({mem.parts()[mem.dominant] / 2**20:.1f} MiB)"
    )


def variants(found: Sequence[Layout], blocks: int) -> list[Layout]:
    """`found` and each with what saves memory at some time: ZeRO stages 1-3 where there are
    replicas (stage 1 only in a pipeline or with experts: `--zero-stage` 2 and 3 refuse
    them; 2 and 3 shard over the cp ranks too), and
    activation checkpointing of every block where the model has blocks."""
    out = []
    for lay in found:
        stages = [0] + [1] * (lay.dp > 1)  # stage 1 over dp; 2 and 3 over dp x cp, no pp, ep
        stages += [2, 3] * (lay.shards > 1 and lay.pp == 1 and lay.ep == 1)
        for z in stages:
            for ac in (False, True) if blocks else (False,):
                out.append(dataclasses.replace(lay, zero_stage=z, checkpointing=ac))
    return out


def calibration_layouts(found: Sequence[Layout], workers: int) -> list[Layout]:
    """The layouts `fit_calibration` needs measured, among `found`: pure data parallelism,
    then tp 2 and pp 2 (with 2 p micro-batches, 1F1B) on the rest of the ranks, then ZeRO-3
    on all of them, where found (ZeRO is searched under a memory limit)."""
    wanted = [Layout(workers, 1, 1)]
    if workers % 2 == 0:
        wanted += [Layout(workers // 2, 2, 1), Layout(workers // 2, 1, 2, 4, "1f1b")]
    wanted.append(Layout(workers, 1, 1, zero_stage=3))
    return [lay for lay in wanted if lay in found]


def fit_calibration(
    prof: MeshProfile, links: Links, measured: dict[Layout, float], algorithm: str = "native"
) -> Calibration:
    """`Calibration` from `calibration_layouts`' measured step seconds, one term per layout in
    turn, each given the ones before (none negative): the step's own work from pure data
    parallelism, the exchanges' excess from tp 2, the micro-batches' from pp 2, FSDP2's
    exchanges' from ZeRO-3."""
    cal = Calibration(fitted_on={lay.name: s for lay, s in measured.items()})
    for lay, seconds in measured.items():
        excess = seconds - predict_mesh(prof, lay, links, algorithm, cal).step_s
        if lay.zero_stage >= 2:
            calls = sum(n for _, n in _unit_collectives(prof, lay))
            cal.unit_exchange_s = max(0.0, excess / calls)
        elif lay.tp == 1 and lay.pp == 1:
            cal.step_overhead_s = max(0.0, excess)
        elif lay.pp == 1:
            cal.exchange_s = max(0.0, excess / max(1, len(_exchanges(prof, lay))))
        else:
            stretch = lay.microbatches / (1 - bubble_formula(lay.pp, lay.microbatches, 1))
            cal.microbatch_s = max(0.0, excess / stretch)
    return cal


def _exchanges(prof: MeshProfile, lay: Layout) -> list[tuple[int, str]]:
    return prof.slices[lay.tp].exchanges[lay.micro(prof.batch)]


def exchange_request(prof: MeshProfile, found: Sequence[Layout]) -> tuple[list[int], list[int]]:
    """(message sizes, group sizes) a probe should fit the links at for these layouts: the tp
    exchanges, the gradient syncs and the stage boundaries they make, four sizes spread over
    their range (the probe fits piecewise between them)."""
    sizes: set[int] = set()
    groups: set[int] = set()
    for lay in found:
        b = lay.micro(prof.batch)
        sizes.update(n for n, _ in _exchanges(prof, lay))
        _, params, crossing = _pipeline_rank(prof, lay)
        sizes.update(n for n in (params, crossing * b) if n)
        groups.update(g for g in (lay.tp, lay.dp, lay.cp, lay.ep, lay.dp * lay.cp) if g > 1)
    ordered = sorted(sizes) or [65536]
    picked = {ordered[round(i * (len(ordered) - 1) / 3)] for i in range(4)}
    return sorted(picked), sorted(groups)


@dataclass
class MeshPlan:
    profile: MeshProfile
    predictions: list[MeshPrediction]
    """Every layout searched, in the order of `preference` (fastest first, without a limit)."""
    links: Links
    calibration: Calibration

    algorithm: str = "native"

    def predict(self, lay: Layout) -> MeshPrediction:
        return predict_mesh(self.profile, lay, self.links, self.algorithm, self.calibration)

    def calibrate(self, measured: dict[Layout, float]) -> None:
        """Fit the calibration on measured steps (`fit_calibration`, on those of `measured`
        that are `calibration_layouts`) and price every layout again."""
        wanted = calibration_layouts([p.layout for p in self.predictions], self.profile.workers)
        steps = {lay: measured[lay] for lay in wanted if lay in measured}
        self.calibration = fit_calibration(self.profile, self.links, steps, self.algorithm)
        preds = [self.predict(p.layout) for p in self.predictions]
        self.predictions = sorted(preds, key=preference)


@dataclass(frozen=True)
class Search:
    """What `plan_mesh` searches besides the data, tensor and pipeline degrees: tp up to
    `tp_max`, gradients averaged by `algorithm`, the layouts of `also` profiled too (for
    `MeshPlan.predict`), and with `memory_limit` (bytes a rank) the ZeRO stages and
    recomputation, keeping the layouts predicted to fit."""

    tp_max: int | None = None
    algorithm: str = "native"
    also: Sequence[Layout] = ()
    memory_limit: float | None = None


def plan_mesh(
    work: Workload,
    workers: int,
    batch_: int,
    links: Links | Callable[[list[int], list[int]], Links],
    sharing: int,
    search: Search = Search(),
    measure: Callable[[list[Layout]], dict[Layout, float]] | None = None,
) -> MeshPlan:
    """Every layout of `workers` ranks for `work`, predicted, fastest first. `links` may be a
    probe, called with `exchange_request`'s sizes once the model is profiled; `measure`, where
    given, times real steps of `calibration_layouts` (seconds by layout) for
    `fit_calibration`. The layouts of `also` are profiled too (`MeshPlan.predict` prices them).
    With `memory_limit` (bytes a rank) the ZeRO stages and activation checkpointing are searched
    too (`variants`), and only the layouts whose predicted peak fits it are kept (`predict_memory`;
    one line naming the smallest when none does), in the order of `preference`."""
    if batch_ < workers:
        raise GradmeshError(f"--batch {batch_} must be at least --workers {workers}")
    tp_max, algorithm, also, memory_limit = (
        search.tp_max,
        search.algorithm,
        search.also,
        search.memory_limit,
    )
    tps = [t for t in divisors(workers) if t <= (tp_max or workers)]
    prof, found = profile_mesh(work, workers, batch_, tps, sharing, also)
    if callable(links):
        links = links(*exchange_request(prof, [*found, *also]))
    if memory_limit is not None:
        found = variants(found, len(prof.block_names))
    preds = [predict_mesh(prof, lay, links, algorithm) for lay in found]
    if memory_limit is not None:
        preds = fitting(preds, memory_limit, workers)
    plan = MeshPlan(prof, sorted(preds, key=preference), links, Calibration(), algorithm)
    if measure is not None:
        plan.calibrate(measure(calibration_layouts(found, workers)))
    return plan
