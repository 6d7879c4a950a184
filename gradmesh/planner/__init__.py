"""The hybrid planner: measure each layer, predict each placement's time from the collectives'
own cost formulas, and choose the placement per layer that minimises the predicted step.

**Profile.** For each layer with weights (with the weightless layers after it: a *unit*) at the
job's per-rank batch: forward and backward seconds on this machine (warm-up, median of several
runs) for every placement (`data` on 1/W of the global batch; `replicate` on 1/dp of it; the
colwise and rowwise slices on 1/dp of it), parameter bytes, and per-sample activation bytes into
the layer, out of the layer and out of the unit; and a step's other work per parameter byte
(zeroing, bucket copies, the SGD update). It runs with the thread count the launcher gives each
rank, and in as many processes at once as there are ranks sharing this machine's cores, so that
the contention the job will meet is measured, not assumed.

**Cost.** Per unit and placement at tp T (dp D = W / T, global batch N), with every formula read
from the collectives (`COSTS` for allreduce, `allgather_cost`):
- blocking exchanges: colwise, the allreduce of its input's gradient over tp (N/D samples of the
  input); rowwise, the allreduce of its partial sums over tp (N/D samples of its output); a
  conversion before the layer, an all-gather over tp of N/D samples of its input (S -> R in
  forward, R -> S in backward); the logits' gather when the last state is S;
- gradient sync, overlappable with the rest of backward: the layer's parameter bytes (a slice's
  for a split layer) averaged over the ranks that hold them: W for `data` (dp x tp), D otherwise;
  each group's link is the within-host one when the group fits a host (tp groups are adjacent
  ranks), else the across-host one.
`predict` lays a step out in time: forward, then backward unit by unit in reverse; each
reducer's buckets (cut as `plan_buckets` cuts them, `fusion_mb`) leave when their last gradient
is ready and share one link in order; the step ends when backward and the last bucket are done,
plus the update of the parameter bytes the rank holds and the step's own overhead
(`Profile.step_overhead_s`, where a probe measured it).

**Search.** Exact dynamic programming over units x activation state (S, R, C) for each tp that
divides W, on an additive objective: each unit's compute, blocking exchanges and the bandwidth
part of its gradient sync; the latency of each reducer's messages is added once. With a memory
limit the state also carries the bytes held (parameters, gradients, optimizer slots and saved
activations), in 256 steps of the limit. The chosen plan is then timed by `predict`, and so are
pure data parallelism, pure tensor parallelism (the model's own tensor-parallel plan at tp W)
and the rule "convolutions data-parallel, fully connected layers split".
"""

from typing import TYPE_CHECKING

from gradmesh.registry import lazy_attributes

if TYPE_CHECKING:
    from gradmesh.planner.cost import *  # noqa: F403
    from gradmesh.planner.links import *  # noqa: F403
    from gradmesh.planner.mesh import *  # noqa: F403
    from gradmesh.planner.mesh_cost import *  # noqa: F403
    from gradmesh.planner.mesh_memory import *  # noqa: F403
    from gradmesh.planner.profiling import *  # noqa: F403
    from gradmesh.planner.search import *  # noqa: F403

MODULES = ("links", "cost", "mesh", "mesh_cost", "mesh_memory", "profiling", "search")
"""The planner's modules, whose `__all__` the package offers, each imported on first use: what
the commands price on (`links`) needs no torch, so `gradmesh --help` imports none."""


__getattr__ = lazy_attributes(__name__, search=MODULES)
