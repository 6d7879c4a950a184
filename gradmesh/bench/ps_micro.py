"""`gradmesh bench ps --micro`: what one push+pull costs a parameter server in CPU, by shard size.

One server process (async mode, SGD with momentum, as `gradmesh train --strategy ps` starts it)
and one worker (this process) on loopback, one torch thread each (as `gradmesh run` starts a job
of more processes than cores). After a warm-up the worker makes push+pull round
trips (`Client.pull(flat, push=grad)`, the request of every training step) for at least
`--seconds`; the server's CPU time over that window is read from the kernel's per-thread
counters (`/proc/PID/task/*/schedstat`, nanoseconds, every thread), the worker's from its own
`time.process_time()`. Figures: CPU microseconds per push+pull on each side and the round
trip's wall time; medians of `--rounds` windows.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from gradmesh.bench.harness import median
from gradmesh.errors import GradmeshError
from gradmesh.launch.jobs import write_json
from gradmesh.units import parse_list, parse_size

DEFAULT_SIZES = "64KB,512KB,2MB,8MB"
WARMUP = 20


class MicroOptions(Protocol):
    """What `gradmesh bench ps --micro` reads of the bench's options."""

    sizes: str
    seconds: float
    rounds: int
    json: str | None


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process `pid` so far, in nanoseconds."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between the listing and the read
    return total


def _serve(numel: int) -> int:
    from gradmesh.sync.parameter_server.roles import launcher_token
    from gradmesh.sync.parameter_server.server import Server
    from gradmesh.sync.parameter_server.serving import ServerConfig

    token = launcher_token()
    assert token is not None
    config = ServerConfig.of(0, 1, numel, mode="async", momentum=0.9, lr=0.01)
    server = Server(config, token, "127.0.0.1")
    print(server.endpoint, flush=True)
    server.serve()
    return 0


def _measure(numel: int, args: MicroOptions) -> dict[str, Any]:
    import torch

    from gradmesh.sync.parameter_server.client import Client
    from gradmesh.sync.parameter_server.roles import TOKEN_ENV

    token_hex = secrets.token_hex(16)
    # one thread each, as `gradmesh run` gives a job of more processes than cores
    env = {**os.environ, TOKEN_ENV: token_hex, "OMP_NUM_THREADS": "1"}
    torch.set_num_threads(1)
    command = [sys.executable, "-m", "gradmesh.bench.ps_micro", "--serve", str(numel)]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        if not endpoint.startswith("tcp://"):
            raise GradmeshError(f"bench ps --micro: the server did not start ({endpoint!r})")
        client = Client([endpoint], bytes.fromhex(token_hex), 0, numel, 60.0)
        flat, grad = torch.zeros(numel, device="cpu"), torch.full((numel,), 1e-3, device="cpu")
        client.init(flat)
        for _ in range(WARMUP):
            client.pull(flat, push=grad)
        windows = []
        for _ in range(args.rounds):
            requests, server_0, worker_0 = 0, cpu_ns(server.pid), time.process_time()
            started = time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                client.pull(flat, push=grad)
                requests += 1
            wall = time.perf_counter() - started
            server_us = (cpu_ns(server.pid) - server_0) / 1e3 / requests
            worker_us = (time.process_time() - worker_0) * 1e6 / requests
            windows.append((server_us, worker_us, wall * 1e6 / requests, requests))
        client.finish({})
        client.close_servers()
        client.close()
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return {
        "shard_bytes": numel * 4,
        "server_cpu_us_per_push_pull": median([w[0] for w in windows]),
        "worker_cpu_us_per_push_pull": median([w[1] for w in windows]),
        "round_trip_us": median([w[2] for w in windows]),
        "requests_per_window": [w[3] for w in windows],
    }


def run(args: MicroOptions) -> int:
    sizes = [parse_size(s) for s in parse_list(args.sizes, "size")]
    if any(s < 4 or s % 4 for s in sizes) or args.seconds <= 0 or args.rounds < 1:
        raise GradmeshError("--sizes must be whole float32 counts, --seconds > 0, --rounds >= 1")
    results = []
    for size in sizes:
        result = _measure(size // 4, args)
        results.append(result)
        print(
            f"{size / 1024:>8.0f} KB: server {result['server_cpu_us_per_push_pull']:8.0f} us CPU, "
            f"worker {result['worker_cpu_us_per_push_pull']:8.0f} us CPU, "
            f"round trip {result['round_trip_us']:8.0f} us per push+pull"
        )
    payload = {
        "results": results,
        "network": "loopback, one server process, one worker",
        "mode": "async, server SGD momentum 0.9",
        "seconds_per_window": args.seconds,
        "rounds": args.rounds,
    }
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(_serve(int(sys.argv[2])))
    sys.exit("usage: python -m gradmesh.bench.ps_micro --serve NUMEL (gradmesh bench ps --micro)")
