"""`tree`: binomial-tree reduce to a root, then binomial-tree broadcast back down.

In round k a rank whose relative index has bit k set sends its partial sum to the rank 2^k below
it and drops out; after ceil(log2 p) rounds the root holds the sum. The broadcast runs the same
tree in reverse. Latency grows with log p, but every round moves the whole vector, so for large
messages the tree loses to the ring.

Cost: 2 ceil(log2 p) (alpha + n beta) + ceil(log2 p) n gamma.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradmesh.collectives.api import algorithm, run_collective
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.cost import CostParams, log2ceil


def tree_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    rounds = log2ceil(p)
    return 2 * rounds * (c.alpha + nbytes * c.beta) + rounds * nbytes * c.gamma


def tree_reduce(flat: torch.Tensor, ch: Channel, root: int = 0) -> None:
    """Sum `flat` over the group into group index `root` (other ranks' `flat` is clobbered)."""
    p = ch.size
    me = (ch.index - root) % p
    incoming = ch.scratch(flat, flat.numel())
    mask = 1
    while mask < p:
        if me & mask:
            ch.send(flat, (me - mask + root) % p)
            return
        if me + mask < p:
            ch.recv(incoming, (me + mask + root) % p)
            ch.combine(flat, incoming)
        mask <<= 1


def tree_broadcast(flat: torch.Tensor, ch: Channel, root: int = 0) -> None:
    """Copy group index `root`'s `flat` to every member, down a binomial tree."""
    p = ch.size
    me = (ch.index - root) % p
    mask = 1
    while mask < p:
        if me & mask:
            ch.recv(flat, (me - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if me + mask < p and flat.numel():
            child = (me + mask + root) % p
            sends.append((ch.isend(flat, child), child))
        mask >>= 1
    for work, child in sends:
        ch.wait(work, child, "send to")


@algorithm("tree", cost=tree_cost)
def tree_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    tree_reduce(flat, ch)
    tree_broadcast(flat, ch)


def broadcast(
    tensor: torch.Tensor, root: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Copy the tensor of global rank `root` into `tensor` on every rank of `group`, in place."""

    def body(view: torch.Tensor, ch: Channel) -> None:
        tree_broadcast(view, ch, ch.ranks.index(root))

    return run_collective(tensor, "tree broadcast", body, group)
