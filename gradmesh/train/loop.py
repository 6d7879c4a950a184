"""The training loop: steps of the engine from the step after the checkpoint to the last, with
the epoch's progress, checkpoints every N steps or epoch, and TensorBoard's per-step scalars."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from itertools import islice

import torch
from tqdm import tqdm

from gradmesh.collectives import allreduce
from gradmesh.data import Split
from gradmesh.data.prefetch import prefetched
from gradmesh.observe.timeline import span
from gradmesh.runtime.process import cpu_jiffies, idle_since
from gradmesh.runtime.world import Runtime
from gradmesh.sync.sharded.optimizer import optimizer_state_dict
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig
from gradmesh.train.evaluation import Evaluator, evaluate
from gradmesh.train.faults import Fault, injected_fault
from gradmesh.train.loss_scale import update
from gradmesh.train.rank_stats import KINDS
from gradmesh.train.setup import Job, model_of


@dataclass
class Clock:
    """Seconds of local computation, excluding time spent in collectives."""

    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    """Samples trained on by all replicas together in this run (from the reduced loss counts)."""
    steps: int = 0
    """Steps this rank took in this run."""
    cpu_idle: float = 0.0
    """The machine's idle CPU share over this rank's training loop."""
    steady_s: float = 0.0
    """Seconds from the end of the first `WARMUP_STEPS` steps to the end of the loop (0 for a
    run that short), less the steps of a batch size not seen before (an epoch's short last
    batch: compiled and autotuned again, once): the rate without start-up (allocator,
    autotuning, compilation)."""
    steady_samples: int = 0
    """Samples every replica together trained on in those seconds."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """--eval-every: per scoring, the step, the training seconds before it (scoring excluded),
    the test loss and accuracy."""


WARMUP_STEPS = 5
"""Steps a run takes before its steady rate is timed (`Clock.steady_s`)."""


def last_step(config: TrainConfig, steps: int) -> int:
    """The step the run ends after: the last epoch's last, or `--max-steps`."""
    last = config.job.epochs * steps
    return min(last, config.job.max_steps) if config.job.max_steps else last


def _progress(config: TrainConfig, steps: int, rt: Runtime) -> tqdm | None:
    if rt.rank != 0 or not sys.stderr.isatty():
        return None
    return tqdm(total=last_step(config, steps), unit="step", dynamic_ncols=True, leave=False)


def _reduce_losses(pending: list[torch.Tensor], clock: Clock) -> None:
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


def _checkpoint(
    job: Job, clock: Clock, pending: list[torch.Tensor], step: int, loss_sum: torch.Tensor
) -> None:
    """Save every piece of this rank's state after `step` steps (every rank at the same step;
    the pending epoch losses are reduced first, so the history saved is the world's)."""
    assert job.checkpointer is not None and job.sharder is not None
    _reduce_losses(pending, clock)
    started = time.perf_counter()  # the stall: the servers' parts (ps) are written from here
    epoch, offset = divmod(step, job.sharder.steps_per_epoch())
    state = {
        "model": job.split.module.state_dict(),
        "optimizer": optimizer_state_dict(job.optimizer),
        "strategy": job.strategy.state_dict(),
        "rng": checkpoint.rng_state(),
        "layout": checkpoint.layout_record(job.split.module, job.optimizer),
        **({"loss_scale": job.loss_scale.state_dict()} if job.loss_scale else {}),
        **({"replicas": job.replica_saves()} if job.replica_saves else {}),
        "progress": {
            "loss_sum": loss_sum.cpu(),
            "losses": torch.tensor(clock.losses, dtype=torch.float64, device="cpu"),
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


@dataclass
class _Run:
    """One run of the loop on this rank: the clock, the step count and what it reports on."""

    job: Job
    clock: Clock
    bar: tqdm | None
    fault: Fault | None
    step: int
    samples: int = 0
    """Samples this replica trained on in this run."""
    pending: list[torch.Tensor] = field(default_factory=list)
    """Per-epoch (loss sum, count) not yet summed over the ranks."""
    started: float = field(default_factory=time.perf_counter)
    cpu_before: tuple[int, int] = field(default_factory=cpu_jiffies)
    steady_from: tuple[float, int] | None = None
    """When the steady rate's clock started, and the samples trained by then."""
    sizes_seen: set[int] = field(default_factory=set)
    """Batch sizes this run has stepped on (a new one is compiled and autotuned afresh)."""
    unsteady: tuple[float, int] = (0.0, 0)
    """Seconds and samples of the steps after `steady_from` on a batch size not seen before:
    left out of the steady rate (`Clock.steady_s`)."""
    scoring_s: float = 0.0
    """Seconds spent scoring the test split (--eval-every), left out of `Clock.evals`' times."""

    def score(self) -> None:
        """--eval-every: the test split's loss and accuracy now (a collective: every rank)."""
        job = self.job
        started = time.perf_counter()
        with span("evaluate", "compute", step=self.step):
            score = evaluate(job.split, job.data.test, job.rt)
        if score is not None:
            self.clock.evals.append(
                {
                    "step": self.step,
                    "seconds": started - self.started - self.scoring_s,
                    "test_loss": score.loss,
                    "test_accuracy": score.accuracy,
                }
            )
        self.scoring_s += time.perf_counter() - started

    def one_step(self, part: Split, global_count: int, sums: torch.Tensor) -> None:
        """Forward, backward and the update of one global batch's slice (`part`, this
        replica's samples as read); adds this replica's (loss sum, count) to `sums` (zeros on
        ranks that do not hold the replica's loss), on the device: nothing in the step waits
        for the GPU."""
        job, rt, clock = self.job, self.job.rt, self.clock
        if rt.timeline is not None:
            rt.timeline.new_step()
        kinds_before = dict(rt.comm.by_kind) if job.metrics is not None else {}
        fresh = self.steady_from is not None and len(part) not in self.sizes_seen
        if fresh:  # timed alone, to leave out of the steady rate (once per batch size)
            rt.synchronize()
        comm_before, step_started = rt.comm.comm_s, time.perf_counter()
        self.sizes_seen.add(len(part))
        part = part.to(rt.device)
        x, y = part.x, part.y
        job.optimizer.zero_grad(set_to_none=False)
        scaled = job.loss_scale.weight if job.loss_scale else 1.0
        loss = job.split.engine.step(x, y, job.replicas / global_count * scaled)
        if self.fault is not None and self.fault.kind == "slow":
            self.fault.check(job.place[0], self.step)
        update(job.optimizer, job.loss_scale)
        if job.warmup is not None:
            job.warmup.step()
        wall, comm = time.perf_counter() - step_started, rt.comm.comm_s - comm_before
        clock.compute_s += wall - comm
        clock.steps += 1
        self.step += 1
        self.after_step(wall, comm, kinds_before, loss, len(part))
        if job.split.owns_output:
            sums[0] += loss
            sums[1] += len(part)
        if fresh:
            rt.synchronize()
            seconds, samples = self.unsteady
            self.unsteady = (seconds + time.perf_counter() - step_started, samples + len(part))

    def after_step(
        self, wall: float, comm: float, kinds: dict[str, int], loss: torch.Tensor, count: int
    ) -> None:
        job = self.job
        if job.metrics is not None:
            _step_scalars(job, self.step, wall, comm, kinds, loss, count)
        if self.clock.steps == 1:
            job.first_step_at = time.time()
        self.samples += count
        if self.clock.steps == WARMUP_STEPS:
            job.rt.synchronize()  # once: the clock starts when the GPU has done the warm-up
            self.steady_from = (time.perf_counter(), self.samples)
        if self.bar is not None:
            self.bar.update(1)
        if job.progress is not None:
            job.progress.reached(self.step)
        if self.fault is not None and self.fault.kind == "kill":
            self.fault.check(job.place[0], self.step)

    def end_epoch(self, epoch: int, loss_sum: torch.Tensor) -> None:
        job = self.job
        self.pending.append(loss_sum)
        own_loss = float(loss_sum[0] / loss_sum[1]) if loss_sum[1] else None
        rate_samples = self.samples * job.replicas
        _report_epoch(epoch, job.config, own_loss, rate_samples, self.started, self.bar, job.rt)
        if job.config.output.tensorboard:
            _epoch_accuracy(job, self.step)

    def close(self) -> tuple[Clock, int, float]:
        job = self.job
        if job.loss_scale is not None:
            scale = job.loss_scale
            job.split.info["loss_scale"] = {"scale": scale.scale, "skipped_steps": scale.skipped}
        if self.steady_from is not None:
            job.rt.synchronize()
            seconds, samples = self.unsteady
            self.clock.steady_s = time.perf_counter() - self.steady_from[0] - seconds
            self.clock.steady_samples = (
                self.samples - self.steady_from[1] - samples
            ) * job.replicas
        _reduce_losses(self.pending, self.clock)
        if job.checkpointer is not None:
            job.checkpointer.close()  # the last write, if it was asynchronous
        if job.progress is not None:
            job.progress.close()
        if self.bar is not None:
            self.bar.close()
        self.clock.cpu_idle = idle_since(self.cpu_before)
        return self.clock, self.samples, time.perf_counter() - self.started


def reader(job: Job) -> tuple[Callable[[torch.Tensor], Split], bool]:
    """How the loop reads a step's samples: gathered from the training split and, for a GPU,
    page-locked; and whether the next step's are read on a background thread while this one
    trains (`gradmesh.data.prefetch`). Ahead where the samples come from disk, and wherever
    the step runs on a GPU: there the gather is host work that the step's kernel launches
    would wait behind. On an H200 it took 12 ms of a compiled GPT step's 42, against a plain
    loop's 24 (scripts/gpu_step.py --profile --compile, docs/gpu.md). On a CPU the gather is
    a small part of a step and a thread would take a core from it."""
    device, train = job.rt.device, job.data.train

    def read(indices: torch.Tensor) -> Split:
        part: Split = train.rows(indices).pinned(device)
        return part

    return read, bool(getattr(train, "lazy", False)) or device.type == "cuda"


def loop(job: Job) -> tuple[Clock, int, float]:
    """Train from the step after the checkpoint to the last; returns the clock, the samples
    this replica trained on, and the wall time."""
    config, sharder = job.config, job.sharder
    assert sharder is not None, "attach(job) first"
    steps = sharder.steps_per_epoch()
    last = last_step(config, steps)
    run = _Run(
        job,
        Clock(losses=job.losses),
        _progress(config, steps, job.rt),
        injected_fault(),
        job.start_step,
    )
    if run.bar is not None:
        run.bar.update(min(job.start_step, last))
    first_epoch, skip = divmod(job.start_step, steps)
    device = job.rt.device
    read, ahead = reader(job)

    def fetch(item: tuple[int, tuple[torch.Tensor, int]]) -> Split:
        return read(item[1][0])

    for epoch in range(first_epoch, config.job.epochs):
        fresh = torch.zeros(2, dtype=torch.float64, device=device)
        loss_sum = job.loss_sum.to(device) if skip and job.loss_sum is not None else fresh
        batches = islice(enumerate(sharder.batches(epoch)), skip, None)  # skip: done before
        with closing(prefetched(batches, fetch, ahead)) as parts:  # the reader ends with the loop
            for (k, (_, global_count)), part in parts:
                if run.step >= last:  # --max-steps
                    break
                run.one_step(part, global_count, loss_sum)
                end_of_epoch = k == steps - 1 or run.step == last  # a cut epoch reports its part
                if end_of_epoch:
                    run.end_epoch(epoch, loss_sum)
                    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
                if config.job.eval_every and run.step % config.job.eval_every == 0:
                    run.score()
                if _due(config, run.step, end_of_epoch, last):
                    with span("checkpoint", "io", step=run.step):
                        _checkpoint(job, run.clock, run.pending, run.step, loss_sum)
        skip = 0
        if run.step >= last:
            break
    return run.close()


def _epoch_accuracy(job: Job, step: int) -> None:
    """After an epoch, with --tensorboard: the test accuracy, scored by the writer in the
    background where it holds the whole model, by every rank at once (a collective) where
    the model is split."""
    shape = job.rt.mesh.shape
    if shape.tp * shape.pp > 1:
        score = evaluate(job.split, job.data.test, job.rt)
        if job.metrics is not None and score is not None:
            job.metrics.scalars(step, {"accuracy/test": score.accuracy})
    elif job.metrics is not None:
        if job.evaluator is None:
            config, data = job.config, job.data
            job.evaluator = Evaluator(lambda: model_of(config, data), data, job.metrics)
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
