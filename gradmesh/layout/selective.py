"""Selective recomputation per operation (`--activation-checkpointing ops`): each block runs
under torch's selective checkpoint, which keeps the outputs of the operations a policy names
and recomputes the rest in backward. The policy is the one torchtitan trains Llama with: keep
every fused attention's outputs (the costliest operation to redo, and small: its output and
log-sum-exp) and every other matrix product's output (the 1st, 3rd, ... of the block's forward),
recompute the element-wise work, the norms and the remaining products. A block then keeps its
input and those outputs: about half of what it keeps unchecked for a sixth of its forward
again, where checkpointing the whole block keeps only its input for a whole forward again.

The same policy counts what it keeps (`PolicyCount`, a dispatch mode over a forward): the
mesh planner's and the simulator's memory model reads those counts
(`gradmesh.layout.memory.saved_activations`, `gradmesh.planner.mesh_memory`), so the bytes
priced are the bytes this policy keeps in training, not a second formula."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from gradmesh.models.flops import op_flops

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
"""The products a block's linear layers run as (a 3-D input is viewed as 2-D first)."""

ATTENTION_OPS = frozenset(
    op.default
    for op in (
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
    )
)
"""The fused attention kernels `F.scaled_dot_product_attention` dispatches to."""


def keeps(func: Any, matmuls: int) -> bool:
    """Whether the policy keeps `func`'s outputs, `matmuls` the products of this block's forward
    so far, `func` included."""
    if func in MATMULS:
        return matmuls % 2 == 1
    return func in ATTENTION_OPS


def _policy() -> Callable[..., CheckpointPolicy]:
    seen = {False: 0, True: 0}  # products so far, in the forward and in the recomputation

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen[ctx.is_recompute] += func in MATMULS
        if keeps(func, seen[ctx.is_recompute]):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def contexts() -> Any:
    """The selective checkpoint's contexts for one block's forward (`checkpoint(context_fn=)`):
    a fresh count of products each call."""
    return create_selective_checkpoint_contexts(_policy())  # type: ignore[no-untyped-call]


def _bytes(out: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if torch.is_tensor(t))


class PolicyCount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Over a forward, per block (`owner()` names the block running, "" outside; `entered`
    marks a block's start; `inside()` says whether its attention module runs): the bytes the
    policy keeps (`kept`), and the forward FLOPs it would recompute (`redone`, everything it
    does not keep) and those of the whole block (`flops`)."""

    def __init__(self, owner: Callable[[], str], inside: Callable[[], bool]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner, self.inside = owner, inside
        self.inner: dict[str, float] = {}
        """Per block, the forward FLOPs of its attention module (`inside()` while it runs)."""
        self.kept: dict[str, int] = {}
        self.redone: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self._matmuls: dict[str, int] = {}

    def entered(self, block: str) -> None:
        self._matmuls[block] = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        block = self.owner()
        if not block:
            return out
        flops = op_flops(func, args, kwargs, out)
        self._matmuls[block] = self._matmuls.get(block, 0) + (func in MATMULS)
        self.flops[block] = self.flops.get(block, 0.0) + flops
        if self.inside():
            self.inner[block] = self.inner.get(block, 0.0) + flops
        if keeps(func, self._matmuls[block]):
            self.kept[block] = self.kept.get(block, 0) + _bytes(out)
        else:
            self.redone[block] = self.redone.get(block, 0.0) + flops
        return out
