"""The planner's search: exact dynamic programming over units and activation states for each
tp, the references it is measured against, and the plan file it writes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from gradmesh.collectives.ring import allgather_cost
from gradmesh.errors import GradmeshError
from gradmesh.layout.tensor.hybrid import CHOICES, GIVES, NEEDS, Plan, check
from gradmesh.planner.cost import (
    Prediction,
    groups_of,
    layer_cost,
    memory_bytes,
    predict,
)
from gradmesh.planner.profiling import Links, Profile, Unit
from gradmesh.runtime.axes import TP
from gradmesh.runtime.axes import divisors as mesh_divisors

__all__ = [
    "Choice",
    "divisors",
    "min_memory",
    "options",
    "plan",
    "rule_plan",
    "search_tp",
    "to_plan",
    "tp_plan_layers",
]


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
    groups = groups_of(w, tp)
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
            end += allgather_cost(tp, logits, links.over(groups[TP], logits))
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
