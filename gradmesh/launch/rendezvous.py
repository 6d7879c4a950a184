"""torchrun's rendezvous, with every store server listening only on the job's own address.

Static (a fixed number of hosts): torch's StaticTCPRendezvous creates a TCPStore server that
listens on every interface of the master port. We hand TCPStore a socket already bound to the
master address instead (its `master_listen_fd` option), so a single-host job listens on loopback
only and a multi-host job only on the address the job runs on.

Elastic (`--nnodes MIN:MAX`): torch's c10d rendezvous (DynamicRendezvousHandler over a
C10dRendezvousBackend), with the same binding for the rendezvous store on host 0 and for the
store the first host of each round serves to its workers (torch's own binds every interface).
Everything else is torch's own handler: rounds, heartbeats, the last call for late hosts.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from gradmesh.runtime.process import ROUND_ENV

BACKEND = "gradmesh-static"
ELASTIC_BACKEND = "gradmesh-elastic"
KEEP_ALIVE_S = 1
"""Heartbeat interval of an elastic job's hosts."""
KEEP_ALIVE_TRIES = 5
"""A host silent for this many heartbeats has left (5 s: a host starved of CPU for a moment,
as 4 emulated hosts on 2 cores are when workers start, is not dropped)."""
LAST_CALL_S = 3
"""Once MIN hosts are in, how long a round waits for more before it starts without them."""


def bound_store(
    host: str, port: int, timeout: timedelta, world_size: int | None = None
) -> tuple[Any, socket.socket]:
    """A TCPStore server listening on (host, port) only (port 0: a free one), and its socket,
    which must stay open as long as the store serves."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = info[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(128)
    port = listener.getsockname()[1]
    store = TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        multi_tenant=True,
        master_listen_fd=listener.fileno(),
    )
    return store, listener


class BoundStaticRendezvous(StaticTCPRendezvous):
    """A StaticTCPRendezvous whose store server binds (master_addr, master_port) only."""

    _listener: socket.socket | None = None

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self.rank == 0 and self._store is None:
            self._store, self._listener = bound_store(
                self.master_addr, self.master_port, self.timeout, self.world_size
            )
        return super().next_rendezvous()


class BoundDynamicRendezvous(DynamicRendezvousHandler):
    """torch's c10d rendezvous handler; the workers' store binds this host's address only."""

    listeners: list[socket.socket]

    def get_backend(self) -> str:
        return ELASTIC_BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        """torch's round, and its number for the workers this agent starts next (they inherit
        its environment): the restart count cannot name a round, since a host whose workers
        were healthy when another joined restarts them without counting an attempt."""
        info = super().next_rendezvous()
        os.environ[ROUND_ENV] = str(self._state_holder.state.round)
        return info

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        store, listener = bound_store(master_addr, master_port, timedelta(minutes=5))
        self.listeners.append(listener)
        return store


def _create_static(params: RendezvousParameters) -> RendezvousHandler:
    base = create_rdzv_handler(params)
    assert isinstance(base, StaticTCPRendezvous)
    handler = BoundStaticRendezvous.__new__(BoundStaticRendezvous)
    handler.__dict__.update(base.__dict__)
    return handler


def _create_elastic(params: RendezvousParameters) -> RendezvousHandler:
    """The rendezvous store lives on the host started with `is_host` (node rank 0)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout_s = int(params.get_as_int("timeout", 60) or 60)
    listeners = []
    if params.get_as_bool("is_host", False):
        store, listener = bound_store(host, port, timedelta(seconds=timeout_s))
        listeners.append(listener)
    else:
        store = TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    handler = BoundDynamicRendezvous.from_backend(
        params.run_id,
        store,
        C10dRendezvousBackend(store, params.run_id),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            join=timedelta(seconds=timeout_s),
            last_call=timedelta(seconds=LAST_CALL_S),
            close=timedelta(seconds=timeout_s),
            heartbeat=timedelta(seconds=KEEP_ALIVE_S * 5),
        ),
        keep_alive_interval=KEEP_ALIVE_S,
        keep_alive_max_attempt=KEEP_ALIVE_TRIES,
    )
    assert isinstance(handler, BoundDynamicRendezvous)
    handler.listeners = listeners
    return handler


def register(elastic: bool = False) -> str:
    """Make the backend known to torch's rendezvous registry; returns its name."""
    if elastic:
        rendezvous_handler_registry.register(ELASTIC_BACKEND, _create_elastic)
        return ELASTIC_BACKEND
    rendezvous_handler_registry.register(BACKEND, _create_static)
    return BACKEND
