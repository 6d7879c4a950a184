"""`star`: every rank sends to one root, which sums and sends the result back.

The single-parameter-server pattern, kept as the baseline that shows the bottleneck: the root's
link carries 2(p-1) full messages, so time grows linearly with p.

Cost: 2 (p-1) (alpha + n beta) + (p-1) n gamma.
"""

from __future__ import annotations

import torch

from gradmesh.collectives.api import algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.cost import CostParams


def star_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    return 2 * (p - 1) * (c.alpha + nbytes * c.beta) + (p - 1) * nbytes * c.gamma


@algorithm("star", cost=star_cost)
def star_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    if ch.index != 0:
        ch.send(flat, 0)
        ch.recv(flat, 0)
        return
    if not flat.numel():
        return
    slots = [ch.scratch(flat, flat.numel(), slot) for slot in (0, 1)]
    # receive from peer k+1 while adding what came from peer k; sum in rank order
    pending = ch.irecv(slots[1], 1)
    for peer in range(1, ch.size):
        ch.wait(pending, peer, "receive from")
        if peer + 1 < ch.size:
            pending = ch.irecv(slots[(peer + 1) % 2], peer + 1)
        ch.combine(flat, slots[peer % 2])
    sends = [(ch.isend(flat, peer), peer) for peer in range(1, ch.size)]
    for work, peer in sends:
        ch.wait(work, peer, "send to")
