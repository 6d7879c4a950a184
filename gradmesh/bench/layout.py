"""`gradmesh bench layout`: one model under every way of splitting it over the same ranks.

Pure data parallelism, tp 2 x dp 2, pp 2 x dp 2, tp 4 and pp 4 (on `--world` 4), each a job of
its own (a mesh is fixed when a job starts), interleaved round by round so that drift in the
machine hits every layout alike. Each job takes `--warmup` steps, then measures `--steps`: the
median step time (rank 0; steps are synchronous), bytes sent per step per rank by kind (gradient
sync, tensor-parallel activations, pipeline activations), parameter bytes per rank, and under
pipelines the bubble (the idle part of the step of the stage that computes longest,
`gradmesh.layout.pipeline.bubble`) next to the formula (p - 1) / (v m + p - 1) (v chunks per
rank: 1 but for the interleaved layouts pp2i and pp4i), and every stage's idle part (bubble
plus waiting for a slower stage). A layout's figure is the median over rounds.

The machine's idle CPU during the measured steps is recorded (from /proc/stat): when it is
under 10 %, the layout is marked `"limit": "cpu"`: its time says more about the cores than
about the link. `--emulate-hosts H --bandwidth R` puts the ranks on H emulated hosts joined by
links of rate R (network namespaces, `tc tbf`), tensor-parallel groups spanning hosts when H
exceeds the hosts a group fits in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import compare_jobs, limit_of, median, medians, report
from gradmesh.launch.jobs import emulated_cluster, worker_main
from gradmesh.layout.config import bubble_formula
from gradmesh.options import option
from gradmesh.train.timing import timed_steps

LAYOUTS = {
    "dp": (1, 1),
    "tp2": (2, 1),
    "pp2": (1, 2),
    "tp4": (4, 1),
    "pp4": (1, 4),
}
"""name -> (tensor parallel, pipeline parallel); data parallel takes the rest of the world."""
INTERLEAVED = {"pp2i": (1, 2), "pp4i": (1, 4)}
"""Pipelines under the interleaved schedule (`--virtual-stages` chunks per rank), whatever
`--schedule` the others run: not in the default list, asked for by name."""
SHAPES = {**LAYOUTS, **INTERLEAVED}


@dataclass
class Config:
    """gradmesh bench layout: one model data-parallel, tensor-parallel and pipelined over the same
    ranks"""

    model: str = option(
        "alexnet", "model (gpt and hf:... train on text, and report tokens/s)", name=True
    )
    model_args: str = option("", "the model builder's keyword arguments, like depth=4")
    sequence_length: int = option(64, "token models: tokens per sample")
    world: int = option(4, "ranks")
    batch: int = option(64, "global batch")
    microbatches: int = option(8, "pipeline")
    schedule: str = option("1f1b", "gpipe or 1f1b", name=True)
    virtual_stages: int = option(2, "the interleaved layouts (pp2i, pp4i): chunks per rank")
    steps: int = option(10, "measured steps")
    warmup: int = option(3, "warm-up steps")
    rounds: int = option(2, "interleaved rounds")
    layouts: str = option(
        ",".join(LAYOUTS), f"which layouts (also {', '.join(INTERLEAVED)}: interleaved 1F1B)"
    )
    emulate_hosts: int | None = option(None, "emulated hosts")
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def measure(config: dict[str, Any]) -> tuple[int, Any]:
    """One layout's job, on one rank: the trainer's own setup (split, optimizer, strategy),
    steps on one fixed global batch, and the trainer's layout figures."""

    from gradmesh.runtime.world import init, shutdown
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.finish import layout_figures
    from gradmesh.train.report import gather_rank_stats, summarize_layout
    from gradmesh.train.setup import attach, setup

    tp, pp = config["tp"], config["pp"]
    batch = config["batch"]
    train = TrainConfig.of(
        workers=config["world"],
        model=config["model"],
        model_args=config["model_args"],
        dataset="text" if tokens(config["model"]) else "synthetic",
        sequence_length=config["sequence_length"],
        synthetic_shape="3x32x32",
        synthetic_samples=batch * 2,  # 80% of it for training: one global batch fits
        batch_size=batch,
        lr=0.01,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        microbatches=config["microbatches"] if pp > 1 else 1,
        schedule=config["schedule"],
        virtual_stages=config["virtual_stages"],
    )
    rt = init(tensor_parallel=tp, pipeline_parallel=pp)
    job = setup(train, rt)
    attach(job)
    step_s, cpu_idle, _ = timed_steps(job, batch, config["warmup"], config["steps"])
    stats = gather_rank_stats(rt, 0.0, layout_figures(job, config["steps"]))
    mean = summarize_layout(stats.layout)
    kinds = ("sync", "tensor_parallel", "pipeline")
    result = {
        "step_s": step_s,
        "bytes_per_step": {k: mean[f"{k}_bytes_per_step"] for k in kinds},
        "param_bytes_per_rank": mean["param_bytes"],
        "bubble": mean["bubble"] if pp > 1 else None,
        "stage_idle": stats.layout["stage_idle"] if pp > 1 else None,
        "cpu_idle": cpu_idle,
    }
    shutdown()
    return rt.rank, result


def tokens(model: str) -> bool:
    """Whether `model` is a language model (trained on the text dataset, measured in tokens)."""
    from gradmesh.models.registry import TOKEN_MODELS

    return model in TOKEN_MODELS or model.startswith("hf:")


def _check(args: Config) -> list[str]:
    from gradmesh.errors import GradmeshError

    names = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        raise GradmeshError(f"unknown layout(s) {', '.join(unknown)} (valid: {', '.join(SHAPES)})")
    for name in names:
        tp, pp = SHAPES[name]
        if args.world % (tp * pp):
            raise GradmeshError(f"layout {name} needs a world that {tp * pp} divides")
    return names


def _summary(args: Config, name: str, runs: list[dict[str, Any]], cluster: Any) -> dict[str, Any]:
    """One layout's figures: medians over its rounds, the bubble beside its formula."""
    tp, pp = SHAPES[name]
    m = args.microbatches if pp > 1 else 1
    pipelined = pp > 1
    chunks = args.virtual_stages if name in INTERLEAVED else 1
    figures = medians(runs, ["step_s", "cpu_idle", *(["bubble"] if pipelined else [])])
    return {
        "dp": args.world // (tp * pp),
        "tp": tp,
        "pp": pp,
        "microbatches": m,
        "schedule": ("interleaved" if chunks > 1 else args.schedule) if pipelined else None,
        "chunks": chunks,
        **figures,
        "bytes_per_step": runs[0]["bytes_per_step"],
        "param_bytes_per_rank": runs[0]["param_bytes_per_rank"],
        "bubble": figures["bubble"] if pipelined else None,
        "stage_idle": [median([r["stage_idle"][rank] for r in runs]) for rank in range(args.world)]
        if pipelined
        else None,
        "bubble_formula": bubble_formula(pp, m, chunks) if pipelined else None,
        "limit": limit_of(figures["cpu_idle"], cluster),
        "tokens_per_s": args.batch * args.sequence_length / figures["step_s"]
        if tokens(args.model)
        else None,
    }


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
    return (
        f"{name:4} dp{r['dp']} tp{r['tp']} pp{r['pp']}: step {r['step_s'] * 1e3:7.1f} ms{rate}  "
        f"params/rank {r['param_bytes_per_rank'] / 1e6:5.2f} MB  MB/step/rank: {sent}"
        f"{bubble}  cpu idle {r['cpu_idle']:.2f} ({r['limit']})"
    )


def run(args: Config, _command: list[str] | None = None) -> int:
    names = _check(args)
    keys: tuple[str, ...] = ("world", "model", "batch", "microbatches", "schedule", "steps")
    keys += ("warmup", "model_args", "sequence_length", "virtual_stages")
    common = {k: getattr(args, k) for k in keys}
    configs = [
        {"tp": SHAPES[n][0], "pp": SHAPES[n][1], **common}
        | ({"schedule": "interleaved"} if n in INTERLEAVED else {})
        for n in names
    ]
    with emulated_cluster(args.emulate_hosts, args.bandwidth) as cluster:
        runs = compare_jobs("gradmesh.bench.layout", args.world, configs, args.rounds, cluster)
        notes = cluster.notes if cluster is not None else None
        results = {n: _summary(args, n, r, cluster) for n, r in zip(names, runs, strict=True)}
    base = results.get("dp")
    for r in results.values():
        if base is not None:
            r["speedup_vs_dp"] = base["step_s"] / r["step_s"]
            r["param_fraction_vs_dp"] = r["param_bytes_per_rank"] / base["param_bytes_per_rank"]
    payload = {
        **{k: common[k] for k in ("model", "world", "batch", "schedule", "steps")},
        "emulated_hosts": args.emulate_hosts,
        "bandwidth": args.bandwidth if args.emulate_hosts else None,
        "rounds": args.rounds,
        "notes": notes,
        "layouts": results,
    }
    return report(args.json, payload, [_line(n, r) for n, r in results.items()])


if __name__ == "__main__":
    worker_main(measure)
