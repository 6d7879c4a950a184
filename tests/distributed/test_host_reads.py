"""No host read in the trainer's steady step (`gradmesh.runtime.host_reads`): on a GPU each one
makes the host wait for the device. Steps after the first two (the first checks that the
ranks' models agree, once) run inside the guard, which raises on `item()`, `float(t)`,
`bool(t)`, `tolist()` or a Python number set by index from gradmesh's code. The CPU's
every-step non-finite read is switched to the GPU's deferred one (what a CUDA device gets)."""

from __future__ import annotations

from typing import Any

import pytest

import gradmesh
from gradmesh.runtime.host_reads import HostReads
from gradmesh.train.config import TrainConfig
from tests.harness import run_ranks

GPT = TrainConfig.of(
    model="gpt",
    model_args="dim=16,depth=2,heads=2",
    dataset="text",
    sequence_length=16,
    batch_size=8,
    epochs=1,
    optimizer="adamw",
    lr=1e-3,
)


def steady_steps(config: TrainConfig, steps: int, fused: bool = False) -> str:
    """The job's first two steps, then `steps` inside the guard; "ok" or the guard's line.
    `fused`: the job's AdamW made fused, as `gradmesh train` makes it on CUDA."""
    import torch

    from gradmesh.errors import GradmeshError
    from gradmesh.train.loop import Clock, _Run
    from gradmesh.train.setup import attach, setup

    job = setup(config, gradmesh.get_runtime())
    if fused:
        job.optimizer = torch.optim.AdamW(job.split.module.parameters(), lr=1e-3, fused=True)
    attach(job)
    assert job.sharder is not None
    watch = getattr(job.strategy, "watch", None)  # ZeRO 2 and 3's check (sharded.nonfinite)
    if watch is not None:
        watch.defer = True  # as on CUDA
    batches = job.sharder.batches(0)
    run = _Run(job, Clock(), None, None, 0)
    sums = torch.zeros(2, dtype=torch.float64, device=job.rt.device)
    for k in range(2 + steps):
        indices, count = next(batches)
        reducer: Any = getattr(job.optimizer, "_gm", None)
        if reducer is not None:
            reducer.defer_nonfinite = True  # as on CUDA: read every NONFINITE_EVERY steps
        if k < 2:
            run.one_step(job.data.train.rows(indices).pinned(job.rt.device), count, sums)
            continue
        try:
            with HostReads():
                run.one_step(job.data.train.rows(indices).pinned(job.rt.device), count, sums)
        except GradmeshError as e:
            return str(e)
    return "ok"


LAYOUTS = {
    "world 1": (1, {}),
    "dp 2": (2, {}),
    "dp 2, zero 1": (2, {"zero_stage": 1}),
    "dp 2, zero 3": (2, {"zero_stage": 3}),
    "dp 2, bf16, recompute": (2, {"precision": "bf16", "activation_checkpointing": "blocks"}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_steady_step_reads_nothing_on_the_host(layout: str) -> None:
    world, fields = LAYOUTS[layout]
    config = GPT.with_options(workers=world, **fields)
    assert run_ranks(steady_steps, world, config, 3, timeout=120) == ["ok"] * world


def test_fp16s_overflow_verdict_stays_on_the_device() -> None:
    """fp16 at dp 2 (torch runs its autocast on CPU too; `gradmesh train` asks for a GPU): with
    the fused AdamW a GPU job gets, the loss scale hands the world's overflow flag to the
    optimizer and reads nothing; with the CPU's default AdamW it reads its verdict, and the
    guard names that line (so the first assertion can fail)."""
    config = GPT.with_options(workers=2, precision="fp16")
    assert run_ranks(steady_steps, 2, config, 3, True, timeout=120) == ["ok"] * 2
    for line in run_ranks(steady_steps, 2, config, 1, False, timeout=120):
        assert "loss_scale.py" in line and "Tensor.item in the step" in line


def test_the_guard_names_the_line_of_a_host_read() -> None:
    """The line issue 57's H100 run found (`buffer[-1] = 1.0` in the bucket's pack), put back
    in a file of the package's: the guard names it."""
    import torch

    from gradmesh.errors import GradmeshError
    from gradmesh.runtime.device_guard import PACKAGE

    code = compile("buffer[-1] = 1.0\n", f"{PACKAGE}sync/data_parallel/buckets.py", "exec")
    buffer = torch.zeros(4, device="cpu")
    with HostReads(), pytest.raises(GradmeshError, match=r"buckets.py:1: a Python number set"):
        exec(code, {"buffer": buffer})
    with HostReads(), pytest.raises(GradmeshError, match=r"Tensor.item in the step"):
        exec(compile("buffer.sum().item()\n", f"{PACKAGE}x.py", "exec"), {"buffer": buffer})
    with HostReads():  # the kernel the pack now uses, and anything from outside the package
        exec(compile("buffer[-1:].fill_(1.0)\n", f"{PACKAGE}x.py", "exec"), {"buffer": buffer})
        buffer.sum().item()
