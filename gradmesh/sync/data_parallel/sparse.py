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
    """The parameters of one optimizer whose gradients travel sparse: those that had a sparse
    gradient on some rank at the first step (found once, by one small max-reduction). That
    step's buckets carry them densified but do not write them back; the reducer then plans its
    buckets without them."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self.params = params
        self.sparse: list[nn.Parameter] | None = None
        self.dense: list[tuple[str, nn.Parameter]] = params

    def designate(
        self,
        mine: bool,
        group: dist.ProcessGroup | None,
        where: dict[int, tuple[Bucket, int]],
    ) -> bool:
        """At the first step: find the sparse parameters, mark them to be skipped in `where`'s
        buckets; whether any were found (the buckets are to be planned anew)."""
        if self.sparse is not None:
            return False
        flags = torch.tensor(
            [float(mine and p.grad is not None and p.grad.is_sparse) for _, p in self.params],
            device=collective_device(),
        )
        if group is not None and flags.numel():
            allreduce(flags, "max", "native", group)
        self.sparse = [p for (_, p), flag in zip(self.params, flags, strict=True) if flag > 0]
        self.dense = [(n, p) for (n, p), flag in zip(self.params, flags, strict=True) if flag == 0]
        for p in self.sparse:
            bucket, j = where[id(p)]
            bucket.skip.add(j)
        return bool(self.sparse)

    def reduce(self, mine: bool, divisor: float, group: dist.ProcessGroup | None) -> None:
        """Each sparse parameter's gradient summed over `group` and divided by `divisor`; a
        joined rank (`mine` False) sends none."""
        for p in self.sparse or ():
            summed = sparse_sum(row_sparse(p.grad if mine else None, p), group)
            p.grad = summed / divisor if divisor != 1.0 else summed
