"""All-to-all context parallelism (DeepSpeed-Ulysses): each rank holds its chunks of the
sequence for every head; one all-to-all turns that into every chunk of the sequence for 1/cp
of the heads, each rank runs ordinary causal attention (torch's fused kernel) on its heads over
the whole sequence, and a second all-to-all turns it back. Four all-to-alls a layer (q, k, v,
out) of 1/cp of the local activations each way, whatever the ring's length; the heads must
divide by cp."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.errors import PeerFailure, first_line
from gradmesh.layout.context.chunks import restore, take
from gradmesh.layout.context.ring import KIND
from gradmesh.runtime.mesh import Axis
from gradmesh.runtime.world import get_runtime


def _exchange(x: torch.Tensor, axis: Axis, what: str) -> torch.Tensor:
    """All-to-all of `x` (cp, ...): part j to rank j; returns part i from rank i."""
    rt = get_runtime()
    x = x.contiguous()
    out = torch.empty_like(x)
    started = time.perf_counter()
    try:
        dist.all_to_all_single(out, x, group=axis.group, async_op=True).wait(rt.timeout)
    except RuntimeError as exc:
        others = ", ".join(str(r) for r in axis.ranks if r != rt.rank)
        raise PeerFailure(
            f"rank {rt.rank}: all-to-all attention ({what}) on cp: waiting for rank(s) "
            f"{others} failed: {first_line(exc)}"
        ) from None
    sent = x.numel() * x.element_size() * (axis.size - 1) // axis.size
    rt.comm.add(sent, time.perf_counter() - started, KIND)
    return out


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
