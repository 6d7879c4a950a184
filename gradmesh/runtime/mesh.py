"""The mesh: the world's ranks on the named axes of `gradmesh.runtime.axes` (dp x pp x ep x
cp x tp), one process group per axis, and one for the ranks that average gradients
(`mesh.replicas`: dp x ep x cp) and for those that split the batch (`mesh.batch`: dp x ep)
where these span more than one axis.

Code that averages over replicas uses `mesh.replicas` (`mesh[DP]` itself when cp and ep are
1), code that splits a layer `mesh[TP]`, code that streams between stages `mesh[PP]`; nothing
assumes the data axis is the whole world.

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
from gradmesh.runtime.axes import BATCH, DP, EXPERT_REPLICAS, NAMES, REPLICAS, MeshShape

BATCH_SHARDED = "gradmesh_batch_sharded"
"""Attribute set (True) on a parameter whose layer computes on this rank's slice of its
replica's batch although tp > 1 (a hybrid plan's data-parallel layers): gradient sync averages
it over the batch group (dp x tp, every rank when pp is 1), not over dp alone."""

LAYOUT_SYNCED = "gradmesh_layout_synced"
"""Attribute set (True) on a parameter whose gradient the layout itself makes whole and
averages over dp (a weight tied across pipeline stages: summed over the stages that hold it and
averaged over the replicas in one allreduce); data-parallel sync leaves it alone."""

EXPERT_PLACED = "gradmesh_expert_placed"
"""Attribute set (True) on a parameter of this rank's experts (`gradmesh.layout.expert`): the
ep ranks hold different ones, so it is averaged over the copies of the same expert
(`Mesh.experts`), not over every replica, and the first broadcast leaves it to that group."""

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def grid(shape: MeshShape) -> torch.Tensor:
    """The ranks as an array with one dimension per axis (torch's `DeviceMesh` takes it)."""
    return torch.arange(shape.world, device="cpu").reshape(shape.sizes)


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
    """The world on its axes; `mesh[DP]` is this rank's data-parallel axis."""

    def __init__(self, shape: MeshShape, axes: dict[str, Axis]) -> None:
        self.shape = shape
        self.axes = axes
        self._device_mesh: DeviceMesh | None = None

    @property
    def replicas(self) -> Axis:
        """The ranks that hold the same parameters as this one (dp x ep x cp: `REPLICAS`), whose
        gradients are averaged together; the dp axis itself when it is the only one of them."""
        return self.axes[_composite(self.shape, REPLICAS)]

    @property
    def experts(self) -> Axis:
        """The ranks that hold the same experts as this one (the replicas but the ep axis:
        `EXPERT_REPLICAS`)."""
        return self.axes[_composite(self.shape, EXPERT_REPLICAS)]

    @property
    def batch(self) -> Axis:
        """The ranks that take different samples of the global batch (dp x ep: `BATCH`); a
        rank's data shard is its index here."""
        return self.axes[_composite(self.shape, BATCH)]

    def __getitem__(self, name: str) -> Axis:
        try:
            return self.axes[name]
        except KeyError:
            raise GradmeshError(f"unknown mesh axis {name!r} (valid: {', '.join(NAMES)})") from None

    @property
    def split(self) -> bool:
        """Whether a replica of the model spans more than one rank."""
        return self.shape.split > 1

    def release(self) -> None:
        """Forget the groups (at shutdown, after they were destroyed)."""
        self.axes = {}
        self._device_mesh = None

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The same mesh as torch's `DeviceMesh` over the same groups (for DTensor users)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(
                [self.axes[a].group for a in NAMES],
                device_type,
                mesh=grid(self.shape),
                mesh_dim_names=NAMES,
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


def _composite(shape: MeshShape, axes: tuple[str, ...]) -> str:
    """The key of the axes' line in `Mesh.axes`: the one axis spanned (dp where none is), or
    their names joined ('dp*cp')."""
    spanned = shape.spanned(axes)
    return spanned[0] if len(spanned) == 1 else "*".join(spanned) if spanned else DP


def build_mesh(
    shape: MeshShape, rank: int, timeout: timedelta, groups: list[dist.ProcessGroup]
) -> Mesh:
    """Make one group per axis, then one per set of axes (`REPLICAS`, `BATCH`,
    `EXPERT_REPLICAS`) that spans more than one axis (every rank calls this in the same order);
    each group made is appended to `groups`, whose owner frees them at shutdown."""
    axes = {}
    for name in NAMES:
        axes[name] = _line(shape, name, rank, timeout, groups)
    for along in (REPLICAS, BATCH, EXPERT_REPLICAS):
        key = _composite(shape, along)
        if key not in axes:
            axes[key] = _line(shape, shape.spanned(along), rank, timeout, groups)
    return Mesh(shape, axes)


def _line(
    shape: MeshShape,
    along: str | tuple[str, ...],
    rank: int,
    timeout: timedelta,
    groups: list[dist.ProcessGroup],
) -> Axis:
    lines = shape.lines(along)
    group = group_of_lines(lines, rank, timeout)
    groups.append(group)
    ranks = next(line for line in lines if rank in line)
    name = along if isinstance(along, str) else "*".join(along)
    return Axis(name, len(ranks), ranks.index(rank), ranks, group)
