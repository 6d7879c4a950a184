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
(`_amp_foreach_non_finite_check_and_unscale_`). Where the optimizer is one of torch's fused
ones (gradmesh's own on GPUs), the verdict never comes to the host: the flag goes to the
optimizer, which skips on the device, and the scale changes there (`unscale_on_device`); other
optimizers get it on the host (one read a step, `unscale`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradmesh.observe.timeline import span
from gradmesh.sync.data_parallel.optimizer import is_distributed
from gradmesh.sync.sharded.model import local


class DynamicLossScale:
    """The scale, and the count of finite steps since it last changed.

    It lives on the host until the first `update` whose optimizer skips a step on the device
    (`skips_on_device`); from there the scale, the finite-step count and the skip count are
    tensors on the gradients' device, changed there by torch's `_amp_update_scale_`, and the
    optimizer reads the overflow flag itself: no step waits for the GPU to tell the host.
    Reading `scale`, `skipped`, `good_steps` or `finite` then reads the device (the report's
    and the checkpoint's business, not the step's)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self._scale = scale
        self.growth_interval = growth_interval
        self._good_steps = 0
        self._skipped = 0
        self._finite = True
        self._held: _OnDevice | None = None

    @property
    def scale(self) -> float:
        return float(self._held.scale) if self._held else self._scale

    @property
    def good_steps(self) -> int:
        return int(self._held.good_steps) if self._held else self._good_steps

    @property
    def skipped(self) -> int:
        """Steps skipped for overflow in this run."""
        return int(self._held.skipped) if self._held else self._skipped

    @property
    def finite(self) -> bool:
        """The last unscale's verdict: every gradient of this job's ranks was finite."""
        return not bool(self._held.found) if self._held else self._finite

    @property
    def weight(self) -> float | torch.Tensor:
        """What the loss is multiplied by before backward: the scale, as a number or, once it
        is on the device, as a tensor there."""
        return self._held.scale if self._held else self._scale

    def unscale(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; whether every rank's are finite. When they are
        not, this rank's gradients are dropped (set to None, so the optimizer updates nothing
        and keeps its state), the scale halves; every `growth_interval` finite steps it
        doubles."""
        assert self._held is None, "the scale is on the device: `unscale_on_device`"
        held = [p for p in params if p.grad is not None]
        found = _check_and_unscale(held, lambda device: 1.0 / self._scale)
        finite = self._finite = not bool(found.item())
        if finite:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._scale, self._good_steps = self._scale * 2.0, 0
        else:
            for p in held:
                p.grad = None
            self._scale, self._good_steps = self._scale / 2.0, 0
            self._skipped += 1
        return finite

    def unscale_on_device(self, optimizer: Optimizer) -> None:
        """`unscale` for an optimizer that `skips_on_device`: the world's overflow flag is
        handed to it (torch's fused optimizers read `found_inf`, as `GradScaler` gives it
        them) and the scale changes on the device; the gradients stay, the step skips them."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        held = [p for p in params if p.grad is not None]
        if self._held is None:
            device = local(held[0].grad).device if held else torch.device("cpu")
            self._held = _OnDevice(self._scale, self._good_steps, self._skipped, device)
        on = self._held
        inverse = on.scale.double().reciprocal().float()  # exact: the scale is a power of 2
        on.found = _check_and_unscale(held, lambda device: inverse.to(device))
        torch._amp_update_scale_(on.scale, on.good_steps, on.found, 2.0, 0.5, self.growth_interval)
        on.skipped += on.found
        cast(Any, optimizer).found_inf = on.found

    def skipped_elsewhere(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Another replica group overflowed at this step, so this finite one skips it too: its
        gradients dropped, the step counted as skipped and not as finite; the scale kept."""
        assert self._held is None, "replica groups read the verdict on the host"
        for p in params:
            p.grad = None
        self._good_steps = max(0, self._good_steps - 1)
        self._skipped += 1

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._scale = float(saved["scale"])
        self._good_steps = int(saved["good_steps"])
        if self._held is not None:
            self._held.scale.fill_(self._scale)
            self._held.good_steps.fill_(self._good_steps)


class _OnDevice:
    """A loss scale's state as tensors on one device (0-d, as torch's kernels take them)."""

    def __init__(self, scale: float, good_steps: int, skipped: int, device: torch.device) -> None:
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.good_steps = torch.full((), good_steps, dtype=torch.int32, device=device)
        self.skipped = torch.full((), skipped, dtype=torch.float32, device=device)
        self.found = torch.zeros((), device=device)


def _check_and_unscale(
    held: list[torch.nn.Parameter], inverse: Callable[[torch.device], float | torch.Tensor]
) -> torch.Tensor:
    """Every gradient of `held` times `inverse(its device)`, in torch's fused kernel, which
    also flags an Inf or NaN; the flag (0-d, on the first gradient's device: what the world's
    backend, NCCL on GPUs, reduces), maxed over the world."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in held:
        grad = local(p.grad)
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    found = torch.zeros((), device=next(iter(by_kind))[0] if by_kind else "cpu")
    for (device, _), grads in by_kind.items():
        flag = torch.zeros((), device=device)
        factor = inverse(device)
        if not isinstance(factor, torch.Tensor):
            factor = torch.full((), factor, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, factor)
        torch.maximum(found, flag.to(found.device), out=found)  # 0 or 1: fused steps skip at 1
    if dist.is_available() and dist.is_initialized():  # the world agrees
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether `optimizer`'s step skips an overflowed step itself, on the device: torch's fused
    Adam, AdamW and SGD read `found_inf`, and every class above them that has its own `step`
    says it leaves the skip to them (`passes_found_inf`: `DistributedOptimizer`, whose step is
    theirs after the reduction). Other wrappers (local SGD, parameter servers, replica groups)
    would act on the gradients an overflow left, so those get the host's verdict."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    for kind in type(optimizer).__mro__:
        if kind.__module__.startswith("torch.optim"):
            return True
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
