"""`gradmesh simulate`'s options (`SimulateConfig`: its own, and the shared components' where an
option means what it means to `gradmesh train`) and the command itself."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from gradmesh.collectives.cost import CostParams
from gradmesh.errors import GradmeshError
from gradmesh.layout.config import LayoutConfig
from gradmesh.layout.pipeline.order import check_schedule
from gradmesh.options import check_choices, component, option
from gradmesh.planner.links import Links
from gradmesh.simulate.asked import (
    refuse_unread_by_image_model,
    refuse_unread_by_token_model,
    refuse_unread_by_validate,
)
from gradmesh.simulate.devices import COMPUTE_KINDS, DEVICES, Device
from gradmesh.simulate.profile import (
    CPU,
    device_profile,
    layout_profile,
    measured_cpu,
    model_layers,
)
from gradmesh.simulate.strategies import SPLITTING, STRATEGIES, Job, compute_s, scaling
from gradmesh.sync.config import AllreduceConfig, LocalSGDConfig, ParameterServerConfig
from gradmesh.train.config import DataConfig


@dataclass
class SimulateConfig:
    """gradmesh simulate: a job's step time and scaling on clusters larger than this one."""

    data: DataConfig = component(DataConfig, only=("model", "model_args", "sequence_length"))
    input_shape: str | None = option(
        None, "CxHxW (default: the model's own, 3x224x224 for ImageNet models)"
    )
    vocab: int = option(51200, "token models: vocabulary size (gpt)")
    gpus: str = option("8,16,32,64,128,256,512,1024", "GPU counts")
    gpus_per_node: int = option(8, "GPUs in one node")
    device: str = option("v100", "device name, or cpu (this machine, measured)", name=True)
    dtype: str = option(
        "",
        "fp32, tf32, bf16, fp16, or fp8 (bf16 with the blocks' linear layers in float8) "
        "(default: the device's; token models: bf16 or fp16 mixed)",
    )
    compile: bool = option(False, "token models: price torch.compile's fusion of each block")
    async_tp: bool = option(False, "token models: tp exchanges overlapped with their products")
    context_gather: bool = option(
        False,
        "token models with ring attention at --context-parallel 2 or more: priced as torch's "
        "context_parallel runs it (torchtitan's CP: every rank's keys and values all-gathered "
        "once a call, not passed a block at a time as in gradmesh's ring)",
    )
    loss_parallel: bool = option(
        False, "token models with tp: the loss on the logits split by vocabulary, not gathered"
    )
    tflops: float | None = option(None, "peak TFLOP/s (overrides the device's)")
    achieved: float | None = option(None, "fraction of peak every compute kernel reaches (0..4]")
    intra_fabric: str = option("", "interconnect within a node: a preset (nvlink-v100, pcie3, ...)")
    inter_fabric: str = option("", "interconnect between nodes: a preset (infiniband-hdr, ...)")
    nics_per_node: int = option(1, "links of --inter-fabric each node has", at_least=1)
    intra_node_bandwidth: str | None = option(None, "link rate within a node (1200gbit)")
    inter_node_bandwidth: str | None = option(None, "link rate between nodes (100gbit)")
    latency: str | None = option(None, "per message between nodes (5us)")
    intra_node_latency: str | None = option(None, "per message within a node (default: --latency)")
    strategy: str = option(
        "allreduce",
        "allreduce, ps, local-sgd, tensor, hybrid, pipeline, or a comma list",
        name=True,
    )
    allreduce: AllreduceConfig = component(
        AllreduceConfig, only=("algorithm", "fusion_mb"), former={"algorithm": "--algorithm"}
    )
    batch_per_gpu: int = option(32, "samples each GPU computes per step")
    ps: ParameterServerConfig = component(ParameterServerConfig, only=("servers",))
    servers_per_node: int = option(0, "ps: parameter servers on each node (0: --servers in all)")
    local_sgd: LocalSGDConfig = component(LocalSGDConfig, only=("sync_every",))
    layout: LayoutConfig = component(
        LayoutConfig,
        only=(
            "tensor_parallel",
            "pipeline_parallel",
            "microbatches",
            "schedule",
            "virtual_stages",
            "activation_checkpointing",
            "sequence_parallel",
            "context_parallel",
            "context_attention",
            "expert_parallel",
        ),
    )
    global_batch: int = option(0, "token models: samples a step (default: --batch-per-gpu x dp)")
    optimizer: str = option("sgd", "token models: sgd, adam or adamw (its state's bytes)")
    zero_stage: int = option(0, "token models: sharded data parallelism's stage (0-3)")
    search: bool = option(False, "token models: the fastest layout that fits, and the next few")
    top: int = option(5, "--search: layouts to print")
    validate: bool = option(False, "price published runs (--published) beside their figures")
    published: str = option("", "--validate: the table of rows (default: the package's own)")
    json: str | None = option(None, "write the prediction here")
    plot: str | None = option(None, "write efficiency and overhead against GPUs here (PNG)")


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


def link_terms(args: SimulateConfig) -> tuple[CostParams, CostParams]:
    """(within a node, between nodes): the fabrics' terms (`fabric_terms`, a node's
    `--nics-per-node` links side by side), with a rate or latency given beside one in its
    place; a bare link where no fabric is named."""
    from gradmesh.simulate.fabrics import FABRICS, fabric_terms
    from gradmesh.units import parse_latency, parse_rate

    def rate(text: str | None) -> float | None:
        return parse_rate(text) / 1e9 if text else None

    inter_latency = parse_latency(args.latency) if args.latency else None
    intra_latency = (
        parse_latency(args.intra_node_latency) if args.intra_node_latency else inter_latency
    )
    intra = fabric_terms(
        FABRICS.get(args.intra_fabric) if args.intra_fabric else None,
        1,
        rate(args.intra_node_bandwidth),
        intra_latency,
        default=(1200.0, 5e-6),
    )
    inter = fabric_terms(
        FABRICS.get(args.inter_fabric) if args.inter_fabric else None,
        args.nics_per_node,
        rate(args.inter_node_bandwidth),
        inter_latency,
    )
    return intra, inter


def _links(args: SimulateConfig) -> Links:
    return Links(*link_terms(args), args.gpus_per_node)


def _device(args: SimulateConfig, shape: tuple[int, ...] | None) -> Device:
    known = [*DEVICES.names(), CPU]
    if args.device not in known:
        raise GradmeshError(f"unknown device {args.device!r} (valid: {', '.join(known)})")
    if args.device == CPU:
        device = measured_cpu(args.data.model, args.batch_per_gpu, shape)
    else:
        device = DEVICES.get(args.device)
        device = device.at(args.dtype or device.precision)
        if args.compile:
            if "compile" not in device.achieved:
                raise GradmeshError(f"--compile: no fitted fusion fraction for {args.device}")
            device = dataclasses.replace(device, compiled=True)
    if args.tflops is not None:
        if args.tflops <= 0:
            raise GradmeshError(f"--tflops must be positive, got {args.tflops}")
        peaks = {**device.peak_tflops, device.precision: args.tflops}
        device = dataclasses.replace(device, peak_tflops=peaks, source="--tflops")
    if args.achieved is not None:
        if not 0 < args.achieved <= 4:
            raise GradmeshError(f"--achieved must be in (0, 4], got {args.achieved}")
        fractions = {**device.achieved, **dict.fromkeys(COMPUTE_KINDS, args.achieved)}
        device = dataclasses.replace(device, achieved=fractions)
    return device


def _check(args: SimulateConfig) -> tuple[list[int], list[str]]:
    """The GPU counts and strategies asked for, or one line for options no job has."""
    from gradmesh.collectives.cost import COSTS
    from gradmesh.units import parse_ints, parse_list

    check_choices(args)
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
    COSTS.get(args.allreduce.algorithm)
    if (
        min(args.batch_per_gpu, args.local_sgd.sync_every) < 1
        or min(args.ps.servers, args.layout.tensor_parallel, args.layout.pipeline_parallel) < 1
        or args.servers_per_node < 0
        or args.allreduce.fusion_mb <= 0
        or args.layout.microbatches < 1
    ):
        raise GradmeshError(
            "--batch-per-gpu, --sync-every, --microbatches, --servers, --tensor-parallel and "
            "--pipeline-parallel must be >= 1, --servers-per-node >= 0, --fusion-mb > 0"
        )
    check_schedule(
        args.layout.schedule,
        args.layout.pipeline_parallel,
        args.layout.microbatches,
        args.layout.virtual_stages,
    )
    return gpus, strategies


def _job(args: SimulateConfig, prof: Any, links: Links, split: Any) -> Job:
    """One GPU's job, as `scaling` prices it at each GPU count."""
    return Job(
        prof,
        1,
        links,
        args.allreduce.algorithm,
        args.allreduce.fusion_mb,
        servers=args.ps.servers,
        servers_per_node=args.servers_per_node,
        sync_every=args.local_sgd.sync_every,
        tensor_parallel=args.layout.tensor_parallel,
        split=split,
        pipeline_parallel=args.layout.pipeline_parallel,
        microbatches=args.layout.microbatches,
        schedule=args.layout.schedule,
        virtual_stages=args.layout.virtual_stages,
    )


def _split(args: SimulateConfig, shape: Any, device: Device) -> Any:
    """The model's per-placement profile, for the strategies that split it."""
    most = args.layout.tensor_parallel
    tps = [t for t in range(2, most + 1) if most % t == 0]
    return layout_profile(args.data.model, args.batch_per_gpu, shape, tps, device)


def run(args: SimulateConfig, _command: list[str] | None = None) -> int:
    from gradmesh.models.registry import is_token_model

    refuse_unread_by_validate(args)
    if args.validate:
        from gradmesh.simulate.published import run_validate

        return run_validate(args.published, args.json)
    if is_token_model(args.data.model) or ":" in args.data.model:
        from gradmesh.simulate.mesh_command import run_mesh

        refuse_unread_by_token_model(args)
        checked = _check(args)
        if args.device == CPU:
            raise GradmeshError(
                "--device cpu measures an image model on this machine; name a GPU for a token "
                "model (p100, v100, a100, h100)"
            )
        return run_mesh(args, *checked, _device(args, None), *link_terms(args))
    return _run_convnet(args)


def _run_convnet(args: SimulateConfig) -> int:
    from gradmesh.launch.jobs import write_json

    gpus, strategies = _check(args)
    refuse_unread_by_image_model(args, strategies)
    started = time.perf_counter()
    shape = _shape(args.input_shape)
    device = _device(args, shape)
    costs = model_layers(args.data.model, args.batch_per_gpu, shape, device.dtype_bytes == 2)
    layers = costs.layers
    links = _links(args)
    prof = device_profile(costs, device, args.batch_per_gpu, args.data.model)
    split = _split(args, shape, device) if SPLITTING & set(strategies) else None
    if split is not None and "tensor" in strategies and not split.tp_plan:
        raise GradmeshError(
            f"model {args.data.model} declares no tensor-parallel plan (--strategy hybrid "
            "places its layers itself)"
        )
    results = {s: scaling(s, _job(args, prof, links, split), gpus) for s in strategies}
    payload: dict[str, Any] = {
        "model": args.data.model,
        "parameters": sum(layer.param_bytes for layer in layers) // device.dtype_bytes,
        "gflops_per_sample": sum(la.fwd_flops + la.bwd_flops for la in layers)
        / args.batch_per_gpu
        / 1e9,
        "device": {"name": args.device, **dataclasses.asdict(device)},
        "one_gpu_step_s": compute_s(prof),
        "batch_per_gpu": args.batch_per_gpu,
        "gpus_per_node": args.gpus_per_node,
        "links": {
            "intra": dataclasses.asdict(links.intra),
            "inter": dataclasses.asdict(links.inter),
        },
        "algorithm": args.allreduce.algorithm,
        "fusion_mb": args.allreduce.fusion_mb,
        "strategies": results,
        "seconds_to_answer": time.perf_counter() - started,
    }
    write_json(args.json, payload)
    print(
        f"{args.data.model}: {payload['parameters'] / 1e6:.1f}M parameters, "
        f"{payload['gflops_per_sample']:.1f} GFLOP per sample; {args.device}: one GPU's step "
        f"{payload['one_gpu_step_s'] * 1e3:.1f} ms at batch {args.batch_per_gpu}"
    )
    print(markdown_table(results, "gpus"))
    if args.plot:
        from gradmesh.observe.plot import scaling_plot

        scaling_plot(args.plot, f"{args.data.model} on {args.device} (simulated)", results, "gpus")
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
