"""The hybrid planner: measure each layer, predict each placement's time from the collectives'
own cost formulas, and choose the placement per layer that minimises the predicted step.

**Profile.** For each layer with weights (with the weightless layers after it: a *unit*) at the
job's per-rank batch: forward and backward seconds on this machine (warm-up, median of several
runs) for every placement (`data` on 1/W of the global batch; `replicate` on 1/dp of it; the
colwise and rowwise slices on 1/dp of it), parameter bytes, and per-sample activation bytes into
the layer, out of the layer and out of the unit; and a step's other work per parameter byte
(zeroing, bucket copies, the SGD update). It runs with the thread count the launcher gives each
rank, and in as many processes at once as there are ranks sharing this machine's cores, so that
the contention the job will meet is measured, not assumed.

**Cost.** Per unit and placement at tp T (dp D = W / T, global batch N), with every formula read
from the collectives (`COSTS` for allreduce, `allgather_cost`):
- blocking exchanges: colwise, the allreduce of its input's gradient over tp (N/D samples of the
  input); rowwise, the allreduce of its partial sums over tp (N/D samples of its output); a
  conversion before the layer, an all-gather over tp of N/D samples of its input (S -> R in
  forward, R -> S in backward); the logits' gather when the last state is S;
- gradient sync, overlappable with the rest of backward: the layer's parameter bytes (a slice's
  for a split layer) averaged over the ranks that hold them: W for `data` (dp x tp), D otherwise;
  each group's link is the within-host one when the group fits a host (tp groups are adjacent
  ranks), else the across-host one.
`predict` lays a step out in time: forward, then backward unit by unit in reverse; each
reducer's buckets (cut as `plan_buckets` cuts them, `fusion_mb`) leave when their last gradient
is ready and share one link in order; the step ends when backward and the last bucket are done,
plus the update of the parameter bytes the rank holds and the step's own overhead
(`Profile.step_overhead_s`, where a probe measured it).

**Search.** Exact dynamic programming over units x activation state (S, R, C) for each tp that
divides W, on an additive objective: each unit's compute, blocking exchanges and the bandwidth
part of its gradient sync; the latency of each reducer's messages is added once. With a memory
limit the state also carries the bytes held (parameters, gradients, optimizer slots and saved
activations), in 256 steps of the limit. The chosen plan is then timed by `predict`, and so are
pure data parallelism, pure tensor parallelism (the model's own tensor-parallel plan at tp W)
and the rule "convolutions data-parallel, fully connected layers split".
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradmesh.collectives.cost import COSTS, CostParams
from gradmesh.collectives.hierarchical import two_level_cost
from gradmesh.collectives.ring import allgather_cost
from gradmesh.errors import GradmeshError
from gradmesh.layout.hybrid import CHOICES, GIVES, NEEDS, Plan, check, conversions
from gradmesh.layout.pipeline import layers_of, sample_shapes, units
from gradmesh.runtime.mesh import divisors as mesh_divisors


@dataclass
class Unit:
    """One layer with weights and the weightless layers after it."""

    name: str
    kind: str
    param_bytes: int
    bias_bytes: int
    in_bytes: int
    """Per sample, into the weighted layer."""
    mid_bytes: int
    """Per sample, out of the weighted layer (a rowwise layer's partial sums)."""
    out_bytes: int
    """Per sample, out of the unit."""
    dims: tuple[int, int]
    """(output, input) features or channels: what colwise and rowwise split."""
    fwd: dict[str, float] = field(default_factory=dict)
    """Seconds of forward per placement key ('data', 'replicate@T', 'colwise@T', 'rowwise@T')."""
    bwd: dict[str, float] = field(default_factory=dict)


@dataclass
class Profile:
    model: str
    workers: int
    batch: int
    units: list[Unit]
    threads: int
    """Threads per rank (the launcher's share of this machine's cores)."""
    concurrent: int
    """Processes that measured at once (the ranks sharing this machine's cores)."""
    update_s_per_byte: float
    """A step's work per parameter byte besides forward and backward (`_update_per_byte`)."""
    optimizer_slots: int = 1
    """Optimizer tensors per parameter (SGD with momentum: 1) for the memory estimate."""
    step_overhead_s: float = 0.0
    """A step's work that the units timed alone do not show (the trainer's loop, hooks and
    bookkeeping under the job's own contention, and the slowest rank's share of it: ranks
    time-sliced on shared cores do not finish their compute together, and a step waits for the
    last): measured by `gradmesh plan` as real data-parallel steps' time outside communication
    on their slowest rank, less the predicted compute; every placement pays it once per step."""

    def key(self, choice: str, tp: int) -> str:
        return "data" if choice == "data" or tp == 1 else f"{choice}@{tp}"


Curve = list[tuple[int, CostParams]]
"""A link fitted piecewise: (largest message size, the figures that price messages up to it),
by size; messages larger than the last size take the last figures."""


@dataclass
class Links:
    """Link cost parameters within a host and across hosts, and ranks per host (tp groups are
    adjacent ranks, so a group of at most this many stays in one host); where a probe fitted
    them, a `Curve` per group size and level, fitted on groups of that many ranks all reducing
    at once (a pair meets other costs than the whole world) and piecewise in message size (on
    the emulated links allreduces cost about the same from 16 KB to 256 KB, then grow at the
    line rate: one line through all sizes was 15% off at both ends)."""

    intra: CostParams
    inter: CostParams
    ranks_per_host: int
    intra_by_size: dict[int, Curve] = field(default_factory=dict)
    inter_by_size: dict[int, Curve] = field(default_factory=dict)
    point_to_point: CostParams | None = None
    """One message between two hosts where a probe fitted it (`plan.loaded_pingpong`): what a
    parameter server's pushes and pulls meet; None: the inter figures."""

    def over(self, ranks: list[int], nbytes: float = 0.0) -> CostParams:
        """The figures that price a message of `nbytes` over the group `ranks`."""
        one_host = len({r // self.ranks_per_host for r in ranks}) <= 1
        curve = (self.intra_by_size if one_host else self.inter_by_size).get(len(ranks))
        if not curve:
            return self.intra if one_host else self.inter
        return next((c for upto, c in curve if nbytes <= upto), curve[-1][1])

    def allreduce_s(
        self, algorithm: str, ranks: list[int], nbytes: float, priced_at: float | None = None
    ) -> float:
        """Seconds for `algorithm` to allreduce `nbytes` over `ranks` (host-major), from its
        registered formula on the figures that price a message of `priced_at` (default
        `nbytes`): within a host on the intra figures; across hosts, `hierarchical` as its two
        levels (a tree inside each host on the intra figures, the leaders on the inter ones),
        any other algorithm on the inter figures (its slowest link)."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        at = nbytes if priced_at is None else priced_at
        hosts = len({r // self.ranks_per_host for r in ranks})
        if algorithm == "hierarchical" and hosts > 1:
            local = p // hosts
            intra, inter = self.over(ranks[:local], at), self.over(ranks[::local], at)
            return two_level_cost(local, hosts, int(nbytes), intra, inter)
        return COSTS.get(algorithm)(p, int(nbytes), self.over(ranks, at), 1)


def _timed(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds + 2):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def _slice_layer(layer: nn.Module, choice: str, tp: int) -> nn.Module:
    """A plain layer shaped like this rank's slice (no exchange: its cost is modelled)."""
    if choice in ("data", "replicate") or tp == 1:
        return layer
    if isinstance(layer, nn.Linear):
        out_f, in_f = layer.out_features, layer.in_features
        if choice == "colwise":
            return nn.Linear(in_f, out_f // tp)
        return nn.Linear(in_f // tp, out_f)
    assert isinstance(layer, nn.Conv2d)
    out_c, in_c = layer.out_channels, layer.in_channels
    k, s, p = layer.kernel_size, layer.stride, layer.padding
    if choice == "colwise":
        return nn.Conv2d(in_c, out_c // tp, k, s, p)  # type: ignore[arg-type]
    return nn.Conv2d(in_c // tp, out_c, k, s, p)  # type: ignore[arg-type]


def _time_unit(
    layers: list[nn.Module], shape: torch.Size, batch: int, grad_in: bool, rounds: int
) -> tuple[float, float]:
    unit = nn.Sequential(*layers)
    x = torch.randn(batch, *shape, requires_grad=grad_in)

    def forward() -> torch.Tensor:
        return unit(x)  # type: ignore[no-any-return]

    fwd = _timed(forward, rounds)

    def both() -> None:
        unit(x).sum().backward()

    total = _timed(both, rounds)
    return fwd, max(total - fwd, 0.0)


def sharing_threads(sharing: int) -> int:
    """The threads the launcher gives each of `sharing` ranks on this machine."""
    return max(1, (os.cpu_count() or 1) // sharing)


def profile(
    model: nn.Module,
    model_name: str,
    sample: torch.Tensor,
    batch: int,
    workers: int,
    tps: list[int],
    sharing: int | None = None,
    rounds: int = 5,
) -> Profile:
    """Measure every unit of `model` for every placement at each tp in `tps` (global `batch`
    over `workers` ranks, `sharing` of them on this machine's cores: all by default).

    When the sharing ranks need more threads than the machine has cores, the measurement runs
    in that many processes at once (each with a rank's threads) and each figure is the median
    over them: the contention the job will meet (cores, caches, memory bandwidth) is measured,
    not assumed."""
    sharing = sharing or workers
    threads = sharing_threads(sharing)
    args = (model, model_name, sample[:1], batch, workers, tps, threads, rounds)
    if sharing * threads <= (os.cpu_count() or 1):
        units_, update = _measure(*args)
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(sharing) as pool:
            runs = pool.starmap(_measure, [args] * sharing)
        units_, update = runs[0][0], statistics.median(r[1] for r in runs)
        for i, unit in enumerate(units_):
            for key in unit.fwd:
                unit.fwd[key] = statistics.median(r[0][i].fwd[key] for r in runs)
                unit.bwd[key] = statistics.median(r[0][i].bwd[key] for r in runs)
    return Profile(model_name, workers, batch, units_, threads, sharing, update)


def _update_per_byte(threads: int, rounds: int) -> float:
    """Seconds per parameter byte of what a step does besides forward and backward: zero the
    gradient, pack it into a bucket and unpack it averaged, an SGD step with momentum."""
    n = 1 << 20
    param = nn.Parameter(torch.zeros(n))
    param.grad = torch.ones(n)
    bucket = torch.empty(n)
    opt = torch.optim.SGD([param], lr=0.01, momentum=0.9)

    def step() -> None:
        assert param.grad is not None
        param.grad.zero_()
        bucket.copy_(param.grad)
        param.grad.copy_(bucket).div_(2.0)
        opt.step()

    return _timed(step, rounds) / (n * 4)


def _measure(
    model: nn.Module,
    model_name: str,
    sample: torch.Tensor,
    batch: int,
    workers: int,
    tps: list[int],
    threads: int,
    rounds: int,
) -> tuple[list[Unit], float]:
    """`profile`'s measurement in this process, with `threads` threads."""
    layers = layers_of(model, model_name)
    shapes = sample_shapes(layers, sample)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: list[Unit] = []
    try:
        for u, (unit, first, at, end) in enumerate(describe_units(layers, shapes, model_name)):
            layer = layers[at][1]
            dims = unit.dims
            before_layers = [m for _, m in layers[first:at]]
            after_layers = [m for _, m in layers[at + 1 : end]]
            for choice, t in placements(dims, tps):
                per_rank = max(1, batch // workers if choice == "data" else batch * t // workers)
                shape = shapes[at]
                if choice == "rowwise":  # the input's features or channels are split
                    shape = torch.Size([shape[0] // t, *shape[1:]])
                seq = [
                    *(before_layers if choice != "rowwise" else []),
                    _slice_layer(layer, choice, t),
                ]
                fwd, bwd = _time_unit(
                    [*seq, *after_layers],
                    shapes[first] if choice != "rowwise" else shape,
                    per_rank,
                    u > 0,
                    rounds,
                )
                key = "data" if choice == "data" else f"{choice}@{t}"
                unit.fwd[key], unit.bwd[key] = fwd, bwd
            out.append(unit)
        update = _update_per_byte(threads, rounds)
    finally:
        torch.set_num_threads(before)
    return out, update


def describe_units(
    layers: list[tuple[str, nn.Module]], shapes: list[torch.Size], model_name: str
) -> list[tuple[Unit, int, int, int]]:
    """Each unit of the layer sequence, untimed (sizes, shapes, dims), with where it starts, its
    weighted layer and where it ends in `layers` (`shapes`: `sample_shapes`'); works on the meta
    device."""
    starts = units(layers)
    if not starts:
        raise GradmeshError(f"model {model_name} has no layers with weights to place")
    bounds = [*starts, len(layers)]
    found = []
    for first, end in zip(bounds, bounds[1:], strict=False):
        at = next(i for i in range(first, end) if any(True for _ in layers[i][1].parameters()))
        name, layer = layers[at]
        if not isinstance(layer, nn.Linear | nn.Conv2d):
            raise GradmeshError(
                f"model {model_name}: layer {name} is a {type(layer).__name__}; the planner "
                "places Linear and Conv2d layers"
            )
        bias = layer.bias.numel() * 4 if layer.bias is not None else 0
        unit = Unit(
            name=name,
            kind=type(layer).__name__,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            bias_bytes=bias,
            in_bytes=int(math.prod(shapes[at])) * 4,
            mid_bytes=int(math.prod(shapes[at + 1])) * 4,
            out_bytes=int(math.prod(shapes[end])) * 4,
            dims=(int(layer.weight.shape[0]), int(layer.weight.shape[1])),
        )
        found.append((unit, first, at, end))
    return found


def placements(dims: tuple[int, int], tps: list[int]) -> list[tuple[str, int]]:
    """(choice, tp) a unit of these (output, input) dims can take at each tp in `tps`."""
    return [("data", 1)] + [
        (c, t)
        for t in tps
        if t > 1
        for c in ("replicate", "colwise", "rowwise")
        if not (c == "colwise" and dims[0] % t or c == "rowwise" and dims[1] % t)
    ]


SMALLEST_FIT = 16 << 10
"""Below this, allreduces on the emulated links are in another regime (4 bytes: 0.4 ms; 16 KB
and up: 2.8 ms or more, on a line with the larger ones), so the link is fitted from here up."""
LARGEST_FIT = 8 << 20
"""And up to this: larger messages are priced by the same line."""


def exchange_sizes(prof: Profile, tps: list[int], most: int = 5) -> list[int]:
    """Up to `most` message sizes, spread evenly in log scale, of the allreduces the candidate
    placements would make (activations exchanged at each tp in `tps`, gradients per layer and
    whole; within `SMALLEST_FIT`..`LARGEST_FIT`): where the link figures are fitted, so that
    they are right where they are used."""
    sizes = {sum(u.param_bytes for u in prof.units)}
    for t in tps:
        per_replica = prof.batch * t / prof.workers
        for u in prof.units:
            sizes.add(u.param_bytes // t)
            if t > 1:
                sizes |= {int(per_replica * u.in_bytes), int(per_replica * u.mid_bytes)}
    ordered = sorted({min(max(n, SMALLEST_FIT), LARGEST_FIT) for n in sizes})
    if len(ordered) <= most:
        return ordered
    logs = [math.log(n) for n in ordered]
    picks = [logs[0] + (logs[-1] - logs[0]) * i / (most - 1) for i in range(most)]
    return sorted({min(ordered, key=lambda n: abs(math.log(n) - x)) for x in picks})


# -- cost --------------------------------------------------------------------------------------


@dataclass
class LayerCost:
    compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float
    grad_bytes: int
    grad_group: str
    """'batch' (every rank) or 'dp'."""


def _groups(workers: int, tp: int) -> dict[str, list[int]]:
    """Rank 0's groups: tp (adjacent), dp (stride tp), batch (every rank)."""
    return {
        "tp": list(range(tp)),
        "dp": list(range(0, workers, tp)),
        "batch": list(range(workers)),
    }


def layer_cost(
    prof: Profile,
    unit: Unit,
    choice: str,
    conversion: str,
    tp: int,
    links: Links,
    algorithm: str,
    first: bool = False,
) -> LayerCost:
    """A unit's compute, blocking exchanges and gradient bytes under `choice` (`first`: the
    model's input needs no gradient, so slicing it costs nothing)."""
    w = prof.workers
    groups = _groups(w, tp)
    per_replica = prof.batch * tp / w
    inputs, partial = per_replica * unit.in_bytes, per_replica * unit.mid_bytes
    key = prof.key(choice, tp)
    compute = unit.fwd[key] + unit.bwd[key]
    fwd_comm = bwd_comm = 0.0
    gathered = allgather_cost(tp, int(inputs), links.over(groups["tp"], inputs))
    if conversion == "gather":
        fwd_comm += gathered
    elif conversion == "slice" and not first:
        bwd_comm += gathered
    if choice == "colwise":
        bwd_comm += links.allreduce_s(algorithm, groups["tp"], inputs)
    elif choice == "rowwise":
        fwd_comm += links.allreduce_s(algorithm, groups["tp"], partial)
    grad = unit.param_bytes
    if tp > 1 and choice == "colwise":
        grad //= tp
    elif tp > 1 and choice == "rowwise":
        grad = (unit.param_bytes - unit.bias_bytes) // tp + unit.bias_bytes
    group = "batch" if choice == "data" and tp > 1 else "dp"
    return LayerCost(compute, fwd_comm, bwd_comm, grad, group)


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    blocking_comm_s: float
    exposed_sync_s: float
    sync_s: float
    rows: list[dict[str, Any]]


def predict(
    prof: Profile,
    layers: dict[str, str],
    tp: int,
    links: Links,
    algorithm: str = "native",
    fusion_mb: float = 64.0,
) -> Prediction:
    """The step time of placement `layers` at tp `tp`: forward, then backward in reverse with
    each reducer's buckets leaving as their gradients are ready (module docstring)."""
    choices = [layers[u.name] for u in prof.units]
    before, after = conversions(choices)
    costs = [
        layer_cost(prof, u, c, k, tp, links, algorithm, first=i == 0)
        for i, (u, c, k) in enumerate(zip(prof.units, choices, before, strict=True))
    ]
    w = prof.workers
    groups = _groups(w, tp)
    last = prof.units[-1]
    logits = int(prof.batch * tp / w * last.out_bytes)
    final = allgather_cost(tp, logits, links.over(groups["tp"], logits)) if after else 0.0
    now = (
        sum(
            c.compute_s * _fwd_share(prof, u, ch, tp) + c.fwd_comm_s
            for u, ch, c in zip(prof.units, choices, costs, strict=True)
        )
        + final
    )
    fusion = int(fusion_mb * (1 << 20))
    pending: dict[str, int] = {"batch": 0, "dp": 0}
    ready: list[tuple[float, str, int]] = []  # (time, group, bytes) of each bucket
    remaining = {g: sum(c.grad_bytes for c in costs if c.grad_group == g) for g in pending}
    for u, ch, c in reversed(list(zip(prof.units, choices, costs, strict=True))):
        now += c.compute_s * (1 - _fwd_share(prof, u, ch, tp)) + c.bwd_comm_s
        g = c.grad_group
        if pending[g] and pending[g] + c.grad_bytes > fusion:
            ready.append((now, g, pending[g]))
            pending[g] = 0
        pending[g] += c.grad_bytes
        remaining[g] -= c.grad_bytes
        if remaining[g] == 0 and pending[g]:
            ready.append((now, g, pending[g]))
            pending[g] = 0
    backward_end = now
    link_free, sync = 0.0, 0.0
    for t, g, nbytes in sorted(ready):
        spent = links.allreduce_s(algorithm, groups[g], nbytes)
        link_free = max(link_free, t) + spent
        sync += spent
    update = prof.update_s_per_byte * sum(c.grad_bytes for c in costs) + prof.step_overhead_s
    step = max(backward_end, link_free) + update
    rows = [
        {
            "layer": u.name,
            "kind": u.kind,
            "choice": ch,
            "conversion": k,
            "compute_ms": c.compute_s * 1e3,
            "comm_ms": (c.fwd_comm_s + c.bwd_comm_s) * 1e3,
            "sync_ms": links.allreduce_s(algorithm, groups[c.grad_group], c.grad_bytes) * 1e3,
            "param_bytes_per_rank": c.grad_bytes,
        }
        for u, ch, k, c in zip(prof.units, choices, before, costs, strict=True)
    ]
    compute = sum(c.compute_s for c in costs) + update
    blocking = sum(c.fwd_comm_s + c.bwd_comm_s for c in costs) + final
    return Prediction(step, compute, blocking, step - compute - blocking, sync, rows)


def _fwd_share(prof: Profile, unit: Unit, choice: str, tp: int) -> float:
    key = prof.key(choice, tp)
    total = unit.fwd[key] + unit.bwd[key]
    return unit.fwd[key] / total if total > 0 else 0.5


def memory_bytes(prof: Profile, unit: Unit, choice: str, tp: int) -> float:
    """What a rank holds for this unit: parameters, gradients, optimizer slots, and the
    activations saved for backward (the unit's output for its per-rank batch)."""
    per_rank = prof.batch / prof.workers * (1 if choice == "data" else tp)
    params = unit.param_bytes / (tp if choice in ("colwise", "rowwise") else 1)
    out = unit.out_bytes / (tp if choice == "colwise" else 1)
    return params * (2 + prof.optimizer_slots) + per_rank * (unit.in_bytes + out)


# -- search ------------------------------------------------------------------------------------


def options(prof: Profile, unit: Unit, tp: int) -> list[str]:
    if tp == 1:
        return ["data"]
    return [c for c in CHOICES if prof.key(c, tp) in unit.fwd]


def search_tp(
    prof: Profile,
    tp: int,
    links: Links,
    algorithm: str = "native",
    memory_limit: float | None = None,
) -> dict[str, str] | None:
    """The placement at tp `tp` minimising the additive objective (module docstring), exact;
    None when no placement fits (`memory_limit` bytes per rank, or no valid chain)."""
    steps = 256
    grain = memory_limit / steps if memory_limit else math.inf
    w = prof.workers
    groups = _groups(w, tp)
    # table: (state, memory units, a layer split yet) -> (cost, choices so far); tp > 1 plans
    # must split a layer (without one they are tp 1's plan, with idle tp exchanges)
    Key = tuple[str, int, bool]
    table: dict[Key, tuple[float, list[str]]] = {("R", 0, False): (0.0, [])}
    for u, unit in enumerate(prof.units):
        nxt: dict[Key, tuple[float, list[str]]] = {}
        for (state, used, split), (so_far, chosen) in table.items():
            for choice in options(prof, unit, tp):
                need = NEEDS[choice]
                if (state == "C") != (need == "C"):
                    continue
                kind = {("S", "R"): "gather", ("R", "S"): "slice"}.get((state, need), "")
                c = layer_cost(prof, unit, choice, kind, tp, links, algorithm, first=u == 0)
                ranks, n = groups[c.grad_group], c.grad_bytes
                bandwidth = links.allreduce_s(algorithm, ranks, n) - links.allreduce_s(
                    algorithm, ranks, 0, priced_at=n
                )
                update = prof.update_s_per_byte * c.grad_bytes
                total = so_far + c.compute_s + c.fwd_comm_s + c.bwd_comm_s + bandwidth + update
                mem = used
                if memory_limit:
                    mem += math.ceil(memory_bytes(prof, unit, choice, tp) / grain)
                    if mem > steps:
                        continue
                key = (GIVES[choice], mem, split or choice in ("colwise", "rowwise"))
                if key not in nxt or total < nxt[key][0]:
                    nxt[key] = (total, [*chosen, choice])
        table = nxt
    best: tuple[float, list[str]] | None = None
    last = prof.units[-1]
    for (state, _, split), (so_far, chosen) in table.items():
        if state == "C" or split != (tp > 1):
            continue
        end = so_far
        if state == "S":
            logits = int(prof.batch * tp / w * last.out_bytes)
            end += allgather_cost(tp, logits, links.over(groups["tp"], logits))
        if best is None or end < best[0]:
            best = (end, chosen)
    if best is None:
        return None
    return {u.name: c for u, c in zip(prof.units, best[1], strict=True)}


def rule_plan(prof: Profile, tp: int) -> dict[str, str] | None:
    """Convolutions data-parallel, fully connected layers split in column/row pairs (an odd
    one, or one whose features tp does not divide, replicated)."""
    out: dict[str, str] = {}
    linear = [u for u in prof.units if u.kind == "Linear"]
    i = 0
    for u in prof.units:
        if u.kind != "Linear":
            out[u.name] = "data"
    while i < len(linear):
        a = linear[i]
        b = linear[i + 1] if i + 1 < len(linear) else None
        if b is not None and a.dims[0] % tp == 0 and b.dims[1] % tp == 0:
            out[a.name], out[b.name] = "colwise", "rowwise"
            i += 2
        else:
            out[a.name] = "replicate"
            i += 1
    placed = {u.name: out[u.name] for u in prof.units}
    if not any(c == "colwise" for c in placed.values()):
        return None
    return placed


def tp_plan_layers(prof: Profile, tp_plan: dict[str, str]) -> dict[str, str]:
    """The model's uniform tensor-parallel plan as placements: its layers split, the rest
    replicated."""
    return {u.name: tp_plan.get(u.name, "replicate") for u in prof.units}


def divisors(n: int, most: int) -> list[int]:
    """The tp sizes a world of `n` can hold, up to `most`."""
    return [d for d in mesh_divisors(n) if d <= most]


@dataclass
class Choice:
    name: str
    tp: int
    layers: dict[str, str]
    prediction: Prediction


def plan(
    prof: Profile,
    links: Links,
    tp_max: int,
    model: nn.Module,
    tp_plan: dict[str, str] | None,
    algorithm: str = "native",
    fusion_mb: float = 64.0,
    memory_limit: float | None = None,
) -> tuple[Choice, list[Choice]]:
    """The planner's plan and the references it is compared with (pure data parallelism, pure
    tensor parallelism, the rule), each with its predicted step; one line when nothing fits."""
    w = prof.workers
    found: list[Choice] = []
    for t in divisors(w, tp_max):
        layers = search_tp(prof, t, links, algorithm, memory_limit)
        if layers is not None:
            found.append(
                Choice("planner", t, layers, predict(prof, layers, t, links, algorithm, fusion_mb))
            )
    if not found:
        limit = f" within {memory_limit / 1e6:.1f} MB per rank" if memory_limit else ""
        raise GradmeshError(
            f"no placement of model {prof.model} on {w} workers fits{limit} (the smallest "
            f"needs {min_memory(prof, divisors(w, tp_max)) / 1e6:.1f} MB)"
        )
    best = min(found, key=lambda c: c.prediction.step_s)
    refs = [
        Choice(
            "data parallel",
            1,
            {u.name: "data" for u in prof.units},
            predict(prof, {u.name: "data" for u in prof.units}, 1, links, algorithm, fusion_mb),
        )
    ]
    if tp_plan and w > 1 and w <= tp_max:
        layers = tp_plan_layers(prof, tp_plan)
        if _valid(prof, layers, w, model):
            refs.append(
                Choice(
                    "tensor parallel",
                    w,
                    layers,
                    predict(prof, layers, w, links, algorithm, fusion_mb),
                )
            )
    rule = rule_plan(prof, w) if w > 1 and w <= tp_max else None
    if rule is not None and _valid(prof, rule, w, model):
        refs.append(Choice("rule", w, rule, predict(prof, rule, w, links, algorithm, fusion_mb)))
    return best, refs


def _valid(prof: Profile, layers: dict[str, str], tp: int, model: nn.Module) -> bool:
    try:
        check(Plan(prof.model, tp, layers), model, prof.workers)
    except GradmeshError:
        return False
    return all(prof.key(c, tp) in u.fwd for u, c in zip(prof.units, layers.values(), strict=True))


def min_memory(prof: Profile, tps: list[int]) -> float:
    return min(
        sum(min(memory_bytes(prof, u, c, t) for c in options(prof, u, t)) for u in prof.units)
        for t in tps
    )


def to_plan(choice: Choice, prof: Profile, links: Links, refs: list[Choice]) -> Plan:
    return Plan(
        model=prof.model,
        tensor_parallel=choice.tp,
        layers=choice.layers,
        workers=prof.workers,
        predicted={
            "step_ms": round(choice.prediction.step_s * 1e3, 3),
            "batch": prof.batch,
            **{f"{r.name} step_ms": round(r.prediction.step_s * 1e3, 3) for r in refs},
            "link_inter": [links.inter.alpha, links.inter.beta],
            "link_intra": [links.intra.alpha, links.intra.beta],
            "ranks_per_host": links.ranks_per_host,
        },
    )
