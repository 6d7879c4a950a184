"""The mesh planner's memory model: the bytes one rank holds at the peak of a step under a
layout (dp x tp x pp x cp x ep, m micro-batches of b samples, a schedule, a ZeRO stage z,
activation checkpointing or not), from the same profile its time is priced on (`profile_mesh`:
rank 0's slice at each tp degree T, measured once at its largest micro-batch of S samples). The
rank counted is the pipeline rank that holds the most. Context parallelism at cp c holds 1/c of
each sequence, so every activation term is taken at b / c samples (the ring keeps what torch's
fused attention keeps: queries, keys, values, output and log-sum-exp, of its own chunks), and
the ring's exchange buffers at an attention's backward are held on top, once
(`axes_cost.context_held`);
expert parallelism at ep e keeps 1/e of the experts' parameters (and their gradients and
optimizer state); stages 2 and 3 shard over dp x cp, stage 1 over dp.

- **State** of the rank's blocks (and of the embeddings, head and final norm on the end stages,
  where a tied weight lives on both): parameters g, gradients g, and the optimizer's state k g,
  k measured (the slice's optimizer state after one step over its parameters: AdamW 2, SGD with
  momentum 1). Stage 1 divides the optimizer's part by dp, stages 2 and 3 all three. In mixed
  precision (`Slice.mixed`: 16-bit parameters, fp32 master copies in the optimizer's state)
  the gradients are reduced and kept in fp32 (Megatron's main gradients: 2 + 4 + 12 bytes a
  parameter, and with ZeRO-1 Megatron's distributed optimizer's 6 + 12 / d); under FSDP2 the
  fp32 shards are themselves the master copy (4 + 4 + 8 bytes a parameter, over the shards),
  the blocks gathered in 16 bits and each unit's gradient reduced in fp32.
- **Activations**: what one micro-batch saves for backward, per block (under selective
  recomputation what the policy keeps: `Saved.recomputed`) (`saved_activations`:
  autograd's saved-tensor hooks during a forward of the slice, each storage counted once, the
  parameters not at all) times b / S, and what the rest saves (embeddings, head, loss) on the end
  stages. The micro-batches in flight are read off the schedule the engine runs
  (`schedule_actions`: each (chunk, micro-batch) held from its forward to its backward, to its
  W under a zero-bubble schedule, which also keeps from B to W the gradients its weights'
  operations received (`Saved.kept`), the most held at once: `peak_in_flight`); one without a
  pipeline. On top, once, the step's transient: the measured peak of one forward and backward
  beyond what it saved (the loss's buffers, the first gradients of backward), times b / S.
  With checkpointing a block keeps only what entered it; on top of those, the transient and
  the larger of the rest's saved bytes (the peak as backward starts) and the largest block
  rebuilt in backward (the peak inside it, where the gradients flowing back are as large as at
  the start).
- **Gathered parameters** (FSDP2, stages 2 and 3; no pipeline): the root's parameters (embeddings,
  head) stay gathered through the step; stage 3 holds two units gathered at once (one running,
  the next prefetched) and stage 2 every unit from forward to backward; and one unit's
  unsharded gradient before its reduce-scatter.
- **The optimizer's step**: its temporaries (AdamW's foreach step makes one more copy of the
  parameters it updates), measured on the slice (`peak_bytes` of one step) and scaled to the
  parameters this rank updates (a 1/dp part from stage 1 on). They are made after backward has
  freed the activations, so the step holds the larger of the two, not their sum.

Not counted: the gradient buckets of plain data parallelism (they fill in backward as the
activations they outlive are freed), and the runtime's own memory (the interpreter, torch,
Gloo's buffers, the allocator's: `gradmesh bench memory --limit` shows that part).
`gradmesh bench memory --world W` prints each layout's predicted step peak beside the measured
one (docs/memory.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import Layout
from gradmesh.layout.pipeline.order import peak_in_flight, schedule_actions
from gradmesh.layout.pipeline.zero_bubble import Action
from gradmesh.planner.axes_cost import context_held, expert_bytes_held
from gradmesh.planner.mesh import MeshProfile, Slice, rank_blocks

__all__ = [
    "MemoryPrediction",
    "in_flight",
    "param_bytes",
    "named_layout",
    "parse_layout",
    "predict_memory",
    "recompute_share",
]

RECOMPUTE = 1 / 3
"""The extra compute of checkpointing every block, as a fraction of a step's forward and
backward: one more forward of each block, whose backward costs about twice its forward. An
upper bound, since the embeddings, the head and the loss are not recomputed (measured on the GPT:
1.21x the step, docs/memory.md)."""


@dataclass
class MemoryPrediction:
    """Bytes one rank holds at the step's peak, by part."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    gathered_bytes: float
    optimizer_step_bytes: float = 0.0

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def step_bytes(self) -> float:
        """What a step holds at its peak on top of the state: activations and gathered
        parameters in forward and backward, or the optimizer step's temporaries after them."""
        return max(self.activation_bytes + self.gathered_bytes, self.optimizer_step_bytes)

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.step_bytes

    def parts(self) -> dict[str, float]:
        return {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes,
            "optimizer state": self.optimizer_bytes,
            "activations": self.activation_bytes,
            "gathered parameters": self.gathered_bytes,
            "the optimizer step's temporaries": self.optimizer_step_bytes,
        }

    @property
    def dominant(self) -> str:
        """The largest part's name."""
        parts = self.parts()
        return max(parts, key=lambda k: parts[k])


def param_bytes(prof: MeshProfile, lay: Layout, blocks: Iterable[int]) -> int:
    """The parameter bytes of these blocks at `lay`'s tp, with the rest (embeddings, head) where
    they include an end of the model."""
    sl = prof.slices[lay.tp]
    names = prof.block_names
    mine = list(blocks)
    ends = not names or 0 in mine or len(names) - 1 in mine
    return sum(sl.block_param_bytes[names[i]] for i in mine) + sl.rest_param_bytes * ends


def in_flight(lay: Layout, rank: int, held: list[float], kept: list[float] | None = None) -> float:
    """The most bytes `rank`'s schedule keeps at once, `held[c]` a micro-batch of chunk c
    (`kept[c]`: what a zero-bubble schedule keeps from its B to its W)."""
    if lay.pp == 1:
        return held[0]
    actions = _actions(lay.schedule or "1f1b", rank, lay.pp, lay.microbatches, lay.chunks)
    return peak_in_flight(actions, held, kept)


@functools.lru_cache(maxsize=1024)
def _actions(kind: str, rank: int, stages: int, m: int, chunks: int) -> tuple[Action, ...]:
    """`schedule_actions`, kept: a mesh search prices the same schedule for many layouts."""
    return tuple(schedule_actions(kind, rank, stages, m, chunks))


def _saved(sl: Slice, name: str, lay: Layout) -> float:
    """Bytes per sample block `name` keeps from its forward to its backward."""
    assert sl.saved is not None
    return sl.saved.recomputed(lay.recomputation)[0][name] / sl.saved_samples


def _state(sl: Slice, g: float, lay: Layout, slots: float) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) of `g` parameter bytes on a rank (module
    docstring), `slots` the optimizer's state bytes per parameter byte."""
    dp = lay.shards if lay.zero_stage >= 2 else lay.dp  # FSDP2 over dp x cp, ZeRO-1 over dp
    if not sl.mixed:
        shard = g / dp if lay.zero_stage >= 2 else g
        return shard, shard, slots * (g / dp if lay.zero_stage >= 1 else g)
    if lay.zero_stage >= 2:  # fp32 shards are the master copy: 4 + 4 + the moments, over dp
        return 2 * g / dp, 2 * g / dp, (slots - 2) * g / dp
    return g, 2 * g, slots * (g / dp if lay.zero_stage else g)  # fp32 gradients: 6 + 12 / d


def predict_memory(prof: MeshProfile, lay: Layout) -> MemoryPrediction:
    """The module docstring's formulas, for the pipeline rank that holds the most."""
    sl = prof.slices[lay.tp]
    saved = sl.saved
    assert saved is not None, "the profile measured no activations"
    names = prof.block_names
    b = lay.micro(prof.batch) / lay.cp  # context parallelism: 1/cp of each sequence's tokens
    experts = prof.experts.param_bytes if prof.experts is not None else 0
    away = experts - expert_bytes_held(prof.experts, lay)  # the other ep ranks' experts
    whole = sum(sl.block_param_bytes.values()) + sl.rest_param_bytes
    slots = sl.optimizer_bytes / whole if whole else 0.0
    per_sample = saved.rest + sum(saved.blocks.values())
    transient = max(0.0, saved.peak - per_sample) / sl.saved_samples
    table = saved.recomputed(lay.recomputation)[0]
    rebuilt = (saved.blocks[n] - table[n] + saved.inputs[n] for n in names)
    biggest = max(rebuilt, default=0) / sl.saved_samples
    ring = context_held(prof.sequences, lay, lay.micro(prof.batch))
    best: MemoryPrediction | None = None
    for rank, chunks in enumerate(rank_blocks(prof, lay)):
        mine = [i for chunk in chunks for i in chunk]
        g = float(param_bytes(prof, lay, mine) - away)
        ends = 0 in mine or len(names) - 1 in mine or not names
        held = [b * sum(_saved(sl, names[i], lay) for i in chunk) for chunk in chunks]
        rest = saved.rest / sl.saved_samples if ends else 0.0
        kept_rest = saved.kept_rest / sl.saved_samples if ends else 0.0
        kept = [
            b * (kept_rest + sum(saved.kept.get(names[i], 0) for i in chunk) / sl.saved_samples)
            for chunk in chunks
        ]
        if lay.recomputation:  # the transient, with the rest or one block rebuilt: the larger
            acts = in_flight(lay, rank, held, kept) + b * (transient + max(rest, biggest))
        else:  # the embeddings' on the first stage, the head's and the loss's on the last
            acts = in_flight(lay, rank, [h + b * rest for h in held], kept) + b * transient
        acts += ring
        params, grads, optimizer = _state(sl, g, lay, slots)
        gathered = 0.0
        if lay.zero_stage >= 2:
            unit = max((sl.block_param_bytes[n] for n in names), default=0)
            root = sl.rest_param_bytes if ends else 0  # this rank's part of the root unit
            units = g - root if lay.zero_stage == 2 else 2 * unit  # stage 2: its blocks
            gathered = root + units + unit * (1 + sl.mixed)  # a unit's gradient, in fp32
            if lay.zero_stage == 2 and lay.pp > 1:  # torchtitan's FSDP in a pipeline reduces
                gathered += g - root  # once a step: the unsharded gradients live through it
        dp = lay.shards if lay.zero_stage >= 2 else lay.dp
        updated = g / dp if lay.zero_stage >= 1 else g
        temporaries = sl.optimizer_step_bytes * updated / whole if whole else 0.0
        this = MemoryPrediction(params, grads, optimizer, acts, gathered, temporaries)
        if best is None or this.total_bytes > best.total_bytes:
            best = this
    assert best is not None
    return best


def recompute_share(sl: Slice, lay: Layout) -> float:
    """The step's extra compute for recomputation: `RECOMPUTE` for whole blocks; under a
    selective policy its blocks' recomputed forward FLOPs over three forwards of the blocks
    (forward and backward, the head's left out as `RECOMPUTE` leaves it)."""
    if lay.checkpointing:
        return RECOMPUTE
    if not lay.recompute or sl.saved is None or not sl.saved.block_flops:
        return 0.0
    redone = sum(sl.saved.recomputed(lay.recompute)[1].values())
    return float(redone / (3 * sum(sl.saved.block_flops.values())))


_LAYOUT = re.compile(r"^(dp|zero[123])(?:xtp(\d+))?(?:xcp(\d+))?(\+ac)?$")


def parse_layout(name: str, world: int) -> dict[str, Any]:
    """`dp`, `zero1`..`zero3`, with `xtpT` (tensor parallelism T, dp the rest), `xcpC`
    (context parallelism C) and `+ac` (activation checkpointing of every block): (stage, tp,
    cp, checkpointing)."""
    match = _LAYOUT.match(name)
    if not match:
        raise GradmeshError(
            f"unknown memory layout {name!r} (like dp, zero1, zero2, zero3, zero3+ac, dpxtp2, "
            "zero3xtp2, dpxcp2)"
        )
    kind, tp, cp = match.group(1), int(match.group(2) or 1), int(match.group(3) or 1)
    if tp < 1 or cp < 1 or world % (tp * cp):
        raise GradmeshError(f"layout {name}: tp {tp} x cp {cp} does not divide --world {world}")
    return {
        "stage": 0 if kind == "dp" else int(kind[-1]),
        "tp": tp,
        "cp": cp,
        "checkpointing": bool(match.group(4)),
    }


def named_layout(name: str, world: int) -> Layout:
    """The `Layout` a memory layout's name (`parse_layout`) gives at `world` ranks: tp x cp
    ranks a replica, dp the rest, one pipeline stage."""
    lay = parse_layout(name, world)
    return Layout(
        world // (lay["tp"] * lay["cp"]),
        lay["tp"],
        1,
        zero_stage=lay["stage"],
        checkpointing=lay["checkpointing"],
        cp=lay["cp"],
    )
