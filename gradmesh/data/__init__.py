"""Datasets by name (`DATASETS`) and the sharder that splits each global batch across ranks."""

from gradmesh.data import digits as _digits  # noqa: F401  (registers "digits")
from gradmesh.data import docstrings as _docstrings  # noqa: F401  (registers "docstrings")
from gradmesh.data import synthetic as _synthetic  # noqa: F401  (registers "synthetic")
from gradmesh.data import text as _text  # noqa: F401  (registers "text")
from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
from gradmesh.data.sharding import GlobalBatchSharder

__all__ = ["DATASETS", "DataOptions", "DataSpec", "GlobalBatchSharder", "Split"]
