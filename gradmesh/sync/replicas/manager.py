"""A replica group's side of the per-step quorum (`gradmesh.sync.replicas.lighthouse`).

Each rank of a group holds a `ReplicaManager`. At the start of every step the group's leader
(its rank 0) asks the lighthouse for the step's quorum and the group's ranks learn it from the
leader (a broadcast inside the group). A new quorum id means a new Gloo process group across the
groups: rank r of every member group joins the group of local rank r (so a group split by any
layout pairs each part with the same part elsewhere), meeting at the lighthouse's store under
the quorum's prefix. A group behind the quorum's highest step (restarted, or new) receives the
source group's state (`state()`: parameters, optimizer and strategy state, the step) over that
process group (`torch.save` bytes, read back with `weights_only=True`) and loads it before the
step; the others receive the same bytes and drop them.

After the backward, `ReplicaOptimizer.step` (`optimizer.py`) averages the gradients over the
quorum (through the job's `--compression`: `averaging.py`), then the group votes (every rank of
it finished the allreduce) and the leader asks the lighthouse whether every member group did:
only then does the optimizer step. Otherwise the step raises `StepAborted`, the trainer takes
the same step again with the next quorum (whose process group is new), and nothing was applied
anywhere, so the groups cannot drift apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from gradmesh.collectives import broadcast_object
from gradmesh.errors import GradmeshError, first_line
from gradmesh.runtime.world import Runtime, collective_device
from gradmesh.sync.replicas.averaging import CrossGroupAverage, QuorumLink

ANSWER_S = 600.0
"""How long a leader waits for the lighthouse's answer: it answers within its own quorum and
commit timeouts (120 s and 10 s by default); a lighthouse that died resets the connection at
once, so this bounds only a lighthouse that hangs or a link that went silent."""


class StepAborted(Exception):
    """The step's cross-group allreduce did not finish on every member group: nothing was
    applied; take the step again with the next quorum."""


REACH_S = 60.0
"""How long a leader keeps trying to connect to a lighthouse it cannot reach (its link down for
a while, the network unreachable, a refused connection) before the group ends in one line."""

CONNECT_S = 5.0
"""One connection attempt's limit (a host that drops the SYNs): then it is tried again."""


def ask(
    address: str, request: dict[str, Any], timeout_s: float, reach_s: float = REACH_S
) -> dict[str, Any]:
    """One request to the lighthouse at `address` (host:port) and its reply; one line naming
    the lighthouse when it cannot be reached within `reach_s` (connections tried again every
    half second: nothing was sent) or answers an error, or its answer does not come within
    `timeout_s` (never sent again: the request may have counted)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + reach_s

    def failed(exc: Exception) -> GradmeshError:
        return GradmeshError(
            f"replica group {request.get('group')} at step {request.get('step')}: the "
            f"lighthouse at {address} did not answer {request.get('op')} ({exc})"
        )

    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=CONNECT_S)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise failed(exc) from None
            time.sleep(0.5)
    try:
        with conn:
            conn.settimeout(timeout_s)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(conn.makefile("rb").readline())
    except (OSError, ValueError) as exc:
        raise failed(exc) from None
    if "error" in reply:
        raise GradmeshError(f"the lighthouse at {address}: {reply['error']}")
    return cast(dict[str, Any], reply)


@dataclass(frozen=True)
class Quorum:
    """One step's quorum as this group sees it."""

    quorum_id: int
    members: tuple[int, ...]
    index: int
    """This group's position among the members (its slice of the global batch)."""
    max_step: int
    source: int
    behind: bool
    """Whether this group must recover the source's state before the step."""
    recovering: bool
    """Whether any member is behind: every member takes part in the copy."""


@dataclass
class ReplicaManager:
    """One rank's view of the replica groups (see the module docstring)."""

    group: int
    groups: int
    address: str
    identity: str
    rt: Runtime
    timeout_s: float = 60.0
    quorum: Quorum | None = None
    process_group: Any = None
    store: Any = None
    retired: list[Any] = field(default_factory=list)
    """The process groups of earlier quorums (see `_connect`)."""
    reconfigure: bool = False
    incarnation: str = field(default_factory=lambda: secrets.token_hex(8))
    """This process's token (the lighthouse gives a restarted group a new process group)."""
    recoveries: int = 0
    aborted: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    """Per quorum change: the step, the members (for the report)."""
    step_seconds: dict[int, float] = field(default_factory=dict)
    """Per committed step: seconds from its first quorum request to its commit (a step taken
    again counts all its tries)."""
    after_the_end: bool = False
    """This group asked to join after another had taken the run's last step."""
    averaging: CrossGroupAverage = field(default_factory=CrossGroupAverage)
    """The average across groups and its compressor (`--compression`)."""

    def start_step(self, step: int) -> Quorum | None:
        """This step's quorum (blocks until the lighthouse decides); a new process group when
        its id changed, asked for again until every member connected to it. None where the run
        is over: another group took its last step before this one (restarted too late) could
        join; it has nothing left to train, and says so in a line."""
        while True:
            asked = self._ask_quorum(step)
            if asked is None:
                return None
            quorum, store = asked
            fresh = self.quorum is None or quorum.quorum_id != self.quorum.quorum_id
            self.quorum, self.reconfigure = quorum, False
            if not fresh:
                return quorum
            if self._agree(self._connect(quorum, store)):
                self.history.append(  # the quorum's step (a group that recovers jumps to it)
                    {
                        "step": quorum.max_step,
                        "members": list(quorum.members),
                        "unix_time": time.time(),
                    }
                )
                return quorum
            self.quorum, self.reconfigure = None, True

    def _ask_quorum(self, step: int) -> tuple[Quorum, str] | None:
        decision = None
        if self.rt.rank == 0:
            decision = ask(
                self.address,
                {
                    "op": "quorum",
                    "group": self.group,
                    "step": step,
                    "identity": self.identity,
                    "reconfigure": self.reconfigure,
                    "incarnation": self.incarnation,
                },
                ANSWER_S,
            )
        decision = self._share(decision)
        if "finished" in decision:
            self.after_the_end = True
            self._say(f"{decision['note']}; it ends here (the finished groups hold the model)")
            return None
        members = tuple(int(g) for g in decision["members"])
        steps = [int(s) for s in decision["steps"].values()]
        top = int(decision["max_step"])
        quorum = Quorum(
            int(decision["quorum_id"]),
            members,
            members.index(self.group),
            top,
            int(decision["source"]),
            int(decision["steps"][str(self.group)]) < top,
            min(steps) < top,
        )
        return quorum, str(decision["store"])

    def _say(self, what: str) -> None:
        """One line about this group, from its leader."""
        if self.rt.rank == 0:
            print(
                f"gradmesh train: replica group {self.group}: {what}", file=sys.stderr, flush=True
            )

    def _share(self, value: Any) -> Any:
        """The leader's value on every rank of this group."""
        return broadcast_object(value, root_rank=0) if self.rt.size > 1 else value

    def _agree(self, ok: bool) -> bool:
        """True only where every rank of this group says True."""
        if self.rt.size > 1:
            vote = torch.tensor([1 if ok else 0], dtype=torch.int64, device=collective_device())
            dist.all_reduce(vote, op=dist.ReduceOp.MIN)
            ok = bool(vote[0])
        return ok

    def _connect(self, quorum: Quorum, store: str) -> bool:
        """Join the quorum's process group (this local rank's), False where a member did not
        come within the timeout."""
        host, _, port = store.rpartition(":")
        if self.process_group is not None:
            # never destroyed: Gloo's destructor joins its work threads, and one blocked on a
            # peer that died can hold it for ever; the process leaves by os._exit
            self.retired.append(self.process_group)
            self.process_group = None
        try:
            if self.store is None:
                self.store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s)
                )
            prefix = dist.PrefixStore(  # type: ignore[attr-defined]
                f"q{quorum.quorum_id}/r{self.rt.rank}", self.store
            )
            self.process_group = dist.ProcessGroupGloo(
                prefix, quorum.index, len(quorum.members), timedelta(seconds=self.timeout_s)
            )
        except RuntimeError:
            return False
        return True

    def recover(
        self, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]
    ) -> bool:
        """The source group's state on every member that is behind (a collective of the
        quorum); False where the copy failed (a peer or the link lost mid-copy)."""
        quorum = self.quorum
        assert quorum is not None
        source = quorum.members.index(quorum.source)
        failure = "on another rank of this group"
        try:
            payload = torch.zeros(0, dtype=torch.uint8, device="cpu")  # Gloo's
            if quorum.index == source:
                buffer = io.BytesIO()
                torch.save(state(), buffer)
                payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device="cpu")
            options = dist.BroadcastOptions()
            options.rootRank = source
            self.process_group.broadcast([length], options).wait()
            if quorum.index != source:
                payload = torch.empty(int(length[0]), dtype=torch.uint8, device="cpu")
            self.process_group.broadcast([payload], options).wait()
        except RuntimeError as exc:
            payload, failure = None, first_line(exc)
        if not self._agree(payload is not None):
            self._say(
                f"the copy of group {quorum.source}'s state at step {quorum.max_step} failed "
                f"({failure}); nothing was loaded, the step is taken again with the next quorum"
            )
            self.reconfigure = True
            return False
        if quorum.behind:
            assert payload is not None
            load(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True))
            self.recoveries += 1
        return True

    def average(self, tensors: list[torch.Tensor]) -> bool:
        """Average `tensors` (this rank's gradients) over the quorum's groups, in place, through
        the job's compressor (`averaging`); False where the allreduce failed (a member lost)."""
        quorum = self.quorum
        assert quorum is not None
        if len(quorum.members) == 1:
            return True
        started, sent = time.perf_counter(), 0
        try:
            sent = self.averaging(self.process_group, tensors)
        except RuntimeError:
            return False
        finally:
            self.rt.comm.add(sent, time.perf_counter() - started)
        return True

    def any_group(self, flag: bool) -> bool | None:
        """Whether `flag` (the same on every rank of this group) holds in any member group: a
        MAX over the quorum; None where the exchange failed (a member lost)."""
        quorum = self.quorum
        assert quorum is not None
        if len(quorum.members) == 1:
            return flag
        link, started = QuorumLink(pg=self.process_group), time.perf_counter()
        vote = torch.tensor([1.0 if flag else 0.0], device="cpu")  # the quorum's Gloo group
        try:
            link.allreduce(vote, "max")
        except RuntimeError:
            return None
        finally:
            self.rt.comm.add(link.sent, time.perf_counter() - started)
        return bool(vote.item())

    def commit(self, step: int, ok: bool) -> bool:
        """Whether every member group finished `step` (the group's ranks vote, the leader asks
        the lighthouse); False also schedules a new process group."""
        ok = self._agree(ok)
        verdict = None
        if self.rt.rank == 0:
            assert self.quorum is not None
            verdict = ask(
                self.address,
                {
                    "op": "commit",
                    "group": self.group,
                    "quorum_id": self.quorum.quorum_id,
                    "step": step,
                    "ok": ok,
                },
                ANSWER_S,
            )["commit"]
        committed = bool(self._share(verdict))
        if committed:
            self.averaging.committed()
        else:
            self.averaging.undo()
            self.reconfigure = True
            self.aborted += 1
        return committed

    def finish(self, step: int) -> None:
        """Tell the lighthouse this group took the run's last step (the leader; a group that
        came after the end has nothing to report). Best effort: the group's training is done
        whether or not the lighthouse hears of it (it only spares a late group its wait)."""
        if self.rt.rank == 0 and not self.after_the_end:
            with contextlib.suppress(GradmeshError):
                request = {"op": "finish", "group": self.group, "step": step}
                ask(self.address, request, 5.0, reach_s=5.0)

    def report(self) -> dict[str, Any]:
        """The group's figures: its quorum changes (step, members, unix time), the copies it
        received, the steps taken again, the step times (median; the first, which waits for
        the other groups to start or copies their state; the longest after it, with its step)."""
        ordered = sorted(self.step_seconds.values())
        first = min(self.step_seconds, default=-1)
        later = {step: s for step, s in self.step_seconds.items() if step != first}
        longest = max(later, key=later.__getitem__, default=-1)
        return {
            "step_s_median": ordered[len(ordered) // 2] if ordered else 0.0,
            "first_step_s": self.step_seconds.get(first, 0.0),
            "step_s_longest": later.get(longest, 0.0),
            "longest_step": longest,
            "replica_group": self.group,
            "replica_groups": self.groups,
            "quorum_changes": self.history,
            "recoveries": self.recoveries,
            "aborted_steps": self.aborted,
            "after_the_end": self.after_the_end,
        }
