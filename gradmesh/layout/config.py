"""The layout's options: how one replica of the model is split over ranks (the rest of the
workers are data-parallel replicas). No torch here: the CLI builds its flags from this."""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.options import option

SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules by name (`gradmesh.layout.pipeline` runs them)."""


@dataclass
class LayoutConfig:
    """Layout: how one replica of the model is split over ranks (the rest of the workers are
    data-parallel replicas)."""

    tensor_parallel: int = option(1, "ranks each layer of the model's plan is split over (tp)")
    pipeline_parallel: int = option(1, "pipeline stages the model's layers are cut into (pp)")
    microbatches: int = option(1, "pipeline: micro-batches per replica's batch")
    schedule: str = option("1f1b", "pipeline schedule", choices=SCHEDULES)
    stages: str = option(
        "",
        "pipeline: where each stage after the first starts: layer indices of a sequence of "
        "layers (4,9) or module names of any other model (blocks.2,blocks.4); default: "
        "balanced (by measured layer time, or by forward FLOPs on the model's graph)",
    )
    plan: str = option(
        "",
        "hybrid plan, a placement per layer: a plan file (gradmesh plan --json), or auto to "
        "plan for this host's loopback link; sets --tensor-parallel",
    )

    @property
    def split(self) -> bool:
        """Whether one replica spans more than one rank."""
        return self.tensor_parallel * self.pipeline_parallel > 1
