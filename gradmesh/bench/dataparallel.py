"""`gradmesh bench dataparallel`: gradmesh's DistributedOptimizer against torch DDP.

Both engines train the same model from the same weights on the same batches (synthetic inputs of
the model's shape). Each round times `--steps` steps of one engine then of the other (the order
alternates), after a warm-up round; a step time is the slowest rank's. Reported: the median step
time of each and ratio = gradmesh / ddp (below 1.0: gradmesh is faster). DDP uses 25 MB buckets,
its default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gradmesh.bench.harness import label, median, shutdown_after_ddp
from gradmesh.launch.jobs import emulated_cluster, run_workers, worker_main, write_json
from gradmesh.options import option
from gradmesh.runtime.process import cpu_jiffies


@dataclass
class Config:
    """gradmesh bench dataparallel: gradmesh's DistributedOptimizer against torch DDP."""

    world: int = option(2, "workers")
    model: str = option("cnn", "a registered model", name=True)
    dataset: str = option("digits", "input shape from this dataset", name=True)
    batch_size: int = option(64, "global batch")
    steps: int = option(20, "steps per timed round")
    rounds: int = option(10, "timed rounds per engine")
    allreduce: str = option("native", "gradmesh's allreduce algorithm")
    emulate_hosts: int | None = option(None, "spread the workers over H hosts")
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.collectives import ALGORITHMS
    from gradmesh.data import DATASETS
    from gradmesh.errors import GradmeshError
    from gradmesh.models.registry import MODELS, check_pairing

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
        result["network"] = (
            f"{cluster.hosts} emulated hosts, {cluster.bandwidth_bps} bit/s"
            if cluster
            else "loopback, one machine"
        )
    ring_bytes = 2 * (world - 1) / world * result["gradient_bytes"]
    result["limit"] = {}
    for name, step_s in result["step_s"].items():
        engine = {"wire_bytes_per_step": ring_bytes, "step_s": step_s}
        engine["cpu_idle"] = result["cpu_idle"][name]
        label(engine, cluster.bandwidth_bps if cluster else None)
        result["limit"][name] = engine["limit"]
    return result


def _measure(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from gradmesh.data import DATASETS, DataOptions
    from gradmesh.models.registry import MODELS
    from gradmesh.runtime.world import init
    from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer, broadcast_parameters

    rt = init()
    shape = tuple(config.get("shape", DataOptions.shape))
    spec = DATASETS.get(config["dataset"])(DataOptions(shape=shape, samples=64))
    per_rank = config["batch_size"] // rt.size
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn((per_rank, *spec.input_shape), generator=g)
    y = torch.randint(0, spec.num_classes, (per_rank,), generator=g)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return MODELS.get(config["model"])(spec.input_shape, spec.num_classes)

    def engine(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = build()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        if name == "ddp":
            return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25), sgd
        broadcast_parameters(model.state_dict())
        if name == "horovod":  # the drop-in, called as a Horovod script calls it
            import gradmesh.horovod as hvd

            return model, hvd.DistributedOptimizer(sgd, model.named_parameters())
        named = model.named_parameters()
        return model, DistributedOptimizer(sgd, named, allreduce=config["allreduce"])

    names = config.get("engines", ["gradmesh", "ddp"])
    engines = {name: engine(name) for name in names}
    slowest = torch.zeros(1, dtype=torch.float64)
    times: dict[str, list[float]] = {name: [] for name in names}
    idle = {name: [0, 0] for name in names}
    for round_ in range(config["rounds"] + 1):  # round 0 warms up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # rotated
            model, opt = engines[name]
            dist.barrier()
            cpu = cpu_jiffies()
            started = time.perf_counter()
            for _ in range(config["steps"]):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                opt.step()
            slowest[0] = (time.perf_counter() - started) / config["steps"]
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_:
                times[name].append(float(slowest[0]))
                for i, (now, then) in enumerate(zip(cpu_jiffies(), cpu, strict=True)):
                    idle[name][i] += now - then
    step_s = {name: median(times[name]) for name in names}
    cpu_idle = {name: idle[name][0] / max(idle[name][1], 1) for name in names}
    result: dict[str, Any] = {
        "world": rt.size,
        "model": config["model"],
        "input_shape": list(spec.input_shape),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in build().parameters()),
        "step_s": step_s,
        "cpu_idle": cpu_idle,
        "batch_size": config["batch_size"],
        "allreduce": config["allreduce"],
        "rounds": config["rounds"],
        "steps_per_round": config["steps"],
    }
    if {"gradmesh", "ddp"} <= step_s.keys():
        result["gradmesh_step_s"], result["ddp_step_s"] = step_s["gradmesh"], step_s["ddp"]
        result["ratio"] = step_s["gradmesh"] / step_s["ddp"]
    rank = rt.rank
    del engines
    shutdown_after_ddp()
    return rank, result


if __name__ == "__main__":
    worker_main(_measure)
