"""The worker's side: one connection per server (`transport`), the flat parameter vector split into
the servers' shards, and the init / push / pull / finish requests. A request's shards are written
to the servers in turn and the answers read as they come (a selector over the connections), so
the first answers come back while later shards still go out; a pull's values are read straight
into the parameters.

Shards are contiguous ranges of the flattened float32 parameters, balanced by bytes: a tensor
larger than a fair share is simply split across servers (`shard_ranges`).
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import time
from typing import Any

import torch

from gradmesh.compression.base import Compressor, NoCompression
from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import span
from gradmesh.runtime.world import get_runtime, is_initialized
from gradmesh.sync.parameter_server.protocol import Kind, Message, WireError, decode, encode
from gradmesh.sync.parameter_server.transport import Closed, Peer, connect

FINISH_PATIENCE = 10
"""finish waits for the slowest worker: this many times the request timeout."""
PIPELINE_SLICES = 8
"""With several servers, the kernel holds at most an eighth of a shard unsent (but at least
PIPELINE_MIN_BYTES), so the shards leave in turn (`TCP_NOTSENT_LOWAT`)."""
PIPELINE_MIN_BYTES = 16 << 10
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
"""Linux's option number where this Python does not name it."""
JSON_REPLY_LIMIT = 16 << 20
"""The largest answer a worker reads is its largest shard or a JSON summary of at most this."""


def shard_ranges(numel: int, servers: int) -> list[tuple[int, int]]:
    """`servers` contiguous [start, end) ranges covering `numel` elements, sizes differing by at
    most one."""
    if servers < 1:
        raise GradmeshError(f"--servers must be >= 1, got {servers}")
    if numel < servers:
        raise GradmeshError(f"{numel} parameters cannot be split over {servers} servers")
    cuts = [numel * i // servers for i in range(servers + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class Client:
    """Requests of worker `worker` to every server, each answered before the next."""

    def __init__(
        self,
        endpoints: list[str],
        token: bytes,
        worker: int,
        numel: int,
        timeout_s: float,
        compressor: Compressor | None = None,
    ) -> None:
        self.token = token
        self.worker = worker
        self.ranges = shard_ranges(numel, len(endpoints))
        self.timeout_s = timeout_s
        self.reply_bound = max(max(b - a for a, b in self.ranges) * 4, JSON_REPLY_LIMIT)
        self.peers = []
        try:
            for server, endpoint in enumerate(endpoints):
                try:
                    sock = connect(endpoint, timeout_s)
                except OSError as exc:
                    raise GradmeshError(
                        f"ps worker {worker}: cannot reach server {server} at {endpoint}: {exc}"
                    ) from None
                if len(endpoints) > 1:  # shards are written in turn (`_roundtrip`)
                    unsent = max(PIPELINE_MIN_BYTES, numel * 4 // len(endpoints) // PIPELINE_SLICES)
                    sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, unsent)
                self.peers.append(Peer(sock, token, self.reply_bound))
        except GradmeshError:
            self.close()
            raise
        self.selector = selectors.DefaultSelector()
        for server, peer in enumerate(self.peers):
            self.selector.register(peer.sock, selectors.EVENT_READ, server)
        self.clock = 0
        self.staleness = 0
        self.versions = [0] * len(endpoints)
        """The servers' versions (updates applied) at the last pull."""
        self.bytes_sent = 0
        self.compressor = None if isinstance(compressor, NoCompression) else compressor
        """Pushes travel compressed (a state per shard); pulls and init travel as they are."""
        self.states = [self.compressor.new_state(b - a) for a, b in self.ranges if self.compressor]

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        if hasattr(self, "selector"):
            self.selector.close()

    def _roundtrip(
        self,
        op: str,
        requests: list[list[bytes | memoryview]],
        into: torch.Tensor | None = None,
    ) -> list[Message]:
        """Send each server its request and collect the answers, one per server, in server
        order. Requests are written one after the other, each whole before the next begins (the
        kernel holds little unsent, `PIPELINE_SLICES`), so the first server's answer can come
        back while later shards still go out. With `into` (contiguous), answers of the right
        length are read straight into its shard ranges."""
        targets = self._targets(into)
        replies: list[Message | None] = [None] * len(self.peers)
        self.bytes_sent += sum(memoryview(f).nbytes for frames in requests for f in frames)
        order = iter(range(len(self.peers)))
        writing: int | None = None  # the server whose request is being written

        def write() -> None:
            nonlocal writing
            while True:
                if writing is None:
                    writing = next(order, None)
                    if writing is None:
                        return
                    peer = self.peers[writing]
                    self._guard(op, writing, peer.send, requests[writing])
                    if peer.out:
                        both = selectors.EVENT_READ | selectors.EVENT_WRITE
                        self.selector.modify(peer.sock, both, writing)
                        return
                elif self._guard(op, writing, self.peers[writing].flush):
                    self.selector.modify(self.peers[writing].sock, selectors.EVENT_READ, writing)
                else:
                    return
                writing = None

        write()
        deadline = time.monotonic() + self.timeout_s
        waiting = len(self.peers)
        while waiting:
            events = self.selector.select(max(0.0, deadline - time.monotonic()))
            if not events:
                late = next(i for i, r in enumerate(replies) if r is None)
                raise GradmeshError(
                    f"ps worker {self.worker}: {op} got no answer from server {late} "
                    f"in {self.timeout_s:.0f} s"
                )
            for key, mask in events:
                server = key.data
                peer = self.peers[server]
                if mask & selectors.EVENT_WRITE:
                    write()
                if mask & selectors.EVENT_READ and replies[server] is None:
                    frames = self._guard(op, server, peer.receive, targets[server])
                    if frames is not None:
                        replies[server] = self._guard(
                            op, server, decode, frames, self.token, self.reply_bound
                        )
                        waiting -= 1
        return replies  # type: ignore[return-value]

    def _targets(self, into: torch.Tensor | None) -> list[memoryview | None]:
        """Where each server's answer is read to: its shard range of `into` (contiguous
        float32), else a buffer of the connection's own."""
        if into is None or not into.is_contiguous() or into.dtype != torch.float32:
            return [None] * len(self.peers)
        raw = memoryview(into.detach().view(torch.uint8).numpy())  # type: ignore[arg-type]
        return [raw[a * 4 : b * 4] for a, b in self.ranges]

    def _guard(self, op: str, server: int, call: Any, *args: Any) -> Any:
        """`call(*args)` on server `server`'s connection, its failures as one line."""
        try:
            return call(*args)
        except Closed as exc:
            raise GradmeshError(
                f"ps worker {self.worker}: {op}: server {server} closed the connection ({exc})"
            ) from None
        except WireError as exc:
            raise GradmeshError(
                f"ps worker {self.worker}: {op}: bad answer from server {server}: {exc}"
            ) from None

    def _per_shard(self, kind: Kind, flat: torch.Tensor) -> list[list[bytes | memoryview]]:
        if kind not in (Kind.PUSH, Kind.PUSH_PULL) or self.compressor is None:
            return [
                encode(kind, self.token, self.worker, clock=self.clock, tensor=flat[a:b])
                for a, b in self.ranges
            ]
        frames = []
        for (a, b), state in zip(self.ranges, self.states, strict=True):
            with span("compress", "comm", compressor=self.compressor.name):
                payload, ctx = self.compressor.encode(flat[a:b], state)
            if is_initialized():
                get_runtime().comm.add_compressed("sync", (b - a) * 4, payload.numel())
            frames.append(
                encode(
                    kind,
                    self.token,
                    self.worker,
                    clock=self.clock,
                    tensor=payload,
                    codec=self.compressor.wire_id,
                    ctx=ctx,
                )
            )
        return frames

    def init(self, flat: torch.Tensor) -> None:
        """Offer the initial values (the servers keep the first they get)."""
        self._roundtrip("init", self._per_shard(Kind.INIT, flat))

    def push(self, grad: torch.Tensor) -> None:
        self.clock += 1
        self._roundtrip("push", self._per_shard(Kind.PUSH, grad))

    def pull(self, flat: torch.Tensor, push: torch.Tensor | None = None) -> int:
        """Fill `flat` with the servers' values (once the mode allows); return the staleness.
        With `push`, one PUSH_PULL per server carries that gradient and asks for the values
        after it is applied (in sync, after its step's update)."""
        if push is None:
            pull = encode(Kind.PULL, self.token, self.worker, clock=self.clock)
            replies = self._roundtrip("pull", [pull] * len(self.peers), into=flat)
        else:  # one message each way per server: the gradient, answered by the values
            self.clock += 1
            requests = self._per_shard(Kind.PUSH_PULL, push)
            replies = self._roundtrip("push and pull", requests, into=flat)
        with torch.no_grad():
            for (a, b), reply in zip(self.ranges, replies, strict=True):
                shard = flat[a:b]
                if reply.payload is None or reply.payload.numel() != b - a:
                    raise GradmeshError(f"ps worker {self.worker}: pull: a shard of wrong size")
                if reply.payload.data_ptr() != shard.data_ptr():  # not read in place
                    shard.copy_(reply.payload)
        self.staleness = max(r.staleness for r in replies)
        self.versions = [r.seen for r in replies]
        return self.staleness

    def save(self) -> None:
        """Ask every server to write its part of the checkpoint after this worker's step
        (`clock`: sync mode only) and wait until each has."""
        self._roundtrip(
            "save", [encode(Kind.SAVE, self.token, self.worker, clock=self.clock)] * len(self.peers)
        )

    def finish(self, stats: dict[str, Any]) -> list[dict[str, Any]]:
        """Say this worker is done; wait until every live worker is; return each server's
        summary."""
        data = json.dumps(stats).encode()
        request = encode(Kind.FINISH, self.token, self.worker, clock=self.clock, data=data)
        patience, self.timeout_s = self.timeout_s, self.timeout_s * FINISH_PATIENCE
        try:
            replies = self._roundtrip("finish", [request] * len(self.peers))
        finally:
            self.timeout_s = patience
        return [json.loads(bytes(r.raw or b"{}")) for r in replies]

    def close_servers(self) -> None:
        """Tell every server to stop (after the final pull)."""
        request = encode(Kind.CLOSE, self.token, self.worker)
        for peer in self.peers:
            peer.sock.setblocking(True)  # a few bytes, written before the connection closes
            with contextlib.suppress(OSError):  # that server is gone already
                peer.sock.sendall(b"".join(request))
