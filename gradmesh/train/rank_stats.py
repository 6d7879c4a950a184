"""What each rank measured in a run, gathered to every rank and summed up for the report:
seconds in and out of communication, bytes sent, the layout's figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.layout.pipeline.schedules import bubble
from gradmesh.runtime.world import Runtime

KINDS = ("sync", "tensor_parallel", "pipeline", "context_parallel", "expert_parallel", "metrics")
"""What bytes were sent for (`CommStats.by_kind`)."""


@dataclass(frozen=True)
class RankStats:
    """Per-rank figures, gathered to every rank."""

    comm_s: list[float]
    compute_s: list[float]
    bytes_sent: list[int]
    layout: dict[str, list[float]] = field(default_factory=dict)
    """Per-rank layout figures: parameter and optimizer bytes held, bytes sent per step by kind,
    a pipeline stage's compute seconds per step and idle fraction."""


def gather_rank_stats(
    rt: Runtime, compute_s: float, layout: dict[str, float] | None = None
) -> RankStats:
    """All-gather (comm seconds, compute seconds, bytes sent, layout figures) from every rank."""
    names = sorted(layout or {})
    values = [rt.comm.comm_s, compute_s, float(rt.comm.bytes_sent)]
    mine = torch.tensor(
        values + [float((layout or {})[n]) for n in names], dtype=torch.float64, device=rt.device
    )
    rows = [torch.empty_like(mine) for _ in range(rt.size)]
    dist.all_gather(rows, mine.to(rt.device))
    table = torch.stack([r.cpu() for r in rows])
    return RankStats(
        comm_s=table[:, 0].tolist(),
        compute_s=table[:, 1].tolist(),
        bytes_sent=[int(b) for b in table[:, 2].tolist()],
        layout={n: table[:, 3 + i].tolist() for i, n in enumerate(names)},
    )


def mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values)


def summarize_layout(per_rank: dict[str, list[float]]) -> dict[str, float]:
    """Every rank's layout figures as one: per-rank means (`stage_idle`: the mean over stages,
    imbalance included) and, for a pipeline, its `bubble`
    (`gradmesh.layout.pipeline.schedules.bubble`)."""
    summary = {k: mean(v) for k, v in per_rank.items()}
    if any(per_rank.get("stage_busy_s", [])):
        summary["bubble"] = bubble(per_rank["stage_busy_s"], per_rank["stage_idle"])
    return summary


def slowest(compute_s: list[float], part_ranks: int) -> dict[str, Any]:
    """The rank computing longest against the median of the ranks doing the same work (those
    holding the same part of the model: ranks equal modulo tp x pp); empty without replicas."""
    worst: dict[str, Any] = {}
    for part in range(part_ranks):
        ranks = list(range(part, len(compute_s), part_ranks))
        if len(ranks) < 2:
            continue
        ordered = sorted(compute_s[r] for r in ranks)
        median = ordered[len(ordered) // 2]
        rank = max(ranks, key=lambda r: compute_s[r])
        ratio = compute_s[rank] / median if median > 0 else 1.0
        if not worst or ratio > worst["ratio_to_median"]:
            worst = {"rank": rank, "compute_s": compute_s[rank], "ratio_to_median": ratio}
    return worst


def compression_figures(figures: dict[str, float]) -> dict[str, float]:
    """The gradient bytes per step given to the compressor and sent, and their ratio, taken out
    of the layout's `figures`; empty without compression."""
    given = figures.pop("compression_given_bytes_per_step", 0.0)
    sent = figures.pop("compression_sent_bytes_per_step", 0.0)
    return (
        {"given_bytes_per_step": given, "sent_bytes_per_step": sent, "ratio": sent / given}
        if given
        else {}
    )
