"""`gradmesh simulate`: predicted step time, scaling efficiency and communication overhead of a
job on 8 to thousands of GPUs, from the cost formulas gradmesh runs on (one source of truth).

**Model.** The model is built on torch's meta device (a billion parameters cost no memory) and
run forward and backward under torch's FLOP counter, which gives every layer with weights its
forward and backward FLOPs (the convolutions and matrix products: the work that scales) and its
parameter bytes, in the order forward runs them.

**Compute.** A layer's seconds are its FLOPs over the device's achieved rate: peak times the
fraction a convnet's training step reaches (`DEVICES`; `--tflops`, `--achieved` override), or
for `cpu` the rate measured by running the model on this machine.

**Communication** comes from the collectives' registered formulas through the planner's `Links`
(`Links.allreduce_s`): two levels, within a node and across nodes (alpha = latency, beta = 1 /
bandwidth); a flat algorithm that spans nodes is priced on the across-node terms (its slowest
link), `hierarchical` as its two levels.

**Strategies** (`STRATEGIES`):
- `allreduce`: the planner's `predict` with every layer data-parallel: forward, then backward
  layer by layer in reverse, each bucket of `--fusion-mb` leaving when its last gradient is
  ready and the buckets sharing one link in order; overlap is simulated, not assumed.
- `ps`: `gradmesh.sync.parameter_server.cost.step_time` (mean-value analysis of W workers pushing
  and pulling through S servers) on the same alpha-beta terms; the G GPUs of a node share its
  link.
- `local-sgd`: compute every step, the parameters' allreduce every `--sync-every` steps.
- `tensor`: the model's own tensor-parallel plan within groups of `--tensor-parallel` GPUs (a
  node's by default), data parallelism across groups; `hybrid`: the planner's choice per layer
  (`gradmesh.layout.planner.plan`, its exact search), both priced by the planner's `predict`
  on a profile whose seconds come from FLOPs (`layout_profile`).
- `pipeline`: gradmesh's own pipeline schedule, action by action (`_pipeline`).

Efficiency at n GPUs is T(1) / T(n), T(1) one GPU's step with no communication (weak scaling:
each GPU keeps its batch); the overhead is T(n) - T(1) (the lectures' definitions).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradmesh.collectives.cost import CostParams
from gradmesh.errors import GradmeshError
from gradmesh.layout.planner import Links, Profile, Unit, predict
from gradmesh.models.flops import Layer, layer_flops
from gradmesh.registry import Registry, canonical_name


@dataclass(frozen=True)
class Device:
    """A device's peak rate and the fraction of it a convnet's training step reaches."""

    peak_tflops: float
    achieved: float
    source: str

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.achieved


DEVICES: Registry[Device] = Registry("device")
# P100 and V100: fp32 peaks (SXM2), achieved fractions from published ResNet-50 runs' own
# single-node times (docs/scaling.md derives them); A100 and H100: dense TF32 peaks (PyTorch's
# default for convolutions on them), achieved fractions assumed, not checked against a run.
DEVICES.register("p100")(
    Device(10.6, 0.32, "fp32; achieved from Goyal et al. 2017: 29 h for 90 epochs on 8 GPUs")
)
DEVICES.register("v100")(
    Device(15.7, 0.51, "fp32; achieved from PyTorch's DDP benchmark: 0.097 s/iter, batch 32")
)
DEVICES.register("a100")(Device(156.0, 0.16, "tf32 dense; achieved assumed"))
DEVICES.register("h100")(Device(495.0, 0.12, "tf32 dense; achieved assumed"))
CPU = "cpu"
"""This machine's CPU: its rate is measured by running the model (`measured_cpu`)."""


def _input(model: str, shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) to build `model` at: `shape`, else the ImageNet models' native
    sizes (1000 classes) and the project's own as they train here (digits, and alexnet on 32x32
    synthetic images; 10 classes)."""
    from gradmesh.models.imagenet import NATIVE_SHAPES

    own = {"alexnet": (3, 32, 32), "cnn": (1, 8, 8), "mlp": (1, 8, 8), "linear": (1, 8, 8)}
    shape = shape or NATIVE_SHAPES.get(model) or own.get(model, (3, 224, 224))
    return shape, 1000 if shape[-1] >= 64 else 10


def model_layers(model: str, batch: int, shape: tuple[int, ...] | None = None) -> list[Layer]:
    """Every module that holds weights, in forward order, with its FLOPs at `batch` (forward,
    backward) and parameter bytes, from the model built on the meta device (`layer_flops`)."""
    import torch

    from gradmesh.models.registry import FEATURE_ID_MODELS, MODELS

    builder = MODELS.get(model)
    if model in FEATURE_ID_MODELS:
        raise GradmeshError(f"model {model} takes feature ids; the simulator models image inputs")
    shape, classes = _input(model, shape)
    with torch.device("meta"):
        net = builder(shape, classes)
        x = torch.randn(batch, *shape)
    return layer_flops(net, x)


def measured_cpu(model: str, batch: int, shape: tuple[int, ...] | None = None) -> Device:
    """This machine's rate on `model`: its FLOPs over the median of three timed forward and
    backward passes (after one warm-up), on real tensors."""
    import torch

    from gradmesh.models.registry import MODELS

    shape, classes = _input(model, shape)
    net = MODELS.get(model)(shape, classes)
    x = torch.randn(batch, *shape)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        net(x).sum().backward()
        times.append(time.perf_counter() - started)
    flops = sum(layer.fwd_flops + layer.bwd_flops for layer in model_layers(model, batch, shape))
    rate = flops / sorted(times[1:])[1]
    return Device(rate / 1e12, 1.0, f"measured: {rate / 1e9:.1f} GFLOP/s on {model}")


def device_profile(layers: list[Layer], device: Device, batch: int, model: str) -> Profile:
    """A one-GPU `Profile` (the planner's) whose layers take their FLOPs over the device's rate."""
    rate = device.flops_per_s
    units = [
        Unit(
            name=layer.name,
            kind="",
            param_bytes=layer.param_bytes,
            bias_bytes=0,
            in_bytes=0,
            mid_bytes=0,
            out_bytes=0,
            dims=(0, 0),
            fwd={"data": layer.fwd_flops / rate},
            bwd={"data": layer.bwd_flops / rate},
        )
        for layer in layers
    ]
    return Profile(model, 1, batch, units, threads=0, concurrent=1, update_s_per_byte=0.0)


@dataclass(frozen=True)
class Split:
    """What the layouts that split layers need: a one-GPU profile with every placement's
    seconds (`layout_profile`), the model on the meta device, its tensor-parallel plan."""

    prof: Profile
    model: Any
    tp_plan: dict[str, str] | None


def layout_profile(
    model: str, batch: int, shape: tuple[int, ...] | None, tps: list[int], device: Device
) -> Split:
    """The planner's `Profile` of one GPU at `batch`, each unit's seconds from its FLOPs for
    every placement at each tp in `tps`: data-parallel at `batch`; a colwise or rowwise slice
    at tp t works on t times the samples and 1/t of the weights (the same FLOPs); `replicate`
    on t times the samples. Sizes and dims are the planner's own (`describe_units`)."""
    import torch

    from gradmesh.layout.pipeline import layers_of, sample_shapes
    from gradmesh.layout.planner import describe_units, placements
    from gradmesh.models.registry import MODELS, TP_PLANS

    shape, classes = _input(model, shape)
    with torch.device("meta"):
        net = MODELS.get(model)(shape, classes)
        x = torch.randn(batch, *shape)
    flops = {la.name: la for la in layer_flops(net, x)}
    layers = layers_of(net, model)
    rate = device.flops_per_s
    found = []
    for unit, *_ in describe_units(layers, sample_shapes(layers, x[:1]), model):
        la = flops[unit.name]
        for choice, t in placements(unit.dims, tps):
            times = t if choice == "replicate" else 1
            key = "data" if choice == "data" else f"{choice}@{t}"
            unit.fwd[key] = la.fwd_flops * times / rate
            unit.bwd[key] = la.bwd_flops * times / rate
        found.append(unit)
    prof = Profile(model, 1, batch, found, threads=0, concurrent=1, update_s_per_byte=0.0)
    return Split(prof, net, TP_PLANS.get(model) if model in TP_PLANS.names() else None)


@dataclass(frozen=True)
class Job:
    """What a strategy needs to price one step on n GPUs."""

    prof: Profile
    """One GPU's profile (batch: its own)."""
    gpus: int
    links: Links
    algorithm: str = "ring"
    fusion_mb: float = 25.0
    _: dataclasses.KW_ONLY  # each strategy's own settings by name: a new one cannot shift them
    servers: int = 0
    """ps: parameter servers (0: one per node)."""
    sync_every: int = 8
    """local-sgd: steps between parameter averages."""
    tensor_parallel: int = 0
    """tensor, hybrid: the largest tp group (0: a node's GPUs)."""
    split: Split | None = None
    """tensor, hybrid, pipeline: the model's per-placement profile (`layout_profile`)."""
    stages: int = 0
    """pipeline: stages (0: a node's GPUs)."""
    microbatches: int = 8
    """pipeline: micro-batches per replica's batch."""
    schedule: str = "1f1b"
    """pipeline: gpipe or 1f1b (`gradmesh.layout.pipeline.schedule_actions`)."""
    servers_apart: bool = False
    """ps: the servers have hosts of their own (BytePS's layout, and `gradmesh bench scaling`'s
    emulated jobs), so pushes and pulls cross the link between nodes even on one node."""


def compute_s(prof: Profile) -> float:
    """One GPU's step with no communication: forward, backward, update, the step's overhead."""
    model_bytes = sum(u.param_bytes for u in prof.units)
    work = sum(u.fwd["data"] + u.bwd["data"] for u in prof.units)
    return work + prof.update_s_per_byte * model_bytes + prof.step_overhead_s


def _allreduce(job: Job) -> float:
    n = job.gpus
    prof = dataclasses.replace(job.prof, workers=n, batch=job.prof.batch * n)
    layers = {u.name: "data" for u in prof.units}
    return predict(prof, layers, 1, job.links, job.algorithm, job.fusion_mb).step_s


def _ps(job: Job) -> float:
    from gradmesh.sync.parameter_server.cost import step_time

    n, per_node = job.gpus, job.links.ranks_per_host
    nbytes = sum(u.param_bytes for u in job.prof.units)
    nodes = max(1, n // per_node)
    servers = job.servers or nodes
    spans = nodes > 1 or job.servers_apart
    link = (job.links.point_to_point or job.links.inter) if spans else job.links.intra
    shared = min(per_node, n)  # a node's GPUs share its link
    worker = CostParams(link.alpha, link.beta * shared, link.gamma)
    return step_time(n, servers, nbytes, worker, compute_s(job.prof), server_link=link).step_s


def _local_sgd(job: Job) -> float:
    nbytes = sum(u.param_bytes for u in job.prof.units)
    average = job.links.allreduce_s(job.algorithm, list(range(job.gpus)), nbytes)
    return compute_s(job.prof) + average / job.sync_every


def _tp_of(job: Job) -> int:
    """The tp group size at this GPU count: the largest asked for that divides it."""
    return math.gcd(job.gpus, job.tensor_parallel or job.links.ranks_per_host)


def _split_of(job: Job) -> tuple[Split, Profile]:
    """The job's `Split`, and its profile at this GPU count (each GPU keeps its batch)."""
    if job.split is None:
        raise GradmeshError("the tensor, hybrid and pipeline layouts need `Job.split`")
    prof = dataclasses.replace(
        job.split.prof, workers=job.gpus, batch=job.split.prof.batch * job.gpus
    )
    return job.split, prof


def _tensor(job: Job) -> float:
    """The model's own tensor-parallel plan within groups of `_tp_of` GPUs (adjacent: a node's),
    data parallelism across them: the planner's `predict`."""
    from gradmesh.layout.planner import tp_plan_layers

    split, prof = _split_of(job)
    if not split.tp_plan:
        raise GradmeshError(f"model {prof.model} declares no tensor-parallel plan")
    tp = _tp_of(job)
    layers = tp_plan_layers(prof, split.tp_plan) if tp > 1 else {}
    layers = layers or {u.name: "data" for u in prof.units}
    return predict(prof, layers, tp, job.links, job.algorithm, job.fusion_mb).step_s


def _hybrid(job: Job) -> float:
    """The planner's own choice (per layer: data-parallel, replicated or split, at each tp up to
    `_tp_of`), by its search over the same cost model."""
    from gradmesh.layout.planner import plan

    split, prof = _split_of(job)
    best, _ = plan(
        prof,
        job.links,
        _tp_of(job),
        split.model,
        split.tp_plan,
        job.algorithm,
        job.fusion_mb,
    )
    return best.prediction.step_s


def _pipeline(job: Job) -> float:
    """Pipeline parallelism as gradmesh runs it: the layer sequence cut into S stages balanced
    on their FLOPs (`pipeline.balance`; S the largest asked for that divides the GPU count,
    adjacent GPUs, so a node's), each replica's batch (S GPUs' worth) in `microbatches`, every
    stage running its schedule's actions in order (`pipeline.schedule_actions`) as a discrete-
    event simulation: a forward waits for the stage before it and its activation's transfer, a
    backward for the stage after it and its gradient's; then each stage's parameters are
    averaged over the S-strided replicas, after its last backward."""
    from gradmesh.layout.pipeline import balance, schedule_actions

    split, _ = _split_of(job)
    n = job.gpus
    stages = math.gcd(n, job.stages or job.links.ranks_per_host)
    units_ = split.prof.units
    if stages > len(units_):
        stages = max(d for d in range(1, len(units_) + 1) if n % d == 0)
    m = job.microbatches
    samples = split.prof.batch * stages / m  # per micro-batch (the profile is at one GPU's)
    scale = stages / m
    per_unit = [(u.fwd["data"] * scale, u.bwd["data"] * scale) for u in units_]
    starts = balance([f + b for f, b in per_unit], stages) if stages > 1 else [0]
    bounds = [*starts, len(units_)]
    fwd = [sum(f for f, _ in per_unit[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    bwd = [sum(b for _, b in per_unit[a:c]) for a, c in zip(bounds, bounds[1:], strict=False)]
    sends = [
        _p2p_s(job.links, [s, s + 1], samples * units_[bounds[s + 1] - 1].out_bytes)
        for s in range(stages - 1)
    ]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    queues = [schedule_actions(job.schedule, s, stages, m) for s in range(stages)]
    while any(queues):
        progressed = False
        for s in range(stages):
            while queues[s]:
                kind, i = queues[s][0]
                if kind == "F":
                    need = [done.get(("F", s - 1, i))] if s else []
                    ready = [t + sends[s - 1] for t in need if t is not None] if s else [0.0]
                else:
                    need = (
                        [done.get(("B", s + 1, i))] if s < stages - 1 else [done.get(("F", s, i))]
                    )
                    ready = [
                        t + (sends[s] if s < stages - 1 else 0.0) for t in need if t is not None
                    ]
                if not ready:
                    break
                start = max(free[s], *ready)
                free[s] = done[(kind, s, i)] = start + (fwd[s] if kind == "F" else bwd[s])
                queues[s].pop(0)
                progressed = True
        if not progressed:
            raise GradmeshError(f"pipeline schedule {job.schedule} deadlocked (a bug)")
    replicas = list(range(0, n, stages))
    step = 0.0
    for s in range(stages):
        nbytes = sum(u.param_bytes for u in units_[bounds[s] : bounds[s + 1]])
        sync = job.links.allreduce_s(job.algorithm, [r + s for r in replicas], nbytes)
        step = max(step, free[s] + sync)
    return step + split.prof.step_overhead_s


def _p2p_s(links: Links, ranks: list[int], nbytes: float) -> float:
    """One message between two ranks: its alpha and beta (within a node or across)."""
    c = links.over(ranks, nbytes)
    return c.alpha + nbytes * c.beta


STRATEGIES: Registry[Callable[[Job], float]] = Registry("simulated strategy")
STRATEGIES.register("allreduce")(_allreduce)
STRATEGIES.register("ps")(_ps)
STRATEGIES.register("local-sgd")(_local_sgd)
STRATEGIES.register("tensor")(_tensor)
STRATEGIES.register("hybrid")(_hybrid)
STRATEGIES.register("pipeline")(_pipeline)
SPLITTING = {"tensor", "hybrid", "pipeline"}


def scaling(strategy: str, base: Job, gpus: list[int]) -> list[dict[str, Any]]:
    """Per GPU count: predicted step, samples/s, efficiency T(1)/T(n), overhead T(n) - T(1)."""
    price = STRATEGIES.get(strategy)
    alone = compute_s(base.prof)
    rows = []
    for n in gpus:
        step = price(dataclasses.replace(base, gpus=n))
        rows.append(
            {
                "gpus": n,
                "nodes": max(1, n // base.links.ranks_per_host),
                "step_s": step,
                "samples_per_s": n * base.prof.batch / step,
                "efficiency": alone / step,
                "overhead_s": step - alone,
            }
        )
    return rows


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=canonical_name, default="resnet50", help="model (default: resnet50)"
    )
    parser.add_argument(
        "--input-shape", help="CxHxW (default: the model's own, 3x224x224 for ImageNet models)"
    )
    parser.add_argument(
        "--gpus", default="8,16,32,64,128,256,512,1024", help="GPU counts (default: 8..1024)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="(default: 8)")
    parser.add_argument(
        "--device", type=canonical_name, default="v100", help="device name (default: v100; or cpu)"
    )
    parser.add_argument("--tflops", type=float, help="peak TFLOP/s (overrides the device's)")
    parser.add_argument("--achieved", type=float, help="fraction of peak reached (0..1]")
    parser.add_argument(
        "--intra-node-bandwidth", default="1200gbit", help="within a node (default: 1200gbit)"
    )
    parser.add_argument(
        "--inter-node-bandwidth", default="100gbit", help="between nodes (default: 100gbit)"
    )
    parser.add_argument("--latency", default="5us", help="per message (default: 5us)")
    parser.add_argument("--intra-node-latency", help="(default: --latency)")
    parser.add_argument(
        "--strategy",
        type=canonical_name,
        default="allreduce",
        help="allreduce, ps, local-sgd, or a comma list",
    )
    parser.add_argument(
        "--algorithm",
        type=canonical_name,
        default="ring",
        help="allreduce algorithm (default: ring)",
    )
    parser.add_argument("--fusion-mb", type=float, default=25.0, help="bucket MiB (default: 25)")
    parser.add_argument("--batch-per-gpu", type=int, default=32, help="(default: 32)")
    parser.add_argument("--servers", type=int, default=0, help="ps: servers (default: 1/node)")
    parser.add_argument("--sync-every", type=int, default=8, help="local-sgd: K (default: 8)")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=0,
        help="tensor, hybrid: the largest tp group (default: --gpus-per-node)",
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        default=0,
        help="pipeline: stages (default: --gpus-per-node)",
    )
    parser.add_argument("--microbatches", type=int, default=8, help="pipeline (default: 8)")
    parser.add_argument(
        "--schedule", type=canonical_name, default="1f1b", help="pipeline: gpipe or 1f1b (default)"
    )
    parser.add_argument("--json", help="write the prediction here")
    parser.add_argument("--plot", help="write efficiency and overhead against GPUs here (PNG)")


def _shape(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise GradmeshError(f"bad --input-shape {text!r}: expected CxHxW like 3x224x224") from None
    if len(dims) != 3 or min(dims) < 1:
        raise GradmeshError(f"bad --input-shape {text!r}: expected CxHxW like 3x224x224")
    return dims


def _links(args: argparse.Namespace, gamma: float) -> Links:
    from gradmesh.units import parse_latency, parse_rate

    rates = {
        f: parse_rate(getattr(args, f)) for f in ("intra_node_bandwidth", "inter_node_bandwidth")
    }
    latency = parse_latency(args.latency)
    intra_latency = parse_latency(args.intra_node_latency) if args.intra_node_latency else latency
    intra = CostParams(intra_latency, 8 / rates["intra_node_bandwidth"], gamma)
    inter = CostParams(latency, 8 / rates["inter_node_bandwidth"], gamma)
    return Links(intra, inter, args.gpus_per_node)


def _device(args: argparse.Namespace, shape: tuple[int, ...] | None) -> Device:
    known = [*DEVICES.names(), CPU]
    if args.device not in known:
        raise GradmeshError(f"unknown device {args.device!r} (valid: {', '.join(known)})")
    if args.device == CPU:
        device = measured_cpu(args.model, args.batch_per_gpu, shape)
    else:
        device = DEVICES.get(args.device)
    if args.tflops is not None:
        if args.tflops <= 0:
            raise GradmeshError(f"--tflops must be positive, got {args.tflops}")
        device = dataclasses.replace(device, peak_tflops=args.tflops, source="--tflops")
    if args.achieved is not None:
        if not 0 < args.achieved <= 1:
            raise GradmeshError(f"--achieved must be in (0, 1], got {args.achieved}")
        device = dataclasses.replace(device, achieved=args.achieved)
    return device


def run(args: argparse.Namespace) -> int:
    from gradmesh.collectives.cost import COSTS
    from gradmesh.launch.jobs import write_json
    from gradmesh.units import parse_ints, parse_list

    gpus = parse_ints(args.gpus, "GPU count")
    per_node = args.gpus_per_node
    if per_node < 1:
        raise GradmeshError(f"--gpus-per-node must be >= 1, got {per_node}")
    uneven = [n for n in gpus if n > per_node and n % per_node]
    if uneven:
        raise GradmeshError(
            f"GPU count {uneven[0]} is not a multiple of --gpus-per-node {per_node}"
        )
    strategies = parse_list(args.strategy, "strategy")
    for s in strategies:
        STRATEGIES.get(s)
    COSTS.get(args.algorithm)
    if (
        min(args.batch_per_gpu, args.sync_every) < 1
        or min(args.servers, args.tensor_parallel, args.pipeline_parallel) < 0
        or args.fusion_mb <= 0
        or args.microbatches < 1
    ):
        raise GradmeshError(
            "--batch-per-gpu, --sync-every and --microbatches must be >= 1, --servers, "
            "--tensor-parallel and --pipeline-parallel >= 0, --fusion-mb > 0"
        )
    from gradmesh.layout.config import SCHEDULES

    if args.schedule not in SCHEDULES:
        raise GradmeshError(f"unknown --schedule {args.schedule!r} (valid: {', '.join(SCHEDULES)})")
    started = time.perf_counter()
    shape = _shape(args.input_shape)
    layers = model_layers(args.model, args.batch_per_gpu, shape)
    device = _device(args, shape)
    links = _links(args, 0.0)
    prof = device_profile(layers, device, args.batch_per_gpu, args.model)
    split = None
    if SPLITTING & set(strategies):
        most = args.tensor_parallel or per_node
        tps = [t for t in range(2, most + 1) if most % t == 0]
        split = layout_profile(args.model, args.batch_per_gpu, shape, tps, device)
        if "tensor" in strategies and not split.tp_plan:
            raise GradmeshError(
                f"model {args.model} declares no tensor-parallel plan (--strategy hybrid "
                "places its layers itself)"
            )
    base = Job(
        prof,
        1,
        links,
        args.algorithm,
        args.fusion_mb,
        servers=args.servers,
        sync_every=args.sync_every,
        tensor_parallel=args.tensor_parallel,
        split=split,
        stages=args.pipeline_parallel,
        microbatches=args.microbatches,
        schedule=args.schedule,
    )
    results = {s: scaling(s, base, gpus) for s in strategies}
    payload = {
        "model": args.model,
        "parameters": sum(layer.param_bytes for layer in layers) // 4,
        "gflops_per_sample": sum(la.fwd_flops + la.bwd_flops for la in layers)
        / args.batch_per_gpu
        / 1e9,
        "device": {"name": args.device, **dataclasses.asdict(device)},
        "one_gpu_step_s": compute_s(prof),
        "batch_per_gpu": args.batch_per_gpu,
        "gpus_per_node": per_node,
        "links": {
            "intra": dataclasses.asdict(links.intra),
            "inter": dataclasses.asdict(links.inter),
        },
        "algorithm": args.algorithm,
        "fusion_mb": args.fusion_mb,
        "strategies": results,
        "seconds_to_answer": time.perf_counter() - started,
    }
    write_json(args.json, payload)
    print(
        f"{args.model}: {payload['parameters'] / 1e6:.1f}M parameters, "
        f"{payload['gflops_per_sample']:.1f} GFLOP per sample; {args.device}: one GPU's step "
        f"{payload['one_gpu_step_s'] * 1e3:.1f} ms at batch {args.batch_per_gpu}"
    )
    print(markdown_table(results, "gpus"))
    if args.plot:
        from gradmesh.observe.plot import scaling_plot

        scaling_plot(args.plot, f"{args.model} on {args.device} (simulated)", results, "gpus")
    return 0


def markdown_table(results: dict[str, list[dict[str, Any]]], unit: str) -> str:
    """One row per strategy and count: step, samples/s, efficiency, overhead."""
    lines = [
        f"| strategy | {unit} | step ms | samples/s | efficiency | overhead ms |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, rows in results.items():
        for r in rows:
            lines.append(
                f"| {strategy} | {r[unit]} | {r['step_s'] * 1e3:.1f} | "
                f"{r['samples_per_s']:.0f} | {r['efficiency'] * 100:.0f}% | "
                f"{r['overhead_s'] * 1e3:.1f} |"
            )
    return "\n".join(lines)
