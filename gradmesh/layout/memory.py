"""Activation checkpointing: a block keeps, from its forward to its backward, only its inputs,
and its backward runs its forward again to rebuild the rest (`torch.utils.checkpoint`,
non-reentrant, so it composes with autograd hooks, tensor-parallel operators and gradient
accumulation). The blocks are the model's (`gradmesh.layout.blocks`): every one (`blocks`), or
every k-th (`every:k`, Megatron's selective recomputation by block). The memory it saves is
the activations inside a block, for one more forward of it in backward (about a third more
arithmetic for a block whose backward costs twice its forward).

A block's class is swapped for a subclass whose forward checkpoints the original's: parameter
names, tensor-parallel plans, checkpoints and deep copies (the graph pipeline traces a copy) see
the same module, where a wrapper module would rename every parameter and a forward patched on
the instance would keep calling the original object from a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradmesh.errors import GradmeshError
from gradmesh.layout.blocks import block_list
from gradmesh.layout.config import every_of

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _recomputed(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` whose forward keeps only its inputs for backward (made once per class)."""
    if cls not in _CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = super(made, self).forward  # type: ignore[arg-type]
            if not torch.is_grad_enabled():
                return run(*args, **kwargs)
            return checkpoint(run, *args, use_reentrant=False, **kwargs)

        made = type(cls.__name__, (cls,), {"forward": forward, "recomputed": True})
        made.__qualname__ = cls.__qualname__
        _CLASSES[cls] = made
    return _CLASSES[cls]


def checkpoint_blocks(model: nn.Module, spec: str, model_name: str) -> list[str]:
    """Make every `every_of(spec)`-th block of `model` recompute its activations in backward,
    in place; returns their names (one line when the model has no blocks)."""
    every = every_of(spec)
    names = block_list(model)
    if not names:
        raise GradmeshError(
            f"--activation-checkpointing: model {model_name} has no list of blocks to recompute "
            "(a ModuleList or Sequential of repeated modules)"
        )
    chosen = names[::every]
    for name in chosen:
        block = model.get_submodule(name)
        if not getattr(block, "recomputed", False):
            block.__class__ = _recomputed(type(block))
    return chosen
