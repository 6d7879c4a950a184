"""The one table of accelerators: each part's data-sheet peaks by precision, memory and bandwidth
(`SHEETS`), and the peak a training run's MFU is measured against (`pick_peak`, `device_peak`).

The simulator prices its roofline on these peaks (`gradmesh.simulate.devices` adds the fitted
fractions of them its kernels reach) and the train report divides by them, so both live here,
below `train` and `simulate`. Peaks are dense (no 2:4 sparsity), in TFLOP/s per device: bf16 and
fp16 on tensor cores, tf32 on tensor cores, fp32 on the CUDA cores, fp8 where the part has it.
The simulator's four parts keep the rounded figures it was fitted with (H100 SXM's data sheet
gives fp32 66.9 and tf32 494.7, kept as 67 and 495).

Why a table and not a measurement on a GPU: a short matmul reaches a fraction of the peak that
depends on its shape, clocks and the library, so MFU against it would be a ratio of two
measurements; MFU is conventionally against the vendor's peak (PaLM, Megatron). A GPU the table
does not know gets no MFU rather than a guess: `--peak-tflops` gives its peak. A CPU has no
vendor figure torch can read (vector units, clocks under load, shared cores), so a CPU worker
keeps its measured peak (`gradmesh.models.flops.measured_peak_flops`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
KINDS = ("conv", "conv3x3", "matmul", "attention", "memory")
"""The kinds of kernel the FLOP counter sorts operations into (`gradmesh.models.flops`) and the
simulator's devices price at a fraction of peak each."""


@dataclass(frozen=True)
class DataSheet:
    """One part's vendor figures, and the CUDA device names (`torch.cuda.get_device_name`) that
    are it."""

    name: str
    """The table's key (the simulator's `--device`)."""
    part: str
    """The part the figures are of, as its data sheet names it."""
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s by precision (`PRECISIONS`); a precision the part lacks is absent."""
    bandwidth_gbs: float
    memory_gib: float
    """The data sheet's memory size (its GB are the HBM's binary gigabytes)."""
    names: str
    """A regular expression (searched, any case) matching the CUDA names of this part."""


_HOPPER = {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0}
"""H100 SXM and H200 (the same GH100 chip and clocks): the data sheets' dense peaks."""

SHEETS: dict[str, DataSheet] = {
    s.name: s
    for s in (
        DataSheet("p100", "Tesla P100 SXM2", {"fp32": 10.6, "fp16": 21.2}, 732.0, 16.0,
                  r"\bP100-SXM2"),
        DataSheet("v100", "Tesla V100 SXM2", {"fp32": 15.7, "fp16": 125.0}, 900.0, 32.0,
                  r"\bV100-SXM2"),
        DataSheet("a100", "A100 SXM4 80GB (every A100 has these peaks)",
                  {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, 2039.0, 80.0,
                  r"\bA100\b"),
        DataSheet("h100-96gb", "H100 96GB HBM2e (the torchtitan benchmark's hosts, 500 W)",
                  dict(_HOPPER), 2400.0, 96.0, r"\bH100\b.*\b96\s*GB"),
        DataSheet("h100", "H100 SXM5 80GB", dict(_HOPPER), 3350.0, 80.0,
                  r"\bH100\b.*\b(HBM3|SXM)"),
        DataSheet("h100-pcie", "H100 PCIe 80GB",
                  {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
                  2000.0, 80.0, r"\bH100\b.*\bPCIe"),
        DataSheet("h200", "H200 SXM 141GB", dict(_HOPPER), 4800.0, 141.0,
                  r"\bH200\b(?!.*\bNVL)"),
    )
}  # fmt: skip
"""Tensor-core peaks are half the data sheets' figures "with sparsity" (H100 PCIe: bf16 1,513,
fp8 3,026). A part not in the table (H100 NVL, H200 NVL, GH200, V100 or P100 PCIe, ...) matches
no entry's names and gets no MFU unless `--peak-tflops` is given."""


def sheet_of(device_name: str) -> DataSheet | None:
    """The table's entry for a CUDA device name, or None for a part it does not know."""
    for sheet in SHEETS.values():
        if re.search(sheet.names, device_name, re.IGNORECASE):
            return sheet
    return None


MEASURED = "measured on this CPU (a float32 512x512 matmul)"
UNKNOWN = "unknown"
"""How `pick_peak`'s answer begins when it has no peak (and MFU is not reported)."""


def pick_peak(
    device_type: str,
    device_name: str,
    precision: str,
    tf32: bool,
    override_tflops: float = 0.0,
    measure: Callable[[], float] | None = None,
) -> tuple[float, str]:
    """The peak FLOP/s of one device running `precision` and where it came from: the
    `--peak-tflops` override when given, a CPU's measured rate (`measure`), a GPU's data sheet
    (fp32 read as tf32 when `tf32` says TF32 matmuls are on), or 0 with why not."""
    if override_tflops > 0:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if device_type == "cpu":
        return (measure() if measure is not None else 0.0), MEASURED
    if device_type != "cuda":
        return 0.0, f"{UNKNOWN} for a {device_type} device: pass --peak-tflops"
    sheet = sheet_of(device_name)
    if sheet is None:
        return 0.0, (
            f"{UNKNOWN}: {device_name!r} is not in the device table "
            "(gradmesh/models/devices.py): pass --peak-tflops"
        )
    key = "tf32" if precision == "fp32" and tf32 else precision
    if key not in sheet.peak_tflops:
        return 0.0, f"{UNKNOWN}: {sheet.part} has no {key} peak: pass --peak-tflops"
    return sheet.peak_tflops[key] * 1e12, f"{sheet.name} {key} (the {sheet.part} data sheet)"


def tf32_matmuls() -> bool:
    """Whether float32 matrix products run on TF32 tensor cores: torch's newer per-backend
    setting where it is set, else the legacy flags (which raise once both APIs were used)."""
    import torch  # the table above needs none: the simulator's commands read it

    new = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if new in ("tf32", "ieee"):
        return bool(new == "tf32")
    try:
        legacy = bool(torch.backends.cuda.matmul.allow_tf32)
        return legacy or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return False


def device_peak(
    device: torch.device,
    precision: str,
    override_tflops: float = 0.0,
    measure: Callable[[], float] | None = None,
) -> tuple[float, str]:
    """`pick_peak` for this process's `device`, its CUDA name and TF32 setting read from torch
    (nothing CUDA is called on another device)."""
    import torch

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else ""
    return pick_peak(
        device.type, name, precision, cuda and tf32_matmuls(), override_tflops, measure
    )
