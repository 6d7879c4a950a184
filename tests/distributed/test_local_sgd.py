"""Local SGD: K = 1 (plain SGD) and a fully synchronous warm-up both equal synchronous training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.data import GlobalBatchSharder
from gradmesh.local_sgd import Averager, LocalSGDOptimizer
from gradmesh.models import small_cnn
from tests.harness import run_ranks

STEPS = 12


def train(rank: int, world: int, momentum: float, k: int, warmup: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(48, 1, 8, 8, generator=g), torch.randint(0, 10, (48,), generator=g)
    torch.manual_seed(11)
    model = small_cnn((1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3)
    if world > 1:
        gradmesh.broadcast_parameters(model.state_dict())
        opt = LocalSGDOptimizer(opt, Averager(list(model.parameters()), k, warmup))
    sharder = GlobalBatchSharder(len(y), 12, rank, world, seed=5)
    steps = 0
    for epoch in range(STEPS):
        for idx, count in sharder.batches(epoch):
            if steps == STEPS:
                return [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            (F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * (world / count)).backward()
            opt.step()
            steps += 1
    raise AssertionError("not enough data")


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
