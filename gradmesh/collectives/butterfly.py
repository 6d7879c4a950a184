"""`butterfly`: recursive doubling for small messages, Rabenseifner's recursive halving then
doubling for large ones, with the standard fold-in for world sizes that are not a power of two.

Fold-in: with p = 2^k + r, the first 2r ranks pair up; each even one hands its vector to its odd
partner and waits, leaving 2^k ranks. Recursive doubling: in round i partners 2^i apart swap whole
vectors and add (log p rounds of n bytes). Rabenseifner: partners swap halves of their current
range and keep the reduced half (reduce-scatter in log p rounds, (p-1)/p n bytes), then swap the
finished ranges back (all-gather). Fold-out returns the result to the waiting ranks.

Cost (p a power of two): doubling log p (alpha + n beta + n gamma);
Rabenseifner 2 log p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma; plus 2 (alpha + n beta) + n gamma
for the fold when p is not a power of two. The variant with the lower predicted cost runs.
"""

from __future__ import annotations

import torch

from gradmesh.collectives.api import algorithm
from gradmesh.collectives.channel import Channel
from gradmesh.collectives.cost import DEFAULT_PARAMS, CostParams, log2ceil


def _fold_cost(p: int, nbytes: int, c: CostParams) -> float:
    return 0.0 if p & (p - 1) == 0 else 2 * (c.alpha + nbytes * c.beta) + nbytes * c.gamma


def doubling_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    q = 1 << (p.bit_length() - 1)
    rounds = log2ceil(q)
    return _fold_cost(p, nbytes, c) + rounds * (c.alpha + nbytes * c.beta + nbytes * c.gamma)


def halving_doubling_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    q = 1 << (p.bit_length() - 1)
    share = (q - 1) / q * nbytes
    return (
        _fold_cost(p, nbytes, c) + 2 * log2ceil(q) * c.alpha + 2 * share * c.beta + share * c.gamma
    )


def butterfly_cost(p: int, nbytes: int, c: CostParams, local_size: int = 1) -> float:
    return min(doubling_cost(p, nbytes, c), halving_doubling_cost(p, nbytes, c))


def _recursive_doubling(flat: torch.Tensor, ch: Channel, me: int, q: int, real: list[int]) -> None:
    incoming = ch.scratch(flat, flat.numel())
    mask = 1
    while mask < q:
        partner = real[me ^ mask]
        ch.exchange(flat, partner, incoming, partner)
        ch.combine(flat, incoming)
        mask <<= 1


def _halving_doubling(flat: torch.Tensor, ch: Channel, me: int, q: int, real: list[int]) -> None:
    lo, hi = 0, flat.numel()
    incoming = ch.scratch(flat, (hi + 1) // 2)
    kept: list[tuple[int, int, int]] = []  # (partner, lo, hi) before each halving
    mask = q >> 1
    while mask:
        partner = real[me ^ mask]
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & mask == 0 else ((mid, hi), (lo, mid))
        kept.append((partner, lo, hi))
        ch.exchange(flat[give[0] : give[1]], partner, incoming[: keep[1] - keep[0]], partner)
        ch.combine(flat[keep[0] : keep[1]], incoming[: keep[1] - keep[0]])
        lo, hi = keep
        mask >>= 1
    for partner, parent_lo, parent_hi in reversed(kept):
        other = (parent_lo, lo) if lo > parent_lo else (hi, parent_hi)
        ch.exchange(flat[lo:hi], partner, flat[other[0] : other[1]], partner)
        lo, hi = parent_lo, parent_hi


@algorithm("butterfly", cost=butterfly_cost)
def butterfly_allreduce(
    flat: torch.Tensor, ch: Channel, params: CostParams = DEFAULT_PARAMS
) -> None:
    p, idx = ch.size, ch.index
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    if idx < 2 * extra:  # fold-in: even ranks hand over to their odd partner and wait
        if idx % 2 == 0:
            ch.send(flat, idx + 1)
            ch.recv(flat, idx + 1)
            return
        incoming = ch.scratch(flat, flat.numel())
        ch.recv(incoming, idx - 1)
        ch.combine(flat, incoming)
        me = idx // 2
    else:
        me = idx - extra
    real = [2 * v + 1 if v < extra else v + extra for v in range(q)]  # folded index -> group index
    nbytes = flat.numel() * flat.element_size()
    if halving_doubling_cost(p, nbytes, params) < doubling_cost(p, nbytes, params):
        _halving_doubling(flat, ch, me, q, real)
    else:
        _recursive_doubling(flat, ch, me, q, real)
    if idx < 2 * extra:  # fold-out
        ch.send(flat, idx - 1)
