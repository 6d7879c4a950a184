"""What starting a job costs, in two source trees of gradmesh: `gradmesh train --epochs 1
--workers N` (the digits CNN: 0.15 s of training) run from each, interleaved, after one warm-up
run of each; the medians of its wall time and of the machine's busy CPU time over the run (from
/proc/stat: every process of the job, the launcher's forkserver included, which no rusage
counts). Run it on a quiet machine:

    git worktree add /tmp/before <rev>
    python scripts/ab_job_start.py /tmp/before . --workers 2 --rounds 7

Arguments after `--` go to `gradmesh train`; `{dir}` in them is a new empty folder each run
(`-- --checkpoint-dir {dir}`: a job that checks its checkpoint before launch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def one(tree: str, workers: int, cwd: str, extra: list[str]) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    fresh = tempfile.mkdtemp(dir=cwd)
    extra = [a.replace("{dir}", fresh) for a in extra]
    command = [sys.executable, "-m", "gradmesh.cli", "train", "--epochs", "1", *extra]
    busy, start = busy_s(), time.monotonic()
    subprocess.run([*command, "--workers", str(workers)], env=env, cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip
    return time.monotonic() - start, busy_s() - busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs=2, metavar="TREE", help="two gradmesh source trees")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    with tempfile.TemporaryDirectory() as cwd:  # not a tree: its gradmesh would be imported
        for tree in args.trees:
            one(tree, args.workers, cwd, extra)
        runs: dict[str, list[tuple[float, float]]] = {tree: [] for tree in args.trees}
        for _ in range(args.rounds):
            for tree in args.trees:
                runs[tree].append(one(tree, args.workers, cwd, extra))
    for tree, got in runs.items():
        wall = statistics.median(w for w, _ in got)
        cpu = statistics.median(c for _, c in got)
        print(f"{tree}: wall {wall:.2f} s, CPU {cpu:.2f} s (median of {len(got)})")


if __name__ == "__main__":
    main()
