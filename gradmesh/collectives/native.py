"""`native`: the backend's own allreduce (Gloo on CPU, NCCL on GPU).

The backend does not tell us what it sent, so bytes are modelled as a ring allreduce, which is
what Gloo and NCCL run for the large messages that dominate training: 2(p-1)/p * n per rank.
"""

import torch
import torch.distributed as dist

from gradmesh.collectives.api import algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.ring import ring_cost
from gradmesh.errors import GradmeshError, first_line


def modelled_bytes_sent(p: int, nbytes: int) -> int:
    """What one rank sends in a ring allreduce of `nbytes` over `p` ranks."""
    return 2 * (p - 1) * nbytes // p


@algorithm("native", cost=ring_cost)
def native_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    try:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ch.group)
    except RuntimeError as exc:  # the backend does not say which peer failed
        raise GradmeshError(
            f"rank {ch.rt.rank}: {ch.operation} failed: {first_line(exc)}"
        ) from None
    ch.sent += modelled_bytes_sent(ch.size, flat.numel() * flat.element_size())
