"""Resuming: every rank's part of the newest complete checkpoint (model, optimizer, strategy
state, RNG, position), and the check before launch that it belongs to this run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from gradmesh.collectives import allreduce
from gradmesh.errors import GradmeshError, first_line
from gradmesh.runtime.axes import TP
from gradmesh.runtime.world import collective_device
from gradmesh.train import checkpoint
from gradmesh.train.config import TrainConfig
from gradmesh.train.optimizers import build_optimizer
from gradmesh.train.setup import Job, elastic_world, load_data, model_of


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
    model = model_of(config, load_data(config))
    optimizer = build_optimizer(config.optimizer, model.parameters(), config.optimizer.lr)

    servers = (
        config.sync.ps.servers if config.sync.strategy == "ps" else 0
    )  # parts 0..S-1 are shards

    def usable(meta: checkpoint.Meta) -> None:
        moved = _resharding(config, meta)
        parted = config.sync.allreduce.zero_stage and config.layout.pipeline_parallel == 1
        if moved or parted:  # shards: check them put together (a pipeline's stages: per rank)
            weights, saved = checkpoint.whole_state(meta)  # fits the whole model, before launch
            problem = checkpoint.model_problem(weights, model)
            if problem is not None:
                raise GradmeshError(
                    f"checkpoint {meta.checkpoint} does not fit this run: {problem}"
                )
            entries = checkpoint.part_for((weights, saved), model, optimizer, 1, 0)[1]
            _load_optimizer(optimizer, entries, meta.checkpoint)
            return
        for rank in range(meta.world):
            fits = model if whole and rank >= servers else None
            state = checkpoint.read_rank(meta.checkpoint, rank, fits)
            if fits is not None and rank == servers:
                path = checkpoint.rank_file(meta.checkpoint, rank)
                _load_optimizer(optimizer, state["optimizer"], path)

    checkpoint.choose(config.checkpoint.dir, config.resume_identity(), usable)


def _restore(job: Job, meta: checkpoint.Meta) -> tuple[torch.Tensor, list[float]]:
    """Load this rank's part of `meta`'s checkpoint into the model, optimizer and strategy (a
    GradmeshError naming the file when it does not fit); returns the epoch's loss sum so far and
    the loss history.

    An elastic job resumes with another number of replicas, all holding the same state (see
    `TrainConfig.check_elastic`): rank r loads rank (r mod the old world)'s part, and its RNG;
    rank 0 carries the world's epoch loss sum."""
    rank, world, _ = job.place
    moved = _resharding(job.config, meta)
    if meta.world != world and elastic_world() is None and not moved:
        raise checkpoint.ForeignCheckpoint(
            f"checkpoint {meta.checkpoint} belongs to another run: world={meta.world} (now {world})"
        )
    source = rank % meta.world
    path = checkpoint.rank_file(meta.checkpoint, source)
    state = checkpoint.read_rank(meta.checkpoint, source, None if moved else job.split.module)
    if moved:  # --reshard: this rank's part of the whole state, cut for its layout
        tp = job.rt.mesh[TP]
        whole = checkpoint.whole_state(meta)
        model, optimizer = checkpoint.part_for(
            whole, job.split.module, job.optimizer, tp.size, tp.index
        )
        # no compression under --reshard: its per-bucket states hold nothing but their sizes,
        # which this layout's buckets have otherwise; the counters carry over, where both
        # layouts keep them (FSDP2 keeps none)
        fresh = job.strategy.state_dict()
        kept = {k: v for k, v in state["strategy"].items() if k in fresh and k != "compressor"}
        strategy = {**fresh, **kept}
        state = {**state, "model": model, "optimizer": optimizer, "strategy": strategy}
        problem = checkpoint.model_problem(model, job.split.module)
        if problem is not None:
            raise GradmeshError(f"checkpoint {meta.checkpoint} does not fit this run: {problem}")
    loss_sum = state["progress"].get("loss_sum")
    if meta.world != world:
        total = _epoch_loss(meta) if rank == 0 else [0.0, 0.0]
        loss_sum = None if total is None else torch.tensor(total, dtype=torch.float64, device="cpu")
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.shape != (2,):
        raise GradmeshError(f"checkpoint {path} does not fit this run: no epoch loss sum")
    losses = state["progress"].get("losses")  # this rank's history: a ps worker's is its own
    if losses is not None and (not isinstance(losses, torch.Tensor) or losses.dim() != 1):
        raise GradmeshError(f"checkpoint {path} does not fit this run: 'losses' is not a list")
    try:
        checkpoint.load_model(job.split.module, state["model"])
    except (GradmeshError, RuntimeError, KeyError) as exc:
        raise GradmeshError(f"checkpoint {path} does not fit this run: {first_line(exc)}") from None
    _load_optimizer(
        job.optimizer, checkpoint.optimizer_state(job.optimizer, state["optimizer"]), path
    )
    _load_steps_state(job, state, path)
    job.replica_state = state.get("replicas")  # a replica group's own, taken by its loop
    history = meta.losses if losses is None else losses.tolist()
    return loss_sum.to(torch.float64), history


def _load_steps_state(job: Job, state: dict[str, Any], path: Path) -> None:
    """The strategy's state, the random generators and fp16's loss scale, from `state`."""
    try:
        job.strategy.load_state_dict(state["strategy"])
        checkpoint.restore_rng(state["rng"])
        if job.loss_scale is not None:
            if "loss_scale" not in state:
                raise GradmeshError("no loss scale (not written by a --precision fp16 run)")
            job.loss_scale.load_state_dict(state["loss_scale"])
    except GradmeshError as exc:
        raise GradmeshError(f"checkpoint {path} does not fit this run: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise GradmeshError(
            f"checkpoint {path} does not fit this run: strategy state: {first_line(exc)}"
        ) from None


def _resharding(config: TrainConfig, meta: checkpoint.Meta) -> bool:
    """Whether `meta`'s checkpoint was saved at another layout, which --reshard resumes from
    (without it, the identity check has refused another layout already)."""
    layout = config.layout
    now = (config.job.workers, layout.tensor_parallel, layout.pipeline_parallel)
    return config.checkpoint.reshard and checkpoint.saved_layout(meta) != (
        *now,
        config.sync.allreduce.zero_stage,
    )


def _epoch_loss(meta: checkpoint.Meta) -> list[float] | None:
    """The world's (loss sum, count) of the epoch under way: saved by an elastic job, else the
    sum of every rank file's own."""
    if meta.epoch_loss is not None or meta.identity.get("strategy") == "ps":
        return meta.epoch_loss
    sums = [
        checkpoint.read_rank(meta.checkpoint, r)["progress"]["loss_sum"] for r in range(meta.world)
    ]
    return [float(sum(s[0] for s in sums)), float(sum(s[1] for s in sums))]


def _agree(ok: bool) -> bool:
    """Whether every rank's `ok` is True (a collective)."""
    failed = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=collective_device())
    allreduce(failed, op="sum", kind="metrics")
    return bool(failed[0] == 0)


def resume(job: Job) -> None:
    """Every rank loads its part of the newest checkpoint that every rank can use (after the
    strategy's wrapping: its state, compressor residuals included, is part of it), and the
    run continues at the step after it; the learning-rate warm-up is replayed to there."""
    config, rt = job.config, job.rt
    if config.checkpoint.dir:
        chosen = checkpoint.choose(
            config.checkpoint.dir, config.resume_identity(), lambda m: _restore(job, m), _agree
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
