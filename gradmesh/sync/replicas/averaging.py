"""The gradients' average across replica groups, through any of gradmesh's compressors.

The slow link of a replica-group job is the one between groups (the point of HSDP and of
DiLoCo: groups sit in different racks or sites), so `--compression` applies to this average
while a group's own data-parallel allreduce stays exact. Every compressor's `reduce` runs here
unchanged over `QuorumLink`, the quorum's own Gloo process group (made outside torch.distributed's
world, so gradmesh's checked collectives, which name ranks of that world, do not apply).

Every member group decodes the same messages in the same order, so all of them apply the same
average and stay bit-equal. What a compressor keeps between steps (error feedback's residual) is
this group's own: a group that rejoins starts with none. A step that is not committed leaves it
as it was before the step (`undo`), so the step taken again sends what the first try would
have. What a compressor keeps that is the same in every member (PowerSGD's Q, summed over the
members each step) is part of the state a joining group copies (`shared`, `load_shared`): its
first P then starts from the others' warm Q, not the seeded one of step 0. (The members decode
the same average either way, since P and Q are both summed.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives.flat import flat_buffers, unpack
from gradmesh.compression.base import (
    Compressor,
    Link,
    NoCompression,
    State,
    load_states,
    save_states,
)
from gradmesh.compression.registry import reduce

REDUCE_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class QuorumLink(Link):
    """A compressor's link over the quorum's raw Gloo process group `pg`; `sent` counts the
    bytes this rank put on the wire (Gloo's ring allreduce: 2(n-1)/n of the message; an
    allgather: n-1 messages)."""

    pg: Any = None
    sent: int = 0

    @property
    def size(self) -> int:
        return int(self.pg.size())

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.payload_bytes += nbytes
        self.sent += 2 * (self.size - 1) * nbytes // self.size
        options = dist.AllreduceOptions()
        options.reduceOp = REDUCE_OPS[op]
        self.pg.allreduce([tensor], options).wait()
        return tensor

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.payload_bytes += nbytes
        self.sent += (self.size - 1) * nbytes
        rows = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.allgather([rows], [tensor]).wait()
        return torch.stack(rows)


class CrossGroupAverage:
    """Averages a group's gradients over the quorum with one compressor (see the docstring)."""

    def __init__(self, compressor: Compressor | None = None) -> None:
        self.compressor = compressor or NoCompression()
        self.states: dict[str, State] = {}
        self._before: dict[str, Any] | None = None

    def __call__(self, pg: Any, tensors: list[torch.Tensor]) -> int:
        """Average `tensors` in place over `pg`'s members; the bytes this rank sent. Raises
        RuntimeError where a member is lost mid-way."""
        buckets = flat_buffers(tensors)
        for i, (flat, _) in enumerate(buckets):
            if str(i) not in self.states:
                self.states[str(i)] = self.compressor.new_state(flat.numel())
        self._before = save_states(self.states)
        link = QuorumLink(pg=pg)
        with torch.no_grad():
            for i, (flat, members) in enumerate(buckets):
                reduce(flat, self.compressor, self.states[str(i)], link)
                flat.div_(link.size)
                unpack(flat, members)
        return link.sent

    def shared(self) -> dict[str, Any]:
        """The compressor state every member holds alike: all of it but error feedback's
        residual (PowerSGD's Q; nothing for the others), for a group that joins."""
        return {
            name: {
                **{k: v for k, v in state.state_dict().items() if k != "tensors"},
                "tensors": {k: v.clone() for k, v in state.tensors.items() if k != "residual"},
            }
            for name, state in self.states.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """All of it, this group's residual included (its checkpoint)."""
        return save_states(self.states)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.load_shared({})
        for name, entry in saved.items():
            self.states[name] = self.compressor.new_state(int(entry["numel"]))
        load_states(self.states, saved)

    def load_shared(self, saved: dict[str, Any]) -> None:
        """Take `shared()` of the group copied from; this group's own residual starts afresh."""
        self.states = {}
        for name, entry in saved.items():
            self.states[name] = self.compressor.new_state(int(entry["numel"]))
            self.states[name].load_state_dict(entry)
        self._before = None

    def committed(self) -> None:
        """The step's average stands: a later abort has nothing of it to undo (a step a group
        took alone, with no average, must not undo the one before)."""
        self._before = None

    def undo(self) -> None:
        """Put the compressor's state back where it stood before the last average."""
        if self._before is not None:
            load_states(self.states, self._before)
            self._before = None
