"""The one harness every `gradmesh bench NAME` plugs into: each benchmark gives its options (a
`Config` dataclass), a small measure function and what to print; the harness gives the rest.

- **Interleaving.** What a benchmark compares runs round by round, every variant once a round in
  an order rotated each round (`interleaved`), so that drift on the machine touches all alike:
  as jobs of their own (`compare_jobs`: a mesh is fixed when a job starts) or as turns inside one
  job (`timed_turn`: a barrier, then the slowest rank's seconds).
- **Warm-up and medians.** The first turn or round of each variant warms up; a figure is the
  median over the rest (`medians`), with its quantiles where they matter (`quantile`).
- **What bound it.** Every figure carries the machine's idle CPU while it was measured and a
  label: `cpu` when the cores were idle under `CPU_BOUND_IDLE`, else `link` or `compute` from the
  bytes the step put on an emulated link (`label`), `loopback` without one (`limit_of`). A
  figure taken while CPU-bound is labelled so, never passed off as a network result.
- **Output.** The JSON (`report`), the lines printed, and a plot where a benchmark draws one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from gradmesh.errors import GradmeshError
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.launch.jobs import run_workers, write_json
from gradmesh.options import refuse_unread
from gradmesh.runtime.process import cpu_jiffies

T = TypeVar("T")

CPU_BOUND_IDLE = 0.10
"""A run during which the machine's cores were idle less than this fraction is CPU-bound."""
LINK_BOUND = 0.5
"""An engine whose bytes fill at least this fraction of the link's rate is labelled link-bound."""


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def medians(runs: Sequence[Mapping[str, Any]], keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Per key (every numeric key of the first run by default), the median over `runs`."""
    chosen = keys if keys is not None else [k for k, v in runs[0].items() if _number(v)]
    return {k: median([r[k] for r in runs]) for k in chosen}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def interleaved(items: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, item): every item once a round, the order rotated by one each round."""
    for round_ in range(rounds):
        shift = round_ % max(len(items), 1)
        for item in [*items[shift:], *items[:shift]]:
            yield round_, item


def compare_jobs(
    module: str,
    world: int,
    configs: Sequence[dict[str, Any]],
    rounds: int,
    cluster: EmulatedCluster | None = None,
) -> list[list[Any]]:
    """Each of `configs` run as a job of `world` ranks (`python -m module`, `run_workers`) once
    a round, interleaved; per config, what its jobs returned."""
    results: list[list[Any]] = [[] for _ in configs]
    for _, i in interleaved(range(len(configs)), rounds):
        results[i].append(run_workers(module, world, configs[i], 300.0, cluster))
    return results


def check_train_flags(jobs: Iterable[Sequence[str]]) -> None:
    """Each job's `gradmesh train` flags checked as `gradmesh train` checks them before it
    launches: a benchmark's bad option (an lr, a compressor, a model's arguments) is one line
    before its first job, not a failed job after minutes of the others."""
    import argparse

    from gradmesh.options import add_flags, from_flags
    from gradmesh.runtime.process import check_gpu_share
    from gradmesh.train.checks import check_train
    from gradmesh.train.config import TrainConfig

    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser, TrainConfig)
    workers = 0
    for flags in jobs:
        config = from_flags(TrainConfig, parser.parse_args(list(flags)))
        check_train(config)
        workers = max(workers, config.job.workers)
    check_gpu_share(workers)  # after every job's flags: a bad option reads the same anywhere


def emulated_train(
    flags: list[str], hosts: int, bandwidth: str, out: Path, what: str
) -> dict[str, Any]:
    """One `gradmesh train` job with `flags`, one worker on each of `hosts` emulated hosts
    behind `bandwidth` links; its JSON report (written to `out`), or one line naming `what`
    failed."""
    import json

    with EmulatedCluster(hosts=hosts, bandwidth=bandwidth) as cluster:
        code = cluster.run(
            ["gradmesh", "train", *flags, "--json", str(out)], procs_per_host=1, timeout=1800
        )
    if code != 0 or not out.exists():
        raise GradmeshError(f"the {what} job on {hosts} hosts failed with code {code}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


class Turn(NamedTuple):
    """One timed turn inside a job: the slowest rank's seconds and the machine's CPU jiffies."""

    seconds: float
    idle: int
    total: int


def timed_turn(work: Callable[[], Any]) -> Turn:
    """Run `work` on every rank after a barrier; its time is the slowest rank's (a collective
    over the world)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    cpu = cpu_jiffies()
    started = time.perf_counter()
    work()
    slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device="cpu")
    idle, total = (a - b for a, b in zip(cpu_jiffies(), cpu, strict=True))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return Turn(float(slowest[0]), idle, total)


def limit_of(cpu_idle: float, cluster: EmulatedCluster | None) -> str:
    """`cpu` under `CPU_BOUND_IDLE` idle, else `link` on emulated hosts, `loopback` without."""
    if cpu_idle < CPU_BOUND_IDLE:
        return "cpu"
    return "link" if cluster is not None else "loopback"


def label(r: dict[str, Any], bandwidth_bps: int | None) -> None:
    """What limited an engine's step: `cpu` (the machine's cores were busy), `link` (its bytes
    filled the link), `compute` (neither: the step's own work and each message's latency),
    `loopback` (no emulated link)."""
    wire = r["wire_bytes_per_step"]
    r["link_utilization"] = (
        wire * 8 / r["step_s"] / bandwidth_bps if wire is not None and bandwidth_bps else None
    )
    if r["cpu_idle"] < CPU_BOUND_IDLE:
        r["limit"] = "cpu"
    elif r["link_utilization"] is None:
        r["limit"] = "loopback"
    else:
        r["limit"] = "link" if r["link_utilization"] >= LINK_BOUND else "compute"


def network(cluster: EmulatedCluster | None) -> str:
    """Where a benchmark ran, for its JSON and its first line."""
    if cluster is None:
        return "loopback, one machine"
    return f"{cluster.hosts} emulated hosts, {cluster.bandwidth_bps} bit/s"


def report(path: str | None, payload: dict[str, Any], lines: Iterable[str]) -> int:
    """Write the JSON (when asked) and print the lines; the command's exit code."""
    write_json(path, payload)
    for line in lines:
        print(line)
    return 0


def shutdown_after_ddp() -> None:
    """End a benchmark worker that used DDP: the caller has dropped its DDP objects (their C++
    reducers must go before the process group, or the process may terminate at exit)."""
    import gc

    import torch.distributed as dist

    from gradmesh.runtime.world import shutdown

    gc.collect()
    dist.barrier()
    shutdown()


def check_link(args: Any) -> None:
    """`--bandwidth` rates the emulated hosts' links: without `--emulate-hosts` the benchmark
    runs on this host's loopback, where nothing would read it (one line, not a loopback figure
    the user takes for the rate they gave)."""
    if not args.emulate_hosts:
        refuse_unread(
            args,
            ("bandwidth",),
            "the emulated hosts' link rate; without --emulate-hosts this runs on loopback",
        )
