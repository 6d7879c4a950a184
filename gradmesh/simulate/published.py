"""Published figures the simulator is fitted on and checked against (`published.toml`):
`predict` prices a row's set-up as its source states it (`predict_gib` its memory),
`gradmesh.simulate.fit.fit_devices` fits the devices' achieved fractions on the calibration rows
alone, and `validate` is `gradmesh simulate --validate`'s table.

A row is a convnet's images a second on one GPU, its scaling efficiency at n GPUs against
`baseline_gpus` (data parallelism: `gradmesh.simulate.strategies`' allreduce, overlap with
backward simulated bucket by bucket), or a transformer's teraFLOP/s a GPU by its source's own
FLOP formula over the predicted step (the mesh formulas, `gradmesh.simulate.mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.simulate.devices import ACHIEVED, SPECS, Device, make_device

PUBLISHED = Path(__file__).with_name("published.toml")
METRICS = ("images_per_s", "efficiency", "tflops_per_gpu", "tokens_per_s_per_gpu")


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
    """Every block recomputed (Megatron's rows; `recompute` names a selective policy)."""
    recompute: str = ""
    zero_stage: int = 0
    context_parallel: int = 1
    context_gather: bool = False
    """Ring attention as torch's `context_parallel` ran it: keys and values all-gathered."""
    schedule: str = ""
    chunks: int = 1
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    sequence_parallel: bool = False
    loss_parallel: bool = False
    fused_attention: bool = True
    """False for runs before FlashAttention (Megatron-LM 2021: its softmax kernel, scores
    kept)."""
    published_gib: float = 0.0
    """The peak GiB a GPU the source reports (the allocator's reservation), where it does."""
    label: str = ""
    """The set-up in words, for a model whose arguments are too long to print."""

    @property
    def transformer(self) -> bool:
        return self.metric in ("tflops_per_gpu", "tokens_per_s_per_gpu")

    @property
    def setup(self) -> tuple[Any, ...]:
        """What a calibration row and a validation row must not share: the model, device and
        GPUs, and what else the run changed (its sequence, layout and options)."""
        return (
            self.model + self.model_args,
            self.device,
            self.gpus,
            self.sequence,
            self.precision,
            (self.tensor_parallel, self.pipeline_parallel, self.context_parallel, self.schedule),
            (self.compile, self.float8, self.async_tp),
        )


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
        if row.context_gather and row.context_parallel < 2:
            raise GradmeshError(
                f"{path.name}: row {name}: context_gather prices the ring of context_parallel 2 "
                "or more"
            )
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


def _meta(row: Row) -> Any:
    """`row`'s model counted on the meta device: once for the rows that differ only in what the
    count does not read (compile, Float8, the layout's other axes, the published figures)."""
    return _counted(
        row.model,
        row.model_args,
        row.sequence,
        row.vocab,
        _precision(row),
        (row.sequence_parallel, row.loss_parallel, row.fused_attention),
        (row.device, row.gpus, row.batch, row.tensor_parallel),
    )


@functools.lru_cache(maxsize=64)
def _counted(
    model: str,
    args: str,
    sequence: int,
    vocab: int,
    precision: str,
    options: tuple[bool, bool, bool],
    where: tuple[str, int, int, int],
) -> Any:
    from gradmesh.simulate.devices import DEVICES
    from gradmesh.simulate.mesh import meta_profile
    from gradmesh.simulate.meta_count import Spec

    sequence_parallel, loss_parallel, fused_attention = options
    spec = Spec(
        model,
        model_args(args),
        sequence,
        vocab,
        precision,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        fused_attention=fused_attention,
    )
    device, gpus, batch, tp = where
    return meta_profile(spec, gpus, batch, [tp], DEVICES.get(device).at(precision))


def _precision(row: Row) -> str:
    return row.precision or ("bf16" if row.transformer else SPECS[row.device][3])


def _device(row: Row, fractions: dict[str, float]) -> Device:
    """`row`'s device with these fractions, in its precision, float8 and compiled as it ran."""
    device = make_device(row.device, fractions).at(_precision(row))
    device = device.at("fp8") if row.float8 else device
    return dataclasses.replace(device, compiled=row.compile)


def megatron_flops(args: dict[str, Any], batch: int, sequence: int, vocab: int) -> float:
    """A step's FLOPs by Narayanan et al.'s formula (recomputation included): 96 B s l h^2
    (1 + s / 6h + V / 16 l h)."""
    h, layers = args["dim"], args["depth"]
    return float(
        96 * batch * sequence * layers * h**2 * (1 + sequence / (6 * h) + vocab / (16 * layers * h))
    )


def _priced(row: Row, device: Device) -> Any:
    from gradmesh.layout.config import Layout
    from gradmesh.simulate.mesh import price

    meta = _meta(row).on(device)
    tp, pp, cp = row.tensor_parallel, row.pipeline_parallel, row.context_parallel
    dp = row.gpus // (tp * pp * cp)
    m = (
        row.microbatches
        if row.metric == "tokens_per_s_per_gpu"
        else row.batch // (dp * row.microbatches)
    )
    schedule = (row.schedule or "1f1b") if pp > 1 else None
    lay = Layout(
        dp, tp, pp, m, schedule, row.chunks, row.zero_stage, row.checkpointing, cp,
        recompute=row.recompute, ring_gathers=row.context_gather,
    )  # fmt: skip
    intra, inter = _links(row)
    return price(meta, lay, intra, inter, row.gpus_per_node, row.sequence, async_tp=row.async_tp)


def _transformer(row: Row, device: Device) -> float:
    priced = _priced(row, device)
    if row.metric == "tokens_per_s_per_gpu":
        return float(priced.tokens_per_s / row.gpus)
    flops = megatron_flops(model_args(row.model_args), row.batch, row.sequence, row.vocab)
    return float(flops / (priced.prediction.step_s * row.gpus) / 1e12)


def predict_gib(row: Row, achieved: dict[str, dict[str, float]] | None = None) -> float:
    """The GiB a GPU the simulator's allocator reserves at `row`'s peak (0 for a convnet)."""
    if not row.transformer:
        return 0.0
    device = _device(row, (achieved or ACHIEVED)[row.device])
    return float(_priced(row, device).reserved_bytes / 2**30)


def predict(row: Row, achieved: dict[str, dict[str, float]] | None = None) -> float:
    """The simulator's figure for `row`'s set-up, its device's fractions `achieved` (the
    fitted ones, `ACHIEVED`, unless given)."""
    device = _device(row, (achieved or ACHIEVED)[row.device])
    return _transformer(row, device) if row.transformer else _convnet(row, device)


# -- the table --------------------------------------------------------------------------------


def error(row: Row, predicted: float) -> float:
    """Points of efficiency, or the fraction of the published figure."""
    if row.metric == "efficiency":
        return predicted - row.published
    return predicted / row.published - 1


def validate(table: Table) -> tuple[list[dict[str, Any]], bool]:
    """Every row's prediction beside its published figure (and its GiB a GPU beside the
    published one, where given), and whether every validation row is within its metric's
    tolerance (and the memory's, `tolerance.gib`)."""
    out, good = [], True
    for row in table.rows:
        predicted = predict(row)
        err = error(row, predicted)
        within = abs(err) <= table.tolerance[row.metric] + 1e-9
        extra: dict[str, Any] = {}
        if row.published_gib:
            gib = predict_gib(row)
            gib_err = gib / row.published_gib - 1
            within &= abs(gib_err) <= table.tolerance["gib"] + 1e-9
            extra = {"predicted_gib": gib, "gib_error": gib_err}
        if row.role == "validation":
            good &= within
        out.append(
            {
                **dataclasses.asdict(row),
                "predicted": predicted,
                "error": err,
                "within": within,
                **extra,
            }
        )
    return out, good


def markdown(results: list[dict[str, Any]], table: Table) -> str:
    lines = [
        "| row | role | source | set-up | published | predicted | error | GiB published | "
        "GiB predicted | GiB error | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        shown = (
            (f"{r['published']:.0%}", f"{r['predicted']:.0%}", f"{r['error'] * 100:+.1f} pt")
            if r["metric"] == "efficiency"
            else (f"{r['published']:,g}", f"{r['predicted']:,.1f}", f"{r['error']:+.1%}")
        )
        gib = ("", "", "")
        if r["published_gib"]:
            gib = (
                f"{r['published_gib']:g}",
                f"{r['predicted_gib']:.1f}",
                f"{r['gib_error']:+.1%}",
            )
        what = {
            "images_per_s": "images/s",
            "tflops_per_gpu": "TFLOP/s a GPU",
            "tokens_per_s_per_gpu": "tokens/s a GPU",
        }.get(r["metric"], f"efficiency against {r['baseline_gpus']}")
        model = r["label"] or f"{r['model']} {r['model_args']}"
        setup = f"{model} on {r['gpus']} {r['device']}, {what}".replace("  ", " ")
        mark = "fitted" if r["role"] == "calibration" else ("yes" if r["within"] else "**no**")
        lines.append(
            f"| {r['id']} | {r['role']} | {r['source']} | {setup} | {' | '.join(shown)} | "
            f"{' | '.join(gib)} | {mark} |"
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
