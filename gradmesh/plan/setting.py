"""What a plan is made for (`Setting`), and the trainer config that runs a placement of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Setting:
    """What a plan is made for: the model and data, the world, the links."""

    model: str
    dataset: str
    shape: str
    workers: int
    batch: int
    tp_max: int
    model_args: str = ""
    """The model builder's keyword arguments (`--model-args`), as the trainer takes them."""

    def arguments(self) -> dict[str, Any]:
        """`model_args` parsed, as `build_model` takes them."""
        from gradmesh.registry import parse_kwargs

        return parse_kwargs(self.model_args, "--model-args")


def placement_config(setting: Setting, tp: int, layers: dict[str, str]) -> Any:
    """The trainer's configuration of a job that trains `setting` with placement `layers`."""
    import json

    from gradmesh.train.config import TrainConfig

    return TrainConfig.of(
        workers=setting.workers,
        model=setting.model,
        model_args=setting.model_args,
        dataset=setting.dataset,
        synthetic_shape=setting.shape,
        synthetic_samples=setting.batch * 2,  # 80% of it for training: one global batch fits
        batch_size=setting.batch,
        lr=0.01,
        momentum=0.9,
        tensor_parallel=tp,
        plan=json.dumps({"model": setting.model, "tensor_parallel": tp, "layers": layers}),
    )
