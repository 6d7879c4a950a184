"""Which tokens each context-parallel rank holds: the sequence cut into 2 x cp equal chunks,
rank i holding chunk i and chunk 2 cp - 1 - i (one early, one late), so that under causal
attention every rank has the same work (Megatron-Core's and torchtitan's load balancing: with
plain contiguous parts the last rank would attend to the whole sequence and the first to its
part alone)."""

from __future__ import annotations

import torch

from gradmesh.errors import GradmeshError


def chunk_ids(cp: int, index: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that rank `index` holds, in the order it holds them."""
    return index, 2 * cp - 1 - index


def positions(length: int, cp: int, index: int, device: torch.device) -> torch.Tensor:
    """The positions in the whole sequence of `length` of the tokens rank `index` holds."""
    check_length(length, cp)
    c = length // (2 * cp)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, index)]
    )


def check_length(length: int, cp: int, where: str = "") -> None:
    """One line unless a sequence of `length` cuts into 2 x `cp` equal chunks."""
    if length % (2 * cp):
        fits = [k for k in range(1, length + 1) if length % (2 * k) == 0 and k <= 64]
        raise GradmeshError(
            f"{where}sequence of {length} tokens cannot be cut into 2 x --context-parallel "
            f"{cp} = {2 * cp} equal chunks (context-parallel sizes that fit: "
            f"{', '.join(map(str, fits)) or 'none'})"
        )


def take(x: torch.Tensor, cp: int, index: int, dim: int = 1) -> torch.Tensor:
    """Rank `index`'s part of `x` along `dim` (the sequence)."""
    return x.index_select(dim, positions(x.shape[dim], cp, index, x.device))


def restore(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (`take`'s, in rank order)."""
    cp = len(parts)
    halves = [p.chunk(2, dim) for p in parts]
    ordered = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(ordered, dim)
