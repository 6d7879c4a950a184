"""Local SGD: each worker takes K optimizer steps on its own, then the models are averaged.

Communication falls K-fold. With K = 1 and plain SGD it is synchronous data parallelism
(averaging w - lr * g_i over the workers is w - lr * mean(g)). Post-local SGD (Lin et al. 2020):
the first T steps average gradients as synchronous training does, then training turns local.
Only parameters are averaged; optimizer state (momentum) stays local, as in the papers.
With a compressor, what travels is the change since the last average (the same on every rank),
so a lossy message loses part of a step, never part of the model; error feedback keeps the rest
for the next round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives import allreduce
from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.compression.base import (
    Compressor,
    Link,
    NoCompression,
    State,
    load_states,
    save_states,
)
from gradmesh.compression.registry import reduce
from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.wrapping import wrap_optimizer


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

    compressor: Compressor = field(default_factory=NoCompression)
    states: dict[tuple[str, int], State] = field(default_factory=dict)
    """A compressor state per (what is averaged, flat buffer)."""
    anchors: list[torch.Tensor] = field(default_factory=list)
    """With compression: the parameters as last averaged (the same on every rank)."""

    def _average(self, tensors: list[torch.Tensor], what: str) -> None:
        replicas = get_runtime().dp  # the ranks holding the same part of the model
        if replicas.size == 1 or not tensors:
            return
        link = Link(replicas.group, self.algorithm)
        compress = not isinstance(self.compressor, NoCompression)
        with torch.no_grad():
            for i, (flat, members) in enumerate(flat_buffers(tensors)):
                if not compress:
                    allreduce(flat, op="average", algorithm=self.algorithm, group=replicas.group)
                    unpack(flat, members)
                    continue
                state = self._state(what, i, flat, members)
                if what == "parameters":  # the change since the last average travels
                    flat.sub_(self.anchors[i])
                reduce(flat, self.compressor, state, link)
                flat.div_(link.size)
                if what == "parameters":
                    flat.add_(self.anchors[i])
                    self.anchors[i].copy_(flat)
                unpack(flat, members)

    def _state(self, what: str, i: int, flat: torch.Tensor, members: list[torch.Tensor]) -> State:
        """The compressor state of flat buffer `i` of `what`, made when first needed."""
        state = self.states.get((what, i))
        if state is None:
            shapes = [tuple(t.shape) for t in members]
            state = self.states[(what, i)] = self.compressor.new_state(flat.numel(), shapes)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Counters, the last average (with compression) and the compressor states."""
        return {
            "steps": self.steps,
            "averaging_rounds": self.averaging_rounds,
            "anchors": [a.clone() for a in self.anchors],
            "compressor": save_states({f"{w}/{i}": s for (w, i), s in self.states.items()}),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        buffers = flat_buffers([p.detach() for p in self.params])
        anchors = saved["anchors"]
        if not isinstance(anchors, list) or (
            anchors and [tuple(a.shape) for a in anchors] != [tuple(f.shape) for f, _ in buffers]
        ):
            raise GradmeshError("local SGD's saved anchors do not match this model's parameters")
        self.anchors = [a.clone() for a in anchors]
        names = saved["compressor"] if isinstance(saved["compressor"], dict) else {}
        for name in names:
            what, _, index = name.partition("/")
            if what not in ("gradients", "parameters") or not index.isdigit():
                raise GradmeshError(f"local SGD has no compressor state named {name!r}")
            if int(index) >= len(buffers):
                raise GradmeshError(f"local SGD's compressor state {name!r} has no buffer")
            self._state(what, int(index), *buffers[int(index)])
        load_states({f"{w}/{i}": s for (w, i), s in self.states.items()}, saved["compressor"])
        self.steps, self.averaging_rounds = int(saved["steps"]), int(saved["averaging_rounds"])

    def before_step(self) -> None:
        """During the synchronous warm-up, average gradients (missing ones count as zero)."""
        if not self.anchors and not isinstance(self.compressor, NoCompression):
            # the starting parameters, the same on every rank: the first change is from them
            self.anchors = [
                flat.detach().clone() for flat, _ in flat_buffers([p.detach() for p in self.params])
            ]
        if self.steps < self.warmup_sync_steps:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._average([cast(torch.Tensor, p.grad) for p in self.params], "gradients")

    def after_step(self) -> None:
        """Every `sync_every` local steps after the warm-up, average the parameters."""
        self.steps += 1
        local = self.steps - self.warmup_sync_steps
        if local > 0 and local % self.sync_every == 0:
            self._average([p.data for p in self.params], "parameters")
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
