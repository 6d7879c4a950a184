"""Synchronous data parallelism equals one process with the global batch, to float rounding."""

from __future__ import annotations

import pytest
import torch

import gradmesh
from tests.distributed.sgd_steps import cnn, run_steps
from tests.harness import run_ranks

STEPS = 10


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = cnn()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def train_steps(
    rank: int, world: int, algorithm: str = "native", passes: int = 1
) -> list[torch.Tensor]:
    model, opt = _setup()
    if world > 1:
        gradmesh.broadcast_parameters(model.state_dict())
        opt = gradmesh.DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            allreduce=algorithm,
            fusion_mb=0.02,  # several buckets
            backward_passes_per_step=passes,
        )
    return run_steps(model, opt, 60, rank, world, STEPS, passes)


ALGORITHMS = ["native", "ring", "tree", "butterfly", "star", "hierarchical"]


def every_algorithm(passes: int) -> dict[str, list[torch.Tensor]]:
    return {a: train_steps(gradmesh.rank(), gradmesh.size(), a, passes) for a in ALGORITHMS}


# 2 ranks: every algorithm's exact sum is in test_allreduce_algorithms
@pytest.mark.parametrize(("world", "passes"), [(4, 1), (3, 2)])
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


def rank_with_kept_gradients() -> dict[str, object]:
    """Steps with gradients kept between steps (the trainer's zero_grad(set_to_none=False)):
    from the first step on they are the buckets' own views; the steps equal those of gradients
    dropped every step (copied into the buckets and back)."""
    runs = {}
    for keep in (False, True):
        model, opt = _setup()
        gradmesh.broadcast_parameters(model.state_dict())
        opt = gradmesh.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), fusion_mb=0.02
        )
        runs[keep] = run_steps(model, opt, 60, gradmesh.rank(), gradmesh.size(), 3, 1, not keep)
        buckets = opt._gm.buckets  # type: ignore[attr-defined]
    inside = [
        any(p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
            for b in buckets)
        for p in model.parameters()
    ]  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
    return {"views": inside, "same": same, "buckets": len(buckets)}


def test_kept_gradients_are_the_buckets_views() -> None:
    for got in run_ranks(rank_with_kept_gradients, 2):
        assert got["buckets"] > 1 and all(got["views"]) and got["same"]  # type: ignore[arg-type]


def rank_with_a_nan(defer: bool, checkpoint_at: int) -> str:
    """A NaN gradient at step 2 of 40, with the "error" check read every step (CPU) or every
    NONFINITE_EVERY steps and before a checkpoint (CUDA, forced here): the error's line."""
    model, opt = _setup()
    opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt._gm.defer_nonfinite = defer  # type: ignore[attr-defined]
    x = torch.randn(4, 1, 8, 8)
    try:
        for step in range(1, 41):
            opt.zero_grad(set_to_none=False)
            model(x * float("nan") if step == 2 else x).sum().backward()
            opt.step()
            if step == checkpoint_at:
                opt._gm.state_dict()  # type: ignore[attr-defined]
    except gradmesh.GradmeshError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("defer", "checkpoint_at"), [(False, 0), (True, 0), (True, 5)])
def test_a_nan_gradient_stops_the_job(defer: bool, checkpoint_at: int) -> None:
    from gradmesh.sync.data_parallel.reducer import NONFINITE_EVERY

    first = run_ranks(rank_with_a_nan, 2, defer, checkpoint_at)[0]
    step = checkpoint_at or NONFINITE_EVERY if defer else 2
    assert first.startswith(f"rank 0: step {step}: non-finite gradient in parameter"), first
    assert ("before a checkpoint" in first) == bool(checkpoint_at)
