"""Host reads in the step: a tensor's value read by the CPU, an error while the guard is on.

On a GPU, `t.item()`, `float(t)`, `bool(t)`, `t.tolist()` and `t[i] = 1.0` (a Python number
set by index: torch copies it from pageable memory) make the host wait until the GPU has run
everything queued, so the next step's kernels are launched only after the device went idle.
issue 57's H100 run found one such line in the bucket's pack (`buffer[-1] = 1.0`): 2.6 ms a
step of an 85.6M GPT, 8 % of it. On the CPU they cost nothing and no timing shows them, so the
rule is checked where it is written: inside `with HostReads():`, a torch function mode raises on
those calls when they come straight from gradmesh's code, naming the file and line (as the
device guard does, `gradmesh_caller`). The tests run the trainer's steady steps inside it
(tests/distributed/test_host_reads.py).

torch's own `torch.cuda.set_sync_debug_mode` is the GPU's version of the same check (the GPU
check's profile uses it); it needs CUDA, which CI does not have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradmesh.errors import GradmeshError
from gradmesh.runtime.device_guard import gradmesh_caller

READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"})


class HostReads(TorchFunctionMode):
    """Raises on a host read (module docstring) called from gradmesh's code."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        by_index = name == "__setitem__" and len(args) > 2 and isinstance(args[2], int | float)
        if (name in READS or by_index) and not torch.compiler.is_compiling():
            where = gradmesh_caller()
            if where is not None:
                what = "a Python number set by index" if by_index else f"Tensor.{name}"
                raise GradmeshError(
                    f"{where}: {what} in the step (on a GPU the host waits for the device "
                    "here; keep the value on the device)"
                )
        return func(*args, **(kwargs or {}))
