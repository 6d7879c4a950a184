"""fp16's dynamic loss scaling (`--precision fp16`): the loss is multiplied by a scale before
backward, so that small gradients of fp16 activations do not flush to zero; after the gradients
are reduced they are divided by it again, and a step whose gradients overflowed (Inf or NaN) is
skipped and the scale halved; after `growth_interval` finite steps in a row it doubles.

Why not torch's `GradScaler`: its skip is decided by each process on its own gradients, which
is right where data parallelism has made them equal, and wrong where ranks hold different ones
(tensor-parallel slices, pipeline stages, ZeRO's shards): one rank would skip while the others
step. Here every rank's overflow is combined over the world (one collective of one number, a
max) before any rank decides; and the decision is made between the gradient sync and the
update (`update`), where `GradScaler.step` would call gradmesh's optimizer wrapper's `step`,
sync and update together. The unscale and the check are torch's own fused kernel
(`_amp_foreach_non_finite_check_and_unscale_`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradmesh.observe.timeline import span
from gradmesh.sync.data_parallel.optimizer import is_distributed
from gradmesh.sync.sharded.model import local


class DynamicLossScale:
    """The scale, and the count of finite steps since it last changed."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = scale
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0
        """Steps skipped for overflow in this run."""
        self.finite = True
        """The last `unscale`'s verdict: every gradient of this job's ranks was finite."""

    def unscale(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; whether every rank's are finite. When they are
        not, this rank's gradients are dropped (set to None, so the optimizer updates nothing
        and keeps its state), the scale halves; every `growth_interval` finite steps it
        doubles."""
        held = [(p, p.grad) for p in params if p.grad is not None]
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for _, g in held:
            grad = local(g)
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        # on the gradients' device: what the world's backend (NCCL on GPUs) reduces
        found = torch.zeros(1, device=next(iter(by_kind))[0] if by_kind else "cpu")
        for (device, _), grads in by_kind.items():
            flag = torch.zeros(1, device=device)
            inverse = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse)
            found += flag.to(found.device)
        if dist.is_available() and dist.is_initialized():  # the world agrees
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        finite = self.finite = not bool(found.item())
        if finite:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale, self.good_steps = self.scale * 2.0, 0
        else:
            for p, _ in held:
                p.grad = None
            self.scale, self.good_steps = self.scale / 2.0, 0
            self.skipped += 1
        return finite

    def skipped_elsewhere(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Another replica group overflowed at this step, so this finite one skips it too: its
        gradients dropped, the step counted as skipped and not as finite; the scale kept."""
        for p in params:
            p.grad = None
        self.good_steps = max(0, self.good_steps - 1)
        self.skipped += 1

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.scale = float(saved["scale"])
        self.good_steps = int(saved["good_steps"])


def update(optimizer: Optimizer, scale: DynamicLossScale | None) -> None:
    """The loop's optimizer step. With a loss scale: the gradients are reduced first (a
    `DistributedOptimizer`'s `synchronize`; FSDP2 reduced them in backward), then unscaled and
    checked (`DynamicLossScale.unscale`), then the step, which updates nothing after an
    overflow (the gradients are gone) and still ends the step for the optimizer wrapper."""
    distributed = is_distributed(optimizer)
    if scale is not None:
        if distributed:
            cast(Any, optimizer).synchronize()
        scale.unscale(p for group in optimizer.param_groups for p in group["params"])
    if not distributed:
        with span("step"):
            optimizer.step()
        return
    synced = cast(Any, optimizer).skip_synchronize() if scale else contextlib.nullcontext()
    with synced:  # the wrapper spans its update itself
        optimizer.step()
