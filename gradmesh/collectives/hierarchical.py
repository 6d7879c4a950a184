"""`hierarchical`: reduce inside each host, allreduce among one leader per host, broadcast inside.

The intra-host steps use the binomial tree over the host's ranks (fast local links); only the
leaders (local rank 0) cross the network, with an inner algorithm (ring by default), so the
slow links carry one vector per host instead of one per process. Runs on the whole world, whose
host layout the runtime knows.

Cost, with L ranks per host and H = p / L hosts: 2 tree(L) + ring(H), each with its own terms.
"""

from __future__ import annotations

import torch

from gradmesh.collectives.api import ALGORITHMS, algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.cost import COSTS, CostParams
from gradmesh.collectives.tree import tree_broadcast, tree_cost, tree_reduce
from gradmesh.errors import GradmeshError

INNER = "ring"


def two_level_cost(
    local: int, hosts: int, nbytes: int, intra: CostParams, inter: CostParams
) -> float:
    """`local` ranks on each of `hosts` hosts: the tree inside a host on the `intra` terms, the
    inner algorithm among the leaders on the `inter` terms."""
    inner = COSTS.get(INNER)(hosts, nbytes, inter, 1) if hosts > 1 else 0.0
    # the local tree costs a reduce and a broadcast: the allreduce tree formula covers both
    return (tree_cost(local, nbytes, intra) if local > 1 else 0.0) + inner


def hierarchical_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    local = max(1, min(local_size, p))
    return two_level_cost(local, max(1, p // local), nbytes, c, c)


def hierarchical_allreduce_with(flat: torch.Tensor, ch: Channel, inner: str) -> None:
    rt = ch.rt
    if ch.size != rt.size:
        raise GradmeshError(f"rank {rt.rank}: hierarchical allreduce runs on the whole world only")
    run_inner = ALGORITHMS.get(inner)
    local = (
        Channel(rt, rt.local_group, ch.operation, ch.reduce)
        if rt.local_size > 1 and rt.local_group
        else None
    )
    if local is not None:
        tree_reduce(flat, local)
    if rt.local_rank == 0 and rt.cross_size > 1 and rt.cross_group is not None:
        leaders = Channel(rt, rt.cross_group, ch.operation, ch.reduce)
        run_inner(flat, leaders)
        ch.sent += leaders.sent
    if local is not None:
        tree_broadcast(flat, local)
        ch.sent += local.sent


@algorithm("hierarchical", cost=hierarchical_cost)
def hierarchical_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    hierarchical_allreduce_with(flat, ch, INNER)
