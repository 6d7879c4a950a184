"""Collective operations built on torch.distributed point-to-point messages, by algorithm name.

`allreduce(tensor, op, algorithm)` reduces in place with one of: ring, tree, butterfly, star,
hierarchical, native (the backend's own) or auto (lowest predicted cost). `broadcast` (and
`broadcast_object` and `allgather_object`, plain values, never pickle), `allgather` and
`reduce_scatter` run on the same machinery.
Every call is counted in the runtime's `CommStats`; `cost()` and `probe()` give the
alpha-beta-gamma model.
"""

from gradmesh.collectives import auto as _auto  # noqa: F401  (registers each algorithm)
from gradmesh.collectives import butterfly as _butterfly  # noqa: F401
from gradmesh.collectives import hierarchical as _hierarchical  # noqa: F401
from gradmesh.collectives import native as _native  # noqa: F401
from gradmesh.collectives import star as _star  # noqa: F401
from gradmesh.collectives.api import ALGORITHMS, Op, allreduce
from gradmesh.collectives.cost import CostParams, cost, probe
from gradmesh.collectives.objects import allgather_object, broadcast_object
from gradmesh.collectives.ring import allgather, reduce_scatter
from gradmesh.collectives.tree import broadcast

__all__ = [
    "ALGORITHMS",
    "CostParams",
    "Op",
    "allgather",
    "allgather_object",
    "allreduce",
    "broadcast",
    "broadcast_object",
    "cost",
    "probe",
    "reduce_scatter",
]
