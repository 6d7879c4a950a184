"""torchao's import without its import-time noise.

Importing torchao tries to load its compiled extensions (CUDA kernels gradmesh never calls:
float8 training runs on torch's own `_scaled_mm`) and logs a warning for each one that this
build of torch cannot load: on every CPU machine, and where torchao was built for another
torch. It also registers enums with torch's pytree, which newer torches warn about. A Hugging
Face model built while torchao is installed imports it too (transformers looks for its
quantizers), so before this every `--model hf:...` run printed four such lines a process.
None of them is about the user's run; they are dropped while torchao loads, and torchao's and
torch's later warnings are theirs as usual.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

NOISY = ("torchao", "torch.utils._pytree")
"""The loggers torchao's import writes through (its own, and torch's pytree registry)."""


@contextlib.contextmanager
def torchao_quiet() -> Iterator[None]:
    """Inside: those loggers pass errors only; after: their levels as they were."""
    loggers = [logging.getLogger(name) for name in NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
