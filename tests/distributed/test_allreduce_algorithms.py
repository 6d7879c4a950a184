"""Every allreduce algorithm equals the exact sum (and native) on 1-8 real ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradmesh
from gradmesh.collectives import allgather, allreduce, broadcast, reduce_scatter
from tests.harness import run_ranks

ALGORITHMS = ["ring", "tree", "butterfly", "star", "hierarchical", "native", "auto"]
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-2, "bfloat16": 5e-2, "int64": 0.0}

Case = tuple[int, str, bool]  # (length, dtype name, non-contiguous)


def make_input(rank: int, length: int, dtype: str, strided: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == "int64":
        base = torch.randint(-1000, 1000, (length * (2 if strided else 1),), generator=g)
    else:
        base = torch.randn(length * (2 if strided else 1), generator=g, dtype=torch.float64)
    base = base.to(DTYPES[dtype])
    return base[::2] if strided else base


def reduce_cases(cases: list[Case], seed: int) -> dict[str, list[torch.Tensor]]:
    """On each rank: every algorithm on every case, twice (buffers are reused across calls)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name in ALGORITHMS:
        results = []
        for repeat in range(2):
            for i, (length, dtype, strided) in enumerate(cases):
                t = make_input(gradmesh.rank(), length, dtype, strided, seed + i)
                assert t.is_contiguous() == (not strided or length <= 1)
                allreduce(t, algorithm=name)
                if repeat == 1:
                    results.append(t.clone())
        out[name] = results
    return out


def check_world(world: int, cases: list[Case], seed: int, local_size: int | None = None) -> None:
    per_rank = run_ranks(reduce_cases, world, cases, seed, timeout=120, local_size=local_size)
    for i, (length, dtype, strided) in enumerate(cases):
        inputs = [make_input(r, length, dtype, strided, seed + i) for r in range(world)]
        exact = torch.stack([t.to(torch.float64) for t in inputs]).sum(0)
        scale = torch.stack([t.to(torch.float64).abs() for t in inputs]).sum(0).clamp(min=1.0)
        for name in ALGORITHMS:
            first = per_rank[0][name][i]
            assert first.dtype == DTYPES[dtype] and first.shape == (length,)
            err = ((first.to(torch.float64) - exact).abs() / scale).max() if length else 0.0
            assert err <= TOLERANCE[dtype], f"{name} {dtype} len {length} world {world}: {err}"
            for rank in range(1, world):  # every rank holds the same result
                assert torch.equal(per_rank[rank][name][i], first), f"{name} rank {rank} differs"


case_strategy = st.tuples(
    st.integers(0, 40) | st.integers(0, 5000),
    st.sampled_from(list(DTYPES)),
    st.booleans(),
)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
@settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(case_strategy, min_size=4, max_size=8), seed=st.integers(0, 10_000))
def test_all_algorithms_match_the_exact_sum(world: int, cases: list[Case], seed: int) -> None:
    fixed: list[Case] = [(0, "float32", False), (1, "int64", False), (world - 1, "float64", True)]
    check_world(world, fixed + cases, seed)


def test_two_hosts_of_three_hierarchical_and_large_messages() -> None:
    cases: list[Case] = [
        (1 << 18, "float32", False),
        (100_003, "float64", False),
        (5, "int64", True),
    ]
    check_world(6, cases, seed=1, local_size=3)


def other_collectives() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, p = gradmesh.rank(), gradmesh.size()
    gathered = allgather(torch.tensor([r, 10 * r]))
    block = reduce_scatter(torch.arange(10, dtype=torch.float32) * (r + 1))
    b = torch.full((4,), float(r))
    broadcast(b, root=p - 1)
    return gathered, block, b


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_reduce_scatter_broadcast(world: int) -> None:
    results = run_ranks(other_collectives, world)
    total = torch.arange(10, dtype=torch.float32) * sum(range(1, world + 1))
    blocks = [total[r * 10 // world : (r + 1) * 10 // world] for r in range(world)]
    for rank, (gathered, block, b) in enumerate(results):
        assert gathered.tolist() == [[r, 10 * r] for r in range(world)]
        assert torch.equal(block, blocks[rank])
        assert b.tolist() == [float(world - 1)] * 4


def probe_on_rank() -> tuple[float, float, float]:
    from gradmesh.collectives import probe

    params = probe(sizes=(8, 65536, 1 << 20), repeats=3)
    return params.alpha, params.beta, params.gamma


def test_probe_gives_every_rank_the_same_positive_fit() -> None:
    fits = run_ranks(probe_on_rank, 3)
    assert fits[0] == fits[1] == fits[2]
    alpha, beta, gamma = fits[0]
    assert 0 < alpha < 0.1 and 0 < beta < 1e-6 and 0 < gamma < 1e-6


def bytes_per_algorithm() -> dict[str, int]:
    sent = {}
    for name in ("ring", "star", "tree"):
        before = gradmesh.get_runtime().comm.bytes_sent
        allreduce(torch.ones(4000), algorithm=name)
        sent[name] = gradmesh.get_runtime().comm.bytes_sent - before
    return sent


def test_bytes_sent_are_what_each_algorithm_puts_on_the_wire() -> None:
    per_rank = run_ranks(bytes_per_algorithm, 4)
    n = 16000
    assert all(r["ring"] == 2 * 3 * n // 4 for r in per_rank)  # 2(p-1) segments of n/p
    assert per_rank[0]["star"] == 3 * n and per_rank[1]["star"] == n  # the root sends p-1 copies
    assert sum(r["tree"] for r in per_rank) == 2 * 3 * n  # p-1 edges, up and down


def reduce_ops() -> dict[str, dict[str, list[float]]]:
    """Every algorithm with min, max and product on float and integer tensors."""
    r = gradmesh.rank()
    out: dict[str, dict[str, list[float]]] = {}
    for name in ALGORITHMS:
        out[name] = {}
        for op in ("min", "max", "product"):
            for dtype in (torch.float64, torch.int64):
                t = torch.tensor([r + 1, -(r + 1), 2 * (r % 2) - 1, 5, 0], dtype=dtype)
                out[name][f"{op}-{dtype}"] = allreduce(t, op=op, algorithm=name).tolist()
    return out


@pytest.mark.parametrize(("world", "local_size"), [(2, None), (3, 2)])
def test_min_max_product_on_every_algorithm(world: int, local_size: int | None) -> None:
    per_rank = run_ranks(reduce_ops, world, local_size=local_size, timeout=120)
    inputs = torch.tensor(
        [[r + 1, -(r + 1), 2 * (r % 2) - 1, 5, 0] for r in range(world)], dtype=torch.float64
    )
    want = {
        "min": inputs.min(0).values.tolist(),
        "max": inputs.max(0).values.tolist(),
        "product": inputs.prod(0).tolist(),
    }
    for out in per_rank:
        for name in ALGORITHMS:
            for key, got in out[name].items():
                assert got == want[key.split("-")[0]], (name, key)
