"""The training loop of one replica group (`--replica-group G --lighthouse HOST:PORT`).

The job is R groups, each a `gradmesh train` job of its own (with data parallelism inside);
`gradmesh.sync.replicas` holds the quorum protocol. Per step this loop:
1. asks for the step's quorum (`ReplicaManager.start_step`); where a member is behind (a group
   restarted by its launcher, or a new one), every member takes part in the copy of the source
   group's state, and the group that was behind continues at the quorum's step;
2. takes its slice of the step's global batch: `keep` splits the whole global batch over the
   groups alive (the step is the one R groups would take), `rescale` keeps each group's own
   slice of R (the batch, and the loss's count, shrink with the groups);
3. runs the step through the same `_Run.one_step` as every other job; the optimizer's wrapper
   averages the gradients over the quorum (compressed by `--compression`; the group's own
   data-parallel allreduce is not) and commits, or raises `StepAborted`, and the same
   step is taken again with the next quorum.
The step's data depend only on the step, so a group that recovers at step S reads what the
others read at S. With --checkpoint-dir each group saves after committed steps into its own
folder (`TrainConfig.place_group_checkpoints`) and resumes from it; groups that resume at
different steps meet in the first quorum, where those behind copy the newest state.
At the last step the leader tells the lighthouse (`ReplicaManager.finish`); a group that asks
for a quorum after that (restarted too late to rejoin) ends at once, in a line.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.data import GlobalBatchSharder, Split
from gradmesh.runtime.world import Runtime, collective_device
from gradmesh.sync.replicas.averaging import CrossGroupAverage
from gradmesh.sync.replicas.diloco import CrossGroupDiLoCo
from gradmesh.sync.replicas.manager import Quorum, ReplicaManager, StepAborted
from gradmesh.sync.replicas.optimizer import ReplicaOptimizer
from gradmesh.sync.sharded.model import local
from gradmesh.sync.strategies import compressor
from gradmesh.train.faults import injected_fault
from gradmesh.train.loop import Clock, _checkpoint, _due, _progress, _Run, last_step
from gradmesh.train.setup import Job

Diloco = CrossGroupDiLoCo | None


def run_identity(job: Job) -> str:
    """What every group must share: the run's identity (model and its arguments, data, batch,
    seed, optimizer, workers, layout), readable in part and hashed in whole."""
    identity = {**job.config.identity(), "precision": job.config.layout.precision}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return (
        f"model {identity.get('model')} {identity.get('model_args') or ''}, "
        f"{identity.get('workers')} workers, batch {identity.get('batch_size')}, "
        f"{digest.hexdigest()[:12]}"
    )


def _slice(
    idx: torch.Tensor, quorum: Quorum, groups: int, group: int, keep: bool, dp: tuple[int, int]
) -> tuple[torch.Tensor, int, int]:
    """This rank's indices of the global batch `idx`, the samples the quorum trains on in all,
    and the replicas they are split over."""
    index, size = dp
    if keep:
        part = torch.tensor_split(idx, len(quorum.members))[quorum.index]
        live = len(idx)
    else:
        parts = torch.tensor_split(idx, groups)
        part = parts[group]
        live = sum(len(parts[g]) for g in quorum.members)
    return torch.tensor_split(part, size)[index], live, len(quorum.members) * size


def _batch(
    job: Job, order: torch.Tensor, k: int, quorum: Quorum, dp: tuple[int, int]
) -> tuple[Split, int]:
    """This rank's part of batch `k` of the epoch's `order` (`job.replicas` set to the replicas
    the quorum splits it over), and the samples the quorum trains on in all."""
    replicas, batch = job.config.sync.replicas, job.config.data.batch_size
    idx = order[k * batch : (k + 1) * batch]
    keep = replicas.on_lost_replica == "keep"
    groups, group = replicas.replica_groups, replicas.replica_group
    mine, live, job.replicas = _slice(idx, quorum, groups, group, keep, dp)
    part: Split = job.data.train.rows(mine).pinned(job.rt.device)
    return part, live


def _state(job: Job, step: int, manager: ReplicaManager, diloco: Diloco) -> dict[str, Any]:
    return {
        "averaging": manager.averaging.shared(),
        "diloco": diloco.state_dict() if diloco is not None else {},
        "model": job.split.module.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "strategy": job.strategy.state_dict(),
        "step": step,
        "losses": list(job.losses),
        "warmup": job.warmup.state_dict() if job.warmup is not None else {},
        "loss_scale": job.loss_scale.state_dict() if job.loss_scale is not None else {},
    }


def _load(job: Job, state: dict[str, Any], manager: ReplicaManager, diloco: Diloco) -> None:
    manager.averaging.load_shared(state["averaging"])
    job.split.module.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.strategy.load_state_dict(state["strategy"])
    if diloco is not None:  # the anchors and the outer optimizer, after the round's outer step
        diloco.load_state_dict(state["diloco"])
    job.losses[:] = state["losses"]
    if job.warmup is not None:  # the learning rate where the source's warm-up stands
        job.warmup.load_state_dict(state["warmup"])
    if job.loss_scale is not None:  # fp16: the source's scale, not a fresh one that overflows
        job.loss_scale.load_state_dict(state["loss_scale"])


def replicated_loop(job: Job) -> tuple[Clock, int, float, dict[str, Any]]:
    """Train to the last step as one of the replica groups; the clock, this replica's
    samples, the wall time, and the groups' figures for the report."""
    config, rt = job.config, job.rt
    dp = job.strategy.shard(rt)
    whole = GlobalBatchSharder(len(job.data.train), config.data.batch_size, 0, 1, config.job.seed)
    steps = whole.steps_per_epoch()
    last = last_step(config, steps)
    bar = _progress(config, steps, rt)
    run = _Run(job, Clock(losses=job.losses), bar, injected_fault(), job.start_step)
    manager = _manager(job)
    params = [p for p in job.split.module.parameters() if p.requires_grad]
    diloco = _diloco(job, params)
    _keep_in_checkpoints(job, manager, diloco)
    if diloco is None:  # every step averaged and committed by the optimizer
        job.optimizer = ReplicaOptimizer(
            job.optimizer, manager, params, lambda: run.step, job.loss_scale
        )
    loss_sum = torch.zeros(2, dtype=torch.float64, device=rt.device)
    if job.loss_sum is not None and job.start_step % steps:  # resumed mid-epoch
        loss_sum = job.loss_sum.to(rt.device)
    orders: dict[int, torch.Tensor] = {}
    began: float | None = None  # the first try of the step under way
    quorum: Quorum | None = None
    while run.step < last:
        began = time.perf_counter() if began is None else began
        if diloco is None or quorum is None or run.step % diloco.sync_every == 0:
            stepped = run.step
            quorum = _start(job, manager, run, diloco)
            if quorum is None:  # the run ended before this group could join (said in a line)
                break
            if run.step != stepped:  # behind: the newest state copied, at the quorum's step
                loss_sum.zero_()
                if run.step >= last:
                    break
        epoch, k = divmod(run.step, steps)
        order = orders.setdefault(epoch, whole.order(epoch))
        part, live = _batch(job, order, k, quorum, dp)
        try:
            run.one_step(part, live, loss_sum)
        except StepAborted:
            continue
        if diloco is not None:
            diloco.inner_step()
        manager.step_seconds[run.step - 1] = time.perf_counter() - began
        began = None
        end_of_epoch = k == steps - 1 or run.step == last
        if end_of_epoch:
            run.end_epoch(epoch, loss_sum)
            loss_sum = torch.zeros(2, dtype=torch.float64, device=rt.device)
            orders.pop(epoch, None)
        if _due(config, run.step, end_of_epoch, last):  # after the commit: every group's state
            _checkpoint(job, run.clock, run.pending, run.step, loss_sum)
    return _end(job, manager, run, diloco, params)


def _end(
    job: Job, manager: ReplicaManager, run: _Run, diloco: Diloco, params: list[torch.nn.Parameter]
) -> tuple[Clock, int, float, dict[str, Any]]:
    """The group's end: DiLoCo's last round (every group ends with one model), the lighthouse
    told, and the loop's figures with the groups'."""
    if diloco is not None and diloco.averager.steps and not manager.after_the_end:
        _start(job, manager, run, diloco, final=True)
    manager.finish(run.step)
    clock, samples, wall = run.close()
    info = {**manager.report(), "parameters_sha256": _digest(params, job.rt)}
    if diloco is not None:
        info["outer_rounds"] = diloco.averager.averaging_rounds
    return clock, samples, wall, info


def _manager(job: Job) -> ReplicaManager:
    replicas = job.config.sync.replicas
    return ReplicaManager(
        replicas.replica_group,
        replicas.replica_groups,
        replicas.lighthouse,
        run_identity(job),
        job.rt,
        replicas.quorum_timeout_s,
        averaging=CrossGroupAverage(compressor(job.config.sync.compression)),
    )


def _diloco(job: Job, params: list[torch.nn.Parameter]) -> Diloco:
    """DiLoCo's outer rounds across the groups, with --strategy diloco (None: every step)."""
    sync = job.config.sync
    if sync.strategy != "diloco":
        return None
    local = sync.local_sgd
    diloco = CrossGroupDiLoCo(params, local.sync_every, local.outer_lr, local.outer_momentum)
    diloco.begin()
    return diloco


def _start(
    job: Job, manager: ReplicaManager, run: _Run, diloco: Diloco, final: bool = False
) -> Quorum | None:
    """The quorum of the step about to be taken (None where the run is over); with DiLoCo, at
    a round's step (the quorum's, every H, or the run's last), first the outer round, committed
    by every member (one behind sends zeros); then, where a member is behind, every member's
    part in the copy of the newest state (the one behind goes on at the quorum's step). Asked
    again until both succeed."""
    while True:
        quorum = manager.start_step(run.step)
        if quorum is None:
            return None
        if diloco is not None and (final or quorum.max_step % diloco.sync_every == 0):
            fresh = diloco.averager.steps > 0 and not quorum.behind
            ok = diloco.average(manager, fresh)
            if not manager.commit(quorum.max_step, ok):  # the step every member shares
                continue
            diloco.apply()
        if quorum.recovering and not _catch_up(job, manager, run, diloco):
            continue
        return quorum


def _keep_in_checkpoints(job: Job, manager: ReplicaManager, diloco: Diloco) -> None:
    """A group's checkpoints hold its cross-group state too (the average's compressor state,
    residual included; DiLoCo's anchors, outer momentum and inner steps): resumed here."""
    saved = job.replica_state
    if saved is not None:
        manager.averaging.load_state_dict(saved["averaging"])
        if diloco is not None:
            diloco.load_state_dict(saved["diloco"])
    job.replica_saves = lambda: {
        "averaging": manager.averaging.state_dict(),
        "diloco": diloco.state_dict() if diloco is not None else {},
    }


def _catch_up(job: Job, manager: ReplicaManager, run: _Run, diloco: Diloco) -> bool:
    """Take part in the quorum's copy of the newest state (False where it failed: the step is
    asked for again); a group that was behind goes on at the quorum's step."""
    quorum = manager.quorum
    assert quorum is not None
    if not manager.recover(
        lambda: _state(job, run.step, manager, diloco),
        lambda s: _load(job, s, manager, diloco),
    ):
        return False
    if quorum.behind:
        if job.progress is not None:  # the steps copied are not trained again
            job.redone = job.progress.skipped(quorum.max_step - run.step)
        run.step = quorum.max_step
    return True


def _digest(params: list[torch.nn.Parameter], rt: Runtime) -> str:
    """The group's parameters' bytes, hashed: every rank's part (a shard of a split or sharded
    layout) in rank order, so groups holding bit-equal models print the same."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(local(p).detach().cpu().contiguous().numpy().tobytes())
    mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    if rt.size == 1:
        return digest.hexdigest()
    parts = [torch.empty_like(mine, device=collective_device()) for _ in range(rt.size)]
    dist.all_gather(parts, mine.to(collective_device()))
    return hashlib.sha256(b"".join(bytes(part.cpu().tolist()) for part in parts)).hexdigest()
