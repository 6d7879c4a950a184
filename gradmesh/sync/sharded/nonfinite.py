"""ZeRO 2 and 3's stop at a non-finite gradient (`--on-nonfinite error`, the default).

At stages 2 and 3 FSDP2 reduce-scatters the gradients in backward and the job's optimizer steps
on them as they are: gradmesh's reducer, which stops plain data parallelism at a NaN or an Inf
(`gradmesh.sync.data_parallel.reducer`), never sees them, and one diverged step would go on
into the weights and every checkpoint after it. So a hook runs before each step of the
optimizer (`Optimizer.register_step_pre_hook`) and checks this rank's shard of the reduced
gradients: the rank holding a non-finite part stops with one line naming the step and the
parameter, and the launcher ends the others. The check is one sum per gradient and a search
only when a sum is not finite (an overflow of a finite gradient's sum is searched and passed);
on CUDA it is folded into the reducer's kind of flag on the device (`gradmesh.sync.nonfinite`),
read every `NONFINITE_EVERY` steps and before a checkpoint, so no step waits for a host read.
Under fp16's loss scale the scale owns non-finite gradients (the step it skips is not an
error).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.sync.nonfinite import FINITE_AGAIN, NONFINITE_EVERY, DeferredFlag, any_nonfinite
from gradmesh.sync.sharded.model import local


class NonfiniteWatch:
    """The pre-step check of one sharded model's gradients (the module docstring)."""

    def __init__(self, model: nn.Module, rank: int, stage: int, defer: bool) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.rank, self.stage, self.defer = rank, stage, defer
        self.steps = 0
        self.flag = DeferredFlag()

    def before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        if vars(optimizer).get("found_inf") is not None:
            return  # fp16's loss scale skips this step itself
        sums = [local(p.grad).sum() for _, p in self.named if p.grad is not None]
        if not sums:
            return
        if not self.defer:
            if bool(any_nonfinite(sums)):
                self._stop("")
            return
        self.flag.fold(sums)
        if self.steps % NONFINITE_EVERY == 0:
            self.read("")

    def read(self, when: str) -> None:
        """Read (and clear) the deferred flag; stop if a step since the last read had a
        non-finite gradient."""
        if self.flag.take():
            self._stop(when)

    def _stop(self, when: str) -> None:
        name = next(
            (
                n
                for n, p in self.named
                if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())
            ),
            None,
        )
        if self.defer:
            name = name or FINITE_AGAIN
        elif name is None:
            return  # a finite gradient whose sum overflowed
        raise GradmeshError(
            f"rank {self.rank}: step {self.steps}: non-finite gradient in parameter {name!r}"
            f"{when} (its shard of ZeRO {self.stage}'s reduced gradients)"
        )


def watch_nonfinite(model: nn.Module, optimizer: Any, rank: int, stage: int) -> NonfiniteWatch:
    """Stop the job before `optimizer` steps on a non-finite gradient of sharded `model`."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    watch = NonfiniteWatch(model, rank, stage, defer=device.type == "cuda")
    optimizer.register_step_pre_hook(watch.before_step)
    return watch
