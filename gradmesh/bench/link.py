"""`gradmesh bench link`: how much of an emulated link the backend's allreduce uses.

The native allreduce of `--bytes` (16 MiB) between `--hosts` emulated hosts, one rank each,
warm-up then the median of `--reps` runs (the allreduce benchmark's measurement loop), reported
as bus bandwidth and as a fraction of the link rate: link_utilization = busbw * 8 / bandwidth.
"""

from __future__ import annotations

import argparse

from gradmesh.launch.jobs import emulated_cluster, run_workers, write_json
from gradmesh.units import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: 2)")
    parser.add_argument("--bandwidth", default="1gbit", help="link rate (default: 1gbit)")
    parser.add_argument("--bytes", default="16MB", help="message size (default: 16MB)")
    parser.add_argument("--reps", type=int, default=10, help="measured runs (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up runs (default: 2)")
    parser.add_argument("--json", help="write the result here")


def run(args: argparse.Namespace) -> int:
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
