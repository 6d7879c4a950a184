"""Per-layer FLOPs of a model, from torch's FLOP counter: what the simulator prices a layer's
compute by (`gradmesh.simulate`) and what emulated compute spreads its sleep by
(`gradmesh.train.emulated`), so the two split a step's compute over the layers alike; and
what a training run's model FLOPs utilisation (MFU) is made of: the model's FLOPs per sample
and the peak rate a worker measures for itself.

Why a measured peak: a CPU's nominal peak depends on its vector units, its clock under load and
the cores a worker shares, none of which torch reports. A worker's peak here is the best rate
of a float32 512 x 512 matrix multiply it reaches in a quarter of a second, measured by every
worker at once before training (so workers sharing cores share them here too): MFU against it
says how far the model's step is from the best dense arithmetic this worker can do."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch


@dataclass(frozen=True)
class Layer:
    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int


def layer_flops(net: nn.Module, x: torch.Tensor) -> list[Layer]:
    """Every module of `net` that holds weights, in the order forward first runs it, with its
    FLOPs on input `x` (forward, backward) and parameter bytes. Works on the meta device."""
    owners = [(n, m) for n, m in net.named_modules() if any(True for _ in m.parameters(False))]
    order: list[str] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n) if n not in order else None)
        for n, m in owners
    ]
    root = type(net).__name__
    try:
        with FlopCounterMode(display=False) as counter:
            out = net(x)
            fwd = {k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()}
            out.sum().backward()
            backward = counter.get_total_flops() - fwd.get("Global", 0.0)
    finally:
        for h in hooks:
            h.remove()
    mine = [fwd.get(f"{root}.{n}", 0.0) for n in order]
    # backward per layer: the weight's gradient and the input's (the first layer's input needs
    # none), each as much work as forward; scaled to the counter's own backward total (the
    # counter's per-module backward figures count a shortcut's work twice in residual models)
    shares = [f * (1 if i == 0 else 2) for i, f in enumerate(mine)]
    scale = backward / sum(shares) if sum(shares) else 0.0
    params = dict(owners)
    return [
        Layer(
            n,
            f,
            share * scale,
            sum(p.numel() * p.element_size() for p in params[n].parameters(False)),
        )
        for n, f, share in zip(order, mine, shares, strict=True)
    ]


def flops_per_sample(build: Callable[[], nn.Module], sample: Batch) -> float:
    """Forward and backward FLOPs of one sample through the model `build` makes, counted on
    the meta device (no weights are made), or, for a model whose forward reads values back
    (a Hugging Face Llama calls `.item()`), on a real copy made for the count."""
    try:
        with torch.device("meta"):
            return _counted(build(), batch.to(sample, "meta"))
    except (RuntimeError, NotImplementedError):
        return _counted(build(), sample)


def _counted(net: nn.Module, sample: Batch) -> float:
    with FlopCounterMode(display=False) as counter:
        out = batch.call(net, sample)
        first = batch.leaves(out, "model output")[0] if not torch.is_tensor(out) else out
        first.float().sum().backward()  # type: ignore[no-untyped-call]
    return float(counter.get_total_flops())


def measured_peak_flops(seconds: float = 0.25, n: int = 512) -> float:
    """FLOP/s of this process on a float32 `n` x `n` matrix multiply: the best of runs of 4
    over `seconds` (see the module docstring)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - started))
    return best
