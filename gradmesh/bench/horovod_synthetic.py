"""`gradmesh bench horovod-synthetic`: Horovod's synthetic benchmark through the drop-in, next to
the same model under gradmesh's own API and under torch DDP.

Horovod's `pytorch_synthetic_benchmark.py` trains a model on random images of a fixed batch per
worker and reports images/s. Here the three engines (the `gradmesh.horovod` drop-in, gradmesh's
`DistributedOptimizer` with its defaults, DDP with its 25 MB buckets) train their own copies from
the same weights on the same random batch, in the same worker processes: rounds of
`--batches-per-round` steps each, the engines' order rotated every round, the first round a
warm-up; images/s = world x batch per worker / median step time (the slowest rank's). The drop-in
adds only argument handling in front of gradmesh's optimizer, so its target is 0.95x or more of
gradmesh's own images/s. The machine's idle CPU during each engine's rounds is recorded, and
each engine's `limit` is `cpu` (idle below 10 %), `link` (a ring allreduce's modelled bytes per
step fill half the emulated link or more), `compute` or `loopback` (no emulated link).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.bench.dataparallel import measure
from gradmesh.bench.harness import check_link
from gradmesh.launch.jobs import write_json
from gradmesh.options import option

ENGINES = ["horovod", "gradmesh", "ddp"]
TARGET = 0.95
"""The drop-in's images/s over gradmesh's own API's, at least."""


@dataclass
class Config:
    """gradmesh bench horovod-synthetic: Horovod's synthetic benchmark: the drop-in against
    gradmesh's API and DDP, img/s"""

    world: int = option(2, "workers", at_least=1)
    model: str = option("alexnet", "a registered model", name=True)
    image_size: int = option(32, "square RGB images", at_least=1)
    batch_size: int = option(32, "images per worker", at_least=1)
    batches_per_round: int = option(10, "steps per timed round", at_least=1)
    rounds: int = option(10, "timed rounds per engine", at_least=1)
    emulate_hosts: int | None = option(None, "spread the workers over H hosts", at_least=1)
    bandwidth: str = option("1gbit", "emulated link rate")
    json: str | None = option(None, "write the result here")


def run(args: Config, _command: list[str] | None = None) -> int:
    from gradmesh.errors import GradmeshError
    from gradmesh.models.registry import MODELS

    check_link(args)
    MODELS.get(args.model)
    if args.world < 2 or args.batches_per_round < 1 or args.rounds < 1 or args.batch_size < 1:
        raise GradmeshError("need --world >= 2, --batches-per-round >= 1, --rounds >= 1")
    if args.image_size < 8 or args.image_size % 8:
        raise GradmeshError(f"--image-size must be a multiple of 8, got {args.image_size}")
    config = {
        "model": args.model,
        "dataset": "synthetic",
        "shape": [3, args.image_size, args.image_size],
        "batch_size": args.batch_size * args.world,
        "steps": args.batches_per_round,
        "rounds": args.rounds,
        "allreduce": "native",
        "engines": ENGINES,
    }
    measured = measure(config, args.world, args.emulate_hosts, args.bandwidth, 600.0)
    network = measured["network"]
    images = {n: config["batch_size"] / s for n, s in measured["step_s"].items()}
    ratio = images["horovod"] / images["gradmesh"]
    result = {
        **measured,
        "network": network,
        "batch_per_worker": args.batch_size,
        "images_per_s": images,
        "horovod_over_gradmesh": ratio,
        "horovod_over_ddp": images["horovod"] / images["ddp"],
        "target_met": ratio >= TARGET,
    }
    write_json(args.json, result)
    for name in ENGINES:
        print(f"{name:9s} {images[name]:8.1f} img/s (limit: {measured['limit'][name]})")
    print(
        f"drop-in / gradmesh {ratio:.3f} (target >= {TARGET}), drop-in / DDP "
        f"{result['horovod_over_ddp']:.3f}; {args.model} on {args.image_size}x{args.image_size} "
        f"images, {args.world} workers ({network})"
    )
    return 0
