"""Timelines: Chrome trace events (open in Perfetto or chrome://tracing), one file for the job.

`start_timeline(path)` makes every `span(...)` of this process record a complete event ("ph": "X")
on its thread (training, communication, or on a parameter server, serving), so the
communication thread's bucket reductions show beside backward. `stop_timeline()` (or
`gradmesh.shutdown()`) writes it:

- **merged** (`--timeline PATH`; `start_timeline(path, merged=True)`): every process of the job
  puts its events in the job's rendezvous store (the torchrun agent's TCPStore, which a
  parameter-server job's servers and workers all reach), and the process of rank 0 writes one
  trace with a named process per rank (pid = the launcher's rank: in a ps job servers first,
  then workers). Clocks are aligned at start-up: rank 0 answers time requests on the interface
  facing the job (never every interface), each other process keeps the offset of its fastest of
  16 round trips; `otherData.clock` holds, per process, where its own time zero lies on rank
  0's clock (`start_us`) and the uncertainty of that (half the round trip). Why not torch's
  profiler: it writes one file per process with no shared clock, which Perfetto cannot merge
  (pytorch/pytorch#128292), and knows nothing of a parameter server's processes.
- **per rank** (`--timeline-per-rank`; the library's default): `path`, or `path` with
  `.rank<R>` before the suffix when the world has more than one rank, each on its own clock.

Bounded size: a timeline keeps its set-up events and the events of the last `max_steps` steps
(a server's steps are its updates); 0 keeps everything. What was kept and dropped is recorded
in `otherData`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import get_runtime

DEFAULT_STEPS = 1000
"""Steps a timeline keeps by default (the last ones)."""
THREADS = {"training": 1, "serving": 1, "communication": 2}
"""Chrome-trace thread ids of the named threads; other threads get 3, 4, ... by first use."""
ROUND_TRIPS = 16


class Timeline:
    """Events of one process, in memory until saved; set-up events and a ring of steps."""

    def __init__(
        self,
        path: str | Path,
        pid: int,
        name: str,
        max_steps: int = DEFAULT_STEPS,
        main_thread: str = "training",
        job: JobClock | None = None,
    ) -> None:
        self.path = Path(path)
        self.pid, self.name, self.main_thread = pid, name, main_thread
        self.max_steps = max_steps
        self.lock = threading.Lock()
        self.origin = time.perf_counter()
        self.setup: list[dict[str, Any]] = []
        self.steps: deque[list[dict[str, Any]]] = deque(maxlen=max_steps or None)
        self.current = self.setup
        self.step_count = 0
        self.open: set[str] = set()
        """Names of the spans open on the main thread (a nested recorder can skip its own)."""
        self.job = job
        self.offset_s = job.join(self.origin) if job is not None else 0.0
        """Add to a `perf_counter()` reading of this process to get rank 0's job clock."""

    def new_step(self) -> None:
        """Events from here on belong to the next step (the oldest step beyond the ring goes)."""
        with self.lock:
            self.current = []
            self.steps.append(self.current)
            self.step_count += 1

    def add(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        thread = threading.current_thread()
        tid = self.main_thread if thread is threading.main_thread() else thread.name
        if tid.startswith("gradmesh-comm"):
            tid = "communication"
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "tid": tid,
            "ts": (start - self.origin) * 1e6,
            "dur": (end - start) * 1e6,
        }
        if args:
            event["args"] = args
        with self.lock:
            self.current.append(event)

    def instant(self, name: str, **args: Any) -> None:
        """A zero-length event now (a restart, say)."""
        now = time.perf_counter()
        self.add(name, "job", now, now, **args)

    @contextmanager
    def span(self, name: str, category: str = "compute", **args: Any) -> Iterator[None]:
        started = time.perf_counter()
        main = threading.current_thread() is threading.main_thread()
        if main:
            self.open.add(name)
        try:
            yield
        finally:
            if main:
                self.open.discard(name)
            self.add(name, category, started, time.perf_counter(), **args)

    def part(self) -> dict[str, Any]:
        """This process's events on rank 0's job clock (µs), and what was kept."""
        shift = (self.origin + self.offset_s) * 1e6
        with self.lock:
            events = [*self.setup, *(e for step in self.steps for e in step)]
            dropped = max(0, self.step_count - len(self.steps))
        return {
            "pid": self.pid,
            "name": self.name,
            "events": [{**e, "ts": e["ts"] + shift} for e in events],
            "start_us": shift,
            "uncertainty_us": self.job.uncertainty_s * 1e6 if self.job else 0.0,
            "steps": self.step_count,
            "dropped_steps": dropped,
        }

    def save(self) -> Path:
        """Write this process's own file, or (merged) hand its part to rank 0, which writes
        the job's; returns the file written (or that rank 0 writes)."""
        part = self.part()
        if self.job is None:
            write_trace(self.path, [part], self.max_steps, [])
            return self.path
        return self.job.finish(self.path, part, self.max_steps)


class JobClock:
    """A process's place in a merged timeline: the job's store, its attempt, its rank (pid) and,
    on rank 0, the clock responder and the number of parts to wait for."""

    def __init__(self, store: Any, pid: int, world: int, host: str, timeout_s: float) -> None:
        from gradmesh.runtime.process import restarts

        self.store, self.pid, self.world, self.host = store, pid, world, host
        self.timeout_s = timeout_s
        self.prefix = f"gradmesh/timeline/{restarts()}"
        self.uncertainty_s = 0.0
        self.stop = threading.Event()
        self.listener: socket.socket | None = None

    def join(self, origin: float) -> float:
        """Rank 0: answer time requests (its job clock: seconds since `origin`); the others:
        measure their offset to it. Returns this process's offset."""
        if self.pid == 0:
            from gradmesh.runtime.process import local_address

            self.listener = socket.create_server((local_address(self.host), 0))
            self.listener.settimeout(0.2)
            threading.Thread(
                target=_answer_time, args=(self.listener, origin, self.stop), daemon=True
            ).start()
            host, port = self.listener.getsockname()[:2]
            self.store.set(f"{self.prefix}/clock", f"{host} {port}")
            return -origin
        try:
            host, port = self.store.get(f"{self.prefix}/clock").decode().split()
        except RuntimeError as exc:  # the store's timeout: rank 0 never started its timeline
            raise GradmeshError(f"timeline: rank {self.pid}: no clock from rank 0: {exc}") from None
        offset, self.uncertainty_s = measure_offset(host, int(port), self.timeout_s)
        return offset

    def finish(self, path: Path, part: dict[str, Any], max_steps: int) -> Path:
        """Put this part in the store; rank 0 gathers every rank's (waiting up to the job's
        timeout for them all: a rank that died is listed as missing) and writes `path`."""
        self.store.set(f"{self.prefix}/part/{part['pid']}", json.dumps(part))
        if self.pid != 0:
            return path
        self.stop.set()
        parts, missing = [part], []
        deadline = time.monotonic() + self.timeout_s
        for pid in range(1, self.world):
            key = f"{self.prefix}/part/{pid}"
            try:
                left = max(0.01, deadline - time.monotonic())
                self.store.wait([key], timedelta(seconds=left))
                parts.append(json.loads(self.store.get(key)))
            except RuntimeError:  # it never came: that rank failed or was killed
                missing.append(pid)
        write_trace(path, parts, max_steps, missing)
        return path


def _answer_time(listener: socket.socket, origin: float, stop: threading.Event) -> None:
    """Rank 0's clock: for each byte a peer sends, 8 bytes back (seconds since `origin`)."""
    with listener:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:  # the accept timeout: check `stop`
                continue
            with conn:
                conn.settimeout(5.0)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    while conn.recv(1):
                        conn.sendall(struct.pack("!d", time.perf_counter() - origin))
                except OSError:
                    pass


def measure_offset(host: str, port: int, timeout_s: float) -> tuple[float, float]:
    """(offset, uncertainty) of rank 0's job clock against this process's `perf_counter()`,
    from the fastest of `ROUND_TRIPS` round trips (Cristian's method: the answer was read at
    the middle of the round trip, give or take half of it)."""
    best: tuple[float, float] | None = None
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(ROUND_TRIPS):
                sent = time.perf_counter()
                conn.sendall(b"t")
                answer = b""
                while len(answer) < 8:
                    chunk = conn.recv(8 - len(answer))
                    if not chunk:
                        raise OSError("closed")
                    answer += chunk
                back = time.perf_counter()
                (remote,) = struct.unpack("!d", answer)
                if best is None or back - sent < best[0]:
                    best = (back - sent, remote - (sent + back) / 2)
    except OSError as exc:
        raise GradmeshError(
            f"timeline: cannot read rank 0's clock at {host}:{port}: {exc}"
        ) from None
    assert best is not None
    return best[1], best[0] / 2


def write_trace(
    path: Path, parts: list[dict[str, Any]], max_steps: int, missing: list[int]
) -> None:
    """One Chrome trace of `parts`: a named process each, numbered threads with names."""
    events: list[dict[str, Any]] = []
    for part in sorted(parts, key=lambda p: p["pid"]):
        pid, tids = part["pid"], dict(THREADS)
        events.append(
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": part["name"]}}
        )
        events.append(
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}
        )
        used: set[str] = set()
        for e in part["events"]:
            tid = tids.setdefault(e["tid"], len(tids) + 1)
            used.add(e["tid"])
            events.append({**e, "pid": pid, "tid": tid})
        for name in sorted(used):
            events.append(
                {
                    "ph": "M",
                    "pid": pid,
                    "tid": tids[name],
                    "name": "thread_name",
                    "args": {"name": name},
                }
            )
    kept = f"the last {max_steps} steps of each process" if max_steps else "every step"
    other = {
        "kept": kept,
        "steps": {p["pid"]: p["steps"] for p in parts},
        "dropped_steps": {p["pid"]: p["dropped_steps"] for p in parts},
        "clock": {
            p["pid"]: {"start_us": p["start_us"], "uncertainty_us": p["uncertainty_us"]}
            for p in parts
        },
        "missing_ranks": missing,
    }
    payload = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def rank_path(path: str, rank: int, size: int) -> Path:
    """`trace.json` for a world of one, `trace.rank<R>.json` otherwise."""
    p = Path(path)
    return p if size == 1 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def job_clock(pid: int, timeout_s: float) -> JobClock | None:
    """This process's place in a merged timeline, from the launcher's environment (torchrun's
    MASTER_ADDR/MASTER_PORT and WORLD_SIZE, or a ps worker's store address); None when no
    launcher started it (a world of one writes its own file)."""
    from gradmesh.runtime.process import STORE_ENV, connect_store

    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    elif os.environ.get(STORE_ENV):
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
    else:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return JobClock(connect_store(host, int(port), timeout_s), pid, world, host, timeout_s)


def start_timeline(
    path: str,
    merged: bool = False,
    max_steps: int = DEFAULT_STEPS,
    pid: int | None = None,
    name: str | None = None,
) -> Path:
    """Record spans from now on; returns the file this process (or, merged, rank 0) writes.
    `pid` and `name` default to this rank's ("rank R")."""
    rt = get_runtime()
    pid = rt.rank if pid is None else pid
    job = job_clock(pid, rt.timeout.total_seconds()) if merged else None
    target = Path(path) if merged else rank_path(path, rt.rank, rt.size)
    timeline = Timeline(target, pid, name or f"rank {pid}", max_steps, job=job)
    rt.timeline = timeline
    if stop_timeline not in rt.on_shutdown:  # leaving the job writes the timeline out
        rt.on_shutdown.append(stop_timeline)
    return timeline.path


def stop_timeline() -> Path | None:
    """Write the timeline and stop recording; returns its path (None when none was started)."""
    rt = get_runtime()
    timeline, rt.timeline = rt.timeline, None
    return timeline.save() if timeline is not None else None


@contextmanager
def span(name: str, category: str = "compute", **args: Any) -> Iterator[None]:
    """Record the enclosed block as one event when a timeline is running (near-free otherwise)."""
    from gradmesh.runtime.world import _runtime

    timeline = _runtime.timeline if _runtime is not None else None
    if timeline is None:
        yield
        return
    with timeline.span(name, category, **args):
        yield


def trace_processes(trace: dict[str, Any]) -> dict[int, tuple[str, list[dict[str, Any]]]]:
    """A merged trace's processes by pid: name and complete ("X") events, in time order."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    found: dict[int, tuple[str, list[dict[str, Any]]]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X":
            pid = e["pid"]
            found.setdefault(pid, (names.get(pid, f"pid {pid}"), []))[1].append(e)
    for _name, events in found.values():
        events.sort(key=lambda e: e["ts"])
    return dict(sorted(found.items()))


def trace_summary(trace: dict[str, Any]) -> str:
    """Lines for `gradmesh report TRACE.json`: per process, the steps it kept and the mean
    milliseconds per step in each span name (spans on different threads may overlap)."""
    data = trace.get("otherData", {})
    lines = [f"gradmesh timeline: {data.get('kept', 'every step')}"]
    for pid, (name, events) in trace_processes(trace).items():
        steps = max(int(data.get("steps", {}).get(str(pid), 0)), 1)
        totals: dict[str, float] = {}
        for e in events:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"] / 1e3
        per_step = "  ".join(f"{k} {v / steps:.3f}" for k, v in sorted(totals.items()))
        lines.append(f"  {name}: {steps} steps; ms per step: {per_step}")
    missing = data.get("missing_ranks", [])
    if missing:
        lines.append(f"  missing (never delivered their part): {missing}")
    return "\n".join(lines)
