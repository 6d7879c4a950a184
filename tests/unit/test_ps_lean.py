"""The lean server path: SGD written out equals torch's to the bit, pull snapshots are reused
but never rewritten while an answer may still be read from them, and the step-time model."""

from __future__ import annotations

import pytest
import torch

from gradmesh.collectives.cost import CostParams
from gradmesh.sync.parameter_server.cost import mean_value_analysis, step_time
from gradmesh.sync.parameter_server.optimizers import make_optimizer


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3)])
def test_server_sgd_is_torch_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    torch.manual_seed(0)
    start = torch.randn(1000)
    mine = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    sgd = make_optimizer("sgd", mine, 0.05, momentum, weight_decay)
    reference = torch.optim.SGD([theirs], lr=0.05, momentum=momentum, weight_decay=weight_decay)
    for step in range(5):
        grad = torch.randn(1000)
        scale = 1.0 / (step + 1)  # a staleness-scaled step
        sgd.apply(grad, 0, scale)
        reference.param_groups[0]["lr"] = 0.05 * scale
        theirs.grad = grad
        reference.step()
        assert torch.equal(mine, theirs)
    saved = sgd.state_dict()
    again = torch.nn.Parameter(mine.detach().clone())
    resumed = make_optimizer("sgd", again, 0.05, momentum, weight_decay)
    resumed.load_state_dict(saved)
    grad = torch.randn(1000)
    sgd.apply(grad, 0, 1.0)
    resumed.apply(grad, 0, 1.0)
    assert torch.equal(mine, again)


def test_mean_value_analysis_matches_its_limits() -> None:
    assert mean_value_analysis(0.01, [0.02, 0.03], 1) == pytest.approx(0.06)
    many = mean_value_analysis(0.01, [0.02, 0.03], 200)
    assert 200 / many == pytest.approx(1 / 0.03, rel=1e-3)  # the busiest queue's rate


def test_sharding_relieves_the_server_links_until_the_workers_limit() -> None:
    link = CostParams(alpha=0.0, beta=8 / 100e6, gamma=0.0)  # 100 Mbit/s
    one, four = (step_time(4, s, 500_000, link, 0.010) for s in (1, 4))
    assert one.bottleneck == "server links" and four.bottleneck == "worker"
    assert one.bound_s == pytest.approx(0.010 + 4 * 0.04)
    assert 2.5 < one.step_s / four.step_s < 3.0
    # a worker alone: compute, then its push and its pull over its own link; with four servers
    # the first three answers come back while later shards go out, only the last one's is extra
    alone = step_time(1, 1, 500_000, link, 0.010)
    assert alone.step_s == pytest.approx(0.010 + 2 * 0.04)
    pipelined = step_time(1, 4, 500_000, link, 0.010)
    assert pipelined.step_s == pytest.approx(0.010 + (1 + 1 / 4) * 0.04)
