"""The point-to-point machinery every gradmesh collective is written on.

A `Channel` is one collective call's view of a process group: group-local peer indices, tagged
non-blocking send and receive straight on the backend's ProcessGroup (Gloo or NCCL), a count of
the bytes this rank sent, and waits that turn a dead or silent peer into a one-line error that
names this rank, the operation and the peer. Scratch buffers come from the runtime's workspace
and are reused across calls, so the hot path allocates nothing message-sized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradmesh.errors import PeerFailure, first_line
from gradmesh.runtime.world import Runtime, resolve_world


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group object itself (the default group for None)."""
    return group if group is not None else resolve_world()


@dataclass
class Channel:
    """Tagged point-to-point messages among the members of one process group."""

    rt: Runtime
    group: dist.ProcessGroup
    operation: str
    """What is running, for error messages: 'ring allreduce #3 on world', ..."""
    reduce: str = "sum"
    """The reduction an allreduce on this channel applies: sum, min, max or product."""
    sent: int = 0
    """Bytes this rank has sent on this channel."""
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranks = dist.get_process_group_ranks(self.group)
        self.index = self.ranks.index(self.rt.rank)
        self.size = len(self.ranks)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        """Start sending `tensor` to group index `peer`."""
        self.sent += tensor.numel() * tensor.element_size()
        try:
            return self.group.send([tensor], peer, tag)
        except RuntimeError as exc:
            raise self._error("send to", peer, exc) from None

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        """Start receiving into `tensor` from group index `peer`."""
        try:
            return self.group.recv([tensor], peer, tag)
        except RuntimeError as exc:
            raise self._error("receive from", peer, exc) from None

    def wait(self, work: dist.Work, peer: int, what: str) -> None:
        """Wait for one send or receive; a failure or timeout names the peer."""
        try:
            work.wait(self.rt.timeout)
        except RuntimeError as exc:
            raise self._error(what, peer, exc) from None

    def backend_collective(self, issue: Callable[[], dist.Work]) -> None:
        """Issue one of the backend's own collectives on the whole group (`issue` starts it
        asynchronously) and wait for it within the timeout."""
        try:
            issue().wait(self.rt.timeout)
        except RuntimeError as exc:  # the backend does not say which peer failed
            others = ", ".join(str(r) for r in self.ranks if r != self.rt.rank)
            raise PeerFailure(
                f"rank {self.rt.rank}: {self.operation}: waiting for rank(s) {others} failed: "
                f"{first_line(exc)}"
            ) from None

    def combine(self, into: torch.Tensor, incoming: torch.Tensor) -> None:
        """`into` = `into` (reduce) `incoming`, in place: every algorithm's reduction step."""
        if self.reduce == "sum":
            into.add_(incoming)
        elif self.reduce == "product":
            into.mul_(incoming)
        elif self.reduce == "min":
            torch.minimum(into, incoming, out=into)
        else:
            torch.maximum(into, incoming, out=into)

    def exchange(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int = 0
    ) -> None:
        """Send to `dst` while receiving from `src`, and wait for both."""
        rwork = self.irecv(recv, src, tag) if recv.numel() else None
        swork = self.isend(send, dst, tag) if send.numel() else None
        if rwork is not None:
            self.wait(rwork, src, "receive from")
        if swork is not None:
            self.wait(swork, dst, "send to")

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        if tensor.numel():
            self.wait(self.isend(tensor, peer, tag), peer, "send to")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        if tensor.numel():
            self.wait(self.irecv(tensor, peer, tag), peer, "receive from")

    def scratch(self, like: torch.Tensor, numel: int, slot: int = 0) -> torch.Tensor:
        """A reusable flat buffer of `numel` elements of `like`'s dtype and device."""
        key = (id(self.group), like.dtype, like.device, slot)
        buf = self.rt.workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self.rt.workspace[key] = buf
        return buf[:numel]

    def _error(self, what: str, peer: int, exc: BaseException) -> PeerFailure:
        return PeerFailure(
            f"rank {self.rt.rank}: {self.operation}: {what} rank {self.ranks[peer]} failed: "
            f"{first_line(exc)}"
        )
