"""The model registry: builders by name (`MODELS`), their tensor-parallel plans (`TP_PLANS`),
and `build_model`, which picks the call from the dataset and says which pairs do not fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gradmesh.data.registry import (
    FEATURE_ID_DATASETS,
    TOKEN_DATASETS,
    DataSpec,
    is_scheme,
    is_token_dataset,
)
from gradmesh.errors import GradmeshError
from gradmesh.options import KIND_NAMES, of_kind
from gradmesh.registry import Registry

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "FEATURE_ID_MODELS",
    "MODELS",
    "TOKEN_MODELS",
    "is_token_model",
    "TP_PLANS",
    "ModelFn",
    "build_model",
    "check_arg_kinds",
    "check_pairing",
]

ModelFn = Callable[..., "nn.Module"]


def load_models() -> None:
    """Import the modules whose models (and plans) register themselves: on the first lookup of
    `MODELS` or `TP_PLANS`, not at import, so that importing the package needs no torch."""
    import importlib

    for name in ("gpt", "hf", "imagenet", "small"):
        importlib.import_module(f"gradmesh.models.{name}")


MODELS: Registry[ModelFn] = Registry("model", loader=load_models)
TP_PLANS: Registry[dict[str, str]] = Registry("tensor-parallel plan", loader=load_models)
FEATURE_ID_MODELS = {"bag"}
TOKEN_MODELS = {"gpt"}
"""Models of token sequences: (batch, time) ids in, (batch, time, vocab) logits out."""


def is_token_model(model: str) -> bool:
    """Whether `model` is a language model (trained on the text dataset, measured in tokens):
    a built-in one or a Hugging Face one (`hf:...`)."""
    return model in TOKEN_MODELS or model.startswith("hf:")


def check_pairing(model: str, dataset: str) -> None:
    """A one-line error unless `model` takes the kind of input `dataset` gives (a user's model
    or dataset, an import path, is taken at its word)."""
    if (":" in dataset and not is_scheme(dataset)) or (
        ":" in model and model.partition(":")[0] not in MODELS.schemes
    ):
        return
    tokens = is_token_dataset(dataset)
    if ":" in model:  # a scheme's model (hf:llama) is a token model
        if not tokens:
            raise GradmeshError(
                f"model {model} trains on token datasets ({', '.join(sorted(TOKEN_DATASETS))}), "
                f"not {dataset}"
            )
        return
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
    if (model in TOKEN_MODELS) != tokens:
        raise GradmeshError(
            f"model {model} and dataset {dataset} do not fit: token models "
            f"({', '.join(sorted(TOKEN_MODELS))}) train on token datasets "
            f"({', '.join(sorted(TOKEN_DATASETS))}), and only they do"
        )


def build_model(name: str, spec: DataSpec, args: dict[str, Any] | None = None) -> nn.Module:
    """Model `name` shaped for dataset `spec` (check the pair first with `check_pairing`),
    with the builder's keyword arguments `args`. A user's factory (`pkg.module:factory`) is
    called with `args` alone and must return an `nn.Module`."""
    builder = MODELS.get(name)
    args = args or {}
    check_arg_kinds(name, _hints(builder), args)
    try:
        if ":" in name and name.partition(":")[0] not in MODELS.schemes:
            model = builder(**args)
        elif name in FEATURE_ID_MODELS:
            model = builder(spec.input_shape, spec.num_classes, vocab=spec.vocab, **args)
        else:
            model = builder(spec.input_shape, spec.num_classes, **args)
    except TypeError as exc:
        raise GradmeshError(f"model {name}: {exc}") from None
    from torch import nn

    if not isinstance(model, nn.Module):
        raise GradmeshError(f"model {name} returned a {type(model).__name__}, not an nn.Module")
    return model


def check_arg_kinds(model: str, hints: dict[str, Any], args: dict[str, Any]) -> None:
    """One line for a `--model-args` value of the wrong kind (`dim=x`), which would otherwise
    fail deep in the model's construction with a message about something else. Text is not
    checked: `variant=50` reads as a number, and a factory may take it."""
    for key, value in args.items():
        kind = hints.get(key)
        if kind in (int, float, bool) and not of_kind(value, kind):
            raise GradmeshError(f"model {model}: {key} must be {KIND_NAMES[kind]}, got {value!r}")


def _hints(builder: Callable[..., Any]) -> dict[str, Any]:
    """The builder's parameters' types, where they resolve (a user's may not)."""
    import typing

    try:
        return typing.get_type_hints(builder)
    except Exception:  # noqa: BLE001 - a user's annotations may name anything
        return {}
