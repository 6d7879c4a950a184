"""`gradmesh bench scaling`: each strategy at 1, 2, 4 ... emulated hosts (one worker per host,
each with the same batch: weak scaling), next to what `gradmesh simulate`'s model predicts for it.

Every (strategy, hosts) point is a `gradmesh train` job on its own emulated cluster (a
parameter-server job gets one more host for its server), interleaved round by round; a point's
figures are medians over rounds. Per point: time per iteration (training wall over the steps a
worker took), samples/s, scaling efficiency T(1)/T(n) and communication overhead T(n) - T(1),
T(1) being one worker alone (a 1-worker job, run every round), bytes sent per worker per step,
the test accuracy after `--epochs` (local SGD and asynchronous servers change the mathematics),
and the machine's idle CPU while the job trained (its report's `cpu_idle`): under 10 % the
point is labelled `"limit": "cpu"` (the hosts share this machine's cores), never passed off as
a network figure. `--emulate-compute MS` makes each step's compute MS longer by sleeping
(`gradmesh.train.emulated`), labelled EMULATED in the JSON, table and plot: 4 hosts on 2 cores
then leave the cores idle enough for the links to be the limit.

The prediction is the simulator's (`gradmesh.simulate.strategies.STRATEGIES`) given this
machine's own measured compute (the job's own compute seconds per step, spread over the layers
by their FLOPs) and the link probed on the same emulated hosts
(`gradmesh.plan.probe.probe_links`).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import (
    CPU_BOUND_IDLE,
    check_train_flags,
    emulated_train,
    interleaved,
    medians,
    report,
)
from gradmesh.errors import GradmeshError
from gradmesh.options import option
from gradmesh.units import parse_ints, parse_list

BASELINE = "one worker"


@dataclass
class Config:
    """gradmesh bench scaling: each strategy at 1, 2, 4 emulated hosts: efficiency, overhead, the
    simulator's prediction"""

    model: str = option("cnn", "model", name=True)
    strategies: str = option("allreduce,local-sgd,ps", "", name=True)
    hosts: str = option("1,2,4", "emulated host counts")
    bandwidth: str = option("1gbit", "link rate per host")
    batch_per_worker: int = option(32, "samples each worker computes per step (weak scaling)")
    epochs: int = option(8, "epochs per job")
    rounds: int = option(2, "interleaved rounds")
    emulate_compute: float = option(
        0.0,
        "EMULATED compute: each step sleeps MS more, spread over forward and backward (more "
        "hosts than cores without the cores becoming the limit)",
    )
    json: str | None = option(None, "write the study here")
    plot: str | None = option(None, "write efficiency and overhead against hosts here (PNG)")


def _flags(strategy: str, hosts: int, args: Config) -> list[str]:
    """The `gradmesh train` flags of `strategy`'s job of `hosts` workers."""
    flags = ["--strategy", "allreduce" if strategy == BASELINE else strategy]
    flags += ["--workers", str(hosts), "--batch-size", str(args.batch_per_worker * hosts)]
    flags += ["--model", args.model, "--epochs", str(args.epochs)]
    if args.emulate_compute:
        flags += ["--emulate-compute-ms", str(args.emulate_compute)]
    return flags + (["--servers", "1"] if strategy == "ps" else [])


def _train(strategy: str, hosts: int, args: Config, tmp: Path) -> dict[str, Any]:
    """One `gradmesh train` job of `hosts` workers, one per emulated host (and its server's for
    ps); its report and the machine's idle CPU fraction while it ran."""
    machines = hosts + (1 if strategy == "ps" else 0)
    out = tmp / f"{strategy}-{hosts}.json"
    report = emulated_train(_flags(strategy, hosts, args), machines, args.bandwidth, out, strategy)
    return {"report": report, "cpu_idle": report["cpu_idle"]}


def _point(run: dict[str, Any], steps: int) -> dict[str, float]:
    r = run["report"]
    return {
        "step_s": r["wall_s"] / steps,
        "compute_step_s": r["compute_s"] / steps,
        "comm_step_s": r["comm_s"] / steps,
        "bytes_per_worker_step": r["bytes_sent"] / steps,
        "test_accuracy": r["test_accuracy"],
        "cpu_idle": run["cpu_idle"],
    }


def _probe(hosts: int, args: Config, grad_bytes: int) -> Any:
    from gradmesh.plan.probe import ProbeRequest, probe_emulated
    from gradmesh.plan.setting import Setting

    setting = Setting(args.model, "digits", "", hosts, args.batch_per_worker * hosts, 1)
    sizes = sorted({16 << 10, max(16 << 10, grad_bytes)})
    request = ProbeRequest(setting, "native", sizes, [], {}, point_to_point=True)
    return probe_emulated(hosts, args.bandwidth, 1, request)[0]


def _predict(
    strategy: str,
    hosts: int,
    measured: dict[str, float],
    links: Any,
    layers: Any,
    args: Config,
) -> float:
    """The simulator's step for this point, given its measured compute and the probed link."""
    from gradmesh.simulate.devices import Device
    from gradmesh.simulate.profile import device_profile
    from gradmesh.simulate.strategies import STRATEGIES, Job

    flops = sum(layer.fwd_flops + layer.bwd_flops for layer in layers.layers)
    device = Device.flat(flops / measured["compute_step_s"] / 1e12, "measured")
    prof = device_profile(layers, device, args.batch_per_worker, args.model)
    job = Job(prof, hosts, links, "native", 64.0, servers=1, servers_apart=True)
    return float(STRATEGIES.get(strategy)(job))


def _measure(args: Config, points: list[tuple[str, int]]) -> dict[tuple[str, int], list[Any]]:
    """Each point (strategy, hosts) trained once a round, interleaved: its runs."""
    from gradmesh.data.registry import DATASETS, DataOptions

    train = len(DATASETS.get("digits")(DataOptions()).train)
    runs: dict[tuple[str, int], list[Any]] = {p: [] for p in points}
    with tempfile.TemporaryDirectory(prefix="gradmesh-scaling-") as tmp:
        for _, (s, h) in interleaved(points, args.rounds):
            steps = args.epochs * math.ceil(train / (args.batch_per_worker * h))
            runs[(s, h)].append(_point(_train(s, h, args, Path(tmp)), steps))
    return runs


def _row(
    args: Config, point: tuple[str, int], f: dict[str, Any], alone: float, predicted: float | None
) -> dict[str, Any]:
    s, h = point
    return {
        "hosts": h,
        **f,
        "samples_per_s": h * args.batch_per_worker / f["step_s"],
        "efficiency": alone / f["step_s"],
        "overhead_s": f["step_s"] - alone,
        "predicted_step_s": predicted,
        "prediction_error": (predicted - f["step_s"]) / f["step_s"]
        if predicted is not None
        else None,
        "limit": "compute"  # one worker alone has no link to wait for
        if h == 1 and s != "ps"
        else ("cpu" if f["cpu_idle"] < CPU_BOUND_IDLE else "link"),
    }


def _lines(args: Config, payload: dict[str, Any]) -> list[str]:
    from gradmesh.simulate.command import markdown_table

    results = payload["strategies"]
    lines = [f"compute {payload['compute']}"] if args.emulate_compute else []
    lines.append(markdown_table(results, "hosts"))
    for s, rows in results.items():
        for r in rows:
            guess = r["predicted_step_s"]
            shown = f"{guess * 1e3:.2f} ms ({r['prediction_error'] * 100:+.0f}%)" if guess else "-"
            lines.append(
                f"{s:10} {r['hosts']} hosts: measured {r['step_s'] * 1e3:.2f} ms, predicted "
                f"{shown}, {r['bytes_per_worker_step'] / 1e3:.0f} KB/worker/step, accuracy "
                f"{r['test_accuracy']:.3f}, cpu idle {r['cpu_idle']:.2f} ({r['limit']})"
            )
    return lines


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.simulate.profile import model_layers
    from gradmesh.simulate.strategies import STRATEGIES

    hosts = parse_ints(args.hosts, "host count")
    strategies = parse_list(args.strategies, "strategy")
    for s in strategies:
        STRATEGIES.get(s)
    if min(args.batch_per_worker, args.epochs, args.rounds) < 1:
        raise GradmeshError("--batch-per-worker, --epochs and --rounds must be >= 1")
    if args.emulate_compute < 0:
        raise GradmeshError(f"--emulate-compute must be >= 0 ms, got {args.emulate_compute}")
    points = [(BASELINE, 1)] + [(s, h) for h in hosts for s in strategies]
    check_train_flags(_flags(s, h, args) for s, h in points)
    runs = _measure(args, points)
    figures = {p: medians(rs) for p, rs in runs.items()}
    alone = figures[(BASELINE, 1)]["step_s"]
    layers = model_layers(args.model, args.batch_per_worker)
    grad_bytes = sum(layer.param_bytes for layer in layers.layers)
    links = {h: _probe(h, args, grad_bytes) for h in hosts if h > 1}
    results: dict[str, list[dict[str, Any]]] = {}
    for s, h in points[1:]:
        one = _probe_or_none(links, h)
        predicted = _predict(s, h, figures[(s, h)], one, layers, args) if one is not None else None
        row = _row(args, (s, h), figures[(s, h)], alone, predicted)
        row["step_s_rounds"] = [r["step_s"] for r in runs[(s, h)]]
        results.setdefault(s, []).append(row)
    payload = _payload(args, alone, links, results)
    report(args.json, payload, _lines(args, payload))
    if args.plot:
        from gradmesh.observe.plot import scaling_plot

        emulated = f", EMULATED compute +{args.emulate_compute:g} ms" * bool(args.emulate_compute)
        title = f"{args.model}, emulated hosts at {args.bandwidth}{emulated}"
        scaling_plot(args.plot, title, results, "hosts")
    return 0


def _payload(
    args: Config, alone: float, links: dict[int, Any], results: dict[str, Any]
) -> dict[str, Any]:
    return {
        "model": args.model,
        "bandwidth": args.bandwidth,
        "batch_per_worker": args.batch_per_worker,
        "epochs": args.epochs,
        "rounds": args.rounds,
        "compute": f"EMULATED: the real arithmetic and {args.emulate_compute:g} ms of sleep per "
        "step, spread over forward and backward by FLOPs"
        if args.emulate_compute
        else "real: this machine's cores",
        "one_worker_step_s": alone,
        "links": {
            h: {
                "alpha": c.inter.alpha,
                "beta": c.inter.beta,
                "point_to_point": c.point_to_point and dataclasses.asdict(c.point_to_point),
            }
            for h, c in links.items()
        },
        "strategies": results,
    }


def _probe_or_none(links: dict[int, Any], hosts: int) -> Any:
    """The probed link for `hosts`; with one host there is no link (the prediction is the
    measured compute with no communication, except a ps job's, whose server has its own host:
    it is priced on the 2-host link)."""
    if hosts in links:
        return links[hosts]
    return next(iter(links.values()), None)
