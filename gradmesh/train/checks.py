"""Before launch: a `TrainConfig` no run can use is one line. Each component checks its own
values (`check()`); what only the registries know (names of strategies, models, algorithms) and
what spans components (a layout a strategy cannot carry) is checked here."""

from __future__ import annotations

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import (
    check_compile,
    check_context_layout,
    check_expert_layout,
    check_fp8,
    check_precision,
    check_sequence_parallel,
    every_of,
)
from gradmesh.layout.pipeline.order import check_schedule
from gradmesh.registry import canonical_name
from gradmesh.runtime.axes import MeshShape
from gradmesh.sync.config import SPLIT_LAYOUTS, check_stage
from gradmesh.train.config import TrainConfig
from gradmesh.train.unread import check_unread
from gradmesh.units import parse_shape


def check_train(config: TrainConfig) -> None:
    """Raise a one-line `GradmeshError` for values no run can use: the counts and the layout
    first, which need no torch, then the names, which the registries (torch's modules) hold.
    What this machine can run is its caller's last check (`check_gpu_share`), after the checks
    that build the model."""
    config.check_choices()
    config.sync.check()
    _check_counts(config)
    _check_layout(config)
    _check_checkpoints(config)
    _check_replicas(config)
    _check_names(config)
    check_unread(config)


def _check_replicas(config: TrainConfig) -> None:
    """Replica groups run synchronous data parallelism inside each group, at any layout (tp,
    pp, cp, ep, ZeRO: rank r of every group holds the same part), every step or DiLoCo's rounds
    across them; one line for the rest."""
    if not config.sync.replicas.enabled:
        return
    sync = config.sync
    if sync.strategy not in ("allreduce", "diloco"):
        raise GradmeshError(
            f"--replica-group runs synchronous data parallelism (any layout) inside each "
            f"group, averaged every step (--strategy allreduce) or every --sync-every steps "
            f"(--strategy diloco) across them; not with --strategy {sync.strategy} (yet)"
        )
    groups = sync.replicas.replica_groups
    if config.data.batch_size < groups * config.job.workers:
        raise GradmeshError(
            f"global batch {config.data.batch_size} is smaller than the {groups} groups x "
            f"{config.job.workers} workers"
        )


def _check_names(config: TrainConfig) -> None:
    """Every name a flag gives, checked without importing torch where it is a built-in one
    (`gradmesh.names`): the launcher's parent process runs this before its workers start."""
    from gradmesh.models.registry import check_pairing
    from gradmesh.names import check

    sync, data = config.sync, config.data
    check("strategy", sync.strategy)
    if config.job.engine == "ray" and sync.strategy == "ps":
        raise GradmeshError(
            "--engine ray cannot run --strategy ps: Ray runs each rank on a thread of its "
            "worker, where a ps worker's supervisor cannot take its signals (use --engine "
            "local or spark)"
        )
    check("allreduce algorithm", sync.allreduce.algorithm)
    check("allreduce algorithm", sync.local_sgd.averaging_algorithm)
    check("compressor", sync.compression.method)
    check("model", data.model)
    check("dataset", data.dataset)
    check_pairing(data.model, data.dataset)
    parse_shape(data.synthetic_shape)


def check_rates(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
    """An optimizer's rates, before a worker's torch optimizer refuses them in a traceback (or
    takes a momentum of 1 or more, under which SGD's steps grow without end)."""
    if not lr > 0:  # a NaN from code fails too
        raise GradmeshError(f"--lr must be > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise GradmeshError(f"--momentum must be in [0, 1), got {momentum}")
    if weight_decay < 0:
        raise GradmeshError(f"--weight-decay must be >= 0, got {weight_decay}")


def _check_counts(config: TrainConfig) -> None:
    job, data, opt = config.job, config.data, config.optimizer
    for flag, value in (
        ("--workers", job.workers),
        ("--epochs", job.epochs),
        ("--batch-size", data.batch_size),
        ("--synthetic-classes", data.synthetic_classes),
        ("--synthetic-samples", data.synthetic_samples),
    ):
        if value < 1:
            raise GradmeshError(f"{flag} must be >= 1, got {value}")
    if opt.warmup_epochs < 0 or opt.reference_batch < 0:
        raise GradmeshError("--warmup-epochs and --reference-batch must be >= 0")
    check_rates(opt.lr, opt.momentum, opt.weight_decay)
    if not job.timeout_s > 0:
        raise GradmeshError(f"--timeout-s must be > 0, got {job.timeout_s}")
    if job.eval_every < 0 or job.max_steps < 0:
        raise GradmeshError(
            f"--eval-every and --max-steps must be >= 0, got {job.eval_every} and {job.max_steps}"
        )
    if job.eval_every and config.sync.strategy in ("ps", "hogwild"):
        raise GradmeshError(
            f"--eval-every needs the replicas to score together; --strategy "
            f"{config.sync.strategy}'s workers do not (its test accuracy is scored at the end)"
        )
    if job.emulate_compute_ms < 0:
        raise GradmeshError(f"--emulate-compute-ms must be >= 0, got {job.emulate_compute_ms}")
    if config.output.peak_tflops < 0:
        raise GradmeshError(f"--peak-tflops must be >= 0, got {config.output.peak_tflops}")
    shards = job.workers // max(1, config.layout.context_parallel)  # cp ranks share samples
    if data.batch_size < shards:
        raise GradmeshError(
            f"global batch {data.batch_size} is smaller than the number of workers {job.workers}"
            + (
                f" over --context-parallel {config.layout.context_parallel}"
                if shards < job.workers
                else ""
            )
        )


STATELESS = ("none", "fp16", "bf16")
"""The compressions fp16's loss scale composes with: casts, which keep no state."""


def _check_fp16(config: TrainConfig) -> None:
    """fp16's loss scale skips a step on every rank at once, before anything keeps the
    overflowed gradients."""
    strategy = config.sync.strategy
    if strategy != "allreduce":
        raise GradmeshError(
            f"--precision fp16 with --strategy {strategy}: its loss scale skips a step only "
            "when every rank agrees, which needs ranks that step together (--strategy allreduce)"
        )
    method = canonical_name(config.sync.compression.method)
    if method not in STATELESS and not config.sync.replicas.enabled:
        raise GradmeshError(
            f"--precision fp16 with --compression {method}: the gradients it compresses are "
            "scaled and may overflow, and its state (error feedback's residual, PowerSGD's Q) "
            "would keep that Inf so that every later step is skipped; use --precision bf16, or "
            f"--compression {' or '.join(STATELESS[1:])}"
        )


def _check_layout(config: TrainConfig) -> None:
    layout, strategy = config.layout, config.sync.strategy
    shape = MeshShape.for_world(config.job.workers, **layout.mesh_sizes())
    if layout.split and strategy not in SPLIT_LAYOUTS:
        raise GradmeshError(
            f"strategy {strategy} needs the whole model on every worker; with "
            f"--tensor-, --pipeline-, --context- or --expert-parallel use "
            f"{' or '.join(sorted(SPLIT_LAYOUTS))}"
        )
    if (shape.cp > 1 or shape.ep > 1) and strategy != "allreduce":
        raise GradmeshError(
            f"--context-parallel and --expert-parallel need --strategy allreduce: their ranks "
            f"average gradients every step (strategy {strategy} does not)"
        )
    if layout.plan and (strategy != "allreduce" or shape.pp > 1):
        raise GradmeshError(
            "--plan places layers over data and tensor parallelism: it needs --strategy "
            "allreduce and no --pipeline-parallel"
        )
    if layout.activation_checkpointing:
        every_of(layout.activation_checkpointing)
    if layout.precision == "fp16":
        _check_fp16(config)
    if layout.precision == "fp8":  # the layout first: its line holds on any machine
        check_fp8(shape.tp, shape.pp, layout.plan)
    check_precision(layout.precision)
    if layout.compile:
        check_compile(shape.pp, layout.plan)
    check_sequence_parallel(layout.sequence_parallel, shape.tp, shape.pp)
    stage = config.sync.allreduce.zero_stage
    check_context_layout(layout, shape.pp, stage)
    check_expert_layout(layout, shape.pp, stage)
    check_stage(
        stage,
        shape.pp,
        strategy,
        config.sync.compression.method,
        plan=bool(layout.plan),
        tensorboard=bool(config.output.tensorboard),
    )
    if config.checkpoint.reshard:
        _check_reshard(config, shape.pp)
    if layout.stages and shape.pp == 1:
        raise GradmeshError("--stages cuts a pipeline: use it with --pipeline-parallel > 1")
    if config.job.emulate_compute_ms and (shape.split != shape.pp or layout.plan):
        raise GradmeshError(
            "--emulate-compute-ms spreads one step's compute over the model's whole layers: "
            "it needs every worker to hold whole layers (data parallel or --pipeline-parallel; "
            "no other splitting axis, no --plan)"
        )
    _check_microbatches(config, shape)


def _check_reshard(config: TrainConfig, pp: int) -> None:
    """One line unless --reshard can move this run's checkpoints between layouts."""
    problem = ""
    if not config.checkpoint.dir:
        problem = "it needs --checkpoint-dir"
    elif config.sync.strategy != "allreduce" or pp > 1:
        problem = (
            "it moves synchronous data x tensor-parallel state (--strategy allreduce, "
            "no --pipeline-parallel)"
        )
    elif config.sync.compression.method != "none":
        problem = "compression keeps state per fusion bucket, which another layout cuts otherwise"
    if problem:
        raise GradmeshError(f"--reshard: {problem}")


def _check_microbatches(config: TrainConfig, shape: MeshShape) -> None:
    m, batch = config.layout.microbatches, config.data.batch_size
    if m < 1:
        raise GradmeshError(f"--microbatches must be >= 1, got {m}")
    if m > 1 and shape.pp == 1:
        raise GradmeshError(
            "--microbatches streams a pipeline: use it with --pipeline-parallel > 1"
        )
    if shape.pp > 1:
        check_schedule(config.layout.schedule, shape.pp, m, config.layout.virtual_stages)
    per_replica = batch // shape.dp
    if m > 1 and batch % (shape.dp * m):
        fits = [k for k in range(1, per_replica + 1) if per_replica % k == 0 and k <= 64]
        raise GradmeshError(
            f"global batch {batch} over {shape.dp} replicas cannot be cut into {m} equal "
            f"micro-batches; --microbatches that fit: {', '.join(map(str, fits))}"
        )


def _check_checkpoints(config: TrainConfig) -> None:
    ck = config.checkpoint
    if ck.every is not None and ck.every < 1:
        raise GradmeshError(f"--checkpoint-every must be >= 1 step, got {ck.every}")
    if ck.every is not None and not ck.dir:
        raise GradmeshError("--checkpoint-every needs --checkpoint-dir to write to")
    if ck.keep < 1:
        raise GradmeshError(f"--keep-checkpoints must be >= 1, got {ck.keep}")
    if ck.max_restarts < 0:
        raise GradmeshError(f"--max-restarts must be >= 0, got {ck.max_restarts}")
    sync = config.sync
    if sync.strategy == "ps" and sync.ps.mode != "sync" and (ck.dir or ck.max_restarts):
        raise GradmeshError(
            "checkpoints and restarts of a ps job need --mode sync: asynchronous servers "
            "and workers never stand at one step that a checkpoint could hold"
        )
