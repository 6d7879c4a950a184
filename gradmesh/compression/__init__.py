"""Gradient compression codecs, Horovod's shape: `compress(t) -> (payload, ctx)`,
`decompress(payload, ctx) -> tensor`. The payload must still be summable by an allreduce."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gradmesh.registry import Registry


class Codec(Protocol):
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor: ...


CODECS: Registry[Codec] = Registry("compression")


class NoCompression:
    """The identity: gradients travel in their own dtype."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        return payload


class FP16Compression:
    """Floating-point gradients travel as float16 (half the bytes), summed in float16."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not tensor.is_floating_point() or tensor.dtype == torch.float16:
            return tensor, None
        return tensor.to(torch.float16), tensor.dtype

    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        return payload if ctx is None else payload.to(ctx)


CODECS.register("none")(NoCompression())
CODECS.register("fp16")(FP16Compression())


def resolve(codec: Codec | str | None) -> Codec:
    """A codec from a name, an object, or None (no compression)."""
    if codec is None:
        return CODECS.get("none")
    return CODECS.get(codec) if isinstance(codec, str) else codec
