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
    [
        ("splits", "alltoall: rank 1 gave bad input"),
        ("shape", "the ranks called different operations: rank 0: alltoall of float32 (-1, 3)"),
    ],
)
def test_bad_alltoall_input_is_one_error_on_every_rank(world: int, case: str, message: str) -> None:
    errors = run_ranks(bad_alltoall, world, case, timeout=30)
    for r, error in enumerate(errors):
        assert message in error and f"rank {r}:" in error and "\n" not in error, error
    if case == "splits":
        assert f"splits [{world}, 1" in errors[1]  # the rank at fault says what was wrong


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16]
DTYPES += [torch.bfloat16, torch.float32, torch.float64, torch.bool]


def alltoall_dtypes() -> dict[str, Any]:
    me, world = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        # rank r holds rows (2j + 10r, 2j + 1 + 10r) and sends r + 1 of them to each rank;
        # without splits, its first `world` rows, one to each rank
        x = (torch.arange(world * (me + 1) * 2).reshape(-1, 2) + 10 * me).to(dtype)
        got, received = hvd.alltoall(x, splits=[me + 1] * world)
        even = hvd.alltoall(x[:world])  # without splits: the rows alone, as in Horovod
        out[str(dtype)] = (got.dtype == dtype, got.tolist(), received.tolist(), even.tolist())
    return out


def _row(j: int, r: int, dtype: torch.dtype) -> list[Any]:
    values = [2 * j + 10 * r, 2 * j + 1 + 10 * r]
    return [bool(v) for v in values] if dtype == torch.bool else values


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall_carries_every_dtype_with_and_without_splits(world: int) -> None:
    for me, got in enumerate(run_ranks(alltoall_dtypes, world)):
        for dtype in DTYPES:
            same, rows, received, even = got[str(dtype)]
            assert same, dtype
            assert received == [r + 1 for r in range(world)], dtype
            want = [
                _row(j, r, dtype)
                for r in range(world)
                for j in range(me * (r + 1), (me + 1) * (r + 1))
            ]
            assert rows == want, dtype
            assert even == [_row(me, r, dtype) for r in range(world)], dtype


def scaled_integers() -> dict[str, Any]:
    x = torch.tensor([3, -3, 7], dtype=torch.int32) * (hvd.rank() + 1)
    return {
        "pre": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5).tolist(),
        "post": hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5).tolist(),
        "dtype": str(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5).dtype),
    }


def test_scale_factors_on_integer_tensors_truncate_as_horovod_does() -> None:
    for got in run_ranks(scaled_integers, 2):
        # each rank's (3, -3, 7) x (1, 2) halved and truncated toward zero, then summed
        assert got["pre"] == [1 + 3, -1 - 3, 3 + 7]
        assert got["post"] == [4, -4, 10]  # (9, -9, 21) halved, truncated
        assert got["dtype"] == "torch.int32"


def unstepped_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].weight.requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return {
        "grads": [p.grad is not None and not p.grad.any() for p in model.parameters()],
        "state": [len(optimizer.state[p]) for p in model.parameters()],
    }


def test_broadcast_optimizer_state_initialises_an_unstepped_optimizer_as_horovod() -> None:
    for got in run_ranks(unstepped_state, 2):
        # zero gradients for what requires one (layer 1's weight is frozen: None), Adam's
        # step, exp_avg and exp_avg_sq for each of those
        assert got["grads"] == [True, True, False, True]
        assert got["state"] == [3, 3, 0, 3]


def grouped_gathers() -> dict[str, Any]:
    me = hvd.rank()
    a = torch.full((me + 1, 2), float(me))  # rank r gives r + 1 rows: first dimensions differ
    b = torch.arange(4, dtype=torch.int64) + 10 * me
    x = torch.arange(6, dtype=torch.float32).reshape(6, 1) * (me + 1)
    gathered = hvd.grouped_allgather([a, b])
    handle = hvd.grouped_allgather_async([b], name="ga")
    scattered = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum)
    rs_async = hvd.synchronize(hvd.grouped_reducescatter_async([x], op=hvd.Average, name="rs"))
    return {
        "gathered": [t.tolist() for t in gathered],
        "async": [t.tolist() for t in hvd.synchronize(handle)],
        "scattered": [t.tolist() for t in scattered],
        "rs_async": [t.tolist() for t in rs_async],
        "homogeneous": hvd.is_homogeneous(),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_grouped_gathers_and_reduce_scatters_are_each_tensors_own(world: int) -> None:
    """grouped_allgather / grouped_reducescatter (and their async forms) give, for each tensor,
    what allgather / reducescatter give; 3 ranks on hosts of 2 and 1 are not homogeneous."""
    total = sum(range(1, world + 1))  # sum over ranks of (r + 1)
    for me, got in enumerate(run_ranks(grouped_gathers, world, local_size=2)):
        rows = [[float(r), float(r)] for r in range(world) for _ in range(r + 1)]
        ints = [v + 10 * r for r in range(world) for v in range(4)]
        assert got["gathered"] == [rows, ints]
        assert got["async"] == [ints]
        n = 6 // world  # 6 rows split evenly over 2 or 3 ranks
        mine = range(me * n, (me + 1) * n)
        assert got["scattered"] == [
            [[float(v * total)] for v in mine],
            [[float(2 * v * total)] for v in mine],
        ]
        assert got["rs_async"] == [[[v * total / world] for v in mine]]
        assert got["homogeneous"] == (world == 2)
