"""`gradmesh bench ps`: samples/s of a parameter-server job as servers are added, against ring
allreduce at the same number of workers, measured in the same run.

Each configuration is a real `gradmesh train` job. With `--emulate-hosts` every server and every
worker gets its own emulated host with a `--bandwidth` link, so a single server's link carries
every worker's gradients in and parameters out: the bottleneck that sharding removes. Compute is
EMULATED: each step's forward and backward sleep `--compute-ms` more, spread over the layers
(`gradmesh.train.emulated`; the MLP's own arithmetic is a few ms), so the figures
show communication, as on a cluster whose workers compute for that long. The model is an MLP on
synthetic inputs sized to `--model-mb` of float32 parameters. Configurations are interleaved
round by round; medians are reported. samples/s of a ps job = all workers' samples / the slowest
worker's training time.

Each configuration is printed next to its prediction (`parameter_server.cost.step_time`: the
links' α-β terms, queueing at the servers by mean-value analysis) from the run's own compute
time per step and server CPU per push+pull, and BytePS's bound; ring allreduce next to its
registered cost formula. The JSON holds each configuration's CPU: the servers' and workers' own
CPU seconds while serving or training, and the machine's idle share over the whole job (start-up
included), labelled `cpu` under 10 %.
`--micro` measures instead what one push+pull costs a server in CPU (`ps_micro`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from gradmesh.bench import ps_micro
from gradmesh.bench.harness import CPU_BOUND_IDLE, check_link, check_train_flags, median
from gradmesh.collectives.cost import DEFAULT_PARAMS, CostParams, cost
from gradmesh.errors import GradmeshError
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.launch.jobs import write_json
from gradmesh.options import option, refuse_unread
from gradmesh.runtime.process import cpu_jiffies
from gradmesh.sync.parameter_server.cost import step_time
from gradmesh.units import parse_ints, parse_rate

HIDDEN = 128  # the mlp model's hidden width
PER_WORKER_BATCH = 16
WIRE_OVERHEAD = 1514 / 1448
"""Bytes on an Ethernet link per byte of TCP payload (1448 of a 1514-byte frame): tbf counts
frames."""


@dataclass
class Config:
    """gradmesh bench ps: parameter servers 1..S against ring allreduce, on emulated hosts"""

    workers: int = option(4, "workers", at_least=1)
    servers: str = option("1,2,4", "server counts")
    emulate_hosts: bool = option(False, "one emulated host each")
    bandwidth: str = option("1gbit", "emulated link rate")
    model_mb: float = option(2.0, "parameters, MB (float32)")
    compute_ms: float = option(10.0, "emulated compute/step", at_least=0)
    steps: int = option(40, "steps per worker per run", at_least=1)
    rounds: int = option(2, "runs of each configuration", at_least=1)
    mode: str = option("async", "ps mode", name=True)
    json: str | None = option(None, "write the result here")
    micro: bool = option(False, "the server's CPU per push+pull by shard size")
    sizes: str = option(ps_micro.DEFAULT_SIZES, "--micro: shard sizes")
    seconds: float = option(1.0, "--micro: each timed window")


MICRO_UNREAD = (
    "workers",
    "servers",
    "emulate_hosts",
    "bandwidth",
    "model_mb",
    "compute_ms",
    "steps",
    "mode",
)
"""The jobs' options, which `--micro` (no job: one server's CPU per request) does not read."""


def _job_flags(args: Config) -> list[str]:
    side = max(4, round((args.model_mb * 1e6 / 4 / HIDDEN) ** 0.5))
    batch = PER_WORKER_BATCH * args.workers
    samples = round(args.steps * batch / 0.8) + 1  # 80% of the synthetic set is for training
    return [
        "--model=mlp",
        "--dataset=synthetic",
        f"--synthetic-shape=1x{side}x{side}",
        f"--synthetic-samples={samples}",
        f"--batch-size={batch}",
        "--epochs=1",
        "--momentum=0",
        "--lr=0.01",
        f"--emulate-compute-ms={args.compute_ms}",
        f"--workers={args.workers}",
    ]


def _flags(args: Config, kind: str, servers: int) -> list[str]:
    """The `gradmesh train` flags of a ps job with `servers` servers, or of ring allreduce."""
    if kind == "ps":
        return [*_job_flags(args), "--strategy=ps", f"--mode={args.mode}", f"--servers={servers}"]
    return [*_job_flags(args), "--strategy=allreduce", "--allreduce=ring"]


def _run(flags: list[str], hosts: int, emulate: bool, bandwidth: str, out: Path) -> dict[str, Any]:
    command = ["gradmesh", "train", *flags, f"--json={out}"]
    if emulate:
        with EmulatedCluster(hosts=hosts, bandwidth=bandwidth) as cluster:
            code = cluster.run(command, procs_per_host=1, timeout=600)
    else:
        argv = [sys.executable, "-m", "gradmesh.cli", *command[1:]]
        code = subprocess.run(
            argv, capture_output=True, env=dict(os.environ), timeout=600
        ).returncode
    if code != 0 or not out.exists():
        raise GradmeshError(f"bench ps: job {' '.join(flags[-3:])} failed with code {code}")
    return dict(json.loads(out.read_text()))


def run(args: Config, _command: list[str] | None = None) -> int:
    if args.micro:
        refuse_unread(args, MICRO_UNREAD, "not read by --micro, which times one server's CPU")
        return ps_micro.run(args)
    refuse_unread(args, ("sizes", "seconds"), "options of --micro")
    check_link(args)
    servers = parse_ints(args.servers, "servers")
    if args.workers < 1 or args.steps < 1 or args.rounds < 1 or args.model_mb <= 0:
        raise GradmeshError("--workers, --steps, --rounds must be >= 1 and --model-mb > 0")
    configs: list[tuple[str, int]] = [("ps", s) for s in servers] + [("ring", 0)]
    check_train_flags(_flags(args, kind, s) for kind, s in configs)
    runs = _measure(args, configs)
    link = _link(args)
    results = [_summary(args, s, runs[("ps", s)], link) for s in servers]
    ring = runs[("ring", 0)]
    ring_compute = median([r["compute_s"] / args.steps for r in ring])
    nbytes = results[0]["parameter_bytes"]
    ring_step = ring_compute + cost("ring", args.workers, nbytes, link.alpha, link.beta, link.gamma)
    payload = {
        "results": results,
        "allreduce_samples_per_s": median([_rate("ring", r) for r in ring]),
        "allreduce_predicted_samples_per_s": PER_WORKER_BATCH * args.workers / ring_step,
        "allreduce_cpu_idle": median([r["cpu_idle"] for r in ring]),
        "network": f"{args.bandwidth} emulated links" if args.emulate_hosts else "loopback",
        "link_model": {"alpha_s": link.alpha, "beta_s_per_byte": link.beta},
        "compute": f"EMULATED: {args.compute_ms} ms sleep per step in forward and backward",
        "model_mb": args.model_mb,
        "mode": args.mode,
        "steps_per_worker": args.steps,
        "rounds": args.rounds,
        "cpu_bound_idle": CPU_BOUND_IDLE,
    }
    write_json(args.json, payload)
    first = results[0]["samples_per_s"]
    for r in results:
        print(
            f"{r['servers']} servers: {r['samples_per_s']:.0f} samples/s "
            f"({r['samples_per_s'] / first:.2f}x {results[0]['servers']} server), predicted "
            f"{r['predicted_samples_per_s']:.0f} ({r['prediction_error']:+.0%}, bound "
            f"{r['bound_samples_per_s']:.0f}), {r['bytes_in_per_server'] / 1e6:.0f} MB in per "
            f"server, idle CPU {r['cpu_idle']:.0%}: {r['limit']}"
        )
    print(
        f"ring allreduce, {args.workers} workers: {payload['allreduce_samples_per_s']:.0f} "
        f"samples/s, predicted {payload['allreduce_predicted_samples_per_s']:.0f}"
    )
    return 0


def _measure(
    args: Config, configs: list[tuple[str, int]]
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Each configuration (a ps job with S servers, or ring allreduce) once a round, the order
    reversed every other round; its reports, each with the machine's idle CPU over its job."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
        for round_ in range(args.rounds):
            order = configs if round_ % 2 == 0 else configs[::-1]
            for kind, s in order:
                flags = _flags(args, kind, s)
                hosts = args.workers + (s if kind == "ps" else 0)
                out = Path(tmp) / f"{round_}-{kind}-{s}.json"
                idle0, total0 = cpu_jiffies()
                report = _run(flags, hosts, args.emulate_hosts, args.bandwidth, out)
                idle1, total1 = cpu_jiffies()
                report["cpu_idle"] = (idle1 - idle0) / max(1, total1 - total0)
                runs[(kind, s)].append(report)
                rate = _rate(kind, report)
                print(f"round {round_ + 1}/{args.rounds}  {kind} servers={s}: {rate:.0f} samples/s")
    return runs


def _link(args: Config) -> CostParams:
    """The α-β terms of the links: the emulated rate (with TCP/IP's framing) or loopback's."""
    if not args.emulate_hosts:
        return DEFAULT_PARAMS
    beta = 8 / parse_rate(args.bandwidth) * WIRE_OVERHEAD
    return CostParams(alpha=DEFAULT_PARAMS.alpha, beta=beta, gamma=DEFAULT_PARAMS.gamma)


def _summary(
    args: Config, servers: int, reports: list[dict[str, Any]], link: CostParams
) -> dict[str, Any]:
    """One configuration's medians, its CPU figures and its prediction (`parameter_server.cost`)
    from the run's own compute time and server CPU per request."""
    stats = [r["strategy_info"]["server_stats"] for r in reports]
    nbytes = int(reports[0]["strategy_info"]["parameter_bytes"])
    compute = median([r["compute_s"] / args.steps for r in reports])
    pushes = args.workers * args.steps
    server_cpu = median([_mean(x, "cpu_s") / pushes for x in stats])
    predicted = step_time(args.workers, servers, nbytes, link, compute, server_cpu)
    per_step = PER_WORKER_BATCH * args.workers  # samples of one step of every worker
    rate = median([_rate("ps", r) for r in reports])
    idle = median([r["cpu_idle"] for r in reports])
    return {
        "servers": servers,
        "workers": args.workers,
        "samples_per_s": rate,
        "predicted_samples_per_s": per_step / predicted.step_s,
        "prediction_error": rate / (per_step / predicted.step_s) - 1,
        "bound_samples_per_s": per_step / predicted.bound_s,
        "predicted_bottleneck": predicted.bottleneck,
        "parameter_bytes": nbytes,
        "compute_s_per_step": compute,
        "server_cpu_s_per_push_pull": server_cpu,
        "server_cpu_s": median([_mean(x, "cpu_s") for x in stats]),
        "worker_cpu_s": median([mean(r["strategy_info"]["worker_cpu_s"]) for r in reports]),
        "cpu_idle": idle,
        "limit": "cpu" if idle < CPU_BOUND_IDLE else "link-or-compute",
        "bytes_in_per_server": median([_mean(x, "bytes_in") for x in stats]),
        "bytes_out_per_server": median([_mean(x, "bytes_out") for x in stats]),
        "request_rate_per_server": median([_mean(x, "request_rate") for x in stats]),
    }


def _rate(kind: str, report: dict[str, Any]) -> float:
    if kind == "ps":
        return float(report["strategy_info"]["job_samples_per_s"])
    return float(report["samples_per_s"])


def _mean(servers: list[dict[str, Any]], key: str) -> float:
    return sum(float(s[key]) for s in servers) / len(servers)
