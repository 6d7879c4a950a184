"""The pipeline's pure parts: the schedules' order, the stage balancer, the bubble's reading."""

from __future__ import annotations

import itertools

import pytest

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import SCHEDULES
from gradmesh.layout.pipeline.order import (
    bubble_formula,
    check_schedule,
    peak_in_flight,
    rank_of,
    schedule_actions,
    stage_of,
    timeline,
)
from gradmesh.layout.pipeline.schedules import balance, bubble
from gradmesh.layout.pipeline.zero_bubble import SPLIT, fewest_microbatches


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "m"), [(2, 4), (4, 8), (4, 2), (3, 5)])
def test_every_stage_runs_each_microbatch_forward_then_backward_once(
    kind: str, stages: int, m: int
) -> None:
    for stage in range(stages):
        actions = [(a, i) for a, _, i in schedule_actions(kind, stage, stages, m)]
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
        for action, _, _ in schedule_actions("1f1b", stage, stages, m):
            live += 1 if action == "F" else -1
            peak = max(peak, live)
        assert peak == min(stages - stage, m)
    # GPipe holds them all
    gpipe = schedule_actions("gpipe", 0, stages, m)
    assert [a for a, _, _ in gpipe[:m]] == ["F"] * m


@pytest.mark.parametrize(("stages", "virtual", "m"), [(2, 2, 4), (2, 3, 2), (4, 2, 8), (3, 2, 6)])
def test_interleaved_runs_every_chunk_forward_then_backward_once(
    stages: int, virtual: int, m: int
) -> None:
    for stage in range(stages):
        actions = schedule_actions("interleaved", stage, stages, m, virtual)
        want = [(a, c, i) for a in "FB" for c in range(virtual) for i in range(m)]
        assert sorted(actions) == sorted(want)
        assert all(actions.index(("F", c, i)) < actions.index(("B", c, i)) for _, c, i in want)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("virtual", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_every_schedule_runs_without_deadlock_and_idles_as_its_formula(
    stages: int, virtual: int, groups: int, backward: float
) -> None:
    """Equal stages, free transfers: the schedule run action by action (a forward waits for
    the stage before, a backward for the stage after) idles exactly (p - 1) / (v m + p - 1)
    of the step; a schedule whose order could deadlock fails here."""
    m, depth = groups * stages, stages * virtual
    kind = "interleaved" if virtual > 1 else "1f1b"
    f, b = [1.0 / virtual] * depth, [backward / virtual] * depth
    free = timeline(kind, stages, m, (f, b, [0.0] * depth), [0.0] * (depth - 1), virtual)
    idle = 1 - m * (1 + backward) / max(free)
    assert idle == pytest.approx(bubble_formula(stages, m, virtual), abs=1e-12)
    if virtual > 1:  # v chunks per rank shrink the bubble against 1F1B's
        costs = ([1.0] * stages, [backward] * stages, [0.0] * stages)
        one = timeline("1f1b", stages, m, costs, [0.0] * (stages - 1))
        assert max(free) < max(one)


ZERO_BUBBLE_CASES = [(p, m) for p in range(2, 9) for m in sorted({p, 2 * p - 1, 2 * p, 3 * p, 8})]


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
@pytest.mark.parametrize(("stages", "m"), ZERO_BUBBLE_CASES)
def test_zero_bubble_schedules_run_every_action_once_in_order(
    kind: str, stages: int, m: int
) -> None:
    """Each (chunk, micro-batch): F, then B, then W, once each; a chunk's B's in micro-batch
    order (its gradients arrive in that order)."""
    chunks = 2 if kind == "zbv" else 1
    for rank in range(stages):
        actions = schedule_actions(kind, rank, stages, m)
        want = [(a, c, i) for a in "FBW" for c in range(chunks) for i in range(m)]
        assert sorted(actions) == sorted(want)
        for _, c, i in want:
            where = [actions.index((a, c, i)) for a in "FBW"]
            assert where == sorted(where)
        for c in range(chunks):
            assert [i for a, cc, i in actions if a == "B" and cc == c] == list(range(m))


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
@pytest.mark.parametrize(("stages", "m"), ZERO_BUBBLE_CASES)
def test_zero_bubble_schedules_idle_as_their_formula_and_hold_1f1b_s_peak(
    kind: str, stages: int, m: int
) -> None:
    """Equal F, B and W times, free transfers: run action by action (no deadlock), each
    schedule idles exactly its formula from its fewest micro-batches on, less than 1F1B's
    third (ZB-H1) or sixth (ZBV) plus the fill, and no rank holds more activations than 1F1B's
    first stage (p micro-batches of a stage: 2 p chunks of half a stage in a V)."""
    if m < fewest_microbatches(kind, stages):
        with pytest.raises(GradmeshError, match=f"--microbatches {m}: {kind} fills"):
            check_schedule(kind, stages, m, 2)
        return
    check_schedule(kind, stages, m, 2)
    chunks = 2 if kind == "zbv" else 1
    depth, unit = stages * chunks, 1.0 / chunks
    ones = [unit] * depth
    free = timeline(kind, stages, m, (ones, ones, ones), [0.0] * (depth - 1))
    idle = 1 - 3 * m / max(free)
    assert idle == pytest.approx(bubble_formula(stages, m, chunks, kind), abs=1e-12)
    plain = bubble_formula(stages, m)  # 1F1B's, with B the whole backward
    assert idle <= plain / (2 if kind == "zb-h1" else 4)
    for rank in range(stages):
        held = peak_in_flight(schedule_actions(kind, rank, stages, m), [unit] * chunks)
        assert held <= min(stages, m)
        if m >= 2 * stages or kind == "zb-h1":
            assert held == stages  # the same at every rank: 1F1B's first stage's


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_a_v_places_two_stages_a_rank_and_finds_each_stage_s_rank(stages: int) -> None:
    placed = sorted(stage_of("zbv", c, r, stages) for r in range(stages) for c in (0, 1))
    assert placed == list(range(2 * stages))
    assert stage_of("zbv", 0, 0, stages) == 0 and stage_of("zbv", 1, 0, stages) == 2 * stages - 1
    for schedule in ("zbv", "interleaved"):
        for r in range(stages):
            for c in (0, 1):
                assert rank_of(schedule, stage_of(schedule, c, r, stages), stages) == r


def test_schedules_refuse_what_they_cannot_run_in_one_line() -> None:
    assert set(SPLIT) <= set(SCHEDULES)  # the options' names cover the split schedules
    with pytest.raises(GradmeshError, match="unknown schedule 'zb-h2'"):
        check_schedule("zb-h2", 4, 8, 1)
    with pytest.raises(GradmeshError, match="--microbatches 3: zb-h1 .* at least 4"):
        check_schedule("zb-h1", 4, 3, 1)
    with pytest.raises(GradmeshError, match="--microbatches 5: zbv .* at least 6"):
        check_schedule("zbv", 4, 5, 2)
    check_schedule("zbv", 1, 1, 2)  # no pipeline: nothing to fill


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


def test_the_default_loss_takes_an_empty_share_of_a_short_last_batch() -> None:
    """A rank's share of an epoch's last, short batch can be empty (3 workers, 16 samples left):
    its sequence loss is zero, not an IndexError or a NaN; otherwise the engines' sum is the
    batch's mean times its samples."""
    import torch

    from gradmesh.layout.loss import summed

    loss = summed(None)
    logits, labels = torch.randn(0, 8, 5), torch.zeros(0, 8, dtype=torch.long)
    assert float(loss(logits, labels)) == 0.0
    whole = loss(torch.zeros(2, 4, 5), torch.zeros(2, 4, dtype=torch.long))
    assert float(whole) == pytest.approx(2 * torch.log(torch.tensor(5.0)).item())
