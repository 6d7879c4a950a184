"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
each backward is split into B, the gradient of the stage's input (on the pipeline's critical
path: the stage before waits for it), and W, the gradients of the stage's weights (which nothing
downstream waits for), and the W's fill the time 1F1B spends waiting.

- `zb-h1`: 1F1B's order of forwards and input backwards, stage s running micro-batch j's W
  after micro-batch j + s's B (the rest at the end). With equal F, B and W times every stage
  idles (p - 1) of the 3 m + p - 1 units of a step, a third of 1F1B's (p - 1) (F + B + W), and
  holds at most p micro-batches' activations from F to W: 1F1B's first stage's, on every stage.
- `zbv`: 2 p stages on p ranks in a V, rank r holding stages r and 2 p - 1 - r, so the first
  and the last stage share rank 0 and the loss's gradient starts back where the batch came in.
  Its phases (warm-up of chunk 0's forwards, then chunk 1's, then F-B-W triples of both chunks,
  then a cool-down of B's whose gaps the deferred W's fill) idle only the (p - 1) chunk
  forwards the last rank waits before its first: (p - 1) / (6 m + p - 1) of the step with
  equal times, from m >= 2 (p - 1) on, holding at most 2 p chunks' activations (p micro-batches
  of a stage's worth, 1F1B's first stage's).

The formulas are the idle part of a step that starts when the first forward does and ends at
the last W, every F, B and W of a (chunk of a) stage the same time; `schedules.timeline` runs
any schedule action by action to check them. ZB-H2 and DualPipeV are not offered: ZB-H2's gain
over ZB-H1 needs the optimizer step to stop synchronising the stages (the paper's
post-validation); with equal F, B and W it idles what ZB-H1 idles under a synchronous step.
DualPipeV runs zbv's V with a forward and a backward chunk overlapped on two streams, which
hides an expert layer's all-to-all; gradmesh's stages compute on one stream.
"""

from __future__ import annotations

from collections.abc import Callable

from gradmesh.errors import GradmeshError

Action = tuple[str, int, int]
"""('F' | 'B' | 'W', chunk, micro-batch): a forward, an input backward (B, or the whole
backward under a schedule that does not split it) or a weight backward."""


def zb_h1(stage: int, p: int, m: int) -> list[Action]:
    """Stage `stage`'s actions under ZB-H1 (see the module's docstring)."""
    warmup = min(p - stage - 1, m)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    order += [("B", 0, i) for i in range(m - warmup, m)]
    out: list[Action] = []
    w = 0
    for action in order:
        out.append(action)
        if action[0] == "B" and action[2] - w >= stage:
            out.append(("W", 0, w))
            w += 1
    return out + [("W", 0, j) for j in range(w, m)]


def zbv(rank: int, p: int, m: int) -> list[Action]:
    """Rank `rank`'s actions under ZBV: chunk 0 is stage `rank`, chunk 1 stage 2 p - 1 - rank
    (see the module's docstring)."""
    out: list[Action] = []
    done = {(a, c): 0 for a in "FBW" for c in (0, 1)}

    def do(*steps: tuple[str, int]) -> None:
        for a, c in steps:  # an action only once what it needs on this rank has run
            ahead = m if a == "F" else done["F" if a == "B" else "B", c]
            if done[a, c] < ahead:
                out.append((a, c, done[a, c]))
                done[a, c] += 1

    for _ in range(2 * (p - rank) - 1):
        do(("F", 0))
    for _ in range(rank):
        do(("F", 1), ("F", 0))
    for _ in range(p - rank):
        do(("F", 1), ("B", 1), ("W", 1))
    while done["F", 0] < m or done["F", 1] < m:
        do(("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(rank):
        do(("B", 0), ("B", 1))
    for _ in range(p - rank):
        do(("B", 0), ("W", 0))
    while done["B", 0] < m or done["B", 1] < m:
        do(("B", 0), ("B", 1))
    while done["W", 1] < m:
        do(("W", 1))
    while done["W", 0] < m:
        do(("W", 0))
    return out


SPLIT: dict[str, Callable[[int, int, int], list[Action]]] = {"zb-h1": zb_h1, "zbv": zbv}
"""The schedules that split backward into B and W, by name."""


def fewest_microbatches(schedule: str, p: int) -> int:
    """The fewest micro-batches with which `schedule` reaches its formula on p ranks."""
    return {"zb-h1": p, "zbv": max(2, 2 * (p - 1))}.get(schedule, 1)


def check_zero_bubble(schedule: str, p: int, m: int) -> None:
    """One line unless a zero-bubble `schedule` can fill its bubble with `m` micro-batches."""
    if schedule not in SPLIT:
        return
    least = fewest_microbatches(schedule, p)
    if m < least:
        raise GradmeshError(
            f"--microbatches {m}: {schedule} fills the bubble of {p} pipeline ranks from "
            f"{least} micro-batches on (fewer idle like 1f1b or worse); give at least {least}"
        )


def zero_bubble_formula(schedule: str, p: int, m: int) -> float:
    """The idle part of the step of a zero-bubble schedule with equal F, B and W times."""
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (3 * m + p - 1)
