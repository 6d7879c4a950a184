"""Per-epoch checkpoints: written atomically by rank 0, read by every rank with weights_only=True.

The checkpoint directory must be visible to every rank (one host, or a shared filesystem).
A checkpoint records which run wrote it; resuming a different run from it is an error.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.errors import GradmeshError, first_line

_NAME = re.compile(r"^epoch-(\d+)\.pt$")


def _path(directory: str, epoch: int) -> Path:
    return Path(directory) / f"epoch-{epoch:05d}.pt"


def save(
    directory: str,
    epoch: int,
    model: nn.Module,
    optimizer: Optimizer,
    identity: dict[str, Any],
    losses: list[float],
) -> Path:
    """Write the state after `epoch` epochs (and the per-epoch losses) to DIR/epoch-NNNNN.pt."""
    os.makedirs(directory, exist_ok=True)
    final = _path(directory, epoch)
    tmp = final.with_suffix(".tmp")
    state = {
        "epoch": epoch,
        "identity": identity,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "losses": list(losses),
    }
    torch.save(state, tmp)
    os.replace(tmp, final)
    return final


def latest(directory: str) -> Path | None:
    """The newest complete checkpoint in `directory`, if any."""
    if not os.path.isdir(directory):
        return None
    epochs = [int(m.group(1)) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return _path(directory, max(epochs)) if epochs else None


def load(
    path: Path, model: nn.Module, optimizer: Optimizer, identity: dict[str, Any]
) -> tuple[int, list[float]]:
    """Restore model and optimizer from `path`; return (epochs already done, their losses)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: say which and why, in one line
        raise GradmeshError(f"cannot load checkpoint {path}: {first_line(exc)}") from None
    saved = state.get("identity", {})
    differing = sorted(k for k in identity if saved.get(k) != identity[k])
    if differing:
        diffs = ", ".join(f"{k}={saved.get(k)!r} (now {identity[k]!r})" for k in differing)
        raise GradmeshError(f"checkpoint {path} belongs to another run: {diffs}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]), [float(v) for v in state.get("losses", [])]
