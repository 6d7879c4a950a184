"""The update a server applies to its shard: torch's SGD (with momentum), AdaGrad and Adam on the
flat shard, and AdaRevision, the delay-tolerant AdaGrad of McMahan & Streeter (2014), written
here because torch has no equivalent.

AdaRevision, per coordinate: the server keeps z (the sum of every gradient applied), z' (an
AdaGrad-like accumulator that counts each gradient's interaction with the gradients that arrived
while it was being computed) and z'max. A worker's read records z; when its gradient g comes
back, g_bck = z - z(read) is the backlog it never saw, and

    eta_old = alpha / sqrt(z'max);  z += g;  z' += g^2 + 2 g g_bck;  z'max = max(z'max, z')
    eta = alpha / sqrt(z'max);      x -= eta g - (eta_old - eta) g_bck

the second term revising the backlog's earlier, larger steps down to the new rate. With no delay
(g_bck = 0) it is AdaGrad.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from gradmesh.errors import GradmeshError

SERVER_OPTIMIZERS = ("sgd", "adagrad", "adam", "adarevision")
INITIAL_ACCUMULATOR = 0.1


class ServerOptimizer(Protocol):
    def on_read(self, worker: int) -> None:
        """A worker has just read the shard."""

    def apply(self, grad: torch.Tensor, worker: int, lr_scale: float) -> None:
        """Apply one gradient (from `worker`) with the learning rate times `lr_scale`."""


class TorchOptimizer:
    """A torch optimizer stepping the flat shard."""

    def __init__(self, shard: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.shard = shard
        self.optimizer = optimizer
        self.base_lr = [g["lr"] for g in optimizer.param_groups]

    def on_read(self, worker: int) -> None:
        pass

    def apply(self, grad: torch.Tensor, worker: int, lr_scale: float) -> None:
        self.shard.grad = grad
        for group, lr in zip(self.optimizer.param_groups, self.base_lr, strict=True):
            group["lr"] = lr * lr_scale
        self.optimizer.step()


class AdaRevision:
    """Delay-tolerant AdaGrad (see the module docstring)."""

    def __init__(self, shard: torch.Tensor, lr: float) -> None:
        self.x = shard
        self.alpha = lr
        self.z = torch.zeros_like(shard)
        self.zp = torch.full_like(shard, INITIAL_ACCUMULATOR)
        self.zmax = self.zp.clone()
        self.read: dict[int, torch.Tensor] = {}

    def on_read(self, worker: int) -> None:
        self.read[worker] = self.z.clone()

    @torch.no_grad()
    def apply(self, grad: torch.Tensor, worker: int, lr_scale: float) -> None:
        backlog = self.z - self.read[worker] if worker in self.read else torch.zeros_like(grad)
        alpha = self.alpha * lr_scale
        eta_old = alpha / self.zmax.sqrt()
        self.z += grad
        self.zp += grad * grad + 2 * grad * backlog
        torch.maximum(self.zmax, self.zp, out=self.zmax)
        eta = alpha / self.zmax.sqrt()
        self.x -= eta * grad - (eta_old - eta) * backlog


def make_optimizer(
    name: str, shard: torch.Tensor, lr: float, momentum: float, weight_decay: float
) -> ServerOptimizer:
    """The server optimizer `name` over `shard` (an `nn.Parameter` updated in place)."""
    if name == "adarevision":
        return AdaRevision(shard, lr)
    assert isinstance(shard, nn.Parameter)
    if name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            [shard], lr=lr, momentum=momentum, weight_decay=weight_decay
        )
    elif name == "adagrad":
        opt = torch.optim.Adagrad([shard], lr=lr, weight_decay=weight_decay)
    elif name == "adam":
        opt = torch.optim.Adam([shard], lr=lr, weight_decay=weight_decay)
    else:
        raise GradmeshError(
            f"unknown server optimizer {name!r} (valid: {', '.join(SERVER_OPTIMIZERS)})"
        )
    return TorchOptimizer(shard, opt)
