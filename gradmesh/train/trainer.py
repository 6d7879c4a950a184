"""The one training loop every strategy and layout runs in, on every rank.

`train` is five parts: `setup` (data, the model split by the layout, the optimizer over this
rank's parameters), `attach` (the strategy's wrapping, the data shard), `resume` (every rank's
part of the newest complete checkpoint: model, optimizer, strategy state, RNG, position),
`loop` (steps of `engine.step`, checkpoints every N steps or epoch), `finish` (evaluation
through the same engine, the report).

Per step each replica computes the summed loss of its slice of the global batch, scaled by
replicas / global batch size: after gradient averaging over the `dp` axis this is exactly the
mean loss over the global batch, so the job takes the step one worker with the whole batch would.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from gradmesh.collectives import allreduce
from gradmesh.data import DATASETS, DataOptions, DataSpec, GlobalBatchSharder, Split
from gradmesh.errors import GradmeshError, first_line
from gradmesh.layout.engine import Split as ModelSplit
from gradmesh.layout.engine import split_model
from gradmesh.layout.hybrid import load_plan
from gradmesh.models.registry import build_model
from gradmesh.observe.metrics import Metrics
from gradmesh.observe.timeline import span, start_timeline
from gradmesh.options import with_value
from gradmesh.runtime.process import MAX_WORLD_ENV, cpu_jiffies, idle_since, restarts
from gradmesh.runtime.world import Runtime
from gradmesh.sync.data_parallel.optimizer import is_distributed
from gradmesh.sync.strategies import STRATEGIES, Strategy
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig
from gradmesh.train.emulated import emulate_compute
from gradmesh.train.faults import injected_fault
from gradmesh.train.optimizers import build_optimizer
from gradmesh.train.report import KINDS, RunReport, gather_rank_stats
from gradmesh.train.schedule import gradual_warmup, scaled_lr
from gradmesh.units import parse_shape


@dataclass
class _Clock:
    """Seconds of local computation, excluding time spent in collectives."""

    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    """Samples trained on by all replicas together in this run (from the reduced loss counts)."""
    steps: int = 0
    """Steps this rank took in this run."""
    cpu_idle: float = 0.0
    """The machine's idle CPU share over this rank's training loop."""


def load_data(config: TrainConfig) -> DataSpec:
    options = DataOptions(
        shape=parse_shape(config.data.synthetic_shape),
        classes=config.data.synthetic_classes,
        samples=config.data.synthetic_samples,
    )
    return DATASETS.get(config.data.dataset)(options)


def _load_optimizer(optimizer: Optimizer, saved: dict[str, object], path: object) -> None:
    try:
        optimizer.load_state_dict(saved)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise GradmeshError(
            f"checkpoint {path} does not fit this run: optimizer state: {first_line(exc)}"
        ) from None


def check_resume(config: TrainConfig) -> None:
    """Before launch: the checkpoint a run would resume from belongs to this run and its rank
    files load (into this run's model and optimizer, for a model every rank holds whole), or
    one line says why not; a broken newest checkpoint falls back to the one before it."""
    if not config.checkpoint.dir:
        return
    whole = config.layout.tensor_parallel * config.layout.pipeline_parallel == 1
    model = build_model(config.data.model, load_data(config))
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.optimizer.lr)

    servers = (
        config.sync.ps.servers if config.sync.strategy == "ps" else 0
    )  # parts 0..S-1 are shards

    def usable(meta: checkpoint.Meta) -> None:
        for rank in range(meta.world):
            fits = model if whole and rank >= servers else None
            state = checkpoint.read_rank(meta.checkpoint, rank, fits)
            if fits is not None and rank == servers:
                path = checkpoint.rank_file(meta.checkpoint, rank)
                _load_optimizer(optimizer, state["optimizer"], path)

    checkpoint.choose(config.checkpoint.dir, config.identity(), usable)


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

    check(
        build_model(config.data.model, load_data(config)),
        config.data.model,
        config.layout.tensor_parallel,
        config.layout.pipeline_parallel,
        config.layout.stages,
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
    return tqdm(total=config.job.epochs * steps, unit="step", dynamic_ncols=True, leave=False)


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
            epoch=f"{epoch + 1}/{config.job.epochs}",
            loss="n/a" if own_loss is None else f"{own_loss:.4f}",
            samples_s=f"{rate:.0f}",
        )
    elif rt.rank == 0:
        print(
            f"epoch {epoch + 1}/{config.job.epochs}  "
            + ("" if own_loss is None else f"rank-0 loss {own_loss:.4f}  ")
            + f"{rate:.0f} samples/s",
            file=sys.stderr,
            flush=True,
        )


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
    evaluator: _Evaluator | None = None


def setup(config: TrainConfig, rt: Runtime) -> Job:
    """Data, the model split by the layout (tensor, then pipeline), the optimizer over this
    rank's own parameters, the strategy's wrapping: in that order, on every rank."""
    torch.manual_seed(config.job.seed)
    most = elastic_world()
    if most is not None and rt.dp.size < most:  # fewer replicas, the same global batch
        accumulate = accumulation(config.data.batch_size, rt.dp.size, most)
        config = with_value(config, ("layout", "microbatches"), accumulate)
    if config.output.timeline:
        _start_timeline(config, rt)
    data = load_data(config)
    whole = build_model(config.data.model, data).to(rt.device)  # the same on every rank (the seed)
    if config.job.emulate_compute_ms:  # labelled emulation (benchmarks): the model is whole here
        emulate_compute(whole, data.train.x[:1], config.job.emulate_compute_ms)
    split = split_model(
        whole,
        config.data.model,
        rt,
        config.layout.microbatches,
        config.layout.schedule,
        config.layout.stages,
        data.train.x[:1].to(rt.device),
        load_plan(config.layout.plan) if config.layout.plan else None,
    )
    lr = scaled_lr(  # an elastic job's rate is that of its full membership: the same steps
        config.optimizer.lr,
        config.optimizer.lr_scaling,
        most or rt.dp.size,
        config.data.batch_size,
        config.optimizer.reference_batch or None,
    )
    optimizer = build_optimizer(config.optimizer, split.module.parameters(), lr)
    strategy = STRATEGIES.get(config.sync.strategy)(
        config.sync, config.layout.microbatches, config.job.timeout_s
    )
    return Job(config, rt, data, split, optimizer, strategy, lr)


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


def _restore(job: Job, meta: checkpoint.Meta) -> tuple[torch.Tensor, list[float]]:
    """Load this rank's part of `meta`'s checkpoint into the model, optimizer and strategy (a
    GradmeshError naming the file when it does not fit); returns the epoch's loss sum so far and
    the loss history.

    An elastic job resumes with another number of replicas, all holding the same state (see
    `TrainConfig.check_elastic`): rank r loads rank (r mod the old world)'s part, and its RNG;
    rank 0 carries the world's epoch loss sum."""
    rank, world, _ = job.place
    if meta.world != world and elastic_world() is None:
        raise checkpoint.ForeignCheckpoint(
            f"checkpoint {meta.checkpoint} belongs to another run: world={meta.world} (now {world})"
        )
    source = rank % meta.world
    path = checkpoint.rank_file(meta.checkpoint, source)
    state = checkpoint.read_rank(meta.checkpoint, source, job.split.module)
    loss_sum = state["progress"].get("loss_sum")
    if meta.world != world:
        total = meta.epoch_loss if rank == 0 else [0.0, 0.0]
        loss_sum = None if total is None else torch.tensor(total, dtype=torch.float64)
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.shape != (2,):
        raise GradmeshError(f"checkpoint {path} does not fit this run: no epoch loss sum")
    losses = state["progress"].get("losses")  # this rank's history: a ps worker's is its own
    if losses is not None and (not isinstance(losses, torch.Tensor) or losses.dim() != 1):
        raise GradmeshError(f"checkpoint {path} does not fit this run: 'losses' is not a list")
    job.split.module.load_state_dict(state["model"])
    _load_optimizer(job.optimizer, state["optimizer"], path)
    try:
        job.strategy.load_state_dict(state["strategy"])
        checkpoint.restore_rng(state["rng"])
    except GradmeshError as exc:
        raise GradmeshError(f"checkpoint {path} does not fit this run: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise GradmeshError(
            f"checkpoint {path} does not fit this run: strategy state: {first_line(exc)}"
        ) from None
    history = meta.losses if losses is None else losses.tolist()
    return loss_sum.to(torch.float64), history


def _agree(ok: bool) -> bool:
    """Whether every rank's `ok` is True (a collective)."""
    failed = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    allreduce(failed, op="sum", kind="metrics")
    return bool(failed[0] == 0)


def resume(job: Job) -> None:
    """Every rank loads its part of the newest checkpoint that every rank can use (after the
    strategy's wrapping: its state, compressor residuals included, is part of it), and the
    run continues at the step after it; the learning-rate warm-up is replayed to there."""
    config, rt = job.config, job.rt
    if config.checkpoint.dir:
        chosen = checkpoint.choose(
            config.checkpoint.dir, config.identity(), lambda m: _restore(job, m), _agree
        )
        if chosen is not None:
            meta, (job.loss_sum, job.losses) = chosen
            job.start_step = meta.step
            job.membership = [list(change) for change in meta.membership]
        changed = not job.membership or job.membership[-1][1] != rt.size
        if elastic_world() is not None and changed:
            job.membership.append([job.start_step, rt.size])
        rank, world, writer = job.place
        if rank == writer:
            job.progress = checkpoint.Progress(config.checkpoint.dir)
            job.redone = job.progress.resumed_at(job.start_step)
        job.checkpointer = checkpoint.Checkpointer(
            config.checkpoint.dir,
            rank,
            world,
            config.identity(),
            config.checkpoint.keep,
            config.checkpoint.asynchronous,
            config.job.timeout_s,
            writer,
        )
    if job.warmup is not None:  # a resumed run continues its warm-up where it was
        for _ in range(job.start_step):
            job.warmup.step()


def _checkpoint(
    job: Job, clock: _Clock, pending: list[torch.Tensor], step: int, loss_sum: torch.Tensor
) -> None:
    """Save every piece of this rank's state after `step` steps (every rank at the same step;
    the pending epoch losses are reduced first, so the history saved is the world's)."""
    assert job.checkpointer is not None and job.sharder is not None
    _reduce_losses(pending, clock)
    started = time.perf_counter()  # the stall: the servers' parts (ps) are written from here
    epoch, offset = divmod(step, job.sharder.steps_per_epoch())
    state = {
        "model": job.split.module.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "strategy": job.strategy.state_dict(),
        "rng": checkpoint.rng_state(),
        "progress": {
            "loss_sum": loss_sum.clone(),
            "losses": torch.tensor(clock.losses, dtype=torch.float64),
        },
    }
    extra = None
    if job.membership:  # an elastic job: what a world of another size resumes from
        world_sum = loss_sum.clone()
        allreduce(world_sum, kind="metrics")
        extra = {"epoch_loss": world_sum.tolist(), "membership": job.membership}
    job.checkpointer.save(
        step, epoch, offset, clock.losses, clock.samples, state, extra, since=started
    )


def _due(config: TrainConfig, step: int, end_of_epoch: bool, last: int) -> bool:
    """Whether a checkpoint is written after `step`: every N steps, or after every epoch, and
    after the last step."""
    if not config.checkpoint.dir:
        return False
    every = config.checkpoint.every
    return step == last or (step % every == 0 if every else end_of_epoch)


def loop(job: Job) -> tuple[_Clock, int, float]:
    """Train from the step after the checkpoint to the last; returns the clock, the samples
    this replica trained on, and the wall time."""
    config, rt, split, sharder = job.config, job.rt, job.split, job.sharder
    assert sharder is not None, "attach(job) first"
    steps = sharder.steps_per_epoch()
    last = config.job.epochs * steps
    bar = _progress(config, steps, rt)
    if bar is not None:
        bar.update(min(job.start_step, last))
    clock = _Clock(losses=job.losses)
    fault = injected_fault()
    started, cpu_before = time.perf_counter(), cpu_jiffies()
    samples, step = 0, job.start_step
    pending: list[torch.Tensor] = []  # per-epoch (loss sum, count) not yet summed over ranks
    first_epoch, skip = divmod(job.start_step, steps)
    for epoch in range(first_epoch, config.job.epochs):
        fresh = torch.zeros(2, dtype=torch.float64)
        loss_sum = job.loss_sum if skip and job.loss_sum is not None else fresh
        for k, (indices, global_count) in enumerate(sharder.batches(epoch)):
            if k < skip:  # done before the checkpoint this run resumed from
                continue
            if rt.timeline is not None:
                rt.timeline.new_step()
            if job.metrics is not None:
                kinds_before = dict(rt.comm.by_kind)
            comm_before = rt.comm.comm_s
            step_started = time.perf_counter()
            x = job.data.train.x[indices].to(rt.device)
            y = job.data.train.y[indices].to(rt.device)
            job.optimizer.zero_grad(set_to_none=False)
            loss = split.engine.step(x, y, job.replicas / global_count)
            if fault is not None and fault.kind == "slow":
                fault.check(job.place[0], step)
            if is_distributed(job.optimizer):  # it spans its update itself, not its wait
                job.optimizer.step()
            else:
                with span("step"):
                    job.optimizer.step()
            if job.warmup is not None:
                job.warmup.step()
            wall, comm = time.perf_counter() - step_started, rt.comm.comm_s - comm_before
            clock.compute_s += wall - comm
            clock.steps += 1
            step += 1
            if job.metrics is not None:
                _step_scalars(job, step, wall, comm, kinds_before, loss, len(indices))
            if clock.steps == 1:
                job.first_step_at = time.time()
            if split.owns_output:
                loss_sum += torch.tensor([float(loss), float(len(indices))], dtype=torch.float64)
            samples += len(indices)
            if bar is not None:
                bar.update(1)
            if job.progress is not None:
                job.progress.reached(step)
            if fault is not None and fault.kind == "kill":
                fault.check(job.place[0], step)
            end_of_epoch = k == steps - 1
            if end_of_epoch:
                pending.append(loss_sum)
                own_loss = float(loss_sum[0] / loss_sum[1]) if loss_sum[1] else None
                _report_epoch(epoch, config, own_loss, samples * job.replicas, started, bar, rt)
                loss_sum = torch.zeros(2, dtype=torch.float64)
                if config.output.tensorboard:
                    _epoch_accuracy(job, step)
            if _due(config, step, end_of_epoch, last):
                with span("checkpoint", "io", step=step):
                    _checkpoint(job, clock, pending, step, loss_sum)
        skip = 0
    _reduce_losses(pending, clock)
    if job.checkpointer is not None:
        job.checkpointer.close()  # the last write, if it was asynchronous
    if job.progress is not None:
        job.progress.close()
    if bar is not None:
        bar.close()
    clock.cpu_idle = idle_since(cpu_before)
    return clock, samples, time.perf_counter() - started


class _Evaluator:
    """The test accuracy after each epoch, for TensorBoard, off the training path: the writer
    (holding the whole model) keeps a copy of its parameters after each epoch and scores the
    copies once training ends. Scoring in the step loop cost the default job 13 % of its step
    time, and on a thread of its own (niced or not) 14-19 %, its CPU taken from the ranks'
    (gradmesh bench observe, 2 cores): so the per-epoch curve appears at the end of the run."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.kept: list[tuple[int, dict[str, torch.Tensor]]] = []

    def after(self, step: int, module: torch.nn.Module) -> None:
        self.kept.append(
            (step, {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()})
        )

    def close(self) -> None:
        """Score every copy and write its accuracy at its step."""
        job = self.job
        assert job.metrics is not None
        model = build_model(job.config.data.model, job.data).eval()
        test = job.data.test
        for step, state in self.kept:
            model.load_state_dict(state)
            correct = 0
            with torch.no_grad():
                for i in range(0, len(test), 512):
                    logits = model(test.x[i : i + 512])
                    correct += int((logits.argmax(dim=1) == test.y[i : i + 512]).sum())
            job.metrics.scalars(step, {"accuracy/test": correct / max(len(test), 1)})
        self.kept.clear()


def _epoch_accuracy(job: Job, step: int) -> None:
    """After an epoch, with --tensorboard: the test accuracy, scored by the writer in the
    background where it holds the whole model, by every rank at once (a collective) where
    the model is split."""
    shape = job.rt.mesh.shape
    if shape.tp * shape.pp > 1:
        accuracy = evaluate(job.split, job.data.test, job.rt)
        if job.metrics is not None:
            job.metrics.scalars(step, {"accuracy/test": accuracy})
    elif job.metrics is not None:
        if job.evaluator is None:
            job.evaluator = _Evaluator(job)
        job.evaluator.after(step, job.split.module)


def _step_scalars(
    job: Job,
    step: int,
    wall: float,
    comm: float,
    kinds_before: dict[str, int],
    loss: torch.Tensor,
    count: int,
) -> None:
    """The step's scalars, in one event: this rank's loss, the job's samples/s, the learning
    rate, seconds and bytes sent by kind."""
    assert job.metrics is not None
    by_kind = job.rt.comm.by_kind
    sent = {k: v - kinds_before.get(k, 0) for k, v in by_kind.items()}
    values = {
        "throughput/samples_per_s": job.replicas * count / wall if wall > 0 else 0.0,
        "lr": float(job.optimizer.param_groups[0]["lr"]),
        "time/step_s": wall,
        "time/comm_s": comm,
        "time/compute_s": wall - comm,
        "bytes/total": float(sum(sent.values())),
        **{f"bytes/{k}": float(sent.get(k, 0)) for k in KINDS},
    }
    if job.split.owns_output and count:
        values["loss/rank0_step"] = float(loss) / count
    job.metrics.scalars(step, values)


def _run_scalars(job: Job, report: RunReport, steps: int) -> None:
    """What is known at the end: the world's mean loss per epoch, the test accuracy, a ps job's
    staleness histogram and request rates, Hogwild!'s updates, restarts."""
    metrics = job.metrics or Metrics(job.config.output.tensorboard or "", f".report{job.place[0]}")
    per_epoch = job.sharder.steps_per_epoch() if job.sharder is not None else 1
    for epoch, loss in enumerate(report.loss_history):
        metrics.scalars((epoch + 1) * per_epoch, {"loss/epoch_mean": loss})
    info = report.strategy_info
    values = {"accuracy/test_final": report.test_accuracy, "job/restarts": float(restarts())}
    if "updates_applied" in info:
        values["hogwild/updates_applied"] = float(info["updates_applied"])
    for server in info.get("server_stats", []):
        values[f"ps/request_rate_server{server['server']}"] = server["request_rate"]
    metrics.scalars(steps, values)
    merged: dict[int, int] = {}
    for counts in info.get("staleness_histogram", {}).values():
        for gap, n in counts.items():
            merged[int(gap)] = merged.get(int(gap), 0) + int(n)
    metrics.histogram("ps/staleness", merged, steps)
    metrics.close()


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
        _faults(job),
        clock.steps,
        clock.cpu_idle,
    )
    if job.evaluator is not None:
        job.evaluator.close()
    writes = job.strategy.writes_report(job.rt)
    if job.config.output.tensorboard and writes:
        _run_scalars(job, report, job.start_step + clock.steps)
    elif job.metrics is not None:
        job.metrics.close()
    return report, writes


def _faults(job: Job) -> dict[str, object]:
    """Restarts, the steps they redid, and what this rank's checkpoints cost."""
    if not job.config.checkpoint.dir and not job.config.checkpoint.max_restarts:
        return {}
    saves = job.checkpointer.stats.summary() if job.checkpointer is not None else {}
    return {
        "restarts": restarts(),
        "steps_redone": job.redone,
        "resumed_from_step": job.start_step,
        "first_step_unix_s": job.first_step_at,
        "checkpoint_async": job.config.checkpoint.asynchronous,
        **{f"checkpoint_{k}": v for k, v in saves.items()},
        **({"membership": job.membership} if job.membership else {}),
    }


def train(config: TrainConfig, rt: Runtime) -> tuple[RunReport, bool]:
    """Train `config` on this rank of `rt`; return the report (the same on every rank of a
    synchronous job) and whether this process is the one that prints and writes it."""
    job = setup(config, rt)
    attach(job)
    resume(job)
    clock, samples, wall_s = loop(job)
    return finish(job, clock, samples, wall_s)
