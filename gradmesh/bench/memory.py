"""`gradmesh bench memory`: what activation checkpointing saves and what it costs, per worker
(and with `--world W`, what each rank holds under sharded data parallelism:
`gradmesh.bench.memory_ranks`).

One process takes training steps (forward, backward) of the model on a fixed batch under each
of `--modes` (`none`: every activation kept; `every:K`, `blocks`, `attention`:
`--activation-checkpointing`'s values) and each of `--precisions` (`bf16`: the forward under
bf16 autocast, as `--precision bf16` runs it), interleaved over `--rounds`: the median step
time, and the step's peak of live tensor bytes on the CPU. The peak is read off torch's profiler
(`profile_memory=True`: the allocator's every allocation and free, summed in time order,
`gradmesh.layout.memory.peak_bytes`): what the step adds on top of the weights
and their gradients, which are allocated before it. It is the same every round (deterministic);
the time is a median. One thread, as a worker of the suite's; layouts divide the figure further
(tensor parallelism: the activations of split layers; a pipeline: the micro-batches in flight).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import interleaved, median, report
from gradmesh.errors import GradmeshError
from gradmesh.options import option, refuse_unread


@dataclass
class Config:
    """gradmesh bench memory: activation checkpointing's memory and time, per worker"""

    model: str = option("gpt", "model (built-in name or pkg.module:factory)", name=True)
    model_args: str = option("dim=128,depth=8,heads=4", "the model builder's keyword arguments")
    batch: int = option(16, "samples per step", at_least=1)
    sequence_length: int = option(128, "token models: tokens per sample", at_least=1)
    modes: str = option(
        "none,every:2,blocks", "none, blocks, every:K or attention, comma-separated"
    )
    precisions: str = option(
        "fp32", "fp32 and/or bf16 (forward under bf16 autocast), comma-separated"
    )
    steps: int = option(5, "timed steps per mode and round", at_least=1)
    warmup: int = option(2, "untimed steps per mode first", at_least=0)
    rounds: int = option(3, "interleaved rounds", at_least=1)
    world: int = option(
        1, "ranks: above 1, each of --layouts is a job of this many ranks", at_least=1
    )
    layouts: str = option(
        "dp,zero1,zero2,zero3,zero3+ac,dpxtp2,zero3xtp2",
        "with --world: dp or zero1-3, with xtpT (tensor parallel), xcpC (context parallel) "
        "and +ac (checkpointing)",
    )
    limit: str | None = option(
        None,
        "with --world: hold every rank to this much memory (a cgroup; binary units: 700MB, "
        "2GB) and say which layouts train within it and which the kernel kills for going over",
    )
    json: str | None = option(None, "write the result here")


def _run_ranks(args: Config) -> int:
    from gradmesh.bench.memory_ranks import limited_line, line, run_ranks
    from gradmesh.planner.mesh_memory import parse_layout

    names = [n for n in args.layouts.split(",") if n]
    for n in names:
        parse_layout(n, args.world)  # one line before any job starts
    if args.limit:
        from gradmesh.launch.cgroup import problem
        from gradmesh.units import parse_size

        parse_size(args.limit)
        if (trouble := problem()) is not None:
            raise GradmeshError(f"--limit: cannot enforce a memory limit: {trouble}")
    results = run_ranks(args, names)
    payload = {
        **{k: getattr(args, k) for k in ("model", "model_args", "batch", "sequence_length")},
        **{"world": args.world, "rounds": args.rounds, "optimizer": "adamw"},
        "layouts": results,
    }
    describe = limited_line if args.limit else line
    return report(args.json, payload, [describe(n, r) for n, r in results.items()])


def _steps(args: Config) -> dict[str, Any]:
    """Per mode, its training step on its own copy of the model (the same weights)."""
    import torch

    from gradmesh.layout.engine import PlainEngine
    from gradmesh.layout.memory import checkpoint_blocks
    from gradmesh.layout.pipeline.engine import HALF
    from gradmesh.models.registry import is_token_model
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.setup import load_data, loss_of, model_of

    config = TrainConfig.of(
        model=args.model,
        model_args=args.model_args,
        dataset="text" if is_token_model(args.model) else "synthetic",
        sequence_length=args.sequence_length,
        synthetic_shape="3x32x32",
        synthetic_samples=args.batch * 2,
    )
    data = load_data(config)
    torch.manual_seed(0)
    base = model_of(config, data)
    x, y, loss_fn = data.train.x[: args.batch], data.train.y[: args.batch], loss_of(config)
    steps = {}
    for mode in [m for m in args.modes.split(",") if m]:
        for precision in [p for p in args.precisions.split(",") if p]:
            model = copy.deepcopy(base)
            if mode != "none":
                checkpoint_blocks(model, mode, args.model)
            for p in model.parameters():  # allocated now, accumulated into: not the step's bytes
                p.grad = torch.zeros_like(p)
            engine = PlainEngine(model, 1, loss_fn, HALF.get(precision))
            key = mode if precision == "fp32" else f"{mode}+{precision}"
            steps[key] = lambda engine=engine: engine.step(x, y, 1.0)
    return steps


def run(args: Config, _command: list[str] | None = None) -> int:
    import torch

    from gradmesh.layout.memory import peak_bytes

    if args.limit and args.world < 2:
        raise GradmeshError("--limit holds each rank of a --world job: give --world 2 or more")
    if args.world > 1:
        refuse_unread(
            args, ("modes", "precisions"), "options of one process; a --world job runs --layouts"
        )
        return _run_ranks(args)
    refuse_unread(args, ("layouts",), "options of a --world job (2 or more ranks)")
    from gradmesh.runtime.process import cpu_jiffies, idle_since

    torch.set_num_threads(1)
    steps = _steps(args)
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    cpu = cpu_jiffies()
    for _, mode in interleaved(list(steps), args.rounds):
        for _ in range(args.warmup):
            steps[mode]()
        started = time.perf_counter()
        for _ in range(args.steps):
            steps[mode]()
        times[mode].append((time.perf_counter() - started) / args.steps)
    idle = idle_since(cpu)
    results = {
        mode: {"step_s": median(times[mode]), "peak_bytes": peak_bytes(step)}
        for mode, step in steps.items()
    }
    base = results.get("none")
    for r in results.values():
        if base is not None:
            r["memory_vs_none"] = r["peak_bytes"] / base["peak_bytes"]
            r["time_vs_none"] = r["step_s"] / base["step_s"]
    payload = {
        **{k: getattr(args, k) for k in ("model", "model_args", "batch", "sequence_length")},
        "rounds": args.rounds,
        "cpu_idle": idle,
        "modes": results,
    }
    lines = [
        f"{mode:9} step {r['step_s'] * 1e3:7.1f} ms  peak {r['peak_bytes'] / 1e6:7.1f} MB"
        + (
            f"  ({r['memory_vs_none']:.2f}x the memory, {r['time_vs_none']:.2f}x the time)"
            if "memory_vs_none" in r
            else ""
        )
        for mode, r in results.items()
    ]
    return report(args.json, payload, [*lines, f"cpu idle {idle:.2f} (one process, one thread)"])
