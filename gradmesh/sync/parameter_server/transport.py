"""The parameter-server transport: one TCP connection per worker and server, each message its
fixed header then the body whose length the header gives (`protocol`), read and written by
non-blocking sockets from the thread that serves them.

Written here rather than kept on ZeroMQ (which ps-lite uses, and this project did until the
server's CPU was measured, `gradmesh bench ps --micro`): libzmq receives every message into a
buffer it allocates for that message and sends from its own I/O thread, so each 0.5 MB push+pull
cost a server a fresh allocation, two hand-offs between threads and a copy of the shard per
version for replies still in flight. Here a body is read straight into a buffer the connection
reuses (on the worker, straight into the parameters), a reply goes to the kernel at once from the
shard itself, and only the part the kernel does not take yet is copied, into a reused buffer. The
header is checked (magic, version, token, a length within the receiver's bound) before any byte
of the body is read, so an unauthenticated peer never makes the receiver allocate.

A header that fails its check leaves the stream unreadable from there on: the caller closes the
connection. A message whose header passes but whose body does not (`protocol.decode`) is
dropped and the connection kept.
"""

from __future__ import annotations

import socket

from gradmesh.sync.parameter_server.protocol import HEADER_BYTES, check_header

LOWAT_CAP = 256 << 10
"""The most a reader asks the kernel to gather before it wakes it (`SO_RCVLOWAT`)."""


class Closed(Exception):
    """The peer closed the connection (or it was reset)."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """ "tcp://HOST:PORT" -> (HOST, PORT); HOST may be an IPv6 address in brackets."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint: {endpoint!r}")
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


def endpoint_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def listen(host: str) -> socket.socket:
    """A non-blocking listening socket on `host` (never every interface unless asked), at a port
    the kernel picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def connect(endpoint: str, timeout_s: float) -> socket.socket:
    return socket.create_connection(parse_endpoint(endpoint), timeout=timeout_s)


class Peer:
    """One end of a connection (see the module docstring). `receive` returns the next whole
    message, or None until it has arrived; `send` writes now what the kernel takes and keeps the
    rest for `flush`."""

    def __init__(self, sock: socket.socket, token: bytes, max_payload: int) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.token = token
        self.max_payload = max_payload
        self.head = bytearray(HEADER_BYTES)
        self.buffer = bytearray()
        """Bodies land here unless the caller gives a place; reused, grown to the largest."""
        self.target: memoryview | None = None
        """Where the body of the message under way goes (None: its header is not in yet)."""
        self.got = 0
        self.out: list[memoryview] = []
        """What `send` could not write yet, in order."""
        self.spill = bytearray()
        """Reused copy of a volatile reply's unwritten part."""
        self.lowat = 1

    def close(self) -> None:
        self.sock.close()

    @property
    def partial(self) -> bool:
        """Part of a message has arrived (a close now cuts it off)."""
        return self.got > 0 or self.target is not None

    # -- reading ----------------------------------------------------------------------------

    def _fill(self, view: memoryview) -> bool:
        """Read into view[got:] what has arrived; True once it is full."""
        while self.got < view.nbytes:
            try:
                n = self.sock.recv_into(view[self.got :])
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:  # reset by the peer
                raise Closed(str(exc)) from None
            if n == 0:
                raise Closed("closed by the peer")
            self.got += n
        return True

    def receive(self, into: memoryview | None = None) -> list[memoryview] | None:
        """The frames [header, body] of the next whole message, or None if it has not arrived.
        The body is read into `into` when its length matches, else into the reused buffer; either
        way it is valid until the next call. Raises WireError (a header that fails its check) or
        Closed."""
        if self.target is None:
            if not self._fill(memoryview(self.head)):
                return None
            nbytes = check_header(self.head, self.token, self.max_payload)
            if into is not None and into.nbytes == nbytes:
                self.target = into
            else:
                if len(self.buffer) < nbytes:
                    self.buffer = bytearray(nbytes)
                self.target = memoryview(self.buffer)[:nbytes]
            self.got = 0
        if not self._fill(self.target):
            # a body on a slow link arrives a packet at a time: have the kernel gather the rest
            # (up to LOWAT_CAP) before the next wake-up, not one per packet
            self._wake_at(min(self.target.nbytes - self.got, LOWAT_CAP))
            return None
        body, self.target, self.got = self.target, None, 0
        self._wake_at(1)
        return [memoryview(self.head), body]

    def _wake_at(self, nbytes: int) -> None:
        if nbytes != self.lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.lowat = nbytes

    # -- writing ----------------------------------------------------------------------------

    def send(self, frames: list[bytes | memoryview], volatile: bool = False) -> None:
        """Write `frames` (after anything still queued). With `volatile` their memory may change
        once this returns (a reply from the live shard): what is not written yet is copied."""
        views = [memoryview(f) for f in frames if len(f)]
        if not self.out:
            views = self._write(views)
        if not views:
            return
        if volatile:
            size = sum(v.nbytes for v in views)
            if self.out or len(self.spill) < size:
                store = bytearray(size)  # first use, or the spill still queued: a fresh copy
                if not self.out:
                    self.spill = store
            else:
                store = self.spill
            at = 0
            for v in views:
                store[at : at + v.nbytes] = v
                at += v.nbytes
            views = [memoryview(store)[:size]]
        self.out.extend(views)

    def flush(self) -> bool:
        """Write what is queued; True when nothing is left."""
        self.out = self._write(self.out)
        return not self.out

    def _write(self, views: list[memoryview]) -> list[memoryview]:
        while views:
            try:
                n = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise Closed(str(exc)) from None
            while n:
                if n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
        return views
