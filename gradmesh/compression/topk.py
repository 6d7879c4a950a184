"""`topk`: only the k elements of largest magnitude travel, as (value, index) pairs.

k is a fraction of the tensor (`ratio`, default 1%) or a fixed count. Each rank picks its own
elements, so the pairs cannot be summed on the wire: every rank's pairs are allgathered (8 bytes
per pair, W - 1 messages per rank) and added where they land. Biased, it converges only with
error feedback (Deep Gradient Compression; Stich et al. 2018), which is on by default.
"""

from __future__ import annotations

import torch

from gradmesh.compression.base import Compressor, Encoded, State, _expect, as_bytes, split_bytes
from gradmesh.errors import GradmeshError


class TopK(Compressor):
    """Keep the k largest magnitudes (see the module docstring)."""

    name, wire_id, biased = "topk", 4, True

    def __init__(self, ratio: float = 0.01, count: int | None = None) -> None:
        if count is None and not 0 < ratio <= 1:
            raise GradmeshError(f"--compression-ratio must be in (0, 1], got {ratio}")
        if count is not None and count < 1:
            raise GradmeshError(f"topk count must be >= 1, got {count}")
        self.ratio, self.count = ratio, count

    def k(self, numel: int) -> int:
        wanted = self.count if self.count is not None else round(self.ratio * numel)
        return max(1, min(numel, wanted))

    def encode(self, x: torch.Tensor, state: State) -> Encoded:
        k = self.k(x.numel())
        flat = x.reshape(-1)
        index = flat.abs().topk(k, sorted=False).indices
        return Encoded(as_bytes(flat[index], index.to(torch.int32)), (x.numel(), k, 0))

    def decode(
        self, payload: torch.Tensor, ctx: tuple[int, int, int], out: torch.Tensor, alpha: float = 1
    ) -> None:
        n, k, extra = ctx
        _expect(n == out.numel() and 1 <= k <= n and extra == 0, "context")
        values, index = split_bytes(payload, (torch.float32, k), (torch.int32, k))
        _expect(int(index.min()) >= 0 and int(index.max()) < n, "index")
        out.view(-1).index_add_(0, index.long(), values, alpha=alpha)

    def describe(self) -> str:
        return f"topk {self.count}" if self.count is not None else f"topk {self.ratio:g}"
