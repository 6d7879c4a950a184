"""The one training loop every strategy and layout runs in, on every rank.

`train` is five parts: `setup` (data, the model split by the layout, the optimizer over this
rank's parameters), `attach` (the strategy's wrapping, the data shard), `resume` (every rank's
part of the newest complete checkpoint: model, optimizer, strategy state, RNG, position),
`loop` (steps of `engine.step`, checkpoints every N steps or epoch), `finish` (evaluation
through the same engine, the report).

Per step each replica computes the summed loss of its slice of the global batch, scaled by
replicas / global batch size: after gradient averaging over the `dp` axis this is exactly the
mean loss over the global batch, so the job takes the step one worker with the whole batch would.
"""

from __future__ import annotations

from gradmesh.runtime.world import Runtime
from gradmesh.train.config import TrainConfig
from gradmesh.train.finish import finish
from gradmesh.train.loop import loop
from gradmesh.train.report import RunReport
from gradmesh.train.resume import resume
from gradmesh.train.setup import attach, setup


def train(config: TrainConfig, rt: Runtime) -> tuple[RunReport, bool]:
    """Train `config` on this rank of `rt`; return the report (the same on every rank of a
    synchronous job) and whether this process is the one that prints and writes it."""
    job = setup(config, rt)
    attach(job)
    resume(job)
    if config.sync.replicas.enabled:
        from gradmesh.train.replicated import replicated_loop

        clock, samples, wall_s, job.replica_info = replicated_loop(job)
    else:
        clock, samples, wall_s = loop(job)
    return finish(job, clock, samples, wall_s)
