"""The lighthouse: the one process that decides, step by step, which replica groups are alive.

A job of R replica groups (each a `gradmesh train` job of its own, any layout inside) averages
its gradients over the groups that are alive this step. Each group's leader asks the lighthouse
for the quorum of its next step; the lighthouse answers every group of a round at once with the
same decision: the members, their highest step (a member behind it, a group restarted or new,
recovers the parameters and optimizer state from `source` over the network before the step),
and a quorum id, new whenever the membership changes (the members then build a new process
group for the cross-group allreduce). After the allreduce each leader reports whether its group
finished it; the step commits only when every member did, so a group lost mid-step cannot leave
the others with different models.

A round closes as soon as every member of the last quorum has asked (new groups that asked by
then join); a member missing for `join_timeout_s` is dropped; the first round waits for all R
groups, or for `min_groups` after `start_timeout_s` (groups start seconds apart: each imports
torch and builds its model, slower on a busy host; one that misses the first round joins later
and copies the state, which costs a copy the job need not make). A round that cannot gather
`min_groups` within `quorum_timeout_s` fails in one line naming the step and the groups present;
a group whose run identity (model, layout, batch) differs from the quorum's is refused in one
line naming it. Each leader reports (`finish`) when its group took the last step; the members of
a quorum take every step together, so once one group finished the run is over, and a group that
asks afterwards (one restarted after its death, too late to rejoin; or one given more steps, since
the step count is not part of a run's identity) is told so at once and ends (the model is the
finished groups'), not kept waiting `quorum_timeout_s` for groups that will never ask again.

Why our own and not torchft's: torchft's lighthouse and manager are a Rust extension with a
gRPC transport (`torchft` on PyPI builds it per platform and pins torch versions of its own),
and its process groups wrap NCCL/Gloo with reconfiguration gradmesh's collectives do not need;
the protocol here is a few hundred lines of JSON lines over TCP on the standard library, which
the suite can drive and kill freely. The rendezvous of each quorum's Gloo group goes through a
torch `TCPStore` the lighthouse hosts beside it, each quorum under its own prefix.
Nothing is unpickled: requests are JSON, one line each, at most `MAX_LINE` bytes.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.options import option

MAX_LINE = 1 << 16
"""The longest request line the lighthouse reads (a quorum request is about 200 bytes)."""


@dataclass
class _Ask:
    group: int
    step: int
    identity: str
    incarnation: str
    """The asking process's own token: a group restarted under the same number is a new member
    (the old process's connections are dead), so its quorum gets a new id and process group."""
    decision: dict[str, Any] | None = None


@dataclass
class Rounds:
    """The quorum rounds and commit votes (the lighthouse's state, under `cond`)."""

    groups: int
    min_groups: int
    join_timeout_s: float
    quorum_timeout_s: float
    commit_timeout_s: float
    store: str = ""
    """host:port of the TCPStore the quorums' process groups meet at."""
    start_timeout_s: float = 30.0
    """How long the first round waits for every group before going on with `min_groups`."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    asks: dict[int, _Ask] = field(default_factory=dict)
    opened: float = 0.0
    """When the round's first member of the last quorum asked (the join timeout's clock)."""
    started: float = 0.0
    """When the round's first group asked (the quorum timeout's clock)."""
    members: tuple[int, ...] = ()
    incarnations: tuple[str, ...] = ()
    quorum_id: int = 0
    fresh: bool = False
    """A member asked for a new process group (its last step failed): the next quorum gets a new
    id even with the same members."""
    identity: str | None = None
    decisions: dict[int, dict[str, Any]] = field(default_factory=dict)
    votes: dict[tuple[int, int], dict[int, bool]] = field(default_factory=dict)
    verdicts: dict[tuple[int, int], bool] = field(default_factory=dict)
    vote_opened: dict[tuple[int, int], float] = field(default_factory=dict)
    finished: dict[int, int] = field(default_factory=dict)
    """The groups that took the run's last step, and that step."""

    def quorum(
        self, group: int, step: int, identity: str, reconfigure: bool, incarnation: str = ""
    ) -> dict[str, Any]:
        """Block until this round is decided; its decision (or an error for this group)."""
        if not 0 <= group < self.groups:
            return self._unknown(group)
        with self.cond:
            # another job is refused whenever it comes: before the run's end or after it
            if self.identity is not None and identity != self.identity:
                return {
                    "error": f"group {group} at step {step} runs another job ({identity}); the "
                    f"quorum runs {self.identity}: it is not admitted"
                }
            if self.finished:
                last, done = max(self.finished.values()), sorted(self.finished)
                return {
                    "finished": last,
                    "groups": done,
                    "note": f"the run finished at step {last} (groups {done}) before group "
                    f"{group} asked for step {step}",
                }
            if group in self.members or not self.members:
                # the clock starts with the first member of the last quorum: a group waiting
                # to join does not make the members' next round short
                self.opened = self.opened or time.monotonic()
            self.started = self.started or time.monotonic()
            ask = self.asks[group] = _Ask(group, step, identity, incarnation)
            self.fresh |= reconfigure
            self.cond.notify_all()
            while ask.decision is None:
                self._close(time.monotonic())
                if ask.decision is None:
                    self.cond.wait(timeout=0.05)
            return ask.decision

    def _unknown(self, group: int) -> dict[str, Any]:
        return {"error": f"group {group} is not one of the job's {self.groups} groups"}

    def _close(self, now: float) -> None:
        present = set(self.asks)
        waited = now - self.opened if self.opened else 0.0
        if self.members:
            ready = set(self.members) <= present or (
                waited >= self.join_timeout_s and len(present) >= self.min_groups
            )
        else:  # the first round: every group, or the minimum after the start timeout
            since = now - self.started  # the first ask opened the round (and its clocks)
            ready = len(present) == self.groups or (
                len(present) >= self.min_groups
                and since >= min(self.start_timeout_s, self.quorum_timeout_s)
            )
        if ready:
            self._decide()
        elif now - self.started >= self.quorum_timeout_s:
            step = max(a.step for a in self.asks.values())
            error = {
                "error": f"no quorum at step {step}: groups {sorted(present)} asked within "
                f"{self.quorum_timeout_s:g} s, at least {self.min_groups} of {self.groups} needed"
            }
            for ask in self.asks.values():
                ask.decision = error
            self.asks, self.opened, self.started = {}, 0.0, 0.0
            self.cond.notify_all()

    def _decide(self) -> None:
        if self.identity is None:  # the first round: the lowest group's run is the job's
            self.identity = self.asks[min(self.asks)].identity
        for group, other in list(self.asks.items()):
            if other.identity != self.identity:
                other.decision = {
                    "error": f"group {group} at step {other.step} runs another job "
                    f"({other.identity}); the quorum runs {self.identity}: it is not admitted"
                }
                del self.asks[group]
        members = tuple(sorted(self.asks))
        incarnations = tuple(self.asks[g].incarnation for g in members)
        if (members, incarnations) != (self.members, self.incarnations) or self.fresh:
            self.quorum_id += 1
        self.members, self.incarnations, self.fresh = members, incarnations, False
        steps = {g: a.step for g, a in self.asks.items()}
        top = max(steps.values())
        decision = {
            "quorum_id": self.quorum_id,
            "members": list(members),
            "steps": {str(g): s for g, s in steps.items()},
            "max_step": top,
            "source": min(g for g, s in steps.items() if s == top),
            "store": self.store,
        }
        self.decisions[self.quorum_id] = decision
        for ask in self.asks.values():
            ask.decision = decision
        self.asks, self.opened, self.started = {}, 0.0, 0.0
        self.cond.notify_all()

    def finish(self, group: int, step: int) -> dict[str, Any]:
        """`group` took the run's last step, `step`."""
        if not 0 <= group < self.groups:
            return self._unknown(group)
        with self.cond:
            self.finished[group] = step
            self.cond.notify_all()
        return {"ok": True}

    def commit(self, group: int, quorum_id: int, step: int, ok: bool) -> dict[str, Any]:
        """Block until every member of the quorum voted on `step` (or the commit timeout);
        True only if all of them finished it."""
        key = (quorum_id, step)
        with self.cond:
            decision = self.decisions.get(quorum_id)
            if decision is None or group not in decision["members"]:
                return {"error": f"group {group} is not in quorum {quorum_id}"}
            votes = self.votes.setdefault(key, {})
            self.vote_opened.setdefault(key, time.monotonic())
            votes[group] = ok
            self.cond.notify_all()
            while key not in self.verdicts:
                complete = set(votes) >= set(decision["members"])
                late = time.monotonic() - self.vote_opened[key] >= self.commit_timeout_s
                if complete or late or not all(votes.values()):  # one failure decides it
                    self.verdicts[key] = complete and all(votes.values())
                    self.cond.notify_all()
                else:
                    self.cond.wait(timeout=0.05)
            return {"commit": self.verdicts[key]}


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline(MAX_LINE + 1)
        try:
            if len(line) > MAX_LINE:
                raise ValueError(f"a request longer than {MAX_LINE} bytes")
            request = json.loads(line)
            reply = self.server.answer(request)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"bad request: {exc}"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], rounds: Rounds) -> None:
        super().__init__(address, _Handler)
        self.rounds = rounds

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "quorum":
            return self.rounds.quorum(
                int(request["group"]),
                int(request["step"]),
                str(request["identity"]),
                bool(request.get("reconfigure", False)),
                str(request.get("incarnation", "")),
            )
        if op == "commit":
            return self.rounds.commit(
                int(request["group"]),
                int(request["quorum_id"]),
                int(request["step"]),
                bool(request["ok"]),
            )
        if op == "finish":
            return self.rounds.finish(int(request["group"]), int(request["step"]))
        raise ValueError(f"unknown op {op!r}")


class Lighthouse:
    """The lighthouse's TCP server on a thread of this process, and the TCPStore the quorums'
    process groups meet at (`store_port`, 0: any free one); `close` stops both."""

    def __init__(self, rounds: Rounds, host: str = "127.0.0.1", port: int = 0, store_port: int = 0):
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        try:
            self.store = TCPStore(host, store_port, is_master=True, wait_for_workers=False)
        except RuntimeError as exc:
            raise GradmeshError(
                f"the lighthouse cannot host its store at {host}:{store_port}: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        rounds.store = f"{host}:{self.store.port}"
        try:
            self.server = _Server((host, port), rounds)
        except OSError as exc:
            raise GradmeshError(f"the lighthouse cannot listen on {host}:{port}: {exc}") from None
        self.host, self.port = host, int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        del self.store


@dataclass
class LighthouseConfig:
    """gradmesh lighthouse: decide each step's quorum of replica groups"""

    groups: int = option(2, "replica groups in the job (R)")
    min_groups: int = option(1, "fewest groups a step may go on with")
    bind: str = option("127.0.0.1", "address to listen on (0.0.0.0 only if asked)")
    port: int = option(29600, "port of the quorum service")
    store_port: int = option(0, "port of the process groups' store (0: any free one)")
    join_timeout_s: float = option(5.0, "seconds a step waits for a group of the last quorum")
    start_timeout_s: float = option(
        30.0, "seconds the first step waits for every group before going on with --min-groups"
    )
    quorum_timeout_s: float = option(120.0, "seconds a step waits for --min-groups at all")
    commit_timeout_s: float = option(10.0, "seconds a commit waits for every member's vote")
    exit_after_s: float = option(0.0, "stop after this many seconds (0: when killed)")


def run(config: LighthouseConfig, _command: list[str] | None = None) -> int:
    if not 1 <= config.min_groups <= config.groups:
        raise GradmeshError(
            f"--min-groups must be in 1..--groups ({config.groups}), got {config.min_groups}"
        )
    if not (0 <= config.port <= 65535 and 0 <= config.store_port <= 65535):  # 0: any free one
        raise GradmeshError(
            f"--port and --store-port must be in 0..65535, got {config.port} and "
            f"{config.store_port}"
        )
    timeouts = (config.join_timeout_s, config.start_timeout_s, config.quorum_timeout_s)
    if min(*timeouts, config.commit_timeout_s) <= 0:
        raise GradmeshError("the lighthouse's timeouts must be > 0")
    rounds = Rounds(
        config.groups,
        config.min_groups,
        config.join_timeout_s,
        config.quorum_timeout_s,
        config.commit_timeout_s,
        start_timeout_s=config.start_timeout_s,
    )
    lighthouse = Lighthouse(rounds, config.bind, config.port, config.store_port)
    print(f"gradmesh lighthouse: {lighthouse.address}, store {rounds.store}", flush=True)
    try:
        deadline = time.monotonic() + config.exit_after_s
        while not config.exit_after_s or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.close()
    return 0
