"""All-to-all context parallelism (DeepSpeed-Ulysses): each rank holds its chunks of the
sequence for every head; one all-to-all turns that into every chunk of the sequence for 1/cp
of the heads, each rank runs ordinary causal attention (torch's fused kernel) on its heads over
the whole sequence, and a second all-to-all turns it back. Four all-to-alls a layer (q, k, v,
out) of 1/cp of the local activations each way, whatever the ring's length; the heads must
divide by cp."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradmesh.collectives.alltoall import all_to_all
from gradmesh.layout.context.chunks import restore, take
from gradmesh.layout.context.ring import KIND
from gradmesh.runtime.mesh import Axis


def _exchange(x: torch.Tensor, axis: Axis, what: str) -> torch.Tensor:
    """All-to-all of `x` (cp, ...): part j to rank j; returns part i from rank i."""
    return all_to_all(x, axis, f"all-to-all attention ({what})", KIND)


class _AllToAll(torch.autograd.Function):
    """`_exchange` with its own adjoint as backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return _exchange(x, axis, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.axis, "backward"), None


def _to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(batch, heads, local sequence, d) -> (batch, heads / cp, whole sequence, d)."""
    b, h, n, d = x.shape
    parts = x.view(b, axis.size, h // axis.size, n, d).transpose(0, 1)
    got: torch.Tensor = _AllToAll.apply(parts, axis)  # type: ignore[no-untyped-call]
    return restore(list(got.unbind(0)), dim=2)


def _to_sequence(y: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The inverse of `_to_heads`."""
    parts = torch.stack([take(y, axis.size, i, dim=2) for i in range(axis.size)])
    got: torch.Tensor = _AllToAll.apply(parts, axis)  # type: ignore[no-untyped-call]
    cp, b, hp, n, d = got.shape
    return got.transpose(0, 1).reshape(b, cp * hp, n, d)


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    axis: Axis,
    attend: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Causal attention of this rank's chunks through `attend` (torch's own
    `scaled_dot_product_attention`) on 1/cp of the heads over the whole sequence."""
    whole = [_to_heads(t, axis) for t in (q, k, v)]
    return _to_sequence(attend(*whole, is_causal=True, scale=scale), axis)
