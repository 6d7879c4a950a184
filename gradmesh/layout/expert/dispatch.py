"""Tokens to their experts and back over the ep axis: each rank holds E / ep consecutive
experts; a mixture's tokens, sorted by expert, go to the ranks holding their experts in one
all-to-all (the counts first, in a small one), each rank runs its experts on what it received
from every rank, and a second all-to-all brings the outputs home in the order they left.
Backward is the same exchange reversed (`_AllToAll`). Uneven splits: dropless routing sends
whatever the router chose, so the splits are each step's counts, read on the host."""

from __future__ import annotations

from typing import Any

import torch

from gradmesh.collectives.alltoall import all_to_all
from gradmesh.models.moe import MoE
from gradmesh.runtime.mesh import Axis

KIND = "expert_parallel"
"""The bytes' kind in the runtime's counts and the report."""


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: Axis, what: str
) -> torch.Tensor:
    """All-to-all of the rows of `x`: `in_splits[j]` rows to rank j, `out_splits[i]` from
    rank i."""
    return all_to_all(x, axis, f"expert dispatch ({what})", KIND, (out_splits, in_splits))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], axis: Axis
    ) -> torch.Tensor:
        ctx.splits, ctx.axis = (out_splits, in_splits), axis
        return _exchange(x, out_splits, in_splits, axis, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.axis, "backward"), None, None, None


def dispatcher(axis: Axis) -> Any:
    """A mixture's `dispatch` over `axis` (`gradmesh.models.moe.Dispatch`)."""

    def dispatch(moe: MoE, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = axis.size
        mine = counts.view(ep, -1)  # row j: my tokens for rank j's experts
        theirs = all_to_all(mine, axis, "expert dispatch (counts)", KIND)
        send = mine.sum(1).tolist()
        grid = theirs.tolist()  # grid[i][e]: rank i's tokens for my expert e
        got: torch.Tensor = _AllToAll.apply(tokens, [sum(r) for r in grid], send, axis)  # type: ignore[no-untyped-call]
        order = _by_expert(grid, tokens.device)
        local = [sum(col) for col in zip(*grid, strict=True)]
        out = moe.run(got[order], local)
        home = torch.empty_like(out).index_copy(0, order, out)
        back: torch.Tensor = _AllToAll.apply(home, send, [sum(r) for r in grid], axis)  # type: ignore[no-untyped-call]
        return back

    return dispatch


def _by_expert(grid: list[list[int]], device: torch.device) -> torch.Tensor:
    """The rows received (grouped by sending rank, then expert) in expert order (then rank)."""
    starts: list[list[int]] = []
    at = 0
    for row in grid:
        starts.append([])
        for n in row:
            starts[-1].append(at)
            at += n
    pieces = [
        torch.arange(starts[i][e], starts[i][e] + grid[i][e], device=device)
        for e in range(len(grid[0]))
        for i in range(len(grid))
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
