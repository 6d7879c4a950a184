"""Large-batch learning-rate rules."""

from __future__ import annotations

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.train.schedule import gradual_warmup, scaled_lr


def test_linear_scaling() -> None:
    assert scaled_lr(0.1, "none", 8, 256) == 0.1
    assert scaled_lr(0.1, "linear", 8, 256) == pytest.approx(0.8)
    assert scaled_lr(0.1, "linear", 8, 1024, reference_batch=256) == pytest.approx(0.4)
    with pytest.raises(GradmeshError, match="unknown lr scaling 'sqrt'"):
        scaled_lr(0.1, "sqrt", 8, 256)


def test_gradual_warmup_rises_from_the_base_rate_to_the_scaled_one() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.8)
    warmup = gradual_warmup(opt, warmup_steps=4, factor=8.0)
    assert warmup is not None
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        warmup.step()
    assert seen[0] == pytest.approx(0.1)  # the single-worker rate
    assert seen == sorted(seen) and seen[4] == pytest.approx(0.8) and seen[5] == pytest.approx(0.8)
    assert gradual_warmup(opt, 0, 8.0) is None and gradual_warmup(opt, 4, 1.0) is None
