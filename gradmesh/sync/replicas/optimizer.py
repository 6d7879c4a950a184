"""A replica group's optimizer: its step averages the gradients over the step's quorum of groups
(`ReplicaManager.average`) and applies them only once every member group committed the step
(`ReplicaManager.commit`; otherwise `StepAborted`, and the trainer takes the step again with the
next quorum). With fp16's loss scale, a step any member group overflowed is skipped by every
group: one flag is exchanged over the quorum before the average (`ReplicaManager.any_group`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from gradmesh.sync.replicas.manager import ReplicaManager, StepAborted
from gradmesh.sync.sharded.model import local
from gradmesh.sync.wrapping import wrap_optimizer


class LossScale(Protocol):
    """What the replica step reads of an fp16 job's loss scale (`train.loss_scale`)."""

    @property
    def finite(self) -> bool: ...

    def skipped_elsewhere(self, params: list[torch.nn.Parameter]) -> None: ...


class _ReplicaMixin:
    _manager: ReplicaManager
    _params: list[torch.nn.Parameter]
    _step_of: Callable[[], int]
    _scale: LossScale | None

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        sync = getattr(self, "synchronize", None)
        if sync is not None:  # the in-group allreduce first (a DistributedOptimizer)
            sync()
        if self._scale is not None and self._overflowed():
            return self._update(closure)  # every gradient dropped: nothing changes
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        for p, g in zip(self._params, grads, strict=True):
            p.grad = g
        ok = self._manager.average([local(g) for g in grads])  # a DTensor: this rank's shard
        if not self._manager.commit(self._step_of(), ok):
            raise StepAborted
        return self._update(closure)

    def _overflowed(self) -> bool:
        """fp16: whether any member group's gradients overflowed at this step (the loss scale's
        check, agreed inside each group); then every group skips it, committed as one, so the
        groups apply the same updates. A group that overflowed halved its scale; the others
        keep theirs (each averages gradients unscaled by its own)."""
        assert self._scale is not None
        anywhere = self._manager.any_group(not self._scale.finite)
        if anywhere is False:
            return False  # the step goes on to the average and its commit
        if not self._manager.commit(self._step_of(), anywhere is not None):
            raise StepAborted
        if self._scale.finite:
            self._scale.skipped_elsewhere(self._params)
        return True

    def _update(self, closure: Callable[[], float] | None) -> Any:
        skip = getattr(self, "skip_synchronize", None)
        if skip is None:
            return super().step(closure)  # type: ignore[misc]
        with skip():
            return super().step(closure)  # type: ignore[misc]


def ReplicaOptimizer(  # noqa: N802 - reads like the optimizer it wraps
    optimizer: Optimizer,
    manager: ReplicaManager,
    params: list[torch.nn.Parameter],
    step_of: Callable[[], int],
    scale: LossScale | None = None,
) -> Optimizer:
    """`optimizer` whose step first averages the gradients over the step's quorum of replica
    groups and commits (or raises `StepAborted`); `step_of()` is the step being taken; with
    fp16's loss `scale`, a step any group overflowed is skipped by all."""
    return wrap_optimizer(
        optimizer,
        _ReplicaMixin,
        _manager=manager,
        _params=params,
        _step_of=step_of,
        _scale=scale,
    )
