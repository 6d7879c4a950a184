"""The run report: what every strategy prints at the end and writes as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmesh.data.registry import is_token_dataset
from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.order import bubble_formula
from gradmesh.models.devices import UNKNOWN
from gradmesh.runtime.axes import NAMES, PP, MeshShape
from gradmesh.train.config import TrainConfig
from gradmesh.train.rank_stats import (
    KINDS,
    RankStats,
    compression_figures,
    mean,
    slowest,
    summarize_layout,
)

STRAGGLER = 1.5
"""A rank computing this many times the median rank's time is named in the summary."""


def _device_figures(figures: dict[str, float], stats: RankStats) -> tuple[float, int]:
    """The workers' mean peak FLOP/s and the largest rank's GPU memory, taken out of the
    layout's `figures` (a mean of memory peaks would describe no rank)."""
    figures.pop("gpu_peak_memory_bytes", None)
    memory = int(max(stats.layout.get("gpu_peak_memory_bytes", [0.0])))
    return figures.pop("peak_flops", 0.0), memory


@dataclass
class RunFacts:
    """What a run measured, which its report is built from (`RunReport.build`)."""

    workers: int
    """Worker processes (a ps job's replicas; one per rank otherwise)."""
    strategy_info: dict[str, Any]
    accuracy: float | None
    losses: list[float]
    wall_s: float
    samples: int
    stats: RankStats
    layout: dict[str, Any] | None = None
    faults: dict[str, Any] | None = None
    steps: int = 0
    cpu_idle: float = 0.0
    flops_per_sample: float = 0.0
    peak_source: str = ""
    steady_rate: float = 0.0
    test_loss: float | None = None
    evals: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class RunReport:
    """The outcome of one training run; `comm_s`, `compute_s`, `bytes_sent` are per-worker means."""

    test_accuracy: float | None
    """None where the targets are not class ids (accuracy does not apply)."""
    final_loss: float | None
    wall_s: float
    samples_per_s: float
    """Samples over the loop's wall time, start-up included."""
    comm_s: float
    compute_s: float
    bytes_sent: float
    workers: int
    strategy: str
    epochs: int
    seed: int
    model: str
    dataset: str
    batch_size: int
    loss_history: list[float]
    per_rank: dict[str, Any]
    strategy_info: dict[str, Any] = field(default_factory=dict)
    compression: dict[str, float] = field(default_factory=dict)
    """Gradient bytes per step and worker given to the compressor and sent by it (its messages),
    and their ratio: empty without compression."""
    layout: dict[str, Any] = field(default_factory=dict)
    """dp, tp, pp, micro-batches, schedule; the per-rank means of parameter bytes held, bytes sent
    per step by kind and stage idle, and (pipelines) the bubble; `per_rank["layout"]` has every
    rank's."""
    slowest: dict[str, Any] = field(default_factory=dict)
    """The rank with the most computation against the ranks doing the same work (a straggler
    holds the others up in synchronous training): its rank, compute seconds, and their ratio to
    those ranks' median."""
    faults: dict[str, Any] = field(default_factory=dict)
    """With checkpoints or restarts: restarts, steps redone, the step resumed from, and the
    reporting rank's checkpoint saves, their median stall and its file's bytes."""
    steps: int = 0
    """Steps the reporting rank took in this run (per-rank seconds / steps = a step's time)."""
    cpu_idle: float = 0.0
    """The machine's idle CPU share while the reporting rank trained (every process on this
    machine counts: on an emulated cluster, every host's); under 10 % the cores, not the links,
    were the limit."""
    tokens_per_sample: int = 0
    """A language model's tokens per sample (its sequence length; 0 for other models): the
    loss is per token, so the summary adds perplexity and tokens/s."""
    flops_per_sample: float = 0.0
    """A language model's forward + backward FLOPs per sample (torch's FLOP counter)."""
    peak_flops: float = 0.0
    """The workers' mean peak FLOP/s (`gradmesh.models.devices.device_peak`): a GPU's from the
    device table by its name and the run's precision, `--peak-tflops`, or a CPU's measured."""
    peak_source: str = ""
    """Where `peak_flops` came from (the reporting rank's): the table's entry and precision,
    the flag, measured on this CPU, or why it is unknown."""
    mfu: float = 0.0
    """Model FLOPs utilisation: the model's FLOPs per second (samples/s x FLOPs per sample)
    over the workers' peak (workers x `peak_flops`); 0 where either is unknown."""
    steady_samples_per_s: float = 0.0
    """Samples per second after the first `WARMUP_STEPS` steps (allocator, autotuning and
    compilation are over; the GPU waited for at both ends): what MFU is computed from, and what
    a plain loop's rate compares with. 0 for a run that short."""
    gpu_peak_memory_bytes: int | None = None
    """The most tensor bytes a rank held on its GPU (`torch.cuda.max_memory_allocated`, the
    largest rank's); None off CUDA."""
    emulated_compute_ms: float = 0.0
    """EMULATED compute (`--emulate-compute-ms`): the sleep each step's forward and backward
    took on top of the real arithmetic; 0 for a run that only computed."""
    max_steps: int = 0
    """--max-steps: the run stopped after this many steps (0: after its epochs)."""
    test_loss: float | None = None
    """The final model's cross-entropy on the test split, per target (per token for a language
    model); None where `test_accuracy` is."""
    eval_history: list[dict[str, float]] = field(default_factory=list)
    """--eval-every N: per scoring, `step`, `seconds` (of training before it, scoring left out),
    `test_loss` and `test_accuracy`. With local SGD or DiLoCo each replica scores its slice
    with its own model: at multiples of --sync-every they are one model."""

    @classmethod
    def build(cls, config: TrainConfig, run: RunFacts) -> RunReport:
        """The report of a run of `config` from what it measured."""
        workers, stats, losses, samples, wall_s = (
            run.workers,
            run.stats,
            run.losses,
            run.samples,
            run.wall_s,
        )
        flops_per_sample, steady_rate = run.flops_per_sample, run.steady_rate
        figures = summarize_layout(stats.layout)
        peak, gpu_memory = _device_figures(figures, stats)
        rate = samples / wall_s if wall_s > 0 else 0.0
        compression = compression_figures(figures)
        return cls(
            test_accuracy=run.accuracy,
            test_loss=run.test_loss,
            eval_history=run.evals,
            final_loss=losses[-1] if losses else None,
            wall_s=wall_s,
            samples_per_s=rate,
            comm_s=mean(stats.comm_s),
            compute_s=mean(stats.compute_s),
            bytes_sent=mean(stats.bytes_sent),
            workers=workers,
            strategy=config.sync.strategy,
            epochs=config.job.epochs,
            max_steps=config.job.max_steps,
            seed=config.job.seed,
            model=config.data.model,
            dataset=config.data.dataset,
            batch_size=config.data.batch_size,
            loss_history=losses,
            per_rank=dataclasses.asdict(stats),
            strategy_info=run.strategy_info,
            compression=compression,
            layout={**(run.layout or {}), **figures},
            slowest=slowest(
                stats.compute_s, config.layout.tensor_parallel * config.layout.pipeline_parallel
            ),
            faults=run.faults or {},
            steps=run.steps,
            emulated_compute_ms=config.job.emulate_compute_ms,
            cpu_idle=run.cpu_idle,
            tokens_per_sample=(
                config.data.sequence_length if is_token_dataset(config.data.dataset) else 0
            ),
            flops_per_sample=flops_per_sample,
            peak_flops=peak,
            peak_source=run.peak_source,
            steady_samples_per_s=steady_rate,
            mfu=(steady_rate or rate) * flops_per_sample / (workers * peak) if peak else 0.0,
            gpu_peak_memory_bytes=gpu_memory or None,
        )

    @classmethod
    def load(cls, path: str, raw: Any = None) -> RunReport:
        """The report `gradmesh train --json` wrote to `path` (a one-line error otherwise);
        `raw` is its JSON where the caller has read it already."""
        raw = read_json(path) if raw is None else raw
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        required -= {f.name for f in dataclasses.fields(cls) if callable(f.default_factory)}
        if not isinstance(raw, dict) or not required <= set(raw):
            missing = sorted(required - set(raw)) if isinstance(raw, dict) else ["an object"]
            raise GradmeshError(
                f"{path} is not a gradmesh run report (gradmesh train --json) or timeline "
                "(--timeline): it lacks " + ", ".join(missing[:4])
            )
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def summary(self) -> str:
        """A few human lines for the end of a run."""
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "n/a"
        info = " ".join(  # tables (histograms, per-server stats) are in the JSON report only
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.strategy_info.items()
            if not isinstance(v, dict | list) or k == "lost_workers"
        )
        return "\n".join(
            [
                f"gradmesh train: {self.model} on {self.dataset}, strategy {self.strategy} {info}, "
                f"{self.workers} workers, {self._length()}, global batch {self.batch_size}",
                f"  test accuracy {self._accuracy()}"
                + (f"   test loss {self.test_loss:.4f}" if self.test_loss is not None else "")
                + f"   final loss {loss}",
                f"  wall {self.wall_s:.2f} s   {self.samples_per_s:.0f} samples/s   "
                f"comm {self.comm_s:.2f} s   compute {self.compute_s:.2f} s (per worker)",
                f"  bytes sent per worker {self.bytes_sent / 1e6:.2f} MB" + self._compressed(),
                *self._gpu_memory_line(),
                *self._language_line(),
                *(
                    [f"  EMULATED compute: {self.emulated_compute_ms:g} ms of sleep per step"]
                    if self.emulated_compute_ms
                    else []
                ),
                *self._layout_lines(),
                *self._fault_lines(),
                *self._straggler_line(),
            ]
        )

    def _length(self) -> str:
        return f"{self.max_steps} steps" if self.max_steps else f"{self.epochs} epochs"

    def _accuracy(self) -> str:
        if self.test_accuracy is None:
            return "n/a (targets are not class ids)"
        return f"{self.test_accuracy:.4f}"

    def _language_line(self) -> list[str]:
        if not self.tokens_per_sample or self.final_loss is None:
            return []
        return [
            f"  language model: training perplexity {math.exp(self.final_loss):.2f} (per "
            f"token), {self.samples_per_s * self.tokens_per_sample:.0f} tokens/s"
            + (
                f" ({self.steady_samples_per_s * self.tokens_per_sample:.0f} after the first steps)"
                if self.steady_samples_per_s
                else ""
            )
            + "; the test accuracy counts every position's next token",
            *self._mfu_line(),
        ]

    def _mfu_line(self) -> list[str]:
        """MFU and the peak it is against, with where that peak came from; or why none."""
        if not self.mfu:
            unknown = self.peak_source.startswith(UNKNOWN)
            return [f"  MFU n/a: the peak FLOP/s is {self.peak_source}"] if unknown else []
        peak = self.peak_flops
        rate = f"{peak / 1e12:.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.1f} GFLOP/s"
        return [
            f"  MFU {self.mfu:.1%}: {self.flops_per_sample / 1e6:.1f} MFLOP a sample (forward "
            f"+ backward, torch's FLOP counter) against {rate} per worker, peak "
            f"{self.peak_source or 'measured by each worker'}"
        ]

    def _gpu_memory_line(self) -> list[str]:
        if self.gpu_peak_memory_bytes is None:
            return []
        return [
            f"  GPU peak memory {self.gpu_peak_memory_bytes / 2**30:.2f} GiB (the largest rank's "
            "torch.cuda.max_memory_allocated; the trainer makes no memory prediction: gradmesh "
            "simulate gives the memory model's GiB a GPU)"
        ]

    def _straggler_line(self) -> list[str]:
        s = self.slowest
        if not s or s["ratio_to_median"] < STRAGGLER:
            return []
        return [
            f"  straggler: rank {s['rank']} computed {s['compute_s']:.2f} s, "
            f"{s['ratio_to_median']:.1f}x the median rank"
        ]

    def _fault_lines(self) -> list[str]:
        f = self.faults
        if not f:
            return []
        changes = f.get("membership", [])
        members = ", ".join(f"{w} from step {s}" for s, w in changes)
        return [
            f"  checkpoints {f.get('checkpoint_saves', 0)} saved, median stall "
            f"{f.get('checkpoint_stall_s_median', 0.0) * 1e3:.1f} ms, "
            f"{f.get('checkpoint_rank_file_bytes', 0) / 1e6:.2f} MB per rank   "
            f"restarts {f['restarts']}, steps redone {f['steps_redone']}, "
            f"resumed from step {f['resumed_from_step']}"
        ] + ([f"  workers (elastic): {members}"] if len(changes) > 1 else [])

    def _compressed(self) -> str:
        if not self.compression:
            return ""
        c = self.compression
        return (
            f"   compressed {c['given_bytes_per_step'] / 1e3:.1f} kB -> "
            f"{c['sent_bytes_per_step'] / 1e3:.1f} kB per step (ratio {c['ratio']:.3f})"
        )

    def _layout_lines(self) -> list[str]:
        lay = self.layout
        recomputed = (
            [
                f"  activation checkpointing: {lay['recomputed_blocks']} "
                f"{lay.get('recomputed', 'blocks')} recompute in backward"
            ]
            if lay.get("recomputed_blocks")
            else []
        )
        if lay.get("precision") in ("bf16", "fp16"):
            recomputed.append(
                f"  precision {lay['precision']}: forwards under autocast; weights, gradients "
                "and reductions fp32"
            )
        if "loss_scale" in lay:
            scale = lay["loss_scale"]
            recomputed.append(
                f"  loss scale {scale['scale']:g} at the end; {scale['skipped_steps']} steps "
                "skipped for overflowing gradients"
            )
        shape = MeshShape.of({a: lay.get(a, 1) for a in NAMES}) if lay else None
        if shape is None or shape.split == 1:
            return recomputed
        split = f"  layout {shape.describe()}"
        split += ", sequence parallel" if lay.get("sequence_parallel") else ""
        if "context_attention" in lay:
            split += f", {lay['context_attention']} attention"
        if "experts" in lay:
            split += (
                f", {lay['experts_per_rank']} of {lay['experts']} experts a rank, top-"
                f"{lay['top_k']}, {lay['routing']}"
            )
        if lay[PP] > 1:
            chunks = lay.get("chunks", 1)
            split += f", {lay['microbatches']} micro-batches {lay['schedule']}"
            split += f" ({chunks} stages per rank)" if chunks > 1 else ""
            formula = bubble_formula(lay[PP], lay["microbatches"], chunks, lay["schedule"])
            split += (
                f", bubble {lay.get('bubble', 0.0):.2f} (formula {formula:.2f}; "
                f"stage idle {lay['stage_idle']:.2f})"
            )
        per_step = ", ".join(
            f"{k} {lay.get(f'{k}_bytes_per_step', 0.0) / 1e3:.1f} kB"
            for k in KINDS[:5]
            if k in KINDS[:3] or lay.get(f"{k}_bytes_per_step")
        )
        return [
            split,
            f"  per rank: parameters {lay.get('param_bytes', 0) / 1e6:.2f} MB; "
            f"sent per step: {per_step}",
            *recomputed,
        ]


def read_json(path: str) -> Any:
    """`path`'s JSON, or a one-line error saying why not."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise GradmeshError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise GradmeshError(f"{path} is not JSON: {exc}") from None
