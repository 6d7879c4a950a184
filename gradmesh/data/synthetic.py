"""A documented synthetic classification task of any input shape and class count.

Each class has a random prototype drawn from N(0, 1); a sample is its class prototype plus
N(0, 1.5^2) noise, so the Bayes-optimal classifier is nearest-prototype and accuracy well above
chance is reachable by any model. Everything is drawn from a fixed seed.
"""

import torch

from gradmesh.data.digits import split_indices
from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split

DATA_SEED = 7
NOISE = 1.5


@DATASETS.register("synthetic")
def make_synthetic(options: DataOptions) -> DataSpec:
    g = torch.Generator().manual_seed(DATA_SEED)
    prototypes = torch.randn((options.classes, *options.shape), generator=g, device="cpu")
    y = torch.randint(0, options.classes, (options.samples,), generator=g, device="cpu")
    x = prototypes[y] + NOISE * torch.randn(
        (options.samples, *options.shape), generator=g, device="cpu"
    )
    train, test = split_indices(options.samples, 0.2, DATA_SEED)
    return DataSpec(
        Split(x[train], y[train]), Split(x[test], y[test]), options.shape, options.classes
    )
