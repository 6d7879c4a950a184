"""Who a rank is in a parameter-server job, and how the roles find each other.

The launcher starts S + W ranks; ranks 0..S-1 are servers, the rest workers. Servers do not join
a torch.distributed process group: they publish their endpoints in the job's rendezvous store
(the torchrun agent's TCPStore at MASTER_ADDR:MASTER_PORT), keyed `gradmesh/ps/ATTEMPT/...`: the
store outlives a restart of the job, the endpoints of the attempt before it do not. Each worker
rank supervises one training process that runs as a world of its own (no collectives), so a
worker that dies does not stop the others, as the elastic agent would for a failed rank.

The job token comes from GRADMESH_JOB_TOKEN, which `gradmesh run` / `gradmesh emulate` draw at
launch; under plain torchrun, server 0 draws one and shares it through the store.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradmesh.runtime.bound import LAUNCHER_PID_ENV, die_with_parent
from gradmesh.runtime.process import STORE_ENV, connect_store, local_address, restarts

if TYPE_CHECKING:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from gradmesh.observe.timeline import Timeline
    from gradmesh.sync.parameter_server.serving import ShardCheckpoints

TOKEN_ENV = "GRADMESH_JOB_TOKEN"
WORKER_ENV = "GRADMESH_PS_WORKER"
WORKERS_ENV = "GRADMESH_PS_WORKERS"
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@dataclass(frozen=True)
class WorkerRole:
    """What a training process of a parameter-server job knows of its place in it."""

    index: int
    workers: int
    store_host: str
    store_port: int


def worker_role() -> WorkerRole | None:
    """This process's worker role, or None when it was not started as a ps worker."""
    if WORKER_ENV not in os.environ:
        return None
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    return WorkerRole(int(os.environ[WORKER_ENV]), int(os.environ[WORKERS_ENV]), host, int(port))


def key(name: str) -> str:
    """The store key `name` of this attempt of the job."""
    return f"gradmesh/ps/{restarts()}/{name}"


def launcher_token() -> bytes | None:
    """The job's 16-byte token as `gradmesh run` / `gradmesh emulate` drew it, if they did."""
    raw = os.environ.get(TOKEN_ENV)
    return bytes.fromhex(raw)[:16].ljust(16, b"\0") if raw else None


def job_token(store: TCPStore, creator: bool) -> bytes:
    """The job's 16-byte token: from the launcher, or drawn by `creator` and shared."""
    token = launcher_token()
    if token is not None:
        return token
    if creator:
        store.set(key("token"), secrets.token_hex(16))
    return bytes.fromhex(store.get(key("token")).decode())


def supervise_worker(
    command: list[str], index: int, workers: int, token: bytes, survivable: bool = True
) -> int:
    """Run one ps training process as worker `index` and wait for it.

    A worker killed by a signal is reported and, when `survivable`, the rank exits 0, so the job
    goes on without it; otherwise (a job that checkpoints: every worker's part is needed) it
    fails the rank, and the launcher restarts the job or ends it. One that fails with an error
    fails the rank. SIGTERM/SIGINT are passed on to the worker.
    """
    child = subprocess.Popen(
        command, env=worker_env(index, workers, token), preexec_fn=die_with_parent
    )  # noqa: PLW1509

    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    if stopped:
        return 128 + stopped[0]
    if code < 0:
        name = signal.Signals(-code).name
        then = "the job goes on without it" if survivable else "the job stops"
        print(
            f"gradmesh ps: worker {index} (pid {child.pid}) was killed by {name}; {then}",
            file=sys.stderr,
            flush=True,
        )
        return 0 if survivable else 128 - code
    return code


def run_server(
    index: int,
    servers: int,
    workers: int,
    store_host: str,
    store_port: int,
    timeout_s: float,
    checkpoints: ShardCheckpoints | None = None,
    on_update: Callable[[int, int], None] | None = None,
    timeline: Timeline | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Serve shard `index` of `servers` for `workers` workers until they are done; `options` are
    `ServerConfig` fields (mode, max_staleness, optimizer, lr, ...); the shard resumes from
    `checkpoints` and saves there (see `Server`). Returns the server's stats."""
    from gradmesh.sync.parameter_server.client import shard_ranges
    from gradmesh.sync.parameter_server.server import Server
    from gradmesh.sync.parameter_server.serving import ServerConfig

    store = connect_store(store_host, store_port, timeout_s)
    token = job_token(store, creator=index == 0)
    total = int(store.get(key("numel")).decode())  # published by worker 0
    start, end = shard_ranges(total, servers)[index]
    config = ServerConfig.of(index, workers, end - start, timeout_s=timeout_s, **options)
    server = Server(config, token, local_address(store_host), checkpoints, on_update, timeline)
    if checkpoints is not None:
        checkpoints.restore(server)
    store.set(key(f"server{index}"), server.endpoint)
    stats = server.serve()
    print(
        f"gradmesh ps: server {index}: {sum(stats['requests'].values())} requests, "
        f"{stats['bytes_in'] / 1e6:.1f} MB in, {stats['bytes_out'] / 1e6:.1f} MB out, "
        f"{stats['dropped_messages']} dropped",
        file=sys.stderr,
        flush=True,
    )
    return stats


def worker_env(index: int, workers: int, token: bytes) -> dict[str, str]:
    """The environment of a ps training process: its role, and no torchrun world of its own."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(
        {
            WORKER_ENV: str(index),
            WORKERS_ENV: str(workers),
            STORE_ENV: f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            TOKEN_ENV: token.hex(),
            LAUNCHER_PID_ENV: str(os.getpid()),  # its supervisor is the process it must not outlive
        }
    )
    return env
