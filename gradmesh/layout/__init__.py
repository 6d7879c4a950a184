"""Layouts: how one replica of the model is split over the ranks of the mesh's splitting axes,
a folder per parallelism (`tensor/`, `pipeline/`; context and expert parallelism will be
folders beside them), with what every layout shares: the engines and the layout's steps
(`engine.py`: `split_tensor`, `cut_pipeline`, `check_layout`), the loss convention
(`loss.py`), recomputation and what a step holds (`memory.py`), fp8 (`fp8.py`), compilation
(`compile.py`), the options (`config.py`). The recipe that runs the steps in order is
`gradmesh.train.recipe.parallelize` (`gradmesh.parallelize`); sharding over the replicas is
`gradmesh.sync.sharded`.
"""

from typing import Any


def __getattr__(name: str) -> Any:  # loaded on first use: the options in `config` need no torch
    from gradmesh.layout import engine

    return getattr(engine, name)
