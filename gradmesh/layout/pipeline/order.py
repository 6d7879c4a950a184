"""The pipeline schedules' orders, with no torch (the CLI's options and the planners read
them): each rank's actions for one step (`schedule_actions`), where each stage sits
(`stage_of`, `rank_of`), the bubble's formula, the checks, and `timeline`, which runs every
rank's actions as a discrete-event simulation (the simulator's pipeline and the tests of every
schedule's bubble). `gradmesh.layout.pipeline.schedules` says what each schedule does;
`gradmesh.layout.pipeline.zero_bubble` the schedules that split backward."""

from __future__ import annotations

from collections.abc import Sequence

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import SCHEDULES, V_SHAPED, chunks_of
from gradmesh.layout.pipeline.zero_bubble import (
    SPLIT,
    Action,
    check_zero_bubble,
    zero_bubble_formula,
)


def stage_of(schedule: str, chunk: int, rank: int, pp: int) -> int:
    """The pipeline stage that is chunk `chunk` of pipeline rank `rank`: c p + r, but in a V
    (rank r holding stages r and 2 p - 1 - r)."""
    if schedule in V_SHAPED and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank holding pipeline stage `stage` (`stage_of`'s inverse)."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def bubble_formula(pp: int, m: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """The idle part of the step of a pipeline of equal stages: (p - 1) / (v m + p - 1), v the
    chunks per rank (1 but under the interleaved schedule); a zero-bubble schedule's with
    equal F, B and W (`zero_bubble.zero_bubble_formula`)."""
    if schedule in SPLIT:
        return zero_bubble_formula(schedule, pp, m)
    return (pp - 1) / (virtual * m + pp - 1)


def check_schedule(schedule: str, pp: int, m: int, virtual: int) -> None:
    """One line unless `schedule` can run `m` micro-batches on `pp` ranks (`virtual` chunks a
    rank under the interleaved schedule)."""
    if schedule not in SCHEDULES:
        raise GradmeshError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)})")
    if pp < 2:
        return
    check_zero_bubble(schedule, pp, m)
    if schedule != "interleaved":
        return
    if virtual < 2:
        raise GradmeshError(
            f"--virtual-stages {virtual}: the interleaved schedule holds at least 2 chunks of "
            "the model per rank (with 1 it is 1f1b)"
        )
    if m % pp:
        raise GradmeshError(
            f"--microbatches {m}: the interleaved schedule sends micro-batches through a rank's "
            f"chunks in groups of --pipeline-parallel {pp}; give a multiple of {pp}"
        )


def schedule_actions(kind: str, stage: int, stages: int, m: int, virtual: int = 1) -> list[Action]:
    """The stage's ordered ('F' | 'B' | 'W', chunk, micro-batch) actions for one step. Under
    `interleaved` each rank holds `virtual` chunks of the model (chunk c of rank s is stage
    c * stages + s of the whole pipeline), under a V-shaped schedule two (`stage_of`); the
    others hold one (chunk 0). Only the zero-bubble schedules (`zero_bubble.SPLIT`) have W's:
    elsewhere B is the whole backward."""
    if kind in SPLIT:
        return SPLIT[kind](stage, stages, m)
    if kind == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if kind == "interleaved":
        return _interleaved(stage, stages, m, virtual)
    warmup = min(stages - stage - 1, m)
    actions = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", 0, warmup + i), ("B", 0, i)]
    return actions + [("B", 0, i) for i in range(m - warmup, m)]


def _interleaved(stage: int, p: int, m: int, v: int) -> list[Action]:
    """1F1B over `v` chunks per rank (Narayanan et al., 2021): micro-batches go through a rank's
    chunks in groups of p (the k-th forward runs chunk (k mod pv) div p on micro-batch
    (k div pv) p + k mod p; backwards visit the chunks in reverse), after a warm-up of
    2 (p - stage - 1) + (v - 1) p forwards. Needs m divisible by p (`check_schedule`)."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    actions: list[Action] = [("F", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [("F", *unit(warmup + k, False)), ("B", *unit(k, True))]
    return actions + [("B", *unit(k, True)) for k in range(total - warmup, total)]


def timeline(
    schedule: str,
    stages: int,
    m: int,
    costs: tuple[list[float], list[float], list[float]],
    sends: list[float],
    virtual: int = 1,
) -> list[float]:
    """Every pipeline rank's actions in its schedule's order as a discrete-event simulation over
    the pipeline's stages (`costs`: each stage's F, B and W seconds, W's ignored by a schedule
    that does not split backward; `sends[g]`: an activation's or its gradient's transfer between
    stages g and g + 1; rank `rank_of(g)` runs stage g): a forward waits for the stage before
    it and the transfer, a B for the stage after it (the last stage: its own F) and the
    transfer, a W for its own B. Returns the time each rank is done; one line if the order
    deadlocks (a bug)."""
    fwd, bwd, wgt = costs
    depth = stages * chunks_of(schedule, stages, virtual)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    queues = [schedule_actions(schedule, s, stages, m, virtual) for s in range(stages)]
    spent = {"F": fwd, "B": bwd, "W": wgt}
    while any(queues):
        progressed = False
        for s in range(stages):
            while queues[s]:
                kind, chunk, i = queues[s][0]
                g = stage_of(schedule, chunk, s, stages)
                if kind == "F":
                    ready = 0.0 if g == 0 else _after(done.get(("F", g - 1, i)), sends[g - 1])
                elif kind == "W":
                    ready = done.get(("B", g, i))
                elif g < depth - 1:
                    ready = _after(done.get(("B", g + 1, i)), sends[g])
                else:
                    ready = done.get(("F", g, i))
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = done[(kind, g, i)] = start + spent[kind][g]
                queues[s].pop(0)
                progressed = True
        if not progressed:
            raise GradmeshError(f"pipeline schedule {schedule} deadlocked (a bug)")
    return free


def _after(t: float | None, transfer: float) -> float | None:
    """When an action waiting for an event at `t` (None: not yet) and a transfer may start."""
    return None if t is None else t + transfer


def peak_in_flight(
    actions: Sequence[Action], held: list[float], kept: list[float] | None = None
) -> float:
    """The most bytes `actions` keep at once, `held[c]` one micro-batch's activations of chunk
    c, each kept from its F to its B, or to its W where the schedule has W's, which also keep
    from B to W the gradients their weights' operations received (`kept[c]`)."""
    extra = kept or [0.0] * len(held)
    live = top = 0.0
    split = any(kind == "W" for kind, _, _ in actions)
    for kind, c, _ in actions:
        if kind == "F":
            live += held[c]
        elif kind == "B":
            live += extra[c] if split else -held[c]
        else:
            live -= held[c] + extra[c]
        top = max(top, live)
    return top
