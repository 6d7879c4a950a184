"""What a dataset provides and the registry that names them."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradmesh.registry import Registry


@dataclass(frozen=True)
class Split:
    """Inputs and integer labels held in memory."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


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
DATASETS: Registry[DatasetFn] = Registry("dataset")
FEATURE_ID_DATASETS: set[str] = set()
"""Datasets whose inputs are int64 feature ids (DataSpec.vocab > 0), known without loading them."""
TOKEN_DATASETS: set[str] = {"text"}
"""Datasets of token sequences: inputs (time,) int64 ids, labels (time,) the next token each."""
