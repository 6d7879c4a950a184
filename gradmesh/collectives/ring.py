"""`ring`: reduce-scatter then all-gather around a ring, 2(p-1) steps, chunked and pipelined.

The vector is cut into p segments; in each of the p-1 reduce-scatter steps every rank sends one
segment to its right neighbour and adds the one arriving from its left, after which each rank
holds the full sum of one segment; p-1 all-gather steps pass the finished segments around.

Pipelining: each segment travels as K pieces. A piece is forwarded to the right as soon as it has
been reduced, while the next piece is still arriving, so a large message streams through the
ring instead of moving step by step; receives land in two reused scratch segments.

Cost: 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma -- the bandwidth term does not grow with
p, which is why the ring is the bandwidth-optimal allreduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradmesh.collectives.agreement import Check
from gradmesh.collectives.api import algorithm, run_collective
from gradmesh.collectives.channel import Channel, resolve_group
from gradmesh.collectives.cost import CostParams
from gradmesh.runtime.compat import all_gather_single

PIECE_BYTES = 2 << 20
"""Pipelining granularity. On loopback with 2 cores fewer, larger messages win (CPU-bound); on a
real link smaller pieces overlap better. 2 MiB measured best of 0.5, 2 and 32 MiB on loopback."""
MAX_PIECES = 32


def ring_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    return (
        2 * (p - 1) * c.alpha + 2 * (p - 1) / p * nbytes * c.beta + (p - 1) / p * nbytes * c.gamma
    )


def allgather_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    """`allgather` (either form) of a result of `nbytes` over `p` ranks: p - 1 steps, each
    rank receiving the (p - 1) / p of the result it lacks."""
    return (p - 1) * c.alpha + (p - 1) / p * nbytes * c.beta if p > 1 else 0.0


def bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Near-equal [start, end) ranges covering 0..n."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def _pieces(n: int, p: int, element_size: int) -> int:
    segment_bytes = n * element_size // p
    return max(1, min(MAX_PIECES, -(-segment_bytes // PIECE_BYTES)))


def ring_pass(flat: torch.Tensor, ch: Channel, reduce: bool, gather: bool) -> None:
    """The ring's reduce-scatter and/or all-gather phases over `flat`, in place.

    Segment i ends reduce-scatter on group index i; all-gather starts from that layout.
    """
    p, r = ch.size, ch.index
    right, left = (r + 1) % p, (r - 1) % p
    segments = bounds(flat.numel(), p)
    k = _pieces(flat.numel(), p, flat.element_size())
    piece_bounds = [[(a + s, a + e) for s, e in bounds(b - a, k)] for a, b in segments]
    # step -> (segment received, whether it is added); the segment sent at step s+1 is the one
    # received at step s, so pieces stream onward as soon as they are ready
    steps = [((r - s - 2) % p, True) for s in range(p - 1)] if reduce else []
    steps += [((r - t - 1) % p, False) for t in range(p - 1)] if gather else []
    first_sent = (r - 1) % p if reduce else r
    longest = max(b - a for a, b in segments)
    scratch = [ch.scratch(flat, longest, slot) for slot in (0, 1)] if reduce else []
    sending: dict[tuple[int, int], dist.Work] = {}

    def piece(segment: int, j: int) -> torch.Tensor:
        a, b = piece_bounds[segment][j]
        return flat[a:b]

    def send(segment: int, j: int, step: int) -> None:
        data = piece(segment, j)
        if data.numel():
            sending[(segment, j)] = ch.isend(data, right, step * k + j)

    def post_receive(step: int, j: int) -> tuple[dist.Work | None, torch.Tensor]:
        segment, added = steps[step]
        if added:
            a, b = piece_bounds[segment][j]
            start = a - segments[segment][0]
            target = scratch[step % 2][start : start + (b - a)]
        else:
            target = piece(segment, j)
            if (segment, j) in sending:  # it was sent earlier: let that finish before overwriting
                ch.wait(sending.pop((segment, j)), right, "send to")
        return (ch.irecv(target, left, step * k + j) if target.numel() else None), target

    # receives are posted before the matching sends so data lands straight in its buffer
    pending = [post_receive(0, j) for j in range(k)] if steps else []
    for j in range(k):
        send(first_sent, j, 0)
    for step, (segment, added) in enumerate(steps):
        upcoming = []
        for j in range(k):
            work, target = pending[j]
            if work is not None:
                ch.wait(work, left, "receive from")
            if added:
                ch.combine(piece(segment, j), target)
            if step + 1 < len(steps):
                upcoming.append(post_receive(step + 1, j))
                send(segment, j, step + 1)
        pending = upcoming
    for work in sending.values():
        ch.wait(work, right, "send to")


@algorithm("ring", cost=ring_cost)
def ring_allreduce(flat: torch.Tensor, ch: Channel) -> None:
    ring_pass(flat, ch, reduce=True, gather=True)


def reduce_scatter(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    check: Check | None = None,
    kind: str = "sync",
) -> torch.Tensor:
    """Sum `tensor` over the group and return this rank's block of the flattened result: group
    index i gets elements [i*n//p, (i+1)*n//p). `tensor` is clobbered."""
    flat = tensor.reshape(-1)
    box: list[torch.Tensor] = []

    def body(view: torch.Tensor, ch: Channel) -> None:
        ring_pass(view, ch, reduce=True, gather=False)
        a, b = bounds(view.numel(), ch.size)[ch.index]
        box.append(view[a:b].clone())

    run_collective(flat, "ring reduce_scatter", body, group, check=check, kind=kind)
    if not box:  # a group of one: the whole tensor is this rank's block
        return flat.clone()
    return box[0]


def allgather(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    check: Check | None = None,
    kind: str = "sync",
    backend: bool = False,
) -> torch.Tensor:
    """Concatenate every rank's `tensor` (same shape everywhere) along a new first dimension:
    around gradmesh's ring, or with `backend` the backend's own all-gather."""
    p = dist.get_world_size(resolve_group(group))
    ranks = dist.get_process_group_ranks(resolve_group(group))
    out = torch.empty((p, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    mine = out[ranks.index(dist.get_rank())]
    mine.copy_(tensor)

    def ring(view: torch.Tensor, ch: Channel) -> None:
        ring_pass(view, ch, reduce=False, gather=True)

    def native(view: torch.Tensor, ch: Channel) -> None:
        own = tensor.detach().reshape(-1).contiguous()  # not a view of the output
        ch.backend_collective(lambda: all_gather_single(view, own, group=ch.group, async_op=True))
        ch.sent += (p - 1) * own.numel() * own.element_size()  # modelled: a ring's bytes

    operation = "native allgather" if backend else "ring allgather"
    run_collective(out, operation, native if backend else ring, group, check=check, kind=kind)
    return out
