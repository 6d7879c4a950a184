"""Collective operations on tensors, by algorithm name.

`allreduce(tensor, op, algorithm)` reduces in place across a process group with the algorithm
registered under that name; `broadcast` copies the root's tensor to every rank. Every call is
counted in the runtime's `CommStats` (bytes this rank sent, seconds spent).
"""

from gradmesh.collectives import native as _native  # noqa: F401  (registers "native")
from gradmesh.collectives.api import ALGORITHMS, Op, allreduce, broadcast

__all__ = ["ALGORITHMS", "Op", "allreduce", "broadcast"]
