"""Horovod-style synchronous data parallelism: wrap an optimizer so `step()` averages gradients.

`DistributedOptimizer(opt, named_parameters)` returns an object of a subclass of `opt`'s own class
(so LR schedulers and `isinstance` keep working) that shares `opt`'s parameter groups and state.
Before each step it packs every gradient into one flat buffer per dtype (tensor fusion), reduces
the buffer with the chosen allreduce algorithm and unpacks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
from torch.optim import Optimizer

from gradmesh.collectives import Op, allreduce, broadcast
from gradmesh.runtime import get_runtime

Average: Op = "average"
Sum: Op = "sum"


def _flat_buffers(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Group tensors by dtype and device and pack each group into one contiguous buffer."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in groups.values()]


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class."""

    _gm_params: list[tuple[str, torch.nn.Parameter]]
    _gm_op: Op
    _gm_allreduce: str

    def synchronize(self) -> None:
        """Reduce every trainable gradient across ranks; a missing gradient counts as zero."""
        grads = []
        for _, p in self._gm_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for flat, members in _flat_buffers(grads):
            allreduce(flat, op=self._gm_op, algorithm=self._gm_allreduce)
            _unpack(flat, members)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self.synchronize()
        return super().step(closure)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 - the Horovod name users already know
    optimizer: Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    op: Op = Average,
    allreduce: str = "native",
) -> Optimizer:
    """Wrap `optimizer` so every `step()` first reduces gradients over all ranks.

    `named_parameters` fixes the order in which parameters are packed (it must be the same on every
    rank); by default the optimizer's own parameter order is used.
    """
    from gradmesh.collectives import ALGORITHMS

    ALGORITHMS.get(allreduce)  # fail early on an unknown algorithm name
    if named_parameters is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        named = [(f"param.{i}", p) for i, p in enumerate(params)]
    else:
        named = list(named_parameters)
    cls = type(optimizer.__class__.__name__, (_DistributedMixin, optimizer.__class__), {})
    wrapped = cast(Optimizer, object.__new__(cls))
    wrapped.__dict__.update(optimizer.__dict__)
    mixin = cast(_DistributedMixin, wrapped)
    mixin._gm_params = [(n, p) for n, p in named if p.requires_grad]
    mixin._gm_op = op
    mixin._gm_allreduce = allreduce
    return wrapped


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0
) -> None:
    """Overwrite every rank's tensors with `root_rank`'s in place (state_dict or named_parameters).

    Tensors are sent in the given order, which must be the same on every rank.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    tensors = [t.data if isinstance(t, torch.nn.Parameter) else t for _, t in items]
    if get_runtime().size == 1 or not tensors:
        return
    with torch.no_grad():
        for flat, members in _flat_buffers(tensors):
            broadcast(flat, root=root_rank)
            _unpack(flat, members)
