"""DiLoCo: H inner steps, then the replicas' mean outer gradient through an outer Nesterov SGD;
checked against a one-process reference written from the paper's update, not torch's SGD."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.compression.registry import make
from gradmesh.data import GlobalBatchSharder
from gradmesh.sync.local_sgd import Averager, LocalSGDOptimizer
from tests.distributed.sgd_steps import GLOBAL_BATCH, cnn, data, run_steps
from tests.harness import run_ranks

STEPS, H, OUTER_LR, OUTER_MOMENTUM, SAMPLES = 12, 4, 0.7, 0.9, 48


def inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def reference(world: int) -> list[torch.Tensor]:
    """W replicas in one process, each on its own slices; every H steps the outer update by hand:
    g = mean(start - end), v = mu v + g, start -= lr (g + mu v), every replica restarts there."""
    x, y = data(SAMPLES)
    models = [cnn() for _ in range(world)]
    opts = [inner(m) for m in models]
    start = [p.detach().clone() for p in models[0].parameters()]
    velocity = [torch.zeros_like(p) for p in start]
    sharders = [GlobalBatchSharder(SAMPLES, GLOBAL_BATCH, r, world, seed=5) for r in range(world)]
    batches = [[b for e in range(STEPS) for b in s.batches(e)] for s in sharders]
    for step in range(STEPS):
        for r, (model, opt) in enumerate(zip(models, opts, strict=True)):
            idx, count = batches[r][step]
            opt.zero_grad()
            (F.cross_entropy(model(x[idx]), y[idx], reduction="sum") * (world / count)).backward()
            opt.step()
        if (step + 1) % H == 0:
            with torch.no_grad():
                for i, s in enumerate(start):
                    g = torch.stack([s - list(m.parameters())[i] for m in models]).mean(0)
                    velocity[i].mul_(OUTER_MOMENTUM).add_(g)
                    s.sub_(OUTER_LR * (g + OUTER_MOMENTUM * velocity[i]))
                    for m in models:
                        list(m.parameters())[i].copy_(s)
    return [p.detach().clone() for p in models[0].parameters()]


def averager(model: torch.nn.Module, method: str = "none") -> Averager:
    return Averager(
        list(model.parameters()),
        H,
        compressor=make(method),
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )


def on_rank(method: str) -> list[torch.Tensor]:
    model = cnn()
    gradmesh.broadcast_parameters(model.state_dict())
    opt = LocalSGDOptimizer(inner(model), averager(model, method))
    return run_steps(model, opt, SAMPLES, gradmesh.rank(), gradmesh.size(), STEPS)


def test_diloco_equals_the_papers_update_on_3_replicas() -> None:
    want = reference(3)
    for params in run_ranks(on_rank, 3, "none"):
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # the outer step moves the replicas somewhere other than their plain average
    plain = run_ranks(on_plain_rank, 3)[0]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(plain, want, strict=True))


def on_plain_rank() -> list[torch.Tensor]:
    """Local SGD, the same inner steps, plain averaging (what DiLoCo's outer step moves off)."""
    model = cnn()
    opt = LocalSGDOptimizer(inner(model), Averager(list(model.parameters()), H))
    return run_steps(model, opt, SAMPLES, gradmesh.rank(), gradmesh.size(), STEPS)


def on_rank_resumed(method: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """6 steps, the state saved; 6 more (run A). A fresh model, optimizer and averager load the
    saved state and take the same 6 steps (run B). The outer momentum, the anchors and the
    compressor's residuals must all come back for B to equal A."""
    rank, world = gradmesh.rank(), gradmesh.size()
    model = cnn()
    avg = averager(model, method)
    opt = LocalSGDOptimizer(inner(model), avg)
    run_steps(model, opt, SAMPLES, rank, world, 6)
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "avg": avg.state_dict()}
    )
    a = run_steps(model, opt, SAMPLES, rank, world, 6)
    model_b = cnn()
    avg_b = averager(model_b, method)
    opt_b = LocalSGDOptimizer(inner(model_b), avg_b)
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    avg_b.load_state_dict(saved["avg"])
    return a, run_steps(model_b, opt_b, SAMPLES, rank, world, 6)


@pytest.mark.parametrize("method", ["none", "int8"])
def test_diloco_resumes_its_outer_momentum_exactly(method: str) -> None:
    results = run_ranks(on_rank_resumed, 2, method)
    for a, b in results:
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    (a0, _), (a1, _) = results  # after step 12 (an outer step) every replica holds the same model
    assert all(torch.equal(x, y) for x, y in zip(a0, a1, strict=True))


def test_outer_lr_1_without_momentum_is_local_sgd() -> None:
    diloco = run_ranks(on_unit_outer_rank, 2)
    plain = run_ranks(on_plain_rank, 2)
    for got, want in zip(diloco[0], plain[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def on_unit_outer_rank() -> list[torch.Tensor]:
    model = cnn()
    avg = Averager(list(model.parameters()), H, outer_lr=1.0, outer_momentum=0.0)
    opt = LocalSGDOptimizer(inner(model), avg)
    return run_steps(model, opt, SAMPLES, gradmesh.rank(), gradmesh.size(), STEPS)


def on_horovod_rank() -> list[torch.Tensor]:
    """The same run through the Horovod-style API: hvd.init, broadcast, hvd.DiLoCoOptimizer."""
    import gradmesh.horovod as hvd

    hvd.init()
    model = cnn()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DiLoCoOptimizer(
        inner(model),
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )
    return run_steps(model, opt, SAMPLES, hvd.rank(), hvd.size(), STEPS)


def test_horovod_scripts_express_diloco() -> None:
    want = reference(2)
    for params in run_ranks(on_horovod_rank, 2):
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
