"""What the planners price on, without torch: a layer unit's profile, a model's (`Profile`),
and the links' cost figures (`Links`), so that the simulator's and the planner's commands can
build their options and say their one-line errors without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradmesh.collectives.cost import COSTS, CostParams

__all__ = ["STATED_ERROR", "Curve", "Links", "Profile", "Unit"]

STATED_ERROR = 0.4
"""How far a calibrated prediction may be from its measurement, as a fraction of the
measurement: the planner's own statement, which `gradmesh bench layout` checks (its choice must
measure within this of the fastest layout). On this 2-core machine the layouts outside the
calibration measured from -22% to +37% of their predictions in four runs (docs/your_model.md):
the per-micro-batch term fitted on dp 2 x pp 2 overprices a pipeline without data parallelism,
and tp 4 on emulated 1 Gbit/s links waits longer per exchange than tp 2 did."""


@dataclass
class Unit:
    """One layer with weights and the weightless layers after it."""

    name: str
    kind: str
    param_bytes: int
    bias_bytes: int
    in_bytes: int
    """Per sample, into the weighted layer."""
    mid_bytes: int
    """Per sample, out of the weighted layer (a rowwise layer's partial sums)."""
    out_bytes: int
    """Per sample, out of the unit."""
    dims: tuple[int, int]
    """(output, input) features or channels: what colwise and rowwise split."""
    fwd: dict[str, float] = field(default_factory=dict)
    """Seconds of forward per placement key ('data', 'replicate@T', 'colwise@T', 'rowwise@T')."""
    bwd: dict[str, float] = field(default_factory=dict)


@dataclass
class Profile:
    model: str
    workers: int
    batch: int
    units: list[Unit]
    threads: int
    """Threads per rank (the launcher's share of this machine's cores)."""
    concurrent: int
    """Processes that measured at once (the ranks sharing this machine's cores)."""
    update_s_per_byte: float
    """A step's work per parameter byte besides forward and backward (`_update_per_byte`)."""
    optimizer_slots: int = 1
    """Optimizer tensors per parameter (SGD with momentum: 1) for the memory estimate."""
    step_overhead_s: float = 0.0
    """A step's work that the units timed alone do not show (the trainer's loop, hooks and
    bookkeeping under the job's own contention, and the slowest rank's share of it: ranks
    time-sliced on shared cores do not finish their compute together, and a step waits for the
    last): measured by `gradmesh plan` as real data-parallel steps' time outside communication
    on their slowest rank, less the predicted compute; every placement pays it once per step."""

    def key(self, choice: str, tp: int) -> str:
        return "data" if choice == "data" or tp == 1 else f"{choice}@{tp}"


Curve = list[tuple[int, CostParams]]
"""A link fitted piecewise: (largest message size, the figures that price messages up to it),
by size; messages larger than the last size take the last figures."""


@dataclass
class Links:
    """Link cost parameters within a host and across hosts, and ranks per host (tp groups are
    adjacent ranks, so a group of at most this many stays in one host); where a probe fitted
    them, a `Curve` per group size and level, fitted on groups of that many ranks all reducing
    at once (a pair meets other costs than the whole world) and piecewise in message size (on
    the emulated links allreduces cost about the same from 16 KB to 256 KB, then grow at the
    line rate: one line through all sizes was 15% off at both ends)."""

    intra: CostParams
    inter: CostParams
    ranks_per_host: int
    intra_by_size: dict[int, Curve] = field(default_factory=dict)
    inter_by_size: dict[int, Curve] = field(default_factory=dict)
    point_to_point: CostParams | None = None
    """One message between two hosts where a probe fitted it (`plan.loaded_pingpong`): what a
    parameter server's pushes and pulls meet; None: the inter figures."""

    def over(self, ranks: list[int], nbytes: float = 0.0) -> CostParams:
        """The figures that price a message of `nbytes` over the group `ranks`."""
        one_host = len({r // self.ranks_per_host for r in ranks}) <= 1
        curve = (self.intra_by_size if one_host else self.inter_by_size).get(len(ranks))
        if not curve:
            return self.intra if one_host else self.inter
        return next((c for upto, c in curve if nbytes <= upto), curve[-1][1])

    def allreduce_s(
        self, algorithm: str, ranks: list[int], nbytes: float, priced_at: float | None = None
    ) -> float:
        """Seconds for `algorithm` to allreduce `nbytes` over `ranks` (host-major), from its
        registered formula on the figures that price a message of `priced_at` (default
        `nbytes`): within a host on the intra figures; across hosts, `hierarchical` as its two
        levels (a tree inside each host on the intra figures, the leaders on the inter ones),
        any other algorithm on the inter figures (its slowest link)."""
        p = len(ranks)
        if p <= 1:
            return 0.0
        at = nbytes if priced_at is None else priced_at
        hosts = len({r // self.ranks_per_host for r in ranks})
        if algorithm == "hierarchical" and hosts > 1:
            local = p // hosts
            intra, inter = self.over(ranks[:local], at), self.over(ranks[::local], at)
            from gradmesh.collectives.hierarchical import two_level_cost  # imports torch

            return two_level_cost(local, hosts, int(nbytes), intra, inter)
        return COSTS.get(algorithm)(p, int(nbytes), self.over(ranks, at), 1)
