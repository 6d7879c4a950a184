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


def fused(params: list[torch.nn.Parameter]) -> bool | None:
    """True (torch's `fused=True`) where every parameter is on CUDA, DTensor shards (ZeRO 2/3,
    tensor parallelism) included, as torchtitan steps them: one kernel for the whole update
    instead of torch's default (foreach: a few kernels a group on CUDA), and fp16's overflow
    verdict read on the device (`gradmesh.train.loss_scale.skips_on_device`). CPU keeps
    torch's default (None), the same arithmetic as a script's optimizer."""
    cuda = bool(params) and all(p.is_cuda for p in params)
    return True if cuda else None


@OPTIMIZERS.register("sgd")
def sgd(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """SGD with momentum and L2 weight decay."""
    own = list(params)
    return torch.optim.SGD(
        own, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay, fused=fused(own)
    )


@OPTIMIZERS.register("adam")
def adam(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """Adam with L2 weight decay added to the gradient."""
    own = list(params)
    return torch.optim.Adam(own, lr=lr, weight_decay=config.weight_decay, fused=fused(own))


@OPTIMIZERS.register("adamw")
def adamw(params: Iterable[torch.nn.Parameter], lr: float, config: OptimizerConfig) -> Optimizer:
    """Adam with decoupled weight decay."""
    own = list(params)
    return torch.optim.AdamW(own, lr=lr, weight_decay=config.weight_decay, fused=fused(own))


def build_optimizer(
    config: OptimizerConfig, params: Iterable[torch.nn.Parameter], lr: float
) -> Optimizer:
    return OPTIMIZERS.get(config.name)(params, lr, config)
