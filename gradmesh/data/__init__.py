"""Datasets by name (`DATASETS`) and the sharder that splits each global batch across ranks."""

from typing import TYPE_CHECKING

from gradmesh.registry import lazy_attributes

if TYPE_CHECKING:
    from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
    from gradmesh.data.sharding import GlobalBatchSharder


__getattr__ = lazy_attributes(
    __name__,
    {
        "DATASETS": "registry",
        "DataOptions": "registry",
        "DataSpec": "registry",
        "Split": "registry",
        "GlobalBatchSharder": "sharding",
    },
)
"""The package's names, loaded on first use (the datasets register themselves on the first
lookup of `DATASETS`), so that importing the package needs no torch."""

__all__ = ["DATASETS", "DataOptions", "DataSpec", "GlobalBatchSharder", "Split"]
