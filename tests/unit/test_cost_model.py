"""The alpha-beta-gamma formulas behave as the literature says, and auto follows them."""

from __future__ import annotations

import pytest

import gradmesh.collectives  # noqa: F401  (registers every algorithm and its cost)
from gradmesh.collectives import cost
from gradmesh.collectives.auto import choose
from gradmesh.collectives.cost import CostParams, fit_alpha_beta
from gradmesh.errors import GradmeshError

LINK = dict(alpha=50e-6, beta=1 / 1.25e8, gamma=1 / 4e9)  # 1 Gbit/s, 50 us


def test_star_grows_linearly_with_p_and_the_ring_does_not() -> None:
    n = 32 << 20
    star = [cost("star", p, n, **LINK) for p in (2, 4, 8, 16)]
    ring = [cost("ring", p, n, **LINK) for p in (2, 4, 8, 16)]
    assert star[3] / star[0] == pytest.approx(15, rel=0.05)  # 2(p-1) messages through the root
    assert ring[3] / ring[0] < 2.0  # bandwidth term 2(p-1)/p n beta stays under 2 n beta
    assert all(r < s for r, s in zip(ring[1:], star[1:], strict=True))


def test_tree_pays_log_p_full_messages() -> None:
    n = 1 << 20
    assert cost("tree", 8, n, **LINK) == pytest.approx(3 * cost("tree", 2, n, **LINK))


def test_ring_formula_exactly() -> None:
    p, n = 4, 1000
    want = 2 * 3 * LINK["alpha"] + 2 * 3 / 4 * n * LINK["beta"] + 3 / 4 * n * LINK["gamma"]
    assert cost("ring", p, n, **LINK) == pytest.approx(want)


def test_butterfly_pays_the_fold_for_non_powers_of_two() -> None:
    n = 1 << 20
    assert cost("butterfly", 5, n, **LINK) > cost("butterfly", 4, n, **LINK)
    assert cost("butterfly", 8, n, **LINK) < cost("butterfly", 5, n, **LINK)


def test_one_rank_costs_nothing_and_unknown_names_fail() -> None:
    assert cost("ring", 1, 1 << 20, **LINK) == 0.0
    with pytest.raises(GradmeshError, match="unknown allreduce algorithm 'fast'"):
        cost("fast", 4, 100, **LINK)


def test_auto_picks_latency_optimal_small_and_bandwidth_optimal_large() -> None:
    params = CostParams(**LINK)
    assert choose(8, 64, params) in ("butterfly", "tree")  # log p messages beat 2(p-1)
    assert choose(8, 64 << 20, params) in ("ring", "butterfly")  # (p-1)/p n per rank
    assert choose(8, 64 << 20, params) != "tree"
    assert choose(8, 64 << 20, params, local_size=4) in ("ring", "butterfly", "hierarchical")


def test_hierarchical_crosses_the_network_once_per_host() -> None:
    n = 64 << 20
    flat = cost("ring", 8, n, **LINK)
    two_level = cost("hierarchical", 8, n, **LINK, local_size=4)
    assert cost("hierarchical", 8, n, **LINK, local_size=1) == pytest.approx(flat)
    assert two_level != flat


def test_fit_recovers_a_known_line() -> None:
    sizes = [8, 4096, 65536, 1 << 20]
    alpha, beta = fit_alpha_beta(sizes, [20e-6 + n * 1e-9 for n in sizes])
    assert alpha == pytest.approx(20e-6, rel=1e-6)
    assert beta == pytest.approx(1e-9, rel=1e-6)
