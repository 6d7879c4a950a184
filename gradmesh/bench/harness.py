"""Pieces every benchmark shares: size parsing, robust statistics, launching a worker module."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.launch.jobs import run_workers


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


CPU_BOUND_IDLE = 0.10
"""A run during which the machine's cores were idle less than this fraction is CPU-bound."""


LINK_BOUND = 0.5
"""An engine whose bytes fill at least this fraction of the link's rate is labelled link-bound."""


def label(r: dict[str, Any], bandwidth_bps: int | None) -> None:
    """What limited an engine's step: `cpu` (the machine's cores were busy), `link` (its bytes
    filled the link), `compute` (neither: the step's own work and each message's latency),
    `loopback` (no emulated link)."""
    wire = r["wire_bytes_per_step"]
    r["link_utilization"] = (
        wire * 8 / r["step_s"] / bandwidth_bps if wire is not None and bandwidth_bps else None
    )
    if r["cpu_idle"] < CPU_BOUND_IDLE:
        r["limit"] = "cpu"
    elif r["link_utilization"] is None:
        r["limit"] = "loopback"
    else:
        r["limit"] = "link" if r["link_utilization"] >= LINK_BOUND else "compute"


def interleaved_jobs(
    module: str,
    world: int,
    configs: Sequence[dict[str, Any]],
    rounds: int,
    cluster: EmulatedCluster | None = None,
) -> list[list[Any]]:
    """Each of `configs` run as a job of `world` ranks (`run_workers`) once per round, round by
    round so that drift on the machine touches every config alike; per config, its results."""
    results: list[list[Any]] = [[] for _ in configs]
    for _ in range(rounds):
        for i, config in enumerate(configs):
            results[i].append(run_workers(module, world, config, 300.0, cluster))
    return results


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def shutdown_after_ddp() -> None:
    """End a benchmark worker that used DDP: the caller has dropped its DDP objects (their C++
    reducers must go before the process group, or the process may terminate at exit)."""
    import gc

    import torch.distributed as dist

    from gradmesh.runtime.world import shutdown

    gc.collect()
    dist.barrier()
    shutdown()
