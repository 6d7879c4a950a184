"""Setting a rank up: data, the model made parallel by the recipe (`gradmesh.train.recipe`), the
optimizer over this rank's own parameters (`setup`), then the strategy's wrapping, the data
shard and the learning-rate warm-up (`attach`); and the checks that build the model before
launch."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

import gradmesh.data.batch as batch
from gradmesh.compression.config import CompressionConfig
from gradmesh.data import DATASETS, DataOptions, DataSpec, GlobalBatchSharder, Split
from gradmesh.data.batch import Batch
from gradmesh.data.registry import is_scheme, is_token_dataset
from gradmesh.errors import GradmeshError
from gradmesh.layout.engine import Split as ModelSplit
from gradmesh.layout.loss import Summed, summed
from gradmesh.layout.memory import checkpoint_blocks
from gradmesh.models.devices import device_peak
from gradmesh.models.flops import flops_per_sample, measured_peak_flops
from gradmesh.models.hf import pretrained_source
from gradmesh.models.registry import build_model
from gradmesh.observe.metrics import Metrics
from gradmesh.observe.timeline import start_timeline
from gradmesh.options import with_value
from gradmesh.registry import import_path, parse_kwargs
from gradmesh.runtime.axes import TP
from gradmesh.runtime.process import MAX_WORLD_ENV, restarts
from gradmesh.runtime.world import Runtime
from gradmesh.sync.sharded.optimizer import shard_optimizer
from gradmesh.sync.strategies import STRATEGIES, Strategy
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig
from gradmesh.train.emulated import emulate_compute
from gradmesh.train.evaluation import Evaluator, has_classes
from gradmesh.train.loss_scale import DynamicLossScale
from gradmesh.train.optimizers import build_optimizer
from gradmesh.train.pretrained import init_skeleton, needs_whole, read_pretrained, read_whole
from gradmesh.train.recipe import parallelize
from gradmesh.train.schedule import gradual_warmup, scaled_lr
from gradmesh.units import parse_shape


def load_data(config: TrainConfig) -> DataSpec:
    options = DataOptions(
        shape=parse_shape(config.data.synthetic_shape),
        classes=config.data.synthetic_classes,
        samples=config.data.synthetic_samples,
        sequence=config.data.sequence_length,
    )
    name = config.data.dataset
    if ":" in name and not is_scheme(name):  # the user's factory
        factory = cast(Callable[[], object], DATASETS.get(name))  # takes no options
        return user_data(name, factory())
    return DATASETS.get(name)(options)


def user_data(name: str, made: object) -> DataSpec:
    """What a user's dataset factory returned, as a `DataSpec`: one itself, or x_train,
    y_train, x_test, y_test, each a tensor or a tuple, list or dict of tensors with the samples
    first (`gradmesh.data.batch`: a model's several inputs, a loss's several targets; classes,
    where the targets are one tensor of class ids: the largest id + 1)."""
    if isinstance(made, DataSpec):
        return made
    if not isinstance(made, tuple | list) or len(made) != 4:
        raise GradmeshError(
            f"dataset {name} returned a {type(made).__name__}; expected a gradmesh DataSpec or "
            "(x_train, y_train, x_test, y_test), each a tensor or a tuple, list or dict of them"
        )
    xt, yt, xs, ys = made
    what = ("x_train", "y_train", "x_test", "y_test")
    for w, b in zip(what, made, strict=True):  # one line on anything but tensors
        batch.leaves(b, f"{w} of dataset {name}")
    sizes = [batch.size(b) for b in made]
    if sizes[0] != sizes[1] or sizes[2] != sizes[3]:
        raise GradmeshError(f"dataset {name}: inputs and targets differ in length")
    train, test = Split(xt, yt), Split(xs, ys)
    classes = int(max(int(yt.max()), int(ys.max()))) + 1 if has_classes(train) else 0
    return DataSpec(train, test, tuple(batch.leaves(xt)[0].shape[1:]), classes)


def first_input(data: DataSpec) -> Batch:
    """The first training sample's input (a batch of one): what a model is traced on."""
    return data.train.rows(slice(0, 1)).x


def model_of(config: TrainConfig, data: DataSpec) -> torch.nn.Module:
    """The whole model the job trains (the same on every rank under the job's seed); with
    `--init-from`, its skeleton, to read those weights (`gradmesh.train.pretrained`)."""
    d = config.data
    args = parse_kwargs(d.model_args, "--model-args")
    if d.init_from:
        return init_skeleton(
            lambda: build_model(d.model, data, args), d.init_from, d.model, d.model_args
        )
    return build_model(d.model, data, args)


def loss_of(config: TrainConfig) -> Summed:
    """The job's loss in the engines' form (`gradmesh.layout.loss`): the user's
    `fn(outputs, targets)`, the batch's mean, or the default cross-entropy."""
    if not config.data.loss:
        return summed(None)
    return summed(import_path(config.data.loss, "loss"), config.data.loss)


def elastic_world() -> int | None:
    """The most workers an elastic job (`--nnodes MIN:MAX`) can have; None for a fixed job."""
    raw = os.environ.get(MAX_WORLD_ENV)
    return int(raw) if raw else None


def accumulation(global_batch: int, replicas: int, most: int) -> int:
    """Micro-batches per step for each of `replicas` so that none computes on more samples at
    once than with `most` replicas: an elastic job keeps its global batch, and its memory, when
    replicas are lost."""
    return math.ceil(math.ceil(global_batch / replicas) / math.ceil(global_batch / most))


def check_layout(config: TrainConfig) -> None:
    """Before launch: the layout can split this model (its plan, its layers), or one line."""
    from gradmesh.layout.engine import check_layout as check

    data = load_data(config)
    model = model_of(config, data)
    place = "meta" if pretrained_source(model) else "cpu"  # a skeleton runs on the meta device
    if config.layout.activation_checkpointing:
        checkpoint_blocks(model, config.layout.activation_checkpointing, config.data.model)
    if config.data.loss:  # the user's loss must give a scalar: tried on two samples
        with torch.no_grad():
            two = data.train.rows(slice(0, 2)).to(place)
            loss_of(config)(batch.call(model, two.x), two.y)
    check(model, config.data.model, config.layout, data.train.rows(slice(0, 1)).to(place).x)


def _start_timeline(config: TrainConfig, rt: Runtime) -> None:
    """This process's timeline: in the job's merged trace (unless per rank) under its launcher
    rank, a ps worker's after the servers'; a restarted job marks the restart."""
    from gradmesh.sync.parameter_server.roles import worker_role

    pid, name = rt.rank, f"rank {rt.rank}"
    role = worker_role() if config.sync.strategy == "ps" else None
    if role is not None:
        pid, name = config.sync.ps.servers + role.index, f"worker {role.index}"
    merged = not config.output.timeline_per_rank
    assert config.output.timeline is not None
    start_timeline(config.output.timeline, merged, config.output.timeline_steps, pid, name)
    if restarts():
        rt.timeline.instant("restart", attempt=restarts())


@dataclass
class Job:
    """Everything `setup` builds for one rank, which the other parts use."""

    config: TrainConfig
    rt: Runtime
    data: DataSpec
    split: ModelSplit
    optimizer: Optimizer
    strategy: Strategy
    lr: float
    sharder: GlobalBatchSharder | None = None
    replicas: int = 1
    """The data-parallel replicas this rank's batch slice is one of (set by `attach`)."""
    place: tuple[int, int, int] = (0, 1, 0)
    """(rank, world, writer) of this process in the checkpoints (set by `attach`)."""
    warmup: LRScheduler | None = None
    start_step: int = 0
    """Steps done before this run started (from the checkpoint it resumed from)."""
    losses: list[float] = field(default_factory=list)
    loss_sum: torch.Tensor | None = None
    """This rank's (loss sum, count) of the epoch under way at the checkpoint."""
    checkpointer: checkpoint.Checkpointer | None = None
    progress: checkpoint.Progress | None = None
    """Rank 0's record of the furthest step reached, for the steps a restart redoes."""
    redone: int = 0
    membership: list[list[int]] = field(default_factory=list)
    """An elastic job's [step, workers] each time its number of workers changed."""
    first_step_at: float = 0.0
    """Unix time at which this run's first step ended (a restart's first step)."""
    metrics: Metrics | None = None
    """With --tensorboard, on the process that writes per-step scalars (rank 0; a ps job's
    worker 0)."""
    evaluator: Evaluator | None = None
    loss_scale: DynamicLossScale | None = None
    """fp16's dynamic loss scale (`--precision fp16`)."""
    model_flops: tuple[float, float] = (0.0, 0.0)
    """A language model's forward + backward FLOPs per sample (torch's FLOP counter) and this
    worker's peak FLOP/s (`gradmesh.models.devices.device_peak`): what its MFU is made of."""
    replica_state: dict[str, Any] | None = None
    """What a replica group's checkpoint adds to every rank file (`replicas`: the cross-group
    average's compressor state, DiLoCo's outer state), as read at resume."""
    replica_saves: Callable[[], dict[str, Any]] | None = None
    """The same, for the checkpoint being written (set by the replica-group loop)."""
    replica_info: dict[str, Any] = field(default_factory=dict)
    """A replica group's figures (`gradmesh.train.replicated`): its quorum changes, the
    recoveries and aborted steps, for the report's strategy_info."""
    peak_source: str = ""
    """Where that peak came from: the device table's entry, --peak-tflops, measured on this CPU,
    or why it is unknown."""


def setup(config: TrainConfig, rt: Runtime) -> Job:
    """Data, the model split by the layout (tensor, then pipeline), the optimizer over this
    rank's own parameters, the strategy's wrapping: in that order, on every rank."""
    torch.manual_seed(config.job.seed)
    most = elastic_world()
    if most is not None and rt.batch.size < most:  # fewer replicas, the same global batch
        accumulate = accumulation(config.data.batch_size, rt.batch.size, most)
        config = with_value(config, ("layout", "microbatches"), accumulate)
    if config.output.timeline:
        _start_timeline(config, rt)
    data = load_data(config)
    whole = model_of(config, data)  # the same on every rank (the seed)
    source = pretrained_source(whole)  # a pretrained model's skeleton: weights read once cut
    if source is None or needs_whole(whole, config.layout.pipeline_parallel):
        read_whole(whole, rt.device)
        source = None
        whole = whole.to(rt.device)
    if config.job.emulate_compute_ms:  # labelled emulation (benchmarks): the model is whole here
        per_pass = config.job.emulate_compute_ms / config.layout.microbatches
        emulate_compute(whole, first_input(data), per_pass)
    split = parallelize(  # the recipe: tp, recomputation, compile, pipeline cut, sharding
        whole,
        config.layout,
        example=batch.to(first_input(data), rt.device),
        loss_fn=loss_of(config),
        zero_stage=config.sync.allreduce.zero_stage,
        name=config.data.model,
        rt=rt,
    )
    if source is not None:  # this rank's part of the pretrained weights, as the layout cut it
        tp = rt.mesh[TP]
        read_pretrained(split.module, source, rt.device, (tp.size, tp.index))
    lr = scaled_lr(  # an elastic job's rate is that of its full membership: the same steps
        config.optimizer.lr,
        config.optimizer.lr_scaling,
        most or rt.batch.size,
        config.data.batch_size,
        config.optimizer.reference_batch or None,
    )
    optimizer = build_optimizer(config.optimizer, split.module.parameters(), lr)
    optimizer = shard_optimizer(optimizer, config.sync.allreduce.zero_stage, rt)  # ZeRO 1
    sync = config.sync
    if sync.replicas.enabled:  # --compression (and DiLoCo) is for the slow link, across groups
        sync = replace(sync, strategy="allreduce", compression=CompressionConfig())
    strategy = STRATEGIES.get(sync.strategy)(
        sync, split.engine.backward_passes, config.job.timeout_s
    )
    job = Job(config, rt, data, split, optimizer, strategy, lr)
    if config.layout.precision == "fp16":
        job.loss_scale = DynamicLossScale()
    if is_token_dataset(config.data.dataset):
        _count_model_flops(job)
    return job


def _count_model_flops(job: Job) -> None:
    """What a language model's MFU is made of: its FLOPs per sample and this worker's peak
    (a GPU's from the device table or --peak-tflops; on CPU every worker measures at once)."""
    config = job.config
    flops = flops_per_sample(lambda: model_of(config, job.data), first_input(job.data))
    peak, job.peak_source = device_peak(
        job.rt.device, config.layout.precision, config.output.peak_tflops, measured_peak_flops
    )
    job.model_flops = (flops, peak)


def attach(job: Job) -> None:
    """The strategy's wrapping, this replica's data shard, the learning-rate warm-up."""
    config = job.config
    job.optimizer = job.strategy.prepare(job.split.module, job.optimizer, job.rt)
    index, job.replicas = job.strategy.shard(job.rt)
    job.place = job.strategy.place(job.rt)
    job.sharder = GlobalBatchSharder(
        len(job.data.train), config.data.batch_size, index, job.replicas, config.job.seed
    )
    steps = job.sharder.steps_per_epoch()
    factor = job.lr / config.optimizer.lr
    job.warmup = gradual_warmup(
        job.optimizer, round(config.optimizer.warmup_epochs * steps), factor
    )
    if config.output.tensorboard and job.place[0] == job.place[2]:
        job.metrics = Metrics(config.output.tensorboard, f".rank{job.place[0]}")
