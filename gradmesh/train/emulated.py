"""Emulated compute (`--emulate-compute-ms MS`, for benchmarks): each step's forward and
backward take MS milliseconds longer, spread over the layers that hold weights by their FLOPs
(`models.flops`, the split the simulator prices by): a layer sleeps its share of forward before
it runs, and its share of backward once its output's gradient is there, before its own gradient
is computed. A bucket of gradients therefore leaves when it would on a device that slow, and
its reduce overlaps the backward still to come, not time after it. Sleeping takes no CPU, so
more workers than cores can stand for a bigger model's compute without the cores becoming the
limit; every report labels the run as emulated (`Report.emulated_compute_ms`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.flops import layer_flops


def emulate_compute(model: nn.Module, sample: torch.Tensor, ms: float) -> list[Any]:
    """Hooks on `model` (input like `sample`, one row is enough) that add `ms` of sleep to one
    forward and backward pass; returns the hook handles. The model takes one input tensor."""
    if not isinstance(sample, torch.Tensor):
        raise GradmeshError("--emulate-compute-ms takes a model of one input tensor")
    with torch.device("meta"):
        shadow = _meta_copy(model)
        x = torch.empty(sample.shape, dtype=sample.dtype, device="meta")
    layers = layer_flops(shadow, x)
    total = sum(la.fwd_flops + la.bwd_flops for la in layers)
    modules = dict(model.named_modules())
    handles = []
    for la in layers:
        fwd_s, bwd_s = (
            (ms / 1e3 * la.fwd_flops / total, ms / 1e3 * la.bwd_flops / total)
            if total
            else (ms / 1e3 / len(layers) / 3, 2 * ms / 1e3 / len(layers) / 3)
        )
        module = modules[la.name]
        handles.append(module.register_forward_pre_hook(lambda _m, _a, s=fwd_s: time.sleep(s)))
        handles.append(module.register_forward_hook(lambda _m, _a, out, s=bwd_s: _later(out, s)))
    return handles


def _later(out: Any, seconds: float) -> None:
    """Sleep `seconds` when `out`'s gradient arrives (nothing if it takes none)."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda _g: time.sleep(seconds))  # type: ignore[no-untyped-call]


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model` with its parameters and buffers on the meta device (no memory, no arithmetic)."""
    import copy

    shadow = copy.deepcopy(model)
    return shadow.to_empty(device="meta")
