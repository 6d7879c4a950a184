"""`TrainConfig`: what `gradmesh train` runs, composed of each component's own options (the
layout's, each sync strategy's, compression's, and the job's, data's, optimizer's, output's and
checkpoints' here). The CLI's flags, a TOML file's `[train]` table (flat, with the flags' names,
or in tables by component) and the JSON the launcher gives its workers all fill it through
`gradmesh.options`. No torch here: the CLI builds its flags from this.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import LAYOUT_KEYS, RESHARDABLE, LayoutConfig
from gradmesh.options import (
    check_choices,
    component,
    from_mapping,
    from_toml,
    option,
    values_by_key,
)
from gradmesh.sync.config import SyncConfig

LR_SCALING = ("none", "linear")


def check_result_files(config: Any) -> None:
    """A command's result files (its `--json`, `--plot`) writable before it works: a
    benchmark's figures were lost to a traceback at its end (train checks its own outputs)."""
    for name in ("json", "plot"):
        path = getattr(config, name, None)
        if isinstance(path, str) and path:
            check_writable(path, f"--{name}")


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
    max_steps: int = option(
        0, "stop after this many steps in all, mid-epoch too (0: at the last epoch's end)"
    )
    eval_every: int = option(
        0,
        "score the test split every N steps (its loss and accuracy against the training seconds "
        "so far: the report's eval_history; 0: only at the end)",
    )
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
class DataConfig:
    """Model and data: what is trained, on what."""

    model: str = option(
        "cnn", "model: a registered one, or your factory as pkg.module:factory", name=True
    )
    model_args: str = option("", "keyword arguments of the model's builder, like dim=64,depth=4")
    init_from: str = option(
        "",
        "start from the weights in this model directory (`gradmesh export`'s, of the same "
        "model): weights only, not the optimizer or the step; a checkpoint to resume wins",
    )
    dataset: str = option(
        "digits",
        "dataset: a registered one, or your factory as pkg.module:factory (returning a DataSpec "
        "or x_train, y_train, x_test, y_test)",
        name=True,
    )
    loss: str = option(
        "",
        "your loss as pkg.module:fn, fn(outputs, targets) -> mean over the batch (default: "
        "cross-entropy, averaged over positions for sequences)",
    )
    sequence_length: int = option(64, "tokens per sample of a token dataset (text)")
    batch_size: int = option(64, "global batch size, split across the data-parallel replicas")
    synthetic_shape: str = option("1x8x8", "input shape of the synthetic dataset, like 3x32x32")
    synthetic_classes: int = option(10, "number of classes of the synthetic dataset")
    synthetic_samples: int = option(2048, "number of samples of the synthetic dataset")

    @property
    def user_code(self) -> bool:
        """Whether the job runs the user's code or arguments (a factory, a loss, model
        arguments, weights to start from): built and tried once before launch, so a mistake is
        one line."""
        return bool(
            self.loss
            or self.model_args
            or self.init_from
            or ":" in self.model
            or ":" in self.dataset
        )


STATE_TENSORS = {"sgd": 1, "adam": 2, "adamw": 2}
"""Tensors of state each optimizer keeps per parameter, each of the parameter's size and dtype
(SGD's momentum; Adam's two moments): what the planner and the simulator count. Here, with the
options and without torch, so that `gradmesh --help` and the planner's one-line errors do not
import torch (`gradmesh.train.optimizers` checks it against what each optimizer holds)."""


@dataclass
class OptimizerConfig:
    """Optimizer: how each rank updates its own parameters."""

    name: str = option(
        "sgd", "optimizer (a registered one: sgd, adam, adamw)", flag="--optimizer", name=True
    )
    lr: float = option(0.05, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "L2 weight decay (decoupled for adamw)")
    lr_scaling: str = option(
        "none", "large-batch rule: linear (lr x replicas or x batch/reference)", choices=LR_SCALING
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
    peak_tflops: float = option(
        0.0,
        "the report's MFU against this peak TFLOP/s per device (default: a GPU's from the "
        "device table by its name and --precision, a CPU's measured)",
    )


@dataclass
class CheckpointConfig:
    """Checkpoints and restarts: what survives a failure (docs/fault_tolerance.md)."""

    dir: str | None = option(
        None,
        "save checkpoints of every rank's state here; resume from the newest complete one",
        flag="--checkpoint-dir",
    )
    every: int | None = option(
        None, "checkpoint every N steps (default: after every epoch)", flag="--checkpoint-every"
    )
    keep: int = option(3, "complete checkpoints kept, the newest", flag="--keep-checkpoints")
    asynchronous: bool = option(
        False,
        "write checkpoints on a background thread: training stops only to copy its state",
        flag="--checkpoint-async",
    )
    max_restarts: int = option(
        0, "restart every worker up to N times after a failure, from the newest checkpoint"
    )
    reshard: bool = option(
        False,
        "resume from a checkpoint saved with other --workers / --tensor-parallel: each rank "
        "takes its part of the whole model and optimizer state",
    )


IDENTITY = (
    "model",
    "model_args",
    "dataset",
    "sequence_length",
    "batch_size",
    "seed",
    "strategy",
    "synthetic_shape",
    "optimizer",
    "compression",
    *LAYOUT_KEYS,
)
"""The options (by flag) a checkpoint must share with the run that resumes from it."""
PS_IDENTITY = ("servers", "mode", "server_optimizer")
"""A parameter-server job's servers each save their shard: their number, and how they update."""


@dataclass
class TrainConfig:
    """What to train, how, and on how many workers: each component's options, owned by it."""

    job: JobConfig = component(JobConfig)
    layout: LayoutConfig = component(LayoutConfig)
    sync: SyncConfig = component(SyncConfig)
    data: DataConfig = component(DataConfig)
    optimizer: OptimizerConfig = component(OptimizerConfig)
    output: OutputConfig = component(OutputConfig)
    checkpoint: CheckpointConfig = component(CheckpointConfig)

    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """The defaults with some options set by their flags' names: `of(workers=3, lr=0.1)`."""
        return from_mapping(cls, values, "TrainConfig")

    def with_options(self, **values: Any) -> TrainConfig:
        """This config with some options set by their flags' names."""
        return from_mapping(TrainConfig, values, "TrainConfig", self)

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str) -> TrainConfig:
        return from_mapping(cls, values, source)

    @classmethod
    def from_toml(cls, path: str) -> TrainConfig:
        return from_toml(cls, path, "train")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def check_elastic(self) -> None:
        """An elastic job (`--nnodes MIN:MAX`) resumes its replicas from a checkpoint with
        another replica count: every replica must hold the same state, so that any rank's part
        serves any rank."""
        if self.sync.strategy != "allreduce" or self.sync.compression.method != "none":
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) needs --strategy allreduce without "
                "compression: its replicas must hold the same state at every step"
            )
        if self.layout.split or self.layout.plan:
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) changes data-parallel replicas only: "
                "tensor and pipeline parallelism are not supported in it"
            )
        if self.sync.allreduce.zero_stage:
            raise GradmeshError(
                f"an elastic job (--nnodes MIN:MAX) resumes any rank from any replica's part: "
                f"--zero-stage {self.sync.allreduce.zero_stage} gives each replica a part of "
                "its own"
            )
        if not self.checkpoint.dir or self.checkpoint.max_restarts < 1:
            raise GradmeshError(
                "an elastic job (--nnodes MIN:MAX) resumes from its checkpoints after a host "
                "is lost: give it --checkpoint-dir and --max-restarts >= 1"
            )

    def check_outputs(self) -> None:
        """Raise one line unless every output path can be written (before anything runs)."""
        out = self.output
        if out.json:
            check_writable(out.json, "--json")
        if out.timeline:
            check_writable(out.timeline, "--timeline")
        if out.tensorboard:
            check_writable(out.tensorboard, "--tensorboard", directory=True)
            from gradmesh.observe.metrics import require_tensorboard

            require_tensorboard()
        if out.timeline_steps < 0:
            raise GradmeshError(f"--timeline-steps must be >= 0, got {out.timeline_steps}")
        if self.checkpoint.dir:
            check_writable(self.checkpoint.dir, "--checkpoint-dir", directory=True)

    def place_group_checkpoints(self) -> None:
        """With --replica-group G, the group's checkpoints go to `group-G` under
        --checkpoint-dir: each group saves and resumes as a job of its own (its disk may be its
        host's), and groups that resume at different steps meet in the first quorum, where the
        ones behind copy the newest state from a peer. Called once, where the command starts."""
        group = self.sync.replicas.replica_group
        if self.checkpoint.dir and group >= 0:
            self.checkpoint.dir = str(Path(self.checkpoint.dir) / f"group-{group}")

    def identity(self) -> dict[str, Any]:
        """The settings a checkpoint must share with the run that resumes from it, by flag."""
        keys = (
            IDENTITY
            + (PS_IDENTITY if self.sync.strategy == "ps" else ())
            + (("plan",) if self.layout.plan else ())
        )
        flat = values_by_key(self)
        return {k: flat[k] for k in keys}

    def resume_identity(self) -> dict[str, Any]:
        """The settings a checkpoint to resume from must share with this run: its identity,
        less the data x tensor-parallel layout with --reshard."""
        moved = RESHARDABLE if self.checkpoint.reshard else frozenset()
        return {k: v for k, v in self.identity().items() if k not in moved}

    def check_choices(self) -> None:
        check_choices(self)


EXPORT_FORMATS = ("auto", "hf", "safetensors")


@dataclass
class ExportConfig:
    """gradmesh export: a checkpoint, from any layout, as a model directory."""

    checkpoint: str = option(
        "", "the run's --checkpoint-dir (its newest checkpoint)", positional=True
    )
    to: str = option("", "the model directory to write (new, or empty)")
    format: str = option(
        "auto",
        "hf (Hugging Face's save_pretrained) or safetensors; auto: hf for hf: models",
        choices=EXPORT_FORMATS,
    )
    max_shard_size: str = option("5GB", "hf: files above this size are split, with an index")
