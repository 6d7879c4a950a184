"""`gradmesh bench hogwild`: Hogwild! samples/s and accuracy for 1..N workers, lock-free or locked.

Two problems: "sparse" (the `bag` model on the `docstrings` dataset, where an update touches about
a hundred of the 2.6M weights) and "dense" (the CNN on digits, where every update writes every
weight). Each configuration is a real `gradmesh train --strategy hogwild` run; the runs are
interleaved round by round (the order rotates) and medians are reported. Every worker gets one
thread (OMP_NUM_THREADS=1) and the same per-worker batch, so W workers use W cores and apply the
same number of updates of the same size as one worker does: samples/s measures parallelism, not a
bigger batch. samples/s is the trainer's own figure (training loop only, excluding start-up).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import median
from gradmesh.errors import GradmeshError
from gradmesh.launch.jobs import write_json
from gradmesh.options import option
from gradmesh.units import parse_ints, parse_list

PROBLEMS: dict[str, dict[str, Any]] = {
    "sparse": {
        "model": "bag",
        "dataset": "docstrings",
        "lr": 0.5,
        "momentum": 0.0,
        "batch_per_worker": 32,
        "epochs": 120,  # a run of a second or more: shorter ones drown in scheduling noise
    },
    "dense": {
        "model": "cnn",
        "dataset": "digits",
        "lr": 0.05,
        "momentum": 0.9,
        "batch_per_worker": 32,
        "epochs": 12,
    },
}
MODES = ("hogwild", "locked")


@dataclass
class Config:
    """gradmesh bench hogwild: samples/s and accuracy, 1..N workers, lock-free and locked."""

    workers: str = option("1,2", "worker counts")
    modes: str = option("hogwild,locked", "hogwild, locked or both", name=True)
    problems: str = option("sparse,dense", "sparse, dense or both", name=True)
    rounds: int = option(5, "runs of each configuration", at_least=1)
    epochs: int | None = option(None, "override every problem's epochs", at_least=1)
    batch_per_worker: int | None = option(None, "override every problem's batch", at_least=1)
    json: str | None = option(None, "write the result here")


def _train(problem: dict[str, Any], workers: int, mode: str, out: Path) -> dict[str, Any]:
    flags = [
        "--strategy=hogwild",
        f"--workers={workers}",
        f"--model={problem['model']}",
        f"--dataset={problem['dataset']}",
        f"--lr={problem['lr']}",
        f"--momentum={problem['momentum']}",
        f"--batch-size={problem['batch_per_worker'] * workers}",
        f"--epochs={problem['epochs']}",
        f"--json={out}",
        *(["--lock"] if mode == "locked" else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gradmesh.cli", "train", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 or not out.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GradmeshError(f"hogwild run ({workers} workers, {mode}) failed: {last}")
    return dict(json.loads(out.read_text()))


def run(args: Config, _command: list[str] | None = None) -> int:
    workers = parse_ints(args.workers, "workers")
    modes = parse_list(args.modes, "mode")
    problems = parse_list(args.problems, "problem")
    for name, known in (("mode", MODES), ("problem", PROBLEMS)):
        bad = sorted(set(modes if name == "mode" else problems) - set(known))
        if bad:
            raise GradmeshError(f"unknown {name} {bad[0]!r} (valid: {', '.join(known)})")
    chosen = {name: dict(PROBLEMS[name]) for name in problems}
    for problem in chosen.values():
        problem["epochs"] = args.epochs or problem["epochs"]
        problem["batch_per_worker"] = args.batch_per_worker or problem["batch_per_worker"]
    configs = list(itertools.product(problems, workers, modes))
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
        for round_ in range(args.rounds):
            shift = round_ % len(configs)
            for i, (name, w, mode) in enumerate(configs[shift:] + configs[:shift]):
                report = _train(chosen[name], w, mode, Path(tmp) / f"{round_}-{i}.json")
                runs[(name, w, mode)].append(report)
                print(
                    f"round {round_ + 1}/{args.rounds}  {name:6} workers {w}  {mode:7}  "
                    f"{report['samples_per_s']:8.0f} samples/s  accuracy "
                    f"{report['test_accuracy']:.4f}",
                    flush=True,
                )
    results = []
    for (name, w, mode), reports in runs.items():
        problem = chosen[name]
        results.append(
            {
                "problem": name,
                "model": problem["model"],
                "dataset": problem["dataset"],
                "workers": w,
                "mode": mode,
                "samples_per_s": median([r["samples_per_s"] for r in reports]),
                "test_accuracy": median([r["test_accuracy"] for r in reports]),
                "updates_applied": reports[0]["strategy_info"]["updates_applied"],
                "runs": len(reports),
            }
        )
    speedups = _speedups(results)
    payload = {
        "results": results,
        "speedup": speedups,
        "threads_per_worker": 1,
        "problems": chosen,
    }
    write_json(args.json, payload)
    for s in speedups:
        print(
            f"{s['problem']:6} {s['mode']:7} {s['workers']} workers: {s['speedup']:.2f}x the "
            f"samples/s of 1 worker, accuracy {s['accuracy_change']:+.4f}"
        )
    return 0


def _speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """samples/s and accuracy of each configuration against 1 lock-free worker, same problem."""
    base = {r["problem"]: r for r in results if r["workers"] == 1 and r["mode"] == "hogwild"}
    return [
        {
            "problem": r["problem"],
            "workers": r["workers"],
            "mode": r["mode"],
            "speedup": r["samples_per_s"] / base[r["problem"]]["samples_per_s"],
            "accuracy_change": r["test_accuracy"] - base[r["problem"]]["test_accuracy"],
        }
        for r in results
        if r["problem"] in base and r is not base[r["problem"]]
    ]
