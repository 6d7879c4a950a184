"""Timelines: Chrome trace events (open in Perfetto or chrome://tracing), one file per rank.

`start_timeline(path)` makes every `span(...)` of this process record a complete event ("ph": "X")
with its thread, so the communication thread's bucket reductions show beside backward.
`stop_timeline()` (or `gradmesh.shutdown()`) writes `path`, or `path` with `.rank<R>` before the
suffix when the world has more than one rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradmesh.runtime import get_runtime


@dataclass
class Timeline:
    """Events of one rank, in memory until saved."""

    path: Path
    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    origin: float = field(default_factory=time.perf_counter)

    def add(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "pid": self.rank,
            "tid": threading.current_thread().name,
            "ts": (start - self.origin) * 1e6,
            "dur": (end - start) * 1e6,
        }
        if args:
            event["args"] = args
        with self.lock:
            self.events.append(event)

    def save(self) -> Path:
        with self.lock:
            payload = {"traceEvents": list(self.events), "displayTimeUnit": "ms"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, self.path)
        return self.path


def rank_path(path: str, rank: int, size: int) -> Path:
    """`trace.json` for a world of one, `trace.rank<R>.json` otherwise."""
    p = Path(path)
    return p if size == 1 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def start_timeline(path: str) -> Path:
    """Record spans from now on; returns the file this rank will write."""
    rt = get_runtime()
    timeline = Timeline(rank_path(path, rt.rank, rt.size), rt.rank)
    rt.timeline = timeline
    return timeline.path


def stop_timeline() -> Path | None:
    """Write the timeline and stop recording; returns its path (None when none was started)."""
    rt = get_runtime()
    timeline, rt.timeline = rt.timeline, None
    return timeline.save() if timeline is not None else None


@contextmanager
def span(name: str, category: str = "compute", **args: Any) -> Iterator[None]:
    """Record the enclosed block as one event when a timeline is running (near-free otherwise)."""
    from gradmesh.runtime import _runtime

    timeline = _runtime.timeline if _runtime is not None else None
    if timeline is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        timeline.add(name, category, started, time.perf_counter(), **args)
