"""scikit-learn's 8x8 handwritten digits: 1,797 real images that ship with the package.

The train/test split is fixed (seeded with SPLIT_SEED, independent of the training seed) so that
every run and every strategy is scored on the same 20% test set.
"""

import torch

from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split

SPLIT_SEED = 20170201
TEST_FRACTION = 0.2


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded permutation cut into (train, test) index tensors."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


@DATASETS.register("digits")
def load_digits(options: DataOptions) -> DataSpec:
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    train, test = split_indices(len(y), TEST_FRACTION, SPLIT_SEED)
    return DataSpec(Split(x[train], y[train]), Split(x[test], y[test]), (1, 8, 8), 10)
