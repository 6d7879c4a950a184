"""Split each global batch across ranks so that W workers see exactly what one worker would.

The epoch's order is a permutation drawn from (seed, epoch); the order is cut into global batches
of B samples and rank r takes the r-th of W near-equal slices of each. Every sample is seen once
per epoch by exactly one rank, and the union of the ranks' slices of step t is the batch a single
process with batch B would take at step t: the basis of data-parallel equivalence.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gradmesh.errors import GradmeshError


@dataclass(frozen=True)
class GlobalBatchSharder:
    """The index slices one rank trains on, epoch by epoch."""

    num_samples: int
    global_batch: int
    rank: int
    world: int
    seed: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise GradmeshError(f"bad shard: rank {self.rank} of {self.world}")
        if self.global_batch < self.world:
            raise GradmeshError(
                f"global batch {self.global_batch} is smaller than "
                f"the number of workers {self.world}"
            )

    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=g, device="cpu")

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, int]]:
        """Yield (this rank's indices, size of the whole global batch) for each step of `epoch`."""
        order = self.order(epoch)
        for start in range(0, self.num_samples, self.global_batch):
            batch = order[start : start + self.global_batch]
            yield torch.tensor_split(batch, self.world)[self.rank], len(batch)
