"""Synchronous data parallelism equals one process with the global batch, to float rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.data import GlobalBatchSharder
from gradmesh.models import small_cnn
from tests.harness import run_ranks

GLOBAL_BATCH = 12
STEPS = 20


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(60, 1, 8, 8, generator=g), torch.randint(0, 10, (60,), generator=g)


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(11)
    model = small_cnn((1, 8, 8), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return model, opt


def train_steps(
    rank: int, world: int, algorithm: str = "native", passes: int = 1
) -> list[torch.Tensor]:
    """STEPS steps on this rank's slices, loss scaled as the trainer does; with `passes` > 1 each
    slice is split into that many micro-batches whose gradients accumulate before the step."""
    x, y = _data()
    model, opt = _setup()
    if world > 1:
        gradmesh.broadcast_parameters(model.state_dict())
        opt = gradmesh.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            allreduce=algorithm,
            fusion_mb=0.02,
            backward_passes_per_step=passes,  # several buckets
        )
    sharder = GlobalBatchSharder(len(y), GLOBAL_BATCH, rank, world, seed=5)
    steps = 0
    for epoch in range(STEPS):
        for idx, count in sharder.batches(epoch):
            if steps == STEPS:
                return [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            for part in torch.tensor_split(idx, passes):
                loss = F.cross_entropy(model(x[part]), y[part], reduction="sum") * (world / count)
                loss.backward()
            opt.step()
            steps += 1
    raise AssertionError("not enough data for the steps asked")


ALGORITHMS = ["native", "ring", "tree", "butterfly", "star", "hierarchical"]


def every_algorithm(passes: int) -> dict[str, list[torch.Tensor]]:
    return {a: train_steps(gradmesh.rank(), gradmesh.size(), a, passes) for a in ALGORITHMS}


@pytest.mark.parametrize(("world", "passes"), [(2, 1), (3, 1), (4, 1), (3, 2)])
def test_equal_to_one_process_with_global_batch(world: int, passes: int) -> None:
    reference = train_steps(0, 1)
    results = run_ranks(every_algorithm, world, passes, timeout=180)
    for per_algorithm in results:
        for algorithm, params in per_algorithm.items():
            for got, want in zip(params, reference, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=algorithm)
    initial = list(_setup()[0].parameters())
    moved = sum(
        float((a - b).detach().abs().sum()) for a, b in zip(reference, initial, strict=True)
    )
    assert moved > 1e-2  # the steps really changed the model


def rank_with_unused_parameter() -> list[float]:
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    params = [*used.parameters(), *unused.parameters()]
    named = [(str(i), p) for i, p in enumerate(params)]
    opt = gradmesh.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), named_parameters=named)
    # rank 0 never touches `unused`; rank 1 does: no hang, and its gradient is averaged with zero
    out = used(torch.ones(1, 3)).sum()
    if gradmesh.rank() == 1:
        out = out + unused(torch.ones(1, 3)).sum()
    out.backward()
    opt.step()
    return [float(unused.bias)]


def test_parameter_without_gradient_counts_as_zero() -> None:
    torch.manual_seed(0)
    torch.nn.Linear(3, 1)
    bias0 = float(torch.nn.Linear(3, 1).bias.detach())
    got = run_ranks(rank_with_unused_parameter, 2)
    assert got[0] == got[1] == [pytest.approx(bias0 - 0.5)]  # mean of grads 0 and 1, lr 1
