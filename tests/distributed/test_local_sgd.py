"""Local SGD: K = 1 (plain SGD) and a fully synchronous warm-up both equal synchronous training."""

from __future__ import annotations

import pytest
import torch

import gradmesh
from gradmesh.sync.local_sgd import Averager, LocalSGDOptimizer
from tests.distributed.sgd_steps import cnn, run_steps
from tests.harness import run_ranks

STEPS = 12


def train(rank: int, world: int, momentum: float, k: int, warmup: int) -> list[torch.Tensor]:
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3)
    if world > 1:
        gradmesh.broadcast_parameters(model.state_dict())
        opt = LocalSGDOptimizer(opt, Averager(list(model.parameters()), k, warmup))
    return run_steps(model, opt, 48, rank, world, STEPS)


def on_rank(momentum: float, k: int, warmup: int) -> list[torch.Tensor]:
    return train(gradmesh.rank(), gradmesh.size(), momentum, k, warmup)


@pytest.mark.parametrize(("momentum", "k", "warmup"), [(0.0, 1, 0), (0.9, 8, STEPS)])
def test_local_sgd_equals_synchronous_training(momentum: float, k: int, warmup: int) -> None:
    reference = train(0, 1, momentum, k, warmup)
    for params in run_ranks(on_rank, 3, momentum, k, warmup):
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_k_local_steps_drift_apart_then_agree() -> None:
    results = run_ranks(on_rank, 2, 0.9, 5, 0)  # 12 steps: averaged after 5 and 10, local after
    assert any(not torch.equal(a, b) for a, b in zip(*results, strict=True))
    synced = run_ranks(on_rank, 2, 0.9, 4, 0)  # averaged after steps 4, 8 and 12: identical
    assert all(torch.equal(a, b) for a, b in zip(*synced, strict=True))
