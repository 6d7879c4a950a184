"""DiLoCo across replica groups (`--replica-group G --strategy diloco --sync-every H`): each group
takes H inner steps on its own (its own data parallelism exact inside it), then the groups alive
average their outer gradients (start minus end parameters), compressed by `--compression`,
and every one applies the same outer Nesterov step. Only the outer rounds cross the slow link
and ask the lighthouse; a group lost mid-round drops out at the next round, and one that comes
back copies the newest state (parameters, inner and outer optimizer state, the anchors) after
that round's outer step. DiLoCo with torchft's fault tolerance, in gradmesh's own parts:
`local_sgd.Averager` keeps the anchors and the outer optimizer (the same update as
`--strategy diloco` in one job), `CrossGroupAverage` and the lighthouse's commit the rest.

A round's average counts only the groups that took inner steps since their anchors (`fresh`):
a group that just joined sends zeros, and the sum is divided by the fresh groups' number.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.sync.local_sgd import Averager
from gradmesh.sync.replicas.averaging import QuorumLink
from gradmesh.sync.replicas.manager import ReplicaManager
from gradmesh.sync.sharded.model import local


class CrossGroupDiLoCo:
    """One rank's DiLoCo state across the replica groups (see the module docstring)."""

    def __init__(
        self, params: list[nn.Parameter], sync_every: int, outer_lr: float, outer_momentum: float
    ) -> None:
        self.params = params
        self.averager = Averager(
            [local(p) for p in params],
            sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )
        self._mean: list[torch.Tensor] | None = None

    @property
    def sync_every(self) -> int:
        return self.averager.sync_every

    def begin(self) -> None:
        """Anchor the outer step at the parameters now (the run's start), unless anchored."""
        if not self.averager.anchors:
            self.averager.set_anchors()

    def inner_step(self) -> None:
        self.averager.steps += 1

    def average(self, manager: ReplicaManager, fresh: bool) -> bool:
        """The mean outer change of the quorum's fresh groups into `_mean` (not applied: the
        round commits first); False where a member was lost mid-way."""
        quorum = manager.quorum
        assert quorum is not None
        with torch.no_grad():
            buffers = flat_buffers([local(p).detach() for p in self.params])
            changes = [
                flat.sub_(anchor) if fresh else torch.zeros_like(flat)
                for (flat, _), anchor in zip(buffers, self.averager.anchors, strict=True)
            ]
            if len(quorum.members) == 1:
                self._mean = changes if fresh else None
                return True
            count = torch.tensor([1.0 if fresh else 0.0], device="cpu")  # Gloo's
            try:
                QuorumLink(pg=manager.process_group).allreduce(count)
            except RuntimeError:
                return False
            if count[0] == 0:  # nobody took inner steps (the run's first round)
                self._mean = None
                return True
            if not manager.average(changes):  # the mean over all members, compressed
                return False
            for change in changes:  # the average over the quorum, of the fresh ones only
                change.mul_(len(quorum.members) / float(count[0]))
        self._mean = changes if fresh else None
        return True

    def apply(self) -> None:
        """After the commit: the outer Nesterov step on the anchors, the parameters set to them
        (a group that was not fresh has nothing to apply: it copies the state next)."""
        if self._mean is None:
            return
        with torch.no_grad():
            buffers = flat_buffers([local(p).detach() for p in self.params])
            for i, ((_, members), mean) in enumerate(zip(buffers, self._mean, strict=True)):
                self.averager.apply_change(i, mean)
                unpack(mean, members)
        self.averager.steps = 0
        self.averager.averaging_rounds += 1
        self._mean = None

    def state_dict(self) -> dict[str, Any]:
        return self.averager.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.averager.load_state_dict(saved)
