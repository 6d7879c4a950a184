"""The model registry: builders by name (`MODELS`), their tensor-parallel plans (`TP_PLANS`),
and `build_model`, which picks the call from the dataset and says which pairs do not fit."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradmesh.data.registry import FEATURE_ID_DATASETS, DataSpec
from gradmesh.errors import GradmeshError
from gradmesh.registry import Registry

__all__ = ["FEATURE_ID_MODELS", "MODELS", "TP_PLANS", "ModelFn", "build_model", "check_pairing"]

ModelFn = Callable[..., nn.Module]
MODELS: Registry[ModelFn] = Registry("model")
TP_PLANS: Registry[dict[str, str]] = Registry("tensor-parallel plan")
FEATURE_ID_MODELS = {"bag"}


def check_pairing(model: str, dataset: str) -> None:
    """A one-line error unless `model` takes the kind of input `dataset` gives."""
    wants_ids = model in FEATURE_ID_MODELS
    if wants_ids and dataset not in FEATURE_ID_DATASETS:
        raise GradmeshError(
            f"model {model} needs a dataset of feature ids "
            f"({', '.join(sorted(FEATURE_ID_DATASETS))}), not {dataset}"
        )
    if not wants_ids and dataset in FEATURE_ID_DATASETS:
        raise GradmeshError(
            f"model {model} needs real-valued inputs; dataset {dataset} gives feature ids "
            f"(use model {', '.join(sorted(FEATURE_ID_MODELS))})"
        )


def build_model(name: str, spec: DataSpec) -> nn.Module:
    """Model `name` shaped for dataset `spec` (check the pair first with `check_pairing`)."""
    builder = MODELS.get(name)
    if name in FEATURE_ID_MODELS:
        return builder(spec.input_shape, spec.num_classes, vocab=spec.vocab)
    return builder(spec.input_shape, spec.num_classes)
