"""Object collectives: plain Python values round-trip exactly, other types are refused on every
rank in one line, nothing is unpickled."""

from __future__ import annotations

import math

import pytest

import gradmesh
from gradmesh.collectives import allgather_object, broadcast_object
from gradmesh.errors import GradmeshError
from tests.harness import run_ranks


def rich(rank: int) -> dict[object, object]:
    return {
        "hello": 123,
        0: [1, 2],
        (1, "a"): (b"\x00\xff", None, True),
        "floats": [0.1, -0.0, math.inf, 2.0**-1074],
        "rank": rank,
        "nested": {"t": ((),), "l": [[], {}]},
        "sets": [{1, "a"}, frozenset({(1, 2)}), set()],
    }


def objects() -> dict[str, object]:
    r = gradmesh.rank()
    out: dict[str, object] = {
        "bcast": broadcast_object(rich(r), root_rank=1),
        "gathered": allgather_object(rich(r) if r != 0 else "x" * 5000),
        "empty": allgather_object(None),
    }
    try:
        allgather_object(1j if r == 1 else r)
    except GradmeshError as exc:
        out["refused"] = str(exc)
    try:
        broadcast_object(2**70 if r == 0 else None)
    except GradmeshError as exc:
        out["too_big"] = str(exc)
    out["after"] = broadcast_object(("still", "in", "step"), root_rank=0)  # nothing left over
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_plain_values_round_trip_and_others_are_refused_on_every_rank(world: int) -> None:
    results = run_ranks(objects, world)
    for out in results:
        assert out["bcast"] == rich(1)
        assert out["gathered"] == ["x" * 5000, *(rich(k) for k in range(1, world))]
        assert out["empty"] == [None] * world
        # the types themselves survive: int key, tuple key, bytes, negative zero
        got = out["bcast"]
        assert 0 in got and "0" not in got and isinstance(got[(1, "a")][0], bytes)
        assert math.copysign(1.0, got["floats"][1]) == -1.0
        assert [type(v) for v in got["sets"]] == [set, frozenset, set]
        assert out["after"] == ("still", "in", "step")
        # every rank raises the refusing rank's own one-line reason
        assert out["refused"].startswith("rank 1: allgather_object cannot send type complex")
        assert out["too_big"].startswith("rank 0: broadcast_object cannot send this object")
        assert "does not fit in 64 bits" in out["too_big"]
