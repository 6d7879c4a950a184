"""Step checkpoints of every piece of a run's state, written atomically, loaded without pickle.

A checkpoint is a folder `DIR/step-NNNNNNNN/` holding one file per rank (`rank-RRRRR.pt`: that
rank's model part, optimizer state, strategy state such as compressor residuals and local SGD's
counters, RNG state, its partial epoch loss) and `meta.json`, written last by rank 0 (in a
parameter-server job: the first worker; the servers write their shards as ranks 0..S-1) once
every rank's file is in place: the position (step, epoch, step within it), the loss history, the
run's identity, the world and the files. Without `meta.json` a folder is never chosen, so a
job killed mid-write resumes from the previous complete checkpoint. Each file is written to a
temporary name, flushed to disk and renamed. The newest `keep` complete checkpoints are kept.

Rank files load with `torch.load(weights_only=True)`, the metadata is JSON: nothing a
checkpoint holds can run code. We do not use torch.distributed.checkpoint for this: its
FileSystemReader reads `.metadata` with `pickle.load` (torch 2.13), which would run whatever
a crafted file holds. Its idea of an asynchronous save is kept: `asynchronous=True` copies the
state on the training thread (the stall) and writes it on a background thread.

The folder must be visible to every rank (one host, or a shared filesystem): rank 0 waits for
the other ranks' files there before it writes the metadata.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gradmesh.errors import GradmeshError, first_line

if TYPE_CHECKING:
    from gradmesh.sync.parameter_server.server import Server

FORMAT = 2
META = "meta.json"
_STEP = re.compile(r"^step-(\d{8})$")
_OLD = re.compile(r"^epoch-\d+\.pt$")
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
    saved = meta.identity
    differing = sorted(k for k in identity if saved.get(k) != identity[k])
    if differing:
        diffs = ", ".join(f"{k}={saved.get(k)!r} (now {identity[k]!r})" for k in differing)
        raise ForeignCheckpoint(f"checkpoint {meta.checkpoint} belongs to another run: {diffs}")


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
    expected = model.state_dict()
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


def _copy(value: Any) -> Any:
    """A snapshot of nested state: tensors copied to the CPU, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
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


@dataclass
class SaveStats:
    """What checkpointing cost this rank: the training thread's stall per save, the bytes."""

    stalls_s: list[float] = field(default_factory=list)
    bytes: int = 0
    """Size of this rank's last file."""

    def summary(self) -> dict[str, float]:
        median = statistics.median(self.stalls_s) if self.stalls_s else 0.0
        return {
            "saves": len(self.stalls_s),
            "stall_s_median": median,
            "rank_file_bytes": self.bytes,
        }


class Checkpointer:
    """Writes this rank's part of each checkpoint; rank `writer` also waits for the others'
    parts, writes the metadata and drops checkpoints beyond the newest `keep`."""

    def __init__(
        self,
        directory: str,
        rank: int,
        world: int,
        identity: dict[str, Any],
        keep: int,
        asynchronous: bool,
        timeout_s: float,
        writer: int = 0,
    ) -> None:
        self.directory = Path(directory)
        self.rank, self.world, self.identity, self.writer = rank, world, identity, writer
        self.keep, self.asynchronous, self.timeout_s = keep, asynchronous, timeout_s
        self.stats = SaveStats()
        self._writer = ThreadPoolExecutor(1, "gradmesh-checkpoint") if asynchronous else None
        self._pending: Future[None] | None = None

    def save(
        self,
        step: int,
        epoch: int,
        offset: int,
        losses: list[float],
        samples: int,
        state: dict[str, Any],
        extra: dict[str, Any] | None = None,
        since: float | None = None,
    ) -> None:
        """Checkpoint after `step` steps (`offset` of them into `epoch`); `state` is this rank's
        part (see RANK_KEYS); `losses` and `samples` are the run's, reduced over the world;
        `extra`: an elastic job's entries (epoch_loss, membership); `since`: the perf_counter
        time at which training stopped for this checkpoint (gathering `state` can take time:
        a parameter server writes its part then), the stall's start (default: now)."""
        started = time.perf_counter() if since is None else since
        self.wait()
        meta = {
            "format": FORMAT,
            "step": step,
            "epoch": epoch,
            "offset": offset,
            "world": self.world,
            "identity": self.identity,
            "losses": list(losses),
            "samples": samples,
            "files": [rank_file(folder(self.directory, step), r).name for r in range(self.world)],
            **(extra or {}),
        }
        if self._writer is None:
            self._write(step, state, meta)
        else:
            self._pending = self._writer.submit(self._write, step, _copy(state), meta)
        self.stats.stalls_s.append(time.perf_counter() - started)

    def wait(self) -> None:
        """Finish the write in flight; its failure is raised here, on the training thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        self.stats.bytes = write_part(self.directory, step, self.rank, state)
        if self.rank == self.writer:
            target = folder(self.directory, step)
            self._await_parts(target)
            text = json.dumps(meta, indent=1).encode()
            with _named_errors(self.rank, target / META):
                _write_atomically(target / META, lambda out: out.write(text))
                self._prune()

    def _await_parts(self, target: Path) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [r for r in range(self.world) if not rank_file(target, r).is_file()]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise GradmeshError(
                    f"checkpoint {target}: rank(s) {', '.join(map(str, missing))} did not write "
                    f"their part within {self.timeout_s:g} s (the folder must be shared by "
                    "every rank)"
                )
            time.sleep(0.005)

    def _prune(self) -> None:
        """Drop complete checkpoints beyond the newest `keep`, and torn ones older than the
        newest complete one (a newer folder without metadata may still be being written)."""
        kept = complete(self.directory)
        newest = kept[0].name
        for old in kept[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        for torn in self.directory.iterdir():
            if _STEP.match(torn.name) and torn.name < newest and not (torn / META).exists():
                shutil.rmtree(torn, ignore_errors=True)


def choose(
    directory: str | Path,
    identity: dict[str, Any],
    usable: Callable[[Meta], Any],
    agree: Callable[[bool], bool] = lambda ok: ok,
) -> tuple[Meta, Any] | None:
    """The newest complete checkpoint whose metadata reads, that belongs to this run and that
    `usable(meta)` accepts (it returns what it loaded, or raises a GradmeshError saying why
    not) on every rank (`agree(ok)` is True when every rank's `ok` is: a collective in a job);
    each one passed over is a warning. None when the folder has no checkpoint at all; one line
    naming the last problem when none is usable."""
    refuse_old_format(directory)
    candidates = complete(directory)
    for i, checkpoint in enumerate(candidates):
        problem = None
        try:
            meta = read_meta(checkpoint)
            check_identity(meta, identity)
            loaded = usable(meta)
        except ForeignCheckpoint:
            raise
        except GradmeshError as exc:
            problem = str(exc)
        if agree(problem is None):
            return meta, loaded
        if i + 1 == len(candidates):
            problem = problem or f"another rank could not use checkpoint {checkpoint}"
            raise GradmeshError(f"{problem}; no earlier complete checkpoint to fall back to")
        if problem is not None:
            _warn(f"warning: {problem}; falling back to {candidates[i + 1].name}")
    return None


def _warn(line: str) -> None:
    print(f"gradmesh: {line}", file=sys.stderr, flush=True)


class ShardFolder:
    """A parameter server's parts of the checkpoints (its `ShardCheckpoints`): rank file
    `index` of each `DIR/step-N/`, in the rank files' form; written when the first worker asks,
    read back from the newest complete checkpoint that fits the shard."""

    def __init__(self, directory: str, identity: dict[str, Any]) -> None:
        self.directory, self.identity = directory, identity

    def save(self, index: int, step: int, state: dict[str, Any]) -> None:
        write_part(self.directory, step, index, state)

    def restore(self, server: Server) -> None:
        index = server.cfg.index

        def load(meta: Meta) -> int:
            state = read_rank(meta.checkpoint, index)
            try:
                server.load_state_dict(state)
            except GradmeshError as exc:
                path = rank_file(meta.checkpoint, index)
                raise GradmeshError(f"checkpoint {path} does not fit this run: {exc}") from None
            return server.version

        chosen = choose(self.directory, self.identity, load)
        if chosen is not None:
            print(
                f"gradmesh ps: server {index} resumed at step {chosen[1]} "
                f"from {chosen[0].checkpoint}",
                file=sys.stderr,
                flush=True,
            )


class Progress:
    """The furthest step a run reached, kept in DIR/progress by rank 0 (two int64 written in
    place each step: no allocation, no rename), so a resumed run can say how many steps it
    redoes. Not part of any checkpoint: losing it loses only that figure."""

    _FORMAT = struct.Struct("<qq")

    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / "progress"
        self.furthest, self.redone = 0, 0
        try:
            raw = self.path.read_bytes()
            if len(raw) == self._FORMAT.size:
                self.furthest, self.redone = self._FORMAT.unpack(raw)
        except OSError:
            pass
        self._fd: int | None = None

    def resumed_at(self, step: int) -> int:
        """Count the steps between `step` (where this run resumes) and the furthest reached;
        returns the run's total so far."""
        self.redone += max(0, self.furthest - step)
        self.furthest = step
        return self.redone

    def reached(self, step: int) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.furthest = max(self.furthest, step)
        os.pwrite(self._fd, self._FORMAT.pack(self.furthest, self.redone), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
