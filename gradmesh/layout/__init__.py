"""Layouts: how one replica of the model is split over the ranks of the mesh's `tp` and `pp` axes.

`split_model` applies the layout in one order, the one DESIGN.md documents: tensor parallelism
first (each layer of the model's plan becomes this rank's slice), then pipeline parallelism (this
rank keeps its stage's layers). It returns this rank's part of the model and the step engine that
runs it: `PlainEngine` (forward, backward) or `PipelineEngine` (a schedule over micro-batches).
`check_layout` says, before any process starts, why a layout cannot split a model. A hybrid
`Plan` (`gradmesh.layout.tensor.hybrid`) places each layer on its own instead of the model's uniform
tensor-parallel plan; `gradmesh.parallelize` applies one from a script.
"""

from typing import Any


def __getattr__(name: str) -> Any:  # loaded on first use: the options in `config` need no torch
    from gradmesh.layout import engine

    return getattr(engine, name)
