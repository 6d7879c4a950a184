"""Transformers on clusters larger than this one: the mesh planner's formulas (`predict_mesh`
for the step, `predict_memory` for the bytes a GPU holds) on a profile made on the meta device
instead of measured (`meta_profile`), so a 175-billion-parameter GPT is priced in seconds and
with the same formulas `gradmesh plan --memory-limit` obeys.

**The profile** (counted by `gradmesh.simulate.meta_count`). For each tensor-parallel degree T
the model's plan admits, rank 0's slice (the plan applied as on a mesh, its exchanges recorded
by `dry_exchanges`) runs one sample forward,
through a summed loss and backward on the meta device, in the job's precision, under
`KernelCounter`: its seconds are the device's roofline of the kernels counted
(`Device.seconds`), times the samples of a micro-batch; its exchanges are the recorded ones,
times the samples. What each block saves for backward and what enters it come from
`saved_activations` (meta tensors counted by their own size); parameter bytes from the slice.
The optimizer's state and its step's temporaries are per parameter: Adam in mixed precision
holds an fp32 copy and two fp32 moments (12 bytes a parameter), in fp32 the two moments (8);
SGD one momentum. The step's update reads and writes parameters, gradients and state once at
memory speed.

**Links.** A GPU's tensor-parallel group and pipeline neighbours are priced on the links within
or across nodes by where their ranks fall (tp fastest, then pp, then dp, as `gradmesh.runtime.
mesh` lays them); a data-parallel group that spans nodes shares each node's links with the
other groups whose ranks sit on that node (`shared_links`).

**The search** (`search`) prices every layout gradmesh can run on the GPUs (`mesh_layouts`:
tp within a node, pp up to the blocks, micro-batches of 1 to 8 samples, 1F1B and interleaved,
and `variants`' ZeRO stages and recomputation) and keeps those that fit the device's memory
(all but `CONTEXT_GIB` of it), fastest first.

**Memory as the allocator reports it.** `predict_memory` gives the live bytes at the peak;
PyTorch's caching allocator reserves more than it holds live (blocks split and cached across
sizes), and the published figures are its reservations: the device's `fragmentation` (a
fraction of the live bytes, fitted on a calibration row) is added, up to the device's size,
since near it the allocator frees its cache and retries before it fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gradmesh.collectives.cost import CostParams
from gradmesh.errors import GradmeshError
from gradmesh.layout.config import Layout
from gradmesh.layout.pipeline.zero_bubble import fewest_microbatches
from gradmesh.planner.axes_cost import Experts, Sequences, context_fits, record_axes
from gradmesh.planner.links import Links
from gradmesh.planner.mesh import MeshProfile, Slice, block_outputs
from gradmesh.planner.mesh_cost import MeshPrediction, Overlap, predict_mesh, variants
from gradmesh.runtime.axes import divisors
from gradmesh.simulate.devices import ASYNC_TP_HIDDEN, Device
from gradmesh.simulate.meta_count import (
    Counted,
    Spec,
    at_depth,
    count,
    deep,
    grown,
    renamed,
    repeated,
)
from gradmesh.train.config import STATE_TENSORS

CONTEXT_GIB = 2.0
"""Of a device's memory, what the CUDA context and the communication library's buffers take
before a layout's first tensor (assumed: about 0.5 GiB of context and NCCL's channels' buffers
on a node of 8 H100s); a layout fits when its live bytes at the peak fit the rest."""

MASTER = 4
"""Mixed precision's fp32 copy of each parameter, bytes."""


class PerSample(dict[int, Any]):
    """A micro-batch's figure at any number of samples, from one sample's: seconds times the
    samples (plus `fixed`, the micro-batch's kernel launches), or each exchange's bytes times
    the samples."""

    def __init__(self, one: Any, fixed: float = 0.0) -> None:
        super().__init__()
        self.one, self.fixed = one, fixed

    def __missing__(self, samples: int) -> Any:
        if isinstance(self.one, list):
            return [(n * samples, kind) for n, kind in self.one]
        return self.fixed + self.one * samples


def _slice(spec: Spec, counted: Counted, device: Device) -> Slice:
    """The planner's `Slice` of a counted slice on `device`."""
    whole = sum(counted.block_param_bytes.values()) + counted.rest_param_bytes
    state = counted.parameters * (4 * STATE_TENSORS[spec.optimizer] + MASTER * spec.mixed)  # fp32
    memory_speed = device.bandwidth_gbs * 1e9 * device.achieved["memory"]
    linear = sum(counted.block_param_bytes.values()) / (2 if spec.mixed else 4)
    fp8_flops = 6 * spec.sequence * linear  # the blocks' linear layers, forward and backward
    return Slice(
        seconds=PerSample(
            device.seconds(counted.kernels, fp8_flops), device.launch_seconds(counted.calls)
        ),
        exchanges=PerSample(counted.exchanges),
        update_s=(3 * whole + 2 * state) / memory_speed,  # read all, write parameters and state
        block_param_bytes=counted.block_param_bytes,
        rest_param_bytes=counted.rest_param_bytes,
        saved=counted.saved,
        saved_samples=1,
        optimizer_bytes=int(state),
        optimizer_step_bytes=int(counted.parameters * 4),  # a foreach step's fp32 temporary
        mixed=spec.mixed,
    )


@dataclass
class MetaProfile:
    spec: Spec
    profile: MeshProfile
    counted: dict[int, Counted]
    device: Device

    @property
    def flops_per_sample(self) -> float:
        """Forward and backward FLOPs of one sample through the whole model (no recompute):
        counted at tp 1, else the smallest tp's slice times tp (the replicated norms over)."""
        tp = min(self.counted)
        return self.counted[tp].flops * tp

    @property
    def parameters(self) -> float:
        """The model's parameters, as `flops_per_sample` counts its FLOPs."""
        tp = min(self.counted)
        return self.counted[tp].parameters * tp

    def on(self, device: Device) -> MetaProfile:
        """The same counts priced on another device (or the same with other fractions)."""
        slices = {tp: _slice(self.spec, c, device) for tp, c in self.counted.items()}
        prof = dataclasses.replace(self.profile, slices=slices)
        return MetaProfile(self.spec, prof, self.counted, device)


def meta_profile(spec: Spec, gpus: int, batch: int, tps: list[int], device: Device) -> MetaProfile:
    """The mesh planner's profile of `spec` at global `batch` samples, at each tp of `tps`
    (those the model's plan admits; one line when it admits none of them). A model of more
    than 3 blocks by a depth argument (`DEPTH_ARGS`: `depth`, Hugging Face's
    `num_hidden_layers`) is counted at 2 and 3 blocks and extrapolated (`repeated`: its blocks
    are taken to be alike, as a depth says; a test checks the extrapolation against a count of
    the whole). A model whose forward reads a tensor's values cannot run on the meta device:
    one line says so (Hugging Face's causal LMs are given their mask, `models.hf.causal_mask`)."""
    try:
        return _meta_profile(spec, gpus, batch, tps, device)
    except (RuntimeError, NotImplementedError) as e:
        if isinstance(e, GradmeshError) or "meta" not in str(e):
            raise
        raise GradmeshError(
            f"model {spec.model} reads tensor values in its forward, which the meta device has "
            f"none of ({str(e).splitlines()[0]}); the simulator prices models that do not "
            "(gpt, hf:..., a factory of your own)"
        ) from None


def _meta_profile(spec: Spec, gpus: int, batch: int, tps: list[int], device: Device) -> MetaProfile:
    from gradmesh.layout.engine import admitted_degrees
    from gradmesh.layout.pipeline.graph import block_flops
    from gradmesh.models.blocks import block_list

    depth = deep(spec)
    small = at_depth(spec, 3) if depth else spec
    net, ids = small.build()
    names = block_list(net)
    full = renamed(names, depth) if depth else names
    if full is None:  # blocks not named as a list: count the whole model
        small, depth = spec, 0
        net, ids = spec.build()
        full = names = block_list(net)
    counted = {}
    for tp in admitted_degrees(net, spec.model, tps):
        if depth:
            counted[tp] = repeated(count(at_depth(spec, 2), tp), count(small, tp), depth, full)
        else:
            counted[tp] = count(spec, tp)
    if not counted:
        raise GradmeshError(f"model {spec.model} admits none of the tensor-parallel degrees {tps}")
    blocks = block_flops(net, ids, 1, spec.model)
    outputs = block_outputs(net, ids)
    if depth:
        blocks, outputs = grown(blocks, full), grown({n: outputs[n] for n in names}, full)
    prof = MeshProfile(spec.model, gpus, batch, 0, 1, blocks, {}, {})
    prof.boundary_bytes = {k: v for k, v in outputs.items() if k in blocks}
    prof.sequences, prof.experts = _axes(net, ids, depth / len(names) if depth else 1.0)
    return MetaProfile(spec, prof, counted, device).on(device)


def _axes(net: Any, ids: Any, grow: float) -> tuple[Sequences | None, Experts | None]:
    """The attention calls and mixtures of one forward (`record_axes`, on the meta device: an
    even load on the experts), grown to the whole depth where the model was counted at less."""
    import gradmesh.data.batch as batch

    seqs, experts = record_axes(net, ids, batch.call)
    if seqs is not None:
        seqs = dataclasses.replace(seqs, calls=round(seqs.calls * grow))
    if experts is not None:
        calls, params = round(experts.calls * grow), int(experts.param_bytes * grow)
        experts = dataclasses.replace(
            experts, calls=calls, param_bytes=params, flops=experts.flops * grow
        )
    return seqs, experts


CP_SEARCHED = 16
"""The largest cp degree `--search` tries (Llama 3 trained its 128k-token stage at cp 16):
each degree multiplies the layouts searched, and a ring longer than that spans many nodes."""


def _degrees(prof: MeshProfile) -> tuple[list[int], list[int]]:
    """The cp (up to `CP_SEARCHED`) and ep degrees the model admits on `prof.workers` GPUs."""
    seqs = prof.sequences
    cps = [1] + [c for c in divisors(prof.workers) if seqs is not None and 1 < c <= CP_SEARCHED]
    experts = prof.experts.experts if prof.experts is not None else 1
    eps = [e for e in divisors(prof.workers) if experts % e == 0 and (e == 1 or prof.experts)]
    return cps, eps


def shared_links(intra: CostParams, inter: CostParams, per_node: int, lay: Layout) -> Links:
    """The links as one GPU of `lay` sees them: a node's links out (`inter`, all its NICs) are
    shared by the data-parallel groups with a rank on it, min(GPUs a node, tp x pp) of them."""
    sharing = max(1, min(per_node, lay.shape.split))
    share = dataclasses.replace(inter, beta=inter.beta * sharing)
    return Links(intra, share, per_node)


def mesh_layouts(
    gpus: int,
    batch: int,
    blocks: int,
    tps: list[int],
    cps: Sequence[int] = (1,),
    eps: Sequence[int] = (1,),
) -> Iterator[Layout]:
    """Every layout of `gpus` at global `batch`: tp from `tps`, pp up to the blocks,
    micro-batches of 1, 2, 4 or 8 samples (without a pipeline, accumulated before the gradient
    sync), 1F1B, ZB-H1 (m >= p) and (two chunks a rank, where the blocks allow) interleaved
    1F1B and ZBV; without a
    pipeline, some replicas given to context parallelism (`cps`, ring and all-to-all) or to
    expert parallelism (`eps`)."""
    for tp in tps:
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if batch % dp or (pp > 1 and pp > blocks):
                continue
            for size in (1, 2, 4, 8):
                if (batch // dp) % size:
                    continue
                m = batch // dp // size
                if pp == 1:  # micro-batches of one replica: gradient accumulation
                    yield Layout(dp, tp, 1, m)
                    yield from _context_expert(dp, tp, m, cps, eps)
                    continue
                yield Layout(dp, tp, pp, m, "1f1b")
                if m >= pp:
                    yield Layout(dp, tp, pp, m, "zb-h1")
                if 2 * pp <= blocks and m % pp == 0:
                    yield Layout(dp, tp, pp, m, "interleaved", 2)
                if 2 * pp <= blocks and m >= fewest_microbatches("zbv", pp):
                    yield Layout(dp, tp, pp, m, "zbv", 2)


def _context_expert(
    dp: int, tp: int, m: int, cps: Sequence[int], eps: Sequence[int]
) -> Iterator[Layout]:
    """`dp` replicas of micro-batches as `m` gives, some given to cp (each sequence split,
    the same samples) or to ep (the experts spread, the samples too)."""
    for cp in (c for c in cps if c > 1 and dp % c == 0):
        for attention in ("ring", "alltoall"):
            yield Layout(dp // cp, tp, 1, m, cp=cp, attention=attention)
    for ep in (e for e in eps if e > 1 and dp % e == 0):
        yield Layout(dp // ep, tp, 1, m, ep=ep)


@dataclass
class Priced:
    prediction: MeshPrediction
    fits: bool
    tokens_per_s: float
    mfu: float
    reserved_bytes: float = 0.0
    """What the allocator reserves at the peak (module docstring)."""

    def row(self) -> dict[str, Any]:
        return {
            **self.prediction.row(),
            "fits": self.fits,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "reserved_bytes": self.reserved_bytes,
        }


def price(
    meta: MetaProfile,
    lay: Layout,
    intra: CostParams,
    inter: CostParams,
    per_node: int,
    sequence: int,
    algorithm: str = "ring",
    async_tp: bool = False,
) -> Priced:
    """One layout's step (FSDP2's exchanges overlapped with compute, as on a GPU's streams;
    the tp exchanges partly, compiled (`achieved["tp_overlap"]`: the compiler's collectives
    wait where their results are read) or all with `async_tp` (`ASYNC_TP_HIDDEN`)), memory
    (live bytes fitting all but `CONTEXT_GIB` of the device or not; reserved with the
    fragmentation), tokens a second and model FLOPs utilisation (the model's FLOPs,
    recomputation not counted, over the GPUs' peak)."""
    links = shared_links(intra, inter, per_node, lay)
    dev = meta.device
    hidden = dev.achieved.get("tp_overlap", 0.0) if dev.compiled else 0.0  # eager: all waited
    hidden = ASYNC_TP_HIDDEN if async_tp else hidden
    overlap = Overlap(fsdp=True, tp_hidden=hidden)
    pred = predict_mesh(meta.profile, lay, links, algorithm, overlap=overlap)
    assert pred.memory is not None
    size = dev.memory_gib * 2**30
    live = pred.memory.total_bytes
    fits = live <= size - CONTEXT_GIB * 2**30
    reserved = min(live * (1 + dev.achieved.get("fragmentation", 0.0)), size)
    batch = meta.profile.batch
    gpus = lay.shape.world
    peak = dev.peak_tflops[dev.precision] * 1e12
    mfu = meta.flops_per_sample * batch / (pred.step_s * gpus * peak)
    return Priced(pred, fits, batch * sequence / pred.step_s, mfu, reserved)


def search(
    meta: MetaProfile,
    intra: CostParams,
    inter: CostParams,
    per_node: int,
    sequence: int,
    algorithm: str = "ring",
    async_tp: bool = False,
) -> list[Priced]:
    """Every layout (`mesh_layouts` and `variants`, and each without checkpointing with the
    per-operation policy too) priced, those that fit first, fastest first; one line naming the
    smallest memory a GPU needs when none fits."""
    prof = meta.profile
    tps = sorted(prof.slices)
    cps, eps = _degrees(prof)
    blocks = len(prof.block_names)
    cut = blocks if prof.experts is None else 0  # a mixture's routing: no pipeline cuts it
    laid = mesh_layouts(prof.workers, prof.batch, cut, tps, cps, eps)
    found = variants([lay for lay in laid if context_fits(prof.sequences, lay)], blocks)
    if blocks:
        found += [dataclasses.replace(v, recompute="ops") for v in found if not v.checkpointing]
    if not found:
        raise GradmeshError(
            f"no layout of {prof.workers} GPUs divides the batch of {prof.batch} samples"
        )
    priced = [
        price(meta, lay, intra, inter, per_node, sequence, algorithm, async_tp) for lay in found
    ]
    if not any(p.fits for p in priced):
        least = min(priced, key=lambda p: p.prediction.memory.total_bytes)  # type: ignore[union-attr]
        mem = least.prediction.memory
        assert mem is not None
        raise GradmeshError(
            f"no layout of {prof.workers} GPUs fits the device's {meta.device.memory_gib:g} GiB "
            f"less {CONTEXT_GIB:g} GiB of context: the smallest, {least.prediction.layout.name}, "
            "needs "
            f"{mem.total_bytes / 2**30:.1f} GiB a GPU, most of it {mem.dominant}"
        )
    return sorted(priced, key=lambda p: (not p.fits, p.prediction.step_s))
