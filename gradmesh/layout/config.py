"""The layout's options: how one replica of the model is split over ranks (the rest of the
workers are data-parallel replicas). No torch here: the CLI builds its flags from this."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.options import option
from gradmesh.runtime.axes import AXES, CP, DP, EP, PP, SPLITTING, TP, MeshShape

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
"""Pipeline schedules by name (`gradmesh.layout.pipeline.order` gives their actions)."""
V_SHAPED = frozenset({"zbv"})
"""Schedules placing two stages a rank in a V (rank r: stages r and 2 p - 1 - r)."""


def chunks_of(schedule: str, pp: int, virtual: int) -> int:
    """Chunks of the model each of `pp` pipeline ranks holds under `schedule`."""
    if pp == 1:
        return 1
    return virtual if schedule == "interleaved" else 2 if schedule in V_SHAPED else 1


LAYOUT_KEYS = ("workers", *(a.flag for a in SPLITTING), "zero_stage")
"""The settings of a layout, by option: the world, each splitting axis's size, the ZeRO stage.
The one list the checkpoint's identity, `--reshard` and the resharder read."""
RESHARDABLE = frozenset(
    {"workers", "zero_stage", *(a.flag for a in AXES if a.flag and a.reshardable)}
)
"""The layout settings a resharded resume may change (not the pipeline's)."""


@dataclass
class LayoutConfig:
    """Layout: how one replica of the model is split over ranks (the rest of the workers are
    data-parallel replicas)."""

    tensor_parallel: int = option(1, "ranks each layer of the model's plan is split over (tp)")
    pipeline_parallel: int = option(1, "pipeline stages the model's layers are cut into (pp)")
    context_parallel: int = option(
        1,
        "ranks each sequence is split over (cp), each holding two of 2 x cp chunks (one early, "
        "one late: the causal work balanced); attention exchanges keys and values "
        "(--context-attention); the same batch on each, gradients averaged over them",
    )
    context_attention: str = option(
        "ring",
        "context parallelism's attention: ring (keys and values passed around the cp ranks, "
        "each step's transfer overlapped with a block's attention) or alltoall (Ulysses: "
        "heads exchanged for sequence, each rank attends its heads over the whole sequence)",
        choices=("ring", "alltoall"),
    )
    expert_parallel: int = option(
        1,
        "ranks a mixture of experts' experts are spread over (ep), tokens dispatched to their "
        "experts and back by all-to-all; each takes its own samples, as a data-parallel "
        "replica does (a model with experts: --model gpt --model-args experts=8,top_k=2)",
    )
    microbatches: int = option(1, "pipeline: micro-batches per replica's batch")
    schedule: str = option(
        "1f1b",
        "pipeline schedule: gpipe, 1f1b, interleaved (--virtual-stages chunks a rank), zb-h1 "
        "(1F1B's memory, backward split into input and weight gradients, the weights' filling "
        "the bubble; m >= p) or zbv (two stages a rank in a V, near-zero bubble; "
        "m >= 2 (p - 1)); docs/model_parallel.md",
        choices=SCHEDULES,
    )
    virtual_stages: int = option(
        2,
        "pipeline, interleaved schedule: chunks of the model each rank holds (rank s holds "
        "stages s, s + p, ... of a pipeline p x this long)",
    )
    stages: str = option(
        "",
        "pipeline: where each stage after the first starts: layer indices of a sequence of "
        "layers (4,9) or module names of any other model (blocks.2,blocks.4); default: "
        "balanced (by measured layer time, or by forward FLOPs on the model's graph)",
    )
    precision: str = option(
        "fp32",
        "bf16: forwards under bf16 autocast; weights, gradients, optimizer state and reductions "
        "stay fp32 (as do the values crossing pipeline stages); fp16 (dynamic loss scaling) "
        "needs a GPU; fp8: the blocks' linear layers in float8 through torchao, the rest as "
        "bf16 (Hopper or Ada GPUs; docs/gpu.md)",
        choices=("fp32", "bf16", "fp16", "fp8"),
    )
    compile: bool = option(
        False,
        "torch.compile each of the model's blocks (the whole model where it has none, or in a "
        "world of one without recomputation or ZeRO 2/3), after the tensor split, before "
        "sharding; not with --pipeline-parallel or --plan",
    )
    sequence_parallel: bool = option(
        False,
        "with --tensor-parallel: between the split layers each tp rank holds its part of the "
        "sequence (norms, residuals; the model's sp_plan; not with --pipeline-parallel)",
    )
    activation_checkpointing: str = option(
        "",
        "recompute activations in backward instead of keeping them: blocks (every block of the "
        "model's block list), every:K (every K-th block), ops (every block, keeping its matrix "
        "products' outputs every other one and its fused attention's: torchtitan's selective "
        "recomputation) or attention (each block's attention module only: Megatron's)",
    )
    plan: str = option(
        "",
        "hybrid plan, a placement per layer: a plan file (gradmesh plan --json), or auto to "
        "plan for this host's loopback link; sets --tensor-parallel",
    )

    @property
    def chunks(self) -> int:
        """Chunks of the model each pipeline rank holds (more than one: interleaved)."""
        return chunks_of(self.schedule, self.pipeline_parallel, self.virtual_stages)

    def mesh_sizes(self) -> dict[str, int]:
        """The splitting axes' sizes, axis name -> size (the data axis is the rest)."""
        return {a.name: int(getattr(self, a.flag)) for a in SPLITTING}

    @property
    def split(self) -> bool:
        """Whether one replica's work spans more than one rank."""
        return math.prod(self.mesh_sizes().values()) > 1

    def at(self, workers: int, zero_stage: int = 0) -> Layout:
        """This layout on `workers` ranks, as the planner and the simulator price it."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        return Layout(
            workers // math.prod(self.mesh_sizes().values()),
            tp,
            pp,
            self.microbatches,
            self.schedule if pp > 1 else None,
            self.chunks,
            zero_stage,
            self.activation_checkpointing == "blocks",
            self.context_parallel,
            self.expert_parallel,
            self.context_attention,
            self.activation_checkpointing if self.activation_checkpointing in SELECTIVE else "",
        )


SELECTIVE = {"ops": "sac", "attention": "aac"}
"""The selective recomputations a layout prices (`--activation-checkpointing`), and the suffix
of its name: per operation (`gradmesh.layout.selective`) and the attention module only."""


@dataclass(frozen=True)
class Layout:
    """One layout of a job on `dp` x `tp` x `pp` ranks, as the planner and the simulator price
    it: the mesh's sizes and the options that change a step's cost, named as `LayoutConfig`
    names them (`chunks` is `LayoutConfig.chunks`: the chunks each pipeline rank holds, 1 but
    under the interleaved schedule). Made from the options by `LayoutConfig.at`; `options()`
    gives them back, which `gradmesh train` and the recipe take, and `flags()` prints them."""

    dp: int
    tp: int
    pp: int
    microbatches: int = 1
    schedule: str | None = None
    chunks: int = 1
    zero_stage: int = 0
    """Sharded data parallelism's stage on the dp axis (`--zero-stage`)."""
    checkpointing: bool = False
    """Every block recomputed in backward (`--activation-checkpointing blocks`)."""
    cp: int = 1
    """Context-parallel ranks a sequence is split over (`--context-parallel`)."""
    ep: int = 1
    """Expert-parallel ranks a mixture's experts are spread over (`--expert-parallel`)."""
    attention: str = "ring"
    """Context parallelism's exchange (`--context-attention`)."""
    recompute: str = ""
    """Selective recomputation of every block (`SELECTIVE`), where `checkpointing` is not."""
    ring_gathers: bool = False
    """Ring attention as torch's `context_parallel` runs it (torchtitan's CP): every cp rank's
    keys and values all-gathered once a call, not passed a block at a time as gradmesh's ring does
    (priced by the simulator's `--context-gather`; trained with gradmesh's ring)."""

    @property
    def recomputation(self) -> str:
        """`--activation-checkpointing`'s value for this layout: blocks, ops, attention or ""."""
        return "blocks" if self.checkpointing else self.recompute

    def micro(self, batch: int) -> int:
        """Samples of one micro-batch on a rank, of a global `batch` (the cp ranks share
        theirs)."""
        return batch // (self.dp * self.ep * self.microbatches)

    @property
    def shards(self) -> int:
        """The ranks ZeRO stages 2 and 3 shard a parameter over: those that hold it (dp x cp;
        expert parallelism refuses these stages)."""
        return self.dp * self.cp

    @property
    def shape(self) -> MeshShape:
        """The mesh this layout runs on."""
        return MeshShape.of({DP: self.dp, PP: self.pp, EP: self.ep, CP: self.cp, TP: self.tp})

    def line(self, axes: tuple[str, ...]) -> list[int]:
        """The ranks of rank 0's line along `axes` on this layout's mesh."""
        return self.shape.first_line(axes)

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp}"] + [f"tp{self.tp}"] * (self.tp > 1)
        if self.cp > 1:
            kind = "a2a" if self.attention == "alltoall" else "ag" if self.ring_gathers else ""
            parts.append(f"cp{self.cp}{kind}")
        parts += [f"ep{self.ep}"] * (self.ep > 1)
        if self.pp > 1:
            suffix = {"interleaved": "i", "zb-h1": "zb", "zbv": "v"}.get(self.schedule or "", "")
            parts.append(f"pp{self.pp}{suffix}")
        if self.pp > 1 or self.microbatches > 1:
            parts.append(f"m{self.microbatches}")
        parts += [f"z{self.zero_stage}"] * (self.zero_stage > 0) + ["ac"] * self.checkpointing
        if self.recompute and not self.checkpointing:
            parts.append(SELECTIVE[self.recompute])
        return "x".join(parts)

    def options(self) -> dict[str, Any]:
        """The `gradmesh train` options (by field name) that run this layout."""
        return {
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "microbatches": self.microbatches if self.pp > 1 else 1,
            "schedule": self.schedule or "1f1b",
            "virtual_stages": max(self.chunks, 2),
            "zero_stage": self.zero_stage,
            "activation_checkpointing": self.recomputation,
            "context_parallel": self.cp,
            "context_attention": self.attention,
            "expert_parallel": self.ep,
        }

    def flags(self) -> str:
        """The `gradmesh train` flags that run this layout."""
        out = [f"--tensor-parallel {self.tp}"] * (self.tp > 1)
        if self.pp > 1:
            out.append(f"--pipeline-parallel {self.pp} --microbatches {self.microbatches}")
            out.append(f"--schedule {self.schedule}")
            if self.schedule == "interleaved":
                out.append(f"--virtual-stages {self.chunks}")
        if self.zero_stage:
            out.append(f"--zero-stage {self.zero_stage}")
        if self.recomputation:
            out.append(f"--activation-checkpointing {self.recomputation}")
        if self.cp > 1:
            out.append(f"--context-parallel {self.cp} --context-attention {self.attention}")
        if self.ep > 1:
            out.append(f"--expert-parallel {self.ep}")
        return " ".join(out) or "(data parallel: no layout flags)"


def every_of(spec: str) -> int:
    """'blocks' and 'attention' -> 1 (every block, or its attention), 'every:k' -> k; one line
    for anything else."""
    if spec in ("blocks", "attention", "ops"):
        return 1
    head, _, k = spec.partition(":")
    if head == "every" and k.isdigit() and int(k) >= 1:
        return int(k)
    raise GradmeshError(
        f"--activation-checkpointing {spec!r}: expected blocks (every block), every:K (every "
        "K-th block), ops (every block, keeping the outputs costliest to redo) or attention "
        "(every block's attention)"
    )


def check_sequence_parallel(sequence_parallel: bool, tp: int, pp: int) -> None:
    """One line unless sequence parallelism can run on this mesh."""
    if sequence_parallel and (tp < 2 or pp > 1):
        raise GradmeshError(
            "--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs "
            "--tensor-parallel 2 or more, and not --pipeline-parallel (a pipeline stage's graph "
            "does not carry the hooks that sum the norms' gradients)"
        )


def check_precision(precision: str) -> None:
    """One line unless `gradmesh train` can run `precision` here: fp16 asks for a GPU, fp8 for
    one with fp8 tensor cores and torchao (`gradmesh.layout.fp8`, which says which layouts)."""
    if precision == "fp8":
        from gradmesh.layout.fp8 import fp8_problem

        problem = fp8_problem()
        if problem:
            raise GradmeshError(problem)
    if precision == "fp16":
        import torch

        if not torch.cuda.is_available():
            raise GradmeshError(
                "--precision fp16 needs a GPU: its dynamic loss scaling is for CUDA's fp16 "
                "kernels; on CPU use --precision bf16"
            )


def check_fp8(tp: int, pp: int, plan: str) -> None:
    """One line for the layouts fp8 does not serve yet: its `Float8Linear` is not one of
    gradmesh's split layers (tp, a hybrid plan), nor traced into a pipeline's stage graphs."""
    if tp > 1 or plan:
        raise GradmeshError(
            "--precision fp8 with --tensor-parallel or --plan: gradmesh's split layers are "
            "not fp8 layers yet; use data parallelism or --zero-stage"
        )
    if pp > 1:
        raise GradmeshError(
            "--precision fp8 with --pipeline-parallel: the stages' traced graphs do not take "
            "fp8 layers yet; use data parallelism or --zero-stage"
        )


def check_compile(pp: int, plan: str) -> None:
    """One line for the layouts `--compile` cannot serve (`gradmesh.layout.compile` says why)."""
    if pp > 1:
        raise GradmeshError(
            "--compile with --pipeline-parallel: a pipeline's stages are graphs torch already "
            "traced and cut; compile a data-, tensor-parallel or sharded layout"
        )
    if plan:
        raise GradmeshError(
            "--compile with --plan: a hybrid plan swaps layers per rank; compile a data-, "
            "tensor-parallel or sharded layout"
        )


def check_context_layout(layout: LayoutConfig, pp: int, zero_stage: int) -> None:
    """One line for what context parallelism does not compose with (the options alone; the
    model's sequence, positions and attention: `gradmesh.layout.context.check_context`)."""
    cp, ep = layout.context_parallel, layout.expert_parallel
    if cp < 1 or ep < 1:
        raise GradmeshError(
            f"--context-parallel and --expert-parallel must be >= 1, got {cp} and {ep}"
        )
    if cp == 1:
        return
    refusals = (
        (
            pp > 1,
            "--pipeline-parallel: a pipeline's stages are graphs traced on whole "
            "sequences, whose attention the ring does not reach",
        ),
        (layout.sequence_parallel, "--sequence-parallel: both split the sequence; use one"),
        (layout.compile, "--compile: the ring's exchanges run between compiled graphs"),
        (
            bool(layout.plan),
            "--plan: a hybrid plan places layers over data and tensor parallelism only",
        ),
        (
            ep > 1,
            "--expert-parallel: the experts' all-to-all and the ring's chunks are not "
            "composed yet; use one",
        ),
    )
    for refused, why in refusals:
        if refused:
            raise GradmeshError(f"--context-parallel {cp} with {why}")
    del zero_stage  # ZeRO 1-3 shard over every replica, the cp ranks included


def check_expert_layout(layout: LayoutConfig, pp: int, zero_stage: int) -> None:
    """One line for what expert parallelism does not compose with (the options alone; the
    model's experts: `gradmesh.layout.expert.check_expert`)."""
    ep = layout.expert_parallel
    if ep == 1:
        return
    refusals = (
        (
            pp > 1,
            "--pipeline-parallel: the balance loss of a stage's mixtures does not reach "
            "the last stage's loss",
        ),
        (
            zero_stage >= 2,
            f"--zero-stage {zero_stage}: FSDP2 would shard each rank's own "
            "experts over replicas that hold others; use --zero-stage 1",
        ),
        (
            bool(layout.plan),
            "--plan: a hybrid plan places layers over data and tensor parallelism only",
        ),
        (layout.compile, "--compile: the dispatch's token counts change the graph each step"),
    )
    for refused, why in refusals:
        if refused:
            raise GradmeshError(f"--expert-parallel {ep} with {why}")
