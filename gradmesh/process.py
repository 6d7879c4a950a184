"""What a gradmesh process knows of the launcher that started it, without importing torch: a
parameter-server job's worker supervisors need no more than this, and start faster for it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from gradmesh.errors import GradmeshError

LAUNCHER_PID_ENV = "GRADMESH_LAUNCHER_PID"
"""Set by `gradmesh run` (and a ps worker's supervisor) to its own pid: the process a worker
must not outlive."""
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torch's elastic agent: how many times it has restarted the job (0 at first)."""
_PR_SET_PDEATHSIG = 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise GradmeshError(f"environment variable {name}={raw!r} is not an integer") from None


def restarts() -> int:
    """How many times the launcher has restarted this job (0 in its first attempt)."""
    return _env_int(RESTART_ENV, 0)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the process that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def bind_to_launcher(rank: int) -> None:
    """A worker never outlives its launcher: when the launcher dies by any signal (SIGKILL
    included, which it cannot pass on), the kernel ends this worker too. Exits at once if the
    launcher is already gone."""
    raw = os.environ.get(LAUNCHER_PID_ENV)
    if not raw:
        return
    die_with_parent()
    if str(os.getppid()) != raw:  # it died before we asked the kernel to watch it
        print(
            f"gradmesh: rank {rank}: the launcher (pid {raw}) is gone; stopping",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
