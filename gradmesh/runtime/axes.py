"""The mesh's axes as data, and its shape: how many ranks each axis has. No torch here, so the
options and the checks before launch read it too.

Each axis is a row of `AXES` (outermost first): its name, the option that sets its size (the
data axis has none: it is the rest of the world), whether a checkpoint can move across its
sizes (`--reshard`), and what its ranks share: whether they take different samples of the
batch (`batch`: dp, and ep, whose ranks hold different experts but see different samples) and
whether they hold the same parameters, their gradients averaged (`replicates`: dp, ep for all
but its experts, cp, whose ranks hold parts of the same sequences). Ranks are laid out with the
last axis innermost:

    rank = (((dp_index * pp + pp_index) * ep + ep_index) * cp + cp_index) * tp + tp_index

so a tensor-parallel group is adjacent ranks (one host, where its per-layer exchanges are
cheapest), then the context ring, the experts' all-to-all, pipeline stages, then data-parallel
replicas. Everything else derives from the table and a shape: the process groups and rank
coordinates (`gradmesh.runtime.mesh`), the groups gradients are averaged over (`REPLICAS`) and
the data is split over (`BATCH`), the checkpoint's layout keys
(`gradmesh.layout.config.LAYOUT_KEYS`), the report's layout. A new axis is a row here, its own
package under `gradmesh/layout/`, and its step in the recipe (`gradmesh.train.recipe`);
docs/architecture.md says it step by step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from gradmesh.errors import GradmeshError

DP, PP, EP, CP, TP = "dp", "pp", "ep", "cp", "tp"
"""The axes' names: the only place they are written, with the axes' own packages."""


@dataclass(frozen=True)
class AxisSpec:
    """One axis of the mesh."""

    name: str
    flag: str
    """The option that sets its size ("" for the data axis: the rest of the world)."""
    what: str
    """What its ranks hold, for messages."""
    reshardable: bool
    """Whether a checkpoint can be resumed at another size of this axis (`--reshard`)."""
    batch: bool = False
    """Whether its ranks take different samples of the global batch."""
    replicates: bool = False
    """Whether its ranks hold the same parameters (their gradients averaged over it)."""


AXES = (
    AxisSpec(DP, "", "data-parallel replicas", True, batch=True, replicates=True),
    AxisSpec(PP, "pipeline_parallel", "pipeline stages", False),
    AxisSpec(EP, "expert_parallel", "expert-parallel ranks", False, batch=True, replicates=True),
    AxisSpec(CP, "context_parallel", "context-parallel ranks", True, replicates=True),
    AxisSpec(TP, "tensor_parallel", "tensor-parallel ranks", True),
)
"""Outermost first."""
NAMES = tuple(a.name for a in AXES)
SPLITTING = tuple(a for a in AXES if a.flag)
"""The axes that split one replica (all but the data axis)."""
BATCH = tuple(a.name for a in AXES if a.batch)
"""The axes over which the global batch is split: a rank's data shard is its place on them."""
REPLICAS = tuple(a.name for a in AXES if a.replicates)
"""The axes whose ranks hold the same parameters: gradients are averaged over them (the
experts, which the ep axis places, over the others: `EXPERT_REPLICAS`)."""
EXPERT_REPLICAS = tuple(a for a in REPLICAS if a != EP)
"""The axes over which the copies of one expert average (`gradmesh.layout.expert`)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshShape:
    """How many ranks each axis has, in `AXES` order (`shape.size("tp")`, or `shape.tp`)."""

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> MeshShape:
        """A shape from axis name -> size (an axis left out has 1); one line for an unknown
        axis or a size below 1."""
        unknown = sorted(set(sizes) - set(NAMES))
        if unknown:
            raise GradmeshError(
                f"unknown mesh axis {unknown[0]!r} (the mesh's axes: {', '.join(NAMES)})"
            )
        for axis in AXES:
            size = sizes.get(axis.name, 1)
            if not isinstance(size, int) or size < 1:
                flag = f" (--{axis.flag.replace('_', '-')})" if axis.flag else ""
                raise GradmeshError(f"mesh axis {axis.name}{flag} must be >= 1, got {size!r}")
        return cls(tuple(int(sizes.get(name, 1)) for name in NAMES))

    @classmethod
    def for_world(cls, world: int, **sizes: int) -> MeshShape:
        """The shape that puts the splitting axes' ranks (`tp=2, pp=2`) in each replica and the
        rest of `world` on the data axis; one line, saying what would fit, when `world` is not a
        multiple of them (or a data-axis size given does not make `world`)."""
        shape = cls.of(sizes)
        split = math.prod(shape.size(a.name) for a in SPLITTING)
        named = " x ".join(f"{a.what} {shape.size(a.name)}" for a in SPLITTING)
        if world % split:
            fits = ", ".join(str(d) for d in divisors(world))
            raise GradmeshError(
                f"{world} workers cannot hold replicas of {named} = {split} ranks: their "
                f"product must divide the worker count ({fits})"
            )
        if DP in sizes and sizes[DP] * split != world:
            raise GradmeshError(
                f"a mesh of {sizes[DP]} data-parallel replicas x {named} is "
                f"{sizes[DP] * split} ranks, not the {world} workers"
            )
        return cls.of({**sizes, DP: world // split})

    def size(self, axis: str) -> int:
        return self.sizes[NAMES.index(axis)]

    def __getattr__(self, name: str) -> int:
        if name in NAMES:
            return self.size(name)
        raise AttributeError(name)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(NAMES, self.sizes, strict=True))

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    @property
    def split(self) -> int:
        """Ranks one replica spans."""
        return self.world // self.size(DP)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis (the last axis innermost)."""
        out = {}
        for name, size in reversed(list(zip(NAMES, self.sizes, strict=True))):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in NAMES}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in zip(NAMES, self.sizes, strict=True):
            rank = rank * size + coords[name]
        return rank

    def lines(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Every group of ranks along `axes` (one axis, or several: the ranks that differ only
        in those coordinates), each in rank order, the same on every rank."""
        along = (axes,) if isinstance(axes, str) else axes
        others = [n for n in NAMES if n not in along]
        return [
            self._line(along, dict(zip(others, fixed, strict=True)))
            for fixed in itertools.product(*(range(self.size(n)) for n in others))
        ]

    def first_line(self, axes: tuple[str, ...]) -> list[int]:
        """`lines(axes)[0]`, rank 0's line, without building the others (a cost model asks for
        it once a layout: 1,024 ranks made the whole list a third of a mesh search)."""
        return self._line(axes, {n: 0 for n in NAMES if n not in axes})

    def _line(self, along: tuple[str, ...], fixed: dict[str, int]) -> list[int]:
        inside = [range(self.size(n)) for n in along]
        return sorted(
            self.rank_of({**fixed, **dict(zip(along, i, strict=True))})
            for i in itertools.product(*inside)
        )

    def spanned(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """The axes of `axes` with more than one rank."""
        return tuple(a for a in axes if self.size(a) > 1)

    def describe(self) -> str:
        """'dp 2 x tp 2': the data axis and every axis of more than one rank."""
        return " x ".join(
            f"{name} {size}"
            for name, size in zip(NAMES, self.sizes, strict=True)
            if name == DP or size > 1
        )
