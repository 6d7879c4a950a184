"""The one training loop every strategy and layout runs in, on every rank.

`train` is four parts: `setup` (data, the model split by the layout, the optimizer over this
rank's parameters, the strategy's wrapping, in that order), `resume` (the newest checkpoint),
`loop` (epochs of `engine.step`), `finish` (evaluation through the same engine, the report).

Per step each replica computes the summed loss of its slice of the global batch, scaled by
replicas / global batch size: after gradient averaging over the `dp` axis this is exactly the
mean loss over the global batch, so the job takes the step one worker with the whole batch would.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from gradmesh.collectives import allreduce
from gradmesh.data import DATASETS, DataOptions, DataSpec, GlobalBatchSharder, Split
from gradmesh.layout import Split as ModelSplit
from gradmesh.layout import split_model
from gradmesh.models import build_model
from gradmesh.runtime import Runtime
from gradmesh.timeline import start_timeline
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig, parse_shape
from gradmesh.train.optimizers import build_optimizer
from gradmesh.train.report import KINDS, RunReport, gather_rank_stats
from gradmesh.train.schedule import gradual_warmup, scaled_lr
from gradmesh.train.strategies import STRATEGIES, Strategy


@dataclass
class _Clock:
    """Seconds of local computation, excluding time spent in collectives."""

    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    """Samples trained on by all replicas together in this run (from the reduced loss counts)."""
    steps: int = 0
    """Steps this rank took in this run."""


def load_data(config: TrainConfig) -> DataSpec:
    options = DataOptions(
        shape=parse_shape(config.synthetic_shape),
        classes=config.synthetic_classes,
        samples=config.synthetic_samples,
    )
    return DATASETS.get(config.dataset)(options)


def _identity(config: TrainConfig) -> dict[str, object]:
    keys = ("model", "dataset", "batch_size", "seed", "strategy", "synthetic_shape", "optimizer")
    return {k: getattr(config, k) for k in keys}


def check_resume(config: TrainConfig) -> None:
    """Before launch: the checkpoint a run would resume from loads into this run's model and
    optimizer, or one line says why not."""
    if config.checkpoint_dir and (found := checkpoint.latest(config.checkpoint_dir)):
        model = build_model(config.model, load_data(config))
        optimizer = build_optimizer(config, model.parameters(), config.lr)
        checkpoint.load(found, model, optimizer, _identity(config))


def check_layout(config: TrainConfig) -> None:
    """Before launch: the layout can split this model (its plan, its layers), or one line."""
    from gradmesh.layout import check_layout as check

    check(
        build_model(config.model, load_data(config)),
        config.model,
        config.tensor_parallel,
        config.pipeline_parallel,
        config.stages,
    )


def evaluate(split: ModelSplit, data: Split, rt: Runtime) -> float:
    """Accuracy over the whole split, each replica scoring its own slice through the engine;
    only the rank that holds a replica's logits counts them."""
    mine = torch.tensor_split(torch.arange(len(data)), rt.dp.size)[rt.dp.index]
    split.module.eval()
    logits = split.engine.predict(data.x[mine].to(rt.device))
    split.module.train()
    counts = torch.zeros(2, dtype=torch.float64)
    if split.owns_output and logits is not None:
        correct = (logits.argmax(dim=1).cpu() == data.y[mine]).sum()
        counts += torch.tensor([float(correct), float(len(mine))], dtype=torch.float64)
    allreduce(counts, kind="metrics")
    return float(counts[0] / counts[1])


def _progress(config: TrainConfig, steps: int, rt: Runtime) -> tqdm | None:
    if rt.rank != 0 or not sys.stderr.isatty():
        return None
    return tqdm(total=config.epochs * steps, unit="step", dynamic_ncols=True, leave=False)


def _reduce_losses(pending: list[torch.Tensor], clock: _Clock) -> None:
    """Sum the pending epochs' losses over the world in one collective and record their means
    (ranks that do not hold their replica's loss add zeros).

    Done at checkpoints and at the end, not every epoch: asynchronous strategies (Hogwild!)
    would otherwise wait for the slowest worker at every epoch boundary.
    """
    if not pending:
        return
    sums = torch.stack(pending)
    allreduce(sums, kind="metrics")
    clock.losses.extend((sums[:, 0] / sums[:, 1]).tolist())
    clock.samples += int(sums[:, 1].sum())
    pending.clear()


def _report_epoch(
    epoch: int,
    config: TrainConfig,
    own_loss: float | None,
    samples: int,
    started: float,
    bar: tqdm | None,
    rt: Runtime,
) -> None:
    """Progress after an epoch, from rank 0's own loss (the global mean comes in the report;
    a pipeline's first stage has none)."""
    elapsed = time.perf_counter() - started
    rate = samples / elapsed if elapsed > 0 else 0.0
    if bar is not None:
        bar.set_postfix(
            epoch=f"{epoch + 1}/{config.epochs}",
            loss="n/a" if own_loss is None else f"{own_loss:.4f}",
            samples_s=f"{rate:.0f}",
        )
    elif rt.rank == 0:
        print(
            f"epoch {epoch + 1}/{config.epochs}  "
            + ("" if own_loss is None else f"rank-0 loss {own_loss:.4f}  ")
            + f"{rate:.0f} samples/s",
            file=sys.stderr,
            flush=True,
        )


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
    warmup: LRScheduler | None = None
    first_epoch: int = 0
    losses: list[float] = field(default_factory=list)


def setup(config: TrainConfig, rt: Runtime) -> Job:
    """Data, the model split by the layout (tensor, then pipeline), the optimizer over this
    rank's own parameters, the strategy's wrapping: in that order, on every rank."""
    torch.manual_seed(config.seed)
    if config.timeline:
        start_timeline(config.timeline)
    data = load_data(config)
    whole = build_model(config.model, data).to(rt.device)  # the same on every rank (the seed)
    split = split_model(
        whole,
        config.model,
        rt,
        config.microbatches,
        config.schedule,
        config.stages,
        data.train.x[:1].to(rt.device),
    )
    lr = scaled_lr(
        config.lr, config.lr_scaling, rt.dp.size, config.batch_size, config.reference_batch or None
    )
    optimizer = build_optimizer(config, split.module.parameters(), lr)
    strategy = STRATEGIES.get(config.strategy)(config)
    return Job(config, rt, data, split, optimizer, strategy, lr)


def resume(job: Job) -> None:
    """Load the newest checkpoint, if the run has a checkpoint folder with one (before the
    strategy wraps the optimizer: every replica then starts from the first one's state)."""
    config = job.config
    if config.checkpoint_dir and (found := checkpoint.latest(config.checkpoint_dir)):
        job.first_epoch, job.losses = checkpoint.load(
            found, job.split.module, job.optimizer, _identity(config)
        )


def attach(job: Job) -> None:
    """The strategy's wrapping, this replica's data shard, the learning-rate warm-up."""
    config = job.config
    job.optimizer = job.strategy.prepare(job.split.module, job.optimizer, job.rt)
    index, job.replicas = job.strategy.shard(job.rt)
    job.sharder = GlobalBatchSharder(
        len(job.data.train), config.batch_size, index, job.replicas, config.seed
    )
    steps = job.sharder.steps_per_epoch()
    factor = job.lr / config.lr
    job.warmup = gradual_warmup(job.optimizer, round(config.warmup_epochs * steps), factor)
    if job.warmup is not None:  # a resumed run continues its warm-up where it was
        for _ in range(job.first_epoch * steps):
            job.warmup.step()


def loop(job: Job) -> tuple[_Clock, int, float]:
    """Train the remaining epochs; returns the clock, the samples this replica trained on, and
    the wall time."""
    config, rt, split, sharder = job.config, job.rt, job.split, job.sharder
    assert sharder is not None, "attach(job) first"
    steps = sharder.steps_per_epoch()
    bar = _progress(config, steps, rt)
    if bar is not None:
        bar.update(job.first_epoch * steps)
    clock = _Clock(losses=job.losses)
    started = time.perf_counter()
    samples = 0
    pending: list[torch.Tensor] = []  # per-epoch (loss sum, count) not yet summed over ranks
    for epoch in range(job.first_epoch, config.epochs):
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for indices, global_count in sharder.batches(epoch):
            comm_before = rt.comm.comm_s
            step_started = time.perf_counter()
            x = job.data.train.x[indices].to(rt.device)
            y = job.data.train.y[indices].to(rt.device)
            job.optimizer.zero_grad(set_to_none=False)
            loss = split.engine.step(x, y, job.replicas / global_count)
            if config.emulate_compute_ms:
                time.sleep(config.emulate_compute_ms / 1000)  # labelled emulation (benchmarks)
            job.optimizer.step()
            if job.warmup is not None:
                job.warmup.step()
            clock.compute_s += time.perf_counter() - step_started - (rt.comm.comm_s - comm_before)
            clock.steps += 1
            if split.owns_output:
                loss_sum += torch.tensor([float(loss), float(len(indices))], dtype=torch.float64)
            samples += len(indices)
            if bar is not None:
                bar.update(1)
        pending.append(loss_sum)
        own_loss = float(loss_sum[0] / loss_sum[1]) if loss_sum[1] else None
        _report_epoch(epoch, config, own_loss, samples * job.replicas, started, bar, rt)
        if config.checkpoint_dir:
            _reduce_losses(pending, clock)
            if rt.rank == 0:
                checkpoint.save(
                    config.checkpoint_dir,
                    epoch + 1,
                    split.module,
                    job.optimizer,
                    _identity(config),
                    clock.losses,
                )
    _reduce_losses(pending, clock)
    if bar is not None:
        bar.close()
    return clock, samples, time.perf_counter() - started


def layout_figures(job: Job, steps: int) -> dict[str, float]:
    """What this rank holds, what it sent per step by kind over `steps` steps, and as a pipeline
    stage its compute seconds per step and idle fraction: the report's figures, and
    `gradmesh bench layout`'s (`summarize_layout` makes them one)."""
    rt, split = job.rt, job.split
    state = [
        v
        for entry in job.optimizer.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    ]
    steps = max(steps, 1)
    engine_clock = getattr(split.engine, "clock", None)
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in split.module.parameters()),
        "optimizer_bytes": sum(v.numel() * v.element_size() for v in state),
        **{f"{kind}_bytes_per_step": rt.comm.by_kind.get(kind, 0) / steps for kind in KINDS},
        "compression_given_bytes_per_step": rt.comm.compressed.get("sync", [0, 0])[0] / steps,
        "compression_sent_bytes_per_step": rt.comm.compressed.get("sync", [0, 0])[1] / steps,
        "stage_busy_s": engine_clock.busy_s / steps if engine_clock is not None else 0.0,
        "stage_idle": engine_clock.idle() if engine_clock is not None else 0.0,
    }


def finish(job: Job, clock: _Clock, samples: int, wall_s: float) -> tuple[RunReport, bool]:
    """Bring the final model here (asynchronous strategies), evaluate, build the report."""
    job.strategy.finish(samples, wall_s)
    accuracy = evaluate(job.split, job.data.test, job.rt)
    stats = gather_rank_stats(job.rt, clock.compute_s, layout_figures(job, clock.steps))
    shape = job.rt.mesh.shape
    report = RunReport.build(
        job.config,
        job.replicas * shape.tp * shape.pp,  # worker processes (replicas for ps, one per worker)
        job.strategy.report(),
        accuracy,
        clock.losses,
        wall_s,
        clock.samples,
        stats,
        job.split.info,
    )
    return report, job.strategy.writes_report(job.rt)


def train(config: TrainConfig, rt: Runtime) -> tuple[RunReport, bool]:
    """Train `config` on this rank of `rt`; return the report (the same on every rank of a
    synchronous job) and whether this process is the one that prints and writes it."""
    job = setup(config, rt)
    resume(job)
    attach(job)
    clock, samples, wall_s = loop(job)
    return finish(job, clock, samples, wall_s)
