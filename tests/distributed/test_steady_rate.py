"""The steady rate (MFU's) leaves out the warm-up steps and each first step on a batch size not
seen before: an epoch's short last batch is compiled and autotuned afresh on a GPU, once, and
with three epochs of 24 steps (the GPU check's GPT) that one step took a fifth of the window."""

from __future__ import annotations

import gradmesh
from gradmesh.train.config import TrainConfig
from tests.harness import run_ranks


def steady_counts(config: TrainConfig) -> tuple[int, int, int]:
    from gradmesh.train.loop import WARMUP_STEPS, loop
    from gradmesh.train.setup import attach, setup

    job = setup(config, gradmesh.get_runtime())
    attach(job)
    clock, samples, _ = loop(job)
    assert clock.steady_s > 0
    return clock.steady_samples, samples, WARMUP_STEPS


def test_a_new_batch_size_is_left_out_of_the_steady_rate() -> None:
    config = TrainConfig.of(model="mlp", dataset="digits", batch_size=64, epochs=3, workers=1)
    ((steady, samples, warmup),) = run_ranks(steady_counts, 1, config)
    per_epoch = samples // 3
    short = per_epoch % 64
    assert short and per_epoch > warmup * 64  # the split leaves a short last batch
    # every sample after the warm-up steps but the first short batch's (later ones are timed)
    assert steady == samples - warmup * 64 - short
