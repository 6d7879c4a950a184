"""gradmesh: distributed deep-learning training for PyTorch.

Horovod-style use from a script::

    import gradmesh
    gradmesh.init()
    gradmesh.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""

from gradmesh.data_parallel.optimizer import (
    Average,
    DistributedOptimizer,
    Sum,
    broadcast_parameters,
)
from gradmesh.errors import GradmeshError
from gradmesh.runtime import (
    WorkerGrid,
    barrier,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    runtime,
    shutdown,
    size,
)

__all__ = [
    "Average",
    "DistributedOptimizer",
    "GradmeshError",
    "Sum",
    "WorkerGrid",
    "barrier",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "runtime",
    "shutdown",
    "size",
]
