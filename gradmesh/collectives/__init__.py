"""Collective operations built on torch.distributed point-to-point messages, by algorithm name.

`allreduce(tensor, op, algorithm)` reduces in place with one of: ring, tree, butterfly, star,
hierarchical, native (the backend's own) or auto (lowest predicted cost). `broadcast` (and
`broadcast_object` and `allgather_object`, plain values, never pickle), `allgather` and
`reduce_scatter` run on the same machinery.
Every call is counted in the runtime's `CommStats`; `cost()` and `probe()` give the
alpha-beta-gamma model.
"""

from typing import TYPE_CHECKING

from gradmesh.collectives.cost import CostParams, cost, probe  # no torch: the formulas
from gradmesh.registry import lazy_attributes

if TYPE_CHECKING:
    from gradmesh.collectives.api import ALGORITHMS, Op, allreduce
    from gradmesh.collectives.objects import allgather_object, broadcast_object
    from gradmesh.collectives.ring import allgather, reduce_scatter
    from gradmesh.collectives.tree import broadcast

_WHERE = {
    "ALGORITHMS": "api",
    "Op": "api",
    "allreduce": "api",
    "allgather_object": "objects",
    "broadcast_object": "objects",
    "allgather": "ring",
    "reduce_scatter": "ring",
    "broadcast": "tree",
}


__getattr__ = lazy_attributes(__name__, _WHERE)
"""Each name loaded on first use, so that the cost formulas (`gradmesh.collectives.cost`) import
no torch; the algorithms register themselves on the first lookup of a registry
(`cost.load_algorithms`)."""

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
