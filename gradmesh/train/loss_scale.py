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
(`_amp_foreach_non_finite_check_and_unscale_`), and the scale's update is torch's
`_amp_update_scale_`, on the gradients' device. Where the optimizer is one of torch's fused
ones (gradmesh's own on GPUs), the verdict never comes to the host: the flag goes to the
optimizer, which skips on the device (`unscale_on_device`); other optimizers get it on the host
(one read a step, `unscale`)."""

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
    """The scale, the count of finite steps since it last changed, and the steps skipped: 0-d
    tensors (`_State`) on the gradients' device from the first unscale on, changed there by
    torch's `_amp_update_scale_` whichever side reads the verdict. `unscale` reads it on the
    host and drops the gradients of an overflowed step; `unscale_on_device` hands it to an
    optimizer that skips the step itself (`skips_on_device`), so that no step waits for the
    GPU. Reading `scale`, `skipped`, `good_steps` or `finite` reads the device: the report's
    and the checkpoint's business, not the step's."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.growth_interval = growth_interval
        self._state = _State(scale, 0, 0, torch.device("cpu"))

    @property
    def scale(self) -> float:
        return float(self._state.scale)

    @property
    def good_steps(self) -> int:
        return int(self._state.good_steps)

    @property
    def skipped(self) -> int:
        """Steps skipped for overflow in this run."""
        return int(self._state.skipped)

    @property
    def finite(self) -> bool:
        """The last unscale's verdict: every gradient of this job's ranks was finite."""
        return not bool(self._state.found)

    @property
    def weight(self) -> torch.Tensor:
        """What the loss is multiplied by before backward: the scale (a 0-d tensor, which
        multiplies a tensor on any device)."""
        return self._state.scale

    def unscale(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; whether every rank's are finite. When they are
        not, this rank's gradients are dropped (set to None, so the optimizer updates nothing
        and keeps its state) and the scale halves; every `growth_interval` finite steps it
        doubles."""
        held = [p for p in params if p.grad is not None]
        finite = not bool(self._unscale(held).item())
        if not finite:
            for p in held:
                p.grad = None
        return finite

    def unscale_on_device(self, optimizer: Optimizer) -> None:
        """`unscale` for an optimizer that `skips_on_device`: the world's overflow flag is
        handed to it (torch's fused optimizers read `found_inf`, as `GradScaler` gives it
        them); the gradients stay, the step skips them."""
        params = (p for group in optimizer.param_groups for p in group["params"])
        cast(Any, optimizer).found_inf = self._unscale([p for p in params if p.grad is not None])

    def _unscale(self, held: list[torch.nn.Parameter]) -> torch.Tensor:
        """The unscale and check, then the scale's update on the device; the flag."""
        inverse = self._state.scale.double().reciprocal().float()  # exact: a power of 2
        found = _check_and_unscale(held, inverse)
        if found.device != self._state.scale.device:  # the first step: to the gradients
            self._state = self._state.to(found.device)
        on = self._state
        torch._amp_update_scale_(on.scale, on.good_steps, found, 2.0, 0.5, self.growth_interval)
        on.skipped += found
        on.found = found
        return found

    def skipped_elsewhere(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Another replica group overflowed at this step, so this finite one skips it too: its
        gradients dropped, the step counted as skipped and not as finite; the scale kept."""
        for p in params:
            p.grad = None
        self._state.good_steps.sub_(1).clamp_(min=0)
        self._state.skipped += 1

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._state.scale.fill_(float(saved["scale"]))
        self._state.good_steps.fill_(int(saved["good_steps"]))


class _State:
    """A loss scale's state as 0-d tensors on one device, as torch's kernels take them."""

    def __init__(self, scale: float, good_steps: int, skipped: int, device: torch.device) -> None:
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.good_steps = torch.full((), good_steps, dtype=torch.int32, device=device)
        self.skipped = torch.full((), skipped, dtype=torch.float32, device=device)
        self.found = torch.zeros((), device=device)

    def to(self, device: torch.device) -> _State:
        moved = _State(0.0, 0, 0, device)
        for name in ("scale", "good_steps", "skipped", "found"):
            getattr(moved, name).copy_(getattr(self, name))
        return moved


def _check_and_unscale(held: list[torch.nn.Parameter], inverse: torch.Tensor) -> torch.Tensor:
    """Every gradient of `held` times `inverse`, in torch's fused kernel, which also flags an
    Inf or NaN; the flag (0-d, on the first gradient's device: what the world's backend, NCCL
    on GPUs, reduces), maxed over the world."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in held:
        grad = local(p.grad)
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    found = torch.zeros((), device=next(iter(by_kind))[0] if by_kind else "cpu")
    for (device, _), grads in by_kind.items():
        flag = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inverse.to(device))
        torch.maximum(found, flag.to(found.device), out=found)  # 0 or 1: fused steps skip at 1
    if dist.is_available() and dist.is_initialized():  # the world agrees
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether `optimizer`'s step skips an overflowed step itself, on the device: torch's fused
    Adam, AdamW and SGD read `found_inf`, and every class above them that has its own `step`
    says it leaves the skip to them (`passes_found_inf`: `DistributedOptimizer`, whose step is
    theirs after the reduction), or hands the flag to an inner optimizer that does
    (`forwards_found_inf`: ZeRO 1's, to the optimizer of its part). Other wrappers (local SGD,
    parameter servers, replica groups) would act on the gradients an overflow left, so those
    get the host's verdict."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    for kind in type(optimizer).__mro__:
        if kind.__module__.startswith("torch.optim"):
            return True
        if vars(kind).get("forwards_found_inf", False):
            return skips_on_device(cast(Any, optimizer).optim)
        if "step" in vars(kind) and not vars(kind).get("passes_found_inf", False):
            return False
    return False


def update(optimizer: Optimizer, scale: DynamicLossScale | None) -> None:
    """The loop's optimizer step. With a loss scale: the gradients are reduced first (a
    `DistributedOptimizer`'s `synchronize`; FSDP2 reduced them in backward), then unscaled and
    checked (`DynamicLossScale.unscale`, or `unscale_on_device`), then the step, which updates
    nothing after an overflow (the gradients are gone, or the optimizer skips them) and still
    ends the step for the optimizer wrapper."""
    distributed = is_distributed(optimizer)
    if scale is not None:
        if distributed:
            cast(Any, optimizer).synchronize()
        if skips_on_device(optimizer):
            scale.unscale_on_device(optimizer)
        else:
            scale.unscale(p for group in optimizer.param_groups for p in group["params"])
    try:
        if not distributed:
            with span("step"):
                optimizer.step()
            return
        synced = cast(Any, optimizer).skip_synchronize() if scale else contextlib.nullcontext()
        with synced:  # the wrapper spans its update itself
            optimizer.step()
    finally:  # this step's flag only, as `GradScaler` leaves it
        vars(optimizer).pop("found_inf", None)
