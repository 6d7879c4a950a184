"""The non-finite check's verdict kept on the device, shared by the data-parallel reducer
(`data_parallel.reducer`) and ZeRO 2 and 3's pre-step check (`sharded.nonfinite`).

Reading a tensor's value makes the host wait for the device (on CUDA, a stall each step). So
where reading is not free each step folds whether its gradients' sums are all finite into one
boolean tensor on the device (`DeferredFlag.fold`), and the host reads it every
`NONFINITE_EVERY` steps and before a checkpoint (`take`); only then is the parameter searched
for and named.
"""

from __future__ import annotations

import torch

NONFINITE_EVERY = 32
"""Steps between reads of the deferred flag on CUDA."""
FINITE_AGAIN = "(finite again by this step)"
"""The name given at a deferred read when no parameter is non-finite any more."""


def any_nonfinite(sums: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of `sums` is NaN or Inf (a NaN or Inf in its tensor, or an overflow of the
    sum), as a boolean tensor on their device."""
    return torch.stack(sums).isfinite().all().logical_not()


class DeferredFlag:
    """Whether a step since the last read had a non-finite sum, on the device."""

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None

    def fold(self, sums: list[torch.Tensor]) -> None:
        if sums:
            bad = any_nonfinite(sums)
            self.seen = bad if self.seen is None else self.seen | bad

    def take(self) -> bool:
        """Read and clear the flag (the one host read)."""
        seen, self.seen = self.seen, None
        return seen is not None and bool(seen)
