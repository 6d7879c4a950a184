"""`gradmesh bench layout`: one model under every way of splitting it over the same ranks.

Pure data parallelism, tp 2 x dp 2, pp 2 x dp 2, tp 4 and pp 4 (on `--world` 4), each a job of
its own (a mesh is fixed when a job starts), interleaved round by round so that drift in the
machine hits every layout alike. Each job takes `--warmup` steps, then measures `--steps`: the
median step time (rank 0; steps are synchronous), bytes sent per step per rank by kind (gradient
sync, tensor-parallel activations, pipeline activations), parameter bytes per rank, and under
pipelines the bubble (the idle part of the step of the stage that computes longest,
`gradmesh.layout.pipeline.schedules.bubble`) next to the formula (p - 1) / (v m + p - 1)
(v chunks per rank: 1 but for the interleaved layouts pp2i and pp4i), and every stage's idle
part (bubble plus waiting for a slower stage). A layout's figure is the median over rounds.

The machine's idle CPU during the measured steps is recorded (from /proc/stat): when it is
under 10 %, the layout is marked `"limit": "cpu"`: its time says more about the cores than
about the link. `--emulate-hosts H --bandwidth R` puts the ranks on H emulated hosts joined by
links of rate R (network namespaces, `tc tbf`), tensor-parallel groups spanning hosts when H
exceeds the hosts a group fits in.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import check_link, compare_jobs, limit_of, median, medians, report
from gradmesh.launch.jobs import emulated_cluster
from gradmesh.layout.config import Layout, chunks_of
from gradmesh.layout.pipeline.order import bubble_formula
from gradmesh.models.registry import is_token_model
from gradmesh.options import option
from gradmesh.planner.links import STATED_ERROR

LAYOUTS = {
    "dp": (1, 1),
    "tp2": (2, 1),
    "pp2": (1, 2),
    "tp4": (4, 1),
    "pp4": (1, 4),
}
"""name -> (tensor parallel, pipeline parallel); data parallel takes the rest of the world."""
SCHEDULED = {
    "pp2i": (1, 2, "interleaved"),
    "pp4i": (1, 4, "interleaved"),
    "pp2zb": (1, 2, "zb-h1"),
    "pp4zb": (1, 4, "zb-h1"),
    "pp2v": (1, 2, "zbv"),
    "pp4v": (1, 4, "zbv"),
}
"""Pipelines under a schedule of their own, whatever `--schedule` the others run: interleaved
(`--virtual-stages` chunks per rank), ZB-H1 and ZBV; not in the default list, asked for by
name."""
SPLITTING: dict[str, dict[str, Any]] = {
    "cp2": {"cp": 2},
    "cp4": {"cp": 4},
    "cp2a2a": {"cp": 2, "attention": "alltoall"},
    "cp4a2a": {"cp": 4, "attention": "alltoall"},
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
}
"""Context parallelism (ring, or all-to-all: a2a) and expert parallelism (a model with experts:
`--model-args experts=4`), data parallel the rest; each cp layout's bytes are printed beside
the formula's (`gradmesh.planner.axes_cost.context_bytes`)."""
SHAPES = {
    **LAYOUTS,
    **{n: (tp, pp) for n, (tp, pp, _) in SCHEDULED.items()},
    **{n: (1, 1) for n in SPLITTING},
}
PLAN = "plan"
"""The layout `gradmesh plan` chooses (`gradmesh.planner.mesh`), measured like the
others; every layout's prediction is printed beside its measurement."""


@dataclass
class Config:
    """gradmesh bench layout: one model data-parallel, tensor-parallel and pipelined over the same
    ranks"""

    model: str = option(
        "alexnet", "model (gpt and hf:... train on text, and report tokens/s)", name=True
    )
    model_args: str = option("", "the model builder's keyword arguments, like depth=4")
    sequence_length: int = option(64, "token models: tokens per sample", at_least=1)
    synthetic_shape: str = option("3x32x32", "other models: the synthetic inputs' shape")
    synthetic_classes: int = option(10, "other models: the synthetic data's classes", at_least=1)
    world: int = option(4, "ranks", at_least=1)
    batch: int = option(64, "global batch", at_least=1)
    microbatches: int = option(8, "pipeline", at_least=1)
    schedule: str = option("1f1b", "the pp layouts' schedule: gpipe or 1f1b", name=True)
    virtual_stages: int = option(
        2, "the interleaved layouts (pp2i, pp4i): chunks per rank", at_least=1
    )
    steps: int = option(10, "measured steps", at_least=1)
    warmup: int = option(3, "warm-up steps", at_least=0)
    rounds: int = option(2, "interleaved rounds", at_least=1)
    layouts: str = option(
        ",".join([*LAYOUTS, PLAN]),
        f"which layouts (also {', '.join(SCHEDULED)}: interleaved 1F1B, ZB-H1 and ZBV; "
        f"{', '.join(SPLITTING)}; {PLAN}: the planner's)",
    )
    emulate_compute_ms: float = option(
        0.0,
        "each job's step computes this many ms longer, slept by the layers (`gradmesh train "
        "--emulate-compute-ms`): the schedules' bubbles without the cores' contention; the "
        "pipelines' rows then carry the simulator's step (`order.timeline`) beside the measured",
        at_least=0,
    )
    emulate_hosts: int | None = option(None, "emulated hosts", at_least=1)
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def _check(args: Config) -> list[str]:
    from gradmesh.errors import GradmeshError

    names = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(names) - {*SHAPES, PLAN})
    if unknown:
        valid = ", ".join([*SHAPES, PLAN])
        raise GradmeshError(f"unknown layout(s) {', '.join(unknown)} (valid: {valid})")
    for name in names:
        if name == PLAN:
            continue
        lay = _layout(args, name)
        if args.world % lay.shape.split or lay.dp < 1:
            raise GradmeshError(f"layout {name} needs a world that {lay.shape.split} divides")
    _refuse_unread(args, names)
    return names


def _refuse_unread(args: Config, names: list[str]) -> None:
    """The pipelines' options where no layout asked for reads them (the planner's search
    chooses its own micro-batches and schedule)."""
    from gradmesh.options import refuse_unread

    piped = [n for n in names if n != PLAN and SHAPES[n][1] > 1]
    plain = [n for n in piped if n not in SCHEDULED]  # under --schedule
    chunked = [n for n in piped if _layout(args, n).schedule == "interleaved"]
    asked = f"--layouts {args.layouts}"
    if not piped:
        pipelined = ", ".join(n for n in SHAPES if SHAPES[n][1] > 1)
        why = f"options of the pipelined layouts ({pipelined}); {asked} has none"
        refuse_unread(args, ("microbatches", "schedule", "virtual_stages"), why)
    if piped and not plain:
        refuse_unread(args, ("schedule",), f"the schedule of pp2 and pp4; {asked} run their own")
    if piped and not chunked:
        refuse_unread(
            args, ("virtual_stages",), f"the interleaved layouts' chunks; {asked} has none"
        )


def _layout(args: Config, name: str) -> Layout:
    if name in SPLITTING:
        sizes = SPLITTING[name]
        split = sizes.get("cp", 1) * sizes.get("ep", 1)
        return Layout(args.world // split, 1, 1, **sizes)
    tp, pp = SHAPES[name]
    if pp == 1:
        return Layout(args.world // tp, tp, 1)
    schedule = SCHEDULED[name][2] if name in SCHEDULED else args.schedule
    chunks = chunks_of(schedule, pp, args.virtual_stages)
    return Layout(args.world // (tp * pp), tp, pp, args.microbatches, schedule, chunks)


def _summary(args: Config, lay: Layout, runs: list[dict[str, Any]], cluster: Any) -> dict[str, Any]:
    """One layout's figures: medians over its rounds, the bubble beside its formula."""
    pipelined = lay.pp > 1
    figures = medians(runs, ["step_s", "cpu_idle", *(["bubble"] if pipelined else [])])
    return {
        "name": lay.name,
        **vars(lay),
        **figures,
        "bytes_per_step": runs[0]["bytes_per_step"],
        "param_bytes_per_rank": runs[0]["param_bytes_per_rank"],
        "bubble": figures["bubble"] if pipelined else None,
        "stage_idle": [median([r["stage_idle"][rank] for r in runs]) for rank in range(args.world)]
        if pipelined
        else None,
        "bubble_formula": bubble_formula(
            lay.pp, lay.microbatches, lay.chunks, lay.schedule or "1f1b"
        )
        if pipelined
        else None,
        "limit": limit_of(figures["cpu_idle"], cluster),
        "tokens_per_s": args.batch * args.sequence_length / figures["step_s"]
        if is_token_model(args.model)
        else None,
        **_formulas(args, lay),
        **_simulated(args, lay, figures["step_s"]),
    }


def _simulated(args: Config, lay: Layout, measured_s: float) -> dict[str, Any]:
    """Under emulated compute, a pipeline's step as the simulator runs its schedule action by
    action (`order.timeline`, the simulator's pipeline): the layers' sleeps (the emulated ms
    by FLOPs, per micro-batch) cut into stages as the balancer cuts them, W half a backward,
    transfers and the real arithmetic left out (the emulated compute is made to dwarf them)."""
    if lay.pp == 1 or not args.emulate_compute_ms:
        return {}
    from gradmesh.layout.pipeline.order import timeline
    from gradmesh.layout.pipeline.schedules import balance
    from gradmesh.layout.pipeline.zero_bubble import SPLIT
    from gradmesh.models.flops import layer_flops

    model, x, _, _, _ = _workload(args).build()
    layers = layer_flops(model, x[:1])
    total = sum(la.fwd_flops + la.bwd_flops for la in layers)
    kind, m, depth = lay.schedule or "1f1b", lay.microbatches, lay.pp * lay.chunks
    per = args.emulate_compute_ms / 1e3 / m / total  # seconds per FLOP of a micro-batch
    starts = [*balance([la.fwd_flops + la.bwd_flops for la in layers], depth), len(layers)]
    fwd = [per * sum(la.fwd_flops for la in layers[a:b]) for a, b in itertools.pairwise(starts)]
    bwd = [per * sum(la.bwd_flops for la in layers[a:b]) for a, b in itertools.pairwise(starts)]
    half = 0.5 if kind in SPLIT else 0.0
    costs = (fwd, [b * (1 - half) for b in bwd], [b * half for b in bwd])
    step = max(timeline(kind, lay.pp, m, costs, [0.0] * (depth - 1), lay.chunks))
    return {"simulated_step_s": step, "simulated_error": step / measured_s - 1}


def _formulas(args: Config, lay: Layout) -> dict[str, Any]:
    """A cp layout's bytes a step a rank by the formula (`context_bytes`), an ep layout's by
    the balanced dispatch's (`expert_bytes`), from one forward of the model."""
    if lay.cp == 1 and lay.ep == 1:
        return {}
    from gradmesh.data.batch import call
    from gradmesh.planner.axes_cost import context_bytes, expert_bytes, record_axes

    model, x, _, _, _ = _workload(args).build()
    seqs, experts = record_axes(model, x[:1], call)
    b = lay.micro(args.batch)
    if lay.cp > 1:
        return {"context_parallel_formula_bytes": context_bytes(seqs, lay, b)}
    return {"expert_parallel_formula_bytes": expert_bytes(experts, lay, b)}


def _line(name: str, r: dict[str, Any]) -> str:
    sent = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in r["bytes_per_step"].items())
    bubble = (
        f"  bubble {r['bubble']:.3f} (formula {r['bubble_formula']:.3f}; idle per rank "
        + " ".join(f"{v:.2f}" for v in r["stage_idle"])
        + ")"
        if r["bubble"] is not None
        else ""
    )
    rate = f" ({r['tokens_per_s']:.0f} tokens/s)" if r.get("tokens_per_s") else ""
    formula = "".join(
        f" ({kind} by the formula {r[f'{kind}_formula_bytes'] / 1e6:.2f})"
        for kind in ("context_parallel", "expert_parallel")
        if f"{kind}_formula_bytes" in r
    )
    predicted = (
        f" predicted {r['predicted_step_s'] * 1e3:.1f} ({r['prediction_error']:+.0%})"
        if r.get("predicted_step_s")
        else ""
    )
    if r.get("simulated_step_s"):
        predicted += f" simulated {r['simulated_step_s'] * 1e3:.1f} ({r['simulated_error']:+.0%})"
    return (
        f"{name:6} {r['name']}: step {r['step_s'] * 1e3:7.1f} ms{rate}"
        f"{predicted}  params/rank {r['param_bytes_per_rank'] / 1e6:5.2f} MB  MB/step/rank: "
        f"{sent}{formula}{bubble}  cpu idle {r['cpu_idle']:.2f} ({r['limit']})"
    )


def _plan(args: Config, named: dict[str, Layout], cluster: Any) -> Any:
    """The planner's `MeshPlan` on the jobs' own ranks (of `cluster`, or loopback), not yet
    calibrated: profiled here and priced on the links as a probe fits them, as `gradmesh plan
    --probe` does; the named layouts are profiled too."""
    from gradmesh.plan.probe import mesh_probe
    from gradmesh.plan.setting import Setting
    from gradmesh.planner import Search, plan_mesh

    setting = Setting(args.model, "", "", args.world, args.batch, args.world)
    probe = mesh_probe(cluster, args.world // (args.emulate_hosts or 1), setting)
    search = Search(also=list(named.values()))
    return plan_mesh(_workload(args), args.world, args.batch, probe, args.world, search)


def _measure(args: Config, named: dict[str, Layout], cluster: Any) -> dict[str, Any]:
    """Each named layout's figures, its jobs interleaved round by round."""
    from gradmesh.plan.calibrate import layout_job

    work = _workload(args)
    options = {**work.options, "model": work.name}
    if args.emulate_compute_ms:
        options["emulate_compute_ms"] = args.emulate_compute_ms
    configs = [
        layout_job(options, args.world, lay, args.steps, args.warmup) for lay in named.values()
    ]
    runs = compare_jobs("gradmesh.plan.calibrate", args.world, configs, args.rounds, cluster)
    return {
        n: _summary(args, lay, r, cluster) for (n, lay), r in zip(named.items(), runs, strict=True)
    }


def _workload(args: Config) -> Any:
    from gradmesh.plan.mesh import workload

    work = workload(
        args.model,
        args.model_args,
        "synthetic",
        args.sequence_length,
        args.synthetic_shape,
        args.batch,
    )
    work.options["synthetic_classes"] = args.synthetic_classes
    return work


def _check_plan(results: dict[str, dict[str, Any]], plan: Any) -> dict[str, Any]:
    """Whether the planner's choice measured the fastest, or within the planner's stated
    error (`STATED_ERROR`) of the fastest; the calibration it fitted and the layouts it
    priced."""
    fastest = min(results, key=lambda n: results[n]["step_s"])
    ratio = results[PLAN]["step_s"] / results[fastest]["step_s"]
    return {
        "fastest": fastest,
        "plan_over_fastest": ratio,
        "stated_error": STATED_ERROR,
        "ok": ratio <= 1 + STATED_ERROR,
        "prediction_errors": {n: r["prediction_error"] for n, r in results.items()},
        "calibration": vars(plan.calibration),
        "predicted": [p.row() for p in plan.predictions],
    }


def run(args: Config, _command: list[str] | None = None) -> int:
    check_link(args)
    names = _check(args)
    named = {n: _layout(args, n) for n in names if n != PLAN}
    with emulated_cluster(args.emulate_hosts, args.bandwidth) as cluster:
        plan = _plan(args, named, cluster) if PLAN in names else None
        if plan is not None:  # calibration layouts the rows do not measure are measured too
            from gradmesh.planner.mesh_cost import calibration_layouts

            wanted = calibration_layouts([p.layout for p in plan.predictions], args.world)
            extra = [lay for lay in wanted if lay not in named.values()]
            named.update({f"calibration {lay.name}": lay for lay in extra})
        runs = _measure(args, named, cluster)
        same = None
        if plan is not None:
            plan.calibrate({named[n]: r["step_s"] for n, r in runs.items()})
            choice = plan.predictions[0].layout
            same = next((n for n, lay in named.items() if lay == choice), None)
            named[PLAN] = choice
            if same is None:
                runs.update(_measure(args, {PLAN: choice}, cluster))
        notes = cluster.notes if cluster is not None else None
    results = dict(runs)
    if same:
        results[PLAN] = {**results[same], "same_as": same}
    base = results.get("dp")
    for n, r in results.items():
        if base is not None:
            r["speedup_vs_dp"] = base["step_s"] / r["step_s"]
            r["param_fraction_vs_dp"] = r["param_bytes_per_rank"] / base["param_bytes_per_rank"]
        if plan is not None:
            p = plan.predict(named[n])
            r["predicted_step_s"] = p.step_s
            r["prediction_error"] = p.step_s / r["step_s"] - 1
            r["prediction"] = p.row()
            r["calibration_layout"] = named[n].name in plan.calibration.fitted_on
    payload = {
        **{k: getattr(args, k) for k in ("model", "world", "batch", "steps", "schedule")},
        "emulated_hosts": args.emulate_hosts,
        "bandwidth": args.bandwidth if args.emulate_hosts else None,
        "rounds": args.rounds,
        "notes": notes,
        "layouts": results,
        "plan": _check_plan(results, plan) if plan is not None else None,
    }
    return report(args.json, payload, [_line(n, r) for n, r in results.items()])
