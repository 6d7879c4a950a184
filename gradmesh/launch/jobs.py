"""Benchmark and probe jobs: a Python module run on W ranks, here or spread over the hosts of an
emulated cluster, whose rank 0 writes its result as JSON for the caller to read back."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from gradmesh.errors import GradmeshError, on_rank
from gradmesh.launch.emulate import EmulatedCluster


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


def worker_main(measure: Callable[[dict[str, Any]], tuple[int, Any]]) -> NoReturn:
    """The `__main__` of a benchmark's worker module: read --config, run `measure` on this rank,
    and have rank 0 write the result to --out for `run_workers` to read."""
    import argparse

    from gradmesh.runtime.ending import exit_process

    parser = argparse.ArgumentParser(prog="gradmesh-bench-worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = json.loads(args.config)
    if config.get("memory_cgroup"):  # a limit of this rank's own (`cgroup`), named by the job
        from gradmesh.launch.cgroup import join

        join(f"{config['memory_cgroup']}{os.environ.get('RANK', '0')}")
    try:
        rank, result = measure(config)
    except GradmeshError as exc:  # bad input the launcher could not see, or a peer's failure
        from gradmesh.runtime.world import mark_failed, shutdown

        print(f"gradmesh: {on_rank(os.environ.get('RANK', '?'), exc)}", file=sys.stderr)
        code = mark_failed(exc)  # a peer's failure exits 75: the launcher names the cause
        shutdown()
        exit_process(code)
    if rank == 0:
        write_json(args.out, result)
    exit_process(0)
