"""Faults on demand, for tests and demonstrations of recovery. `GRADMESH_FAULT=kill:R:S` makes
rank R end itself with SIGKILL right after its step S, in the job's first attempt only (a
restarted job runs clean), the way a lost machine or an OOM kill ends a worker: no handler, no
cleanup, no last message. In a parameter-server job R is the launcher's rank: servers are
0..S-1 (killed after their update S), workers S and up. `GRADMESH_FAULT=slow:R:MS` makes rank
R a straggler: MS milliseconds of extra computation every step."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from gradmesh.errors import GradmeshError
from gradmesh.runtime.process import restarts

FAULT_ENV = "GRADMESH_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    amount: int
    """kill: the step after which; slow: milliseconds per step."""

    def check(self, rank: int, step: int) -> None:
        if rank != self.rank:
            return
        if self.kind == "slow":
            time.sleep(self.amount / 1000)
        elif step == self.amount and restarts() == 0:
            print(
                f"gradmesh: rank {rank}: {FAULT_ENV}: killed after step {step} "
                f"at unix time {time.time():.3f}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


def injected_fault() -> Fault | None:
    """The fault GRADMESH_FAULT asks for, if any."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    kind, _, rest = raw.partition(":")
    rank, _, amount = rest.partition(":")
    if kind not in ("kill", "slow") or not rank.isdigit() or not amount.isdigit():
        raise GradmeshError(
            f"{FAULT_ENV}={raw!r}: expected kill:RANK:STEP or slow:RANK:MS, like kill:1:7"
        )
    return Fault(kind, int(rank), int(amount))
