"""`native`: the backend's own allreduce (Gloo on CPU, NCCL on GPU).

The backend does not tell us what it sent, so bytes are modelled as a ring allreduce, which is
what Gloo and NCCL run for the large messages that dominate training: 2(p-1)/p * n per rank.
"""

import torch
import torch.distributed as dist

from gradmesh.collectives.api import ALGORITHMS


@ALGORITHMS.register("native")
def native_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    p = dist.get_world_size(group)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    nbytes = tensor.numel() * tensor.element_size()
    return 2 * (p - 1) * nbytes // p
