"""`gradmesh bench memory --world W`: what each rank holds under sharded data parallelism.

One job per layout of `--layouts` (the planner's job, `gradmesh.plan.calibrate`, with
`memory_figures`; `dp`: plain data parallelism; `zero1`, `zero2`, `zero3`:
`--zero-stage`; a `+ac` suffix adds `--activation-checkpointing blocks`; `dpxtp2` and
`zero3xtp2`: with tensor parallelism 2, dp the rest), interleaved over `--rounds`: the
trainer's own setup (AdamW), `--warmup` then `--steps` steps on one fixed global batch, the
median step, and then, on every rank, the bytes it holds at rest (parameters, gradients,
optimizer state: DTensor shards as held, `gradmesh.sync.sharded.model.state_bytes`) and the peak
of one more step's live tensor bytes (`peak_bytes`, the profiler's) on top of them. Rank 0's
figures are reported (the ranks hold the same to within a shard's padding).

The state is predicted beside its measurement from the whole model's parameter bytes P (fp32),
AdamW's two slots, tp T and dp N: parameters P/T, gradients P/T, optimizer state 2P/T; stage 1
divides the optimizer state by N, stages 2 and 3 all three (FSDP2 keeps parameters sharded
between steps at both stages; they differ inside the step, where stage 2 keeps the gathered
units from forward to backward). The step's peak is predicted beside it by the mesh planner's
memory model (`gradmesh.planner.mesh_memory.predict_memory`, from a profile of the
model's slices taken in this process: what each block saves per sample, the step's transient,
the units FSDP2 gathers).
"""

from __future__ import annotations

import itertools
from typing import Any

from gradmesh.bench.harness import compare_jobs, limit_of, medians
from gradmesh.layout.context.chunks import check_length
from gradmesh.planner.mesh_memory import named_layout, parse_layout
from gradmesh.units import parse_size


def predicted(
    param_bytes: int, stage: int, tp: int, dp: int, slots: int = 2, cp: int = 1
) -> dict[str, float]:
    """The state a rank holds at rest (the module docstring's formulas; stages 2 and 3 shard
    over dp x cp, stage 1 over dp)."""
    whole = param_bytes / tp
    shard = whole / (dp * cp)
    return {
        "param_bytes": shard if stage >= 2 else whole,
        "grad_bytes": shard if stage >= 2 else whole,
        "optimizer_bytes": slots * (shard if stage >= 2 else whole / dp if stage else whole),
    }


def run_ranks(args: Any, names: list[str]) -> dict[str, Any]:
    """Every layout's figures at `args.world` ranks, beside the predicted state."""
    from gradmesh.plan.calibrate import layout_job
    from gradmesh.plan.mesh import workload

    work = workload(
        args.model,
        args.model_args,
        "synthetic",
        args.sequence_length,
        "3x32x32",
        args.batch,
        "adamw",
    )
    layouts = {n: parse_layout(n, args.world) for n in names}
    for name, lay in layouts.items():  # the trainer's check of a cp layout, before launch
        if lay["cp"] > 1:
            check_length(args.sequence_length, lay["cp"], f"layout {name}: ")
    grids = {name: named_layout(name, args.world) for name in layouts}
    options = {**work.options, "model": work.name}
    configs = [
        layout_job(options, args.world, grid, args.steps, args.warmup, True)
        for grid in grids.values()
    ]
    if args.limit:
        return {
            n: limited(c, args.world, parse_size(args.limit))
            for n, c in zip(layouts, configs, strict=True)
        }
    runs = compare_jobs("gradmesh.plan.calibrate", args.world, configs, args.rounds)
    steps = predicted_steps(work, args.world, args.batch, grids)
    results = {}
    for (name, lay), rs in zip(layouts.items(), runs, strict=True):
        r = {**lay, **medians(rs, ["step_s", "cpu_idle"])}
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "peak_bytes"):
            r[key] = rs[0][key]
        r["state_bytes"] = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        dp = args.world // (lay["tp"] * lay["cp"])
        want = predicted(rs[0]["model_param_bytes"], lay["stage"], lay["tp"], dp, cp=lay["cp"])
        r["predicted"] = {**want, "state_bytes": sum(want.values())}
        r["prediction_error"] = r["predicted"]["state_bytes"] / r["state_bytes"] - 1
        step = steps[name]
        r["predicted"] |= {"step_peak_bytes": step.step_bytes, **vars(step)}
        r["step_peak_error"] = step.step_bytes / r["peak_bytes"] - 1
        r["limit"] = limit_of(r["cpu_idle"], None)
        results[name] = r
    base = results.get("dp")
    for r in results.values():
        if base is not None:
            r["state_vs_dp"] = r["state_bytes"] / base["state_bytes"]
            r["time_vs_dp"] = r["step_s"] / base["step_s"]
    return results


def predicted_steps(work: Any, world: int, batch: int, grids: dict[str, Any]) -> dict[str, Any]:
    """Each layout's predicted memory (`predict_memory`: its step peak is what a step holds on
    top of the state), from a profile of the model's slices at the layouts' tp degrees and
    micro-batches, taken in this process."""
    from gradmesh.planner.mesh import profile_mesh
    from gradmesh.planner.mesh_memory import predict_memory

    tps = sorted({g.tp for g in grids.values()})
    prof, _ = profile_mesh(work, world, batch, tps, 1, list(grids.values()), 1, search=False)
    return {name: predict_memory(prof, g) for name, g in grids.items()}


def limited(config: dict[str, Any], world: int, limit: int) -> dict[str, Any]:
    """One job of `config` with every rank held to `limit` bytes (`gradmesh.launch.cgroup`):
    whether it trained, each rank's peak charged memory, and the ranks the kernel killed for
    going over."""
    import os

    from gradmesh.errors import GradmeshError
    from gradmesh.launch import cgroup
    from gradmesh.launch.jobs import run_workers

    prefix = f"gmesh-limit-{os.getpid()}-{next(_JOBS)}-rank"
    # glibc raises its mmap threshold as big blocks are freed, then serves them from the heap,
    # which it keeps: a rank's resident peak would be its high-water mark, not what it holds.
    # Fixed at 128 KiB, freed tensors go back to the kernel (and a step pays their page faults).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    names = [f"{prefix}{r}" for r in range(world)]
    try:
        for name in names:
            cgroup.create(name, limit)
        try:
            # no profiler (`memory`): its records would be charged to the ranks too
            job = {**config, "memory": False, "memory_cgroup": prefix}
            result = run_workers("gradmesh.plan.calibrate", world, job, 600.0)
            failure = None
        except GradmeshError as exc:
            result, failure = {}, str(exc)
        used = [cgroup.usage(name) for name in names]
    finally:
        for name in names:
            if (cgroup.ROOT / name).exists():
                cgroup.remove(name)
    killed = [r for r, u in enumerate(used) if u["oom_kills"]]
    if failure is not None and not killed:
        raise GradmeshError(failure)
    return {
        "limit_bytes": limit,
        "fits": failure is None,
        "oom_killed_ranks": killed,
        "charged_peak_bytes": [u["peak_bytes"] for u in used],
        "step_s": result.get("step_s"),
    }


_JOBS = itertools.count()


def limited_line(name: str, r: dict[str, Any]) -> str:
    peak = max(r["charged_peak_bytes"]) / 2**20
    limit = r["limit_bytes"] / 2**20
    if r["fits"]:
        return (
            f"{name:10} trained within {limit:.0f} MiB a rank: peak {peak:.0f} MiB charged, "
            f"step {r['step_s'] * 1e3:.1f} ms"
        )
    return (
        f"{name:10} out of memory at {limit:.0f} MiB a rank: the kernel killed rank(s) "
        f"{', '.join(map(str, r['oom_killed_ranks']))} (peak {peak:.0f} MiB charged)"
    )


def line(name: str, r: dict[str, Any]) -> str:
    vs = (
        f" ({r['state_vs_dp']:.2f}x dp's state, {r['time_vs_dp']:.2f}x its step)"
        if "state_vs_dp" in r
        else ""
    )
    mb = {k: r[k] / 1e6 for k in ("state_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")}
    return (
        f"{name:10} state {mb['state_bytes']:6.2f} MB (predicted "
        f"{r['predicted']['state_bytes'] / 1e6:6.2f}, {r['prediction_error']:+.1%}: params "
        f"{mb['param_bytes']:.2f}, grads {mb['grad_bytes']:.2f}, optimizer "
        f"{mb['optimizer_bytes']:.2f})  step peak {r['peak_bytes'] / 1e6:6.1f} MB (predicted "
        f"{r['predicted']['step_peak_bytes'] / 1e6:6.1f}, {r['step_peak_error']:+.1%})  "
        f"step {r['step_s'] * 1e3:6.1f} ms{vs}  cpu idle {r['cpu_idle']:.2f} ({r['limit']})"
    )
