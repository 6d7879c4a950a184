"""Pieces every benchmark shares: size parsing, robust statistics, launching a worker module."""

from __future__ import annotations

import contextlib
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from gradmesh.errors import GradmeshError
from gradmesh.launch.emulate import EmulatedCluster
from gradmesh.runtime.process import cpu_jiffies, idle_since

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1 << 10,
    "K": 1 << 10,
    "MB": 1 << 20,
    "M": 1 << 20,
    "GB": 1 << 30,
    "G": 1 << 30,
}


def parse_size(text: str) -> int:
    """'4KB' -> 4096 (binary units, as nccl-tests use)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise GradmeshError(f"bad size {text!r}: expected a number with KB, MB or GB, like 4MB")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_list(text: str, kind: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise GradmeshError(f"empty {kind} list")
    return items


def parse_ints(text: str, kind: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in parse_list(text, kind)]
    except ValueError:
        raise GradmeshError(f"bad {kind} list {text!r}: expected integers like 2,4") from None
    if any(v < minimum for v in values):
        raise GradmeshError(f"every {kind} must be >= {minimum}, got {text}")
    return values


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


CPU_BOUND_IDLE = 0.10
"""A run during which the machine's cores were idle less than this fraction is CPU-bound."""


LINK_BOUND = 0.5
"""An engine whose bytes fill at least this fraction of the link's rate is labelled link-bound."""


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


class Timed(NamedTuple):
    step_s: float
    """Median step seconds on this rank."""
    cpu_idle: float
    """The machine's idle CPU fraction over the measured steps."""
    outside_comm_s: float
    """Median seconds per step outside communication calls (compute, the loop's own work) on the
    slowest rank of each step."""


def timed_steps(job: Any, batch: int, warmup: int, steps: int) -> Timed:
    """`warmup` then `steps` training steps of a trainer `Job` on one fixed global batch (this
    replica's slice of its first `batch` samples). Byte counts (and a pipeline's clock) restart
    after the warm-up."""
    import time

    import torch

    rt, engine = job.rt, job.split.engine
    mine = torch.arange(batch).tensor_split(rt.dp.size)[rt.dp.index]
    x, y = job.data.train.x[mine], job.data.train.y[mine]
    times, outside = [], []
    for step in range(warmup + steps):
        if step == warmup:
            rt.comm.by_kind.clear()
            clock = getattr(engine, "clock", None)
            if clock is not None:
                clock.step_s = clock.busy_s = 0.0
            cpu_before = cpu_jiffies()
        started, comm_before = time.perf_counter(), rt.comm.comm_s
        job.optimizer.zero_grad()
        engine.step(x, y, rt.dp.size / batch)
        job.optimizer.step()
        times.append(time.perf_counter() - started)
        outside.append(times[-1] - (rt.comm.comm_s - comm_before))
    # The step is this rank's own: its steps run back to back, so their median is the job's
    # period. A per-step maximum over the ranks would not be: a rank that starts a step early
    # waits for the others inside it, and the maximum keeps that wait (`bench plan` on alexnet,
    # 4 emulated hosts: tensor parallelism read 203 ms that way, 150 ms this way, in two runs).
    # The time outside communication is the slowest rank's, step by step, since that rank's
    # compute is what a synchronous step waits for.
    slowest = torch.tensor(outside[warmup:], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    return Timed(median(times[warmup:]), idle_since(cpu_before), median(slowest.tolist()))


def interleaved_jobs(
    module: str,
    world: int,
    configs: Sequence[dict[str, Any]],
    rounds: int,
    cluster: EmulatedCluster | None = None,
) -> list[list[Any]]:
    """Each of `configs` run as a job of `world` ranks (`run_workers`) once per round, round by
    round so that drift on the machine touches every config alike; per config, its results."""
    results: list[list[Any]] = [[] for _ in configs]
    for _ in range(rounds):
        for i, config in enumerate(configs):
            results[i].append(run_workers(module, world, config, 300.0, cluster))
    return results


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def run_workers(
    module: str,
    world: int,
    config: dict[str, Any],
    timeout_s: float,
    cluster: EmulatedCluster | None = None,
) -> Any:
    """Launch `python -m module` on `world` ranks, on this host or spread evenly over the hosts
    of an emulated cluster; return what rank 0 wrote as JSON."""
    from gradmesh.launch.run import LaunchSpec, launch

    with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, "--config", json.dumps(config), "--out", str(out)]
        if cluster is None:
            code = launch(LaunchSpec(nproc=world, timeout_s=timeout_s), cmd)
        else:
            if world % cluster.hosts:
                raise GradmeshError(
                    f"world {world} does not split evenly over {cluster.hosts} hosts"
                )
            cmd[0] = "python"
            code = cluster.run(cmd, procs_per_host=world // cluster.hosts, timeout=timeout_s * 4)
        if code != 0 or not out.exists():
            raise GradmeshError(
                f"benchmark workers ({module}, world {world}) failed with code {code}"
            )
        return json.loads(out.read_text())


def write_json(path: str | None, payload: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def emulated_cluster(
    hosts: int | None, bandwidth: str
) -> contextlib.AbstractContextManager[EmulatedCluster | None]:
    """An emulated cluster of `hosts` hosts, or nothing (loopback) when `hosts` is None."""
    if hosts is None:
        return contextlib.nullcontext()
    return EmulatedCluster(hosts=hosts, bandwidth=bandwidth)


def shutdown_after_ddp() -> None:
    """End a benchmark worker that used DDP: the caller has dropped its DDP objects (their C++
    reducers must go before the process group, or the process may terminate at exit)."""
    import gc

    import torch.distributed as dist

    from gradmesh.runtime.world import shutdown

    gc.collect()
    dist.barrier()
    shutdown()


def worker_main(measure: Callable[[dict[str, Any]], tuple[int, Any]]) -> NoReturn:
    """The `__main__` of a benchmark's worker module: read --config, run `measure` on this rank,
    and have rank 0 write the result to --out for `run_workers` to read."""
    import argparse

    from gradmesh.runtime.world import exit_process

    parser = argparse.ArgumentParser(prog="gradmesh-bench-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank, result = measure(json.loads(args.config))
    if rank == 0:
        write_json(args.out, result)
    exit_process(0)
