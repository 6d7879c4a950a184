"""What `import gradmesh` offers a script: the Horovod-style API (init, the optimizer wrapper,
broadcasts, collectives), the mesh, and the recipe that makes a model parallel
(`parallelize`, with its `LayoutConfig`). This module is the one list of those names;
`gradmesh/__init__.py` loads it on first use."""

from gradmesh.collectives import broadcast_object
from gradmesh.errors import GradmeshError
from gradmesh.horovod.api import join
from gradmesh.horovod.gathers import allgather, broadcast
from gradmesh.horovod.reductions import allreduce, allreduce_async
from gradmesh.layout.config import LayoutConfig
from gradmesh.layout.pipeline.stages import pipeline_stage
from gradmesh.layout.tensor.vocab import vocab_parallel_cross_entropy
from gradmesh.observe.timeline import start_timeline, stop_timeline
from gradmesh.runtime.world import (
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
from gradmesh.sync.data_parallel.api import broadcast_optimizer_state, poll, synchronize
from gradmesh.sync.data_parallel.ddp_hook import ddp_comm_hook
from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer, broadcast_parameters
from gradmesh.sync.data_parallel.reducer import Adasum, Average, Sum
from gradmesh.sync.replicas.script import ReplicaGroup
from gradmesh.sync.sharded.model import shard
from gradmesh.train.recipe import parallelize

__all__ = sorted(name for name in dir() if not name.startswith("_"))
