"""The pipeline's pure parts: the schedules' order, the stage balancer, the bubble's reading."""

from __future__ import annotations

import itertools

import pytest

from gradmesh.layout.pipeline import balance, bubble, schedule_actions


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "m"), [(2, 4), (4, 8), (4, 2), (3, 5)])
def test_every_stage_runs_each_microbatch_forward_then_backward_once(
    kind: str, stages: int, m: int
) -> None:
    for stage in range(stages):
        actions = schedule_actions(kind, stage, stages, m)
        assert sorted(actions) == sorted(
            [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        )
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))
        # backwards run in micro-batch order (the next stage sends their gradients in that order)
        assert [i for a, i in actions if a == "B"] == list(range(m))


@pytest.mark.parametrize(("stages", "m"), [(4, 8), (2, 4), (4, 3)])
def test_1f1b_holds_at_most_as_many_microbatches_as_stages_ahead(stages: int, m: int) -> None:
    for stage in range(stages):
        live, peak = 0, 0
        for action, _ in schedule_actions("1f1b", stage, stages, m):
            live += 1 if action == "F" else -1
            peak = max(peak, live)
        assert peak == min(stages - stage, m)
    # GPipe holds them all
    gpipe = schedule_actions("gpipe", 0, stages, m)
    assert [a for a, _ in gpipe[:m]] == ["F"] * m


@pytest.mark.parametrize(
    "times", [[3.0, 2.6, 1.8, 2.3, 1.6, 0.1], [1.0] * 7, [5.0, 1.0, 1.0, 1.0, 1.0, 5.0]]
)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_balance_finds_the_cut_with_the_fastest_slowest_stage(times: list[float], pp: int) -> None:
    def slowest(starts: list[int]) -> float:
        ends = [*starts[1:], len(times)]
        return max(sum(times[a:b]) for a, b in zip(starts, ends, strict=True))

    starts = balance(times, pp)
    assert starts[0] == 0 and len(starts) == pp
    assert all(b > a for a, b in itertools.pairwise(starts))
    best = min(slowest([0, *cut]) for cut in itertools.combinations(range(1, len(times)), pp - 1))
    assert slowest(starts) == pytest.approx(best)


def test_bubble_is_read_off_the_stage_that_computes_longest() -> None:
    # stage 1 computes longest: it waits only while the pipeline fills and drains
    assert bubble([0.03, 0.05, 0.02], [0.50, 0.30, 0.70]) == 0.30
    assert bubble([0.04], [0.0]) == 0.0
