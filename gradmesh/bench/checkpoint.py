"""`gradmesh bench checkpoint`: what checkpoints cost a real training job, and how long a job
takes to train again after a worker is killed.

Each round runs the same `gradmesh train` job (default: alexnet on digits, the largest model,
2 workers) three ways, in rotated order: without checkpoints, with synchronous checkpoints and
with asynchronous ones every `--every` steps; then once more with synchronous checkpoints and
a worker killed with SIGKILL half-way (GRADMESH_FAULT) under `--max-restarts 1`. Reported, as
medians over the rounds: the size of one rank's file and of a whole checkpoint; the training
thread's stall per save (rank 0's own clock); the step time against the run without
checkpoints, and from it the stall a save costs the job (the run's extra time over its saves:
every rank waits for the slowest one's save, and the last save is waited for);
restart-to-first-step, from the kill (its time stamp) to the first step the restarted job
completed. The machine's idle CPU during each run is recorded, and a mode is labelled `cpu`
when the cores were busy (idle under 10 %): the background writer of an asynchronous save
competes with training for the same cores.
"""

from __future__ import annotations

import json
import os
import re
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
from gradmesh.runtime.process import cpu_jiffies

MODES = ("none", "sync", "async")
_KILLED = re.compile(r"killed after step \d+ at unix time ([0-9.]+)")


@dataclass
class Config:
    """gradmesh bench checkpoint: checkpoint size, training stall (sync and async) and restart-to-
    first-step time"""

    model: str = option("alexnet", "model", name=True)
    dataset: str = option("digits", "dataset", name=True)
    workers: int = option(2, "worker processes", at_least=1)
    epochs: int = option(2, "epochs per run", at_least=1)
    every: int = option(5, "steps between checkpoints (5)", at_least=1)
    rounds: int = option(3, "rounds of every mode", at_least=1)
    modes: str = option("sync,async", "save modes to time against no checkpoints", name=True)
    json: str | None = option(None, "write the result here")


def _train(args: Config, folder: Path, mode: str, kill: int | None) -> dict[str, Any]:
    """One `gradmesh train` run; its report, the machine's idle CPU, and the kill's time stamp."""
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    command = [
        *(sys.executable, "-m", "gradmesh.cli", "train"),
        *("--model", args.model, "--dataset", args.dataset),
        *("--workers", str(args.workers), "--epochs", str(args.epochs)),
        *("--json", str(report)),
    ]
    if mode != "none":
        command += ["--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", str(args.every)]
    if mode == "async":
        command.append("--checkpoint-async")
    env = dict(os.environ)
    if kill is not None:
        command += ["--max-restarts", "1"]
        env["GRADMESH_FAULT"] = f"kill:1:{kill}"
    idle0, total0 = cpu_jiffies()
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    idle1, total1 = cpu_jiffies()
    if out.returncode != 0 or not report.exists():
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise GradmeshError(f"bench checkpoint: the {mode} run failed: {last}")
    result: dict[str, Any] = json.loads(report.read_text())
    result["cpu_idle"] = (idle1 - idle0) / max(1, total1 - total0)
    if kill is not None:
        stamp = _KILLED.search(out.stderr)
        if stamp is None:
            raise GradmeshError("bench checkpoint: the killed worker left no time stamp")
        result["killed_at"] = float(stamp.group(1))
    return result


def run(args: Config, _command: list[str] | None = None) -> int:
    chosen = [m for m in args.modes.split(",") if m]
    if not chosen or set(chosen) - set(MODES[1:]):
        raise GradmeshError(f"--modes {args.modes!r}: a list of sync, async")
    modes = ("none", *chosen)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in (*modes, "restart")}
    for round_ in range(args.rounds):
        for i in range(len(modes)):
            mode = modes[(i + round_) % len(modes)]
            with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
                runs[mode].append(_train(args, Path(tmp), mode, None))
        done = runs[chosen[0]][-1]  # its steps: the kill comes half-way
        steps = round(done["samples_per_s"] * done["wall_s"] / done["batch_size"])
        with tempfile.TemporaryDirectory(prefix="gradmesh-bench-") as tmp:
            runs["restart"].append(_train(args, Path(tmp), chosen[0], max(1, steps // 2)))
    result = summarize(args, runs)
    write_json(args.json, result)
    print(format_summary(result))
    return 0


def _step_s(report: dict[str, Any]) -> float:
    return float(report["batch_size"] / report["samples_per_s"])


def summarize(args: Config, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = median([_step_s(r) for r in runs["none"]])
    modes: dict[str, Any] = {}
    timed = [m for m in runs if m != "restart"]  # "none" first, then the save modes timed
    for mode in timed:
        reports = runs[mode]
        step = median([_step_s(r) for r in reports])
        idle = median([r["cpu_idle"] for r in reports])
        entry: dict[str, Any] = {
            "step_s": step,
            "step_ratio_to_none": step / base,
            "cpu_idle": idle,
            "limit": "cpu" if idle < CPU_BOUND_IDLE else "disk-or-compute",
        }
        if mode != "none":
            faults = [r["faults"] for r in reports]
            entry["stall_s_median"] = median([f["checkpoint_stall_s_median"] for f in faults])
            saves = faults[0]["checkpoint_saves"]
            steps = round(
                reports[0]["samples_per_s"] * reports[0]["wall_s"] / int(reports[0]["batch_size"])
            )
            entry["job_stall_s_per_checkpoint"] = max(0.0, (step - base) * steps / saves)
            entry["saves"] = saves
        modes[mode] = entry
    restarts = runs["restart"]
    sizes = [r["faults"]["checkpoint_rank_file_bytes"] for r in runs[timed[1]]]
    per_rank = int(median(sizes))
    return {
        "model": args.model,
        "dataset": args.dataset,
        "workers": args.workers,
        "every": args.every,
        "rounds": args.rounds,
        "rank_file_bytes": per_rank,
        "checkpoint_bytes": per_rank * args.workers,
        "modes": modes,
        "restart_to_first_step_s": median(
            [r["faults"]["first_step_unix_s"] - r["killed_at"] for r in restarts]
        ),
        "restart_steps_redone": median([r["faults"]["steps_redone"] for r in restarts]),
        "restart_ok": all(r["faults"]["restarts"] == 1 for r in restarts),
    }


def format_summary(r: dict[str, Any]) -> str:
    lines = [
        f"checkpoints of {r['model']} on {r['dataset']}, {r['workers']} workers, every "
        f"{r['every']} steps: {r['rank_file_bytes'] / 1e6:.2f} MB per rank, "
        f"{r['checkpoint_bytes'] / 1e6:.2f} MB per checkpoint"
    ]
    for mode, m in r["modes"].items():
        line = f"  {mode:5s} step {m['step_s'] * 1e3:7.2f} ms ({m['step_ratio_to_none']:.3f}x)"
        if mode != "none":
            line += (
                f"  stall per save {m['stall_s_median'] * 1e3:.1f} ms on rank 0, "
                f"{m['job_stall_s_per_checkpoint'] * 1e3:.1f} ms for the job"
            )
        lines.append(line + f"  [idle CPU {m['cpu_idle']:.0%}: {m['limit']}]")
    lines.append(
        f"  restart to first step {r['restart_to_first_step_s']:.2f} s "
        f"({r['restart_steps_redone']:.0f} steps redone)"
    )
    return "\n".join(lines)
