"""Large mini-batch learning-rate rules (Goyal et al. 2017), usable from the trainer and scripts.

Linear scaling: with k times the batch, use k times the learning rate. Gradual warm-up: start
from the single-worker rate and rise linearly to the scaled one over the first epochs, which
keeps the early, fast-changing phase of training stable. The warm-up is torch's own LinearLR.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LinearLR, LRScheduler

from gradmesh.errors import GradmeshError


def scaled_lr(
    base_lr: float, rule: str, workers: int, global_batch: int, reference_batch: int | None = None
) -> float:
    """`rule` 'none' keeps `base_lr`; 'linear' multiplies it by global batch / reference batch,
    or by the number of workers when no reference batch is given."""
    if rule == "none":
        return base_lr
    if rule != "linear":
        raise GradmeshError(f"unknown lr scaling {rule!r} (valid: linear, none)")
    factor = global_batch / reference_batch if reference_batch else workers
    return base_lr * factor


def gradual_warmup(optimizer: Optimizer, warmup_steps: int, factor: float) -> LRScheduler | None:
    """Ramp each group's rate from lr / factor up to lr over `warmup_steps` steps (call
    `.step()` after every optimizer step); None when there is nothing to warm up."""
    if warmup_steps <= 0 or factor <= 1.0:
        return None
    return LinearLR(optimizer, start_factor=1.0 / factor, end_factor=1.0, total_iters=warmup_steps)
