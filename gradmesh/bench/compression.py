"""`gradmesh bench compression`: every compressor on one model over a slow link, interleaved.

Each engine trains its own copy of the model (same initial weights, same batches of real digits)
in the same worker processes: gradmesh's DistributedOptimizer with each compressor, plus two DDP
engines with PowerSGD at the same rank, torch's own hook (`powerSGD_hook`, error feedback and
warm start on, compression from its second step) and gradmesh's compressor as a DDP hook. Rounds
give every engine a turn of `--chunk` steps, in an order rotated each round; a turn's time is
the slowest rank's, after a barrier. An engine trains until its test accuracy (evaluated after
each turn, off the clock) reaches `--target` and it has had `--min-rounds` timed turns, or until
`--max-epochs`.

Reported per engine: step time (median over turns after the first, which warms up), bytes per
step and worker as the emulated host's interface counted them (every byte on the wire, headers
included; none on loopback) and as gradmesh's collectives counted their messages, time and steps
to the target (training time only, at the resolution of one turn), the machine's idle CPU
during the engine's turns and the fraction of the link's rate its bytes used (the limit: `cpu`
when the cores were idle under 10 % of the time, `link` when the bytes filled half the link or
more, otherwise `compute`), and ratios against no compression and against torch's hook, all
from the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradmesh.bench.harness import (
    check_link,
    label,
    median,
    network,
    shutdown_after_ddp,
    timed_turn,
)
from gradmesh.compression.config import READ_BY
from gradmesh.errors import GradmeshError
from gradmesh.launch.jobs import emulated_cluster, run_workers, worker_main, write_json
from gradmesh.options import option, refuse_unread
from gradmesh.train.checks import check_rates
from gradmesh.units import parse_list

TORCH_HOOK = "torch-powersgd"
"""DDP with torch's PowerSGD hook."""
OUR_HOOK = "powersgd-ddp-hook"
"""DDP with gradmesh's powersgd compressor as its hook."""
REFERENCE = "none"
FUSION_MB = 64.0
"""Every engine's bucket size (gradmesh's default; given to DDP explicitly, which also drops its
1 MB first bucket: with two buckets torch's PowerSGD hook chains collectives from two threads
and hangs on gloo)."""


def engines() -> list[str]:
    from gradmesh.compression.registry import COMPRESSORS

    return [REFERENCE, *(n for n in COMPRESSORS.names() if n != REFERENCE), OUR_HOOK, TORCH_HOOK]


@dataclass
class Config:
    """gradmesh bench compression: every compressor over a slow link: bytes, step time, time to
    accuracy, torch's hook"""

    world: int = option(2, "workers", at_least=2)
    engines: str | None = option(None, "comma-separated")
    model: str = option("alexnet", "a registered model", name=True)
    batch_size: int = option(64, "global batch", at_least=1)
    lr: float = option(0.05, "SGD learning rate")
    momentum: float = option(0.9, "SGD momentum")
    ratio: float = option(0.01, "topk's fraction (0.01)")
    rank: int = option(4, "PowerSGD's rank")
    allreduce: str = option("native", "gradmesh's allreduce algorithm")
    target: float = option(0.95, "test accuracy to reach")
    chunk: int = option(10, "steps per turn", at_least=1)
    min_rounds: int = option(5, "timed turns at least", at_least=1)
    max_epochs: int = option(15, "give up after", at_least=1)
    emulate_hosts: int | None = option(None, "spread the workers over H hosts", at_least=1)
    bandwidth: str = option("100mbit", "emulated link rate (100mbit)")
    json: str | None = option(None, "write the result here")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.collectives import ALGORITHMS
    from gradmesh.compression.registry import make
    from gradmesh.models.registry import MODELS, check_pairing

    check_link(args)
    MODELS.get(args.model)
    check_pairing(args.model, "digits")
    ALGORITHMS.get(args.allreduce)
    make("powersgd", args.ratio, args.rank)  # checks the ratio and the rank
    chosen = parse_list(args.engines, "engine") if args.engines else engines()
    unknown = [e for e in chosen if e not in engines()]
    if unknown:
        raise GradmeshError(f"unknown engine {unknown[0]!r} (valid: {', '.join(engines())})")
    for dest, owner in READ_BY.items():
        readers = {owner, OUR_HOOK, TORCH_HOOK} if owner == "powersgd" else {owner}
        if not readers & set(chosen):
            refuse_unread(
                args, (dest,), f"{owner}'s option; --engines {args.engines} has none that reads it"
            )
    check_rates(args.lr, args.momentum)
    if not 0 < args.target <= 1:
        raise GradmeshError(f"--target is a test accuracy: in (0, 1], got {args.target}")
    if args.batch_size % args.world:
        raise GradmeshError(f"--batch-size {args.batch_size} must split evenly over {args.world}")
    keys = ("model", "batch_size", "lr", "momentum", "ratio", "rank", "allreduce", "target")
    config = {k: getattr(args, k) for k in keys}
    config.update(
        engines=chosen, chunk=args.chunk, min_rounds=args.min_rounds, max_epochs=args.max_epochs
    )
    with emulated_cluster(args.emulate_hosts, args.bandwidth) as cluster:
        result = run_workers("gradmesh.bench.compression", args.world, config, 1800.0, cluster)
        result["network"] = network(cluster)
    for r in result["engines"].values():
        label(r, cluster.bandwidth_bps if cluster else None)
    compare(result)
    write_json(args.json, result)
    print(f"model {result['model']}, world {result['world']}, {result['network']}:")
    for name, r in result["engines"].items():
        wire = r["wire_bytes_per_step"]
        reached = (
            f"{r['time_to_target_s']:.1f} s ({r['steps_to_target']} steps)"
            if r["time_to_target_s"] is not None
            else f"not reached (best {r['best_accuracy']:.3f})"
        )
        print(
            f"  {name:18s} {r['step_s'] * 1e3:8.1f} ms/step  "
            + (f"{wire / 1e6:7.3f} MB/step on the wire  " if wire is not None else "")
            + f"to {result['target']}: {reached}  ({r['limit']})"
        )
    for line in result["summary"]:
        print("  " + line)
    return 0


def compare(result: dict[str, Any]) -> None:
    """Ratios against no compression and torch's hook, and the issue's targets where the run
    holds the engines they compare."""
    runs = result["engines"]
    ref = runs.get(REFERENCE)
    for r in runs.values():
        bytes_key = "wire_bytes_per_step" if r["wire_bytes_per_step"] is not None else None
        r["bytes_ratio"] = (
            r[bytes_key] / ref[bytes_key]
            if ref is not None and bytes_key and ref[bytes_key]
            else None
        )
        r["speedup"] = ref["step_s"] / r["step_s"] if ref is not None else None
        reached = ref is not None and None not in (r["time_to_target_s"], ref["time_to_target_s"])
        r["time_to_target_ratio"] = (
            r["time_to_target_s"] / ref["time_to_target_s"] if reached else None
        )
    summary, targets = [], {}
    if "int8" in runs and ref is not None:
        int8 = runs["int8"]
        if int8["bytes_ratio"] is not None:
            targets["int8_bytes_ratio<=0.27"] = int8["bytes_ratio"] <= 0.27
        targets["int8_speedup>=2.5"] = int8["speedup"] >= 2.5
        summary.append(
            f"int8: {_fmt(int8['bytes_ratio'])} of the bytes, step {int8['speedup']:.2f}x faster"
        )
    if "topk" in runs and ref is not None:
        ratio = runs["topk"]["time_to_target_ratio"]
        targets["topk_time_to_target_ratio<=0.5"] = ratio is not None and ratio <= 0.5
        summary.append(f"topk: time to {result['target']} {_fmt(ratio)} of no compression's")
    for ours in ("powersgd", OUR_HOOK):
        if ours in runs and TORCH_HOOK in runs:
            ratio = runs[ours]["step_s"] / runs[TORCH_HOOK]["step_s"]
            result[f"{ours}_vs_torch_step_ratio"] = ratio
            if ours == "powersgd":
                targets["powersgd_step_vs_torch<=1.05"] = ratio <= 1.05
            summary.append(
                f"{ours}: step {ratio:.3f}x torch's PowerSGD hook at rank {result['rank']}"
            )
    result["targets"] = targets
    result["summary"] = summary


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _wire_bytes() -> int | None:
    """Bytes this process's network namespace has sent on the emulated host's interface; None
    outside an emulated cluster."""
    import os

    from gradmesh.launch.emulate import CLUSTER_ENV

    iface = os.environ.get(CLUSTER_ENV["iface"])
    with open("/proc/net/dev") as f:  # the reading process's own namespace
        for line in f:
            name, _, counters = line.partition(":")
            if iface and name.strip() == iface:
                return int(counters.split()[8])
    return None


@dataclass
class Engine:
    """One engine's model, its step, and what was measured of it."""

    name: str
    model: Any
    """The model itself (inside DDP for the hooks: evaluating through DDP would communicate)."""
    step: Callable[[Any, Any], None]
    steps: int = 0
    train_s: float = 0.0
    turns: list[float] = field(default_factory=list)
    """Seconds per step of each timed turn."""
    wire: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)
    idle: list[int] = field(default_factory=lambda: [0, 0])
    best: float = 0.0
    reached: tuple[float, int] | None = None


class _Workload:
    """The digits every engine trains on, batch by batch, and the model each starts from."""

    def __init__(self, config: dict[str, Any], rank: int, size: int) -> None:
        from gradmesh.data import DATASETS, DataOptions

        self.config, self.rank = config, rank
        self.spec = DATASETS.get("digits")(DataOptions())
        self.batch, self.per_rank = config["batch_size"], config["batch_size"] // size
        self.per_epoch = len(self.spec.train) // self.batch
        self.max_steps = self.per_epoch * config["max_epochs"]

    def batch_at(self, step: int) -> tuple[Any, Any]:
        import torch

        epoch, k = divmod(step, self.per_epoch)
        order = torch.randperm(
            len(self.spec.train), generator=torch.Generator().manual_seed(epoch), device="cpu"
        )
        first = k * self.batch + self.rank * self.per_rank
        rows = order[first : first + self.per_rank]
        return self.spec.train.x[rows], self.spec.train.y[rows]

    def build(self) -> Any:
        import torch

        from gradmesh.models.registry import MODELS

        torch.manual_seed(0)
        return MODELS.get(self.config["model"])(self.spec.input_shape, self.spec.num_classes)

    def accuracy(self, model: Any) -> float:
        import torch

        with torch.no_grad():
            right = (model(self.spec.test.x).argmax(1) == self.spec.test.y).sum()
        return float(right) / len(self.spec.test)


def _make_engine(name: str, work: _Workload) -> Engine:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from gradmesh.compression.registry import make
    from gradmesh.sync.data_parallel.ddp_hook import ddp_comm_hook
    from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer

    config, model = work.config, work.build()

    def stepper(net: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any, Any], None]:
        def step(x: Any, y: Any) -> None:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()

        return step

    def sgd(net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(net.parameters(), lr=config["lr"], momentum=config["momentum"])

    if name in (OUR_HOOK, TORCH_HOOK):
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=FUSION_MB)
        if name == TORCH_HOOK:
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=config["rank"],
                start_powerSGD_iter=2,
                random_seed=0,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            hook = ddp_comm_hook(config["allreduce"], make("powersgd", rank=config["rank"]))
            ddp.register_comm_hook(None, hook)
        return Engine(name, model, stepper(ddp, sgd(ddp)))
    opt = DistributedOptimizer(
        sgd(model),
        named_parameters=model.named_parameters(),
        allreduce=config["allreduce"],
        compression=make(name, config["ratio"], config["rank"]),
        fusion_mb=FUSION_MB,
    )
    return Engine(name, model, stepper(model, opt))


def _turn(e: Engine, work: _Workload, rt: Any, timed: bool) -> None:
    """One turn of engine `e`: `--chunk` steps timed on the slowest rank, then its test accuracy
    (off the clock); a timed turn's seconds, bytes and idle CPU are kept."""
    import torch
    import torch.distributed as dist

    config = work.config
    chunk = min(config["chunk"], work.max_steps - e.steps)
    batches = [work.batch_at(e.steps + i) for i in range(chunk)]
    wire, counted = _wire_bytes(), rt.comm.bytes_sent

    def steps() -> None:
        for x, y in batches:
            e.step(x, y)

    turn = timed_turn(steps)
    e.steps += chunk
    e.model.eval()
    best = torch.tensor(
        [work.accuracy(e.model) if rt.rank == 0 else 0.0], dtype=torch.float64, device=rt.device
    )
    e.model.train()
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    e.train_s += turn.seconds
    e.best = max(e.best, float(best[0]))
    if e.reached is None and e.best >= config["target"]:
        e.reached = (e.train_s, e.steps)
    if timed and chunk == config["chunk"]:
        e.turns.append(turn.seconds / chunk)
        if wire is not None:
            e.wire.append(((_wire_bytes() or 0) - wire) // chunk)
        e.counted.append((rt.comm.bytes_sent - counted) // chunk)
        e.idle[0] += turn.idle
        e.idle[1] += turn.total


def _result(runs: list[Engine], work: _Workload, rt: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if any(not e.turns for e in runs):
        raise GradmeshError("an engine had no timed turn: raise --max-epochs or lower --chunk")
    wires = torch.tensor(
        [median(e.wire) if e.wire else -1.0 for e in runs], dtype=torch.float64, device=rt.device
    )
    dist.all_reduce(wires)  # the mean over workers
    result: dict[str, Any] = {
        "world": rt.size,
        "steps_per_epoch": work.per_epoch,
        **{k: v for k, v in work.config.items() if k != "engines"},
        "engines": {},
    }
    for e, wire_sum in zip(runs, wires.tolist(), strict=True):
        result["engines"][e.name] = {
            "step_s": median(e.turns),
            "timed_turns": len(e.turns),
            "wire_bytes_per_step": wire_sum / rt.size if wire_sum >= 0 else None,
            "counted_bytes_per_step": median(e.counted) if e.name != TORCH_HOOK else None,
            "time_to_target_s": e.reached[0] if e.reached else None,
            "steps_to_target": e.reached[1] if e.reached else None,
            "best_accuracy": e.best,
            "steps": e.steps,
            "cpu_idle": e.idle[0] / e.idle[1] if e.idle[1] else 0.0,
        }
    return result


def _measure(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from gradmesh.runtime.world import init

    rt = init()
    work = _Workload(config, rt.rank, rt.size)
    runs = [_make_engine(name, work) for name in config["engines"]]
    for round_ in range(10**6):  # engines leave once at the target with enough timed turns
        active = [
            e
            for e in runs
            if e.steps < work.max_steps
            and (e.reached is None or len(e.turns) < config["min_rounds"])
        ]
        if not active:
            break
        shift = round_ % len(active)
        for e in active[shift:] + active[:shift]:
            _turn(e, work, rt, timed=round_ > 0)  # the first turn warms up
    result = _result(runs, work, rt)
    rank = rt.rank
    runs.clear()  # DDP's reducers go before the process group
    shutdown_after_ddp()
    return rank, result


if __name__ == "__main__":
    worker_main(_measure)
