"""The device guard: a tensor that gradmesh makes without naming its device is an error.

On a GPU, a tensor made without `device=` lands on the CPU and fails where it meets the data
(b000888's loss total crashed every single-GPU step), or, handed to NCCL, fails the collective.
A CPU-only machine cannot see that bug: every tensor is on the CPU anyway. So the rule is
checked where it is written: with `GRADMESH_DEVICE_GUARD=1`, a torch function mode looks at every
tensor factory (`torch.zeros`, `torch.tensor`, `torch.arange`, ... the list torch's own
default-device mode uses) and raises, naming the file and line, when the call comes straight
from gradmesh's code and names no device. Code that means the CPU says `device="cpu"`.

Why not the alternatives the issue suggested: under `torch.set_default_device("meta")` torch's
own optimizers make their step counters on meta and fail, and meta tensors mix with CPU scalars
without an error (the b000888 line passes); fake CUDA tensors (`FakeTensorMode`) carry no values,
so the loop, the collectives and evaluation cannot run. The guard needs neither, runs the real
job on real ranks, and points at the line. The test suite turns it on for every test
(tests/conftest.py), so every engine, strategy and path a test runs is checked.

The caller is the frame that called the factory: torch's internals (an optimizer's step counter)
and users' code are not gradmesh's business.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from gradmesh.errors import GradmeshError

ENV = "GRADMESH_DEVICE_GUARD"
PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


def _factories() -> frozenset[Any]:
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


class DeviceGuard(TorchFunctionMode):
    """Raises on a tensor factory called from gradmesh's code without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.factories = _factories()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # Dynamo traces this mode too; asked first, so that it folds the rest away (asked after
        # the factory test, dynamo 2.13 fails inside recomputed blocks: NameError
        # ___get_torch_function_mode_stack_at). A compiled graph is torch's, not gradmesh's.
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if func in self.factories and kwargs.get("device") is None and not _from_tensor(args):
            where = gradmesh_caller()
            if where is not None:
                raise GradmeshError(
                    f"{where}: torch.{getattr(func, '__name__', func)} without device= (it would "
                    "land on the CPU beside data on a GPU; name the device of the data it meets)"
                )
        return func(*args, **kwargs)


def gradmesh_caller() -> str | None:
    """`file:line` (relative to the package) of the code that called torch, when it is
    gradmesh's: the frame above a torch function mode's `__torch_function__`."""
    caller = sys._getframe(2)
    where = caller.f_code.co_filename
    if not where.startswith(PACKAGE):
        return None
    return f"{os.path.relpath(where, PACKAGE)}:{caller.f_lineno}"


def _from_tensor(args: tuple[Any, ...]) -> bool:
    """`torch.as_tensor(t)` / `torch.tensor(t)` of a tensor keep its device."""
    return bool(args) and isinstance(args[0], torch.Tensor)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install() -> None:
    """Push the guard on this thread's mode stack for the life of the process (once), when
    `GRADMESH_DEVICE_GUARD` is set: every rank calls this from `gradmesh.init`."""
    if enabled() and not active():
        DeviceGuard().__enter__()  # type: ignore[no-untyped-call]


def active() -> bool:
    return any(isinstance(m, DeviceGuard) for m in _get_current_function_mode_stack())  # type: ignore[no-untyped-call]
