"""The compressors by name (`COMPRESSORS`), `make` (a compressor with its settings and error
feedback), `resolve` (a name, a compressor or a Horovod-style codec) and `reduce` (a compressed
reduction, counted in the runtime's stats)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradmesh.compression.base import (
    CodecAdapter,
    Compressor,
    ErrorFeedback,
    Link,
    NoCompression,
    State,
)
from gradmesh.compression.config import ERROR_FEEDBACK
from gradmesh.compression.powersgd import PowerSGD
from gradmesh.compression.quantize import Cast, Int8, Sign
from gradmesh.compression.topk import TopK
from gradmesh.errors import GradmeshError
from gradmesh.registry import Registry
from gradmesh.runtime.world import get_runtime, is_initialized

Factory = Callable[[float, int], Compressor]
"""factory(ratio, rank) -> a compressor with those settings (each uses what applies to it)."""

COMPRESSORS: Registry[Factory] = Registry("compressor")
COMPRESSORS.register("none")(lambda ratio, rank: NoCompression())
COMPRESSORS.register("fp16")(lambda ratio, rank: Cast("fp16", torch.float16, 1))
COMPRESSORS.register("bf16")(lambda ratio, rank: Cast("bf16", torch.bfloat16, 2))
COMPRESSORS.register("int8")(lambda ratio, rank: Int8())
COMPRESSORS.register("topk")(lambda ratio, rank: TopK(ratio))
COMPRESSORS.register("sign")(lambda ratio, rank: Sign())
COMPRESSORS.register("powersgd")(lambda ratio, rank: PowerSGD(rank))


def make(
    name: str, ratio: float = 0.01, rank: int = 1, error_feedback: str | bool = "auto"
) -> Compressor:
    """The compressor called `name` with these settings; error feedback "auto" turns it on for
    the biased ones (int8, topk, sign, powersgd)."""
    if not 0 < ratio <= 1:
        raise GradmeshError(f"--compression-ratio must be in (0, 1], got {ratio}")
    name = COMPRESSORS.canonical(name)
    if isinstance(error_feedback, bool):
        error_feedback = "on" if error_feedback else "off"
    error_feedback = error_feedback.lower()
    if error_feedback not in ERROR_FEEDBACK:
        raise GradmeshError(
            f"unknown --error-feedback {error_feedback!r} (valid: {', '.join(ERROR_FEEDBACK)})"
        )
    compressor = COMPRESSORS.get(name)(ratio, rank)
    wanted = compressor.biased if error_feedback == "auto" else error_feedback == "on"
    return ErrorFeedback(compressor) if wanted and name != "none" else compressor


def resolve(spec: Compressor | str | Any | None) -> Compressor:
    """A compressor from a name, a compressor, a Horovod-style codec, or None (no compression)."""
    if spec is None:
        return NoCompression()
    if isinstance(spec, str):
        return make(spec)
    if isinstance(spec, Compressor):
        return spec
    if hasattr(spec, "compress") and hasattr(spec, "decompress"):
        return CodecAdapter(spec)
    raise GradmeshError(f"not a compressor: {spec!r} (valid: {', '.join(COMPRESSORS.names())})")


def reduce(
    x: torch.Tensor,
    compressor: Compressor,
    state: State,
    link: Link,
    keep: torch.Tensor | None = None,
) -> None:
    """`compressor.reduce` with accounting: the bytes given and the bytes of the messages sent
    are added to the runtime's `CommStats.compressed` under the link's kind."""
    before = link.payload_bytes
    compressor.reduce(x, state, link, keep)
    if is_initialized():
        get_runtime().comm.add_compressed(
            link.kind, x.numel() * x.element_size(), link.payload_bytes - before
        )


DECODERS: dict[int, Compressor] = {
    c.wire_id: c for c in (COMPRESSORS.get(n)(0.01, 1) for n in COMPRESSORS.names()) if c.wire_id
}
"""Wire id -> a compressor that can decode that method's messages (decode needs no settings)."""
