"""Pack many tensors into one flat buffer per dtype and device, and back: one message instead of
many. The one flattener every path uses (a whole model's reduction or broadcast, a grouped
allreduce, a parameter-server worker's parameter vector)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flat_buffers(
    tensors: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Group tensors by dtype and device (in the order they come) and pack each group into one
    contiguous buffer: [(buffer, its tensors)]."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(torch.cat([t.detach().reshape(-1) for t in ts]), ts) for ts in groups.values()]


def views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of `flat` shaped as `tensors` (views: writing one writes `flat`)."""
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors, strict=True)]


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`, in place."""
    for t, part in zip(tensors, views(flat, tensors), strict=True):
        t.copy_(part)
