"""The planner's cost model: each unit's exchanges and gradient sync per placement from the
collectives' formulas, and `predict`, which lays one step out in time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gradmesh.collectives.ring import allgather_cost
from gradmesh.layout.tensor.hybrid import conversions
from gradmesh.planner.profiling import Links, Profile, Unit
from gradmesh.runtime.axes import DP, TP

__all__ = [
    "groups_of",
    "exchange_sizes",
    "LARGEST_FIT",
    "layer_cost",
    "LayerCost",
    "memory_bytes",
    "predict",
    "Prediction",
    "SMALLEST_FIT",
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
    """'batch' (every rank) or the data axis's name."""


def groups_of(workers: int, tp: int) -> dict[str, list[int]]:
    """Rank 0's groups: tp (adjacent), dp (stride tp), batch (every rank)."""
    return {
        TP: list(range(tp)),
        DP: list(range(0, workers, tp)),
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
    groups = groups_of(w, tp)
    per_replica = prof.batch * tp / w
    inputs, partial = per_replica * unit.in_bytes, per_replica * unit.mid_bytes
    key = prof.key(choice, tp)
    compute = unit.fwd[key] + unit.bwd[key]
    fwd_comm = bwd_comm = 0.0
    gathered = allgather_cost(tp, int(inputs), links.over(groups[TP], inputs))
    if conversion == "gather":
        fwd_comm += gathered
    elif conversion == "slice" and not first:
        bwd_comm += gathered
    if choice == "colwise":
        bwd_comm += links.allreduce_s(algorithm, groups[TP], inputs)
    elif choice == "rowwise":
        fwd_comm += links.allreduce_s(algorithm, groups[TP], partial)
    grad = unit.param_bytes
    if tp > 1 and choice == "colwise":
        grad //= tp
    elif tp > 1 and choice == "rowwise":
        grad = (unit.param_bytes - unit.bias_bytes) // tp + unit.bias_bytes
    group = "batch" if choice == "data" and tp > 1 else DP
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
    groups = groups_of(w, tp)
    last = prof.units[-1]
    logits = int(prof.batch * tp / w * last.out_bytes)
    final = allgather_cost(tp, logits, links.over(groups[TP], logits)) if after else 0.0
    now = (
        sum(
            c.compute_s * _fwd_share(prof, u, ch, tp) + c.fwd_comm_s
            for u, ch, c in zip(prof.units, choices, costs, strict=True)
        )
        + final
    )
    backward_end, ready = _backward(prof, choices, costs, tp, now, int(fusion_mb * (1 << 20)))
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


def _backward(
    prof: Profile, choices: list[str], costs: list[LayerCost], tp: int, now: float, fusion: int
) -> tuple[float, list[tuple[float, str, int]]]:
    """Backward in reverse from `now`: when it ends, and each gradient bucket's (time it is
    ready, group, bytes), a bucket leaving once `fusion` bytes are pending or its group's
    last gradient is."""
    pending: dict[str, int] = {"batch": 0, DP: 0}
    ready: list[tuple[float, str, int]] = []
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
    return now, ready


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
