"""`gradmesh bench dataparallel`: gradmesh's DistributedOptimizer against torch DDP.

Both engines train the same model from the same weights on the same batches (synthetic inputs of
the model's shape). Each round times `--steps` steps of one engine then of the other (the order
alternates), after a warm-up round; a step time is the slowest rank's. Reported: the median step
time of each and ratio = gradmesh / ddp (below 1.0: gradmesh is faster). DDP uses 25 MB buckets,
its default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import (
    Turn,
    check_link,
    interleaved,
    label,
    median,
    network,
    shutdown_after_ddp,
    timed_turn,
)
from gradmesh.launch.jobs import emulated_cluster, run_workers, worker_main, write_json
from gradmesh.options import option


@dataclass
class Config:
    """gradmesh bench dataparallel: gradmesh's DistributedOptimizer against torch DDP."""

    world: int = option(2, "workers", at_least=1)
    model: str = option("cnn", "a registered model", name=True)
    dataset: str = option("digits", "input shape from this dataset", name=True)
    batch_size: int = option(64, "global batch", at_least=1)
    steps: int = option(20, "steps per timed round", at_least=1)
    rounds: int = option(10, "timed rounds per engine", at_least=1)
    allreduce: str = option("native", "gradmesh's allreduce algorithm")
    emulate_hosts: int | None = option(None, "spread the workers over H hosts", at_least=1)
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.collectives import ALGORITHMS
    from gradmesh.data import DATASETS
    from gradmesh.errors import GradmeshError
    from gradmesh.models.registry import MODELS, check_pairing

    check_link(args)
    MODELS.get(args.model)
    DATASETS.get(args.dataset)
    check_pairing(args.model, args.dataset)
    ALGORITHMS.get(args.allreduce)
    if args.world < 2 or args.steps < 1 or args.rounds < 1 or args.batch_size < args.world:
        raise GradmeshError("need --world >= 2, --steps >= 1, --rounds >= 1, batch >= world")
    config = {
        k: getattr(args, k)
        for k in ("model", "dataset", "batch_size", "steps", "rounds", "allreduce")
    }
    result = measure(config, args.world, args.emulate_hosts, args.bandwidth, 300.0)
    write_json(args.json, result)
    print(
        f"world {result['world']}, model {result['model']}: gradmesh "
        f"{result['gradmesh_step_s'] * 1e3:.2f} ms/step, DDP {result['ddp_step_s'] * 1e3:.2f} "
        f"ms/step, ratio {result['ratio']:.3f} ({result['network']})"
    )
    return 0


def measure(
    config: dict[str, Any],
    world: int,
    hosts: int | None,
    bandwidth: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Run the engines of `config` on `world` workers (over `hosts` emulated hosts, or loopback)
    and label what limited each: `limit` from its idle CPU and a ring allreduce's modelled
    bytes per step against the emulated link (see `label`)."""
    with emulated_cluster(hosts, bandwidth) as cluster:
        result: dict[str, Any] = run_workers(
            "gradmesh.bench.dataparallel", world, config, timeout_s, cluster
        )
        result["network"] = network(cluster)
    ring_bytes = 2 * (world - 1) / world * result["gradient_bytes"]
    result["limit"] = {}
    for name, step_s in result["step_s"].items():
        engine = {"wire_bytes_per_step": ring_bytes, "step_s": step_s}
        engine["cpu_idle"] = result["cpu_idle"][name]
        label(engine, cluster.bandwidth_bps if cluster else None)
        result["limit"][name] = engine["limit"]
    return result


def _engine(name: str, build: Callable[[], Any], allreduce: str) -> tuple[Any, Any]:
    """(model, optimizer) of engine `name`: DDP, the Horovod drop-in as a script calls it, or
    gradmesh's own DistributedOptimizer; each from the same initial weights."""
    import torch
    from torch import nn

    from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer, broadcast_parameters

    model = build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "ddp":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25), sgd
    broadcast_parameters(model.state_dict())
    if name == "horovod":
        import gradmesh.horovod as hvd

        return model, hvd.DistributedOptimizer(sgd, model.named_parameters())
    return model, DistributedOptimizer(sgd, model.named_parameters(), allreduce=allreduce)


def _measure(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from gradmesh.data import DATASETS, DataOptions
    from gradmesh.models.registry import MODELS
    from gradmesh.runtime.world import init

    rt = init()
    shape = tuple(config.get("shape", DataOptions.shape))
    spec = DATASETS.get(config["dataset"])(DataOptions(shape=shape, samples=64))
    per_rank = config["batch_size"] // rt.size
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn((per_rank, *spec.input_shape), generator=g, device="cpu")
    y = torch.randint(0, spec.num_classes, (per_rank,), generator=g, device="cpu")

    def build() -> Any:
        torch.manual_seed(0)
        return MODELS.get(config["model"])(spec.input_shape, spec.num_classes)

    names = config.get("engines", ["gradmesh", "ddp"])
    engines = {name: _engine(name, build, config["allreduce"]) for name in names}

    def steps(name: str) -> Callable[[], None]:
        model, opt = engines[name]

        def run() -> None:
            for _ in range(config["steps"]):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()

        return run

    turns: dict[str, list[Turn]] = {name: [] for name in names}
    for round_, name in interleaved(names, config["rounds"] + 1):  # round 0 warms up
        turn = timed_turn(steps(name))
        if round_:
            turns[name].append(turn)
    step_s = {n: median([t.seconds for t in ts]) / config["steps"] for n, ts in turns.items()}
    result: dict[str, Any] = {
        "world": rt.size,
        "model": config["model"],
        "input_shape": list(spec.input_shape),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in build().parameters()),
        "step_s": step_s,
        "cpu_idle": {
            n: sum(t.idle for t in ts) / max(sum(t.total for t in ts), 1) for n, ts in turns.items()
        },
        **{k: config[k] for k in ("batch_size", "allreduce", "rounds")},
        "steps_per_round": config["steps"],
    }
    if {"gradmesh", "ddp"} <= step_s.keys():
        result["gradmesh_step_s"], result["ddp_step_s"] = step_s["gradmesh"], step_s["ddp"]
        result["ratio"] = step_s["gradmesh"] / step_s["ddp"]
    rank = rt.rank
    engines.clear()  # DDP's reducers go before the process group
    shutdown_after_ddp()
    return rank, result


def _idle(turns: list[Turn]) -> float:
    """The machine's idle CPU share over `turns`."""
    return sum(t.idle for t in turns) / max(sum(t.total for t in turns), 1)


if __name__ == "__main__":
    worker_main(_measure)
