"""`auto`: the algorithm with the lowest predicted cost for this message and world size.

Every rank evaluates the same formulas on the same (p, n, parameters), so all choose alike.
"""

from __future__ import annotations

import torch

from gradmesh.collectives.api import ALGORITHMS, algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.cost import COSTS, DEFAULT_PARAMS, CostParams

CANDIDATES = ("ring", "tree", "butterfly", "hierarchical")


def choose(p: int, nbytes: int, params: CostParams = DEFAULT_PARAMS, local_size: int = 1) -> str:
    """The candidate with the lowest predicted time (hierarchical only across several hosts)."""
    names = [n for n in CANDIDATES if n != "hierarchical" or 1 < local_size < p]
    return min(names, key=lambda n: COSTS.get(n)(p, nbytes, params, local_size))


def auto_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    return COSTS.get(choose(p, nbytes, c, local_size))(p, nbytes, c, local_size)


@algorithm("auto", cost=auto_cost)
def auto_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    whole_world = ch.size == ch.rt.size
    # the widest host, not this rank's own: every rank must choose alike on uneven hosts
    local = ch.rt.widest_host if whole_world else 1
    name = choose(ch.size, flat.numel() * flat.element_size(), DEFAULT_PARAMS, local)
    ALGORITHMS.get(name)(flat, ch)
