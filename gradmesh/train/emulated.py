"""Emulated compute (`--emulate-compute-ms`, for benchmarks): each step's forward and
backward take MS milliseconds longer, spread over the layers that hold weights by their FLOPs
(`models.flops`, the split the simulator prices by): a layer sleeps its share of forward before
it runs, half its share of backward once its output's gradient is there (the input's gradient,
B) and the other half when its weights' gradients are computed (W). A step of m micro-batches
(a pipeline's, or accumulation) runs each layer m times: the trainer gives it MS / m a pass. A
bucket of gradients therefore leaves when it would on a device that slow, its reduce overlaps
the backward still to come, and a zero-bubble schedule's W's take the time they would.
Sleeping takes no CPU, so more workers than cores can stand for a bigger model's compute
without the cores becoming the limit; every report labels the run as emulated
(`Report.emulated_compute_ms`)."""

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
        handles += _Sleeper(modules[la.name], fwd_s, bwd_s / 2).handles
    return handles


class _Sleeper:
    """One layer's sleeps: forward before it runs, B when its output's gradient arrives, W when
    the first of its weights' gradients is computed."""

    def __init__(self, module: nn.Module, fwd_s: float, half_bwd_s: float) -> None:
        self.fwd_s, self.half_bwd_s = fwd_s, half_bwd_s
        self.handles = [
            module.register_forward_pre_hook(lambda _m, _a: time.sleep(fwd_s)),
            module.register_forward_hook(self._output),
        ]
        weights = [p for p in module.parameters() if p.requires_grad]
        self.weights, self.fired = len(weights), 0
        for weight in weights:  # the first of them to get its gradient sleeps for the rest
            hook = weight.register_hook(lambda _g: self._weight())  # type: ignore[no-untyped-call]
            self.handles.append(hook)

    def _output(self, _module: nn.Module, _args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            once = [self.half_bwd_s]  # a zero-bubble W runs the node, and this hook, again
            out.register_hook(lambda _g: time.sleep(once.pop()) if once else None)  # type: ignore[no-untyped-call]

    def _weight(self) -> None:
        self.fired = self.fired % self.weights + 1
        if self.fired == 1:
            time.sleep(self.half_bwd_s)


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model` with its parameters and buffers on the meta device (no memory, no arithmetic)."""
    import copy

    shadow = copy.deepcopy(model)
    return shadow.to_empty(device="meta")
