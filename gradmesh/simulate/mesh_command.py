"""`gradmesh simulate` on a token model (the built-in `gpt`, `hf:...`, a factory taking token
ids): each GPU count priced at the layout the options give, or (`--search`) the fastest layout
that fits the device, with its step, tokens a second, model FLOPs utilisation and memory a GPU
(`gradmesh.simulate.mesh`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import (
    Layout,
    LayoutConfig,
    check_context_layout,
    check_expert_layout,
    check_sequence_parallel,
)
from gradmesh.options import refuse_unread
from gradmesh.runtime.axes import divisors
from gradmesh.simulate.mesh import CONTEXT_GIB, MetaProfile, Priced, meta_profile, price
from gradmesh.simulate.mesh import search as search_layouts
from gradmesh.simulate.meta_count import Spec
from gradmesh.train.config import STATE_TENSORS

GIB = 2**30


def _spec(args: Any, device: Any) -> Spec:
    from gradmesh.registry import parse_kwargs

    if args.optimizer not in STATE_TENSORS:
        raise GradmeshError(
            f"unknown --optimizer {args.optimizer!r} (valid: {', '.join(STATE_TENSORS)})"
        )
    if min(args.data.sequence_length, args.vocab) < 1:
        raise GradmeshError("--sequence-length and --vocab must be >= 1")
    model_args = parse_kwargs(args.data.model_args, "--model-args")
    return Spec(
        args.data.model,
        model_args,
        args.data.sequence_length,
        args.vocab,
        device.precision,
        args.optimizer,
        sequence_parallel=args.layout.sequence_parallel,
        loss_parallel=args.loss_parallel,
    )


def _mixed(args: Any, device: Any) -> Any:
    """`device` in the job's precision: mixed (bf16 where the device has it, else fp16), as large
    transformers train, unless `--dtype` names one."""
    if args.dtype:
        return device
    mixed = device.at("bf16" if "bf16" in device.peak_tflops else "fp16")
    return dataclasses.replace(mixed, compiled=device.compiled)


def _fixed(args: Any, n: int) -> Layout:
    """The layout the options give at `n` GPUs (one line when its degrees do not divide n)."""
    lay: LayoutConfig = args.layout
    tp, pp = lay.tensor_parallel, lay.pipeline_parallel
    cp, ep = lay.context_parallel, lay.expert_parallel
    if n % (tp * pp * cp * ep):
        more = "".join(
            f" x --{flag} {size}"
            for flag, size in (("context-parallel", cp), ("expert-parallel", ep))
            if size > 1
        )
        raise GradmeshError(
            f"{n} GPUs do not divide into --tensor-parallel {tp} x --pipeline-parallel {pp}{more}"
        )
    if args.zero_stage > 1 and pp > 1:
        raise GradmeshError(
            f"--zero-stage {args.zero_stage} does not run with --pipeline-parallel in gradmesh "
            "(stage 1 does)"
        )
    if args.zero_stage not in (0, 1, 2, 3):
        raise GradmeshError(f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    check_sequence_parallel(lay.sequence_parallel, tp, pp)  # the trainer's own refusals of
    check_context_layout(lay, pp, args.zero_stage)  # axes that do not compose: the simulator
    check_expert_layout(lay, pp, args.zero_stage)  # prices what gradmesh can run
    if args.loss_parallel and tp < 2:
        raise GradmeshError(
            "--loss-parallel splits the logits over the tensor-parallel ranks: it needs "
            "--tensor-parallel 2 or more"
        )
    if lay.activation_checkpointing not in ("", "blocks", "ops", "attention"):
        raise GradmeshError(
            f"--activation-checkpointing {lay.activation_checkpointing}: the simulator prices "
            "blocks, ops and attention (every block), not every:K"
        )
    if args.context_gather and (lay.context_parallel < 2 or lay.context_attention != "ring"):
        raise GradmeshError(
            "--context-gather prices ring attention's keys and values all-gathered: it needs "
            "--context-parallel 2 or more and --context-attention ring"
        )
    return dataclasses.replace(lay.at(n, args.zero_stage), ring_gathers=args.context_gather)


def check_axes(meta: MetaProfile, lay: Layout) -> None:
    """The trainer's refusals of a layout, on the counted model: blocks for every pipeline
    stage, no mixtures of experts in a pipeline; attention cp can split (torch's, causal,
    unmasked), a sequence that cuts into 2 x cp chunks, for all-to-all heads that divide by cp;
    mixtures whose experts divide by ep (`--search` tries only such layouts)."""
    from gradmesh.layout.context.chunks import check_length
    from gradmesh.layout.context.parallel import check_heads
    from gradmesh.layout.engine import check_stage_count
    from gradmesh.layout.expert.parallel import check_mixtures

    seqs, experts, model = meta.profile.sequences, meta.profile.experts, meta.spec.model
    check_stage_count(len(meta.profile.block_names), lay.pp * lay.chunks, model)
    counts = {"of every block": experts.experts} if experts is not None else {}
    check_mixtures(counts, model, lay.ep, lay.pp)
    if lay.cp == 1:
        return
    if seqs is None:
        raise GradmeshError(
            f"--context-parallel: model {model} has no attention context parallelism splits "
            "(torch's scaled_dot_product_attention, causal, without a mask or dropout)"
        )
    check_length(meta.spec.sequence, lay.cp, f"--context-parallel: model {model}: ")
    if lay.attention == "alltoall":
        check_heads(seqs.heads, lay.tp, lay.cp, model)


def _row(p: Priced, n: int) -> dict[str, Any]:
    row = {"gpus": n, **p.row()}
    if not p.fits:  # marked, not priced
        for key in ("step_s", "tokens_per_s", "mfu"):
            row[key] = None
    return row


def _line(r: dict[str, Any], memory_gib: float) -> str:
    need = r["reserved_bytes"] / GIB
    if r["step_s"] is None:
        live = r["memory"]["total_bytes"] / GIB
        return (
            f"| {r['gpus']} | {r['name']} | - | - | - | {live:.1f} live | does not fit "
            f"({memory_gib:g} GiB less {CONTEXT_GIB:g}) |"
        )
    return (
        f"| {r['gpus']} | {r['name']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
        f"{r['mfu']:.1%} | {need:.1f} | yes |"
    )


def run_mesh(
    args: Any, gpus: list[int], strategies: list[str], device: Any, intra: Any, inter: Any
) -> int:
    """Price `args`' token model on `device` (`--device`'s, `--dtype` applied) over links
    `intra` and `inter` (`link_terms`)."""
    from gradmesh.launch.jobs import write_json

    if strategies != ["allreduce"]:
        raise GradmeshError(
            "a token model is priced on the mesh (--tensor-parallel, --pipeline-parallel, "
            "--zero-stage, or --search), not by --strategy"
        )
    if args.search and not args.global_batch:
        raise GradmeshError("--search needs --global-batch (samples a step)")
    if not args.search:
        refuse_unread(args, ("top",), "options of --search (the layouts it prints)")
    else:
        refuse_unread(args, ("context_gather",), "--search looks for layouts gradmesh runs")
    if args.global_batch < 0 or args.top < 1:
        raise GradmeshError("--global-batch must be >= 0 and --top >= 1")
    started = time.perf_counter()
    device = _mixed(args, device)
    spec = _spec(args, device)
    fixed = {n: _fixed(args, n) for n in gpus} if not args.search else {}
    tps = sorted({lay.tp for lay in fixed.values()}) or [
        t for t in divisors(args.gpus_per_node) if all(n % t == 0 for n in gpus)
    ]
    meta = meta_profile(spec, max(gpus), args.global_batch or args.batch_per_gpu, tps, device)
    for lay in fixed.values():
        check_axes(meta, lay)
    rows = _rows(args, meta, fixed, gpus, intra, inter)
    payload = {
        "model": spec.model,
        "model_args": spec.args,
        "parameters": meta.parameters,
        "flops_per_sample": meta.flops_per_sample,
        "sequence_length": spec.sequence,
        "device": {"name": args.device, **dataclasses.asdict(device)},
        "gpus_per_node": args.gpus_per_node,
        "links": {"intra": dataclasses.asdict(intra), "inter": dataclasses.asdict(inter)},
        "context_gib": CONTEXT_GIB,
        "rows": rows,
        "seconds_to_answer": time.perf_counter() - started,
    }
    write_json(args.json, payload)
    print(
        f"{spec.model}: {meta.parameters / 1e9:.2f}B parameters, "
        f"{meta.flops_per_sample / spec.sequence / 1e9:.1f} GFLOP a token; {args.device} in "
        f"{device.precision}, {device.memory_gib:g} GiB; answered in "
        f"{payload['seconds_to_answer']:.1f} s"
    )
    print("| GPUs | layout | step s | tokens/s | MFU | GiB a GPU | fits |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(_line(r, device.memory_gib))
    return 0


def _rows(
    args: Any,
    meta: MetaProfile,
    fixed: dict[int, Layout],
    gpus: list[int],
    intra: Any,
    inter: Any,
) -> list[dict[str, Any]]:
    """Each GPU count's layout priced (`fixed`), or its `--top` fastest that fit (`--search`)."""
    rows: list[dict[str, Any]] = []
    per_node, sequence, algorithm = args.gpus_per_node, meta.spec.sequence, args.allreduce.algorithm
    for n in gpus:
        if args.search:
            at = _at(meta, n, args.global_batch)
            found = search_layouts(at, intra, inter, per_node, sequence, algorithm, args.async_tp)
            rows += [_row(p, n) for p in found[: args.top]]
        else:
            lay = fixed[n]
            batch = args.global_batch or args.batch_per_gpu * lay.dp
            if batch % (lay.dp * lay.microbatches):
                raise GradmeshError(
                    f"a batch of {batch} samples does not divide into dp {lay.dp} x "
                    f"--microbatches {lay.microbatches} at {n} GPUs"
                )
            at = _at(meta, n, batch)
            priced = price(at, lay, intra, inter, per_node, sequence, algorithm, args.async_tp)
            rows.append(_row(priced, n))
    return rows


def _at(meta: MetaProfile, gpus: int, batch: int) -> MetaProfile:
    """`meta` for `gpus` GPUs at a global batch of `batch` samples."""
    prof = dataclasses.replace(meta.profile, workers=gpus, batch=batch)
    return dataclasses.replace(meta, profile=prof)
