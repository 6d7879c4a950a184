"""Compression's options: which compressor a strategy's messages go through, with its settings.
No torch here: the CLI builds its flags from this."""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.errors import GradmeshError
from gradmesh.options import option

ERROR_FEEDBACK = ("auto", "on", "off")
READ_BY = {"ratio": "topk", "rank": "powersgd"}
"""Each compressor setting, and the one compressor that reads it."""


@dataclass
class CompressionConfig:
    """Compression: what each strategy's messages are squeezed into (docs/compression.md)."""

    method: str = option(
        "none",
        "gradient compression: none, fp16, bf16, int8, topk, sign, powersgd",
        flag="--compression",
        name=True,
    )
    ratio: float = option(
        0.01, "topk: fraction of the elements sent, in (0, 1]", flag="--compression-ratio"
    )
    rank: int = option(1, "powersgd: rank of the low-rank approximation", flag="--compression-rank")
    error_feedback: str = option(
        "auto",
        "keep what compression left out for the next step: auto (on for the biased int8, topk, "
        "sign, powersgd), on, off",
        choices=ERROR_FEEDBACK,
    )

    def check(self) -> None:
        """One line for settings no compressor takes (the name is the registry's to check)."""
        if not 0 < self.ratio <= 1:
            raise GradmeshError(f"--compression-ratio must be in (0, 1], got {self.ratio}")
        if self.rank < 1:
            raise GradmeshError(f"--compression-rank must be >= 1, got {self.rank}")
