"""Which workers a parameter server waits for.

A worker silent for `lost_after_s` with no request waiting (or, before its first message, for
`timeout_s`) is declared lost: the server no longer waits for it (sync rounds close without it,
SSP's slowest clock leaves it out, the job may end without it). A worker declared lost that
speaks again was slow, not gone (a long pause on a busy machine): it is readmitted, said in a
line, and waited for again, so it is not left to meet a server the others have closed.

In sync mode the rounds of the steps it missed closed without it, so its clock is moved on by an
offset kept for the rest of the run: its gradient joins the round under way and its next read
waits for that round to close, as every other worker's does (without the offset its clock would
lag the server's version, each read would be answered at once, and it would push several
gradients into one round).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from gradmesh.sync.parameter_server.protocol import Kind, Message


@dataclass
class Membership:
    """The server's view of its workers: when each last spoke, which are lost, which came back."""

    workers: int
    lost_after_s: float
    timeout_s: float
    sync: bool
    last_seen: list[float] = field(default_factory=list)
    heard: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    readmitted: list[int] = field(default_factory=list)
    """Workers that came back after being declared lost, once per return."""
    offset: list[int] = field(default_factory=list)
    """sync: what each worker's clock is moved on by (its missed rounds)."""

    def __post_init__(self) -> None:
        self.last_seen = [time.monotonic()] * self.workers
        self.offset = [0] * self.workers

    def find_lost(self, live: list[int], waiting: set[int], now: float) -> list[tuple[int, float]]:
        """Declare lost every live worker silent too long with no request waiting; each one
        with its silence."""
        found = []
        for w in live:
            # a worker still starting up (never heard from) gets the whole timeout
            patience = self.lost_after_s if w in self.heard else self.timeout_s
            if w not in waiting and now - self.last_seen[w] > patience:
                self.lost.add(w)
                found.append((w, now - self.last_seen[w]))
        return found

    def heard_from(self, msg: Message, version: int, now: float) -> tuple[Message, float | None]:
        """Note `msg`'s worker spoke; the message with its clock moved on (sync), and the
        silence it broke where the worker was lost and is readmitted now (else None)."""
        w, back = msg.worker, None
        if w in self.lost:
            self.lost.discard(w)
            self.readmitted.append(w)
            back = now - self.last_seen[w]
            if self.sync and msg.kind in (Kind.PUSH, Kind.PUSH_PULL, Kind.PULL):
                # a push's clock is the round it closes (version + 1), a read's the version
                wanted = version + (0 if msg.kind is Kind.PULL else 1)
                self.offset[w] = max(self.offset[w], wanted - msg.clock)
        self.last_seen[w] = now
        self.heard.add(w)
        if self.offset[w] and msg.kind is not Kind.SAVE:
            msg = replace(msg, clock=msg.clock + self.offset[w])
        return msg, back
