"""Horovod's coordinator: the drop-in's operations are matched across ranks by name, within
each process set, and run once every rank of the set has submitted them, whatever order each
rank submitted them in.

Read from Horovod's `controller.cc`, `operations.cc`, `response_cache.cc` and
`tensor_queue.cc`, and built for gradmesh's layering (torch.distributed groups, a thread per
set, no rank-0 coordinator):

- Each process set that is used gets a `Coordinator`: its own process group and its own thread.
  A submitted operation becomes a pending `Request` (its name, a header: kind, dtype, shape and
  the op or root, and the function that runs it); a second pending request with the same name
  is a `ValueError` on that rank at once, as in Horovod. An unnamed operation is named by a
  counter of unnamed operations on the set (Horovod's `allreduce.noname.N`), so unnamed ones
  match in submission order.
- While a rank has requests pending (or has joined), its thread runs rounds: one all-gather of
  every rank's pending set on the set's group. A name pending on every rank that has not joined
  is ready; every rank sees the same tables, so every rank runs the ready operations in the same
  order (the lowest active rank's), on the same thread, on the set's group. A name whose headers
  differ between ranks (another shape, dtype, op or root) is one error on every rank. A rank
  with nothing pending takes no part in rounds, and costs nothing; an operation waits for its
  last rank to submit it, bounded by the job's timeout.
- The response cache: a request whose name and header ran before is sent as one bit of a fixed
  bit set (the cache is the same on every rank: it is filled and aged in the agreed order of
  execution, least recently used entries evicted). In the steady state a round is one
  all-gather of 88 bytes a rank, whatever the number of operations it settles; new requests
  add a second all-gather of their rows. Horovod allreduces the bits (AND); gradmesh
  all-gathers them, which also tells every rank who has joined and what each rank waits for.
- Join (Horovod's semantics): a joined rank contributes zeros to the others' Sum and Average
  allreduces, averages still divide by the set's size, and it takes the optimizer's steps
  (announced as a request) on zero gradients (Horovod's joined rank does not step). Allgather,
  broadcast, alltoall, reducescatter (Horovod's refusals), barrier, objects and Min/Max/Product
  (gradmesh's) with a joined rank are an error on the ranks that called them; a joined rank
  still advances its unnamed counter, so names stay matched. `join()` returns the last rank.
Not Horovod's C++ core: it does not build against current torch (docs/horovod.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives import allreduce
from gradmesh.errors import GradmeshError, GradmeshValueError, PeerFailure, first_line
from gradmesh.horovod.headers import (
    ALLREDUCE,
    AUTO,
    DIFFERENT,
    DTYPE,
    DTYPES,
    EXTRA,
    GROUPED,
    JOINABLE,
    KIND,
    KINDS,
    NDIM,
    OPS,
    ROW,
    SHAPE,
    STEP,
    SUMMARY,
    Cache,
    Key,
    Round,
    buffers_of,
    name_hash,
    said,
)
from gradmesh.runtime.compat import all_gather_single
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.data_parallel.reducer import Average, Sum

IDLE_S = (0.0005, 0.02)
"""A round that settles nothing waits from the first to the second, doubling."""


@dataclass
class Request:
    name: str
    key: Key
    """(name hash, *header): what the ranks must agree on."""
    run: Callable[[int], Any]
    """Runs the operation on this rank, given how many of the set's ranks have joined."""
    future: Future[Any] = field(default_factory=Future)
    since: float = field(default_factory=time.monotonic)


class Coordinator:
    """The negotiation of one process set (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ranks: list[int], label: str) -> None:
        self.group, self.ranks, self.label = group, ranks, label
        rt = get_runtime()
        self.device = rt.device if rt.backend == "nccl" else torch.device("cpu")  # NCCL: CUDA
        self.pending: dict[str, Request] = {}
        self.lock = threading.Condition()
        self.unnamed = 0
        self.rounds = 0
        self.new_rounds = 0
        """Rounds that sent requests' rows (a second all-gather): names not in the cache."""
        self.joining: Future[int] | None = None
        self.joined_in = -1
        self.cache = Cache()
        self.closed: str | None = None
        self.leave_now = False  # closed without waiting for the other ranks: the thread ends
        self.optimizer: Any = None
        """A weak reference to the set's most recent DistributedOptimizer (a joined rank steps
        it when the others announce a step)."""
        self.thread: threading.Thread | None = None

    # -- the caller's side -------------------------------------------------------------
    def submit(
        self, what: str, row: list[int], name: str | None, run: Callable[[int], Any]
    ) -> Future[Any]:
        """Queue an operation; its future completes when every rank of the set has submitted
        it and it ran. One line at once for a name already pending on this rank."""
        with self.lock:
            if self.closed is not None:
                raise PeerFailure(
                    f"rank {get_runtime().rank}: {what} on {self.label}: {self.closed}"
                )
            if name is None:  # matched by the counter; named as Horovod names it
                row[AUTO], self.unnamed = self.unnamed, self.unnamed + 1
                name, match = f"{what}.noname.{row[AUTO]}", f"noname.{row[AUTO]}"
            else:
                match = name
            if name in self.pending:
                raise GradmeshValueError(
                    f"rank {get_runtime().rank}: an operation named {name!r} is still in flight "
                    f"on {self.label}; synchronize it before starting another of that name"
                )
            request = Request(name, (name_hash(match), *row), run)
            self.pending[name] = request
            self._wake()
        return request.future

    def join(self) -> Future[int]:
        """This rank has joined (see the module docstring); the future gives the last rank to
        join, once every rank of the set has."""
        with self.lock:
            if self.joining is None:
                self.joining = Future()
                self._wake()
            return self.joining

    def close(self, reason: str, wait: bool = True) -> None:
        """Fail what is pending with `reason` (the set was removed, the job shut down); later
        submissions fail with it too. Every rank of the set closes (removing a set and shutting
        down are collective): the threads run rounds until all say they are closing, so none
        is left waiting in a round for another, and the set's group can then be freed."""
        with self.lock:
            self.closed, self.leave_now = reason, not wait
            failed = list(self.pending.values())
            self.pending.clear()
            joining, self.joining = self.joining, None
            self.lock.notify_all()
        me = get_runtime().rank
        for request in failed:
            where = f"{self._what(request)} {request.name!r} on {self.label}"
            request.future.set_exception(PeerFailure(f"rank {me}: {where}: {reason}"))
        if joining is not None:
            joining.set_exception(PeerFailure(f"rank {me}: join on {self.label}: {reason}"))
        if wait and self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(get_runtime().timeout.total_seconds() + 5.0)

    def _wake(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._loop, name=f"gradmesh-coordinator {self.label}", daemon=True
            )
            self.thread.start()
        self.lock.notify_all()

    # -- the coordinator's thread ------------------------------------------------------
    def _loop(self) -> None:
        idle = IDLE_S[0]
        while True:
            with self.lock:
                while not self.pending and self.joining is None and self.closed is None:
                    self.lock.wait()
                closing = self.closed is not None
                if closing and self.leave_now:
                    return
                mine = list(self.pending.values())
                if self.joining is not None and self.joined_in < 0:
                    self.joined_in = self.rounds
            try:
                table = self._exchange([r.key for r in mine], closing)
            except Exception as exc:  # noqa: BLE001 - the group cannot be trusted after a failed call
                if not closing:  # (closing: the group may be gone already, on a failing rank)
                    self.close(first_line(exc))
                return
            if all(table.closing):
                return
            try:  # a joined rank's part in the others' operation, failing, ends its join
                settled = self._settle(table, {r.key[0]: r for r in mine})
            except Exception as exc:  # noqa: BLE001 - said once, by `close`, to every waiter
                self.close(first_line(exc), wait=False)
                return
            self._expire(table, mine)
            if settled:
                idle = IDLE_S[0]
            else:
                time.sleep(idle)
                idle = min(2 * idle, IDLE_S[1])

    def _exchange(self, keys: list[Key], closing: bool = False) -> Round:
        """One round: every rank's summary (one all-gather), then the new rows if any rank
        has some (a second)."""
        self.rounds += 1
        words, new = self.cache.encode(keys)
        row = [self.joined_in, len(new), int(closing), *words]
        summary = torch.tensor(row, dtype=torch.int64, device=self.device)
        summaries = self._gather(summary, "summaries").view(-1, SUMMARY).tolist()
        most = max(s[1] for s in summaries)
        rows: list[list[int]] = [[] for _ in summaries]
        if most:
            self.new_rounds += 1
            padded = torch.full((most, ROW), -1, dtype=torch.int64, device=self.device)
            if new:
                padded[: len(new)] = torch.tensor(new, dtype=torch.int64, device=self.device)
            rows = self._gather(padded.view(-1), "requests").view(len(summaries), -1).tolist()
        keys_of = [
            self.cache.decode(s[3:]) + [tuple(row[i * ROW : (i + 1) * ROW]) for i in range(s[1])]
            for s, row in zip(summaries, rows, strict=True)
        ]
        return Round([int(s[0]) for s in summaries], keys_of, [bool(s[2]) for s in summaries])

    def _gather(self, mine: torch.Tensor, what: str) -> torch.Tensor:
        rt = get_runtime()
        out = torch.empty(mine.numel() * len(self.ranks), dtype=torch.int64, device=self.device)
        try:
            all_gather_single(out, mine, self.group, async_op=True).wait(rt.timeout)
        except RuntimeError as exc:  # said by `close`, for each operation waiting
            others = [r for r in self.ranks if r != rt.rank]
            who = f"rank {others[0]} did not" if len(others) == 1 else f"not all of ranks {others}"
            raise PeerFailure(
                f"round {self.rounds} of the negotiation ({what}): {who} take part within "
                f"{rt.timeout.total_seconds():g} s: {first_line(exc)}"
            ) from None
        return out.cpu()

    def _settle(self, table: Round, mine: dict[int, Request]) -> bool:
        """Run (or refuse) every request ready in `table`, in the agreed order; whether any
        was."""
        active = table.active()
        if not active:
            self._joined_all(table)
            return True
        joined = len(self.ranks) - len(active)
        lead = {key[0]: key for key in table.keys[active[0]]}
        by_rank = [{key[0]: key for key in keys} for keys in table.keys]
        ready = [h for h in lead if all(h in by_rank[r] for r in active)]
        for h in ready:
            keys = {r: by_rank[r][h] for r in active}
            problem = self._problem(keys, table, joined)
            key = lead[h]
            if key[1 + AUTO] >= 0:  # a joined rank's unnamed counter follows the others'
                with self.lock:
                    self.unnamed = max(self.unnamed, key[1 + AUTO] + 1)
            request = mine.get(h)
            if request is not None:
                self._finish(request, problem, joined)
            elif not problem and self.joined_in >= 0:
                self._take_part(key)
            if not problem:
                self.cache.put(key)
        return bool(ready)

    def _problem(self, keys: dict[int, Key], table: Round, joined: int) -> str:
        """Why a ready name cannot run ('' if it can): the ranks disagree on it, or a joined
        rank cannot take part in it."""
        first = next(iter(keys.values()))
        if any(key != first for key in keys.values()):
            words = "; ".join(f"rank {self.ranks[r]}: {said(key[1:])}" for r, key in keys.items())
            return f"{DIFFERENT}: {words}"
        if not joined:
            return ""
        kind, extra = first[1 + KIND], first[1 + EXTRA]
        reduces = kind in (ALLREDUCE, GROUPED)
        if kind not in JOINABLE or (reduces and OPS[extra] not in (Sum, Average)):
            who = [self.ranks[r] for r, at in enumerate(table.joined) if at >= 0]
            return (
                f"rank(s) {who} have joined, and joined ranks take part only in Sum and Average "
                f"allreduces and the optimizer's steps, not in a {said(first[1:])} (as in "
                "Horovod)"
            )
        return ""

    def _finish(self, request: Request, problem: str, joined: int) -> None:
        with self.lock:
            self.pending.pop(request.name, None)
        if problem:
            me = get_runtime().rank
            line = f"rank {me}: {self._what(request)} {request.name!r} on {self.label}: {problem}"
            differ = problem.startswith(DIFFERENT)  # the ranks' doing: the job cannot go on
            request.future.set_exception(PeerFailure(line) if differ else GradmeshError(line))
            return
        try:
            result = request.run(joined)
        except BaseException as exc:  # the operation's own error, raised at synchronize
            request.future.set_exception(exc)
        else:
            request.future.set_result(result)

    def _what(self, request: Request) -> str:  # the request's kind, in words
        return KINDS[request.key[1 + KIND]]

    def _take_part(self, key: Key) -> None:
        """A joined rank's side of a ready operation: zeros into an allreduce, the optimizer's
        step on zero gradients."""
        row = key[1:]
        if row[KIND] == STEP:
            optimizer = self.optimizer() if self.optimizer is not None else None
            if optimizer is None:
                raise GradmeshError(
                    f"rank {get_runtime().rank}: join: the others step a DistributedOptimizer "
                    "this rank has not made"
                )
            optimizer.join_step()
            return
        device = get_runtime().device
        if row[KIND] == GROUPED:
            for numel, dtype in buffers_of(row):
                allreduce(
                    torch.zeros(numel, dtype=dtype, device=device), "sum", "native", self.group
                )
            return
        shape = list(row[SHAPE : SHAPE + row[NDIM]])
        zeros = torch.zeros(shape, dtype=DTYPES[row[DTYPE]], device=device)
        allreduce(zeros, "sum", "native", self.group)

    def _joined_all(self, table: Round) -> None:
        """Every rank has joined: each returns the last to join (of those, the highest)."""
        last = max(range(len(self.ranks)), key=lambda r: (table.joined[r], r))
        with self.lock:
            joining, self.joining, self.joined_in = self.joining, None, -1
        if joining is not None:
            joining.set_result(self.ranks[last])

    def _expire(self, table: Round, mine: list[Request]) -> None:
        """Fail this rank's requests that waited past the job's timeout for ranks that have not
        submitted them, naming those ranks."""
        timeout = get_runtime().timeout.total_seconds()
        now = time.monotonic()
        for request in mine:
            if request.future.done() or now - request.since < timeout:
                continue
            h = request.key[0]
            missing = [
                self.ranks[r] for r in table.active() if all(key[0] != h for key in table.keys[r])
            ]
            with self.lock:
                self.pending.pop(request.name, None)
            request.future.set_exception(
                PeerFailure(
                    f"rank {get_runtime().rank}: {self._what(request)} {request.name!r} on "
                    f"{self.label}: rank(s) {missing} did not submit it within {timeout:g} s"
                )
            )


_coordinators: dict[int, Coordinator] = {}
"""The coordinator of each process set this rank is in, by set id."""


def coordinator(set_id: int, group: dist.ProcessGroup, ranks: list[int]) -> Coordinator:
    """The set's coordinator (made on first use; all of them closed when the runtime shuts
    down, `gradmesh.shutdown()` as well as `hvd.shutdown()`)."""
    found = _coordinators.get(set_id)
    if found is None:
        if not _coordinators:
            rt = get_runtime()
            rt.on_shutdown.append(lambda: close_all(SHUT_DOWN, wait=False))
        label = "the global process set" if set_id == 0 else f"process set {set_id}"
        found = _coordinators[set_id] = Coordinator(group, ranks, label)
    return found


SHUT_DOWN = "the job was shut down while it was pending"


def close(set_id: int, reason: str, wait: bool = True) -> None:
    """Fail the set's pending operations with `reason` and forget its coordinator."""
    found = _coordinators.pop(set_id, None)
    if found is not None:
        found.close(reason, wait)


def close_all(reason: str, wait: bool = True) -> None:
    """Close every set's coordinator (`wait` False: at the runtime's shutdown, which need not
    be collective, a rank waits for no peer)."""
    for set_id in list(_coordinators):
        close(set_id, reason, wait)
