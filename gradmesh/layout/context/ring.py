"""Ring attention: causal attention over a sequence whose chunks are spread over the cp ranks
(`chunks`), each rank's keys and values passed once around the ring.

Forward: at step s a rank holds the keys and values of rank (index - s); it attends its two
query chunks to the key chunks before them (the diagonal chunk causally), keeping each query's
log-sum-exp, and merges the partial results as online softmax does; the next step's keys and
values travel while the block computes. Backward goes around the ring again: each rank
computes its queries' gradient against each visiting block, and that block's key and value
gradients, which travel with the block and arrive home after the last step. Only the rank's
own queries, keys, values, output and log-sum-exp are kept for backward (O(local)), which is
what lets a sequence cp times longer fit.

Why our own: torch's `context_parallel` (torch.distributed.tensor.experimental) is
experimental, changes across the torch versions gradmesh supports (2.11-2.15), works on DTensor
and CUDA kernels, and does not run on Gloo/CPU; this one is plain tensor algebra on any device
and dtype (the scores of one block pair at a time: a fused kernel would not hold them, left for
the GPU work), with gradmesh's channels (counted bytes, errors naming rank and peer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from gradmesh.collectives.channel import Channel
from gradmesh.layout.context.chunks import chunk_ids
from gradmesh.runtime.mesh import Axis
from gradmesh.runtime.world import get_runtime

KIND = "context_parallel"
"""The bytes' kind in the runtime's counts and the report."""


class Ring:
    """The cp axis as the ring sees it: its channel, neighbours, and counted transfers."""

    def __init__(self, axis: Axis) -> None:
        self.axis, self.rt = axis, get_runtime()
        self.size, self.index = axis.size, axis.index
        self.next, self.prev = (self.index + 1) % self.size, (self.index - 1) % self.size
        self.waited = 0.0

    def channel(self, what: str) -> Channel:
        return Channel(self.rt, self.axis.group, f"ring attention {what} on cp")

    def start(self, ch: Channel, send: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Send `send` to the next rank while receiving the previous rank's into a new
        tensor; returns it and the pending works (`finish` waits for them)."""
        recv = torch.empty_like(send)
        return recv, [
            (ch.irecv(recv, self.prev), self.prev),
            (ch.isend(send, self.next), self.next),
        ]

    def finish(self, ch: Channel, works: list[Any]) -> None:
        """Wait for `start`'s works (the seconds waited are the exchange's, counted by
        `count`)."""
        started = time.perf_counter()
        for work, peer in works:
            ch.wait(work, peer, "exchange with")
        self.waited += time.perf_counter() - started

    def count(self, ch: Channel) -> None:
        """The channel's bytes and the seconds waited, in the runtime's counts."""
        self.rt.comm.add(ch.sent, self.waited, KIND)
        self.waited = 0.0


TILE = 1 << 16
"""Score elements (per batch and head) one tile of query rows computes at once: the ring holds
one tile's scores, not a block's, so that its transient stays small beside the activations at
any sequence length (a block of c query rows x c keys is c / (TILE / c) tiles)."""


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, offset: int | None) -> torch.Tensor:
    """q k^T scale; with `offset` (a diagonal block), key j masked for query row i when
    j > offset + i."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if offset is not None:
        rows = torch.arange(q.shape[-2], device=s.device)[:, None] + offset
        s = s.masked_fill(torch.arange(k.shape[-2], device=s.device)[None, :] > rows, -torch.inf)
    return s


def _pairs(cp: int, index: int, src: int) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) for the blocks rank `index` computes against the keys
    of rank `src`: a key chunk before the query chunk whole, the same chunk causally."""
    mine, theirs = chunk_ids(cp, index), chunk_ids(cp, src)
    return [
        (a, b, qid == kid)
        for a, qid in enumerate(mine)
        for b, kid in enumerate(theirs)
        if kid <= qid
    ]


def _tiles(ring: Ring, src: int, c: int) -> Iterator[tuple[slice, slice, int | None]]:
    """(query rows, key columns, causal offset) of every tile this rank computes against the
    keys of rank `src` (its chunks of c tokens): a diagonal block's tile of rows r0..r1 needs
    the keys up to r1 only."""
    rows_a_tile = max(1, min(c, TILE // max(c, 1)))
    for a, b, causal in _pairs(ring.size, ring.index, src):
        for r0 in range(0, c, rows_a_tile):
            r1 = min(c, r0 + rows_a_tile)
            cols = slice(b * c, b * c + (r1 if causal else c))
            yield slice(a * c + r0, a * c + r1), cols, r0 if causal else None


class RingAttention(torch.autograd.Function):
    """out = causal softmax(q k^T scale) v over the whole sequence, from this rank's chunks
    of q, k, v (batch, heads, 2c, head dim)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ring: Ring
    ) -> torch.Tensor:
        work = torch.promote_types(q.dtype, torch.float32)
        c = q.shape[-2] // 2
        out = torch.zeros(q.shape, dtype=work, device=q.device)
        lse = torch.full(q.shape[:-1], -torch.inf, dtype=work, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        ch = ring.channel("forward")
        for step in range(ring.size):
            pending = ring.start(ch, kv) if step < ring.size - 1 else None
            for rows, cols, offset in _tiles(ring, (ring.index - step) % ring.size, c):
                s = _scores(q[..., rows, :], kv[0][..., cols, :], scale, offset).to(work)
                part_lse = s.logsumexp(-1)
                part = torch.matmul(
                    torch.exp(s - part_lse[..., None]), kv[1][..., cols, :].to(work)
                )
                merged = torch.logaddexp(lse[..., rows], part_lse)
                out[..., rows, :] = (
                    out[..., rows, :] * torch.exp(lse[..., rows] - merged)[..., None]
                    + part * torch.exp(part_lse - merged)[..., None]
                )
                lse[..., rows] = merged
            if pending is not None:
                ring.finish(ch, pending[1])
                kv = pending[0]
        ring.count(ch)
        out = out.to(q.dtype)  # kept as fused attention keeps it, in the inputs' dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.ring = scale, ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, ring = ctx.scale, ctx.ring
        work, c = lse.dtype, q.shape[-2] // 2
        dout = dout.to(work)
        delta = (dout * out.to(work)).sum(-1)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=work, device=q.device)
        ch = ring.channel("backward")
        for step in range(ring.size):
            pending = ring.start(ch, kv) if step < ring.size - 1 else None
            for rows, cols, offset in _tiles(ring, (ring.index - step) % ring.size, c):
                qa, kb, vb = (
                    t[..., sl, :].to(work) for t, sl in ((q, rows), (kv[0], cols), (kv[1], cols))
                )
                p = torch.exp(_scores(qa, kb, scale, offset) - lse[..., rows, None])
                dkv[1][..., cols, :] += torch.matmul(p.transpose(-1, -2), dout[..., rows, :])
                ds = p * (
                    torch.matmul(dout[..., rows, :], vb.transpose(-1, -2)) - delta[..., rows, None]
                )
                dq[..., rows, :] += torch.matmul(ds, kb) * scale
                dkv[0][..., cols, :] += torch.matmul(ds.transpose(-1, -2), qa) * scale
            if ring.size > 1:  # this block's gradients on to the next rank: home after the last
                back = ring.start(ch, dkv)
                ring.finish(ch, back[1])
                dkv = back[0]
            if pending is not None:
                ring.finish(ch, pending[1])
                kv = pending[0]
        ring.count(ch)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ring: Ring
) -> torch.Tensor:
    out: torch.Tensor = RingAttention.apply(q, k, v, scale, ring)  # type: ignore[no-untyped-call]
    return out
