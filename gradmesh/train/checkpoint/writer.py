"""Writing checkpoints during a run (`Checkpointer`, synchronous or on a background thread),
choosing the one to resume from (`choose`), a parameter server's shard folder and rank 0's
record of the furthest step reached (`Progress`)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradmesh.errors import GradmeshError

if TYPE_CHECKING:
    from gradmesh.sync.parameter_server.serving import Restorable

from gradmesh.train.checkpoint.files import (
    _STEP,
    FORMAT,
    META,
    ForeignCheckpoint,
    Meta,
    _copy,
    _named_errors,
    _write_atomically,
    check_identity,
    complete,
    folder,
    rank_file,
    read_meta,
    read_rank,
    refuse_old_format,
    write_part,
)

__all__ = [
    "SaveStats",
    "Checkpointer",
    "choose",
    "ShardFolder",
    "Progress",
]


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
            self._write(step, _copy(state, copy=False), meta)
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

    def restore(self, server: Restorable) -> None:
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
        self.counted = 0
        """The steps this run's resume counted as redone."""
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
        self.counted = max(0, self.furthest - step)
        self.redone += self.counted
        self.furthest = step
        return self.redone

    def skipped(self, steps: int) -> int:
        """A replica group that resumed behind its peers copied their state, `steps` ahead:
        those steps were counted as redone and are not; returns the run's total."""
        taken = min(self.counted, steps)
        self.counted -= taken
        self.redone -= taken
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
