"""The one training loop every strategy runs in, on every rank.

Per step each rank computes the summed loss of its slice of the global batch, scaled by
world / global batch size: after gradient averaging this is exactly the mean loss over the global
batch, so W workers take the same step one worker with the whole batch would.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from gradmesh.collectives import allreduce
from gradmesh.data import DATASETS, DataOptions, DataSpec, GlobalBatchSharder, Split
from gradmesh.models import build_model
from gradmesh.runtime import Runtime
from gradmesh.timeline import span, start_timeline
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig, parse_shape
from gradmesh.train.report import RunReport, gather_rank_stats
from gradmesh.train.schedule import gradual_warmup, scaled_lr
from gradmesh.train.strategies import STRATEGIES


@dataclass
class _Clock:
    """Seconds of local computation, excluding time spent in collectives."""

    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    """Samples trained on by all ranks together in this run (from the reduced loss counts)."""


def load_data(config: TrainConfig) -> DataSpec:
    options = DataOptions(
        shape=parse_shape(config.synthetic_shape),
        classes=config.synthetic_classes,
        samples=config.synthetic_samples,
    )
    return DATASETS.get(config.dataset)(options)


def _identity(config: TrainConfig) -> dict[str, object]:
    keys = ("model", "dataset", "batch_size", "seed", "strategy", "synthetic_shape")
    return {k: getattr(config, k) for k in keys}


def build_optimizer(config: TrainConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def check_resume(config: TrainConfig) -> None:
    """Before launch: the checkpoint a run would resume from loads into this run's model and
    optimizer, or one line says why not."""
    if config.checkpoint_dir and (found := checkpoint.latest(config.checkpoint_dir)):
        model = build_model(config.model, load_data(config))
        checkpoint.load(found, model, build_optimizer(config, model, config.lr), _identity(config))


def evaluate(model: nn.Module, split: Split, rt: Runtime) -> float:
    """Accuracy over the whole split, each rank scoring its own slice."""
    mine = torch.tensor_split(torch.arange(len(split)), rt.size)[rt.rank]
    model.eval()
    with torch.no_grad():
        logits = model(split.x[mine].to(rt.device))
        correct = (logits.argmax(dim=1).cpu() == split.y[mine]).sum()
    model.train()
    counts = torch.tensor([float(correct), float(len(mine))], dtype=torch.float64)
    allreduce(counts)
    return float(counts[0] / counts[1])


def _progress(config: TrainConfig, steps: int, rt: Runtime) -> tqdm | None:
    if rt.rank != 0 or not sys.stderr.isatty():
        return None
    return tqdm(total=config.epochs * steps, unit="step", dynamic_ncols=True, leave=False)


def _reduce_losses(pending: list[torch.Tensor], clock: _Clock) -> None:
    """Sum the pending epochs' losses over the ranks in one collective and record their means.

    Done at checkpoints and at the end, not every epoch: asynchronous strategies (Hogwild!)
    would otherwise wait for the slowest worker at every epoch boundary.
    """
    if not pending:
        return
    sums = torch.stack(pending)
    allreduce(sums)
    clock.losses.extend((sums[:, 0] / sums[:, 1]).tolist())
    clock.samples += int(sums[:, 1].sum())
    pending.clear()


def _report_epoch(
    epoch: int,
    config: TrainConfig,
    own_loss: float,
    samples: int,
    started: float,
    bar: tqdm | None,
    rt: Runtime,
) -> None:
    """Progress after an epoch, from rank 0's own loss (the global mean comes in the report)."""
    elapsed = time.perf_counter() - started
    rate = samples / elapsed if elapsed > 0 else 0.0
    if bar is not None:
        bar.set_postfix(
            epoch=f"{epoch + 1}/{config.epochs}", loss=f"{own_loss:.4f}", samples_s=f"{rate:.0f}"
        )
    elif rt.rank == 0:
        print(
            f"epoch {epoch + 1}/{config.epochs}  rank-0 loss {own_loss:.4f}  {rate:.0f} samples/s",
            file=sys.stderr,
            flush=True,
        )


def train(config: TrainConfig, rt: Runtime) -> tuple[RunReport, bool]:
    """Train `config` on this rank of `rt`; return the report (the same on every rank of a
    synchronous job) and whether this process is the one that prints and writes it."""
    torch.manual_seed(config.seed)
    if config.timeline:
        start_timeline(config.timeline)
    data = load_data(config)
    model = build_model(config.model, data).to(rt.device)
    lr = scaled_lr(
        config.lr, config.lr_scaling, rt.size, config.batch_size, config.reference_batch or None
    )
    optimizer = build_optimizer(config, model, lr)
    first_epoch, losses = 0, list[float]()
    if config.checkpoint_dir and (found := checkpoint.latest(config.checkpoint_dir)):
        first_epoch, losses = checkpoint.load(found, model, optimizer, _identity(config))
    strategy = STRATEGIES.get(config.strategy)(config)
    optimizer = strategy.prepare(model, optimizer, rt)
    index, count = strategy.shard(rt)
    sharder = GlobalBatchSharder(len(data.train), config.batch_size, index, count, config.seed)
    warmup = gradual_warmup(
        optimizer, round(config.warmup_epochs * sharder.steps_per_epoch()), lr / config.lr
    )
    if warmup is not None:  # a resumed run continues its warm-up where it was
        for _ in range(first_epoch * sharder.steps_per_epoch()):
            warmup.step()
    bar = _progress(config, sharder.steps_per_epoch(), rt)
    if bar is not None:
        bar.update(first_epoch * sharder.steps_per_epoch())
    clock = _Clock(losses=losses)
    started = time.perf_counter()
    samples = 0
    pending: list[torch.Tensor] = []  # per-epoch (loss sum, count) not yet summed over ranks
    for epoch in range(first_epoch, config.epochs):
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for indices, global_count in sharder.batches(epoch):
            comm_before = rt.comm.comm_s
            step_started = time.perf_counter()
            x = data.train.x[indices].to(rt.device)
            y = data.train.y[indices].to(rt.device)
            with span("forward"):
                loss = F.cross_entropy(model(x), y, reduction="sum")
            if config.emulate_compute_ms:
                time.sleep(config.emulate_compute_ms / 1000)  # labelled emulation (benchmarks)
            optimizer.zero_grad(set_to_none=False)
            (loss * (count / global_count)).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if warmup is not None:
                warmup.step()
            clock.compute_s += time.perf_counter() - step_started - (rt.comm.comm_s - comm_before)
            loss_sum += torch.tensor([loss.item(), float(len(indices))], dtype=torch.float64)
            samples += len(indices)
            if bar is not None:
                bar.update(1)
        pending.append(loss_sum)
        own_loss = float(loss_sum[0] / loss_sum[1])
        _report_epoch(epoch, config, own_loss, samples * count, started, bar, rt)
        if config.checkpoint_dir:
            _reduce_losses(pending, clock)
            if rt.rank == 0:
                checkpoint.save(
                    config.checkpoint_dir,
                    epoch + 1,
                    model,
                    optimizer,
                    _identity(config),
                    clock.losses,
                )
    _reduce_losses(pending, clock)
    wall_s = time.perf_counter() - started
    if bar is not None:
        bar.close()
    strategy.finish(samples, wall_s)
    accuracy = evaluate(model, data.test, rt)
    stats = gather_rank_stats(rt, clock.compute_s)
    report = RunReport.build(
        config, count, strategy.report(), accuracy, clock.losses, wall_s, clock.samples, stats
    )
    return report, strategy.writes_report(rt)
