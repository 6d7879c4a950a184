"""Probing the job's links for the planner: alpha and beta fitted piecewise, per group size, from
allreduces of the sizes the candidates exchange, timed between stretches of compute on the job's
own ranks (`loaded_fit`), on an emulated cluster or loopback; and one data-parallel step's time
outside communication. `python -m gradmesh.plan.probe` is the probe's worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradmesh.plan.setting import Setting, placement_config


@dataclass
class ProbeRequest:
    """What the planner asks a probe for, once the model is profiled."""

    setting: Setting
    algorithm: str
    sizes: list[int]
    """Message sizes to fit the link at (`planner.exchange_sizes`)."""
    group_sizes: list[int]
    """Sizes of the groups the candidates reduce over (each fitted on its own)."""
    data_layers: dict[str, str]
    """The pure data-parallel placement, whose real step the probe times."""
    point_to_point: bool = False
    """Also fit one message between two hosts (`loaded_pingpong`: a parameter server's link)."""


def probe_emulated(
    hosts: int | None, bandwidth: str, per_host: int, request: ProbeRequest
) -> tuple[Any, float]:
    """`probe_links` on an emulated cluster of `hosts` (None: on loopback, one host)."""
    from gradmesh.launch.jobs import emulated_cluster

    with emulated_cluster(hosts, bandwidth) as cluster:
        return probe_links(request, cluster, per_host)


def probe_links(request: ProbeRequest, cluster: Any, per_host: int) -> tuple[Any, float]:
    """`_probe_worker` on the job's own ranks (of `cluster`, or local): (Links whose figures
    across hosts, or within the one host, are the fitted ones; the data-parallel step's seconds
    outside communication)."""
    import dataclasses

    from gradmesh.collectives.cost import DEFAULT_PARAMS, CostParams
    from gradmesh.launch.jobs import run_workers
    from gradmesh.planner import Links

    config = {**dataclasses.asdict(request), "setting": dataclasses.asdict(request.setting)}
    if not request.data_layers:  # no data-parallel step to time (`mesh_probe`)
        config["setting"] = None
    workers = request.setting.workers
    gamma, by_size, outside, pair = run_workers(
        "gradmesh.plan.probe", max(2, workers), config, 300.0, cluster
    )
    fitted = {
        int(p): [(int(upto), CostParams(alpha, beta, gamma)) for upto, alpha, beta in pieces]
        for p, pieces in by_size.items()
    }
    world = fitted[max(fitted)][-1][1]  # the largest group's figures for its largest messages
    p2p = CostParams(pair[0], pair[1], gamma) if pair else None
    if cluster is None:
        return Links(world, world, workers, fitted, fitted, p2p), outside
    return Links(DEFAULT_PARAMS, world, per_host, {}, fitted, p2p), outside


DEFAULT_SIZES = (65536, 524288, 2097152)
COMPUTE_BETWEEN = 160
"""Matrix products before each timed allreduce: about 3 ms on 4 ranks sharing 2 cores."""


def _probe_worker(config: dict[str, Any]) -> tuple[int, Any]:
    """[gamma; {group size: its pieces}; the seconds a real data-parallel step spends outside
    communication on its slowest rank (`timed_steps`); where asked, `loaded_pingpong`'s
    [alpha, beta], else None]. Gamma is `probe`'s; the pieces are `loaded_fit`'s, which times
    allreduces of the sizes the plan's candidates exchange between stretches of compute on every
    rank at once, for the world and for each smaller group size on groups of that many ranks
    (strided, so they span hosts) reducing at once. The ping-pong fit of an idle pair is not
    what a step meets: on 4 emulated hosts its intercept fell to nothing (1e-7 s, clamped) while
    each allreduce of 16 KB or more took 2.8 ms or more."""
    import torch.distributed as dist

    from gradmesh.collectives import probe
    from gradmesh.runtime.world import init, shutdown
    from gradmesh.train.setup import attach, setup
    from gradmesh.train.timing import timed_steps

    rt = init()
    c = probe()
    sizes = list(config.get("sizes") or DEFAULT_SIZES)
    algorithm = config.get("algorithm", "native")
    by_size = {rt.size: loaded_fit(None, algorithm, c, sizes)}
    for p in sorted(set(config.get("group_sizes") or []) - {1, rt.size}):
        stride = rt.size // p
        groups = [dist.new_group(list(range(i, rt.size, stride))) for i in range(stride)]
        by_size[p] = loaded_fit(groups[rt.rank % stride], algorithm, c, sizes)
    outside = 0.0
    if config.get("setting") and config.get("data_layers"):
        setting = Setting(**config["setting"])
        job = setup(placement_config(setting, 1, config["data_layers"]), rt)
        attach(job)
        outside = timed_steps(job, setting.batch, 3, 8).outside_comm_s
    pair = loaded_pingpong(sizes) if config.get("point_to_point") else None
    shutdown()
    return rt.rank, [c.gamma, by_size, outside, pair]


def loaded_fit(
    group: Any, algorithm: str, idle: Any, sizes: list[int], rounds: int = 3
) -> list[list[float]]:
    """A piecewise fit, [[largest size, alpha, beta], ...] by size, of what an allreduce of each
    of `sizes` bytes over `group` (None: the world; every rank is in one group of the same size,
    all reducing at once) costs through the algorithm's registered formula (`loaded_seconds`
    times each size); `fit_segments` puts alpha and beta through each pair of neighbouring
    sizes."""
    import torch
    import torch.distributed as dist

    one = torch.zeros(1, device="cpu")
    spent = []
    for nbytes in sizes:
        msg = torch.zeros(max(1, nbytes // 4), device="cpu")
        spent.append(
            loaded_seconds(
                lambda m=msg: dist.all_reduce(m, group=group),
                lambda: dist.all_reduce(one, group=group),
                rounds,
            )
        )
    return fit_segments(algorithm, dist.get_world_size(group), sizes, spent, idle)


def loaded_pingpong(sizes: list[int], rounds: int = 3) -> list[float]:
    """[alpha, beta] of one message between ranks 0 and 1 (on emulated hosts, two hosts) as a
    parameter server's push and pull meet it: each size sent from 1 to 0 and back between
    stretches of compute (`loaded_seconds`), half the round trip's cost its one-way time, a
    line through the sizes (`fit_alpha_beta`). The idle ping-pong of `probe` is not it: on
    emulated hosts its intercept falls to nothing. Every rank calls this; the others compute."""
    import torch
    import torch.distributed as dist

    from gradmesh.collectives.cost import fit_alpha_beta

    rank = dist.get_rank()

    def round_trip(buf: torch.Tensor) -> None:
        if rank == 1:
            dist.send(buf, 0)
            dist.recv(buf, 0)
        elif rank == 0:
            dist.recv(buf, 1)
            dist.send(buf, 1)

    one = torch.zeros(1, device="cpu")
    one_way = []
    for nbytes in sizes:
        msg = torch.zeros(max(1, nbytes // 4), device="cpu")
        one_way.append(loaded_seconds(lambda m=msg: round_trip(m), lambda: round_trip(one)) / 2)
    alpha, beta = fit_alpha_beta([max(4, n) for n in sizes], one_way)
    return [alpha, beta]


def loaded_seconds(exchange: Any, settle: Any, rounds: int = 3) -> float:
    """What `exchange()` costs between stretches of compute on every rank at once: a loop of
    (compute, exchange) timed against the same compute with one `settle()` (the smallest
    exchange) at the end, the difference per iteration; medians of `rounds`, the largest over
    the ranks (every rank gets the same figure)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    a = torch.randn(96, 96, device="cpu")

    def loop(each: Any) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(4):
            for _ in range(COMPUTE_BETWEEN):
                torch.mm(a, a)
            if each is not None:
                each()
        if each is None:
            settle()
        return (time.perf_counter() - started) / 4

    synced, free = [], []
    for _ in range(rounds):
        synced.append(loop(exchange))
        free.append(loop(None))
    figures = torch.tensor(
        [statistics.median(free), statistics.median(synced)], dtype=torch.float64, device="cpu"
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    compute, total = figures.tolist()
    return max(float(total) - float(compute), 1e-6)


def fit_segments(
    algorithm: str, p: int, sizes: list[int], spent: list[float], idle: Any
) -> list[list[float]]:
    """[[largest size, alpha, beta], ...]: for each pair of neighbouring `sizes`, the alpha and
    beta with which the algorithm's registered formula (over `p` ranks, gamma the `idle`
    probe's) costs exactly what was `spent` at both; the formula is linear in them. A solution
    with a negative term keeps the other term alone (least squares on the two). The first piece
    also prices smaller messages, the last larger ones, so the last needs a rate: where its
    sizes cost the same (or there is one size) it takes the idle probe's beta, with the alpha
    that prices its largest size."""
    from gradmesh.collectives.cost import COSTS, CostParams

    formula = COSTS.get(algorithm)

    def terms(n: int, t: float) -> tuple[float, float, float]:
        rest = t - formula(p, n, CostParams(0.0, 0.0, idle.gamma), 1)
        return (
            formula(p, n, CostParams(1.0, 0.0, 0.0), 1),
            formula(p, n, CostParams(0.0, 1.0, 0.0), 1),
            rest,
        )

    points = [terms(n, t) for n, t in zip(sizes, spent, strict=True)]
    pieces: list[list[float]] = []
    for i in range(len(points) - 1):
        (a1, b1, r1), (a2, b2, r2) = points[i], points[i + 1]
        det = a1 * b2 - a2 * b1
        alpha = (r1 * b2 - r2 * b1) / det if det else -1.0
        beta = (a1 * r2 - a2 * r1) / det if det else -1.0
        if alpha < 0 or beta < 0:
            alpha_only = max((a1 * r1 + a2 * r2) / (a1 * a1 + a2 * a2), 0.0)
            beta_only = max((b1 * r1 + b2 * r2) / (b1 * b1 + b2 * b2), 0.0)
            alpha, beta = (alpha_only, 0.0) if beta < 0 else (0.0, beta_only)
        pieces.append([sizes[i + 1], alpha, beta])
    if not pieces or pieces[-1][2] <= 0:
        a, b, r = points[-1]
        pieces[-1:] = [[sizes[-1], max((r - b * idle.beta) / a, 0.0), idle.beta]]
    return pieces


def mesh_probe(cluster: Any, per_host: int, setting: Setting) -> Any:
    """A probe for the mesh planner (`plan_mesh`): called with the message and group sizes its
    layouts exchange, it returns the Links `loaded_fit` and `loaded_pingpong` fit on the job's
    own ranks (of an emulated `cluster`, or loopback)."""

    def probe(sizes: list[int], groups: list[int]) -> Any:
        request = ProbeRequest(setting, "native", sizes, groups, {}, point_to_point=True)
        return probe_links(request, cluster, per_host)[0]

    return probe


if __name__ == "__main__":
    from gradmesh.launch.jobs import worker_main

    worker_main(_probe_worker)
