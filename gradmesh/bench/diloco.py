"""`gradmesh bench diloco`: DiLoCo against synchronous data parallelism on emulated hosts behind
slow links, the same model, data, optimizer and steps.

Each round trains both as `gradmesh train` jobs, one worker per emulated host (`--hosts`, links
shaped to `--bandwidth`), interleaved, with the test split scored every `--eval-every` steps (a
multiple of `--sync-every`, where DiLoCo's replicas hold one model): the report's
`eval_history` gives each run's test loss against its training seconds (scoring left out).
With `--pretrain-steps P`, one synchronous job first trains P steps on the same hosts, is
exported (`gradmesh export`), and both runs start from those weights (`--init-from`), each with
a fresh optimizer: the paper's protocol, where DiLoCo starts from a pretrained model. That
job's steps, seconds and bytes count in neither run.

Per strategy (medians over rounds): seconds a step, bytes each worker sent a step (the run's
whole traffic, the first broadcast included, over its steps), the final test loss, and the
machine's idle CPU while it trained with its label (`gradmesh.bench.harness.label`: `cpu` when
the cores were the limit, the hosts sharing this machine's, so that run's seconds are this
machine's, not the link's; `link` when its bytes filled the link; `compute` otherwise).
The comparisons:
- `bytes_ratio`: synchronous bytes a step over DiLoCo's;
- `loss_gap`: DiLoCo's final test loss over the synchronous run's, less 1 (the same tokens);
- `time_to_loss_speedup`: the loss both runs reach (the larger of their final test losses), and
  the training seconds each took to first score at or below it, the synchronous run's over
  DiLoCo's (from the first round's scoring: the curves are not averaged).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import (
    check_train_flags,
    emulated_train,
    interleaved,
    label,
    medians,
    report,
)
from gradmesh.errors import GradmeshError
from gradmesh.options import option
from gradmesh.units import parse_rate

STRATEGIES = ("allreduce", "diloco")


@dataclass
class Config:
    """gradmesh bench diloco: DiLoCo against synchronous data parallelism on emulated hosts:
    bytes a step, wall-clock to the same loss, the loss after the same tokens"""

    hosts: int = option(4, "emulated hosts, one worker each")
    bandwidth: str = option("100mbit", "link rate per host")
    model: str = option("gpt", "model", name=True)
    model_args: str = option("", "the model's --model-args")
    dataset: str = option("text", "dataset", name=True)
    batch_per_worker: int = option(8, "samples each worker computes per step")
    steps: int = option(1000, "steps of each run (the same tokens for both)")
    sync_every: int = option(100, "DiLoCo's inner steps between outer steps (H)")
    compression: str = option("int8", "DiLoCo's outer-gradient compressor", name=True)
    optimizer: str = option("adamw", "the (inner) optimizer of both runs", name=True)
    lr: float = option(0.002, "the (inner) learning rate of both runs")
    outer_lr: float = option(0.7, "DiLoCo's outer Nesterov SGD learning rate")
    outer_momentum: float = option(0.9, "DiLoCo's outer Nesterov momentum")
    eval_every: int = option(0, "score the test split every N steps (0: --sync-every)")
    pretrain_steps: int = option(
        0,
        "first train synchronously N steps, once, and start both runs from those weights "
        "(the paper's protocol: DiLoCo from a pretrained model)",
    )
    rounds: int = option(1, "interleaved rounds")
    json: str | None = option(None, "write the result here")


def _flags(strategy: str, args: Config, steps: int, init: str = "") -> list[str]:
    flags = ["--strategy", strategy, "--workers", str(args.hosts)]
    flags += ["--batch-size", str(args.batch_per_worker * args.hosts)]
    flags += ["--model", args.model, "--dataset", args.dataset]
    flags += ["--model-args", args.model_args] if args.model_args else []
    flags += ["--optimizer", args.optimizer, "--lr", str(args.lr)]
    flags += ["--max-steps", str(steps), "--epochs", "1000000"]
    flags += ["--init-from", init] if init else []
    flags += ["--eval-every", str(args.eval_every or args.sync_every)]
    if strategy == "diloco":
        flags += ["--sync-every", str(args.sync_every), "--compression", args.compression]
        flags += ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    return flags


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    steps = max(r["steps"], 1)
    return {
        "step_s": r["wall_s"] / steps,
        "bytes_per_worker_step": r["bytes_sent"] / steps,
        "test_loss": r["test_loss"],
        "test_accuracy": r["test_accuracy"],
        "cpu_idle": r["cpu_idle"],
    }


def _seconds_to(history: list[dict[str, float]], loss: float) -> float | None:
    """Training seconds before the first scoring at or below `loss` (None: never)."""
    return next((e["seconds"] for e in history if e["test_loss"] <= loss), None)


def compare(sync: dict[str, Any], diloco: dict[str, Any]) -> dict[str, Any]:
    """The three comparisons from the two runs' figures and first-round scoring histories."""
    target = max(sync["test_loss"], diloco["test_loss"])
    t_sync = _seconds_to(sync["eval_history"], target)
    t_diloco = _seconds_to(diloco["eval_history"], target)
    return {
        "bytes_ratio": sync["bytes_per_worker_step"] / diloco["bytes_per_worker_step"],
        "loss_gap": diloco["test_loss"] / sync["test_loss"] - 1,
        "target_loss": target,
        "seconds_to_target": {"allreduce": t_sync, "diloco": t_diloco},
        "time_to_loss_speedup": t_sync / t_diloco if t_sync and t_diloco else None,
    }


def _lines(payload: dict[str, Any]) -> list[str]:
    c = payload["comparison"]
    lines = [f"{payload['network']}; {payload['setting']}"]
    if payload["pretrained"]:
        p = payload["pretrained"]
        lines.append(f"both from {p['steps']} synchronous steps (test loss {p['test_loss']:.4f})")
    for s, f in payload["strategies"].items():
        lines.append(
            f"{s:9}: {f['step_s'] * 1e3:.1f} ms/step, {f['bytes_per_worker_step'] / 1e3:.1f} "
            f"kB/worker/step, test loss {f['test_loss']:.4f}, cpu idle {f['cpu_idle']:.2f} "
            f"({f['limit']}, link {f['link_utilization']:.2f} used)"
        )
    speed = c["time_to_loss_speedup"]
    lines.append(
        f"bytes a step {c['bytes_ratio']:.0f}x fewer; loss after the same tokens "
        f"{c['loss_gap'] * 100:+.1f} %; to test loss {c['target_loss']:.4f}: "
        + (f"{speed:.2f}x faster" if speed else "not reached by both runs")
    )
    return lines


def _pretrain(args: Config, tmp: Path, figures: dict[str, Any]) -> str:
    """Train synchronously `--pretrain-steps` on the same hosts and export the weights both
    runs start from; `figures` gets that run's steps, test loss and seconds (counted in
    neither run)."""
    from gradmesh.train.export import export

    steps, ck = args.pretrain_steps, tmp / "pretrain"
    flags = _flags("allreduce", args, steps) + ["--checkpoint-dir", str(ck)]
    flags += ["--checkpoint-every", str(steps)]
    done = emulated_train(flags, args.hosts, args.bandwidth, tmp / "pretrain.json", "pretraining")
    export(str(ck), str(tmp / "pretrained"), "safetensors")
    figures.update(steps=steps, test_loss=done["test_loss"], wall_s=done["wall_s"])
    return str(tmp / "pretrained")


def run(args: Config, _command: list[str] | None = None) -> int:
    if min(args.hosts, args.batch_per_worker, args.steps, args.sync_every, args.rounds) < 1:
        raise GradmeshError(
            "--hosts, --batch-per-worker, --steps, --sync-every and --rounds must be >= 1"
        )
    if args.pretrain_steps < 0:
        raise GradmeshError(f"--pretrain-steps must be >= 0, not {args.pretrain_steps}")
    every = args.eval_every or args.sync_every
    if every < 1 or every % args.sync_every:
        raise GradmeshError(
            f"--eval-every {every} must be a multiple of --sync-every {args.sync_every} (where "
            "DiLoCo's replicas hold one model)"
        )
    check_train_flags(_flags(s, args, args.steps) for s in STRATEGIES)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    pretrained: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gradmesh-diloco-") as tmp:
        init = _pretrain(args, Path(tmp), pretrained) if args.pretrain_steps > 0 else ""
        for round_, s in interleaved(STRATEGIES, args.rounds):
            out = Path(tmp) / f"{s}-{round_}.json"
            flags = _flags(s, args, args.steps, init)
            runs[s].append(emulated_train(flags, args.hosts, args.bandwidth, out, s))
    figures = {}
    for s, rs in runs.items():
        f = medians([_figures(r) for r in rs])
        f["wire_bytes_per_step"] = f["bytes_per_worker_step"]
        label(f, parse_rate(args.bandwidth))  # cpu, link (its bytes fill it) or compute
        f["eval_history"] = rs[0]["eval_history"]
        f["test_loss_rounds"] = [r["test_loss"] for r in rs]
        figures[s] = f
    payload = {
        "network": f"{args.hosts} emulated hosts at {args.bandwidth}, one worker each",
        "setting": (
            f"{args.model} {args.model_args} on {args.dataset}, {args.steps} steps of "
            f"{args.batch_per_worker} samples a worker, {args.optimizer} lr {args.lr}; DiLoCo H "
            f"{args.sync_every}, {args.compression}, outer lr {args.outer_lr} momentum "
            f"{args.outer_momentum}"
        ),
        "rounds": args.rounds,
        "pretrained": pretrained or None,
        "strategies": figures,
        "comparison": compare(figures["allreduce"], figures["diloco"]),
    }
    return report(args.json, payload, _lines(payload))
