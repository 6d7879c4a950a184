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


def _problem(state: Any, model: nn.Module) -> str | None:
    """The first way `state` is not a checkpoint of `model`, or None."""
    if not isinstance(state, dict):
        return f"expected a dict of checkpoint fields, found {type(state).__name__}"
    kinds = {"epoch": int, "identity": dict, "model": dict, "optimizer": dict, "losses": list}
    names = {int: "an integer", dict: "a dict", list: "a list"}
    for key, kind in kinds.items():
        if key not in state:
            return f"no {key!r} entry"
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            return f"{key!r} is a {type(state[key]).__name__}, not {names[kind]}"
    if state["epoch"] < 0 or not all(isinstance(v, int | float) for v in state["losses"]):
        return "'epoch' must be >= 0 and 'losses' a list of numbers"
    expected = model.state_dict()
    saved = state["model"]
    for name in sorted(set(expected) ^ set(saved)):
        side = "the model has no" if name in saved else "missing model entry"
        return f"{side} {name!r}"
    for name, want in expected.items():
        got = saved[name]
        if not isinstance(got, torch.Tensor):
            return f"model entry {name!r} is a {type(got).__name__}, not a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (
                f"model entry {name!r} is {list(got.shape)} {got.dtype}, "
                f"the model needs {list(want.shape)} {want.dtype}"
            )
    return None


def load(
    path: Path, model: nn.Module, optimizer: Optimizer, identity: dict[str, Any]
) -> tuple[int, list[float]]:
    """Restore model and optimizer from `path`; return (epochs already done, their losses).
    Anything wrong with the file is one line naming it and the first problem found."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: say which and why, in one line
        raise GradmeshError(f"cannot load checkpoint {path}: {first_line(exc)}") from None
    if (problem := _problem(state, model)) is not None:
        raise GradmeshError(f"checkpoint {path} does not fit this run: {problem}")
    saved = state["identity"]
    differing = sorted(k for k in identity if saved.get(k) != identity[k])
    if differing:
        diffs = ", ".join(f"{k}={saved.get(k)!r} (now {identity[k]!r})" for k in differing)
        raise GradmeshError(f"checkpoint {path} belongs to another run: {diffs}")
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise GradmeshError(
            f"checkpoint {path} does not fit this run: optimizer state: {first_line(exc)}"
        ) from None
    return int(state["epoch"]), [float(v) for v in state["losses"]]
