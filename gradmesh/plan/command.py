"""`gradmesh plan`: profile a model on this machine, price every placement per layer on the
links the job will use, and print (and write) the plan with the fastest predicted step, next to
pure data parallelism, pure tensor parallelism and the rule "convolutions data-parallel, fully
connected layers split" (the planner itself: `gradmesh.planner`).

Links: `--bandwidth R [--latency L]` describes the link between hosts (each rank its own host
unless `--ranks-per-host`); `--emulate-hosts H [--bandwidth R]` probes the links of an emulated
cluster and `--probe` loopback, both with the job's own ranks (alpha and beta fitted piecewise,
per group size, from allreduces of the sizes the candidates exchange, timed between stretches of
compute: `loaded_fit`; and a step's overhead from real data-parallel steps); with none of these,
loopback's default figures (those `auto` uses).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.options import component, option
from gradmesh.plan.mesh import TrainWorkload, describe_mesh, flags, workload
from gradmesh.plan.probe import ProbeRequest, mesh_probe, probe_emulated
from gradmesh.plan.setting import Setting
from gradmesh.plan.unread import check_plan
from gradmesh.sync.config import AllreduceConfig
from gradmesh.train.config import STATE_TENSORS


@dataclass
class PlanConfig:
    """gradmesh plan: the fastest placement per layer for a model on the job's links."""

    model: str = option(
        "alexnet",
        "model to plan for: a registered one, or your factory as pkg.module:factory",
        name=True,
    )
    model_args: str = option("", "the model builder's keyword arguments, like depth=4")
    dataset: str = option("synthetic", "dataset whose inputs the model takes", name=True)
    synthetic_shape: str = option("3x32x32", "synthetic input shape")
    sequence_length: int = option(64, "token models: tokens per sample", at_least=1)
    workers: int = option(4, "ranks of the job", at_least=1)
    batch: int = option(64, "global batch", at_least=1)
    tensor_parallel_max: int | None = option(
        None, "largest tp to consider (default: --workers)", at_least=1
    )
    bandwidth: str | None = option(None, "link rate between hosts, like 1gbit")
    latency: str | None = option(None, "one-way latency between hosts, like 100us")
    ranks_per_host: int | None = option(None, "ranks per host (with --bandwidth)")
    emulate_hosts: int | None = option(None, "probe an emulated cluster of H hosts", at_least=1)
    probe: bool = option(False, "probe loopback between the job's ranks")
    memory_limit: str | None = option(
        None,
        "most bytes per rank, like 64MB or 2GiB: only layouts predicted to fit (a mesh plan also "
        "searches ZeRO stages and activation checkpointing)",
    )
    optimizer: str = option(
        "sgd", "the job's optimizer (sgd, adam, adamw): its state counts against --memory-limit"
    )
    top: int = option(12, "a mesh plan (any other model): the fastest layouts to print", at_least=1)
    allreduce: AllreduceConfig = component(AllreduceConfig, only=("algorithm", "fusion_mb"))
    json: str | None = option(None, "write the plan file here (gradmesh train --plan FILE)")
    memory: bool = option(
        False,
        "print each rank's predicted bytes (parameters, gradients, optimizer state, activations, "
        "gathered parameters) for each of --layouts and whether it fits --device, from the meta "
        "device in seconds; plans and launches nothing",
    )
    layouts: str = option(
        "dp,zero3,dpxtp2",
        "with --memory: dp or zero1-3, with xtpT (tensor parallel) and +ac (checkpointing), "
        "as gradmesh bench memory names them",
    )
    device: str = option(
        "cpu", "with --memory: cpu (this host's memory, shared by the ranks) or a simulator GPU"
    )


def links_for(args: PlanConfig, workers: int) -> tuple[Any, int]:
    """(Links, or a probe: a function of what to probe that returns the Links and one data-
    parallel step's time outside communication; ranks sharing this machine's cores) for the
    flags given."""
    from gradmesh.collectives.cost import DEFAULT_PARAMS, CostParams
    from gradmesh.planner import Links
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


def make_plan(
    setting: Setting,
    links: Any,
    sharing: int,
    memory_limit: float | None = None,
    allreduce: str = "native",
    fusion_mb: float = 64.0,
    optimizer_slots: int = 1,
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
    from gradmesh.models.registry import TP_PLANS, build_model, check_pairing
    from gradmesh.planner import divisors, exchange_sizes, plan, predict, profile
    from gradmesh.units import parse_shape

    if setting.workers < 1 or setting.batch < setting.workers:
        raise GradmeshError(
            f"--batch {setting.batch} must be at least --workers {setting.workers} (>= 1)"
        )
    check_pairing(setting.model, setting.dataset)
    data = DATASETS.get(setting.dataset)(DataOptions(shape=parse_shape(setting.shape)))
    torch.manual_seed(0)
    model = build_model(setting.model, data, setting.arguments())
    if not isinstance(model, torch.nn.Sequential):
        raise GradmeshError(
            f"a per-layer plan (--plan) places each layer of a sequence of layers; model "
            f"{setting.model} is not one: `gradmesh plan --model {setting.model}` chooses its "
            "data, tensor and pipeline degrees instead"
        )
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
    prof.optimizer_slots = optimizer_slots
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


def run(args: PlanConfig, _command: list[str] | None = None) -> int:
    from pathlib import Path

    from gradmesh.planner import to_plan
    from gradmesh.units import parse_size

    if args.optimizer not in STATE_TENSORS:
        raise GradmeshError(
            f"unknown --optimizer {args.optimizer!r} (valid: {', '.join(sorted(STATE_TENSORS))})"
        )
    args.allreduce.check()
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
        args.model_args,
    )
    limit = float(parse_size(args.memory_limit)) if args.memory_limit else None
    links, sharing = links_for(args, args.workers)
    work = workload(
        args.model,
        args.model_args,
        args.dataset,
        args.sequence_length,
        args.synthetic_shape,
        args.batch,
        args.optimizer,
    )
    per_layer = _sequence_of_layers(work)
    check_plan(args, per_layer)
    if not per_layer:
        return _run_mesh(args, work, setting, links, sharing)
    best, refs, prof, links = make_plan(
        setting,
        links,
        sharing,
        limit,
        args.allreduce.algorithm,
        args.allreduce.fusion_mb,
        STATE_TENSORS[args.optimizer],
    )
    print(describe(best, refs, prof))
    if args.json:
        Path(args.json).write_text(to_plan(best, prof, links, refs).to_json())
        print(f"plan written to {args.json} (gradmesh train --plan {args.json})", file=sys.stderr)
    return 0


def _sequence_of_layers(work: TrainWorkload) -> bool:
    import torch

    model = work.build()[0]
    return isinstance(model, torch.nn.Sequential)


def _run_mesh(
    args: PlanConfig, work: TrainWorkload, setting: Setting, links: Any, sharing: int
) -> int:
    """A mesh plan (`gradmesh.plan.mesh`) for a model that is not a sequence of layers."""
    import json
    from pathlib import Path

    from gradmesh.launch.jobs import emulated_cluster
    from gradmesh.models.registry import is_token_model
    from gradmesh.plan.calibrate import calibrator
    from gradmesh.planner import Search, plan_mesh
    from gradmesh.units import parse_size

    limit = float(parse_size(args.memory_limit)) if args.memory_limit else None
    with emulated_cluster(args.emulate_hosts, args.bandwidth or "1gbit") as cluster:
        measure = None
        if callable(links):  # probe the links for the sizes the layouts exchange; calibrate
            links = mesh_probe(cluster, args.workers // (args.emulate_hosts or 1), setting)
            measure = calibrator({**work.options, "model": work.name}, args.workers, cluster)
        plan = plan_mesh(
            work,
            args.workers,
            args.batch,
            links,
            sharing,
            Search(args.tensor_parallel_max, args.allreduce.algorithm, memory_limit=limit),
            measure=measure,
        )
    preds = plan.predictions
    if not preds:
        raise GradmeshError(f"no layout of {args.workers} workers fits --batch {args.batch}")
    tokens = args.sequence_length if is_token_model(args.model) else None
    print(describe_mesh(plan, tokens, args.top))
    if args.json:
        rows = [p.row() for p in preds]
        payload = {
            "kind": "mesh",
            "model": args.model,
            "workers": args.workers,
            "batch": args.batch,
            "choice": rows[0],
            "flags": flags(rows[0]),
            "layouts": rows,
            "calibration": vars(plan.calibration),
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"plan written to {args.json}", file=sys.stderr)
    return 0


def resolve(config: Any) -> Any:
    """Before launch: `config` with its `--plan` (a file, or auto: planned now for this host's
    loopback) checked against the model and world and inlined, and tp set from it."""
    import json

    from gradmesh.layout.tensor.hybrid import check, load_plan
    from gradmesh.train.setup import load_data, model_of

    if config.layout.plan == "auto":
        from gradmesh.collectives.cost import DEFAULT_PARAMS
        from gradmesh.planner import Links, to_plan

        setting = Setting(
            config.data.model,
            config.data.dataset,
            config.data.synthetic_shape,
            config.job.workers,
            config.data.batch_size,
            config.job.workers,
            config.data.model_args,
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
    check(plan, model_of(config, load_data(config)), config.job.workers)
    inline = json.dumps(
        {"model": plan.model, "tensor_parallel": plan.tensor_parallel, "layers": plan.layers}
    )
    return config.with_options(plan=inline, tensor_parallel=plan.tensor_parallel)
