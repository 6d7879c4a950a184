"""Sparse gradients kept sparse (Horovod's `sparse_as_dense=False`): an embedding's gradient
touches a few rows, so each rank sends only those rows. Indices and values are all-gathered
(sizes differ between ranks) and summed by coalescing, as Horovod's sparse allreduce does; a
dense allreduce would send every row of the table."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gradmesh.collectives import allreduce
from gradmesh.runtime.world import collective_device
from gradmesh.sync.data_parallel.api import allgather_tensor, members
from gradmesh.sync.data_parallel.buckets import Bucket


def sparse_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's sparse COO `tensor` summed, still sparse and coalesced: the ranks' indices
    and values all-gathered over `group` (None: the world, on the communication thread's
    group). Every rank's tensor has the same shape and sparse dimensions."""
    mine = tensor.coalesce()
    if members(group)[2] == 1:
        return mine
    on = members(group)[0]
    indices = allgather_tensor(mine.indices().t().contiguous(), on)
    values = allgather_tensor(mine.values(), on)
    # checked: the indices came from other processes, and a bad one would write out of bounds
    summed = torch.sparse_coo_tensor(indices.t(), values, mine.shape, check_invariants=True)
    return summed.coalesce()


def row_sparse(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`grad` as a sparse tensor over the first dimension (an embedding's layout); no gradient
    is an empty one."""
    if grad is None:
        empty = torch.empty((1, 0), dtype=torch.int64, device=like.device)
        values = like.detach().new_empty((0, *like.shape[1:]))
        return torch.sparse_coo_tensor(empty, values, like.shape, check_invariants=True)
    if grad.is_sparse and grad.sparse_dim() == 1:
        return grad
    return (grad.to_dense() if grad.is_sparse else grad).to_sparse(1)


class SparseGradients:
    """The parameters of one optimizer whose gradients travel sparse: those with a sparse
    gradient on some rank at the first step, found bucket by bucket as each leaves (one small
    max-reduction of the bucket's flags, at the first step only), so that even the first step
    sends them sparse; the reducer then plans its buckets without them."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self.params = params
        self.sparse: list[nn.Parameter] = []
        self.dense: list[tuple[str, nn.Parameter]] = params
        self.decided = False
        """Whether the first step has found them all."""

    def designate(self, bucket: Bucket, mine: bool, group: dist.ProcessGroup | None) -> None:
        """At the first step, as `bucket` leaves: mark its sparse parameters to be skipped in
        its buffer (a joined rank, `mine` False, says none of its own are)."""
        params = [p for _, p in bucket.params]
        flags = torch.tensor(
            [float(mine and p.grad is not None and p.grad.is_sparse) for p in params],
            device=collective_device(),
        )
        if group is not None and flags.numel():
            allreduce(flags, "max", "native", group)
        for j, (p, flag) in enumerate(zip(params, flags.tolist(), strict=True)):
            if flag > 0:
                bucket.skip.add(j)
                self.sparse.append(p)

    def settle(self) -> bool:
        """After the first step's buckets: whether any parameter travels sparse (the buckets
        are then to be planned anew, without them)."""
        self.decided = True
        found = {id(p) for p in self.sparse}
        self.dense = [(n, p) for n, p in self.params if id(p) not in found]
        return bool(self.sparse)

    def reduce(self, mine: bool, divisor: float, group: dist.ProcessGroup | None) -> None:
        """Each sparse parameter's gradient summed over `group` and divided by `divisor`; a
        joined rank (`mine` False) sends none."""
        for p in self.sparse:
            summed = sparse_sum(row_sparse(p.grad if mine else None, p), group)
            p.grad = summed / divisor if divisor != 1.0 else summed
