"""`gradmesh plan` on a model that is not a sequence of layers (the built-in `gpt`, `residual`,
`hf:...`, a user's `pkg.module:factory`): the data, tensor and pipeline degrees, micro-batches
and schedule with the fastest predicted step (`gradmesh.planner.mesh`), measured on the
trainer's own model, data, loss and optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from gradmesh.layout.config import Layout

if TYPE_CHECKING:  # not imported at run time: it imports torch, which `gradmesh --help` and
    from gradmesh.data.batch import Batch  # a launcher that only starts workers do without


@dataclass
class TrainWorkload:
    """The trainer's workload for the planner: built from `gradmesh train`'s options (plain
    values, so it pickles into the measuring processes)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> tuple[Any, Batch, Batch, Any, Any]:
        import torch

        from gradmesh.train.config import TrainConfig
        from gradmesh.train.optimizers import build_optimizer
        from gradmesh.train.setup import load_data, loss_of, model_of

        config = TrainConfig.of(model=self.name, **self.options)
        data = load_data(config)
        torch.manual_seed(config.job.seed)
        model = model_of(config, data)
        n = config.data.batch_size
        part = data.train.rows(slice(0, n))
        x, y = part.x, part.y

        def optimizer(params: list[Any]) -> Any:
            return build_optimizer(config.optimizer, params, config.optimizer.lr)

        return model, x, y, loss_of(config), optimizer


def workload(
    model: str,
    model_args: str,
    dataset: str,
    sequence_length: int,
    shape: str,
    batch: int,
    optimizer: str = "sgd",
) -> TrainWorkload:
    """The workload of `gradmesh train --model ... --batch-size batch` (token models on the
    text dataset unless a dataset is named)."""
    from gradmesh.models.registry import is_token_model

    if dataset == "synthetic" and is_token_model(model):
        dataset = "text"
    return TrainWorkload(
        model,
        {
            "model_args": model_args,
            "dataset": dataset,
            "sequence_length": sequence_length,
            "synthetic_shape": shape,
            "synthetic_samples": batch * 2,  # 80% of it for training: one global batch fits
            "batch_size": batch,
            "lr": 0.01,
            "optimizer": optimizer,
        },
    )


def flags(row: dict[str, Any]) -> str:
    """The `gradmesh train` flags that run a layout (a prediction's row)."""
    return layout_of(row).flags()


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout a prediction's row describes."""
    return Layout(**{f.name: row[f.name] for f in fields(Layout) if f.name in row})


def describe_mesh(plan: Any, tokens_per_sample: int | None, top: int) -> str:
    """The table `gradmesh plan` prints for a mesh plan: the fastest `top` layouts, and the
    calibration where one was fitted."""
    prof, preds, cal = plan.profile, plan.predictions, plan.calibration
    rate = "tokens/s" if tokens_per_sample else "samples/s"
    lines = [
        f"model {prof.model}, {prof.workers} workers, global batch {prof.batch}: "
        f"{len(preds)} layouts priced (profiled with {prof.threads} thread(s) per rank, "
        f"{prof.concurrent} rank(s) at once)",
        f"{'layout':22} {'step ms':>8} {rate:>10} {'compute':>8} {'tp':>6} {'pp':>6} "
        f"{'sync':>6} {'update':>6} {'bubble':>6} {'params/rank':>11} {'memory/rank':>11}",
    ]
    for p in preds[:top]:
        r = p.row()
        per_s = prof.batch * (tokens_per_sample or 1) / p.step_s
        lines.append(
            f"{r['name']:22} {p.step_s * 1e3:8.1f} {per_s:10.0f} {p.compute_s * 1e3:8.1f} "
            f"{p.tensor_parallel_s * 1e3:6.1f} {p.pipeline_s * 1e3:6.1f} {p.sync_s * 1e3:6.1f} "
            f"{p.update_s * 1e3:6.1f} {p.bubble:6.3f} {p.param_bytes_per_rank / 1e6:9.2f}MB "
            f"{p.memory.total_bytes / 2**20 if p.memory else 0:8.1f}MiB"
        )
    if cal.fitted_on:
        fsdp = ""
        if any("xz" in name for name in cal.fitted_on):  # a ZeRO layout was measured
            fsdp = f", each FSDP2 exchange {cal.unit_exchange_s * 1e3:.2f} ms"
        lines.append(
            f"calibrated on {', '.join(f'{n} {s * 1e3:.1f} ms' for n, s in cal.fitted_on.items())}"
            f": a step's own work {cal.step_overhead_s * 1e3:.2f} ms, each tp exchange "
            f"{cal.exchange_s * 1e3:.2f} ms, each stage's micro-batch "
            f"{cal.microbatch_s * 1e3:.2f} ms{fsdp}"
        )
    lines.append(f"plan: {preds[0].layout.name}: gradmesh train {flags(preds[0].row())}")
    return "\n".join(lines)
