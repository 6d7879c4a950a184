"""`native`: the backend's own allreduce (Gloo on CPU, NCCL on GPU).

The backend does not tell us what it sent, so bytes are modelled as a ring allreduce, which is
what Gloo and NCCL run for the large messages that dominate training: 2(p-1)/p * n per rank.
"""

import torch
import torch.distributed as dist

from gradmesh.collectives.api import algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.ring import ring_cost


def modelled_bytes_sent(p: int, nbytes: int) -> int:
    """What one rank sends in a ring allreduce of `nbytes` over `p` ranks."""
    return 2 * (p - 1) * nbytes // p


REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


@algorithm("native", cost=ring_cost)
def native_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    op = REDUCE_OPS[ch.reduce]
    ch.backend_collective(lambda: dist.all_reduce(flat, op=op, group=ch.group, async_op=True))
    ch.sent += modelled_bytes_sent(ch.size, flat.numel() * flat.element_size())
