"""Optimizers by name (`--optimizer`): each builds torch's own optimizer over the parameters
this rank holds (after the model was split), from the optimizer config."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer

from gradmesh.registry import Registry
from gradmesh.train.config import OptimizerConfig

OptimizerFn = Callable[[Iterable[torch.nn.Parameter], float, OptimizerConfig], Optimizer]
OPTIMIZERS: Registry[OptimizerFn] = Registry("optimizer")
STATE_TENSORS = {"sgd": 1, "adam": 2, "adamw": 2}
"""Tensors of state each optimizer keeps per parameter, each of the parameter's size and dtype
(SGD's momentum; Adam's two moments): what the planner and the simulator count."""


@OPTIMIZERS.register("sgd")
def sgd(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """SGD with momentum and L2 weight decay."""
    return torch.optim.SGD(
        params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


@OPTIMIZERS.register("adam")
def adam(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """Adam with L2 weight decay added to the gradient."""
    return torch.optim.Adam(params, lr=lr, weight_decay=config.weight_decay)


@OPTIMIZERS.register("adamw")
def adamw(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """Adam with decoupled weight decay."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)


def build_optimizer(
    config: OptimizerConfig, params: Iterable[torch.nn.Parameter], lr: float
) -> Optimizer:
    return OPTIMIZERS.get(config.name)(params, lr, config)
