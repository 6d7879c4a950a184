"""How each strategy's step is priced on n GPUs (`STRATEGIES`), from one GPU's profile and the
collectives' cost formulas through the planner (`predict`), and `scaling` over GPU counts."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradmesh.collectives.cost import CostParams
from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.order import check_schedule
from gradmesh.planner.links import Links, Profile
from gradmesh.registry import Registry
from gradmesh.simulate.profile import Split


@dataclass(frozen=True)
class Job:
    """What a strategy needs to price one step on n GPUs."""

    prof: Profile
    """One GPU's profile (batch: its own)."""
    gpus: int
    links: Links
    algorithm: str = "native"
    fusion_mb: float = 25.0
    _: dataclasses.KW_ONLY  # each strategy's own settings by name: a new one cannot shift them
    servers: int = 1
    """ps: parameter servers in all (when `servers_per_node` is 0)."""
    servers_per_node: int = 0
    """ps: parameter servers on each node (0: `servers` in all)."""
    sync_every: int = 8
    """local-sgd: steps between parameter averages."""
    tensor_parallel: int = 1
    """tensor, hybrid: the largest tp group."""
    split: Split | None = None
    """tensor, hybrid, pipeline: the model's per-placement profile (`layout_profile`)."""
    pipeline_parallel: int = 1
    """pipeline: stages (the option's name: `LayoutConfig.pipeline_parallel`)."""
    microbatches: int = 1
    """pipeline: micro-batches per replica's batch."""
    schedule: str = "1f1b"
    """pipeline: gpipe, 1f1b, interleaved, zb-h1 or zbv
    (`gradmesh.layout.pipeline.order.schedule_actions`)."""
    virtual_stages: int = 2
    """pipeline, interleaved: chunks of the model each GPU holds."""
    servers_apart: bool = False
    """ps: the servers have hosts of their own (BytePS's layout, and `gradmesh bench scaling`'s
    emulated jobs), so pushes and pulls cross the link between nodes even on one node."""


def compute_s(prof: Profile) -> float:
    """One GPU's step with no communication: forward, backward, update, the step's overhead."""
    model_bytes = sum(u.param_bytes for u in prof.units)
    work = sum(u.fwd["data"] + u.bwd["data"] for u in prof.units)
    return work + prof.update_s_per_byte * model_bytes + prof.step_overhead_s


def _allreduce(job: Job) -> float:
    n = job.gpus
    prof = dataclasses.replace(job.prof, workers=n, batch=job.prof.batch * n)
    layers = {u.name: "data" for u in prof.units}
    from gradmesh.planner.cost import predict  # imports torch: only when a strategy prices

    return predict(prof, layers, 1, job.links, job.algorithm, job.fusion_mb).step_s


def _ps(job: Job) -> float:
    from gradmesh.sync.parameter_server.cost import step_time

    n, per_node = job.gpus, job.links.ranks_per_host
    nbytes = sum(u.param_bytes for u in job.prof.units)
    nodes = max(1, n // per_node)
    servers = job.servers_per_node * nodes or job.servers
    spans = nodes > 1 or job.servers_apart
    link = (job.links.point_to_point or job.links.inter) if spans else job.links.intra
    shared = min(per_node, n)  # a node's GPUs share its link
    worker = CostParams(link.alpha, link.beta * shared, link.gamma)
    return step_time(n, servers, nbytes, worker, compute_s(job.prof), server_link=link).step_s


def _local_sgd(job: Job) -> float:
    nbytes = sum(u.param_bytes for u in job.prof.units)
    average = job.links.allreduce_s(job.algorithm, list(range(job.gpus)), nbytes)
    return compute_s(job.prof) + average / job.sync_every


def _tp_of(job: Job) -> int:
    """The tp group size at this GPU count: the largest asked for that divides it."""
    return math.gcd(job.gpus, job.tensor_parallel)


def _split_of(job: Job) -> tuple[Split, Profile]:
    """The job's `Split`, and its profile at this GPU count (each GPU keeps its batch)."""
    if job.split is None:
        raise GradmeshError("the tensor, hybrid and pipeline layouts need `Job.split`")
    prof = dataclasses.replace(
        job.split.prof, workers=job.gpus, batch=job.split.prof.batch * job.gpus
    )
    return job.split, prof


def _tensor(job: Job) -> float:
    """The model's own tensor-parallel plan within groups of `_tp_of` GPUs (adjacent: a node's),
    data parallelism across them: the planner's `predict`."""
    from gradmesh.planner import tp_plan_layers

    split, prof = _split_of(job)
    if not split.tp_plan:
        raise GradmeshError(f"model {prof.model} declares no tensor-parallel plan")
    tp = _tp_of(job)
    layers = tp_plan_layers(prof, split.tp_plan) if tp > 1 else {}
    layers = layers or {u.name: "data" for u in prof.units}
    from gradmesh.planner.cost import predict

    return predict(prof, layers, tp, job.links, job.algorithm, job.fusion_mb).step_s


def _hybrid(job: Job) -> float:
    """The planner's own choice (per layer: data-parallel, replicated or split, at each tp up to
    `_tp_of`), by its search over the same cost model."""
    from gradmesh.planner import plan

    split, prof = _split_of(job)
    best, _ = plan(
        prof,
        job.links,
        _tp_of(job),
        split.model,
        split.tp_plan,
        job.algorithm,
        job.fusion_mb,
    )
    return best.prediction.step_s


def _pipeline(job: Job) -> float:
    """Pipeline parallelism as gradmesh runs it: the layer sequence cut into S stages balanced
    on their FLOPs (`pipeline.balance`; S the largest asked for that divides the GPU count,
    adjacent GPUs, so a node's; S v under the interleaved schedule, GPU s holding stages s,
    s + S, ...; 2 S in a V, GPU s holding s and 2 S - 1 - s), each replica's batch (S GPUs'
    worth) in `microbatches`, every GPU running its schedule's actions in order
    (`order.timeline`) as a discrete-event simulation: a forward waits for the stage before it
    and its activation's transfer, a backward for the stage after it and its gradient's; under
    a zero-bubble schedule a backward is B and W, each half of its FLOPs (a matmul's input and
    weight gradients cost the same); then each GPU's parameters are averaged over the
    S-strided replicas, after its last backward."""
    from gradmesh.layout.config import chunks_of
    from gradmesh.layout.pipeline.order import rank_of, stage_of, timeline
    from gradmesh.layout.pipeline.schedules import balance
    from gradmesh.layout.pipeline.zero_bubble import SPLIT

    split, _ = _split_of(job)
    n = job.gpus
    stages = math.gcd(n, job.pipeline_parallel)
    units_ = split.prof.units
    if stages > len(units_):
        stages = max(d for d in range(1, len(units_) + 1) if n % d == 0)
    m, kind = job.microbatches, job.schedule
    v = chunks_of(kind, stages, job.virtual_stages)
    check_schedule(kind, stages, m, v)
    if v > len(units_) // stages and kind != "interleaved":
        raise GradmeshError(
            f"schedule {kind} holds {v} stages a GPU: the model's {len(units_)} layers make "
            f"fewer than {v * stages}"
        )
    v = max(1, min(v, len(units_) // stages))  # no chunk without a layer
    depth = stages * v
    samples = split.prof.batch * stages / m  # per micro-batch (the profile is at one GPU's)
    scale = stages / m
    per_unit = [(u.fwd["data"] * scale, u.bwd["data"] * scale) for u in units_]
    starts = balance([f + b for f, b in per_unit], depth) if depth > 1 else [0]
    bounds = [*starts, len(units_)]
    fwd = [sum(f for f, _ in per_unit[a:b]) for a, b in itertools.pairwise(bounds)]
    bwd = [sum(b for _, b in per_unit[a:c]) for a, c in itertools.pairwise(bounds)]
    half = 0.5 if kind in SPLIT else 0.0  # W's share of a backward
    costs = ([*fwd], [b * (1 - half) for b in bwd], [b * half for b in bwd])
    sends = []
    for g in range(depth - 1):
        pair = [rank_of(kind, g, stages), rank_of(kind, g + 1, stages)]
        nbytes = samples * units_[bounds[g + 1] - 1].out_bytes
        sends.append(0.0 if pair[0] == pair[1] else _p2p_s(job.links, pair, nbytes))
    free = timeline(kind, stages, m, costs, sends, v)
    replicas = list(range(0, n, stages))
    step = 0.0
    for s in range(stages):
        mine = [stage_of(kind, c, s, stages) for c in range(v)]
        nbytes = sum(u.param_bytes for g in mine for u in units_[bounds[g] : bounds[g + 1]])
        sync = job.links.allreduce_s(job.algorithm, [r + s for r in replicas], nbytes)
        step = max(step, free[s] + sync)
    return step + split.prof.step_overhead_s


def _p2p_s(links: Links, ranks: list[int], nbytes: float) -> float:
    """One message between two ranks: its alpha and beta (within a node or across)."""
    c = links.over(ranks, nbytes)
    return c.alpha + nbytes * c.beta


STRATEGIES: Registry[Callable[[Job], float]] = Registry("simulated strategy")
STRATEGIES.register("allreduce")(_allreduce)
STRATEGIES.register("ps")(_ps)
STRATEGIES.register("local-sgd")(_local_sgd)
STRATEGIES.register("tensor")(_tensor)
STRATEGIES.register("hybrid")(_hybrid)
STRATEGIES.register("pipeline")(_pipeline)
SPLITTING = {"tensor", "hybrid", "pipeline"}


def scaling(strategy: str, base: Job, gpus: list[int]) -> list[dict[str, Any]]:
    """Per GPU count: predicted step, samples/s, efficiency T(1)/T(n), overhead T(n) - T(1)."""
    price = STRATEGIES.get(strategy)
    alone = compute_s(base.prof)
    rows = []
    for n in gpus:
        step = price(dataclasses.replace(base, gpus=n))
        rows.append(
            {
                "gpus": n,
                "nodes": max(1, n // base.links.ranks_per_host),
                "step_s": step,
                "samples_per_s": n * base.prof.batch / step,
                "efficiency": alone / step,
                "overhead_s": step - alone,
            }
        )
    return rows


# -- command line ------------------------------------------------------------------------------
