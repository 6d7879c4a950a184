"""scikit-learn's 8x8 handwritten digits: 1,797 real images that ship with the package.

The train/test split is fixed (seeded with SPLIT_SEED, independent of the training seed) so that
every run and every strategy is scored on the same 20% test set.

The images are read from the file scikit-learn ships (`sklearn/datasets/data/digits.csv.gz`,
what its `load_digits` parses) without importing `sklearn.datasets`: that import (scipy with it)
costs 0.7 s of CPU in every rank of every job, about as much as torch's own. A unit test checks
the arrays equal `sklearn.datasets.load_digits()`'s.
"""

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
from gradmesh.errors import GradmeshError

SPLIT_SEED = 20170201
TEST_FRACTION = 0.2


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded permutation cut into (train, test) index tensors."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed), device="cpu")
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images as 1,797 x 64 floats 0..16, labels) from scikit-learn's shipped file."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise GradmeshError("the digits dataset needs scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


@DATASETS.register("digits")
def load_digits(options: DataOptions) -> DataSpec:
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32, device="cpu").reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64, device="cpu")
    train, test = split_indices(len(y), TEST_FRACTION, SPLIT_SEED)
    return DataSpec(Split(x[train], y[train]), Split(x[test], y[test]), (1, 8, 8), 10)
