"""Pack many tensors into one flat buffer per dtype and device, and back: one message instead of
many, for strategies that reduce or broadcast a whole model at once."""

from __future__ import annotations

import torch


def flat_buffers(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Group tensors by dtype and device and pack each group into one contiguous buffer."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in groups.values()]


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`, in place."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
