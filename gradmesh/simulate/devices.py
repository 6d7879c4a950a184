"""The devices the simulator prices compute on: a roofline per kind of kernel.

A kernel of kind k with F FLOPs that reads and writes B bytes takes

    max(F / (peak[precision] * achieved[k]), B / (bandwidth * achieved["memory"]))

seconds (`Device.seconds`; the kinds are `gradmesh.models.devices.KINDS`, counted per operation on
the meta device by `layer_kernels`). The peaks, bandwidths and memory sizes are the vendors'
data-sheet figures (SXM parts), read from the one device table the train report's MFU also
uses (`gradmesh.models.devices`). The achieved fractions are fitted on the calibration rows of
`published.toml` (`gradmesh.simulate.fit.fit_devices`; a test checks that the numbers
below are that fit's), except where `ASSUMED` says otherwise: the memory-bound fraction, and the
kinds no calibration row of a device exercises, which it takes from the device `LIKE` names.

Why fractions per kind and not one per device: a convnet of 3x3 stride-1 convolutions (VGG-16)
runs on cuDNN's Winograd kernels, which do fewer multiplications than the FLOPs counted, while
ResNet-50 spends a third of its step in batch norm and ReLU at memory speed: one fraction made
one of them several times too slow or too fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from gradmesh.errors import GradmeshError
from gradmesh.models.devices import KINDS, SHEETS
from gradmesh.registry import Registry

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
COMPUTE_KINDS = tuple(k for k in KINDS if k != "memory")
"""The kinds of kernel priced on the device's peak (the rest on its bandwidth)."""
CUDA_CORE_KINDS = ("matmul", "attention")
"""The products a device's own fp32 fraction (`Device.fraction`) prices: a transformer's, the
ones a calibration row (gpt-h100-fp32) separates; convolutions keep their kinds' fractions."""


@dataclass(frozen=True)
class Device:
    """A device's peaks by precision, its memory bandwidth and size, and the fraction of each
    peak every kind of kernel reaches."""

    peak_tflops: dict[str, float]
    bandwidth_gbs: float
    """0 for a device of one measured rate (`flat`)."""
    memory_gib: float
    achieved: dict[str, float]
    precision: str
    """The precision a job runs in unless told (`gradmesh simulate --dtype`)."""
    source: str
    dtype_bytes: int = field(default=4)
    """Bytes of an activation element in `precision` (2 for bf16 and fp16)."""
    float8: bool = False
    """The blocks' linear layers in float8 (`at("fp8")`: torchao's float8 training, the rest in
    bf16): their products priced at the fp8 peak times `achieved["fp8"]`."""
    compiled: bool = False
    """torch.compile's fusion: memory-bound kernels move `achieved["compile"]` of the bytes
    they move eagerly."""

    @classmethod
    def flat(cls, tflops: float, source: str) -> Device:
        """A device of one measured rate for every kernel, with no bandwidth or memory figure
        (0: this CPU's rate on the model, or a benchmark's measured compute): its seconds are
        FLOPs over the rate."""
        return cls(
            {"fp32": tflops},
            0.0,
            0.0,
            dict.fromkeys(KINDS, 1.0),
            "fp32",
            source,
        )

    @property
    def flops_per_s(self) -> float:
        """The matrix products' achieved rate (what a per-FLOP estimate falls back on)."""
        return self.peak_tflops[self.precision] * 1e12 * self.achieved["matmul"]

    def at(self, precision: str) -> Device:
        """This device running in `precision` (one line naming those it has when not); fp8 is
        bf16 with the blocks' linear layers in float8 (`float8`)."""
        if precision == "fp8":
            if "fp8" not in self.peak_tflops or "fp8" not in self.achieved:
                raise GradmeshError(
                    "fp8 needs a device with fp8 tensor cores and a fitted fp8 fraction "
                    f"(this one has {', '.join(p for p in self.peak_tflops if p != 'fp8')})"
                )
            return dataclasses.replace(self.at("bf16"), float8=True)
        if precision not in self.peak_tflops or precision == "fp8":
            raise GradmeshError(
                f"unknown precision {precision!r} for this device (valid: "
                f"{', '.join(self.peak_tflops)})"
            )
        return dataclasses.replace(
            self,
            precision=precision,
            dtype_bytes=2 if precision in ("bf16", "fp16") else 4,
            float8=False,
        )

    def seconds(self, kernels: Iterable[tuple[str, float, float]], fp8_flops: float = 0.0) -> float:
        """The roofline's seconds of these (kind, FLOPs, bytes) kernels (module docstring), the
        first `fp8_flops` of the matrix products' in float8 where `float8` is set."""
        peak = self.peak_tflops[self.precision] * 1e12
        if not self.bandwidth_gbs:
            return sum(flops for _, flops, _ in kernels) / (peak * self.achieved["matmul"])
        memory = self.bandwidth_gbs * 1e9 * self.achieved["memory"]
        fused = self.achieved["compile"] if self.compiled else 1.0
        total = 0.0
        for kind, flops, moved in kernels:
            if kind == "memory":
                total += moved * fused / memory
                continue
            compute = flops / (peak * self.fraction(kind))
            if kind == "matmul" and self.float8:
                low = min(flops, fp8_flops)
                fp8 = self.peak_tflops["fp8"] * 1e12 * self.achieved["fp8"]
                compute = low / fp8 + (flops - low) / (peak * self.achieved[kind])
            total += max(compute, moved / memory)
        return total

    def fraction(self, kind: str) -> float:
        """The fraction of the peak `kind` reaches in this precision: a device with tensor cores
        runs fp32 products (no TF32) on its CUDA cores, at `achieved["fp32"]` of the fp32 peak
        where a row fitted it, not at the tensor cores' fraction."""
        if self.precision == "fp32" and kind in CUDA_CORE_KINDS and "fp32" in self.achieved:
            return self.achieved["fp32"]
        return self.achieved[kind]

    def launch_seconds(self, calls: dict[str, float]) -> float:
        """What `calls` kernels (by kind) cost beyond their work: each one's launch, ramp and
        tail (`achieved["launch"]` seconds, fitted; 0 where not), memory-bound ones fused by
        torch.compile as their bytes are."""
        launch = self.achieved.get("launch", 0.0)
        fused = self.achieved["compile"] if self.compiled else 1.0
        return launch * sum(n * (fused if k == "memory" else 1.0) for k, n in calls.items())


GIB = 2**30

DEFAULT_PRECISION = {
    "p100": "fp32",
    "v100": "fp32",
    "a100": "tf32",
    "h100-96gb": "tf32",
    "h100": "tf32",
}
"""The devices the simulator prices (those with fitted fractions) and the precision each runs a
convnet in unless told."""


def _spec(name: str) -> tuple[dict[str, float], float, float, str]:
    """`name`'s data sheet (`gradmesh.models.devices.SHEETS`, shared with the train report's
    MFU): peaks in the precisions the roofline prices (fp8 for float8's products), GB/s, GiB,
    and its default precision."""
    sheet = SHEETS[name]
    peaks = {p: t for p, t in sheet.peak_tflops.items() if p in (*PRECISIONS, "fp8")}
    return peaks, sheet.bandwidth_gbs, sheet.memory_gib, DEFAULT_PRECISION[name]


SPECS = {name: _spec(name) for name in DEFAULT_PRECISION}
"""Data-sheet figures: peak dense TFLOP/s by precision, GB/s, GiB, default precision."""

MEMORY_FRACTION = 0.8
"""The fraction of its data-sheet bandwidth a memory-bound kernel reaches: assumed (streaming
copies reach 75-90% on these parts), not fitted: no calibration row separates it from the
convolutions' fraction (ResNet-50 and Inception V3 on a P100 ask for opposite signs)."""

ASYNC_TP_HIDDEN = 1.0
"""The fraction of the tensor-parallel exchanges async TP hides: assumed all of them (it splits
each exchange into pieces that run beside the matrix product using them, which is its aim).
Fitted on tt-70b-256-async it reached the bisection's upper bound, 1.0: the row could only say
"all", so it validates the assumption instead (-0.7 %)."""

LIKE = {"p100": "", "v100": "p100", "a100": "v100", "h100-96gb": "a100", "h100": "h100-96gb"}
"""Where a device's kinds that no calibration row of its own fits come from."""

ACHIEVED: dict[str, dict[str, float]] = {
    "p100": {"conv": 0.473, "conv3x3": 1.53, "matmul": 0.473, "attention": 0.473},
    "v100": {"conv": 0.512, "conv3x3": 1.66, "matmul": 0.512, "attention": 0.512},
    "a100": {"conv": 0.512, "conv3x3": 1.66, "matmul": 0.809, "attention": 0.809},
    "h100-96gb": {
        "conv": 0.512, "conv3x3": 1.66, "matmul": 0.488, "attention": 0.532,
        "fragmentation": 0.183, "compile": 0.408, "fp8": 0.373, "tp_overlap": 0.865,
    },
    "h100": {
        "conv": 0.512, "conv3x3": 1.66, "matmul": 0.488, "attention": 0.532,
        "fragmentation": 0.183, "compile": 0.408, "fp8": 0.373, "tp_overlap": 0.865,
        "launch": 1.16e-05, "fp32": 0.76,
    },
}  # fmt: skip
"""Each kind's fraction of peak by device: `fit_devices`' result on `published.toml`'s
calibration rows (a test checks it), `LIKE`'s where a device has none of its own."""

ASSUMED = {
    "h100": "no calibration row of its own: the H100 96GB's (the same chip at 500 W, so an "
    "SXM part at 700 W may run faster than priced)",
    "memory": f"{MEMORY_FRACTION} of the data-sheet bandwidth on every device",
}

DEVICES: Registry[Device] = Registry("device")


def make_device(name: str, achieved: dict[str, float]) -> Device:
    """`name`'s data-sheet figures with these compute fractions."""
    peaks, bandwidth, memory, precision = SPECS[name]
    fractions = {**achieved, "memory": MEMORY_FRACTION}
    source = ASSUMED.get(name, "fitted on published.toml's calibration rows")
    return Device(peaks, bandwidth, memory, fractions, precision, source).at(precision)


for _name in SPECS:
    DEVICES.register(_name)(make_device(_name, ACHIEVED[_name]))
