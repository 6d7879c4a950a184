"""The update a server applies to its shard: SGD (with momentum and weight decay), torch's AdaGrad
and Adam on the flat shard, and AdaRevision, the delay-tolerant AdaGrad of McMahan & Streeter
(2014), written here because torch has no equivalent.

SGD calls torch's fused SGD kernel (`torch._fused_sgd_`, what `torch.optim.SGD(fused=True)` steps
with; dampening 0, not Nesterov) on the flat shard directly: one pass over the shard for weight
decay, momentum and the update, where the optimizer's default step makes three (22 vs 33 us on
0.5 MB, one thread), with the same bits (tested against `torch.optim.SGD`); and torch's `step()`
spends more CPU in its Python (hooks, parameter groups, grad-mode switching) than in the
arithmetic at the shard sizes a server holds, and constructing the first one imports torch's
compiler stack: 0.8 s of a server's start on a 2-core machine (`torch.optim.SGD([p])` timed in a
fresh process, 3 runs: 0.77-0.80 s).

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

from typing import Any, Protocol

import torch
from torch import nn

from gradmesh.errors import GradmeshError, first_line
from gradmesh.sync.config import SERVER_OPTIMIZERS

INITIAL_ACCUMULATOR = 0.1


class ServerOptimizer(Protocol):
    def on_read(self, worker: int) -> None:
        """A worker has just read the shard."""

    def apply(self, grad: torch.Tensor, worker: int, lr_scale: float) -> None:
        """Apply one gradient (from `worker`) with the learning rate times `lr_scale`."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, for a checkpoint (tensors and numbers only)."""

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; a GradmeshError when it does not fit."""


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

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        try:
            self.optimizer.load_state_dict(saved)
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
            raise GradmeshError(f"server optimizer state: {first_line(exc)}") from None
        self.base_lr = [g["lr"] for g in self.optimizer.param_groups]


class SGD:
    """SGD with momentum and weight decay on a flat shard, in place (see the module docstring)."""

    def __init__(self, shard: torch.Tensor, lr: float, momentum: float, weight_decay: float):
        self.x, self.lr, self.momentum, self.weight_decay = shard, lr, momentum, weight_decay
        self.buffer: torch.Tensor | None = None

    def on_read(self, worker: int) -> None:
        pass

    @torch.no_grad()
    def apply(self, grad: torch.Tensor, worker: int, lr_scale: float) -> None:
        # torch's fused SGD kernel (what SGD(fused=True) steps with): decay, momentum and the
        # update in one pass over the shard, not three
        first = bool(self.momentum) and self.buffer is None
        if first:
            self.buffer = torch.empty_like(self.x)  # the kernel starts it at the first gradient
        torch._fused_sgd_(
            [self.x],
            [grad],
            [] if self.buffer is None else [self.buffer],
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr * lr_scale,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=first,
        )

    def state_dict(self) -> dict[str, Any]:
        return {} if self.buffer is None else {"momentum_buffer": self.buffer}

    @torch.no_grad()
    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if not isinstance(saved, dict) or not set(saved) <= {"momentum_buffer"}:
            raise GradmeshError("server optimizer state: SGD keeps only 'momentum_buffer'")
        buffer = saved.get("momentum_buffer")
        if buffer is None:
            self.buffer = None
            return
        if not isinstance(buffer, torch.Tensor) or buffer.shape != self.x.shape:
            raise GradmeshError(f"server optimizer state: SGD needs {len(self.x)} values")
        self.buffer = buffer.to(self.x.dtype).clone()


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

    def state_dict(self) -> dict[str, Any]:
        read = {str(w): z for w, z in self.read.items()}
        return {"z": self.z, "zp": self.zp, "zmax": self.zmax, "read": read}

    @torch.no_grad()
    def load_state_dict(self, saved: dict[str, Any]) -> None:
        read = saved.get("read")
        tensors = [saved.get(k) for k in ("z", "zp", "zmax")]
        if not isinstance(read, dict) or not all(str(w).isdigit() for w in read):
            raise GradmeshError("server optimizer state: AdaRevision's 'read' is not by worker")
        tensors += list(read.values())
        if not all(isinstance(t, torch.Tensor) and t.shape == self.z.shape for t in tensors):
            raise GradmeshError(f"server optimizer state: AdaRevision needs {len(self.z)} values")
        for mine, name in zip((self.z, self.zp, self.zmax), ("z", "zp", "zmax"), strict=True):
            mine.copy_(saved[name])
        self.read = {int(w): z.clone() for w, z in read.items()}

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
    if name == "sgd":
        return SGD(shard, lr, momentum, weight_decay)
    assert isinstance(shard, nn.Parameter)
    if name == "adagrad":
        opt: torch.optim.Optimizer = torch.optim.Adagrad([shard], lr=lr, weight_decay=weight_decay)
    elif name == "adam":
        opt = torch.optim.Adam([shard], lr=lr, weight_decay=weight_decay)
    else:
        raise GradmeshError(
            f"unknown server optimizer {name!r} (valid: {', '.join(SERVER_OPTIMIZERS)})"
        )
    return TorchOptimizer(shard, opt)
