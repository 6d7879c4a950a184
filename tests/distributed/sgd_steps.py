"""The training steps equivalence tests share: a seeded CNN and data, and the trainer's loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gradmesh.data import GlobalBatchSharder
from gradmesh.models.small import small_cnn

GLOBAL_BATCH = 12


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(samples, 1, 8, 8, generator=g), torch.randint(0, 10, (samples,), generator=g)


def cnn() -> torch.nn.Module:
    torch.manual_seed(11)
    return small_cnn((1, 8, 8), 10)


def run_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    samples: int,
    rank: int,
    world: int,
    steps: int,
    passes: int = 1,
    set_to_none: bool = True,
) -> list[torch.Tensor]:
    """`steps` optimizer steps on this rank's slices of each global batch, loss scaled as the
    trainer does; with `passes` > 1 each slice is split into micro-batches whose gradients
    accumulate before the step. Returns the parameters."""
    x, y = data(samples)
    sharder = GlobalBatchSharder(samples, GLOBAL_BATCH, rank, world, seed=5)
    done = 0
    for epoch in range(steps):
        for idx, count in sharder.batches(epoch):
            if done == steps:
                return [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=set_to_none)
            for part in torch.tensor_split(idx, passes):
                loss = F.cross_entropy(model(x[part]), y[part], reduction="sum") * (world / count)
                loss.backward()
            opt.step()
            done += 1
    raise AssertionError("not enough data for the steps asked")
