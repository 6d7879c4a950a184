"""What a model costs on a device, for the simulator: the device table (`DEVICES`), each
weighted layer's FLOPs and bytes from the model built on the meta device, and the planner's
`Profile` of it, whole (`device_profile`) or per placement (`layout_profile`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.layout.planner import Profile, Unit
from gradmesh.models.flops import Layer, layer_flops
from gradmesh.registry import Registry


@dataclass(frozen=True)
class Device:
    """A device's peak rate and the fraction of it a convnet's training step reaches."""

    peak_tflops: float
    achieved: float
    source: str

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.achieved


DEVICES: Registry[Device] = Registry("device")
# P100 and V100: fp32 peaks (SXM2), achieved fractions from published ResNet-50 runs' own
# single-node times (docs/scaling.md derives them); A100 and H100: dense TF32 peaks (PyTorch's
# default for convolutions on them), achieved fractions assumed, not checked against a run.
DEVICES.register("p100")(
    Device(10.6, 0.32, "fp32; achieved from Goyal et al. 2017: 29 h for 90 epochs on 8 GPUs")
)
DEVICES.register("v100")(
    Device(15.7, 0.51, "fp32; achieved from PyTorch's DDP benchmark: 0.097 s/iter, batch 32")
)
DEVICES.register("a100")(Device(156.0, 0.16, "tf32 dense; achieved assumed"))
DEVICES.register("h100")(Device(495.0, 0.12, "tf32 dense; achieved assumed"))
CPU = "cpu"
"""This machine's CPU: its rate is measured by running the model (`measured_cpu`)."""


def _input(model: str, shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) to build `model` at: `shape`, else the ImageNet models' native
    sizes (1000 classes) and the project's own as they train here (digits, and alexnet on 32x32
    synthetic images; 10 classes)."""
    from gradmesh.models.imagenet import NATIVE_SHAPES

    own = {"alexnet": (3, 32, 32), "cnn": (1, 8, 8), "mlp": (1, 8, 8), "linear": (1, 8, 8)}
    shape = shape or NATIVE_SHAPES.get(model) or own.get(model, (3, 224, 224))
    return shape, 1000 if shape[-1] >= 64 else 10


def model_layers(model: str, batch: int, shape: tuple[int, ...] | None = None) -> list[Layer]:
    """Every module that holds weights, in forward order, with its FLOPs at `batch` (forward,
    backward) and parameter bytes, from the model built on the meta device (`layer_flops`)."""
    import torch

    from gradmesh.models.registry import FEATURE_ID_MODELS, MODELS

    builder = MODELS.get(model)
    if model in FEATURE_ID_MODELS:
        raise GradmeshError(f"model {model} takes feature ids; the simulator models image inputs")
    shape, classes = _input(model, shape)
    with torch.device("meta"):
        net = builder(shape, classes)
        x = torch.randn(batch, *shape)
    return layer_flops(net, x)


def measured_cpu(model: str, batch: int, shape: tuple[int, ...] | None = None) -> Device:
    """This machine's rate on `model`: its FLOPs over the median of three timed forward and
    backward passes (after one warm-up), on real tensors."""
    import torch

    from gradmesh.models.registry import MODELS

    shape, classes = _input(model, shape)
    net = MODELS.get(model)(shape, classes)
    x = torch.randn(batch, *shape)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        net(x).sum().backward()
        times.append(time.perf_counter() - started)
    flops = sum(layer.fwd_flops + layer.bwd_flops for layer in model_layers(model, batch, shape))
    rate = flops / sorted(times[1:])[1]
    return Device(rate / 1e12, 1.0, f"measured: {rate / 1e9:.1f} GFLOP/s on {model}")


def device_profile(layers: list[Layer], device: Device, batch: int, model: str) -> Profile:
    """A one-GPU `Profile` (the planner's) whose layers take their FLOPs over the device's rate."""
    rate = device.flops_per_s
    units = [
        Unit(
            name=layer.name,
            kind="",
            param_bytes=layer.param_bytes,
            bias_bytes=0,
            in_bytes=0,
            mid_bytes=0,
            out_bytes=0,
            dims=(0, 0),
            fwd={"data": layer.fwd_flops / rate},
            bwd={"data": layer.bwd_flops / rate},
        )
        for layer in layers
    ]
    return Profile(model, 1, batch, units, threads=0, concurrent=1, update_s_per_byte=0.0)


@dataclass(frozen=True)
class Split:
    """What the layouts that split layers need: a one-GPU profile with every placement's
    seconds (`layout_profile`), the model on the meta device, its tensor-parallel plan."""

    prof: Profile
    model: Any
    tp_plan: dict[str, str] | None


def layout_profile(
    model: str, batch: int, shape: tuple[int, ...] | None, tps: list[int], device: Device
) -> Split:
    """The planner's `Profile` of one GPU at `batch`, each unit's seconds from its FLOPs for
    every placement at each tp in `tps`: data-parallel at `batch`; a colwise or rowwise slice
    at tp t works on t times the samples and 1/t of the weights (the same FLOPs); `replicate`
    on t times the samples. Sizes and dims are the planner's own (`describe_units`)."""
    import torch

    from gradmesh.layout.pipeline import layers_of, sample_shapes
    from gradmesh.layout.planner import describe_units, placements
    from gradmesh.models.registry import MODELS, TP_PLANS

    shape, classes = _input(model, shape)
    with torch.device("meta"):
        net = MODELS.get(model)(shape, classes)
        x = torch.randn(batch, *shape)
    flops = {la.name: la for la in layer_flops(net, x)}
    layers = layers_of(net, model)
    rate = device.flops_per_s
    found = []
    for unit, *_ in describe_units(layers, sample_shapes(layers, x[:1]), model):
        la = flops[unit.name]
        for choice, t in placements(unit.dims, tps):
            times = t if choice == "replicate" else 1
            key = "data" if choice == "data" else f"{choice}@{t}"
            unit.fwd[key] = la.fwd_flops * times / rate
            unit.bwd[key] = la.bwd_flops * times / rate
        found.append(unit)
    prof = Profile(model, 1, batch, found, threads=0, concurrent=1, update_s_per_byte=0.0)
    return Split(prof, net, TP_PLANS.get(model) if model in TP_PLANS.names() else None)
