"""The sharder: each sample once per epoch, ranks' slices together are one process's batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmesh.data import GlobalBatchSharder
from gradmesh.errors import GradmeshError


def _all_ranks(n: int, batch: int, world: int, seed: int, epoch: int) -> list[list[torch.Tensor]]:
    shards = [GlobalBatchSharder(n, batch, r, world, seed) for r in range(world)]
    return [[idx for idx, _ in s.batches(epoch)] for s in shards]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 4),
    extra=st.integers(0, 40),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
)
def test_every_sample_once_per_epoch_and_steps_match_one_process(
    n: int, world: int, extra: int, seed: int, epoch: int
) -> None:
    batch = world + extra
    per_rank = _all_ranks(n, batch, world, seed, epoch)
    single = [idx for idx, _ in GlobalBatchSharder(n, batch, 0, 1, seed).batches(epoch)]
    assert all(len(steps) == len(single) for steps in per_rank)  # same number of steps everywhere
    for step, whole in enumerate(single):
        assert torch.equal(torch.cat([steps[step] for steps in per_rank]), whole)
    seen = torch.cat([idx for steps in per_rank for idx in steps])
    assert sorted(seen.tolist()) == list(range(n))


def test_order_is_reshuffled_each_epoch_and_reproducible() -> None:
    a = GlobalBatchSharder(100, 10, 0, 2, seed=1)
    b = GlobalBatchSharder(100, 10, 0, 2, seed=1)
    assert torch.equal(a.order(0), b.order(0))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), GlobalBatchSharder(100, 10, 0, 2, seed=2).order(0))


def test_global_batch_count_is_reported_with_each_slice() -> None:
    counts = [c for _, c in GlobalBatchSharder(25, 10, 1, 3, seed=0).batches(0)]
    assert counts == [10, 10, 5]


def test_batch_smaller_than_world_is_an_error() -> None:
    with pytest.raises(GradmeshError, match="global batch 2 is smaller than the number of workers"):
        GlobalBatchSharder(10, 2, 0, 3, seed=0)
