"""torchrun's static rendezvous, with host 0's store listening only on the master address.

torch's StaticTCPRendezvous creates a TCPStore server that listens on every interface of the
master port. We hand TCPStore a socket already bound to the master address instead (its
`master_listen_fd` option), so a single-host job listens on loopback only and a multi-host job
only on the address the job runs on. Everything else is torch's own handler.
"""

from __future__ import annotations

import socket

from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)

BACKEND = "gradmesh-static"


class BoundStaticRendezvous(StaticTCPRendezvous):
    """A StaticTCPRendezvous whose store server binds (master_addr, master_port) only."""

    _listener: socket.socket | None = None

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self.rank == 0 and self._store is None:
            info = socket.getaddrinfo(self.master_addr, self.master_port, type=socket.SOCK_STREAM)
            family, _, _, _, address = info[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
            self._listener = listener  # the store serves on this descriptor; keep it open
            self._store = TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                True,
                self.timeout,
                multi_tenant=True,
                master_listen_fd=listener.fileno(),
            )
        return super().next_rendezvous()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    base = create_rdzv_handler(params)
    assert isinstance(base, StaticTCPRendezvous)
    handler = BoundStaticRendezvous.__new__(BoundStaticRendezvous)
    handler.__dict__.update(base.__dict__)
    return handler


def register() -> str:
    """Make the backend known to torch's rendezvous registry; returns its name."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
