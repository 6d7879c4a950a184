"""An enforced memory limit per rank: a cgroup (v1 memory controller) of its own, which the
kernel holds the rank to by killing it when it goes over (an out-of-memory kill, counted in the
cgroup). What a GPU's memory is to a rank there, this is to a CPU rank here: the benchmarks use it
to show a model that does not fit one rank under plain data parallelism and does under ZeRO.

A rank joins its cgroup once it has started (after importing torch), so the memory charged to it
is what the job allocates: the model, its gradients and optimizer state, activations and the
collectives' buffers, not the interpreter's shared libraries. The peak charged is read back after
the job (`memory.max_usage_in_bytes`): the resident memory the kernel counted, not tensor bytes.
Written by hand because no maintained library wraps cgroup v1 for this: a few files to write.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from gradmesh.errors import GradmeshError

ROOT = Path("/sys/fs/cgroup/memory")
"""The v1 memory controller's mount (cgroup v2's unified hierarchy is not supported here)."""


def problem() -> str | None:
    """Why per-rank memory limits cannot be enforced here, or None."""
    if not (ROOT / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller at {ROOT}"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (memory limits need root)"
    return None


def create(name: str, limit: int) -> Path:
    """A fresh cgroup `name` whose processes together may hold at most `limit` bytes (swap
    included, where the kernel accounts it, so going over is a kill and not a swap-out)."""
    if (trouble := problem()) is not None:
        raise GradmeshError(f"cannot enforce a memory limit: {trouble}")
    path = ROOT / name
    path.mkdir(exist_ok=False)
    (path / "memory.limit_in_bytes").write_text(str(limit))
    swap = path / "memory.memsw.limit_in_bytes"
    if swap.is_file():
        swap.write_text(str(limit))
    return path


def join(name: str) -> None:
    """Move this process into cgroup `name` (made by `create`)."""
    (ROOT / name / "cgroup.procs").write_text(str(os.getpid()))


def usage(name: str) -> dict[str, int]:
    """The cgroup's peak charged bytes and how many of its processes the kernel killed for going
    over its limit."""
    path = ROOT / name
    oom = re.search(r"oom_kill (\d+)", (path / "memory.oom_control").read_text())
    return {
        "peak_bytes": int((path / "memory.max_usage_in_bytes").read_text()),
        "oom_kills": int(oom.group(1)) if oom else 0,
    }


def remove(name: str, wait_s: float = 10.0) -> None:
    """Delete cgroup `name` once its processes have exited."""
    path = ROOT / name
    deadline = time.monotonic() + wait_s
    while path.exists():
        try:
            path.rmdir()
        except OSError:  # still holding an exiting process
            if time.monotonic() > deadline:
                raise GradmeshError(f"cgroup {path} still holds processes") from None
            time.sleep(0.1)
