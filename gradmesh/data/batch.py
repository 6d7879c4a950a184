"""Batches as users hold them: a tensor, a tuple or list of tensors (the model's positional
inputs), or a dict of tensors (its keyword inputs, as a Hugging Face model takes `input_ids`
and `attention_mask`); targets likewise, handed whole to the loss. Every tensor of a batch has
the samples on its first dimension, so a batch splits into micro-batches and into data-parallel
slices tensor by tensor (torch's pytree does the walking)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from gradmesh.errors import GradmeshError

Batch = Any
"""A tensor, or a tuple, list or dict of them (nested as deep as the model needs)."""


def leaves(batch: Batch, what: str = "batch") -> list[torch.Tensor]:
    """The batch's tensors, or one line saying what else it holds or that their sample
    counts differ."""
    return _flat(batch, what)[0]


def _flat(batch: Batch, what: str = "batch") -> tuple[list[torch.Tensor], Any]:
    """The batch's tensors and the structure they fill (checked as `leaves` says)."""
    found, spec = tree_flatten(batch)
    if not found or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in found):
        kinds = ", ".join(sorted({type(t).__name__ for t in found})) or "nothing"
        raise GradmeshError(
            f"a {what} must be a tensor, or a tuple, list or dict of tensors with the samples "
            f"first; got {kinds}"
        )
    counts = {len(t) for t in found}
    if len(counts) > 1:
        raise GradmeshError(
            f"the tensors of a {what} hold different numbers of samples: {sorted(counts)}"
        )
    return found, spec


def size(batch: Batch) -> int:
    """Samples in the batch."""
    return len(leaves(batch)[0])


def split(batch: Batch, parts: int) -> list[Batch]:
    """The batch in `parts` micro-batches along the samples (as `tensor_split`: some may be
    empty when there are fewer samples than parts)."""
    found, spec = _flat(batch)
    pieces = [t.tensor_split(parts) for t in found]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def rows(batch: Batch, index: Any) -> Batch:
    """The samples `index` (a slice, or indices) of every tensor of the batch."""
    return tree_map(lambda t: t[index], batch)


def to(batch: Batch, device: Any) -> Batch:
    """Every tensor of the batch on `device`; to a GPU from page-locked memory without
    waiting (the step's kernels queue behind the copy on the same stream)."""
    target = torch.device(device)
    if target.type != "cuda":
        return tree_map(lambda t: t.to(target), batch)
    return tree_map(lambda t: _pinned(t).to(target, non_blocking=True), batch)


def pinned(batch: Batch, device: Any) -> Batch:
    """The batch in page-locked memory where it will go to a GPU (`to` then copies it without
    waiting), as it is elsewhere. The batch is walked on every device, so a CPU run meets a
    leaf that is not a tensor where a GPU run would (7a9be6e crashed so at every H100 step)."""
    pin = torch.device(device).type == "cuda"
    return tree_map(lambda t: _pinned(t) if pin else _tensor(t), batch)


def _tensor(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a batch holds tensors (or tuples, lists, dicts of them), not {type(t)}")
    return t


def _pinned(t: torch.Tensor) -> torch.Tensor:
    t = _tensor(t)
    return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()


def arguments(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as the model's arguments: a dict's entries as keyword arguments, a tuple's or a
    list's as positional ones, a tensor as the one input."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    return (batch,), {}


def call(module: Callable[..., Any], batch: Batch) -> Any:
    """The model on a batch (`arguments`)."""
    args, kwargs = arguments(batch)
    return module(*args, **kwargs)
