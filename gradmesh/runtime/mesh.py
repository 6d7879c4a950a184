"""The mesh: the world's ranks arranged on named axes `dp x pp x tp`, one process group per axis.

Tensor-parallel ranks are innermost (adjacent ranks, so a tp group stays on one host, where its
per-layer exchanges are cheapest), then pipeline stages, then data-parallel replicas:

    rank = (dp_index * pp + pp_index) * tp + tp_index

Code that averages over replicas uses `mesh["dp"]`, code that splits a layer `mesh["tp"]`, code
that streams between stages `mesh["pp"]`; nothing assumes the data axis is the whole world.

The groups are made here, with the job's timeout and labelled by axis in every message, and then
handed to torch's `DeviceMesh.from_group` (`Mesh.device_mesh`), rather than made by
`init_device_mesh`: that would give them torch's 30-minute default timeout for subgroups.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gradmesh.errors import GradmeshError

BATCH_SHARDED = "gradmesh_batch_sharded"
"""Attribute set (True) on a parameter whose layer computes on this rank's slice of its
replica's batch although tp > 1 (a hybrid plan's data-parallel layers): gradient sync averages
it over the batch group (dp x tp, every rank when pp is 1), not over dp alone."""

LAYOUT_SYNCED = "gradmesh_layout_synced"
"""Attribute set (True) on a parameter whose gradient the layout itself makes whole and
averages over dp (a weight tied across pipeline stages: summed over the stages that hold it and
averaged over the replicas in one allreduce); data-parallel sync leaves it alone."""

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("dp", "pp", "tp")
"""Outermost first."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshShape:
    """How many ranks each axis has."""

    dp: int
    pp: int = 1
    tp: int = 1

    @classmethod
    def for_world(cls, world: int, tp: int = 1, pp: int = 1) -> MeshShape:
        """The shape that puts `tp` x `pp` ranks in each replica and the rest on `dp`; a
        one-line error, saying what would fit, when `world` is not a multiple of tp x pp."""
        if tp < 1 or pp < 1:
            raise GradmeshError(
                f"--tensor-parallel and --pipeline-parallel must be >= 1, got {tp}, {pp}"
            )
        if world % (tp * pp):
            fits = ", ".join(str(d) for d in divisors(world))
            raise GradmeshError(
                f"{world} workers cannot hold replicas of tensor-parallel {tp} x pipeline-parallel "
                f"{pp} = {tp * pp} ranks: tp x pp must divide the worker count ({fits})"
            )
        return cls(dp=world // (tp * pp), pp=pp, tp=tp)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def size(self, axis: str) -> int:
        return int(getattr(self, axis))

    def grid(self) -> torch.Tensor:
        """The ranks as a dp x pp x tp array."""
        return torch.arange(self.world, device="cpu").reshape(self.dp, self.pp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis."""
        dp, rest = divmod(rank, self.pp * self.tp)
        pp, tp = divmod(rest, self.tp)
        return {"dp": dp, "pp": pp, "tp": tp}

    def lines(self, axis: str) -> list[list[int]]:
        """Every group of ranks along `axis`: the ranks that differ only in that coordinate."""
        moved = self.grid().movedim(AXES.index(axis), -1)
        return [[int(r) for r in line] for line in moved.reshape(-1, self.size(axis))]

    def describe(self) -> str:
        return f"dp {self.dp} x pp {self.pp} x tp {self.tp}"


@dataclass
class Axis:
    """One axis of the mesh as this rank sees it."""

    name: str
    size: int
    index: int
    """This rank's coordinate on the axis."""
    ranks: list[int]
    """The global ranks of this rank's group on the axis, in axis order."""
    group: dist.ProcessGroup

    def rank_at(self, index: int) -> int:
        """The global rank at `index` on this axis (same other coordinates as this rank)."""
        return self.ranks[index]


class Mesh:
    """The world as dp x pp x tp; `mesh["dp"]` is this rank's data-parallel axis."""

    def __init__(self, shape: MeshShape, axes: dict[str, Axis]) -> None:
        self.shape = shape
        self.axes = axes
        self._device_mesh: DeviceMesh | None = None

    def __getitem__(self, name: str) -> Axis:
        try:
            return self.axes[name]
        except KeyError:
            raise GradmeshError(f"unknown mesh axis {name!r} (valid: {', '.join(AXES)})") from None

    @property
    def split(self) -> bool:
        """Whether a replica of the model spans more than one rank."""
        return self.shape.tp * self.shape.pp > 1

    def release(self) -> None:
        """Forget the groups (at shutdown, after they were destroyed)."""
        self.axes = {}
        self._device_mesh = None

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The same mesh as torch's `DeviceMesh` over the same groups (for DTensor users)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(
                [self.axes[a].group for a in AXES],
                device_type,
                mesh=self.shape.grid(),
                mesh_dim_names=AXES,
            )
        return self._device_mesh


def group_of_lines(lines: list[list[int]], rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """One group per line of ranks (every rank makes them all, in the same order: torch needs
    every rank in every `new_group` call); returns the group of the line holding `rank`."""
    mine: dist.ProcessGroup | None = None
    for line in lines:
        group: dist.ProcessGroup = dist.new_group(line, timeout=timeout)
        if rank in line:
            mine = group
    assert mine is not None, f"rank {rank} is on no line"
    return mine


def build_mesh(
    shape: MeshShape, rank: int, timeout: timedelta, groups: list[dist.ProcessGroup]
) -> Mesh:
    """Make one group per axis (every rank calls this in the same order); each group made is
    appended to `groups`, whose owner frees them at shutdown."""
    axes = {}
    coords = shape.coords(rank)
    for name in AXES:
        lines = shape.lines(name)
        group = group_of_lines(lines, rank, timeout)
        groups.append(group)
        ranks = next(line for line in lines if rank in line)
        axes[name] = Axis(name, shape.size(name), coords[name], ranks, group)
    return Mesh(shape, axes)
