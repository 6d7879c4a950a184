"""`gradmesh bench plan`: the hybrid planner's plan against pure data parallelism, pure tensor
parallelism and the rule "convolutions data-parallel, fully connected layers split", each
measured next to the planner's prediction for it.

The links are probed first (on the emulated cluster when `--emulate-hosts` is given, else on
loopback), the model is profiled on this machine, and the planner predicts a step time for
each of the four placements. Each is then a job of its own (a mesh is fixed when a job starts),
interleaved round by round (a placement chosen twice, as when the planner's plan is a
reference's, is one job measured once); a job takes `--warmup` steps, then measures `--steps`
through the trainer's own setup (split, optimizer, strategy). A placement's figure is the
median over rounds of each job's median step (rank 0; steps are synchronous). The JSON holds,
per placement, the measured and predicted step, the prediction's error, the step's time outside
communication calls on its slowest rank (`outside_comm_s`), the bytes sent per step by kind,
and the machine's idle CPU during the measured steps: under 10 % the figure is labelled
`"limit": "cpu"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import check_link, compare_jobs, limit_of, medians, report
from gradmesh.launch.jobs import emulated_cluster, worker_main
from gradmesh.options import option
from gradmesh.train.timing import timed_steps


@dataclass
class Config:
    """gradmesh bench plan: the hybrid planner's plan against data, tensor parallelism and the
    rule: measured"""

    model: str = option("alexnet", "model", name=True)
    dataset: str = option("synthetic", "dataset", name=True)
    synthetic_shape: str = option("3x32x32", "synthetic input shape")
    world: int = option(4, "ranks", at_least=1)
    batch: int = option(64, "global batch", at_least=1)
    steps: int = option(10, "measured steps", at_least=1)
    warmup: int = option(3, "warm-up steps", at_least=0)
    rounds: int = option(3, "interleaved rounds", at_least=1)
    emulate_hosts: int | None = option(None, "emulated hosts", at_least=1)
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def measure(config: dict[str, Any]) -> tuple[int, Any]:
    """One placement's job, on one rank: the trainer's setup with the plan, steps on one fixed
    global batch, the bytes sent per step by kind."""
    from gradmesh.plan.setting import Setting, placement_config
    from gradmesh.runtime.world import init, shutdown
    from gradmesh.train.finish import layout_figures
    from gradmesh.train.rank_stats import gather_rank_stats, summarize_layout
    from gradmesh.train.setup import attach, setup

    setting = Setting(**config["setting"])
    rt = init(tensor_parallel=config["tp"])
    job = setup(placement_config(setting, config["tp"], config["layers"]), rt)
    attach(job)
    step_s, cpu_idle, outside = timed_steps(job, setting.batch, config["warmup"], config["steps"])
    stats = gather_rank_stats(rt, 0.0, layout_figures(job, config["steps"]))
    mean = summarize_layout(stats.layout)
    result = {
        "step_s": step_s,
        "bytes_per_step": {k: mean[f"{k}_bytes_per_step"] for k in ("sync", "tensor_parallel")},
        "param_bytes_per_rank": mean["param_bytes"],
        "cpu_idle": cpu_idle,
        "outside_comm_s": outside,
    }
    shutdown()
    return rt.rank, result


def _measure(args: Config, setting: Any, choices: list[Any], cluster: Any) -> dict[str, Any]:
    """Each distinct placement as a job, interleaved; its runs by placement. A placement chosen
    twice (the planner's plan is often a reference's) is one job, measured once, so that the
    comparison between them is not noise between two runs."""
    import dataclasses

    first: dict[str, Any] = {}  # a placement -> the first choice that has it
    for choice in choices:
        first.setdefault(_placement(choice), choice)
    configs = [
        {
            "setting": dataclasses.asdict(setting),
            "tp": choice.tp,
            "layers": choice.layers,
            "steps": args.steps,
            "warmup": args.warmup,
        }
        for choice in first.values()
    ]
    measured = compare_jobs("gradmesh.bench.plan", args.world, configs, args.rounds, cluster)
    return {"first": first, "runs": dict(zip(first, measured, strict=True))}


def _result(
    args: Config, choice: Any, runs: list[dict[str, Any]], shared: str, cluster: Any
) -> dict[str, Any]:
    """A placement's measured step (the median over rounds) next to its prediction."""
    figures = medians(runs, ["step_s", "cpu_idle", "outside_comm_s"])
    step, predicted = figures["step_s"], choice.prediction.step_s
    return {
        "tp": choice.tp,
        "dp": args.world // choice.tp,
        "layers": choice.layers,
        **figures,
        "step_s_rounds": [r["step_s"] for r in runs],
        "predicted_step_s": predicted,
        "prediction_error": (predicted - step) / step,
        "predicted": {
            "compute_s": choice.prediction.compute_s,
            "blocking_comm_s": choice.prediction.blocking_comm_s,
            "exposed_sync_s": choice.prediction.exposed_sync_s,
        },
        "bytes_per_step": runs[0]["bytes_per_step"],
        "param_bytes_per_rank": runs[0]["param_bytes_per_rank"],
        "same_placement_as": shared if shared != choice.name else None,
        "limit": limit_of(figures["cpu_idle"], cluster),
    }


def _link(links: Any, sizes: list[int]) -> dict[str, Any]:
    return {
        "alpha": links.inter.alpha,
        "beta": links.inter.beta,
        "gamma": links.inter.gamma,
        "by_group_size": {
            p: [{"up_to_bytes": n, "alpha": c.alpha, "beta": c.beta} for n, c in curve]
            for p, curve in links.inter_by_size.items()
        },
        "fitted_at_bytes": sizes,
    }


def _lines(results: dict[str, Any], payload: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in results.items():
        sent = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in r["bytes_per_step"].items())
        same = f"  (= {r['same_placement_as']}: one job)" if r["same_placement_as"] else ""
        lines.append(
            f"{name:16} tp{r['tp']} dp{r['dp']}: step {r['step_s'] * 1e3:7.1f} ms, predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ({r['prediction_error'] * 100:+.0f}%)  MB/step/"
            f"rank: {sent}  cpu idle {r['cpu_idle']:.2f} ({r['limit']}){same}"
        )
    lines.append(
        f"planner: {payload['planner_vs_fastest']:.2f}x the fastest, "
        f"{payload['planner_vs_data_parallel']:.2f}x data parallelism; worst prediction error "
        f"{payload['worst_prediction_error'] * 100:.0f}%"
    )
    return lines


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.errors import GradmeshError
    from gradmesh.plan.command import describe, make_plan
    from gradmesh.plan.probe import ProbeRequest, probe_links
    from gradmesh.plan.setting import Setting
    from gradmesh.planner import Links

    check_link(args)
    if args.world < 1 or args.batch < args.world or min(args.steps, args.rounds) < 1:
        raise GradmeshError("--world, --steps, --rounds must be >= 1 and --batch >= --world")
    setting = Setting(
        args.model, args.dataset, args.synthetic_shape, args.world, args.batch, args.world
    )
    with emulated_cluster(args.emulate_hosts, args.bandwidth) as cluster:
        hosts = cluster.hosts if cluster is not None else 1
        probed: list[tuple[Links, ProbeRequest, float]] = []

        def probe(request: ProbeRequest) -> tuple[Links, float]:
            links, outside = probe_links(request, cluster, args.world // hosts)
            probed.append((links, request, outside))
            return links, outside

        best, refs, prof, links = make_plan(setting, probe, args.world)
        print(describe(best, refs, prof))
        choices = [best, *refs]
        measured = _measure(args, setting, choices, cluster)
        notes = cluster.notes if cluster is not None else None
        results = {}
        for choice in choices:
            key = _placement(choice)
            runs, shared = measured["runs"][key], measured["first"][key].name
            results[choice.name] = _result(args, choice, runs, shared, cluster)
    _, request, outside = probed[0]
    fastest = min(r["step_s"] for r in results.values())
    payload = {
        "model": args.model,
        "world": args.world,
        "batch": args.batch,
        "emulated_hosts": args.emulate_hosts,
        "bandwidth": args.bandwidth if args.emulate_hosts else None,
        "link": _link(links, request.sizes),
        "profiled_concurrently": prof.concurrent,
        "update_s_per_byte": prof.update_s_per_byte,
        "probe_outside_comm_s": outside,
        "step_overhead_s": prof.step_overhead_s,
        "rounds": args.rounds,
        "steps": args.steps,
        "notes": notes,
        "placements": results,
        "planner_vs_fastest": results["planner"]["step_s"] / fastest,
        "planner_vs_data_parallel": results["planner"]["step_s"]
        / results["data parallel"]["step_s"],
        "worst_prediction_error": max(abs(r["prediction_error"]) for r in results.values()),
    }
    return report(args.json, payload, _lines(results, payload))


def _placement(choice: Any) -> str:
    import json

    return json.dumps([choice.tp, choice.layers], sort_keys=True)


if __name__ == "__main__":
    worker_main(measure)
