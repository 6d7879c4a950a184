"""What a dataset provides and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradmesh.registry import Registry

if TYPE_CHECKING:
    from gradmesh.data.batch import Batch


@dataclass(frozen=True)
class Split:
    """Inputs and targets held in memory: each a tensor, or a tuple, list or dict of tensors (a
    model's several inputs, a loss's several targets; `gradmesh.data.batch`), the samples first
    in every tensor."""

    x: Batch
    y: Batch

    def __len__(self) -> int:
        import gradmesh.data.batch as batch  # imports torch: the options need none

        return batch.size(self.y)

    def rows(self, index: Any) -> Split:
        """The samples `index` (a slice, or indices) of inputs and targets."""
        import gradmesh.data.batch as batch

        return Split(batch.rows(self.x, index), batch.rows(self.y, index))

    def to(self, device: Any) -> Split:
        import gradmesh.data.batch as batch

        return Split(batch.to(self.x, device), batch.to(self.y, device))

    def pinned(self, device: Any) -> Split:
        """Inputs and targets in page-locked memory where they will go to a GPU."""
        import gradmesh.data.batch as batch

        return Split(batch.pinned(self.x, device), batch.pinned(self.y, device))


@dataclass(frozen=True)
class DataSpec:
    """A train/test pair and the shape a model must accept."""

    train: Split
    test: Split
    input_shape: tuple[int, ...]
    num_classes: int
    vocab: int = 0
    """For inputs that are int64 feature ids: how many ids there are. 0 for real-valued inputs."""


@dataclass(frozen=True)
class DataOptions:
    """Dataset options from the command line; each dataset reads the ones it understands."""

    shape: tuple[int, ...] = (1, 8, 8)
    """Input shape of one synthetic sample (channels, height, width)."""
    classes: int = 10
    """Number of synthetic classes."""
    samples: int = 2048
    """Number of synthetic samples (train + test)."""
    sequence: int = 64
    """Tokens per sample of a token dataset."""


DatasetFn = Callable[[DataOptions], DataSpec]


def load_datasets() -> None:
    """Import the modules whose datasets register themselves: on the first lookup of
    `DATASETS`, not at import, so that the options and the CLI's flags need no torch."""
    import importlib

    for name in ("digits", "docstrings", "synthetic", "text", "tokens"):
        importlib.import_module(f"gradmesh.data.{name}")


DATASETS: Registry[DatasetFn] = Registry("dataset", loader=load_datasets)
FEATURE_ID_DATASETS: set[str] = {"docstrings"}
"""Datasets whose inputs are int64 feature ids (DataSpec.vocab > 0), known without loading them."""
TOKEN_DATASETS: set[str] = {"text"}
"""Datasets of token sequences: inputs (time,) int64 ids, labels (time,) the next token each."""
DATASET_SCHEMES = {"tokens": "token files on disk (gradmesh.data.tokens)"}
"""Datasets named `scheme:rest` (known without loading them): all of token sequences."""


def is_token_dataset(name: str) -> bool:
    """Whether dataset `name` gives token sequences (a registered one, or a scheme's)."""
    return name in TOKEN_DATASETS or is_scheme(name)


def is_scheme(name: str) -> bool:
    """Whether `name` is a dataset scheme's (`tokens:GLOB`), not a user's import path."""
    return ":" in name and name.partition(":")[0] in DATASET_SCHEMES
