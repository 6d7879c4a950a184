"""The built-in names of the registries a run's flags name, so that `gradmesh train`'s parent
process (the launcher) checks them without importing torch: the registries live in, or load,
modules that import it, which cost the parent 1.3-2.8 s of CPU on every launch (measured with
`python -X importtime -m gradmesh.cli train`) before its workers import it again.

The registries stay the truth: a name not listed here is looked up in its registry (a user's
import path, a scheme such as `hf:llama` or `tokens:GLOB`, something registered by a plugin, or
a typo, which gets the registry's one-line error listing the valid names), and
tests/unit/test_names.py checks that every tuple equals its registry's names.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from gradmesh.registry import canonical_name

STRATEGIES = ("allreduce", "diloco", "hogwild", "local-sgd", "ps")
ALGORITHMS = ("auto", "butterfly", "hierarchical", "native", "ring", "star", "tree")
COMPRESSORS = ("bf16", "fp16", "int8", "none", "powersgd", "sign", "topk")
MODELS = (
    "alexnet",
    "alexnet-imagenet",
    "bag",
    "cnn",
    "gpt",
    "inception3",
    "linear",
    "mlp",
    "residual",
    "resnet101",
    "resnet50",
    "vgg16",
)
DATASETS = ("digits", "docstrings", "synthetic", "text")

WHERE = {
    "strategy": (STRATEGIES, "gradmesh.sync.strategies", "STRATEGIES"),
    "allreduce algorithm": (ALGORITHMS, "gradmesh.collectives.api", "ALGORITHMS"),
    "compressor": (COMPRESSORS, "gradmesh.compression.registry", "COMPRESSORS"),
    "model": (MODELS, "gradmesh.models.registry", "MODELS"),
    "dataset": (DATASETS, "gradmesh.data.registry", "DATASETS"),
}
"""Registry kind -> (its built-in names, the module that holds it, its name there)."""


def registry(kind: str) -> Any:
    """The registry of `kind` (importing its module, and torch with it)."""
    _, module, attr = WHERE[kind]
    return getattr(import_module(module), attr)


def check(kind: str, name: str) -> None:
    """Nothing where `name` is a built-in name of the registry of `kind`; otherwise the
    registry's own lookup: the user's entry, or its one-line error."""
    if canonical_name(name) not in WHERE[kind][0]:
        registry(kind).get(name)
