"""`gradmesh bench ps`: samples/s of a parameter-server job as servers are added, against ring
allreduce at the same number of workers, measured in the same run.

Each configuration is a real `gradmesh train` job. With `--emulate-hosts` every server and every
worker gets its own emulated host with a `--bandwidth` link, so a single server's link carries
every worker's gradients in and parameters out: the bottleneck that sharding removes. Compute is
EMULATED: each step sleeps `--compute-ms` (the MLP's own arithmetic is a few ms), so the figures
show communication, as on a cluster whose workers compute for that long. The model is an MLP on
synthetic inputs sized to `--model-mb` of float32 parameters. Configurations are interleaved
round by round; medians are reported. samples/s of a ps job = all workers' samples / the slowest
worker's training time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gradmesh.bench.common import median, parse_ints, write_json
from gradmesh.errors import GradmeshError
from gradmesh.launch.emulate import EmulatedCluster

HIDDEN = 128  # the mlp model's hidden width


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="workers (default: 4)")
    parser.add_argument("--servers", default="1,2,4", help="server counts (default: 1,2,4)")
    parser.add_argument("--emulate-hosts", action="store_true", help="one emulated host each")
    parser.add_argument("--bandwidth", default="1gbit", help="emulated link rate")
    parser.add_argument("--model-mb", type=float, default=2.0, help="parameters, MB (float32)")
    parser.add_argument("--compute-ms", type=float, default=10.0, help="emulated compute/step")
    parser.add_argument("--steps", type=int, default=40, help="steps per worker per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--mode", default="async", help="ps mode (default: async)")
    parser.add_argument("--json", help="write the result here")


def _job_flags(args: argparse.Namespace) -> list[str]:
    side = max(4, round((args.model_mb * 1e6 / 4 / HIDDEN) ** 0.5))
    per_worker = 16
    batch = per_worker * args.workers
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


def run(args: argparse.Namespace) -> int:
    servers = parse_ints(args.servers, "servers")
    if args.workers < 1 or args.steps < 1 or args.rounds < 1 or args.model_mb <= 0:
        raise GradmeshError("--workers, --steps, --rounds must be >= 1 and --model-mb > 0")
    base = _job_flags(args)
    configs: list[tuple[str, int]] = [("ps", s) for s in servers] + [("ring", 0)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
        for round_ in range(args.rounds):
            order = configs if round_ % 2 == 0 else configs[::-1]
            for kind, s in order:
                if kind == "ps":
                    flags = [*base, "--strategy=ps", f"--mode={args.mode}", f"--servers={s}"]
                    hosts = s + args.workers
                else:
                    flags = [*base, "--strategy=allreduce", "--allreduce=ring"]
                    hosts = args.workers
                out = Path(tmp) / f"{round_}-{kind}-{s}.json"
                report = _run(flags, hosts, args.emulate_hosts, args.bandwidth, out)
                runs[(kind, s)].append(report)
                rate = _rate(kind, report)
                print(f"round {round_ + 1}/{args.rounds}  {kind} servers={s}: {rate:.0f} samples/s")
    results = []
    for s in servers:
        reports = runs[("ps", s)]
        stats = [r["strategy_info"]["server_stats"] for r in reports]
        results.append(
            {
                "servers": s,
                "workers": args.workers,
                "samples_per_s": median([_rate("ps", r) for r in reports]),
                "bytes_in_per_server": median([_mean(x, "bytes_in") for x in stats]),
                "bytes_out_per_server": median([_mean(x, "bytes_out") for x in stats]),
                "request_rate_per_server": median([_mean(x, "request_rate") for x in stats]),
            }
        )
    payload = {
        "results": results,
        "allreduce_samples_per_s": median([_rate("ring", r) for r in runs[("ring", 0)]]),
        "network": f"{args.bandwidth} emulated links" if args.emulate_hosts else "loopback",
        "compute": f"EMULATED: {args.compute_ms} ms sleep per step",
        "model_mb": args.model_mb,
        "mode": args.mode,
        "steps_per_worker": args.steps,
        "rounds": args.rounds,
    }
    write_json(args.json, payload)
    first = results[0]["samples_per_s"]
    for r in results:
        print(
            f"{r['servers']} servers: {r['samples_per_s']:.0f} samples/s "
            f"({r['samples_per_s'] / first:.2f}x {results[0]['servers']} server), "
            f"{r['bytes_in_per_server'] / 1e6:.0f} MB in per server"
        )
    print(f"ring allreduce, {args.workers} workers: {payload['allreduce_samples_per_s']:.0f}")
    return 0


def _rate(kind: str, report: dict[str, Any]) -> float:
    if kind == "ps":
        return float(report["strategy_info"]["job_samples_per_s"])
    return float(report["samples_per_s"])


def _mean(servers: list[dict[str, Any]], key: str) -> float:
    return sum(float(s[key]) for s in servers) / len(servers)
