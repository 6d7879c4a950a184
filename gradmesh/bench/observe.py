"""`gradmesh bench observe`: what `--tensorboard` and `--timeline` cost a training step.

The default job (`gradmesh train` with its defaults, or `--strategy`/`--epochs` given here) runs
without either and with both, alternately, `--rounds` times each; a job's step time is its
training wall (the report's `wall_s`: the loop, per-epoch evaluation for TensorBoard included,
start-up and the trace's merge at the end not) over its steps. Reported: the medians, their
ratio, and the machine's idle CPU during each job (under 10 %: `"limit": "cpu"`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import CPU_BOUND_IDLE, median
from gradmesh.errors import GradmeshError
from gradmesh.launch.jobs import write_json
from gradmesh.options import option
from gradmesh.runtime.process import cpu_jiffies, idle_since


@dataclass
class Config:
    """gradmesh bench observe: the default job's step time with and without --tensorboard and
    --timeline"""

    strategy: str = option("allreduce", "", name=True)
    epochs: int = option(12, "epochs per job (train's default)", at_least=1)
    rounds: int = option(5, "jobs of each kind", at_least=1)
    json: str | None = option(None, "write the result here")


def _job(args: Config, observed: bool, tmp: Path, n: int) -> dict[str, float]:
    out = tmp / f"r{n}.json"
    flags = ["--strategy", args.strategy, "--epochs", str(args.epochs), "--json", str(out)]
    if args.strategy == "ps":
        flags += ["--servers", "1"]
    if observed:
        flags += ["--tensorboard", str(tmp / f"tb{n}"), "--timeline", str(tmp / f"t{n}.json")]
    before = cpu_jiffies()
    done = subprocess.run(
        [sys.executable, "-m", "gradmesh.cli", "train", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    idle = idle_since(before)
    if done.returncode != 0 or not out.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GradmeshError(f"the {'observed' if observed else 'plain'} job failed: {last}")
    report = json.loads(out.read_text())
    return {"step_s": report["wall_s"] / max(report["steps"], 1), "cpu_idle": idle}


def run(args: Config, _command: list[str] | None = None) -> int:
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="gradmesh-observe-") as tmp:
        _job(args, True, Path(tmp), -1)  # warm-up: the page cache, tensorboard's import
        for n in range(args.rounds):
            for observed in (n % 2 == 1, n % 2 == 0):  # alternate which goes first
                runs[observed].append(_job(args, observed, Path(tmp), 2 * n + observed))
    plain = median([r["step_s"] for r in runs[False]])
    seen = median([r["step_s"] for r in runs[True]])
    idle = median([r["cpu_idle"] for rs in runs.values() for r in rs])
    payload: dict[str, Any] = {
        "strategy": args.strategy,
        "epochs": args.epochs,
        "rounds": args.rounds,
        "plain_step_s": plain,
        "observed_step_s": seen,
        "overhead": seen / plain - 1,
        "plain_step_s_rounds": [r["step_s"] for r in runs[False]],
        "observed_step_s_rounds": [r["step_s"] for r in runs[True]],
        "cpu_idle": idle,
        "limit": "cpu" if idle < CPU_BOUND_IDLE else "not cpu",
    }
    write_json(args.json, payload)
    print(
        f"{args.strategy}: {plain * 1e3:.3f} ms a step plain, {seen * 1e3:.3f} ms with "
        f"--tensorboard and --timeline: {payload['overhead']:+.1%} (medians of {args.rounds}; "
        f"idle CPU {idle:.0%})"
    )
    return 0
