"""`gradmesh bench allreduce`: every allreduce algorithm, interleaved, on real ranks.

For each world size the ranks first probe alpha, beta (ping-pong sweep) and gamma, then warm every
(algorithm, size) up and take `--reps` measured rounds; in each round every size and algorithm
runs once, in turn, so drift hits all alike. A measurement is the slowest rank's time between a
barrier and the end of its allreduce. Reported: median and p90, algbw = bytes / median, busbw =
algbw * 2(p-1)/p (the nccl-tests definition), and the time the alpha-beta-gamma model predicts
with the probed parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import check_link, median, quantile
from gradmesh.launch.jobs import emulated_cluster, run_workers, worker_main, write_json
from gradmesh.options import option
from gradmesh.units import parse_ints, parse_list, parse_size

DEFAULT_ALGORITHMS = "ring,tree,butterfly,star,hierarchical,native"


@dataclass
class Config:
    """gradmesh bench allreduce: every allreduce algorithm, interleaved, with the cost model"""

    world: str = option("2,4", "world sizes, like 2,4")
    sizes: str = option("4KB,256KB,4MB,32MB", "message sizes")
    algorithms: str = option(DEFAULT_ALGORITHMS, "algorithms to compare", name=True)
    reps: int = option(10, "measured rounds", at_least=1)
    warmup: int = option(2, "warm-up rounds", at_least=0)
    json: str | None = option(None, "write the results here")
    timeout: float = option(120.0, "collective timeout, s")
    emulate_hosts: int | None = option(None, "spread each world over H emulated hosts", at_least=1)
    bandwidth: str = option("1gbit", "emulated link rate")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.collectives import ALGORITHMS

    check_link(args)
    worlds = parse_ints(args.world, "world size")
    sizes = [parse_size(s) for s in parse_list(args.sizes, "size")]
    algorithms = parse_list(args.algorithms, "algorithm")
    for name in algorithms:
        ALGORITHMS.get(name)
    config = {"sizes": sizes, "algorithms": algorithms, "reps": args.reps, "warmup": args.warmup}
    results: list[dict[str, Any]] = []
    with emulated_cluster(args.emulate_hosts, args.bandwidth) as cluster:
        for world in worlds:
            found = run_workers("gradmesh.bench.allreduce", world, config, args.timeout, cluster)
            results += found["results"]
        where = (
            f"{cluster.hosts} emulated hosts, {cluster.bandwidth_bps} bit/s links"
            if cluster
            else "loopback, one machine"
        )
    payload = {"results": results, "network": where, "reps": args.reps}
    write_json(args.json, payload)
    print(table(results))
    return 0


def table(results: list[dict[str, Any]]) -> str:
    native = {
        (r["world"], r["bytes"]): r["busbw_GBps"] for r in results if r["algorithm"] == "native"
    }
    lines = [
        f"{'algorithm':>12} {'world':>5} {'bytes':>10} {'median ms':>10} {'p90 ms':>9} "
        f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'model ms':>9} {'vs native':>9}"
    ]
    for r in results:
        ref = native.get((r["world"], r["bytes"]))
        ratio = f"{r['busbw_GBps'] / ref:.2f}" if ref else "-"
        lines.append(
            f"{r['algorithm']:>12} {r['world']:>5} {r['bytes']:>10} {r['median_s'] * 1e3:>10.3f} "
            f"{r['p90_s'] * 1e3:>9.3f} {r['algbw_GBps']:>10.3f} {r['busbw_GBps']:>10.3f} "
            f"{r['predicted_s'] * 1e3:>9.3f} {ratio:>9}"
        )
    return "\n".join(lines)


def _measure(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from gradmesh.collectives import allreduce, cost, probe
    from gradmesh.runtime.world import init, shutdown

    rt = init()
    p = rt.size
    params = probe() if p > 1 else None
    buffers = {n: torch.ones(n // 4, dtype=torch.float32, device="cpu") for n in config["sizes"]}
    slowest = torch.zeros(1, dtype=torch.float64, device="cpu")
    samples: dict[tuple[str, int], list[float]] = {}
    for round_ in range(config["warmup"] + config["reps"]):
        for n in config["sizes"]:
            for name in config["algorithms"]:
                buffers[n].fill_(1.0)
                dist.barrier()
                started = time.perf_counter()
                allreduce(buffers[n], algorithm=name)
                slowest[0] = time.perf_counter() - started
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if round_ >= config["warmup"]:
                    samples.setdefault((name, n), []).append(float(slowest[0]))
    rows = []
    for (name, n), times in samples.items():
        mid = median(times)
        algbw = n / mid / 1e9
        predicted = (
            cost(name, p, n, params.alpha, params.beta, params.gamma, rt.local_size)
            if params
            else 0.0
        )
        rows.append(
            {
                "algorithm": name,
                "world": p,
                "bytes": n,
                "median_s": mid,
                "p90_s": quantile(times, 0.9),
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (p - 1) / p,
                "predicted_s": predicted,
            }
        )
    rows.sort(key=lambda r: (r["bytes"], config["algorithms"].index(r["algorithm"])))
    fitted = (
        {"alpha_s": params.alpha, "beta_s_per_byte": params.beta, "gamma_s_per_byte": params.gamma}
        if params
        else {}
    )
    shutdown()
    return rt.rank, {"results": [{**r, **fitted} for r in rows]}


if __name__ == "__main__":
    worker_main(_measure)
