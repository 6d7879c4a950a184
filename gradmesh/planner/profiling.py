"""The planner's profile: each unit's seconds per placement, measured on this machine under
the job's own contention, its bytes, and the links (`Links`) the job will use."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.schedules import layers_of, sample_shapes, units
from gradmesh.planner.links import Curve, Links, Profile, Unit

__all__ = [
    "Curve",
    "describe_units",
    "Links",
    "placements",
    "profile",
    "Profile",
    "sharing_threads",
    "Unit",
]


def _timed(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds + 2):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def _slice_layer(layer: nn.Module, choice: str, tp: int) -> nn.Module:
    """A plain layer shaped like this rank's slice (no exchange: its cost is modelled)."""
    if choice in ("data", "replicate") or tp == 1:
        return layer
    if isinstance(layer, nn.Linear):
        out_f, in_f = layer.out_features, layer.in_features
        if choice == "colwise":
            return nn.Linear(in_f, out_f // tp)
        return nn.Linear(in_f // tp, out_f)
    assert isinstance(layer, nn.Conv2d)
    out_c, in_c = layer.out_channels, layer.in_channels
    k, s, p = layer.kernel_size, layer.stride, layer.padding
    if choice == "colwise":
        return nn.Conv2d(in_c, out_c // tp, k, s, p)  # type: ignore[arg-type]
    return nn.Conv2d(in_c // tp, out_c, k, s, p)  # type: ignore[arg-type]


def _time_unit(
    layers: list[nn.Module], shape: torch.Size, batch: int, grad_in: bool, rounds: int
) -> tuple[float, float]:
    unit = nn.Sequential(*layers)
    x = torch.randn(batch, *shape, requires_grad=grad_in, device="cpu")

    def forward() -> torch.Tensor:
        return unit(x)  # type: ignore[no-any-return]

    fwd = _timed(forward, rounds)

    def both() -> None:
        unit(x).sum().backward()

    total = _timed(both, rounds)
    return fwd, max(total - fwd, 0.0)


def sharing_threads(sharing: int) -> int:
    """The threads the launcher gives each of `sharing` ranks on this machine."""
    return max(1, (os.cpu_count() or 1) // sharing)


def profile(
    model: nn.Module,
    model_name: str,
    sample: torch.Tensor,
    batch: int,
    workers: int,
    tps: list[int],
    sharing: int | None = None,
    rounds: int = 5,
) -> Profile:
    """Measure every unit of `model` for every placement at each tp in `tps` (global `batch`
    over `workers` ranks, `sharing` of them on this machine's cores: all by default).

    When the sharing ranks need more threads than the machine has cores, the measurement runs
    in that many processes at once (each with a rank's threads) and each figure is the median
    over them: the contention the job will meet (cores, caches, memory bandwidth) is measured,
    not assumed."""
    sharing = sharing or workers
    threads = sharing_threads(sharing)
    args = (model, model_name, sample[:1], batch, workers, tps, threads, rounds)
    if sharing * threads <= (os.cpu_count() or 1):
        units_, update = _measure(*args)
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(sharing) as pool:
            runs = pool.starmap(_measure, [args] * sharing)
        units_, update = runs[0][0], statistics.median(r[1] for r in runs)
        for i, unit in enumerate(units_):
            for key in unit.fwd:
                unit.fwd[key] = statistics.median(r[0][i].fwd[key] for r in runs)
                unit.bwd[key] = statistics.median(r[0][i].bwd[key] for r in runs)
    return Profile(model_name, workers, batch, units_, threads, sharing, update)


def _update_per_byte(threads: int, rounds: int) -> float:
    """Seconds per parameter byte of what a step does besides forward and backward: zero the
    gradient, pack it into a bucket and unpack it averaged, an SGD step with momentum."""
    n = 1 << 20
    param = nn.Parameter(torch.zeros(n, device="cpu"))
    param.grad = torch.ones(n, device="cpu")
    bucket = torch.empty(n, device="cpu")
    opt = torch.optim.SGD([param], lr=0.01, momentum=0.9)

    def step() -> None:
        assert param.grad is not None
        param.grad.zero_()
        bucket.copy_(param.grad)
        param.grad.copy_(bucket).div_(2.0)
        opt.step()

    return _timed(step, rounds) / (n * 4)


def _measure(
    model: nn.Module,
    model_name: str,
    sample: torch.Tensor,
    batch: int,
    workers: int,
    tps: list[int],
    threads: int,
    rounds: int,
) -> tuple[list[Unit], float]:
    """`profile`'s measurement in this process, with `threads` threads."""
    layers = layers_of(model, model_name)
    shapes = sample_shapes(layers, sample)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: list[Unit] = []
    try:
        for u, (unit, first, at, end) in enumerate(describe_units(layers, shapes, model_name)):
            layer = layers[at][1]
            dims = unit.dims
            before_layers = [m for _, m in layers[first:at]]
            after_layers = [m for _, m in layers[at + 1 : end]]
            for choice, t in placements(dims, tps):
                per_rank = max(1, batch // workers if choice == "data" else batch * t // workers)
                shape = shapes[at]
                if choice == "rowwise":  # the input's features or channels are split
                    shape = torch.Size([shape[0] // t, *shape[1:]])
                seq = [
                    *(before_layers if choice != "rowwise" else []),
                    _slice_layer(layer, choice, t),
                ]
                fwd, bwd = _time_unit(
                    [*seq, *after_layers],
                    shapes[first] if choice != "rowwise" else shape,
                    per_rank,
                    u > 0,
                    rounds,
                )
                key = "data" if choice == "data" else f"{choice}@{t}"
                unit.fwd[key], unit.bwd[key] = fwd, bwd
            out.append(unit)
        update = _update_per_byte(threads, rounds)
    finally:
        torch.set_num_threads(before)
    return out, update


def describe_units(
    layers: list[tuple[str, nn.Module]], shapes: list[torch.Size], model_name: str
) -> list[tuple[Unit, int, int, int]]:
    """Each unit of the layer sequence, untimed (sizes, shapes, dims), with where it starts, its
    weighted layer and where it ends in `layers` (`shapes`: `sample_shapes`'); works on the meta
    device."""
    starts = units(layers)
    if not starts:
        raise GradmeshError(f"model {model_name} has no layers with weights to place")
    bounds = [*starts, len(layers)]
    found = []
    for first, end in zip(bounds, bounds[1:], strict=False):
        at = next(i for i in range(first, end) if any(True for _ in layers[i][1].parameters()))
        name, layer = layers[at]
        if not isinstance(layer, nn.Linear | nn.Conv2d):
            raise GradmeshError(
                f"model {model_name}: layer {name} is a {type(layer).__name__}; the planner "
                "places Linear and Conv2d layers"
            )
        bias = layer.bias.numel() * 4 if layer.bias is not None else 0
        unit = Unit(
            name=name,
            kind=type(layer).__name__,
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            bias_bytes=bias,
            in_bytes=int(math.prod(shapes[at])) * 4,
            mid_bytes=int(math.prod(shapes[at + 1])) * 4,
            out_bytes=int(math.prod(shapes[end])) * 4,
            dims=(int(layer.weight.shape[0]), int(layer.weight.shape[1])),
        )
        found.append((unit, first, at, end))
    return found


def placements(dims: tuple[int, int], tps: list[int]) -> list[tuple[str, int]]:
    """(choice, tp) a unit of these (output, input) dims can take at each tp in `tps`."""
    return [("data", 1)] + [
        (c, t)
        for t in tps
        if t > 1
        for c in ("replicate", "colwise", "rowwise")
        if not (c == "colwise" and dims[0] % t or c == "rowwise" and dims[1] % t)
    ]
