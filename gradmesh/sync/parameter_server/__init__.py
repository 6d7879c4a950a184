"""Parameter servers: sharded servers holding the parameters and the optimizer; workers pull
parameters and push gradients over TCP (see docs/parameter_server.md).

`gradmesh train --strategy ps` runs the roles for you. In your own script, started with
`gradmesh run -np S+W -- python script.py`:

    from gradmesh.sync import parameter_server as ps
    role = ps.join(servers=S, mode="ssp", max_staleness=2, lr=0.05)  # servers serve, then exit
    worker = ps.PSWorker(role, servers=S, push_every=1, pull_every=1, timeout_s=60)
    optimizer = worker.attach(model, optimizer)   # pulls the servers' values
    ...  # an ordinary loop on this worker's data (role.index of role.workers)
    worker.finish(samples, wall_s)                # waits for the others; one is the reporter

In a script a worker that dies stops the job (the launcher's rule); under `gradmesh train` each
worker is supervised so the others go on.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

from gradmesh.errors import GradmeshError
from gradmesh.runtime.process import connect_store
from gradmesh.sync.parameter_server.roles import (
    WorkerRole,
    job_token,
    run_server,
    worker_env,
)

if TYPE_CHECKING:
    from gradmesh.sync.parameter_server.client import Client, shard_ranges
    from gradmesh.sync.parameter_server.server import MODES, Server, ServerConfig
    from gradmesh.sync.parameter_server.worker import PSWorker

_LAZY = {
    "Client": "client",
    "shard_ranges": "client",
    "MODES": "server",
    "Server": "server",
    "ServerConfig": "server",
    "PSWorker": "worker",
}
"""Imported on first use: a worker's supervisor (`node`) imports this package, not torch."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"gradmesh.sync.parameter_server.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'gradmesh.sync.parameter_server' has no attribute {name!r}")


__all__ = [
    "MODES",
    "Client",
    "PSWorker",
    "Server",
    "ServerConfig",
    "WorkerRole",
    "join",
    "run_server",
    "shard_ranges",
]


def join(servers: int, timeout_s: float = 60.0, **server_options: Any) -> WorkerRole:
    """Take this rank's role in a job the launcher started with S + W ranks.

    Ranks 0..S-1 serve a shard (`server_options` are `ServerConfig` fields) and exit when the
    workers are done; the others return their `WorkerRole`. Call it before `gradmesh.init()`:
    a worker's world is its own (no collectives with the others).
    """
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as exc:
        raise GradmeshError(f"parameter_server.join needs the launcher's {exc} variable") from None
    if not 1 <= servers < world:
        raise GradmeshError(f"{servers} servers leave no worker in a world of {world}")
    workers = world - servers
    if rank < servers:
        run_server(rank, servers, workers, host, port, timeout_s, **server_options)
        sys.exit(0)
    token = job_token(connect_store(host, port, timeout_s), creator=False)
    env = worker_env(rank - servers, workers, token)
    os.environ.clear()
    os.environ.update(env)
    return WorkerRole(rank - servers, workers, host, port)
