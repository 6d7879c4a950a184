"""Horovod's grouped, asynchronous, reduce-scatter and all-to-all collectives through the drop-in,
on 2 and 3 ranks, checked against the values Horovod's documentation gives; bad all-to-all
input is one error on every rank, within the timeout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradmesh.horovod as hvd
from tests.harness import run_ranks

WORLDS = [2, 3]


def grouped() -> dict[str, Any]:
    r = hvd.rank()
    a = torch.full((2, 2), float(r + 1))
    b = torch.arange(3, dtype=torch.float64) * (r + 1)
    c = torch.tensor([r + 1, 10], dtype=torch.int64)
    out: dict[str, Any] = {}
    out["average"] = [t.tolist() for t in hvd.grouped_allreduce([a, b])]
    out["sum"] = [t.tolist() for t in hvd.grouped_allreduce([a, b, c], op=hvd.Sum)]
    handle = hvd.grouped_allreduce_async([a, c], average=False, name="g")
    out["async"] = [t.tolist() for t in hvd.synchronize(handle)]
    out["untouched"] = a.tolist()
    returned = hvd.grouped_allreduce_([a, b], op=hvd.Sum, prescale_factor=2.0)
    out["in_place"] = [returned[0] is a, a.tolist(), b.tolist()]
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_grouped_allreduce_reduces_each_tensor_as_one_operation(world: int) -> None:
    results = run_ranks(grouped, world)
    total = sum(range(1, world + 1))
    mean = total / world
    for got in results:
        assert got["average"] == [[[mean] * 2] * 2, [0.0, mean, 2 * mean]]
        assert got["sum"] == [
            [[float(total)] * 2] * 2,
            [0.0, total, 2.0 * total],
            [total, 10 * world],
        ]
        assert got["async"] == [[[float(total)] * 2] * 2, [total, 10 * world]]
        assert got["untouched"] != got["in_place"][1]
        assert got["in_place"] == [True, [[2.0 * total] * 2] * 2, [0.0, 2.0 * total, 4.0 * total]]


def async_gather_and_broadcast() -> dict[str, Any]:
    r = hvd.rank()
    rows = torch.full((r + 1, 2), float(r))  # first dimensions differ
    gathered = hvd.synchronize(hvd.allgather_async(rows))
    mine = torch.tensor([float(r), 7.0])
    copy = hvd.synchronize(hvd.broadcast_async(mine, root_rank=1))
    before = mine.tolist()
    handle = hvd.broadcast_async_(mine, root_rank=1)
    returned = hvd.synchronize(handle)
    return {
        "gathered": gathered.tolist(),
        "copy": copy.tolist(),
        "argument_kept": before == [float(r), 7.0],
        "in_place": mine.tolist(),
        "same_tensor": returned.data_ptr() == mine.data_ptr(),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_allgather_and_broadcast_have_async_forms(world: int) -> None:
    expected = [[float(r)] * 2 for r in range(world) for _ in range(r + 1)]
    for got in run_ranks(async_gather_and_broadcast, world):
        assert got["gathered"] == expected
        assert got["copy"] == got["in_place"] == [1.0, 7.0]
        assert got["argument_kept"] and got["same_tensor"]


def scatter() -> dict[str, Any]:
    r = hvd.rank()
    x = torch.arange(14, dtype=torch.float32).view(7, 2) * (r + 1)
    return {
        "average": hvd.reducescatter(x).tolist(),
        "sum": hvd.reducescatter(x, op=hvd.Sum, postscale_factor=0.5).tolist(),
        "async": hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum)).tolist(),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_reducescatter_gives_each_rank_its_rows_of_the_reduction(world: int) -> None:
    total = sum(range(1, world + 1))
    full = torch.arange(14, dtype=torch.float32).view(7, 2)
    base, extra = divmod(7, world)
    start = 0
    for r, got in enumerate(run_ranks(scatter, world)):
        count = base + (r < extra)  # the first 7 % world ranks get one more row
        rows = full[start : start + count]
        start += count
        assert got["average"] == (rows * total / world).tolist()
        assert got["sum"] == (rows * total * 0.5).tolist()
        assert got["async"] == (rows * total).tolist()


def exchange() -> dict[str, Any]:
    r, w = hvd.rank(), hvd.size()
    equal = torch.arange(2 * w, dtype=torch.float32).view(w, 2) + 100 * r  # one row for each
    splits = [i + 1 for i in range(w)]  # i + 1 rows to rank i
    rows = torch.full((sum(splits), 1), float(r))
    out, received = hvd.alltoall(rows, splits=splits)
    return {
        "equal": hvd.alltoall(equal).tolist(),
        "given": out.reshape(-1).tolist(),
        "received": received.tolist(),
        "async": hvd.synchronize(hvd.alltoall_async(equal))[0].tolist(),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall_sends_each_rank_its_rows(world: int) -> None:
    for r, got in enumerate(run_ranks(exchange, world)):
        assert (
            got["equal"]
            == got["async"]
            == [[2 * r + 100 * s, 2 * r + 1 + 100 * s] for s in range(world)]
        )
        assert got["received"] == [r + 1] * world
        assert got["given"] == [float(s) for s in range(world) for _ in range(r + 1)]


def bad_alltoall(case: str) -> str:
    r, w = hvd.rank(), hvd.size()
    rows = torch.zeros(w, 3 if case != "shape" or r == 0 else 4)
    splits = [1] * w if case != "splits" or r != 1 else [w, 1] + [0] * (w - 2)  # sums to w + 1
    try:
        hvd.alltoall(rows, splits=splits)
    except Exception as exc:  # noqa: BLE001 - each rank returns what it raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    ("case", "message"),
    [("splits", "alltoall: rank 1 gave bad input"), ("shape", "differ beyond the first dimension")],
)
def test_bad_alltoall_input_is_one_error_on_every_rank(world: int, case: str, message: str) -> None:
    errors = run_ranks(bad_alltoall, world, case, timeout=30)
    for r, error in enumerate(errors):
        assert message in error and f"rank {r}:" in error and "\n" not in error, error
    if case == "splits":
        assert f"splits [{world}, 1" in errors[1]  # the rank at fault says what was wrong
