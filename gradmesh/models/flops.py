"""Per-layer FLOPs of a model, from torch's FLOP counter: what the simulator prices a layer's
compute by (`gradmesh.simulate`) and what emulated compute spreads its sleep by
(`gradmesh.train.emulated`), so the two split a step's compute over the layers alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


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
