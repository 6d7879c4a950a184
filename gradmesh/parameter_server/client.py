"""The worker's side: one DEALER socket per server, the flat parameter vector split into the
servers' shards, and the init / push / pull / finish requests.

Shards are contiguous ranges of the flattened float32 parameters, balanced by bytes: a tensor
larger than a fair share is simply split across servers (`shard_ranges`).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import zmq

from gradmesh.compression import Compressor, NoCompression
from gradmesh.errors import GradmeshError
from gradmesh.parameter_server.protocol import Kind, Message, WireError, decode, encode
from gradmesh.runtime import get_runtime, is_initialized
from gradmesh.timeline import span

FINISH_PATIENCE = 10
"""finish waits for the slowest worker: this many times the request timeout."""
CLOSE_LINGER_MS = 1000


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
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context()
        self.socks = []
        for endpoint in endpoints:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.socks.append(sock)
        self.clock = 0
        self.staleness = 0
        self.versions = [0] * len(endpoints)
        """The servers' versions (updates applied) at the last pull."""
        self.bytes_sent = 0
        self.compressor = None if isinstance(compressor, NoCompression) else compressor
        """Pushes travel compressed (a state per shard); pulls and init travel as they are."""
        self.states = [self.compressor.new_state(b - a) for a, b in self.ranges if self.compressor]

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=CLOSE_LINGER_MS)  # let a CLOSE already queued go out
        self.ctx.term()

    def _roundtrip(self, op: str, *requests: list[list[bytes | memoryview]]) -> list[Message]:
        """Send each request to every server (all of them before any answer is awaited), then
        collect the answers: one per server per request, in order."""
        for frames in requests:
            for sock, parts in zip(self.socks, frames, strict=True):
                self.bytes_sent += sum(memoryview(p).nbytes for p in parts)
                sock.send_multipart(parts, copy=False)
        replies = []
        for server, sock in [(i, s) for _ in requests for i, s in enumerate(self.socks)]:
            if not sock.poll(self.timeout_ms):
                raise GradmeshError(
                    f"ps worker {self.worker}: {op} got no answer from server {server} "
                    f"in {self.timeout_ms / 1000:.0f} s"
                )
            raw = sock.recv_multipart(copy=False)
            try:
                replies.append(decode([f.buffer for f in raw], self.token, 1 << 40))
            except WireError as exc:
                raise GradmeshError(
                    f"ps worker {self.worker}: {op}: bad answer from server {server}: {exc}"
                ) from None
        return replies

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
            replies = self._roundtrip("pull", [pull] * len(self.socks))
        else:  # one message each way per server: the gradient, answered by the values
            self.clock += 1
            replies = self._roundtrip("push and pull", self._per_shard(Kind.PUSH_PULL, push))
        with torch.no_grad():
            for (a, b), reply in zip(self.ranges, replies, strict=True):
                if reply.payload is None or reply.payload.numel() != b - a:
                    raise GradmeshError(f"ps worker {self.worker}: pull: a shard of wrong size")
                flat[a:b].copy_(reply.payload)
        self.staleness = max(r.staleness for r in replies)
        self.versions = [r.seen for r in replies]
        return self.staleness

    def save(self) -> None:
        """Ask every server to write its part of the checkpoint after this worker's step
        (`clock`: sync mode only) and wait until each has."""
        self._roundtrip(
            "save", [encode(Kind.SAVE, self.token, self.worker, clock=self.clock)] * len(self.socks)
        )

    def finish(self, stats: dict[str, Any]) -> list[dict[str, Any]]:
        """Say this worker is done; wait until every live worker is; return each server's
        summary."""
        data = json.dumps(stats).encode()
        request = encode(Kind.FINISH, self.token, self.worker, clock=self.clock, data=data)
        patience, self.timeout_ms = self.timeout_ms, self.timeout_ms * FINISH_PATIENCE
        try:
            replies = self._roundtrip("finish", [request] * len(self.socks))
        finally:
            self.timeout_ms = patience
        return [json.loads(bytes(r.raw or b"{}")) for r in replies]

    def close_servers(self) -> None:
        """Tell every server to stop (after the final pull)."""
        request = encode(Kind.CLOSE, self.token, self.worker)
        for sock in self.socks:
            sock.send_multipart(request, copy=False)
