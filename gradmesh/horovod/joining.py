"""Horovod's join for uneven data: a rank out of batches calls `hvd.join()`, and the other
ranks' operations on the global process set still complete. The joined rank adds zeros to sums,
is left out of averages, gathers no rows, receives broadcasts and takes the optimizer's steps
on zero gradients (so every replica stays the same); `join()` returns the last rank to join.

How: every operation on the global set is announced first. Each rank posts a small header
(kind, dtype, shape, and the reduction's op or the broadcast's root) in one all-gather on the
communication thread's group, as Horovod's coordinator negotiates each tensor before it moves.
A rank in `join()` posts "joined" headers and runs its side of each operation the others
announce; when every header says joined, all of them return. The headers also catch ranks that
call different operations: one error on every rank, not a hang.

Process sets other than the global one are not announced: an optimizer over a set joins
through its own step loop (`DistributedOptimizer.join`, the count of ranks still training riding
on its last bucket).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any

import torch

from gradmesh.collectives import allreduce, broadcast
from gradmesh.errors import GradmeshError, PeerFailure, first_line
from gradmesh.runtime.compat import all_gather_single
from gradmesh.runtime.world import get_runtime
from gradmesh.sync.data_parallel import api as _api
from gradmesh.sync.data_parallel.api import MAX_DIMS, Before
from gradmesh.sync.data_parallel.reducer import Average, Sum

JOINED, ALLREDUCE, ALLGATHER, BROADCAST, STEP, OTHER = range(6)
KINDS = ("join", "allreduce", "allgather", "broadcast", "optimizer step", "operation")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
OPS = (Sum, Average, "min", "max", "product")
"""A reduction's op, by the index its header carries."""
OTHERS = (
    "operation",
    "alltoall",
    "barrier",
    "broadcast_object",
    "allgather_object",
    "sparse_allreduce",
)
"""Operations a joined rank cannot take part in, by the index their header carries."""
KIND, DTYPE, EXTRA, NDIM, SHAPE = 0, 1, 2, 3, 4
WIDTH = SHAPE + MAX_DIMS
"""A header: kind, dtype, extra (op, root, or the round a rank joined in), ndim, shape."""


class _Join:
    rounds = 0
    """Headers exchanged so far (the same count on every rank: all of them take part)."""
    optimizer: Any = None
    """A weak reference to the global set's most recent DistributedOptimizer."""


def _header(kind: int, tensor: torch.Tensor | None = None, extra: int = 0) -> torch.Tensor:
    row = torch.full((WIDTH,), -1, dtype=torch.int64, device=get_runtime().device)
    row[KIND], row[EXTRA] = kind, extra
    if tensor is not None and kind != OTHER:  # (whose ranks may send different shapes)
        known = tensor.dtype in DTYPES and tensor.dim() <= MAX_DIMS
        row[DTYPE] = DTYPES.index(tensor.dtype) if known else len(DTYPES)  # not to mirror
        dims = tensor.shape[:MAX_DIMS]
        row[NDIM] = len(dims)
        row[SHAPE : SHAPE + len(dims)] = torch.tensor(dims, dtype=torch.int64, device="cpu")
        if kind == ALLGATHER and tensor.dim():
            row[SHAPE] = -1  # first dimensions may differ between ranks
    return row


def _exchange(row: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's header (on the communication thread); a rank that never announces (it
    called another operation on another group, or none) is an error naming the operation."""
    _Join.rounds += 1
    rt = get_runtime()
    table = torch.empty(rt.size * WIDTH, dtype=torch.int64, device=rt.device)
    try:  # the backend's own all-gather: the header is the check, no signature exchange first
        all_gather_single(table, row, rt.async_group, async_op=True).wait(rt.timeout)
        return table.view(rt.size, WIDTH)
    except RuntimeError as exc:
        others = ", ".join(str(r) for r in range(rt.size) if r != rt.rank)
        raise PeerFailure(
            f"rank {rt.rank}: {what} (announcement #{_Join.rounds} on the global process set): "
            f"rank(s) {others} did not join the call (timeout {rt.timeout.total_seconds():g} "
            f"s): {first_line(exc)}"
        ) from None


def _said(row: torch.Tensor) -> str:
    kind = int(row[KIND])
    if kind == JOINED:
        return "join"
    if kind == STEP:
        return KINDS[kind]
    if kind == OTHER:
        return OTHERS[int(row[EXTRA])]
    code = int(row[DTYPE])
    dtype = str(DTYPES[code]).removeprefix("torch.") if code < len(DTYPES) else "other dtype"
    shape = tuple(int(n) for n in row[SHAPE : SHAPE + int(row[NDIM])])
    return f"{KINDS[kind]} of {dtype} {shape}"


def _check(table: torch.Tensor, what: str) -> list[int]:
    """The joined ranks; one line if the ranks still training announced different operations,
    or one a joined rank cannot take part in."""
    me = get_runtime().rank
    joined = [r for r in range(len(table)) if int(table[r, KIND]) == JOINED]
    active = [r for r in range(len(table)) if r not in joined]
    if not active:
        return joined
    first = table[active[0]]
    if any(not torch.equal(table[r], first) for r in active):
        said = "; ".join(f"rank {r}: {_said(table[r])}" for r in active)
        raise PeerFailure(f"rank {me}: {what}: the ranks called different operations: {said}")
    if not joined:
        return joined
    kind, extra = int(first[KIND]), int(first[EXTRA])
    problem = ""
    if kind == OTHER:
        problem = "it serves allreduce, allgather, broadcast and the optimizer's steps only"
    elif kind == ALLREDUCE and OPS[extra] not in (Sum, Average):
        problem = f"its zeros would change a {OPS[extra]} reduction"
    elif kind == BROADCAST and extra in joined:
        problem = f"the broadcast's root rank {extra} has joined"
    elif kind != STEP and int(first[DTYPE]) == len(DTYPES):
        problem = f"it mirrors tensors of known dtypes and at most {MAX_DIMS} dimensions"
    if problem:
        raise GradmeshError(
            f"rank {me}: {what}: rank {joined[0]} has joined, and a joined rank cannot take "
            f"part in rank {active[0]}'s {_said(first)}: {problem}"
        )
    return joined


def announce(kind: int, what: str, tensor: torch.Tensor | None = None, extra: int = 0) -> int:
    """Post this rank's header for the operation about to run on the global set (on the
    communication thread); returns how many ranks contribute to it (the others have joined)."""
    rt = get_runtime()
    if rt.size == 1:
        return 1
    table = _exchange(_header(kind, tensor, extra), what)
    return rt.size - len(_check(table, what))


def before(kind: int, what: str, extra: int = 0) -> Before:
    """The announcement of one operation on the tensor it sends, for the data-parallel API's
    `before`."""
    if kind == OTHER:
        extra = OTHERS.index(what) if what in OTHERS else 0
    return lambda tensor: announce(kind, what, tensor, extra)


def reduction(op: str) -> Before:
    return before(ALLREDUCE, "allreduce", OPS.index(op))


def announce_now(what: str) -> None:
    """Announce an operation a joined rank cannot take part in, and wait: one line on every
    rank if some rank has joined."""
    if get_runtime().size > 1:
        extra = OTHERS.index(what) if what in OTHERS else 0
        _api.submit(announce, OTHER, what, None, extra).result()


def announce_step() -> Future[Any]:
    """The reducer's `announce`: an optimizer step follows (it does not wait)."""
    return _api.submit(announce, STEP, "DistributedOptimizer step")


def register(optimizer: Any) -> None:
    """The optimizer a joined rank steps when the others announce a step."""
    _Join.optimizer = weakref.ref(optimizer)
    optimizer._gm.announce = announce_step if optimizer._gm.replicas > 1 else None


def forget() -> None:
    """At shutdown: no optimizer, no rounds."""
    _Join.rounds, _Join.optimizer = 0, None


def optimizer() -> Any:
    """The registered optimizer, if it is still alive."""
    return _Join.optimizer() if _Join.optimizer is not None else None


def _take_part(row: torch.Tensor) -> None:
    """A joined rank's side of the operation `row` announces (on the communication thread)."""
    group = get_runtime().async_group
    kind = int(row[KIND])
    shape = [int(n) for n in row[SHAPE : SHAPE + int(row[NDIM])]]
    dtype = DTYPES[int(row[DTYPE])]
    if kind == ALLREDUCE:
        allreduce(
            torch.zeros(shape, dtype=dtype, device=get_runtime().device), "sum", "native", group
        )
    elif kind == ALLGATHER:
        rows = torch.zeros((0, *shape[1:]), dtype=dtype, device=get_runtime().device)
        _api.allgather_tensor(rows, group)
    elif kind == BROADCAST:
        broadcast(
            torch.zeros(shape, dtype=dtype, device=get_runtime().device), int(row[EXTRA]), group
        )


def join() -> int:
    """Take part in the other ranks' operations until every rank has joined; the last rank to
    join (the highest of those that joined last)."""
    rt = get_runtime()
    if rt.size == 1:
        return rt.rank
    entered = _Join.rounds
    what = "join"
    while True:
        table = _api.submit(_exchange, _header(JOINED, extra=entered), what).result()
        joined = _check(table, what)
        if len(joined) == rt.size:
            return max(joined, key=lambda r: (int(table[r, EXTRA]), r))
        row = table[next(r for r in range(rt.size) if r not in joined)]
        if int(row[KIND]) != STEP:
            _api.submit(_take_part, row).result()
            continue
        stepping = optimizer()
        if stepping is None:
            raise GradmeshError(
                f"rank {rt.rank}: join: the others step a DistributedOptimizer this rank has not "
                "made"
            )
        stepping.join_step()
