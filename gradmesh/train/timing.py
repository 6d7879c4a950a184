"""Timing a trainer job's steps, for benchmarks and the planner's probe: medians, the machine's
idle CPU, and the slowest rank's time outside communication (a step's peak of live tensor bytes
is `gradmesh.layout.memory.peak_bytes`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

from gradmesh.runtime.process import cpu_jiffies, idle_since


class Timed(NamedTuple):
    step_s: float
    """Median step seconds on this rank."""
    cpu_idle: float
    """The machine's idle CPU fraction over the measured steps."""
    outside_comm_s: float
    """Median seconds per step outside communication calls (compute, the loop's own work) on the
    slowest rank of each step."""


def replica_step(job: Any, batch: int) -> Callable[[], None]:
    """One training step of a trainer `Job` on this replica's slice of the first `batch`
    samples of its training data (the same slice every call)."""
    import torch

    rt, engine = job.rt, job.split.engine
    part = job.data.train.rows(
        torch.arange(batch, device="cpu").tensor_split(rt.batch.size)[rt.batch.index]
    )

    def step() -> None:
        job.optimizer.zero_grad(set_to_none=False)  # as the trainer's loop: gradients stay
        engine.step(part.x, part.y, rt.batch.size / batch)
        job.optimizer.step()

    return step


def timed_steps(job: Any, batch: int, warmup: int, steps: int) -> Timed:
    """`warmup` then `steps` training steps of a trainer `Job` on one fixed global batch (this
    replica's slice of its first `batch` samples). Byte counts (and a pipeline's clock) restart
    after the warm-up."""
    import time

    import torch

    rt, engine = job.rt, job.split.engine
    step_once = replica_step(job, batch)
    times, outside = [], []
    for step in range(warmup + steps):
        if step == warmup:
            rt.comm.by_kind.clear()
            clock = getattr(engine, "clock", None)
            if clock is not None:
                clock.step_s = clock.busy_s = 0.0
            cpu_before = cpu_jiffies()
        started, comm_before = time.perf_counter(), rt.comm.comm_s
        step_once()
        times.append(time.perf_counter() - started)
        outside.append(times[-1] - (rt.comm.comm_s - comm_before))
    # The step is this rank's own: its steps run back to back, so their median is the job's
    # period. A per-step maximum over the ranks would not be: a rank that starts a step early
    # waits for the others inside it, and the maximum keeps that wait (`bench plan` on alexnet,
    # 4 emulated hosts: tensor parallelism read 203 ms that way, 150 ms this way, in two runs).
    # The time outside communication is the slowest rank's, step by step, since that rank's
    # compute is what a synchronous step waits for.
    slowest = torch.tensor(outside[warmup:], dtype=torch.float64, device=rt.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return Timed(
        statistics.median(times[warmup:]),
        idle_since(cpu_before),
        statistics.median(slowest.tolist()),
    )
