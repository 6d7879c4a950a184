"""fp16 across replica groups: a step whose gradients overflowed in one group is skipped by every
group, through the groups' real step path (`ReplicaManager` against a lighthouse, the
`ReplicaOptimizer`, the loop's `loss_scale.update`). Each group is a world of its own, as in a
job (`gradmesh train --precision fp16` asks for a GPU, so the CLI path cannot run on this CPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gradmesh.runtime.world import get_runtime
from gradmesh.sync.replicas.lighthouse import Lighthouse, Rounds
from gradmesh.sync.replicas.manager import ReplicaManager
from gradmesh.sync.replicas.optimizer import ReplicaOptimizer
from gradmesh.train.loss_scale import DynamicLossScale, update
from tests.harness import run_ranks

GROUPS, STEPS, OVERFLOW = 2, 4, 1


def _group(group: int, lighthouse: str) -> dict[str, Any]:
    """STEPS steps of a linear model in replica group `group` (a world of one rank); group 1's
    gradient holds an infinity at step OVERFLOW."""
    rt = get_runtime()  # a world of one rank: the group
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params = list(model.parameters())
    scale = DynamicLossScale(scale=1024.0)
    manager = ReplicaManager(group, GROUPS, lighthouse, "fp16 test", rt, 30.0)
    step = 0
    optimizer = ReplicaOptimizer(
        torch.optim.SGD(params, lr=0.1), manager, params, lambda: step, scale
    )
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(group))
    for step in range(STEPS):  # noqa: B007 - read by the optimizer's step_of
        assert manager.start_step(step) is not None
        optimizer.zero_grad()
        (model(x).square().mean() * scale.scale).backward()
        if group == 1 and step == OVERFLOW:
            params[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        update(optimizer, scale)
    manager.finish(STEPS)
    return {
        "params": [p.detach().clone() for p in params],
        "scale": scale.scale,
        "skipped": scale.skipped,
        "aborted": manager.aborted,
    }


def test_a_step_one_group_overflowed_is_skipped_by_every_group() -> None:
    """Both groups skip the step group 1 overflowed (each counts it), only group 1 halves its
    scale, and both end with the same bits: the three steps left, each averaged."""
    rounds = Rounds(
        GROUPS, GROUPS, join_timeout_s=5.0, quorum_timeout_s=30.0, commit_timeout_s=10.0
    )
    lighthouse = Lighthouse(rounds)
    try:
        with ThreadPoolExecutor(GROUPS) as pool:  # each group a world of its own
            runs = [pool.submit(run_ranks, _group, 1, g, lighthouse.address) for g in range(GROUPS)]
            zero, one = (run.result()[0] for run in runs)
    finally:
        lighthouse.close()
    assert zero["aborted"] == one["aborted"] == 0
    assert zero["skipped"] == one["skipped"] == 1
    assert (zero["scale"], one["scale"]) == (1024.0, 512.0)
    for mine, theirs in zip(zero["params"], one["params"], strict=True):
        assert torch.equal(mine, theirs)
    # the reference: the same model, each step but OVERFLOW on the mean of the groups' gradients
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(g)) for g in range(GROUPS)]
    for step in range(STEPS):
        if step == OVERFLOW:
            continue
        grads = [
            torch.autograd.grad(model(x).square().mean(), list(model.parameters())) for x in xs
        ]
        with torch.no_grad():
            for p, *each in zip(model.parameters(), *grads, strict=True):
                p -= 0.1 * torch.stack(each).mean(0)
    for got, want in zip(zero["params"], model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
