"""`gradmesh bench link`: how much of an emulated link the backend's allreduce uses.

The native allreduce of `--bytes` (16 MiB) between `--hosts` emulated hosts, one rank each,
warm-up then the median of `--reps` runs (the allreduce benchmark's measurement loop), reported
as bus bandwidth and as a fraction of the link rate: link_utilization = busbw * 8 / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.launch.jobs import emulated_cluster, run_workers, write_json
from gradmesh.options import option
from gradmesh.units import parse_size


@dataclass
class Config:
    """gradmesh bench link: native allreduce over emulated hosts, as a fraction of the link"""

    hosts: int = option(2, "emulated hosts")
    bandwidth: str = option("1gbit", "link rate")
    bytes: str = option("16MB", "message size")
    reps: int = option(10, "measured runs")
    warmup: int = option(2, "warm-up runs")
    json: str | None = option(None, "write the result here")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.errors import GradmeshError

    if args.hosts < 2 or args.reps < 1:
        raise GradmeshError("--hosts must be >= 2 and --reps >= 1")
    nbytes = parse_size(args.bytes)
    config = {"sizes": [nbytes], "algorithms": ["native"], "reps": args.reps, "warmup": args.warmup}
    with emulated_cluster(args.hosts, args.bandwidth) as cluster:
        assert cluster is not None
        row = run_workers("gradmesh.bench.allreduce", args.hosts, config, 120.0, cluster)[
            "results"
        ][0]
        bandwidth = cluster.bandwidth_bps
        notes = cluster.notes
    busbw = row["busbw_GBps"] * 1e9
    result = {
        "hosts": args.hosts,
        "bandwidth_bps": bandwidth,
        "bytes": nbytes,
        "median_s": row["median_s"],
        "p90_s": row["p90_s"],
        "busbw_Bps": busbw,
        "link_utilization": busbw * 8 / bandwidth,
        "notes": notes,
    }
    write_json(args.json, result)
    print(
        f"native allreduce of {nbytes} bytes over {args.hosts} emulated hosts at "
        f"{bandwidth / 1e9:g} Gbit/s: median {row['median_s'] * 1e3:.1f} ms, "
        f"busbw {busbw * 8 / 1e9:.3f} Gbit/s, link utilization {result['link_utilization']:.3f}"
    )
    return 0
