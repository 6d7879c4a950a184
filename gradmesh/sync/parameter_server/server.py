"""One parameter server: owns a contiguous shard of the flat parameter vector and its optimizer.

A single-threaded loop over the workers' TCP connections (`transport`). Every message is checked
by `protocol.decode`; one that fails is dropped and counted, and the loop serves on (a header that
fails closes its connection: the stream cannot be followed past it). Modes:

- `sync`: the gradients of step t from every live worker are averaged (summed in worker order, so
  the result does not depend on their arrival) and applied once; a worker's pull for step t + 1
  is answered after that update. Only this mode checkpoints: at step t the first worker asks
  (SAVE) for the shard's part after update t, before its own gradient of step t + 1, so no
  later update can be in it.
- `async` (Downpour): each gradient is applied as it arrives; pulls are answered at once.
- `ssp`: as async, but a pull from a worker whose clock (pushes so far) is more than K ahead of the
  slowest live worker's waits until that worker catches up.

Staleness of a gradient = the clock gap of the read it was computed from: how many clocks the
reading worker was ahead of the slowest live worker (SSP's own measure, at most K in `ssp`, 0 in
`sync`). With `staleness_lr` a gradient's step is divided by max(1, staleness) (Zhang et al.).
A worker silent for `lost_after_s` with no request waiting (or, before its first message, for
`timeout_s`) is declared lost and no longer waited for; its last gradients stay applied. One
that speaks again is readmitted (`membership`).

The path of a request allocates nothing per message after warm-up: a push is read into a buffer
its connection reuses (`transport`), SGD updates the shard in place, a sync step copies each
gradient into a buffer kept per worker and sums into one reused buffer, and a pull's answer is
written to the kernel from the shard itself (only what the kernel does not take at once is copied,
into a reused buffer, before the shard can change).
"""

from __future__ import annotations

import json
import selectors
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import Timeline
from gradmesh.sync.parameter_server.membership import Membership
from gradmesh.sync.parameter_server.optimizers import make_optimizer
from gradmesh.sync.parameter_server.protocol import Kind, Message, WireError, decode, encode
from gradmesh.sync.parameter_server.serving import (
    PUSHES,
    REQUESTS,
    Progress,
    ServerConfig,
    ServerStats,
    ShardCheckpoints,
    check_request,
    decompress,
)
from gradmesh.sync.parameter_server.transport import Closed, Peer, endpoint_of, listen

JSON_LIMIT = 1 << 16
POLL_S = 0.05


class Server:
    """Serve one shard until the workers are done (see the module docstring)."""

    def __init__(
        self,
        config: ServerConfig,
        token: bytes,
        host: str,
        checkpoints: ShardCheckpoints | None = None,
        on_update: Callable[[int, int], None] | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        """`on_update(index, version)` runs after every update (fault injection); `timeline`
        records each push, apply and pull (with the staleness of the gradient or read)."""
        self.cfg = config
        self.timeline = timeline
        self.progress: Progress | None = None
        self.checkpoints = checkpoints
        self.on_update = on_update
        self.token = token
        self.values = nn.Parameter(torch.zeros(config.numel, device="cpu"), requires_grad=True)
        self.optimizer = make_optimizer(
            config.ps.server_optimizer, self.values, config.lr, config.momentum, config.weight_decay
        )
        self.max_payload = max(config.numel * 4, JSON_LIMIT)
        self.listener = listen(host)
        self.endpoint = endpoint_of(self.listener)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.stats = ServerStats()
        self.initialized = False
        self.version = 0
        self.clocks = [0] * config.workers
        self.read_gap = [0] * config.workers
        self.members = Membership(
            config.workers, config.ps.lost_after_s, config.timeout_s, config.ps.mode == "sync"
        )
        self.finished: dict[int, dict[str, Any]] = {}
        self.pending_pulls: list[tuple[Peer, Message]] = []
        self.pending_done: list[tuple[Peer, int]] = []
        self.round: dict[int, torch.Tensor] = {}
        """sync: the gradients of the step under way, by worker (in `held`)."""
        self.held: dict[int, torch.Tensor] = {}
        """sync: a buffer per worker its gradient is copied into (the connection's is reused)."""
        self.total = torch.empty(config.numel if config.ps.mode == "sync" else 0, device="cpu")
        """sync: the step's sum, reused."""
        self.summary: bytes | None = None
        """DONE's summary, once every live worker has finished (it names the reporter)."""
        self.done_to: list[Peer] = []
        """The connections DONE was sent on: the job ends once they have all closed."""
        self.closed = False
        self.active_at = 0.0  # when it last received a message or sent DONE

    # -- the loop ---------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Run until a CLOSE after DONE (the reporter's, after its final pull), every
        connection DONE went on closed (the reporter died; servers may name different ones), or
        nothing happening for `timeout_s`; return this server's stats."""
        self.active_at = time.monotonic()
        if self.cfg.index == 0 and sys.stderr.isatty():
            self.progress = Progress(self.stats)
        try:
            while not self.closed:
                events = self.selector.select(POLL_S)
                if events:
                    self.active_at = time.monotonic()
                    self._wakeup(events)
                now = time.monotonic()
                self._find_lost(now)
                self._release_pulls()
                self._maybe_done()
                if now - self.active_at > self.cfg.timeout_s:
                    break
        finally:
            self.close()
            if self.progress is not None:
                self.progress.close()
        return self.stats.as_dict(self.cfg.index, sorted(self.members.lost))

    def close(self) -> None:
        """Close the listening socket and every connection."""
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()

    def _wakeup(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        handled = 0
        for key, mask in events:
            if key.fileobj is self.listener:
                self._accept()
                continue
            peer: Peer = key.data
            try:
                if mask & selectors.EVENT_WRITE and peer.flush():
                    self.selector.modify(peer.sock, selectors.EVENT_READ, peer)
                if mask & selectors.EVENT_READ:
                    while (frames := peer.receive()) is not None:
                        handled += 1
                        self._handle(peer, frames)
            except WireError:  # a header that fails: the rest of the stream cannot be read
                self.stats.dropped += 1
                self._disconnect(peer)
            except Closed:
                self.stats.dropped += peer.partial  # a message cut off by the close
                self._disconnect(peer)
        self.stats.wakeups += 1
        self.stats.depth_sum += handled
        self.stats.depth_max = max(self.stats.depth_max, handled)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            peer = Peer(sock, self.token, self.max_payload)
            self.selector.register(sock, selectors.EVENT_READ, peer)

    def _disconnect(self, peer: Peer) -> None:
        if peer.sock.fileno() >= 0:
            self.selector.unregister(peer.sock)
            peer.close()
        if self.done_to and all(p.sock.fileno() < 0 for p in self.done_to):
            self.closed = True
        self.pending_pulls = [(p, m) for p, m in self.pending_pulls if p is not peer]
        self.pending_done = [(p, w) for p, w in self.pending_done if p is not peer]

    def _send(self, peer: Peer, frames: list[bytes | memoryview], volatile: bool = False) -> None:
        if peer.sock.fileno() < 0:
            return  # its connection is gone
        self.stats.bytes_out += sum(memoryview(f).nbytes for f in frames)
        waiting = bool(peer.out)
        try:
            peer.send(frames, volatile)
        except Closed:
            self._disconnect(peer)
            return
        if peer.out and not waiting:
            self.selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)

    def _reply(self, peer: Peer, kind: Kind, worker: int, **fields: Any) -> None:
        self._send(peer, encode(kind, self.token, worker, **fields))

    def _handle(self, peer: Peer, frames: list[memoryview]) -> None:
        self.stats.bytes_in += sum(f.nbytes for f in frames)
        try:
            msg = self._check(decode(frames, self.token, self.max_payload))
        except WireError:
            self.stats.dropped += 1
            return
        now = time.monotonic()
        self.stats.first = self.stats.first or now
        self.stats.last = now
        self.stats.cpu_last = time.process_time()
        self.stats.cpu_first = self.stats.cpu_first or self.stats.cpu_last
        self.stats.requests.update(REQUESTS[msg.kind])
        msg, back = self.members.heard_from(msg, self.version, now)
        if back is not None:
            self._say(f"worker {msg.worker} is back after {back:.0f} s silent; waited for again")
        if msg.kind is Kind.INIT:
            if not self.initialized:
                with torch.no_grad():
                    self.values.copy_(msg.payload)  # type: ignore[arg-type]
                self.initialized = True
            self._reply(peer, Kind.ACK, msg.worker, seen=self.version)
        elif msg.kind is Kind.PUSH:
            self._push(msg)
            self._reply(peer, Kind.ACK, msg.worker, seen=self.version)
        elif msg.kind is Kind.PUSH_PULL:  # the step's one message: answered by the pull alone
            self._push(msg)
            self.pending_pulls.append((peer, msg))
        elif msg.kind is Kind.PULL:
            self.pending_pulls.append((peer, msg))
        elif msg.kind is Kind.FINISH:
            self.finished[msg.worker] = json.loads(bytes(msg.raw or b"{}"))
            self.pending_done.append((peer, msg.worker))
            self._close_round()  # sync: a round may have waited for this worker alone
        elif msg.kind is Kind.CLOSE:
            self.closed = self.summary is not None  # DONE was sent
        elif msg.kind is Kind.SAVE:
            assert self.checkpoints is not None
            self.checkpoints.save(self.cfg.index, msg.clock, self.state_dict())
            self._reply(peer, Kind.ACK, msg.worker, seen=self.version)

    def _check(self, msg: Message) -> Message:
        """`check_request`; a compressed push comes back decoded to a dense shard."""
        if msg.codec:
            if msg.kind not in PUSHES:
                raise WireError(f"{msg.kind.name} carries no codec")
            msg = replace(msg, payload=decompress(msg, self.cfg.numel))
            self.stats.decoded += 1
        return check_request(msg, self.cfg, self.initialized, self.checkpoints, self.version)

    # -- the modes --------------------------------------------------------------------------

    def _span(self, name: str, **args: Any) -> AbstractContextManager[None]:
        return self.timeline.span(name, "serve", **args) if self.timeline else nullcontext()

    def _live(self) -> list[int]:
        lost, done = self.members.lost, self.finished
        return [w for w in range(self.cfg.workers) if w not in lost and w not in done]

    def _push(self, msg: Message) -> None:
        grad = msg.payload
        assert grad is not None
        w = msg.worker
        self.clocks[w] = max(self.clocks[w], msg.clock)
        gap = self.read_gap[w]
        self.stats.staleness.setdefault(w, Counter())[gap] += 1
        if self.cfg.ps.mode == "sync":
            # the connection's buffer is read into again by its next message: keep a copy
            with self._span("push", worker=w):
                if w in self.round:
                    self.round[w] += grad
                else:
                    held = self.held.setdefault(w, torch.empty(self.cfg.numel, device="cpu"))
                    self.round[w] = held.copy_(grad)
            self._close_round()
            return
        scale = 1.0 / max(1, gap) if self.cfg.ps.staleness_lr else 1.0
        with self._span("apply", worker=w, staleness=gap):
            self.optimizer.apply(grad, w, scale)  # a view of the connection's buffer: unwritten
        self._updated()

    def _updated(self) -> None:
        self.version += 1
        if self.timeline is not None:
            self.timeline.new_step()
        if self.progress is not None:
            self.progress.update()
        if self.on_update is not None:
            self.on_update(self.cfg.index, self.version)

    def _close_round(self) -> None:
        """sync: once every live worker has pushed this step, apply their average."""
        if not self.round or not set(self._live()) <= set(self.round):
            return
        first, *rest = sorted(self.round)
        with self._span("apply", workers=len(self.round), staleness=0):
            total = self.total.copy_(self.round[first])
            for w in rest:
                total += self.round[w]
            self.optimizer.apply(total.div_(len(self.round)), -1, 1.0)
        self.round.clear()
        self._updated()

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The shard's part of a checkpoint, in the trainer's rank-file form."""
        return {
            "model": {"values": self.values.detach()},
            "optimizer": self.optimizer.state_dict(),
            "strategy": {"version": self.version},
            "rng": {"torch": torch.get_rng_state()},
            "progress": {},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resume from `state_dict()`'s output; a GradmeshError (before any change) when it is
        not a part of this shard."""
        values = saved["model"].get("values")
        version = saved["strategy"].get("version")
        if not isinstance(values, torch.Tensor) or values.shape != (self.cfg.numel,):
            raise GradmeshError(f"the shard's 'values' are not {self.cfg.numel} numbers")
        if values.dtype != torch.float32 or type(version) is not int or version < 0:
            raise GradmeshError("the shard's values are not float32 or its version not a count")
        self.optimizer.load_state_dict(saved["optimizer"])
        with torch.no_grad():
            self.values.copy_(values)
        self.version = version
        self.initialized = True

    def _may_read(self, msg: Message) -> bool:
        if not self.initialized:
            return False
        if self.cfg.ps.mode == "sync":
            return self.version >= msg.clock
        if self.cfg.ps.mode == "ssp":
            others = [self.clocks[w] for w in self._live() if w != msg.worker]
            return not others or msg.clock - min(others) <= self.cfg.ps.max_staleness
        return True

    def _release_pulls(self) -> None:
        waiting = []
        for peer, msg in self.pending_pulls:
            if not self._may_read(msg):
                waiting.append((peer, msg))
                continue
            others = [self.clocks[w] for w in self._live() if w != msg.worker]
            gap = max(0, msg.clock - min(others)) if others and self.cfg.ps.mode != "sync" else 0
            self.read_gap[msg.worker] = gap
            self.optimizer.on_read(msg.worker)
            with self._span("pull", worker=msg.worker, staleness=gap):
                frames = encode(
                    Kind.PARAMS,
                    self.token,
                    msg.worker,
                    seen=self.version,
                    staleness=gap,
                    tensor=self.values.detach(),
                )
                self._send(peer, frames, volatile=True)  # the shard changes with the next push
        self.pending_pulls = waiting

    def _say(self, what: str) -> None:
        print(f"gradmesh ps: server {self.cfg.index}: {what}", flush=True)

    def _find_lost(self, now: float) -> None:
        waiting = {msg.worker for _, msg in self.pending_pulls}
        for w, silent in self.members.find_lost(self._live(), waiting, now):
            self._say(f"worker {w} lost (silent for {silent:.0f} s)")
            self._close_round()  # sync: a round may have waited for this worker alone

    def _maybe_done(self) -> None:
        """Once every live worker has finished, answer each FINISH with DONE and the summary;
        a FINISH after that (a worker declared lost that came back) is answered at once."""
        if not self.pending_done or (self.summary is None and self._live()):
            return
        if self.summary is None:
            lost = sorted(self.members.lost)
            summary = {
                "reporter": min(w for _, w in self.pending_done),
                "lost_workers": lost,
                "readmitted_workers": self.members.readmitted,
                "workers": {str(w): s for w, s in sorted(self.finished.items())},
                "server": self.stats.as_dict(self.cfg.index, lost),
            }
            self.summary = json.dumps(summary).encode()
            self.active_at = time.monotonic()  # the reporter's final pull gets all of timeout_s
        done, self.pending_done = self.pending_done, []
        self.done_to += [peer for peer, _ in done]  # all of them before a failed reply counts
        for peer, w in done:
            self._reply(peer, Kind.DONE, w, data=self.summary)
