"""Local SGD: each worker takes K optimizer steps on its own, then the models are averaged.

Communication falls K-fold. With K = 1 and plain SGD it is synchronous data parallelism
(averaging w - lr * g_i over the workers is w - lr * mean(g)). Post-local SGD (Lin et al. 2020):
the first T steps average gradients as synchronous training does, then training turns local.
Only parameters are averaged; optimizer state (momentum) stays local, as in the papers.
With a compressor, what travels is the change since the last average (the same on every rank),
so a lossy message loses part of a step, never part of the model; error feedback keeps the rest
for the next round.

DiLoCo (Douillard et al. 2023) is the same loop with an outer optimizer: the averaged change
(start minus end parameters, the "outer gradient") is not simply added but given to an outer SGD
with Nesterov momentum, which moves the last average; every replica then starts its next H inner
steps from the result. With outer lr 1 and momentum 0 it is local SGD. The outer optimizer is
torch's own `SGD(nesterov=True)` over the anchors (one flat tensor per fusion buffer), so its
update and its state_dict are PyTorch's. The streaming variant (fragments synchronised in turn)
is not built.
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
    """With compression or an outer optimizer: the parameters as last averaged (the same on
    every rank)."""
    outer_lr: float | None = None
    """DiLoCo: the outer Nesterov SGD's learning rate (None: plain local SGD)."""
    outer_momentum: float = 0.0
    outer: torch.optim.SGD | None = None
    """DiLoCo's outer optimizer over `anchors`, made with them."""

    @property
    def diloco(self) -> bool:
        return self.outer_lr is not None

    def set_anchors(self) -> None:
        """The starting parameters, the same on every rank: the first change is from them."""
        self.anchors = [
            flat.detach().clone() for flat, _ in flat_buffers([p.detach() for p in self.params])
        ]
        if self.diloco:
            assert self.outer_lr is not None
            self.outer = torch.optim.SGD(
                self.anchors,
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                nesterov=self.outer_momentum > 0,
            )

    def _average(self, tensors: list[torch.Tensor], what: str) -> None:
        replicas = get_runtime().dp  # the ranks holding the same part of the model
        if replicas.size == 1 or not tensors:
            return
        link = Link(replicas.group, self.algorithm)
        compress = not isinstance(self.compressor, NoCompression)
        change = what == "parameters" and (compress or self.diloco)
        with torch.no_grad():
            for i, (flat, members) in enumerate(flat_buffers(tensors)):
                if change:  # the change since the last average travels
                    flat.sub_(self.anchors[i])
                if compress:
                    reduce(flat, self.compressor, self._state(what, i, flat, members), link)
                    flat.div_(link.size)
                else:
                    allreduce(flat, op="average", algorithm=self.algorithm, group=replicas.group)
                if change:
                    self.apply_change(i, flat)
                unpack(flat, members)

    def apply_change(self, i: int, mean_change: torch.Tensor) -> None:
        """Move anchor `i` by the replicas' mean change (the negated outer gradient) and leave
        the new parameters in `mean_change`: added as it is (local SGD), or through the outer
        Nesterov SGD (DiLoCo)."""
        anchor = self.anchors[i]
        if self.outer is None:
            anchor.add_(mean_change)
        else:
            anchor.grad = mean_change.neg_()  # start minus end: the outer gradient
            self.outer.step()
            anchor.grad = None
        mean_change.copy_(anchor)

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
            "outer": self.outer.state_dict() if self.outer is not None else {},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        buffers = flat_buffers([p.detach() for p in self.params])
        anchors = saved["anchors"]
        if not isinstance(anchors, list) or (
            anchors and [tuple(a.shape) for a in anchors] != [tuple(f.shape) for f, _ in buffers]
        ):
            raise GradmeshError("local SGD's saved anchors do not match this model's parameters")
        if self.diloco and not anchors:
            raise GradmeshError("DiLoCo's checkpoint holds no anchors: it was not a diloco run")
        if anchors:
            self.set_anchors()
            for mine, saved_anchor in zip(self.anchors, anchors, strict=True):
                mine.copy_(saved_anchor)
        if self.outer is not None and saved.get("outer"):
            self.outer.load_state_dict(saved["outer"])
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
        if not self.anchors and (self.diloco or not isinstance(self.compressor, NoCompression)):
            self.set_anchors()
        if self.steps < self.warmup_sync_steps:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._average([cast(torch.Tensor, p.grad) for p in self.params], "gradients")

    def after_step(self) -> None:
        """Every `sync_every` local steps after the warm-up, average the parameters."""
        self.steps += 1
        local = self.steps - self.warmup_sync_steps
        if self.diloco and local == 0:  # the outer optimizer starts where the warm-up ended
            self.set_anchors()
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
