"""Horovod's `hvd.Compression`: gradmesh's compressors under Horovod's names."""

from __future__ import annotations

from gradmesh.compression.registry import make

__all__ = [
    "Compression",
]


class Compression:
    """`hvd.Compression.none` / `hvd.Compression.fp16`, and gradmesh's other compressors
    (`bf16`, `int8`, `topk`, `sign`, `powersgd`, with error feedback where they need it)."""

    none = make("none")
    fp16 = make("fp16")
    bf16 = make("bf16")
    int8 = make("int8")
    topk = make("topk")
    sign = make("sign")
    powersgd = make("powersgd")
