"""What counts as one backward pass for the data-parallel reducers. A reducer counts the
autograd runs that reach its parameters (one per micro-batch's backward) to know when the step's
gradients are complete; a zero-bubble pipeline's W is several autograd runs (one per split node,
`gradmesh.layout.pipeline.split`) that together make one micro-batch's weight gradients. Inside
`one_backward()`, the end-of-backward callbacks the runs would each queue wait and run once, when
the block ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def one_backward() -> Iterator[None]:
    """The autograd runs inside count as one backward pass."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.pending = {}
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            pending, _local.pending = _local.pending, {}
            for callback in pending.values():
                callback()


def defer(callback: Callable[[], None]) -> bool:
    """Keep `callback` for the end of the current `one_backward` block (once however often it
    is deferred); False outside one, where the caller queues it with autograd's engine."""
    if getattr(_local, "depth", 0) == 0:
        return False
    _local.pending.setdefault(callback, callback)  # a bound method equals its like
    return True
