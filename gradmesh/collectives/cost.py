"""The alpha-beta-gamma cost model shared by `auto`, the planner, the benchmarks and the simulator.

A message of n bytes costs alpha + n*beta seconds; reducing n bytes costs n*gamma. Each algorithm
registers its formula next to its code (`@algorithm(name, cost=...)`); `cost()` evaluates it and
`probe()` fits alpha and beta from a ping-pong sweep in a group, and gamma from a local reduction.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradmesh.registry import Registry

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class CostParams:
    """Link and reduction costs (seconds per message, per byte sent, per byte reduced)."""

    alpha: float
    beta: float
    gamma: float


DEFAULT_PARAMS = CostParams(alpha=60e-6, beta=1 / 2.0e9, gamma=1 / 4.0e9)
"""A loopback link between two processes of this class of machine (order of magnitude only;
`probe()` measures the real thing). Used by `auto` unless measured parameters are given."""

CostFn = Callable[[int, int, CostParams, int], float]
"""(p, nbytes, params, local_size) -> predicted seconds."""

COSTS: Registry[CostFn] = Registry("allreduce algorithm", loader=lambda: load_algorithms())


def log2ceil(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def cost(
    algorithm: str,
    p: int,
    nbytes: int,
    alpha: float,
    beta: float,
    gamma: float,
    local_size: int = 1,
) -> float:
    """Predicted seconds for `algorithm` to allreduce `nbytes` over `p` ranks."""
    if p <= 1:
        return 0.0
    return COSTS.get(algorithm)(p, nbytes, CostParams(alpha, beta, gamma), local_size)


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares line t = alpha + beta * n through (size, one-way time) points."""
    slope, intercept = statistics.linear_regression(sizes, seconds)
    return max(intercept, 1e-7), max(slope, 1e-13)


def probe(
    group: dist.ProcessGroup | None = None,
    sizes: tuple[int, ...] = (8, 4096, 65536, 1 << 20, 4 << 20),
    repeats: int = 5,
) -> CostParams:
    """Fit alpha and beta from ping-pongs between two ranks of the group, gamma from a local
    reduction; every member gets the same figures. Needs >= 2 ranks. On the whole world of a
    multi-host job the pair spans two hosts, so the fit describes the network, not loopback."""
    from gradmesh.runtime.world import get_runtime

    rt = get_runtime()
    import torch  # a probe runs collectives; the formulas need no torch
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(rt.size))
    if len(ranks) < 2:
        raise ValueError("probe needs a group of at least 2 ranks")
    pair = ranks[:2]
    if group is None and rt.cross_size > 1:  # torchrun numbers ranks host by host
        pair = [0, rt.local_size]
    me = rt.rank
    result = torch.zeros(3, dtype=torch.float64, device=rt.device)
    if me in pair:
        peer = pair[1] if me == pair[0] else pair[0]
        one_way = []
        for n in sizes:
            buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=rt.device)
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                if me == pair[0]:
                    dist.send(buf, peer, group=group)
                    dist.recv(buf, peer, group=group)
                else:
                    dist.recv(buf, peer, group=group)
                    dist.send(buf, peer, group=group)
                times.append((time.perf_counter() - started) / 2)
            one_way.append(statistics.median(times[1:]))
        alpha, beta = fit_alpha_beta([max(4, n) for n in sizes], one_way)
        a, b = torch.zeros(1 << 21, device=rt.device), torch.ones(1 << 21, device=rt.device)
        started = time.perf_counter()
        for _ in range(5):
            a.add_(b)
        gamma = (time.perf_counter() - started) / (5 * a.numel() * 4)
        result = torch.tensor([alpha, beta, gamma], dtype=torch.float64, device=rt.device)
    dist.broadcast(result, src=pair[0], group=group)
    return CostParams(*(float(v) for v in result))


ALGORITHM_MODULES = ("ring", "tree", "butterfly", "star", "hierarchical", "native", "auto")
"""The modules whose algorithms (and their cost formulas) register themselves on import."""


def load_algorithms() -> None:
    """Import every algorithm, so that each registers its code and its cost formula: on the
    first lookup of either registry (`COSTS`, `api.ALGORITHMS`), not at import, so that the
    formulas alone need no torch (`gradmesh --help`, the planner's and simulator's commands)."""
    import importlib

    for name in ALGORITHM_MODULES:
        importlib.import_module(f"gradmesh.collectives.{name}")
