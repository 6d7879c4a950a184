"""The expected step time of a parameter-server job: S servers, W workers, M bytes of parameters.

Each step a worker computes for `compute_s`, pushes its gradient (M bytes, one shard of M/S to
each server) and pulls the parameters back (M bytes); in async mode a server answers the pull
once the push is applied. A server's link carries W·M/S bytes each way per step, a worker's M.
BytePS's bound is the busiest link: step >= compute + max(M·β_worker, W·M·β_server / S).

The bound ignores queueing: a worker's push waits behind the others' at the server, and its
pull behind theirs on the way out. `step_time` solves the closed network exactly by mean-value
analysis (Reiser & Lavenberg, 1980; exact for product-form networks), W workers cycling through
- a delay: compute, two message latencies (α each), and the part of the worker's own link time
  that the servers' links do not cover. A worker writes its shards in turn and a server answers
  once its shard is in, so the answers come back while later shards still go out: the worker's
  link is busy for (M + M/S)·β_worker per step (all of the push, then the last answer), of which
  a shard crosses a server's link at the same time, packet by packet, in and out:
  max(0, (M + M/S)·β_worker − 2·M/S·β_server);
- two queues, the servers' inbound and outbound links, each of demand M/S·β_server per step
  (the servers are alike, so one stands for all);
- a third, the server's CPU, of demand `server_cpu_s` per push+pull of its shard.
The link terms are the collectives' (`CostParams`: α per message, β per byte).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.collectives.cost import CostParams


def mean_value_analysis(delay_s: float, demands_s: list[float], customers: int) -> float:
    """The cycle time of `customers` in a closed network of one delay station and queueing
    stations of the given demands (exact MVA)."""
    queues = [0.0] * len(demands_s)
    cycle = delay_s + sum(demands_s)
    for n in range(1, customers + 1):
        residence = [d * (1 + q) for d, q in zip(demands_s, queues, strict=True)]
        cycle = delay_s + sum(residence)
        throughput = n / cycle
        queues = [throughput * r for r in residence]
    return cycle


@dataclass(frozen=True)
class PSPrediction:
    step_s: float
    """One worker's expected step (the network's cycle time)."""
    bound_s: float
    """BytePS's bound: compute plus the busiest link's time per step."""
    bottleneck: str
    """What the queues spend most time on: `server links`, `server cpu` or `worker`."""


def step_time(
    workers: int,
    servers: int,
    nbytes: int,
    link: CostParams,
    compute_s: float,
    server_cpu_s: float = 0.0,
    server_link: CostParams | None = None,
) -> PSPrediction:
    """Expected step of a worker of an async ps job (see the module docstring); `server_link`
    defaults to `link` (every host's link alike)."""
    server = server_link or link
    shard = nbytes / servers
    own = max(0.0, (nbytes + shard) * link.beta - 2 * shard * server.beta)
    delay = compute_s + 2 * link.alpha + own
    demands = [shard * server.beta, shard * server.beta, server_cpu_s]
    cycle = mean_value_analysis(delay, demands, workers)
    busiest = max(nbytes * link.beta, workers * shard * server.beta)
    loads = {
        "server links": workers * shard * server.beta,
        "server cpu": workers * server_cpu_s,
        "worker": delay + sum(demands),
    }
    return PSPrediction(cycle, compute_s + busiest, max(loads, key=lambda k: loads[k]))
