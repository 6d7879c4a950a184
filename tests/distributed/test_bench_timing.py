"""The benches' step timing (`gradmesh.bench.harness.timed_steps`), on real gloo ranks."""

from __future__ import annotations

import time
from typing import Any

from tests.harness import run_ranks

SLOW_S = 0.04


def slow_rank_one() -> tuple[float, float]:
    """Two data-parallel ranks of the digits CNN, rank 1 sleeping `SLOW_S` before each forward:
    (step seconds, seconds outside communication) as `timed_steps` reports them here."""
    from gradmesh.runtime.world import get_runtime
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.setup import attach, setup
    from gradmesh.train.timing import timed_steps

    rt = get_runtime()
    job = setup(TrainConfig.of(workers=2, model="cnn", dataset="digits", batch_size=32), rt)
    attach(job)
    if rt.rank == 1:

        def late(*_: Any) -> None:
            time.sleep(SLOW_S)

        job.split.module.register_forward_pre_hook(late)
    timed = timed_steps(job, 32, 1, 3)
    return timed.step_s, timed.outside_comm_s


def test_time_outside_communication_is_the_slowest_ranks() -> None:
    """A step waits for its slowest rank, so the time outside communication that the planner
    adds to every placement (`Profile.step_overhead_s`) is that rank's: rank 0, which computes
    fast and then waits in the gradient allreduce, reports rank 1's compute, not its own. The
    step itself is each rank's own median, so it is not compared with that figure: the two are
    medians of different ranks' steps, and rank 0's came out 0.08 ms below rank 1's compute."""
    (step0, outside0), (step1, outside1) = run_ranks(slow_rank_one, 2, timeout=120)
    assert outside0 == outside1 >= SLOW_S
    assert step0 >= SLOW_S and step1 >= SLOW_S  # rank 0 waits for rank 1 inside its step
