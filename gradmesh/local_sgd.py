"""Local SGD: each worker takes K optimizer steps on its own, then the models are averaged.

Communication falls K-fold. With K = 1 and plain SGD it is synchronous data parallelism
(averaging w - lr * g_i over the workers is w - lr * mean(g)). Post-local SGD (Lin et al. 2020):
the first T steps average gradients as synchronous training does, then training turns local.
Only parameters are averaged; optimizer state (momentum) stays local, as in the papers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives import allreduce
from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.errors import GradmeshError
from gradmesh.runtime import get_runtime
from gradmesh.wrapping import wrap_optimizer


@dataclass
class Averager:
    """The long-lived state of local SGD: when to talk, and how many times it did."""

    params: list[nn.Parameter]
    sync_every: int
    warmup_sync_steps: int = 0
    algorithm: str = "native"
    steps: int = 0
    averaging_rounds: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.warmup_sync_steps < 0:
            raise GradmeshError("--sync-every must be >= 1 and --warmup-sync-steps >= 0")

    def _average(self, tensors: list[torch.Tensor]) -> None:
        replicas = get_runtime().dp  # the ranks holding the same part of the model
        if replicas.size == 1 or not tensors:
            return
        with torch.no_grad():
            for flat, members in flat_buffers(tensors):
                allreduce(flat, op="average", algorithm=self.algorithm, group=replicas.group)
                unpack(flat, members)

    def before_step(self) -> None:
        """During the synchronous warm-up, average gradients (missing ones count as zero)."""
        if self.steps < self.warmup_sync_steps:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._average([cast(torch.Tensor, p.grad) for p in self.params])

    def after_step(self) -> None:
        """Every `sync_every` local steps after the warm-up, average the parameters."""
        self.steps += 1
        local = self.steps - self.warmup_sync_steps
        if local > 0 and local % self.sync_every == 0:
            self._average([p.data for p in self.params])
            self.averaging_rounds += 1


class _LocalSGDMixin:
    _averager: Averager

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self._averager.before_step()
        result = super().step(closure)  # type: ignore[misc]
        self._averager.after_step()
        return result


def LocalSGDOptimizer(  # noqa: N802 - reads like the optimizer it wraps
    optimizer: Optimizer, averager: Averager
) -> Optimizer:
    """`optimizer` with local SGD's communication around each step (a subclass of its class)."""
    return wrap_optimizer(optimizer, _LocalSGDMixin, _averager=averager)
