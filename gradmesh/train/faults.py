"""A fault on demand, for tests and demonstrations of recovery: `GRADMESH_FAULT=kill:R:S` makes
rank R end itself with SIGKILL right after its step S, in the job's first attempt only (a
restarted job runs clean), the way a lost machine or an OOM kill ends a worker: no handler, no
cleanup, no last message."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from gradmesh.errors import GradmeshError

FAULT_ENV = "GRADMESH_FAULT"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def restarts() -> int:
    """How many times the launcher has restarted this job (0 in its first attempt)."""
    raw = os.environ.get(RESTART_ENV, "0")
    return int(raw) if raw.isdigit() else 0


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int

    def check(self, rank: int, step: int) -> None:
        if rank == self.rank and step == self.step and restarts() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def injected_fault() -> Fault | None:
    """The fault GRADMESH_FAULT asks for, if any."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    kind, _, rest = raw.partition(":")
    rank, _, step = rest.partition(":")
    if kind != "kill" or not rank.isdigit() or not step.isdigit():
        raise GradmeshError(f"{FAULT_ENV}={raw!r}: expected kill:RANK:STEP, like kill:1:7")
    return Fault(int(rank), int(step))
