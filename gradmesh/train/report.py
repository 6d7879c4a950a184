"""The run report: what every strategy prints at the end and writes as JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.runtime import Runtime
from gradmesh.train.config import TrainConfig


@dataclass(frozen=True)
class RankStats:
    """Per-rank figures, gathered to every rank."""

    comm_s: list[float]
    compute_s: list[float]
    bytes_sent: list[int]


def gather_rank_stats(rt: Runtime, compute_s: float) -> RankStats:
    """All-gather (comm seconds, compute seconds, bytes sent) from every rank."""
    mine = torch.tensor([rt.comm.comm_s, compute_s, float(rt.comm.bytes_sent)], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(rt.size)]
    dist.all_gather(rows, mine.to(rt.device))
    table = torch.stack([r.cpu() for r in rows])
    return RankStats(
        comm_s=table[:, 0].tolist(),
        compute_s=table[:, 1].tolist(),
        bytes_sent=[int(b) for b in table[:, 2].tolist()],
    )


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values)


@dataclass(frozen=True)
class RunReport:
    """The outcome of one training run; `comm_s`, `compute_s`, `bytes_sent` are per-worker means."""

    test_accuracy: float
    final_loss: float | None
    wall_s: float
    samples_per_s: float
    comm_s: float
    compute_s: float
    bytes_sent: float
    workers: int
    strategy: str
    epochs: int
    seed: int
    model: str
    dataset: str
    batch_size: int
    loss_history: list[float]
    per_rank: dict[str, list[Any]]
    strategy_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        config: TrainConfig,
        workers: int,
        strategy_info: dict[str, Any],
        accuracy: float,
        losses: list[float],
        wall_s: float,
        samples: int,
        stats: RankStats,
    ) -> RunReport:
        return cls(
            test_accuracy=accuracy,
            final_loss=losses[-1] if losses else None,
            wall_s=wall_s,
            samples_per_s=samples / wall_s if wall_s > 0 else 0.0,
            comm_s=_mean(stats.comm_s),
            compute_s=_mean(stats.compute_s),
            bytes_sent=_mean(stats.bytes_sent),
            workers=workers,
            strategy=config.strategy,
            epochs=config.epochs,
            seed=config.seed,
            model=config.model,
            dataset=config.dataset,
            batch_size=config.batch_size,
            loss_history=losses,
            per_rank=dataclasses.asdict(stats),
            strategy_info=strategy_info,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def summary(self) -> str:
        """A few human lines for the end of a run."""
        loss = f"{self.final_loss:.4f}" if self.final_loss is not None else "n/a"
        info = " ".join(  # tables (histograms, per-server stats) are in the JSON report only
            f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.strategy_info.items()
            if not isinstance(v, dict | list) or k == "lost_workers"
        )
        return "\n".join(
            [
                f"gradmesh train: {self.model} on {self.dataset}, strategy {self.strategy} {info}, "
                f"{self.workers} workers, {self.epochs} epochs, global batch {self.batch_size}",
                f"  test accuracy {self.test_accuracy:.4f}   final loss {loss}",
                f"  wall {self.wall_s:.2f} s   {self.samples_per_s:.0f} samples/s   "
                f"comm {self.comm_s:.2f} s   compute {self.compute_s:.2f} s (per worker)",
                f"  bytes sent per worker {self.bytes_sent / 1e6:.2f} MB",
            ]
        )
