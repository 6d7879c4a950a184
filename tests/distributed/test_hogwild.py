"""Hogwild!: ranks of one host really share one set of weights; locked updates lose nothing."""

from __future__ import annotations

import glob

import torch
from torch import nn

import gradmesh
from gradmesh.errors import GradmeshError
from gradmesh.sync.hogwild import SHM_DIR, HogwildOptimizer, share_model
from tests.harness import run_ranks

STEPS = 25


def locked_updates(lock: bool) -> tuple[torch.Tensor, torch.Tensor, int, list[str]]:
    rank = gradmesh.rank()
    torch.manual_seed(rank)  # every rank starts from different weights: rank 0's must win
    model = nn.Linear(3, 2)
    shared = share_model(model, lock=lock)
    start = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
    # every rank has its snapshot of rank 0's values before any rank steps the shared weights
    gradmesh.barrier()
    opt = HogwildOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), shared)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    gradmesh.barrier()
    leftovers = glob.glob(f"{SHM_DIR}/gradmesh-hogwild-*")
    final = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
    shared.close()
    return start, final, shared.updates, leftovers


def test_ranks_share_rank0_weights_and_locked_updates_all_land() -> None:
    results = run_ranks(locked_updates, 3, True)
    start0, final0, _, _ = results[0]
    for start, final, updates, leftovers in results:
        torch.testing.assert_close(start, start0)  # everyone maps rank 0's values
        torch.testing.assert_close(final, final0)  # and sees every rank's writes
        assert updates == STEPS
        assert leftovers == []  # the segment is unlinked once every rank has it
    # each of the 3 ranks applied STEPS steps of gradient (rank + 1) with lr 1: none was lost
    torch.testing.assert_close(final0, start0 - STEPS * (1 + 2 + 3))


def test_one_rank_shares_and_steps_like_plain_sgd() -> None:
    ((start, final, updates, _),) = run_ranks(locked_updates, 1, False)
    torch.testing.assert_close(final, start - STEPS)
    assert updates == STEPS


def across_hosts() -> str:
    try:
        share_model(nn.Linear(2, 2))
    except GradmeshError as exc:
        return str(exc)
    return "no error"


def test_hogwild_across_hosts_is_a_clear_error() -> None:
    messages = run_ranks(across_hosts, 2, local_size=1)
    assert messages[0] == messages[1]
    assert "hogwild shares memory within one host" in messages[0]
    assert "spread over 2 hosts" in messages[0]
