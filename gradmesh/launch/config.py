"""The launcher's options: `gradmesh run` (workers on this host) and `gradmesh emulate` (a
command on emulated hosts). No torch here: the CLI builds its flags from this."""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.options import option


@dataclass
class RunConfig:
    """gradmesh run: start workers on this host (gradmesh run -np N -- CMD ...)."""

    np: int | None = option(
        None, "worker processes on this host (default: what Kubernetes or emulate set)", flag="-np"
    )
    nnodes: str | None = option(
        None,
        "hosts in the job: N, or MIN:MAX for an elastic job that goes on with fewer hosts "
        "after one is lost (default: 1, or what Kubernetes or emulate set)",
    )
    node_rank: int | None = option(None, "index of this host (default: 0)")
    master: str | None = option(None, "HOST[:PORT] of host 0 (default: a free loopback port)")
    iface: str | None = option(None, "network interface for Gloo/NCCL traffic (multi-host)")
    timeout: float | None = option(
        None, "rendezvous and collective timeout, s (default: GRADMESH_TIMEOUT_S or 60)"
    )
    max_restarts: int = option(0, "restart every worker up to N times after a failure")


@dataclass
class EmulateConfig:
    """gradmesh emulate: run a command on emulated hosts (gradmesh emulate --hosts H -- CMD)."""

    hosts: int | None = option(None, "emulated hosts (required)")
    procs_per_host: int = option(1, "workers per host")
    bandwidth: str = option("1gbit", "link rate per host")
    latency: str | None = option(None, "added one-way latency, like 1ms (needs netem)")
    timeout: float = option(600.0, "end the job after S seconds")
    nnodes: str | None = option(
        None, "MIN:MAX (MAX = --hosts): an elastic job that goes on with MIN hosts"
    )
