"""The rendezvous port: a free one for a single host, a check that a named one is free, and a
bounded wait for host 0's.

A free port is drawn below the kernel's ephemeral range, not by binding port 0: a port from that
range can be taken, between our check and the store's bind, by any outgoing connection on the
machine, including a rank's own retried connect to the not-yet-listening store (Linux lets a
connect to 127.0.0.1:P from source port P succeed: a self-connected socket then holds P). A CI run
failed so with EADDRINUSE at rank 0's bind; no connect takes a port outside that range.
"""

from __future__ import annotations

import errno
import random
import socket
import time

from gradmesh.errors import GradmeshError

_LOWEST = 10000
"""Ports below this are left to services; above it, up to the ephemeral range, free ones are
drawn (torchrun's 29500 lies there too)."""


def _ephemeral_start() -> int:
    """The first port the kernel hands to connect() and bind(0) (32768 when it does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind_error(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be bound now (None: it can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
        return None


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port that nothing holds right now and that no outgoing connection will take."""
    top = _ephemeral_start()
    if top - _LOWEST >= tries:
        for port in random.sample(range(_LOWEST, top), tries):
            if _bind_error(host, port) is None:
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Fail with one line if `host:port` cannot be bound (the master's store will bind it)."""
    exc = _bind_error(host, port)
    if exc is not None and exc.errno == errno.EADDRINUSE:
        raise GradmeshError(f"master port {port} is already in use on {host}")
    if exc is not None:
        raise GradmeshError(f"cannot use master address {host}:{port}: {exc.strerror}")


def wait_for_master(host: str, port: int, timeout_s: float, node_rank: int) -> None:
    """Wait until host 0's store accepts connections, at most `timeout_s`: torch's store client
    backs off between tries and overshot the timeout by 1.4-2.5x; this bound is exact."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GradmeshError(
                f"node {node_rank}: rendezvous with master {host}:{port} failed: "
                f"nothing accepted a connection within {timeout_s:g} s ({last})"
            )
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
