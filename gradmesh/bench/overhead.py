"""`gradmesh bench overhead`: the trainer's step against a plain PyTorch loop, in one process.

Both sides train the same model (built with the same seed), on the same batch, at the same
precision, with the same torch optimizer, on whatever device the machine has (`--device`):

- **trainer**: the job `gradmesh train --workers 1` builds (`setup`, `attach`: the strategy's
  optimizer wrapper, the sharder), stepped by the loop's own `_Run.one_step` on the first batch
  of epoch 0, read each step as the loop reads it (`loop.reader`: on a GPU, the next step's
  on a background thread), its loss added on the device into a (sum, count) tensor as the
  loop does;
- **plain**: `opt.zero_grad()`, forward and loss under the same autocast, `backward()`,
  `opt.step()`, the batch on the device already, the loss summed on the device (no `.item()`).

The two alternate turn by turn (`interleaved`: A B, B A, ...), each turn `--warmup` untimed
steps then `--steps` timed ones; a CUDA device is synchronised before each timer is read, never
inside a step. A side's figure is the median over `--rounds` of its turns' mean step. Reported:
each side's ms a step and tokens (or samples) per second, the ratio trainer / plain, the
framework's overhead in ms a step, the optimizer kernels torch chose (fused, foreach or a loop),
each side's loss after its first step (the same weights and batch: equal to rounding) and after
its last turn, and the machine's idle CPU (`limit`: `cpu` under 10 %, as every benchmark).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradmesh.bench.harness import interleaved, limit_of, median, report
from gradmesh.errors import GradmeshError
from gradmesh.options import option
from gradmesh.train.checks import check_rates

SIDES = ("trainer", "plain")


@dataclass
class Config:
    """gradmesh bench overhead: the trainer's step against a plain PyTorch loop on the same model,
    batch, precision and optimizer"""

    model: str = option("gpt", "model (a registered one)", name=True)
    model_args: str = option("dim=128,depth=2,heads=4", "the model builder's keyword arguments")
    dataset: str = option("text", "dataset (text for token models)", name=True)
    batch: int = option(16, "samples per step")
    sequence_length: int = option(128, "token models: tokens per sample", at_least=1)
    precision: str = option(
        "fp32", "fp32, or bf16 (forward under autocast)", choices=("fp32", "bf16")
    )
    optimizer: str = option(
        "adamw", "torch's optimizer with its defaults", choices=("sgd", "adamw")
    )
    lr: float = option(1e-3, "learning rate")
    device: str = option(
        "auto", "auto (cuda when available), cpu or cuda", choices=("auto", "cpu", "cuda")
    )
    compile: bool = option(
        False,
        "both sides compiled: the trainer with its --compile (in this world of one, the whole "
        "model), the plain loop's model whole (torch.compile(model), as a script does)",
    )
    steps: int = option(10, "timed steps per side and turn")
    warmup: int = option(3, "untimed steps per side before each turn's timed ones")
    rounds: int = option(5, "interleaved rounds (each side one turn a round)")
    json: str | None = option(None, "write the result here")


@dataclass
class Side:
    """One side's step, how to read (and restart) its loss, and what it was measured at."""

    step: Callable[[], None]
    loss: Callable[[], float]
    """The mean loss over the steps since the last call (a host read: outside the timers)."""
    kernels: str
    zero_grad: str
    close: Callable[[], None] = lambda: None
    """Ends what the side started (the trainer's reader thread on a GPU)."""
    seconds: list[float] = field(default_factory=list)
    first_loss: float = 0.0


def _backend(device: str) -> str | None:
    """The runtime's backend for `--device` (gloo: the CPU, nccl: the GPU, None: auto)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise GradmeshError("--device cuda: torch sees no CUDA device here (use cpu or auto)")
    return {"cpu": "gloo", "cuda": "nccl"}.get(device)


def _train_config(args: Config) -> Any:
    from gradmesh.train.config import TrainConfig

    return TrainConfig.of(
        workers=1,
        epochs=1,
        model=args.model,
        model_args=args.model_args,
        dataset=args.dataset,
        sequence_length=args.sequence_length,
        batch_size=args.batch,
        precision=args.precision,
        optimizer=args.optimizer,
        lr=args.lr,
        compile=args.compile,
    )


def kernels(optimizer: Any) -> str:
    """How torch runs `optimizer`'s update: fused, foreach, or a Python loop over the tensors
    (what its defaults resolve to, as `Optimizer.step` resolves them)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "for-loop"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return "foreach" if foreach else "for-loop"


def _mean_of(sums: Any) -> Callable[[], float]:
    """Read `sums` (loss sum, count) as a mean, then zero it."""

    def read() -> float:
        mean = float(sums[0] / sums[1]) if float(sums[1]) else float("nan")
        sums.zero_()
        return mean

    return read


def trainer_side(args: Config, rt: Any) -> tuple[Side, Any]:
    """The trainer's job for a world of one, stepped by the loop's own `one_step` on a fixed
    batch; and the job (its data and indices make the plain side's batch)."""
    import torch

    from gradmesh.data.prefetch import prefetched
    from gradmesh.train.loop import Clock, _Run, reader
    from gradmesh.train.setup import attach, setup

    job = setup(_train_config(args), rt)
    attach(job)
    assert job.sharder is not None
    indices, global_count = next(iter(job.sharder.batches(0)))
    run = _Run(job, Clock(), None, None, 0)
    sums = torch.zeros(2, dtype=torch.float64, device=rt.device)
    parts = prefetched(itertools.repeat(indices), *reader(job))  # read as the loop reads

    def step() -> None:
        run.one_step(next(parts)[1], global_count, sums)

    side = Side(step, _mean_of(sums), kernels(job.optimizer), "set_to_none=False", parts.close)
    return side, (job, indices)


def plain_side(args: Config, job: Any, indices: Any) -> Side:
    """A plain PyTorch loop over the same model class, seed, batch, autocast and optimizer."""
    import torch
    import torch.nn.functional as F

    from gradmesh.layout.compile import BACKEND_ENV
    from gradmesh.layout.pipeline.engine import HALF
    from gradmesh.train.optimizers import fused
    from gradmesh.train.setup import load_data, model_of

    device = job.rt.device
    config = job.config
    torch.manual_seed(config.job.seed)  # as `setup` does: the same weights
    data = load_data(config)
    model = model_of(config, data).to(device)
    part = data.train.rows(indices)
    x, y = part.x.to(device), part.y.to(device)
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    kind, decay = fused(params), config.optimizer.weight_decay  # fused on CUDA: as the trainer
    if args.optimizer == "sgd":
        momentum = config.optimizer.momentum
        opt = torch.optim.SGD(params, lr=args.lr, momentum=momentum, weight_decay=decay, fused=kind)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=decay, fused=kind)
    if args.compile:
        model = torch.compile(model, backend=os.environ.get(BACKEND_ENV) or "inductor")  # type: ignore[assignment]
    half = HALF.get(args.precision)
    sums = torch.zeros(2, dtype=torch.float64, device=device)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=half) if half else contextlib.nullcontext():
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sums[0] += loss.detach()
        sums[1] += 1

    return Side(step, _mean_of(sums), kernels(opt), "set_to_none=True (torch's default)")


def _measure(args: Config, sides: dict[str, Side], sync: Callable[[], None]) -> None:
    """Interleaved turns: untimed warm-up steps, then the timed ones, the device synchronised
    before each timer is read; each turn's losses are read (and restarted) after its timer."""
    for side in sides.values():  # the first step of each on the same weights and batch
        side.step()
        side.first_loss = side.loss()
    for _, name in interleaved(SIDES, args.rounds):
        side = sides[name]
        for _ in range(args.warmup):
            side.step()
        sync()
        side.loss()
        started = time.perf_counter()
        for _ in range(args.steps):
            side.step()
        sync()
        side.seconds.append((time.perf_counter() - started) / args.steps)


def _describe_device(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _payload(args: Config, sides: dict[str, Side], device: Any, idle: float) -> dict[str, Any]:
    import torch

    from gradmesh.models.registry import is_token_model
    from gradmesh.runtime.device_guard import enabled as guarded

    tokens = is_token_model(args.model)
    per_step = args.batch * (args.sequence_length if tokens else 1)
    unit = "tokens" if tokens else "samples"
    results: dict[str, dict[str, Any]] = {}
    for name, side in sides.items():
        step_s = median(side.seconds)
        results[name] = {
            "step_ms": step_s * 1e3,
            f"{unit}_per_s": per_step / step_s,
            "step_ms_rounds": [s * 1e3 for s in side.seconds],
            "optimizer_kernels": side.kernels,
            "zero_grad": side.zero_grad,
            "first_loss": side.first_loss,
            "last_loss": side.loss(),
        }
    trainer, plain = results["trainer"]["step_ms"], results["plain"]["step_ms"]
    return {
        **{k: getattr(args, k) for k in ("model", "model_args", "dataset", "batch")},
        **{k: getattr(args, k) for k in ("sequence_length", "precision", "optimizer", "lr")},
        "compile": args.compile,
        **{"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "unit": unit},
        "device": _describe_device(device),
        "torch": torch.__version__,
        "trainer": results["trainer"],
        "plain": results["plain"],
        "ratio": trainer / plain,
        "overhead_ms": trainer - plain,
        "cpu_idle": idle,
        "limit": limit_of(idle, None),
        "device_guard": guarded(),  # GRADMESH_DEVICE_GUARD: a mode every torch call goes through
    }


def _lines(p: dict[str, Any]) -> list[str]:
    unit = p["unit"]
    lines = [
        f"{p['model']} ({p['model_args']}), batch {p['batch']}, {p['precision']}, "
        f"{p['optimizer']}{', compiled' if p['compile'] else ''}"
        f"{f' (the trainer: {c})' if (c := p.get('trainer_compiled')) else ''}, on {p['device']}, "
        f"torch {p['torch']}"
    ]
    for name in SIDES:
        r = p[name]
        lines.append(
            f"{name:8} {r['step_ms']:8.2f} ms a step  {r[f'{unit}_per_s']:10.0f} {unit}/s  "
            f"optimizer {r['optimizer_kernels']}, first loss {r['first_loss']:.4f}"
        )
    lines.append(
        f"trainer / plain {p['ratio']:.3f}: the framework costs {p['overhead_ms']:+.2f} ms a "
        f"step (medians of {p['rounds']} turns of {p['steps']} steps; cpu idle "
        f"{p['cpu_idle']:.2f}, limit {p['limit']}; load {p['load_average'][0]:.2f} before, "
        f"{p['load_average'][1]:.2f} after)"
    )
    return lines


def run(args: Config, _command: list[str] | None = None) -> int:
    import torch

    from gradmesh.runtime.process import cpu_jiffies, idle_since
    from gradmesh.runtime.world import init, shutdown

    if min(args.steps, args.rounds, args.batch) < 1 or args.warmup < 0:
        raise GradmeshError("--steps, --rounds and --batch must be >= 1, --warmup >= 0")
    check_rates(args.lr)
    rt = init(backend=_backend(args.device))
    sides: dict[str, Side] = {}
    try:
        sides["trainer"], (job, indices) = trainer_side(args, rt)
        sides["plain"] = plain_side(args, job, indices)
        cuda = rt.device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(rt.device)) if cuda else (lambda: None)
        cpu, load = cpu_jiffies(), os.getloadavg()[0]
        _measure(args, sides, sync)
        payload = _payload(args, sides, rt.device, idle_since(cpu))
        payload["load_average"] = [load, os.getloadavg()[0]]  # 1 minute, before and after
        payload["trainer_compiled"] = job.split.info.get("compiled")  # its scope, or None
    finally:
        for side in sides.values():
            side.close()
        shutdown()
    return report(args.json, payload, _lines(payload))
