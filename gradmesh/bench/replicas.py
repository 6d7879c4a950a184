"""`gradmesh bench replicas`: replica groups whose average across groups goes through each
compressor, on emulated hosts: the lighthouse on host 0, one group (one worker) on each of hosts
1..G behind `--bandwidth` links, the same model, data, optimizer and steps for every method.

A method is a compressor of the per-step average, or `diloco:H:C`: DiLoCo across the groups
(`--strategy diloco --sync-every H --compression C`: a round every H steps). Per method
(interleaved rounds, medians): the groups' median step and mean step (the run's wall time
over its steps: DiLoCo's rounds are rare, long steps that a median leaves out), the bytes
each group sent a step (all of it crosses groups: a group has one worker), the test loss
after the steps, whether every group ended with the same parameters, and the machine's idle
CPU with its label (`cpu` when the cores were the limit, the hosts sharing this machine's:
that step time is not a link figure). Against `none` measured in the same run:
`bytes_ratio` (none's bytes over the method's), `step_speedup` and `mean_step_speedup`
(none's step over the method's) and `loss_gap` (the method's loss over none's, less 1).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import check_train_flags, interleaved, label, medians, report
from gradmesh.errors import GradmeshError
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.options import option
from gradmesh.units import parse_rate

PORT = 29600


@dataclass
class Config:
    """gradmesh bench replicas: the average across replica groups through each compressor on
    emulated hosts: bytes a step, step time, the loss after the same steps"""

    groups: int = option(3, "replica groups, one emulated host (one worker) each")
    bandwidth: str = option("100mbit", "link rate per host")
    methods: str = option(
        "none,fp16,int8,topk",
        "compressors, comma-separated (none first); diloco:H:C is DiLoCo across the groups, "
        "a round every H steps with compressor C",
    )
    model: str = option("gpt", "model", name=True)
    dataset: str = option("text", "dataset", name=True)
    batch_size: int = option(24, "the global batch, split over the groups")
    steps: int = option(150, "steps of each run")
    optimizer: str = option("adamw", "optimizer", name=True)
    lr: float = option(0.002, "learning rate")
    rounds: int = option(1, "interleaved rounds")
    json: str | None = option(None, "write the result here")


def _method(method: str) -> list[str]:
    """A method's flags: a compressor's name, or diloco:H:C (DiLoCo's rounds every H steps)."""
    kind, _, rest = method.partition(":")
    if kind != "diloco":
        return ["--compression", method]
    every, _, compression = rest.partition(":")
    if not every.isdigit() or not compression:
        raise GradmeshError(f"{method!r}: expected diloco:H:COMPRESSOR, like diloco:10:int8")
    return ["--strategy", "diloco", "--sync-every", every, "--compression", compression]


def _group(args: Config, g: int, lighthouse: str, method: str, out: Path) -> list[str]:
    return ["gradmesh", "train", "--workers", "1", "--batch-size", str(args.batch_size)] + [
        *("--model", args.model, "--dataset", args.dataset, "--optimizer", args.optimizer),
        *("--lr", str(args.lr), "--max-steps", str(args.steps), *_method(method)),
        *("--replica-group", str(g), "--replica-groups", str(args.groups)),
        *("--lighthouse", lighthouse, "--json", str(out / f"group{g}.json")),
    ]


def _run(args: Config, method: str, out: Path) -> dict[str, Any]:
    """One run of every group with `method`; the figures of the groups' reports."""
    out.mkdir(parents=True)
    with EmulatedCluster(hosts=args.groups + 1, bandwidth=args.bandwidth) as cluster:
        lighthouse = f"{cluster.address(0)}:{PORT}"
        keeper = cluster.start_on(
            0,
            ["gradmesh", "lighthouse", "--groups", str(args.groups), "--bind", cluster.address(0)]
            + ["--port", str(PORT), "--min-groups", str(args.groups)],
        )
        jobs = [
            cluster.start_on(g + 1, _group(args, g, lighthouse, method, out))
            for g in range(args.groups)
        ]
        codes = [job.wait(timeout=1800) for job in jobs]
        keeper.procs[0].terminate()  # SIGTERM: a background shell leaves SIGINT ignored
        keeper.wait(timeout=30)
    if any(codes):
        raise GradmeshError(f"the {method} run's groups ended with codes {codes}")
    reports = [json.loads((out / f"group{g}.json").read_text()) for g in range(args.groups)]
    infos = [r["strategy_info"] for r in reports]
    return {
        "step_s": max(i["step_s_median"] for i in infos),
        "mean_step_s": max(r["wall_s"] for r in reports) / args.steps,  # DiLoCo's rounds too
        "bytes_per_group_step": max(r["bytes_sent"] for r in reports) / args.steps,
        "test_loss": reports[0]["test_loss"],
        "bit_equal": len({i["parameters_sha256"] for i in infos}) == 1,
        "cpu_idle": reports[0]["cpu_idle"],
    }


def run(args: Config, _command: list[str] | None = None) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or methods[0] != "none":
        raise GradmeshError(f"--methods must start with none (the reference), got {args.methods!r}")
    if min(args.groups - 1, args.steps, args.rounds) < 1:
        raise GradmeshError("--groups must be >= 2, --steps and --rounds >= 1")
    check_train_flags(_group(args, 0, "127.0.0.1:1", m, Path("."))[2:] for m in methods)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="gradmesh-replicas-") as tmp:
        for round_, m in interleaved(methods, args.rounds):
            runs[m].append(_run(args, m, Path(tmp) / f"{m}-{round_}"))
    figures: dict[str, dict[str, Any]] = {}
    for m, rs in runs.items():
        f = medians(rs, ["step_s", "mean_step_s", "bytes_per_group_step", "test_loss", "cpu_idle"])
        f["bit_equal"] = all(r["bit_equal"] for r in rs)
        f["wire_bytes_per_step"] = f["bytes_per_group_step"]
        label(f, parse_rate(args.bandwidth))  # cpu, link (its bytes fill it) or compute
        figures[m] = f
    none = figures["none"]
    for f in figures.values():
        f["bytes_ratio"] = none["bytes_per_group_step"] / f["bytes_per_group_step"]
        f["step_speedup"] = none["step_s"] / f["step_s"]
        f["mean_step_speedup"] = none["mean_step_s"] / f["mean_step_s"]
        f["loss_gap"] = f["test_loss"] / none["test_loss"] - 1
    payload = {
        "network": f"{args.groups} replica groups on emulated hosts at {args.bandwidth}, one "
        "worker each, the lighthouse on another",
        "setting": f"{args.model} on {args.dataset}, global batch {args.batch_size}, "
        f"{args.steps} steps, {args.optimizer} lr {args.lr}",
        "rounds": args.rounds,
        "methods": figures,
    }
    lines = [f"{payload['network']}; {payload['setting']}"] + [
        f"{m:14}: {f['bytes_per_group_step'] / 1e3:7.1f} kB/group/step ({f['bytes_ratio']:.1f}x "
        f"fewer), median step {f['step_s'] * 1e3:.1f} ms ({f['step_speedup']:.2f}x), mean "
        f"{f['mean_step_s'] * 1e3:.1f} ms ({f['mean_step_speedup']:.2f}x), test loss "
        f"{f['test_loss']:.4f} ({f['loss_gap'] * 100:+.1f} %), groups bit-equal "
        f"{'yes' if f['bit_equal'] else 'NO'}, cpu idle {f['cpu_idle']:.2f} ({f['limit']})"
        for m, f in figures.items()
    ]
    return report(args.json, payload, lines)
