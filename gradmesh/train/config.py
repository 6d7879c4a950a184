"""`TrainConfig`: the one configuration surface of `gradmesh train`.

Every field carries its help text; the CLI builds its flags from these fields and a TOML file
(`--config FILE`) fills the same fields, so there is nothing to keep in sync by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.registry import canonical_name


def option(default: Any, help: str, name: bool = False) -> Any:
    """A dataclass field with the help text the CLI shows for it; `name`: its value is a name
    from a fixed set (a registry, a mode), matched without regard to case."""
    return field(default=default, metadata={"help": help, "name": name})


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x8x8' -> (1, 8, 8)."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise GradmeshError(f"bad shape {text!r}: expected sizes joined by x, like 1x8x8") from None
    if not shape or any(s < 1 for s in shape):
        raise GradmeshError(f"bad shape {text!r}: every size must be >= 1")
    return shape


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def field_kind(cls: type, name: str) -> tuple[type, bool]:
    """(the field's type, whether None is allowed), from its annotation: `str | None` -> str."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        args = typing.get_args(hint)
        return next(a for a in args if a is not type(None)), type(None) in args
    return typing.cast(type, hint), False


def _metadata(cls: type, name: str) -> Any:
    return next(f.metadata for f in dataclasses.fields(cls) if f.name == name)


def field_value(cls: type, name: str, value: Any, source: str | None) -> Any:
    """`value` checked against field `name`'s annotation: the one conversion every flag, TOML
    key and JSON key goes through. `source` names the file; None means a command-line flag,
    whose value is text to parse."""
    text = source is None
    kind, optional = field_kind(cls, name)
    if value is None and optional:
        return value
    if text and isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        if isinstance(value, str) and _metadata(cls, name).get("name", False):
            return canonical_name(value)
        return value
    shown = json.dumps(value) if not isinstance(value, str) else repr(value)
    what = f"--{name.replace('_', '-')}" if source is None else f"{source}: {name}"
    raise GradmeshError(f"{what} must be {_KIND_NAMES[kind]}, got {shown}")


def check_writable(path: str, what: str, directory: bool = False) -> None:
    """Raise one line unless `path` (a file, or with `directory` a folder, created here if it
    is missing) can be written: checked before launch so no run's results are lost at the end."""
    target = Path(path)
    if directory:
        if target.exists() and not target.is_dir():
            raise GradmeshError(f"{what} {path} exists and is not a folder")
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise GradmeshError(f"{what} {path} cannot be created: {exc.strerror}") from None
        folder = target
    else:
        if target.is_dir():
            raise GradmeshError(f"{what} {path} is a folder, not a file")
        folder = target.parent
        if not folder.is_dir():
            raise GradmeshError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        not directory and target.exists() and not os.access(target, os.W_OK)
    ):
        raise GradmeshError(f"{what} {path} is not writable")


@dataclass
class JobConfig:
    """The job: how many workers, how long, how it fails."""

    workers: int = option(2, "number of worker processes on this host")
    epochs: int = option(12, "passes over the training set")
    seed: int = option(0, "seed for model initialisation and data order")
    timeout_s: float = option(60.0, "seconds before a rendezvous or collective is declared failed")
    emulate_compute_ms: float = option(
        0.0,
        "benchmarks: each step's forward and backward sleep this much longer, spread over the "
        "layers by their FLOPs, standing in for a bigger model's compute",
    )
    engine: str = option(
        "local", "what starts the workers: local (gradmesh's launcher), ray or spark", name=True
    )


@dataclass
class LayoutConfig:
    """Layout: how one replica of the model is split over ranks (the rest of the workers are
    data-parallel replicas)."""

    tensor_parallel: int = option(1, "ranks each layer of the model's plan is split over (tp)")
    pipeline_parallel: int = option(1, "pipeline stages the model's layers are cut into (pp)")
    microbatches: int = option(1, "pipeline: micro-batches per replica's batch")
    schedule: str = option("1f1b", "pipeline schedule: gpipe or 1f1b", name=True)
    stages: str = option(
        "",
        "pipeline: first layer index of each stage after the first, like 4,9 (default: "
        "balanced by measured layer time)",
    )
    plan: str = option(
        "",
        "hybrid plan, a placement per layer: a plan file (gradmesh plan --json), or auto to "
        "plan for this host's loopback link; sets --tensor-parallel",
    )


@dataclass
class StrategyConfig:
    """Strategy: how the replicas agree."""

    strategy: str = option("allreduce", "how workers cooperate (a registered strategy)", name=True)
    allreduce: str = option("native", "allreduce algorithm for gradient averaging", name=True)
    fusion_mb: float = option(64.0, "gradient fusion buffer size in MiB")
    compression: str = option(
        "none", "gradient compression: none, fp16, bf16, int8, topk, sign, powersgd", name=True
    )
    compression_ratio: float = option(0.01, "topk: fraction of the elements sent, in (0, 1]")
    compression_rank: int = option(1, "powersgd: rank of the low-rank approximation")
    error_feedback: str = option(
        "auto",
        "keep what compression left out for the next step: auto (on for the biased "
        "int8, topk, sign, powersgd), on, off",
        name=True,
    )
    on_nonfinite: str = option("error", "NaN/Inf in gradients: error, or skip the step", name=True)
    sync_every: int = option(8, "local-sgd: local steps between parameter averages (K)")
    averaging_algorithm: str = option(
        "native", "local-sgd: allreduce algorithm for averaging", name=True
    )
    warmup_sync_steps: int = option(0, "local-sgd: synchronous steps before going local (T)")
    lock: bool = option(False, "hogwild: serialise the shared-memory updates with a lock")
    servers: int = option(1, "ps: parameter-server processes")
    mode: str = option("async", "ps: sync, async (Downpour) or ssp (bounded staleness)", name=True)
    max_staleness: int = option(2, "ps --mode ssp: most clocks a worker may run ahead (K)")
    push_every: int = option(1, "ps: push the accumulated gradient every n steps")
    pull_every: int = option(1, "ps: pull the parameters every m steps")
    staleness_lr: bool = option(False, "ps: divide each gradient's step by its staleness")
    server_optimizer: str = option(
        "sgd", "ps: sgd (with --momentum), adagrad, adam, adarevision", name=True
    )
    lost_after_s: float = option(10.0, "ps: a worker silent this long is declared lost")


@dataclass
class DataConfig:
    """Model and data: what is trained, on what."""

    model: str = option("cnn", "model to train (a registered model)", name=True)
    dataset: str = option("digits", "dataset to train on (a registered dataset)", name=True)
    batch_size: int = option(64, "global batch size, split across the data-parallel replicas")
    synthetic_shape: str = option("1x8x8", "input shape of the synthetic dataset, like 3x32x32")
    synthetic_classes: int = option(10, "number of classes of the synthetic dataset")
    synthetic_samples: int = option(2048, "number of samples of the synthetic dataset")


@dataclass
class OptimizerConfig:
    """Optimizer: how each rank updates its own parameters."""

    optimizer: str = option("sgd", "optimizer (a registered one: sgd, adam, adamw)", name=True)
    lr: float = option(0.05, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "L2 weight decay (decoupled for adamw)")
    lr_scaling: str = option(
        "none", "large-batch rule: linear (lr x replicas or x batch/reference)", name=True
    )
    reference_batch: int = option(0, "with --lr-scaling linear: batch the base lr was tuned for")
    warmup_epochs: float = option(0.0, "gradual linear warm-up to the scaled lr over K epochs")


@dataclass
class OutputConfig:
    """Output: what the run writes."""

    timeline: str | None = option(
        None, "write one Chrome trace (Perfetto) of every rank, clocks aligned, to this path"
    )
    timeline_per_rank: bool = option(
        False, "with --timeline: a file per rank (PATH.rankR.json), each on its own clock"
    )
    timeline_steps: int = option(1000, "with --timeline: keep each rank's last N steps (0: all)")
    tensorboard: str | None = option(None, "write TensorBoard scalars to this folder")
    json: str | None = option(None, "write the run report as JSON to this path")


@dataclass
class CheckpointConfig:
    """Checkpoints and restarts: what survives a failure (docs/fault_tolerance.md)."""

    checkpoint_dir: str | None = option(
        None, "save checkpoints of every rank's state here; resume from the newest complete one"
    )
    checkpoint_every: int | None = option(
        None, "checkpoint every N steps (default: after every epoch)"
    )
    keep_checkpoints: int = option(3, "complete checkpoints kept, the newest")
    checkpoint_async: bool = option(
        False, "write checkpoints on a background thread: training stops only to copy its state"
    )
    max_restarts: int = option(
        0, "restart every worker up to N times after a failure, from the newest checkpoint"
    )


COMPONENTS: tuple[tuple[str, type], ...] = (
    ("job", JobConfig),
    ("layout", LayoutConfig),
    ("strategy", StrategyConfig),
    ("model and data", DataConfig),
    ("optimizer", OptimizerConfig),
    ("output", OutputConfig),
    ("checkpoints and restarts", CheckpointConfig),
)
"""Each component's own config, in the order `gradmesh train --help` shows them."""


IDENTITY = (
    "model",
    "dataset",
    "batch_size",
    "seed",
    "strategy",
    "synthetic_shape",
    "optimizer",
    "workers",
    "tensor_parallel",
    "pipeline_parallel",
    "compression",
)
PS_IDENTITY = ("servers", "mode", "server_optimizer")
"""A parameter-server job's servers each save their shard: their number, and how they update."""


@dataclass
class TrainConfig(
    CheckpointConfig,
    OutputConfig,
    OptimizerConfig,
    DataConfig,
    StrategyConfig,
    LayoutConfig,
    JobConfig,
):
    """What to train, how, and on how many workers: every component's fields, flat (one TOML
    table, one JSON object), each defined once in its component's dataclass."""

    def compressor(self) -> Any:
        """The `Compressor` these settings ask for (a one-line error for bad ones)."""
        from gradmesh.compression import make

        if self.compression_rank < 1:
            raise GradmeshError(f"--compression-rank must be >= 1, got {self.compression_rank}")
        return make(
            self.compression, self.compression_ratio, self.compression_rank, self.error_feedback
        )

    def validate(self) -> None:
        """Raise a one-line `GradmeshError` for values no run can use."""
        from gradmesh.collectives import ALGORITHMS
        from gradmesh.data import DATASETS
        from gradmesh.models import MODELS, check_pairing
        from gradmesh.train.strategies import STRATEGIES

        STRATEGIES.get(self.strategy)
        from gradmesh.launch.engines.choice import check_engine

        check_engine(self.engine)
        if self.engine == "ray" and self.strategy == "ps":
            raise GradmeshError(
                "--engine ray cannot run --strategy ps: Ray runs each rank on a thread of its "
                "worker, where a ps worker's supervisor cannot take its signals (use --engine "
                "local or spark)"
            )
        ALGORITHMS.get(self.allreduce)
        ALGORITHMS.get(self.averaging_algorithm)
        if self.sync_every < 1 or self.warmup_sync_steps < 0:
            raise GradmeshError("--sync-every must be >= 1 and --warmup-sync-steps >= 0")
        MODELS.get(self.model)
        DATASETS.get(self.dataset)
        check_pairing(self.model, self.dataset)
        parse_shape(self.synthetic_shape)
        positive = ("workers", "epochs", "batch_size", "synthetic_classes", "synthetic_samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise GradmeshError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        self.compressor()
        if self.compression != "none" and self.strategy == "hogwild":
            raise GradmeshError("hogwild shares memory: it sends nothing to compress")
        if self.lr_scaling not in ("none", "linear"):
            raise GradmeshError(f"unknown lr scaling {self.lr_scaling!r} (valid: linear, none)")
        if self.on_nonfinite not in ("error", "skip"):
            raise GradmeshError(
                f"unknown --on-nonfinite {self.on_nonfinite!r} (valid: error, skip)"
            )
        if self.fusion_mb <= 0 or self.warmup_epochs < 0 or self.reference_batch < 0:
            raise GradmeshError(
                "--fusion-mb must be > 0, --warmup-epochs and --reference-batch >= 0"
            )
        if self.lr <= 0 or self.timeout_s <= 0:
            raise GradmeshError("--lr and --timeout-s must be > 0")
        self._validate_ps()
        self._validate_layout()
        self._validate_checkpoints()
        if self.batch_size < self.workers:
            raise GradmeshError(
                f"global batch {self.batch_size} is smaller than "
                f"the number of workers {self.workers}"
            )

    def _validate_layout(self) -> None:
        from gradmesh.layout.pipeline import SCHEDULES
        from gradmesh.runtime.mesh import MeshShape
        from gradmesh.train.strategies import SPLIT_LAYOUTS

        shape = MeshShape.for_world(self.workers, self.tensor_parallel, self.pipeline_parallel)
        split = shape.tp * shape.pp > 1
        if split and self.strategy not in SPLIT_LAYOUTS:
            raise GradmeshError(
                f"strategy {self.strategy} needs the whole model on every worker; with "
                f"--tensor-parallel/--pipeline-parallel use {' or '.join(sorted(SPLIT_LAYOUTS))}"
            )
        if self.plan and (self.strategy != "allreduce" or shape.pp > 1):
            raise GradmeshError(
                "--plan places layers over data and tensor parallelism: it needs --strategy "
                "allreduce and no --pipeline-parallel"
            )
        if self.stages and shape.pp == 1:
            raise GradmeshError("--stages cuts a pipeline: use it with --pipeline-parallel > 1")
        if self.emulate_compute_ms < 0:
            raise GradmeshError(f"--emulate-compute-ms must be >= 0, got {self.emulate_compute_ms}")
        if self.emulate_compute_ms and (split or self.plan):
            raise GradmeshError(
                "--emulate-compute-ms spreads one step's compute over the whole model's layers: "
                "it needs every worker to hold the whole model (no --tensor-parallel, "
                "--pipeline-parallel or --plan)"
            )
        if self.microbatches < 1:
            raise GradmeshError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.microbatches > 1 and shape.pp == 1:
            raise GradmeshError(
                "--microbatches streams a pipeline: use it with --pipeline-parallel > 1"
            )
        if self.schedule not in SCHEDULES:
            raise GradmeshError(
                f"unknown --schedule {self.schedule!r} (valid: {', '.join(SCHEDULES)})"
            )
        per_replica = self.batch_size // shape.dp
        if self.microbatches > 1 and self.batch_size % (shape.dp * self.microbatches):
            fits = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and m <= 64]
            raise GradmeshError(
                f"global batch {self.batch_size} over {shape.dp} replicas cannot be cut into "
                f"{self.microbatches} equal micro-batches; --microbatches that fit: "
                f"{', '.join(map(str, fits))}"
            )

    def _validate_checkpoints(self) -> None:
        every = self.checkpoint_every
        if every is not None and every < 1:
            raise GradmeshError(f"--checkpoint-every must be >= 1 step, got {every}")
        if every is not None and not self.checkpoint_dir:
            raise GradmeshError("--checkpoint-every needs --checkpoint-dir to write to")
        if self.keep_checkpoints < 1:
            raise GradmeshError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.max_restarts < 0:
            raise GradmeshError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if (
            self.strategy == "ps"
            and self.mode != "sync"
            and (self.checkpoint_dir or self.max_restarts)
        ):
            raise GradmeshError(
                "checkpoints and restarts of a ps job need --mode sync: asynchronous servers "
                "and workers never stand at one step that a checkpoint could hold"
            )

    def check_elastic(self) -> None:
        """An elastic job (`--nnodes MIN:MAX`) resumes its replicas from a checkpoint with
        another replica count: every replica must hold the same state, so that any rank's part
        serves any rank."""
        if self.strategy != "allreduce" or self.compression != "none":
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) needs --strategy allreduce without "
                "compression: its replicas must hold the same state at every step"
            )
        if self.tensor_parallel * self.pipeline_parallel > 1 or self.plan:
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) changes data-parallel replicas only: "
                "tensor and pipeline parallelism are not supported in it"
            )
        if not self.checkpoint_dir or self.max_restarts < 1:
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) resumes from its checkpoints after a host "
                "is lost: give it --checkpoint-dir and --max-restarts >= 1"
            )

    def check_outputs(self) -> None:
        """Raise one line unless every output path can be written (before anything runs)."""
        if self.json:
            check_writable(self.json, "--json")
        if self.timeline:
            check_writable(self.timeline, "--timeline")
        if self.tensorboard:
            check_writable(self.tensorboard, "--tensorboard", directory=True)
            from gradmesh.observe.metrics import require_tensorboard

            require_tensorboard()
        if self.timeline_steps < 0:
            raise GradmeshError(f"--timeline-steps must be >= 0, got {self.timeline_steps}")
        if self.checkpoint_dir:
            check_writable(self.checkpoint_dir, "--checkpoint-dir", directory=True)

    def _validate_ps(self) -> None:
        from gradmesh.sync.parameter_server.optimizers import SERVER_OPTIMIZERS
        from gradmesh.sync.parameter_server.server import MODES

        if self.mode not in MODES:
            raise GradmeshError(f"unknown --mode {self.mode!r} (valid: {', '.join(MODES)})")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise GradmeshError(
                f"unknown --server-optimizer {self.server_optimizer!r} "
                f"(valid: {', '.join(SERVER_OPTIMIZERS)})"
            )
        if min(self.servers, self.push_every, self.pull_every) < 1 or self.max_staleness < 0:
            raise GradmeshError(
                "--servers, --push-every and --pull-every must be >= 1, --max-staleness >= 0"
            )
        if self.mode == "sync" and (self.push_every, self.pull_every) != (1, 1):
            raise GradmeshError("--mode sync pushes and pulls every step: drop --push/pull-every")
        if self.lost_after_s <= 0:
            raise GradmeshError(f"--lost-after-s must be > 0, got {self.lost_after_s}")

    def identity(self) -> dict[str, Any]:
        """The settings a checkpoint must share with the run that resumes from it."""
        keys = (
            IDENTITY
            + (PS_IDENTITY if self.strategy == "ps" else ())
            + (("plan",) if self.plan else ())
        )
        return {k: getattr(self, k) for k in keys}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_mapping(
        cls, values: dict[str, Any], source: str, base: TrainConfig | None = None
    ) -> TrainConfig:
        """Build from a dict (JSON or TOML), each value checked against its field's type, on
        top of `base` (the defaults when None); `source` is named in errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise GradmeshError(f"{source}: unknown option(s) {', '.join(unknown)}")
        checked = {k: field_value(cls, k, v, source) for k, v in values.items()}
        return dataclasses.replace(base or cls(), **checked)

    @classmethod
    def from_toml(cls, path: str) -> TrainConfig:
        try:
            values = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise GradmeshError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise GradmeshError(f"cannot read config {path}: {exc}") from None
        table = values.get("train", values)
        if not isinstance(table, dict):
            raise GradmeshError(f"{path}: [train] must be a table")
        return cls.from_mapping(table, path)
