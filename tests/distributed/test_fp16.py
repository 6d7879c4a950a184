"""fp16 with dynamic loss scaling on real gloo ranks: the skip decision is the world's, and a GPT
trains under fp16 autocast through the loop's own update (`gradmesh.train.loss_scale.update`)
with gradmesh's `DistributedOptimizer`, and cut into pipeline stages. On CPU: torch runs fp16
autocast here, while `gradmesh train --precision fp16` asks for a GPU (no GPU was lent to run
it there)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import gradmesh
from gradmesh.layout.engine import PlainEngine
from gradmesh.models.gpt import GPT, GPTConfig, lm_loss
from gradmesh.runtime.host_reads import HostReads
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.sharded.model import local, shard_model
from gradmesh.sync.sharded.optimizer import shard_optimizer
from gradmesh.train.loss_scale import DynamicLossScale, skips_on_device, update
from tests.distributed.test_any_model import MatmulDtypes
from tests.harness import run_ranks


def overflow_on_rank_1() -> list[Any]:
    """Four steps of one parameter whose gradient is 8 x the scale: at the second, rank 1's is
    Inf. Per step: (finite, gradient after, scale after)."""
    rank = gradmesh.rank()
    p = torch.nn.Parameter(torch.zeros(3))
    scale = DynamicLossScale(scale=1024.0, growth_interval=2)
    seen = []
    for step in range(4):
        p.grad = torch.full((3,), 8.0 * scale.scale)
        if step == 1 and rank == 1:
            p.grad[0] = float("inf")
        finite = scale.unscale([p])
        seen.append((finite, None if p.grad is None else p.grad.tolist(), scale.scale))
    restored = DynamicLossScale()
    restored.load_state_dict(scale.state_dict())
    return [seen, (restored.scale, restored.good_steps), scale.skipped]


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    """Rank 1 alone overflows: both ranks drop their gradients and halve the scale; finite steps
    are unscaled exactly, and two in a row double it; the state survives a checkpoint."""
    for seen, restored, skipped in run_ranks(overflow_on_rank_1, 2):
        assert seen == [
            (True, [8.0] * 3, 1024.0),
            (False, None, 512.0),
            (True, [8.0] * 3, 512.0),
            (True, [8.0] * 3, 1024.0),
        ]
        assert restored == (1024.0, 0) and skipped == 1


CONFIG = {"vocab": 64, "seq": 16, "dim": 32, "depth": 2, "heads": 4}


def one_step(engine: Any, opt: Any, scale: DynamicLossScale | None, x: Any, y: Any) -> float:
    """One step as the loop takes it: the loss scaled into backward, then `update`; the loss a
    token."""
    opt.zero_grad(set_to_none=False)
    factor = scale.scale if scale else 1.0
    loss = float(engine.step(x, y, factor / len(y))) / len(y)
    update(opt, scale)
    return loss


def fp16_steps(half: bool, steps: int) -> tuple[list[float], int, float, list[str], bool]:
    """`steps` AdamW steps of a GPT at dp 2 (half: fp16 autocast, a loss scale starting at 2^24,
    past what fp16's gradients hold), through `update`. Returns the losses, the steps skipped,
    the final scale, the matrix products' dtypes, and whether the skipped steps left every
    weight as it was."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    engine = PlainEngine(model, 1, lm_loss, torch.float16 if half else None)
    opt = gradmesh.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), named_parameters=model.named_parameters()
    )
    scale = DynamicLossScale(scale=2.0**24) if half else None
    g = torch.Generator().manual_seed(1 + gradmesh.rank())
    data = torch.randint(0, CONFIG["vocab"], (8, CONFIG["seq"] + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    losses, products, kept = [], MatmulDtypes(), True
    for _ in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        skipped = scale.skipped if scale else 0
        with products:
            losses.append(one_step(engine, opt, scale, x, y))
        if scale and scale.skipped > skipped:
            kept &= all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    seen = sorted(str(d) for d in products.seen)
    return losses, scale.skipped if scale else 0, scale.scale if scale else 0.0, seen, kept


def test_fp16_with_a_loss_scale_trains_a_gpt_as_fp32_does() -> None:
    """A scale that overflows at first is halved, skipping those steps without touching a
    weight, until fp16 holds the gradients; from there the losses follow an fp32 run's."""
    steps = 40
    fp32 = run_ranks(fp16_steps, 2, False, steps)[0][0]
    losses, skipped, scale, seen, kept = run_ranks(fp16_steps, 2, True, steps)[0]
    assert seen == ["torch.float16"] and kept
    assert 1 <= skipped <= 20 and scale < 2.0**24
    assert losses[-1] < 0.9 * losses[0]  # it learned
    # fp16 steps start late by the skipped ones; after them it tracks fp32's descent
    assert losses[-1] == pytest.approx(fp32[steps - 1 - skipped], rel=0.05)


def pipeline_steps(precision: str, steps: int) -> tuple[list[float], tuple[int, float] | None]:
    """`steps` AdamW steps of a 4-block GPT cut into 2 pipeline stages (4 micro-batches) under
    `precision`, a loss scale from 2^24 with fp16. Returns the losses (the last stage's) and
    (steps skipped, final scale)."""
    from gradmesh.layout.config import LayoutConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CONFIG, "depth": 4}))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG["vocab"], (8, CONFIG["seq"] + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    layout = LayoutConfig(
        pipeline_parallel=2, microbatches=4, stages="blocks.2", precision=precision
    )
    split = gradmesh.parallelize(model, layout, example=x, loss_fn=lm_loss, name="gpt")
    opt = torch.optim.AdamW(split.module.parameters(), lr=3e-3)
    scale = DynamicLossScale(scale=2.0**24) if precision == "fp16" else None
    losses = [one_step(split.engine, opt, scale, x, y) for _ in range(steps)]
    return losses, (scale.skipped, scale.scale) if scale else None


def test_pipeline_stages_skip_the_same_steps_under_fp16() -> None:
    """The two stages of a pipeline hold different gradients and overflow apart, yet skip the
    same steps and keep the same scale; past the skipped steps the losses follow fp32's."""
    steps, init = 20, {"pipeline_parallel": 2}
    fp32 = run_ranks(pipeline_steps, 2, "fp32", steps, init=init)[1][0]
    first, last = run_ranks(pipeline_steps, 2, "fp16", steps, init=init)
    assert first[1] == last[1]
    skipped, scale = last[1]
    assert 1 <= skipped <= 10 and scale == 2.0**24 / 2**skipped
    losses = last[0]
    assert losses[-1] < 0.9 * losses[0]
    assert losses[-1] == pytest.approx(fp32[steps - 1 - skipped], rel=0.05)


class HostVerdict(torch.optim.AdamW):
    """A fused AdamW behind a `step` of its own, as a wrapper's: `skips_on_device` cannot know
    what it does with the gradients, so the loss scale decides on the host."""

    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def fused_fp16_steps(
    on_device: bool, steps: int, zero_stage: int = 0
) -> tuple[list[float], int, float, Any]:
    """`steps` of the GPT at dp 2 under fp16 from a scale of 2^24 (the first steps overflow),
    with a fused AdamW through `DistributedOptimizer` and `update` (at `zero_stage` 1, over
    this replica's part), or (`zero_stage` 3) over FSDP2's DTensor shards, which reduced the
    gradients in backward: the verdict on the device
    (steps after the first inside the host-read guard) or, `HostVerdict`, on the host. Returns
    the losses, steps skipped, the final scale and the weights (this rank's shards at stage 3)."""
    torch.manual_seed(0)
    model = shard_model(GPT(GPTConfig(**CONFIG)), zero_stage, get_runtime())
    engine = PlainEngine(model, 1, lm_loss, torch.float16)
    kind = torch.optim.AdamW if on_device else HostVerdict
    opt = kind(model.parameters(), lr=3e-3, fused=True)
    if zero_stage < 2:
        opt = shard_optimizer(opt, zero_stage, get_runtime())
        opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    assert skips_on_device(opt) == on_device
    scale = DynamicLossScale(scale=2.0**24, growth_interval=4)
    g = torch.Generator().manual_seed(1 + gradmesh.rank())
    data = torch.randint(0, CONFIG["vocab"], (8, CONFIG["seq"] + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        with HostReads() if on_device and step else contextlib.nullcontext():
            loss = engine.step(x, y, scale.weight / len(y))
            update(opt, scale)
        losses.append(float(loss) / len(y))
    weights = torch.cat([local(p.detach()).flatten() for p in model.parameters()])
    return losses, scale.skipped, scale.scale, weights


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_device_verdict_takes_the_host_verdicts_steps_bit_for_bit(zero_stage: int) -> None:
    """The fused optimizer skips the overflowed steps itself and the scale changes on the
    device, with no host read in the step; the weights, losses, skips and scale are those of
    the same optimizer given the verdict on the host, bit for bit (skips, halvings, and the
    doublings of `growth_interval` 4 included). Stage 1: ZeRO's optimizer hands the flag to the
    fused optimizer of its part; stage 3: the fused step over DTensor shards takes it too (as a
    GPU's ZeRO 2/3 and tensor-parallel parameters now step fused)."""
    steps = 24
    host = run_ranks(fused_fp16_steps, 2, False, steps, zero_stage)
    device = run_ranks(fused_fp16_steps, 2, True, steps, zero_stage)
    for (losses, skipped, scale, weights), (d_losses, d_skipped, d_scale, d_weights) in zip(
        host, device, strict=True
    ):
        assert 1 <= skipped <= 12 and scale != 2.0**24 / 2**skipped  # it grew again
        assert (d_losses, d_skipped, d_scale) == (losses, skipped, scale)
        assert torch.equal(d_weights, weights)
        assert losses[-1] < 0.9 * losses[0]


def test_an_overflow_in_two_kinds_of_gradient_is_one_flag_the_fused_step_skips() -> None:
    """Gradients of two dtypes are unscaled in two kernels; both overflowing still make a flag
    of 1 (the fused step skips only at exactly 1), so the weights stay and the scale halves;
    the flag is taken off the optimizer after its step."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2).double())]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    scale = DynamicLossScale(scale=8.0)
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    update(opt, scale)
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    assert (scale.scale, scale.skipped, scale.finite) == (4.0, 1, False)
    assert not hasattr(opt, "found_inf")  # that step's flag only, as GradScaler leaves it
