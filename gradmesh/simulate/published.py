"""Published figures the simulator is fitted on and checked against (`published.toml`):
`predict` prices a row's set-up as its source states it, `fit_devices` fits the devices'
achieved fractions on the calibration rows alone, and `validate` is `gradmesh simulate
--validate`'s table.

A row is a convnet's images a second on one GPU, its scaling efficiency at n GPUs against
`baseline_gpus` (data parallelism: `gradmesh.simulate.strategies`' allreduce, overlap with
backward simulated bucket by bucket), or a transformer's teraFLOP/s a GPU by its source's own
FLOP formula over the predicted step (the mesh formulas, `gradmesh.simulate.mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.simulate.devices import ACHIEVED, COMPUTE_KINDS, LIKE, SPECS, Device, make_device

PUBLISHED = Path(__file__).with_name("published.toml")
METRICS = ("images_per_s", "efficiency", "tflops_per_gpu")


@dataclass(frozen=True)
class Row:
    id: str
    role: str
    source: str
    where: str
    model: str
    device: str
    gpus: int
    batch: int
    """Samples a GPU (convnets) or a step (transformers)."""
    metric: str
    published: float
    fits: str = ""
    """calibration: the kind whose fraction this row fits, or "compute" (all, one factor)."""
    baseline_gpus: int = 1
    gpus_per_node: int = 8
    intra_fabric: str = ""
    inter_fabric: str = ""
    nics_per_node: int = 1
    algorithm: str = "ring"
    fusion_mb: float = 25.0
    model_args: str = ""
    sequence: int = 2048
    vocab: int = 51200
    precision: str = ""
    """The device's default for convnets; bf16 for transformers."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    microbatches: int = 1
    checkpointing: bool = True

    @property
    def transformer(self) -> bool:
        return self.metric == "tflops_per_gpu"

    @property
    def setup(self) -> tuple[str, str, int]:
        """What a calibration row and a validation row must not share."""
        return (self.model + self.model_args, self.device, self.gpus)


@dataclass(frozen=True)
class Table:
    tolerance: dict[str, float]
    sources: dict[str, dict[str, str]]
    rows: list[Row]

    def role(self, role: str) -> list[Row]:
        return [r for r in self.rows if r.role == role]


def load(path: Path = PUBLISHED) -> Table:
    """The table in `path`; one line naming the row and the field that is wrong."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise GradmeshError(f"cannot read the published figures {path}: {e}") from None
    known = {f.name for f in fields(Row)}
    rows = []
    for i, raw in enumerate(data.get("rows", [])):
        name = raw.get("id", f"#{i + 1}")
        unknown = set(raw) - known
        if unknown:
            raise GradmeshError(f"{path.name}: row {name} has unknown field {sorted(unknown)[0]}")
        try:
            row = Row(**raw)
        except TypeError as e:
            raise GradmeshError(f"{path.name}: row {name}: {e}") from None
        if row.metric not in METRICS or row.role not in ("calibration", "validation"):
            raise GradmeshError(
                f"{path.name}: row {name}: metric must be one of {', '.join(METRICS)} and role "
                "calibration or validation"
            )
        if row.source not in data.get("sources", {}):
            raise GradmeshError(f"{path.name}: row {name} cites unknown source {row.source}")
        rows.append(row)
    return Table(data.get("tolerance", {}), data.get("sources", {}), rows)


# -- one row's prediction ---------------------------------------------------------------------


def _links(row: Row) -> tuple[Any, Any]:
    from gradmesh.simulate.fabrics import FABRICS, fabric_terms

    intra = FABRICS.get(row.intra_fabric) if row.intra_fabric else None
    inter = FABRICS.get(row.inter_fabric) if row.inter_fabric else None
    return fabric_terms(intra, default=(1200.0, 5e-6)), fabric_terms(inter, row.nics_per_node)


def _convnet(row: Row, device: Device) -> float:
    from gradmesh.planner import Links
    from gradmesh.simulate.profile import device_profile, model_layers
    from gradmesh.simulate.strategies import Job, compute_s, scaling

    costs = model_layers(row.model, row.batch, None, device.dtype_bytes == 2)
    prof = device_profile(costs, device, row.batch, row.model)
    if row.metric == "images_per_s":
        return row.batch / compute_s(prof)
    intra, inter = _links(row)
    job = Job(prof, 1, Links(intra, inter, row.gpus_per_node), row.algorithm, row.fusion_mb)
    steps = {
        r["gpus"]: r["step_s"] for r in scaling("allreduce", job, [row.baseline_gpus, row.gpus])
    }
    return float(steps[row.baseline_gpus] / steps[row.gpus])


def model_args(text: str) -> dict[str, Any]:
    from gradmesh.registry import parse_kwargs

    return parse_kwargs(text, "model_args")


@functools.lru_cache(maxsize=64)
def _meta(row: Row) -> Any:
    from gradmesh.simulate.devices import DEVICES
    from gradmesh.simulate.mesh import meta_profile
    from gradmesh.simulate.meta_count import Spec

    spec = Spec(row.model, model_args(row.model_args), row.sequence, row.vocab, _precision(row))
    device = DEVICES.get(row.device).at(spec.precision)
    return meta_profile(spec, row.gpus, row.batch, [row.tensor_parallel], device)


def _precision(row: Row) -> str:
    return row.precision or ("bf16" if row.transformer else SPECS[row.device][3])


def megatron_flops(args: dict[str, Any], batch: int, sequence: int, vocab: int) -> float:
    """A step's FLOPs by Narayanan et al.'s formula (recomputation included): 96 B s l h^2
    (1 + s / 6h + V / 16 l h)."""
    h, layers = args["dim"], args["depth"]
    return float(
        96 * batch * sequence * layers * h**2 * (1 + sequence / (6 * h) + vocab / (16 * layers * h))
    )


def _transformer(row: Row, device: Device) -> float:
    from gradmesh.layout.config import Layout
    from gradmesh.simulate.mesh import price

    meta = _meta(row).on(device)
    tp, pp = row.tensor_parallel, row.pipeline_parallel
    dp = row.gpus // (tp * pp)
    m = row.batch // (dp * row.microbatches)
    lay = Layout(dp, tp, pp, m, "1f1b" if pp > 1 else None, 1, 0, row.checkpointing)
    intra, inter = _links(row)
    step = price(meta, lay, intra, inter, row.gpus_per_node, row.sequence).prediction.step_s
    flops = megatron_flops(model_args(row.model_args), row.batch, row.sequence, row.vocab)
    return flops / (step * row.gpus) / 1e12


def predict(row: Row, achieved: dict[str, dict[str, float]] | None = None) -> float:
    """The simulator's figure for `row`'s set-up, its device's fractions `achieved` (the
    fitted ones, `ACHIEVED`, unless given)."""
    fractions = (achieved or ACHIEVED)[row.device]
    device = make_device(row.device, fractions).at(_precision(row))
    return _transformer(row, device) if row.transformer else _convnet(row, device)


# -- the fit ----------------------------------------------------------------------------------


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
        for _ in range(3 if len(mine) > 1 else 1):
            for row in mine:
                base = _fit_row(row, base)
        fitted[name] = {k: round(v, 3) for k, v in base.items()}
    return fitted


TIED: dict[str, tuple[str, ...]] = {"conv": ("matmul", "attention"), "matmul": ("attention",)}
"""Kinds fitted together with a row's own: a convnet's row fits its fully connected layers' and
any attention's fraction with its convolutions', a transformer's its attention's with its
matrix products' (no calibration row separates them)."""


def _fit_row(row: Row, base: dict[str, float]) -> dict[str, float]:
    def with_(x: float) -> dict[str, float]:
        if row.fits == "compute":
            return {k: v * x for k, v in base.items()}
        return {**base, row.fits: x, **dict.fromkeys(TIED.get(row.fits, ()), x)}

    if row.fits not in (*COMPUTE_KINDS, "compute"):
        raise GradmeshError(f"calibration row {row.id}: fits must name a kind of kernel")
    x = _solve(lambda v: predict(row, {row.device: with_(v)}), row.published)
    return with_(x)


# -- the table --------------------------------------------------------------------------------


def error(row: Row, predicted: float) -> float:
    """Points of efficiency, or the fraction of the published figure."""
    if row.metric == "efficiency":
        return predicted - row.published
    return predicted / row.published - 1


def validate(table: Table) -> tuple[list[dict[str, Any]], bool]:
    """Every row's prediction beside its published figure, and whether every validation row
    is within its metric's tolerance."""
    out, good = [], True
    for row in table.rows:
        predicted = predict(row)
        err = error(row, predicted)
        within = abs(err) <= table.tolerance[row.metric] + 1e-9
        if row.role == "validation":
            good &= within
        out.append(
            {**dataclasses.asdict(row), "predicted": predicted, "error": err, "within": within}
        )
    return out, good


def markdown(results: list[dict[str, Any]], table: Table) -> str:
    lines = [
        "| row | role | source | set-up | published | predicted | error | within |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shown = (
            (f"{r['published']:.0%}", f"{r['predicted']:.0%}", f"{r['error'] * 100:+.1f} pt")
            if r["metric"] == "efficiency"
            else (f"{r['published']:g}", f"{r['predicted']:.1f}", f"{r['error']:+.1%}")
        )
        what = {"images_per_s": "images/s", "tflops_per_gpu": "TFLOP/s a GPU"}.get(
            r["metric"], f"efficiency against {r['baseline_gpus']}"
        )
        setup = f"{r['model']} {r['model_args']} on {r['gpus']} {r['device']}, {what}".replace(
            "  ", " "
        )
        mark = "fitted" if r["role"] == "calibration" else ("yes" if r["within"] else "**no**")
        lines.append(
            f"| {r['id']} | {r['role']} | {r['source']} | {setup} | {shown[0]} | {shown[1]} | "
            f"{shown[2]} | {mark} |"
        )
    return "\n".join(lines)


def run_validate(path: str, json_path: str | None) -> int:
    """`gradmesh simulate --validate`: the table, and exit 1 when a validation row is outside
    its tolerance."""
    from gradmesh.launch.jobs import write_json

    table = load(Path(path) if path else PUBLISHED)
    results, good = validate(table)
    write_json(json_path, {"tolerance": table.tolerance, "sources": table.sources, "rows": results})
    print(markdown(results, table))
    outside = [r["id"] for r in results if r["role"] == "validation" and not r["within"]]
    if outside:
        print(f"outside tolerance: {', '.join(outside)}")
    return 0 if good else 1
