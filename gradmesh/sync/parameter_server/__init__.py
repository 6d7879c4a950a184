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

from importlib import import_module
from typing import Any

from gradmesh.sync.config import MODES
from gradmesh.sync.parameter_server.roles import WorkerRole, run_server
from gradmesh.sync.parameter_server.script import join

__all__ = ["MODES", "WorkerRole", "join", "run_server"]


def __getattr__(name: str) -> Any:  # the rest on first use: a worker's supervisor needs no torch
    for module in ("client", "serving", "server", "worker"):
        found = import_module(f"gradmesh.sync.parameter_server.{module}")
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module 'gradmesh.sync.parameter_server' has no attribute {name!r}")
