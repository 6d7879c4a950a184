"""Every collective call checks, before any of its data moves, that all ranks came to the same call.

A call's signature is its sequence number on the group, a digest of the operation (and the name
the caller gave it, Horovod style), the dtype and the shape. Each rank posts its signature as a
small asynchronous all-gather on the call's group; the data moves only after every rank's row
has arrived and all rows agree. That order matters: Gloo aborts the whole process ("Received data
size doesn't match expected size") when a peer's message is longer than the buffer posted for it,
so a mismatch must be found before the data is sent.

The exchange is one small round trip before the data (about 0.3 ms on this machine's loopback).
The training step's hot path does not pay it: a DistributedOptimizer's buckets go on a process
group of their own (`FixedLayout`), whose only calls are those buckets, in a layout checked once
when the optimizer first reduces, so each of its calls agrees by construction.

A mismatch is a `PeerFailure` that names every rank's signature and the call's sequence number;
a rank that never comes is one that names the ranks waited for, after the group's timeout.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from gradmesh.errors import PeerFailure, first_line
from gradmesh.runtime.compat import all_gather_single
from gradmesh.runtime.world import Runtime

MAX_DIMS = 5
"""Dimensions carried one by one; a tensor with more is described by its element count."""
_HEADER = 5  # sequence, operation digest, dtype code, number of dimensions, element count
WIDTH = _HEADER + MAX_DIMS

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def dtype_name(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "other"


def encode(sequence: int, what: str, tensor: torch.Tensor) -> list[int]:
    """The signature row of one call: `what` is the operation and the caller's name for it."""
    shape = list(tensor.shape)
    code = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1
    dims = shape[:MAX_DIMS] + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
    return [sequence, zlib.crc32(what.encode()), code, len(shape), tensor.numel(), *dims]


def describe(row: list[int], first: list[int], first_rank: int) -> str:
    """'call #7 of 2x3 float32', from a signature row, saying whether its operation (or name)
    differs from the lowest rank's row `first`: every rank words the mismatch alike."""
    sequence, digest, code, ndim, numel = row[:_HEADER]
    shape = (
        "x".join(str(d) for d in row[_HEADER : _HEADER + ndim]) or "scalar"
        if ndim <= MAX_DIMS
        else f"{ndim}-d with {numel} elements"
    )
    other = "" if digest == first[1] else f", another operation or name than rank {first_rank}"
    return f"call #{sequence} of {shape} {dtype_name(code)}{other}"


class Check(Protocol):
    """What `run_collective` needs of a call's agreement check."""

    label: str

    def wait(self) -> None: ...


@dataclass
class FixedLayout:
    """A call on a group reserved for one stream of calls whose layout is fixed and was checked
    once (a DistributedOptimizer's buckets): every call on it agrees by construction, so it
    needs no exchange. The call still takes its sequence number, for messages."""

    label: str

    @classmethod
    def post(cls, rt: Runtime, group: dist.ProcessGroup, operation: str) -> FixedLayout:
        return cls(f"{operation} #{rt.next_sequence(group)} on {rt.group_label(group)}")

    def wait(self) -> None:
        return None


@dataclass
class PendingCheck:
    """One call's posted signature exchange; `wait()` before the call's data moves."""

    rt: Runtime
    group: dist.ProcessGroup
    label: str
    """'ring allreduce #12 on world': the operation and its sequence number, for messages."""
    mine: list[int]
    rows: torch.Tensor
    work: dist.Work | None

    @classmethod
    def post(
        cls,
        rt: Runtime,
        group: dist.ProcessGroup,
        operation: str,
        tensor: torch.Tensor,
        name: str | None = None,
    ) -> PendingCheck:
        """Take the call's sequence number on `group` and start exchanging signatures."""
        sequence = rt.next_sequence(group)
        label = f"{operation} #{sequence} on {rt.group_label(group)}"
        mine = encode(sequence, f"{operation}\0{name or ''}", tensor)
        p = dist.get_world_size(group)
        rows = torch.empty(p * WIDTH, dtype=torch.int64, device=rt.device)
        own = torch.tensor(mine, dtype=torch.int64, device=rt.device)
        try:
            work = all_gather_single(rows, own, group=group, async_op=True)
        except RuntimeError as exc:
            raise PeerFailure(f"rank {rt.rank}: {label}: {first_line(exc)}") from None
        return cls(rt, group, label, mine, rows, work)

    def peers(self) -> str:
        others = [r for r in dist.get_process_group_ranks(self.group) if r != self.rt.rank]
        return ", ".join(str(r) for r in others)

    def wait(self) -> None:
        """Return once every rank brought the same call; raise `PeerFailure` otherwise."""
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            work.wait(self.rt.timeout)
        except RuntimeError as exc:
            raise PeerFailure(
                f"rank {self.rt.rank}: {self.label}: rank(s) {self.peers()} did not join the "
                f"call (timeout {self.rt.timeout.total_seconds():g} s): {first_line(exc)}"
            ) from None
        rows = self.rows.view(-1, WIDTH).tolist()
        if any(row != self.mine for row in rows):
            ranks = dist.get_process_group_ranks(self.group)
            which = ", ".join(
                f"rank {ranks[i]} has {describe(row, rows[0], ranks[0])}"
                for i, row in enumerate(rows)
            )
            raise PeerFailure(f"rank {self.rt.rank}: {self.label}: ranks disagree: {which}")
