"""gradmesh: distributed deep-learning training for PyTorch.

Horovod-style use from a script::

    import gradmesh
    gradmesh.init()
    gradmesh.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# The public names are loaded on first use, so that `gradmesh --help` and the launcher start
# without importing torch (and the launcher can set torch's log level before it loads).
_EXPORTS = {
    "Adasum": "gradmesh.data_parallel.optimizer",
    "allgather": "gradmesh.horovod",
    "allreduce": "gradmesh.horovod",
    "allreduce_async": "gradmesh.horovod",
    "broadcast": "gradmesh.horovod",
    "broadcast_object": "gradmesh.collectives",
    "broadcast_optimizer_state": "gradmesh.data_parallel.api",
    "ddp_comm_hook": "gradmesh.data_parallel.ddp_hook",
    "join": "gradmesh.horovod",
    "poll": "gradmesh.data_parallel.api",
    "synchronize": "gradmesh.data_parallel.api",
    "start_timeline": "gradmesh.timeline",
    "stop_timeline": "gradmesh.timeline",
    "Average": "gradmesh.data_parallel.optimizer",
    "DistributedOptimizer": "gradmesh.data_parallel.optimizer",
    "Sum": "gradmesh.data_parallel.optimizer",
    "broadcast_parameters": "gradmesh.data_parallel.optimizer",
    "GradmeshError": "gradmesh.errors",
    "barrier": "gradmesh.runtime",
    "cross_rank": "gradmesh.runtime",
    "cross_size": "gradmesh.runtime",
    "init": "gradmesh.runtime",
    "is_initialized": "gradmesh.runtime",
    "local_rank": "gradmesh.runtime",
    "local_size": "gradmesh.runtime",
    "mesh": "gradmesh.runtime",
    "parallelize": "gradmesh.layout.hybrid",
    "rank": "gradmesh.runtime",
    "get_runtime": "gradmesh.runtime",
    "shutdown": "gradmesh.runtime",
    "size": "gradmesh.runtime",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from gradmesh.collectives import broadcast_object
    from gradmesh.data_parallel.api import (
        broadcast_optimizer_state,
        poll,
        synchronize,
    )
    from gradmesh.data_parallel.ddp_hook import ddp_comm_hook
    from gradmesh.data_parallel.optimizer import (
        Adasum,
        Average,
        DistributedOptimizer,
        Sum,
        broadcast_parameters,
    )
    from gradmesh.errors import GradmeshError
    from gradmesh.horovod import allgather, allreduce, allreduce_async, broadcast, join
    from gradmesh.layout.hybrid import parallelize
    from gradmesh.runtime import (
        barrier,
        cross_rank,
        cross_size,
        get_runtime,
        init,
        is_initialized,
        local_rank,
        local_size,
        mesh,
        rank,
        shutdown,
        size,
    )
    from gradmesh.timeline import start_timeline, stop_timeline


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gradmesh' has no attribute {name!r}")
