"""`gradmesh plan`: profile a model on this machine, price every placement per layer on the
links the job will use, and print (and write) the plan with the fastest predicted step, next to
pure data parallelism, pure tensor parallelism and the rule "convolutions data-parallel, fully
connected layers split" (the planner itself: `gradmesh.layout.planner`).

Links: `--bandwidth R [--latency L]` describes the link between hosts (each rank its own host
unless `--ranks-per-host`); `--emulate-hosts H [--bandwidth R]` probes the links of an emulated
cluster and `--probe` loopback, both with the job's own ranks (alpha and beta fitted piecewise,
per group size, from allreduces of the sizes the candidates exchange, timed between stretches of
compute: `loaded_fit`; and a step's overhead from real data-parallel steps); with none of these,
loopback's default figures (those `auto` uses).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.registry import canonical_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=canonical_name, default="alexnet", help="model (default: alexnet)"
    )
    parser.add_argument(
        "--dataset", type=canonical_name, default="synthetic", help="dataset (default: synthetic)"
    )
    parser.add_argument(
        "--synthetic-shape", default="3x32x32", help="synthetic input shape (default: 3x32x32)"
    )
    parser.add_argument("--workers", type=int, default=4, help="ranks (default: 4)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default: 64)")
    parser.add_argument(
        "--tensor-parallel-max", type=int, help="largest tp to consider (default: --workers)"
    )
    parser.add_argument("--bandwidth", help="link rate between hosts, like 1gbit")
    parser.add_argument("--latency", help="one-way latency between hosts, like 100us")
    parser.add_argument("--ranks-per-host", type=int, help="ranks per host (with --bandwidth)")
    parser.add_argument("--emulate-hosts", type=int, help="probe an emulated cluster of H hosts")
    parser.add_argument("--probe", action="store_true", help="probe loopback between 2 ranks")
    parser.add_argument("--memory-limit", help="most bytes per rank, like 64MB")
    parser.add_argument("--allreduce", default="native", help="gradient allreduce algorithm")
    parser.add_argument("--fusion-mb", type=float, default=64.0, help="gradient bucket MiB")
    parser.add_argument("--json", help="write the plan file here (gradmesh train --plan FILE)")


@dataclass
class Setting:
    """What a plan is made for: the model and data, the world, the links."""

    model: str
    dataset: str
    shape: str
    workers: int
    batch: int
    tp_max: int


def links_for(args: argparse.Namespace, workers: int) -> tuple[Any, int]:
    """(Links, or a probe: a function of what to probe that returns the Links and one data-
    parallel step's time outside communication; ranks sharing this machine's cores) for the
    flags given."""
    from gradmesh.collectives.cost import DEFAULT_PARAMS, CostParams
    from gradmesh.layout.planner import Links
    from gradmesh.units import parse_latency, parse_rate

    if args.emulate_hosts:
        hosts = args.emulate_hosts
        if workers % hosts:
            raise GradmeshError(f"--workers {workers} does not split over {hosts} hosts")
        rate = args.bandwidth or "1gbit"

        def emulated(request: ProbeRequest) -> tuple[Links, float]:
            return probe_emulated(hosts, rate, workers // hosts, request)

        return emulated, workers
    if args.probe:

        def loopback(request: ProbeRequest) -> tuple[Links, float]:
            return probe_emulated(None, "", workers, request)

        return loopback, workers
    if args.bandwidth:
        beta = 8 / parse_rate(args.bandwidth)
        alpha = parse_latency(args.latency) if args.latency else DEFAULT_PARAMS.alpha
        inter = CostParams(alpha or DEFAULT_PARAMS.alpha, beta, DEFAULT_PARAMS.gamma)
        per_host = args.ranks_per_host or 1
        if per_host < 1 or workers % per_host:
            raise GradmeshError(f"--ranks-per-host {per_host} does not divide --workers {workers}")
        return Links(DEFAULT_PARAMS, inter, per_host), per_host
    return Links(DEFAULT_PARAMS, DEFAULT_PARAMS, workers), workers


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
    from gradmesh.layout.planner import Links

    config = {**dataclasses.asdict(request), "setting": dataclasses.asdict(request.setting)}
    workers = request.setting.workers
    gamma, by_size, outside, pair = run_workers(
        "gradmesh.plan.command", max(2, workers), config, 300.0, cluster
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


def placement_config(setting: Setting, tp: int, layers: dict[str, str]) -> Any:
    """The trainer's configuration of a job that trains `setting` with placement `layers`."""
    import json

    from gradmesh.train.config import TrainConfig

    return TrainConfig.of(
        workers=setting.workers,
        model=setting.model,
        dataset=setting.dataset,
        synthetic_shape=setting.shape,
        synthetic_samples=setting.batch * 2,  # 80% of it for training: one global batch fits
        batch_size=setting.batch,
        lr=0.01,
        momentum=0.9,
        tensor_parallel=tp,
        plan=json.dumps({"model": setting.model, "tensor_parallel": tp, "layers": layers}),
    )


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
    from gradmesh.train.timing import timed_steps
    from gradmesh.train.trainer import attach, setup

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

    one = torch.zeros(1)
    spent = []
    for nbytes in sizes:
        msg = torch.zeros(max(1, nbytes // 4))
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

    one = torch.zeros(1)
    one_way = []
    for nbytes in sizes:
        msg = torch.zeros(max(1, nbytes // 4))
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

    a = torch.randn(96, 96)

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
        [statistics.median(free), statistics.median(synced)], dtype=torch.float64
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


def make_plan(
    setting: Setting,
    links: Any,
    sharing: int,
    memory_limit: float | None = None,
    allreduce: str = "native",
    fusion_mb: float = 64.0,
) -> tuple[Any, list[Any], Any, Any]:
    """Profile, search, compare: (the chosen `Choice`, the references, the `Profile`, the
    `Links` priced on).
    `links` may be a probe: once the model is profiled it is called with a `ProbeRequest` (the
    sizes the candidates exchange, `exchange_sizes`, and the sizes of the groups they reduce
    over) and returns the Links and real data-parallel steps' seconds outside communication on
    their slowest rank, whose excess over the predicted compute becomes the profile's
    `step_overhead_s`."""
    import torch

    from gradmesh.data import DATASETS, DataOptions
    from gradmesh.layout.planner import divisors, exchange_sizes, plan, predict, profile
    from gradmesh.models.registry import TP_PLANS, build_model, check_pairing
    from gradmesh.units import parse_shape

    if setting.workers < 1 or setting.batch < setting.workers:
        raise GradmeshError(
            f"--batch {setting.batch} must be at least --workers {setting.workers} (>= 1)"
        )
    check_pairing(setting.model, setting.dataset)
    data = DATASETS.get(setting.dataset)(DataOptions(shape=parse_shape(setting.shape)))
    torch.manual_seed(0)
    model = build_model(setting.model, data)
    tps = [t for t in divisors(setting.workers, setting.tp_max) if t > 1]
    prof = profile(
        model, setting.model, data.train.x[:1], setting.batch, setting.workers, tps, sharing
    )
    if callable(links):
        w = setting.workers
        data_layers = {u.name: "data" for u in prof.units}
        request = ProbeRequest(
            setting,
            allreduce,
            exchange_sizes(prof, [1, *tps]),
            sorted({w, *tps, *(w // t for t in tps)}),
            data_layers,
        )
        links, outside = links(request)
        computed = predict(prof, data_layers, 1, links, allreduce, fusion_mb).compute_s
        prof.step_overhead_s = max(0.0, outside - computed)
    tp_plan = TP_PLANS.get(setting.model) if setting.model in TP_PLANS else None
    best, refs = plan(
        prof, links, setting.tp_max, model, tp_plan, allreduce, fusion_mb, memory_limit
    )
    return best, refs, prof, links


def describe(best: Any, refs: list[Any], prof: Any) -> str:
    """The table `gradmesh plan` prints."""
    lines = [
        f"model {prof.model}, {prof.workers} workers, global batch {prof.batch}; plan: tp "
        f"{best.tp} x dp {prof.workers // best.tp} (profiled with {prof.threads} thread(s) per "
        f"rank, {prof.concurrent} rank(s) at once)",
        f"{'layer':>6} {'kind':7} {'choice':10} {'conv':7} {'compute ms':>10} {'comm ms':>8} "
        f"{'sync ms':>8} {'params/rank':>11}",
    ]
    for r in best.prediction.rows:
        lines.append(
            f"{r['layer']:>6} {r['kind']:7} {r['choice']:10} {r['conversion'] or '-':7} "
            f"{r['compute_ms']:10.2f} {r['comm_ms']:8.2f} {r['sync_ms']:8.2f} "
            f"{r['param_bytes_per_rank'] / 1e6:9.2f}MB"
        )
    p = best.prediction
    lines.append(
        f"predicted step {p.step_s * 1e3:.1f} ms (compute and update {p.compute_s * 1e3:.1f}, "
        "blocking "
        f"exchanges {p.blocking_comm_s * 1e3:.1f}, exposed gradient sync "
        f"{p.exposed_sync_s * 1e3:.1f} of {p.sync_s * 1e3:.1f})"
    )
    for r in refs:
        lines.append(
            f"  {r.name:16} tp {r.tp}: predicted step {r.prediction.step_s * 1e3:7.1f} ms "
            f"({r.prediction.step_s / p.step_s:.2f}x the plan's)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gradmesh.layout.planner import to_plan
    from gradmesh.units import parse_size

    if args.workers < 1:
        raise GradmeshError(f"--workers must be >= 1, got {args.workers}")
    if args.fusion_mb <= 0:
        raise GradmeshError(f"--fusion-mb must be > 0, got {args.fusion_mb}")
    if (
        sum(bool(x) for x in (args.emulate_hosts, args.probe, args.latency and not args.bandwidth))
        > 1
    ):
        raise GradmeshError("give one of --emulate-hosts, --probe, --bandwidth [--latency]")
    setting = Setting(
        args.model,
        args.dataset,
        args.synthetic_shape,
        args.workers,
        args.batch,
        args.tensor_parallel_max or args.workers,
    )
    limit = float(parse_size(args.memory_limit)) if args.memory_limit else None
    if args.json:
        from gradmesh.train.config import check_writable

        check_writable(args.json, "--json")
    links, sharing = links_for(args, args.workers)
    best, refs, prof, links = make_plan(
        setting, links, sharing, limit, args.allreduce, args.fusion_mb
    )
    print(describe(best, refs, prof))
    if args.json:
        Path(args.json).write_text(to_plan(best, prof, links, refs).to_json())
        print(f"plan written to {args.json} (gradmesh train --plan {args.json})", file=sys.stderr)
    return 0


def resolve(config: Any) -> Any:
    """Before launch: `config` with its `--plan` (a file, or auto: planned now for this host's
    loopback) checked against the model and world and inlined, and tp set from it."""
    import json

    from gradmesh.layout.hybrid import check, load_plan
    from gradmesh.models.registry import build_model
    from gradmesh.train.trainer import load_data

    if config.layout.plan == "auto":
        from gradmesh.collectives.cost import DEFAULT_PARAMS
        from gradmesh.layout.planner import Links, to_plan

        setting = Setting(
            config.data.model,
            config.data.dataset,
            config.data.synthetic_shape,
            config.job.workers,
            config.data.batch_size,
            config.job.workers,
        )
        links = Links(DEFAULT_PARAMS, DEFAULT_PARAMS, config.job.workers)
        best, refs, prof, links = make_plan(setting, links, config.job.workers)
        print(describe(best, refs, prof), file=sys.stderr)
        plan = to_plan(best, prof, links, refs)
    else:
        plan = load_plan(config.layout.plan)
    if plan.model != config.data.model:
        raise GradmeshError(f"--plan is for model {plan.model}, not --model {config.data.model}")
    if config.layout.tensor_parallel not in (1, plan.tensor_parallel):
        raise GradmeshError(
            f"--tensor-parallel {config.layout.tensor_parallel} contradicts the plan's "
            f"tensor_parallel {plan.tensor_parallel}"
        )
    check(plan, build_model(config.data.model, load_data(config)), config.job.workers)
    inline = json.dumps(
        {"model": plan.model, "tensor_parallel": plan.tensor_parallel, "layers": plan.layers}
    )
    return config.with_options(plan=inline, tensor_parallel=plan.tensor_parallel)


if __name__ == "__main__":
    from gradmesh.launch.jobs import worker_main

    worker_main(_probe_worker)
