"""Horovod's `hvd.Compression`: gradmesh's compressors under Horovod's names, and with Horovod's
own interface where Horovod has one.

`Compression.none`, `.fp16` (and gradmesh's `.bf16`) answer `compress(tensor) -> (compressed,
ctx)` and `decompress(compressed, ctx)` as Horovod's do: a floating tensor cast to the narrow
type and back to its own dtype (`ctx`); other dtypes pass unchanged. A script's own class with
those two static methods works in `DistributedOptimizer(compression=...)` too
(`gradmesh.compression.base.CodecAdapter`). gradmesh's other compressors (`int8`, `topk`,
`sign`, `powersgd`) need a state and an all-gather of their messages, so they have gradmesh's
interface only.
"""

from __future__ import annotations

from typing import Any

import torch

from gradmesh.compression.base import NoCompression
from gradmesh.compression.quantize import Cast
from gradmesh.compression.registry import make

__all__ = [
    "Compression",
]


class _None(NoCompression):
    """Horovod's `Compression.none`: the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _Narrow(Cast):
    """Horovod's `Compression.fp16` (and bf16): floating tensors cast to the narrow type."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point():
            return tensor.to(self.dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """`hvd.Compression.none` / `hvd.Compression.fp16` with Horovod's `compress`/`decompress`,
    and gradmesh's other compressors (`bf16`, `int8`, `topk`, `sign`, `powersgd`, with error
    feedback where they need it)."""

    none = _None()
    fp16 = _Narrow("fp16", torch.float16, 1)
    bf16 = _Narrow("bf16", torch.bfloat16, 2)
    int8 = make("int8")
    topk = make("topk")
    sign = make("sign")
    powersgd = make("powersgd")
