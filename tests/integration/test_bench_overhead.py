"""`gradmesh bench overhead` end to end: the trainer's step and a plain loop, both trained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.zygote import gradmesh

ROOT = Path(__file__).resolve().parents[2]
SIDE_KEYS = {
    "step_ms",
    "tokens_per_s",
    "step_ms_rounds",
    "optimizer_kernels",
    "zero_grad",
    "first_loss",
    "last_loss",
}


def test_bench_overhead_times_the_trainer_beside_a_plain_loop(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    flags = ["--model-args", "dim=16,depth=1,heads=2", "--batch", "4", "--sequence-length", "16"]
    flags += ["--steps", "2", "--warmup", "1", "--rounds", "1", "--device", "cpu"]
    done = gradmesh("bench", "overhead", *flags, "--json", str(out))
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())
    assert {"device", "torch", "ratio", "overhead_ms", "cpu_idle", "limit", "unit"} <= set(got)
    assert got["device"].startswith("cpu") and got["unit"] == "tokens"
    assert got["trainer_compiled"] is None  # no --compile: neither side compiled
    for side in ("trainer", "plain"):
        r = got[side]
        assert set(r) >= SIDE_KEYS
        assert len(r["step_ms_rounds"]) == 1 and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / (r["step_ms"] / 1e3))
        assert r["optimizer_kernels"] in ("fused", "foreach", "for-loop")
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
        assert r["last_loss"] < r["first_loss"]  # it trained: 4 steps on one batch
    # the same seed, weights, batch and loss: the first step's loss agrees to float rounding
    assert got["trainer"]["first_loss"] == pytest.approx(got["plain"]["first_loss"], rel=1e-5)
    assert got["trainer"]["last_loss"] == pytest.approx(got["plain"]["last_loss"], rel=1e-3)
    assert got["ratio"] == pytest.approx(got["trainer"]["step_ms"] / got["plain"]["step_ms"])
    assert got["overhead_ms"] == pytest.approx(got["trainer"]["step_ms"] - got["plain"]["step_ms"])
    assert f"trainer / plain {got['ratio']:.3f}" in done.stdout
