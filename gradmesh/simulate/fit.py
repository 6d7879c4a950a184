"""The fit of the devices' achieved fractions on `published.toml`'s calibration rows
(`fit_devices`; `gradmesh.simulate.devices.ACHIEVED` holds its result, a test checks it): each
calibration row solves, by bisection, the one number (or two: a time and a memory figure) its
`fits` names, the others held, in three sweeps over a device's rows."""

from __future__ import annotations

import math
from collections.abc import Callable

from gradmesh.errors import GradmeshError
from gradmesh.simulate.devices import COMPUTE_KINDS, LIKE, SPECS
from gradmesh.simulate.published import Row, Table, predict, predict_gib

MEMORY_FITS = ("fragmentation",)
"""What a calibration row fits on its memory figure (`published_gib`), not its metric."""


def _solve(figure: Callable[[float], float], target: float) -> float:
    """x in [0.01, 4] where the increasing `figure(x)` is `target` (bisection in log space)."""
    lo, hi = math.log(0.01), math.log(4.0)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if figure(math.exp(mid)) < target else (lo, mid)
    return math.exp((lo + hi) / 2)


def fit_devices(table: Table) -> dict[str, dict[str, float]]:
    """Each device's achieved fractions by kind, fitted on the calibration rows alone (each
    fits its `fits`, given the others; three sweeps where a device has several), starting from
    the device it is `LIKE` (or from 0.5) for the kinds no row of its own fits."""
    fitted: dict[str, dict[str, float]] = {}
    for name in SPECS:
        like = LIKE[name]
        base = dict(fitted[like]) if like else dict.fromkeys(COMPUTE_KINDS, 0.5)
        mine = [r for r in table.role("calibration") if r.device == name]
        own = {k for r in mine for k in r.fits.split(",")}
        for _ in range(3 if len(mine) > 1 else 1):
            for row in mine:
                base = _fit_row(row, base, own)
        fitted[name] = {k: float(f"{v:.3g}") for k, v in base.items()}
    return fitted


TIED: dict[str, tuple[str, ...]] = {"conv": ("matmul", "attention"), "matmul": ("attention",)}
"""Kinds fitted together with a row's own: a convnet's row fits its fully connected layers' and
any attention's fraction with its convolutions', a transformer's its attention's with its
matrix products' (no calibration row separates them)."""


FITTED = {
    "fp8": 1.0,
    "fp32": 1.0,
    "compile": -1.0,
    "launch": -1e-5,
    "tp_overlap": 1.0,
    "fragmentation": 1.0,
}
"""What a row may fit besides the kinds' fractions, with its unit and sign: float8's fraction of
the fp8 peak, the fp32 products' fraction of the fp32 peak on CUDA cores (`Device.fraction`),
the fraction of memory-bound work left by torch.compile's fusion (more is slower),
each kernel's launch and tail in units of 10 us (more is slower), the fraction of the tp
exchanges hidden by torch.compile without async TP, the allocator's fragmentation (on
`published_gib`)."""


def _fit_row(row: Row, base: dict[str, float], own: set[str]) -> dict[str, float]:
    """`base` with each of the row's `fits` (a comma list) solved for its figure: a kind's
    fraction (or "compute", every kind's by one factor) or one of `FITTED` on the row's metric,
    the fragmentation on its `published_gib`."""
    for name in row.fits.split(","):
        if name not in (*COMPUTE_KINDS, "compute", *FITTED):
            raise GradmeshError(f"calibration row {row.id}: fits must name a kind of kernel")
        base = _fit_one(row, name, base, own)
    return base


def _fit_one(row: Row, name: str, base: dict[str, float], own: set[str]) -> dict[str, float]:
    unit = FITTED.get(name, 1.0)
    tied = [k for k in TIED.get(name, ()) if k not in own]  # not fitted on their own

    def with_(x: float) -> dict[str, float]:
        if name == "compute":
            return {k: v * x if k in COMPUTE_KINDS else v for k, v in base.items()}
        hidden = name == "tp_overlap"  # a fraction of the exchanges' time
        value = min(x, 1.0) if hidden else x * abs(unit)
        return {**base, name: value, **dict.fromkeys(tied, x)}

    memory = name in MEMORY_FITS
    figure = predict_gib if memory else predict
    target = row.published_gib if memory else row.published
    sign = -1.0 if unit < 0 else 1.0
    return with_(_solve(lambda v: sign * figure(row, {row.device: with_(v)}), sign * target))
