"""A parameter-server job from a user's script (`gradmesh run -np S+W -- python script.py`):
`join` gives each rank its role; servers serve until the workers are done."""

from __future__ import annotations

import os
import sys
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.runtime.process import connect_store
from gradmesh.sync.parameter_server.roles import WorkerRole, job_token, run_server, worker_env


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
