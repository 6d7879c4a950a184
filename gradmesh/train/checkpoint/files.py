"""A checkpoint on disk: its folder, its rank files (torch tensors, loaded with
`weights_only=True`) and its `meta.json`, written atomically, read with each value checked."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gradmesh.errors import GradmeshError, first_line
from gradmesh.layout.config import RESHARDABLE
from gradmesh.sync.sharded.model import local

if TYPE_CHECKING:
    pass


__all__ = [
    "FORMAT",
    "META",
    "RANK_KEYS",
    "META_KEYS",
    "ForeignCheckpoint",
    "folder",
    "rank_file",
    "Meta",
    "read_meta",
    "complete",
    "check_identity",
    "refuse_old_format",
    "model_problem",
    "read_rank",
    "restore_rng",
    "rng_state",
    "write_part",
]


FORMAT = 2


META = "meta.json"


_STEP = re.compile(r"^step-(\d{8})$")


_OLD = re.compile(r"^epoch-\d+\.pt$")


IDENTITY_DEFAULTS = {"zero_stage": 0, "model_args": "", "sequence_length": 64}
"""What a checkpoint written before an identity setting existed had it at."""


RANK_KEYS: dict[str, type] = {
    "model": dict,
    "optimizer": dict,
    "strategy": dict,
    "rng": dict,
    "progress": dict,
}


META_KEYS: dict[str, type] = {
    "format": int,
    "step": int,
    "epoch": int,
    "offset": int,
    "world": int,
    "identity": dict,
    "losses": list,
    "samples": int,
    "files": list,
}


_NAMES = {int: "an integer", dict: "a mapping", list: "a list"}


class ForeignCheckpoint(GradmeshError):
    """A checkpoint written by another run (model, layout, strategy...): never fallen back from."""


def folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rank-{rank:05d}.pt"


@dataclass(frozen=True)
class Meta:
    """What `meta.json` says: where the run stood and who wrote it."""

    path: Path
    step: int
    epoch: int
    offset: int
    world: int
    identity: dict[str, Any]
    losses: list[float]
    samples: int
    epoch_loss: list[float] | None = None
    """Elastic jobs: the world's (loss sum, count) of the epoch under way, for a world of
    another size (each rank file holds only its own rank's)."""
    membership: list[list[int]] = field(default_factory=list)
    """Elastic jobs: [step, workers] each time the number of workers changed."""

    @property
    def checkpoint(self) -> Path:
        return self.path.parent


def _kind_problem(values: dict[str, Any], kinds: dict[str, type]) -> str | None:
    for key, kind in kinds.items():
        if key not in values:
            return f"no {key!r} entry"
        value = values[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{key!r} is a {type(value).__name__}, not {_NAMES[kind]}"
    return None


def read_meta(checkpoint: Path) -> Meta:
    """The metadata of `checkpoint`, or one line naming the file and what is wrong with it."""
    path = checkpoint / META
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GradmeshError(f"cannot read checkpoint metadata {path}: {first_line(exc)}") from None
    if not isinstance(values, dict):
        problem: str | None = f"expected a mapping, found {type(values).__name__}"
    else:
        problem = _kind_problem(values, META_KEYS)
    if problem is None and values["format"] != FORMAT:
        problem = f"format {values['format']}, this gradmesh reads format {FORMAT}"
    if problem is None and (min(values["step"], values["epoch"], values["offset"]) < 0):
        problem = "'step', 'epoch' and 'offset' must be >= 0"
    if problem is None and not all(isinstance(v, int | float) for v in values["losses"]):
        problem = "'losses' must be a list of numbers"
    if problem is None:
        problem = _elastic_problem(values)
    if problem is None:
        expected = [rank_file(checkpoint, r).name for r in range(max(values["world"], 0))]
        if values["world"] < 1 or values["files"] != expected:
            problem = f"'files' must name one file per rank of {values['world']}"
    if problem is not None:
        raise GradmeshError(f"checkpoint metadata {path} is malformed: {problem}")
    return Meta(
        path,
        values["step"],
        values["epoch"],
        values["offset"],
        values["world"],
        values["identity"],
        [float(v) for v in values["losses"]],
        values["samples"],
        values.get("epoch_loss"),
        values.get("membership", []),
    )


def _elastic_problem(values: dict[str, Any]) -> str | None:
    """What is wrong with an elastic job's optional entries, if anything."""
    loss = values.get("epoch_loss")
    if loss is not None and not (
        isinstance(loss, list) and len(loss) == 2 and all(isinstance(v, int | float) for v in loss)
    ):
        return "'epoch_loss' must be two numbers"
    changes = values.get("membership", [])
    if not isinstance(changes, list) or not all(
        isinstance(c, list) and len(c) == 2 and all(type(v) is int for v in c) for c in changes
    ):
        return "'membership' must be a list of [step, workers] pairs"
    return None


def complete(directory: str | Path) -> list[Path]:
    """The checkpoints in `directory` that have their metadata, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def check_identity(meta: Meta, identity: dict[str, Any]) -> None:
    """One line naming what differs when `meta` was written by another run."""
    saved = {**IDENTITY_DEFAULTS, **meta.identity}
    differing = sorted(k for k in identity if saved.get(k) != identity[k])
    if differing:
        diffs = ", ".join(f"{k}={saved.get(k)!r} (now {identity[k]!r})" for k in differing)
        hint = " (--reshard resumes it in this layout)" if set(differing) <= RESHARDABLE else ""
        raise ForeignCheckpoint(
            f"checkpoint {meta.checkpoint} belongs to another run: {diffs}{hint}"
        )


def refuse_old_format(directory: str | Path) -> None:
    """Checkpoints of gradmesh before step checkpoints (epoch-NNNNN.pt) are not resumed from
    silently: the run would start again from scratch."""
    root = Path(directory)
    if root.is_dir() and not complete(root):
        old = sorted(p.name for p in root.iterdir() if _OLD.match(p.name))
        if old:
            raise GradmeshError(
                f"checkpoint folder {root} holds checkpoints of an older gradmesh ({old[-1]}), "
                "which this version cannot resume: move them away to start afresh"
            )


def model_problem(saved: dict[str, Any], model: nn.Module) -> str | None:
    """The first way `saved` is not a state dict of `model`, or None."""
    # a shard's shape where the model holds shards (DTensors)
    expected = {k: local(v) for k, v in model.state_dict().items()}
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


def read_rank(checkpoint: Path, rank: int, model: nn.Module | None = None) -> dict[str, Any]:
    """This rank's part of `checkpoint`, checked (against `model` when given), or one line
    naming the file and the first problem found."""
    path = rank_file(checkpoint, rank)
    try:
        with warnings.catch_warnings():  # torch's notes on foreign pickles: the line says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn, missing or foreign file: say which and why, in one line
        raise GradmeshError(f"cannot load checkpoint {path}: {first_line(exc)}") from None
    problem: str | None
    if not isinstance(state, dict):
        problem = f"expected a mapping of checkpoint fields, found {type(state).__name__}"
    else:
        problem = _kind_problem(state, RANK_KEYS)
    if problem is None and model is not None:
        problem = model_problem(state["model"], model)
    if problem is None and not isinstance(state["rng"].get("torch"), torch.Tensor):
        problem = "'rng' has no 'torch' generator state"
    if problem is not None:
        raise GradmeshError(f"checkpoint {path} does not fit this run: {problem}")
    return cast(dict[str, Any], state)


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and isinstance(rng.get("cuda"), list):
        torch.cuda.set_rng_state_all(rng["cuda"])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _copy(value: Any, copy: bool = True) -> Any:
    """A snapshot of nested state: tensors copied to the CPU (with `copy` False, only where they
    are not there), containers rebuilt; a DTensor (sharded data parallelism) as this rank's
    shard, the part the rank writes."""
    value = local(value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, dict):
        return {k: _copy(v, copy) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v, copy) for v in value)
    return value


class _File:
    """A file torch writes into that keeps the operating system's error: torch turns it into
    "unexpected pos 175872 vs 175760", which does not say the disk is full."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.out.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.out.flush()


def _write_atomically(path: Path, write: Any) -> None:
    """`write(file)` into a temporary file, flushed to disk, then renamed to `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as raw:
            out = _File(raw)
            try:
                write(out)
            except RuntimeError:
                if out.error is not None:
                    raise out.error from None
                raise
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _named_errors(rank: int, path: Path) -> Iterator[None]:
    """A failed write as one line naming the rank and the file."""
    try:
        yield
    except OSError as exc:
        raise GradmeshError(
            f"rank {rank}: cannot write checkpoint {path}: {exc.strerror or exc}"
        ) from None
    except RuntimeError as exc:  # torch's stream writer: a full disk, a vanished folder
        raise GradmeshError(
            f"rank {rank}: cannot write checkpoint {path}: {first_line(exc)}"
        ) from None


def write_part(directory: str | Path, step: int, rank: int, state: dict[str, Any]) -> int:
    """Write `rank`'s part (see RANK_KEYS) of the checkpoint after `step`; returns its size.
    A parameter server writes its shard this way, and the metadata's writer waits for it."""
    target = folder(directory, step)
    path = rank_file(target, rank)
    with _named_errors(rank, path):
        target.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, lambda out: torch.save(state, out))
        return path.stat().st_size
