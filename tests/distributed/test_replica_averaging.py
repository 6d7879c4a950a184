"""The average across replica groups through each compressor, over a quorum's own Gloo process
group made as `ReplicaManager` makes it: every member ends with the same bits, near the exact
mean, sending fewer bytes; a step taken again starts from the compressor state of the first."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradmesh
from gradmesh.compression.registry import make
from gradmesh.launch.ports import free_port
from gradmesh.sync.replicas.averaging import CrossGroupAverage
from tests.harness import run_ranks

GROUPS = 3
SHAPES = [(3000,), (70, 50)]


def gradients(group: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + group)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def quorum_group(port: int, rank: int) -> Any:
    """The quorum's own Gloo process group, made as `ReplicaManager` makes it."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, GROUPS, rank == 0, timeout=timedelta(seconds=30)
    )
    prefix = dist.PrefixStore("q1/r0", store)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefix, rank, GROUPS, timedelta(seconds=30))


def _average(port: int, method: str) -> dict[str, Any]:
    rank = gradmesh.rank()
    pg = quorum_group(port, rank)
    average = CrossGroupAverage(make(method))
    first = gradients(rank, 0)
    sent = average(pg, first)
    kept = {k: s.state_dict() for k, s in average.states.items()}
    again = gradients(rank, 1)
    average(pg, again)
    average.undo()  # the step was not committed: the state is the first step's again
    undone = {k: s.state_dict() for k, s in average.states.items()}
    same = same_as(kept, undone)
    average(pg, gradients(rank, 1))
    average.committed()  # that step stands: an abort of the next (taken alone) keeps it
    stands = {k: s.state_dict() for k, s in average.states.items()}
    average.undo()
    kept_after = same_as(stands, {k: s.state_dict() for k, s in average.states.items()})
    return {
        "first": first,
        "sent": sent,
        "undo_restores": same and bool(kept["0"]["tensors"]),
        "committed_stays": kept_after and not same_as(stands, kept),
    }


def same_as(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two compressor-state dicts hold equal tensors."""
    return all(
        torch.equal(a[k]["tensors"][t], b[k]["tensors"][t]) for k in a for t in a[k]["tensors"]
    )


@pytest.mark.parametrize(
    ("method", "tolerance", "ratio"), [("fp16", 2e-3, 0.51), ("int8", 0.05, 0.27)]
)
def test_every_group_applies_the_same_compressed_average(
    method: str, tolerance: float, ratio: float
) -> None:
    none = run_ranks(_average, GROUPS, free_port(), "none")
    got = run_ranks(_average, GROUPS, free_port(), method)
    exact = [torch.stack([gradients(g, 0)[i] for g in range(GROUPS)]).mean(0) for i in range(2)]
    for rank in range(GROUPS):
        for mine, first, want in zip(got[rank]["first"], got[0]["first"], exact, strict=True):
            assert torch.equal(mine, first), "every member group decodes the same average"
            assert (mine - want).abs().max() < tolerance * want.abs().max()
        for mine, want in zip(none[rank]["first"], exact, strict=True):
            assert torch.allclose(mine, want, atol=1e-6)
    assert got[0]["sent"] < ratio * none[0]["sent"]
    assert got[0]["undo_restores"] == (method == "int8")  # int8 keeps an error-feedback residual
    assert got[0]["committed_stays"] == (method == "int8")


def _rejoin(port: int) -> dict[str, Any]:
    """PowerSGD across 3 groups: a step together; then group 2 "rejoins" with a fresh average,
    once taking the others' shared state (`load_shared`, as a copy from a peer does) and once
    not; each time every member's result of the next step."""
    rank = gradmesh.rank()
    pg = quorum_group(port, rank)
    average = CrossGroupAverage(make("powersgd"))
    average(pg, gradients(rank, 0))
    shared = average.shared()  # the same on every member after a step
    out: dict[str, Any] = {"residual_kept": "residual" in str(shared)}
    for load in (True, False):
        mine = average
        if rank == 2:
            mine = CrossGroupAverage(make("powersgd"))
            if load:
                mine.load_shared(shared)
                states = list(mine.states.values())
                out["residual_zero"] = all(not s.tensors["residual"].any() for s in states)
                out["q"] = [s.tensors["q"].clone() for s in states]
        elif load:
            out["q"] = [s.tensors["q"].clone() for s in average.states.values()]
        result = gradients(rank, 1)
        mine(pg, result)
        average.undo()  # the next try starts where this one did (a no-op on the joiner)
        out[f"loaded={load}"] = result
    return out


def test_powersgd_across_groups_stays_bit_equal_and_a_joiner_takes_the_warm_q() -> None:
    """PowerSGD's P and Q are both summed over the members each step, so every member decodes
    the same average whatever Q a joining group starts from; it takes the others' Q (their warm
    start) with the copied state, and not their residual (each group's own)."""
    got = run_ranks(_rejoin, GROUPS, free_port())
    assert not got[0]["residual_kept"] and got[2]["residual_zero"]
    for q, others in zip(got[2]["q"], got[0]["q"], strict=True):
        assert torch.equal(q, others)
    for load in (True, False):
        for rank in range(GROUPS):
            mine, first = got[rank][f"loaded={load}"], got[0][f"loaded={load}"]
            assert all(torch.equal(a, b) for a, b in zip(mine, first, strict=True))
