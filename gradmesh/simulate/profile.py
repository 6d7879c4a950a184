"""What a model costs on a device, for the simulator: each weighted layer's FLOPs, parameter
bytes and kernels from the model built on the meta device (`model_layers`), and the planner's
`Profile` of it on a device (`gradmesh.simulate.devices`), whole (`device_profile`) or per
placement (`layout_profile`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradmesh.errors import GradmeshError
from gradmesh.planner.links import Profile, Unit
from gradmesh.simulate.devices import Device

if TYPE_CHECKING:
    from gradmesh.models.flops import Kernels, Layer

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


@dataclass(frozen=True)
class Costs:
    """A model's weighted layers at a batch (`Layer`: FLOPs, parameter bytes, forward kernels)
    and its backward's kernels."""

    layers: list[Layer]
    backward: Kernels


@functools.lru_cache(maxsize=32)
def model_layers(
    model: str, batch: int, shape: tuple[int, ...] | None = None, half: bool = False
) -> Costs:
    """Every module that holds weights, in forward order, with its FLOPs at `batch` (forward,
    backward), parameter bytes and kernels, and the backward's kernels, from the model built on
    the meta device (`layer_kernels`), its tensors in 16 bits with `half`."""
    import torch

    from gradmesh.models.registry import FEATURE_ID_MODELS, MODELS

    builder = MODELS.get(model)
    if model in FEATURE_ID_MODELS:
        raise GradmeshError(f"model {model} takes feature ids; the simulator models image inputs")
    shape, classes = _input(model, shape)
    dtype = torch.bfloat16 if half else torch.float32
    with torch.device("meta"):
        net = builder(shape, classes).to(dtype)
        x = torch.randn(batch, *shape, dtype=dtype, device="meta")
    from gradmesh.models.flops import layer_kernels  # imports torch: when a model is counted

    layers, backward = layer_kernels(net, x)
    return Costs(layers, backward)


def measured_cpu(model: str, batch: int, shape: tuple[int, ...] | None = None) -> Device:
    """This machine's rate on `model`: its FLOPs over the median of three timed forward and
    backward passes (after one warm-up), on real tensors."""
    import torch

    from gradmesh.models.registry import MODELS

    shape, classes = _input(model, shape)
    net = MODELS.get(model)(shape, classes)
    x = torch.randn(batch, *shape, device="cpu")
    times = []
    for _ in range(4):
        started = time.perf_counter()
        net(x).sum().backward()
        times.append(time.perf_counter() - started)
    layers = model_layers(model, batch, shape).layers
    flops = sum(layer.fwd_flops + layer.bwd_flops for layer in layers)
    rate = flops / sorted(times[1:])[1]
    return Device.flat(rate / 1e12, f"measured: {rate / 1e9:.1f} GFLOP/s on {model}")


def layer_seconds(costs: Costs, device: Device) -> list[tuple[float, float]]:
    """Each layer's (forward, backward) seconds on `device`: forward the roofline of its own
    kernels; backward the roofline of the whole backward's kernels, shared out in proportion to
    each layer's forward seconds times its backward-to-forward FLOPs (2, 1 for the first layer,
    whose input needs no gradient; 2 where it has no FLOPs: a norm's backward). A layer counted
    without kernels (a measured device) is its FLOPs over the device's rate."""
    rate = device.flops_per_s
    fwd = [
        device.seconds(la.kernels) if la.kernels and device.bandwidth_gbs else la.fwd_flops / rate
        for la in costs.layers
    ]
    if not costs.backward or not device.bandwidth_gbs:
        return [(f, la.bwd_flops / rate) for f, la in zip(fwd, costs.layers, strict=True)]
    weights = [
        f * (la.bwd_flops / la.fwd_flops if la.fwd_flops else 2.0)
        for f, la in zip(fwd, costs.layers, strict=True)
    ]
    total = device.seconds((k, f, b) for k, (f, b) in costs.backward.items())
    scale = total / sum(weights) if sum(weights) else 0.0
    return [(f, w * scale) for f, w in zip(fwd, weights, strict=True)]


def device_profile(costs: Costs, device: Device, batch: int, model: str) -> Profile:
    """A one-GPU `Profile` (the planner's) whose layers take their seconds on `device`
    (`layer_seconds`)."""
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
            fwd={"data": f},
            bwd={"data": b},
        )
        for layer, (f, b) in zip(costs.layers, layer_seconds(costs, device), strict=True)
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
    """The planner's `Profile` of one GPU at `batch`, each unit's seconds for every placement at
    each tp in `tps`: data-parallel at `batch` (`layer_seconds`); a colwise or rowwise slice at
    tp t works on t times the samples and 1/t of the weights (the same work); `replicate` on t
    times the samples. Sizes and dims are the planner's own (`describe_units`)."""
    import torch

    from gradmesh.layout.pipeline.schedules import layers_of, sample_shapes
    from gradmesh.models.registry import MODELS, TP_PLANS
    from gradmesh.planner import describe_units, placements

    shape, classes = _input(model, shape)
    with torch.device("meta"):
        net = MODELS.get(model)(shape, classes)
        x = torch.randn(batch, *shape, device="meta")
    costs = model_layers(model, batch, shape)
    seconds = dict(zip((la.name for la in costs.layers), layer_seconds(costs, device), strict=True))
    layers = layers_of(net, model)
    found = []
    for unit, *_ in describe_units(layers, sample_shapes(layers, x[:1]), model):
        f, b = seconds[unit.name]
        for choice, t in placements(unit.dims, tps):
            times = t if choice == "replicate" else 1
            key = "data" if choice == "data" else f"{choice}@{t}"
            unit.fwd[key] = f * times
            unit.bwd[key] = b * times
        found.append(unit)
    prof = Profile(model, 1, batch, found, threads=0, concurrent=1, update_s_per_byte=0.0)
    return Split(prof, net, TP_PLANS.get(model) if model in TP_PLANS.names() else None)
