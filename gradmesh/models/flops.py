"""Per-layer FLOPs of a model, from torch's FLOP counter: what the simulator prices a layer's
compute by (`gradmesh.simulate`) and what emulated compute spreads its sleep by
(`gradmesh.train.emulated`), so the two split a step's compute over the layers alike; and
what a training run's model FLOPs utilisation (MFU) is made of: the model's FLOPs per sample
and the peak rate a worker measures for itself.

What the simulator's roofline prices a layer by is also counted here (`layer_kernels`):
every aten operation of a forward and backward, by kind of kernel (`KINDS`: convolutions, 3x3
stride-1 convolutions apart since cuDNN runs them with Winograd's fewer multiplications, matrix
products, attention, and everything else as memory-bound element-wise and normalisation work),
with its FLOPs (torch's own FLOP formulas, `flop_registry`) and the bytes it reads and writes
(its tensor arguments and results; views move nothing and are skipped). The FLOPs a GPU issues
for a matrix product or a convolution are counted, not the useful ones: such kernels compute
tiles of `TILE` columns (output channels, or the input's for a convolution's input gradient), so
a side that is not a multiple of it is padded (`issued`: 48 output channels cost 64's work).
Forward operations belong to the weighted module that last started its forward (a ReLU to the
convolution before it); backward operations are totalled by kind for the whole model.

Why a measured peak: a CPU's nominal peak depends on its vector units, its clock under load and
the cores a worker shares, none of which torch reports. A worker's peak here is the best rate
of a float32 512 x 512 matrix multiply it reaches in a quarter of a second, measured by every
worker at once before training (so workers sharing cores share them here too): MFU against it
says how far the model's step is from the best dense arithmetic this worker can do."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch

Kernels = dict[str, tuple[float, float]]
"""(FLOPs, bytes read and written) by kind of kernel (`KINDS`)."""

_aten = torch.ops.aten
_KIND = {
    _aten.convolution: "conv",
    _aten.convolution_backward: "conv",
    _aten.mm: "matmul",
    _aten.addmm: "matmul",
    _aten.bmm: "matmul",
    _aten.baddbmm: "matmul",
    **{
        getattr(_aten, f"_scaled_dot_product_{impl}_attention{end}"): "attention"
        for impl in ("efficient", "flash", "cudnn")
        for end in ("", "_backward")
    },
}


_VIEWS = {_aten._unsafe_view, _aten._reshape_alias}
"""Views whose schemas do not say so."""

TILE = 64
"""The width a GPU's matrix-product and implicit-GEMM convolution kernels compute an output
tile's columns in: cuDNN's and cuBLAS's kernels are named by their tiles (128x64, 128x128,
256x128); 64 is the narrow side of the ones convnets on Pascal and Volta run. Assumed, not
fitted: no calibration row has a side that is not a multiple of it (docs/simulator.md gives
Inception V3's figure at 32 and at 128 as well)."""


def _padded(width: int) -> float:
    """The fraction of a tile-padded `width` that is useful work."""
    return width / (TILE * -(-width // TILE)) if width else 1.0


def issued(packet: Any, args: Any, out: Any) -> float:
    """The fraction of its issued FLOPs that are useful for a matrix product or convolution
    (1 for anything else; module docstring): a product's output sides padded to `TILE`; a
    convolution's output channels forward, and backward its input gradient's input channels and
    its weight gradient's output channels, in the harmonic mean of the parts it computes (each
    as much work). A grouped convolution (depthwise) is not one product over its channels and
    is counted as it is."""
    if packet in (_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm):
        rows, cols = out.shape[-2:]
        return _padded(rows) * _padded(cols)
    if packet is _aten.convolution and args[8] == 1:
        return _padded(args[1].shape[0])
    if packet is _aten.convolution_backward and args[9] == 1:
        cout, cin = args[2].shape[:2]
        parts = [_padded(c) for c, wanted in zip((cin, cout), args[-1], strict=False) if wanted]
        return len(parts) / sum(1 / p for p in parts) if parts else 1.0
    return 1.0


@dataclass(frozen=True)
class Layer:
    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    kernels: tuple[tuple[str, float, float], ...] = ()
    """Its forward's kernels: (kind, FLOPs, bytes), where counted (`layer_kernels`)."""


def op_flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> float:
    """An aten operation's useful FLOPs by torch's own formulas (0 for one without a formula)."""
    packet = func.overloadpacket
    if packet not in flop_registry:
        return 0.0
    return float(flop_registry[packet](*args, **kwargs, out_val=out))


class KernelCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every operation's kind, FLOPs and bytes (the module docstring), forward ones by the layer
    `current` names, the rest (backward) under None."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = ""
        self.forward = True
        self.costs: dict[str | None, Kernels] = {}
        """FLOPs issued (`issued`) by owner and kind."""
        self.useful = 0.0
        """The FLOPs of every operation counted, without tile padding."""
        self.calls: dict[str, int] = {}
        """Operations by kind: the kernels a GPU launches (each pays a launch and a tail)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        returns = func._schema.returns
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if views or func.overloadpacket in _VIEWS:
            return out  # a view: nothing moves
        packet = func.overloadpacket
        kind = _KIND.get(packet, "memory")
        if kind == "conv":
            weight, stride = (args[1], args[3]) if packet is _aten.convolution else args[2:5:2]
            if tuple(weight.shape[-2:]) == (3, 3) and tuple(stride) == (1, 1):
                kind = "conv3x3"
        useful = op_flops(func, args, kwargs, out)
        self.useful += useful
        flops = useful / issued(packet, args, out)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        moved = float(sum(t.numel() * t.element_size() for t in tensors))
        self.calls[kind] = self.calls.get(kind, 0) + 1
        owner = self.costs.setdefault(self.current if self.forward else None, {})
        f, b = owner.get(kind, (0.0, 0.0))
        owner[kind] = (f + flops, b + moved)
        return out


def layer_flops(net: nn.Module, x: torch.Tensor) -> list[Layer]:
    """Every module of `net` that holds weights, in the order forward first runs it, with its
    FLOPs on input `x` (forward, backward) and parameter bytes. Works on the meta device."""
    return _counted_layers(net, x, None)[0]


def layer_kernels(net: nn.Module, x: torch.Tensor) -> tuple[list[Layer], Kernels]:
    """`layer_flops` with each layer's forward kernels, and the whole backward's kernels (the
    module docstring)."""
    return _counted_layers(net, x, KernelCounter())


def _counted_layers(
    net: nn.Module, x: torch.Tensor, kernels: KernelCounter | None
) -> tuple[list[Layer], Kernels]:
    owners = [(n, m) for n, m in net.named_modules() if any(True for _ in m.parameters(False))]
    order: list[str] = []

    def enter(name: str) -> None:
        if name not in order:
            order.append(name)
        if kernels is not None:
            kernels.current = name

    hooks = [m.register_forward_pre_hook(lambda _m, _a, n=n: enter(n)) for n, m in owners]
    root = type(net).__name__
    try:
        with FlopCounterMode(display=False) as counter, kernels or contextlib.nullcontext():
            out = net(x)
            fwd = {k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()}
            if kernels is not None:
                kernels.forward = False
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
    costs = kernels.costs if kernels is not None else {}
    first = costs.setdefault(order[0], {}) if order else {}
    for kind, (f, b) in costs.pop("", {}).items():  # what ran before the first weighted
        # module (an embedding's lookup, a cast) counts as that module's
        had = first.get(kind, (0.0, 0.0))
        first[kind] = (had[0] + f, had[1] + b)
    layers = [
        Layer(
            n,
            f,
            share * scale,
            sum(p.numel() * p.element_size() for p in params[n].parameters(False)),
            tuple((k, *v) for k, v in costs.get(n, {}).items()),
        )
        for n, f, share in zip(order, mine, shares, strict=True)
    ]
    return layers, costs.get(None, {})


def flops_per_sample(build: Callable[[], nn.Module], sample: Batch) -> float:
    """Forward and backward FLOPs of one sample through the model `build` makes, counted on
    the meta device (no weights are made), or, for a model whose forward reads values back
    (calls `.item()`), on a real copy made for the count."""
    try:
        with torch.device("meta"):
            return _counted(build(), batch.to(sample, "meta"))
    except (RuntimeError, NotImplementedError):
        return _counted(build(), sample)


def _counted(net: nn.Module, sample: Batch) -> float:
    with FlopCounterMode(display=False) as counter:
        scalar_of(batch.call(net, sample)).backward()  # type: ignore[no-untyped-call]
    return float(counter.get_total_flops())


def scalar_of(out: Any) -> torch.Tensor:
    """A scalar for a counting backward to start from: the sum of a model output's first
    tensor (a tuple's, a `ModelOutput`'s), plus its scalar losses (a mixture's balance loss)."""
    if torch.is_tensor(out):
        return out.float().sum()
    found = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.is_floating_point()]
    return found[0].float().sum() + sum(t.float() for t in found[1:] if t.dim() == 0)


def measured_peak_flops(seconds: float = 0.25, n: int = 512) -> float:
    """FLOP/s of this process on a float32 `n` x `n` matrix multiply: the best of runs of 4
    over `seconds` (see the module docstring)."""
    a, b = torch.randn(n, n, device="cpu"), torch.randn(n, n, device="cpu")
    a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - started))
    return best
