"""The context and expert axes' prices, for the mesh planner (`mesh_cost.predict_mesh`) and
the simulator, from what one forward of the model shows (`record_axes`, run by the profile:
measured on this machine, counted on the meta device by the simulator).

**Context parallelism** at cp c: under load-balanced causal chunks each rank does 1/c of every
FLOP (linear layers on 1/c of the tokens, attention on 1/c of the causal pairs), so the compute
is the slice's at the same micro-batch divided by c, and the activations likewise. Each
attention call then exchanges, per rank, with K the keys and values of its chunks (the call's
whole-sequence bytes times b / c):
- ring: forward c - 1 transfers of K to the next rank, each overlapped with one block pair's
  attention (its FLOPs / c^2 of the call's, at the slice's measured FLOP rate); backward c - 1
  more, overlapped with twice that, and c transfers of the keys' and values' gradients (K in
  the work precision), which wait for their block: not overlapped. Bytes a step per rank:
  calls x (3 c - 2) x K. Where torch's `context_parallel` runs the ring (torchtitan's CP, the
  simulator's `--context-gather`), each call all-gathers every rank's keys and values at once
  (its default rotate method) instead of passing one block at a time: the same bytes arrive.
  The ring's memory (`context_held`): the exchange buffers of a call's backward beyond what
  the call keeps for it (the fp32 copies of the queries' gradient and of the output's, the
  queries' size, are left to the profile's transient), with g = 4 / the keys' element bytes
  (the gradients are fp32): gradmesh's ring (`layout/context/ring.py`) holds the block it
  computes against (a copy) and the one arriving, 2 K, and the key and value gradients being
  summed into and arriving, 2 g K; torch's holds every rank's keys and values gathered and its own
  concatenated to send, (c + 1) K, and the gradients summed into, concatenated to send and
  arriving, 3 g K.
- all-to-all (Ulysses): forward four all-to-alls (q, k, v, out) of the local activations Q
  (the call's query bytes times b / c), backward four more, (c - 1) / c of each leaving the
  rank; not overlapped.
**Expert parallelism** at ep e: each rank takes its own samples (a data-parallel axis for the
rest of the model) and holds E / e experts; each mixture's call sends its tokens' slots to
their experts and back, forward and backward: four all-to-alls of (e - 1) / e of the slots'
bytes. The experts' compute is the slice's times the measured imbalance (the busiest rank's
tokens over the mean, from the router's counts on the profile's batch), on the experts' share
of the FLOPs; their parameters count 1 / e, synced over their copies only.
An all-to-all of n bytes a rank over p ranks is priced as p - 1 messages of n / p each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gradmesh.data.batch as batch
from gradmesh.data.batch import Batch
from gradmesh.layout.config import Layout
from gradmesh.models.moe import MoE
from gradmesh.planner.links import Links
from gradmesh.runtime.axes import CP, EP


@dataclass
class Sequences:
    """The attention calls of one forward, per sample of the whole sequence."""

    calls: int
    kv_bytes: int
    """Keys and values of one call."""
    q_bytes: int
    """Queries (and the output) of one call."""
    flops: float
    """One call's causal attention FLOPs (scores and the weighted sum)."""
    heads: int
    length: int
    """The sequence's tokens."""
    element: int = 4
    """Bytes of one element of the keys (the ring's gradients are fp32 whatever it is)."""


def context_fits(seqs: Sequences | None, lay: Layout) -> bool:
    """Whether `lay`'s context parallelism can split these calls: the sequence cuts into 2 x cp
    chunks, and all-to-all attention's heads (on each tp rank) divide by cp."""
    if lay.cp == 1:
        return True
    if seqs is None or seqs.length % (2 * lay.cp):
        return False
    heads = seqs.heads // lay.tp if seqs.heads % lay.tp == 0 else 0
    return lay.attention == "ring" or (heads > 0 and heads % lay.cp == 0)


@dataclass
class Experts:
    """The mixtures of one forward, per sample."""

    calls: int
    experts: int
    slot_bytes: int
    """One call's token slots (tokens x top-k x width x element)."""
    param_bytes: int
    """Every mixture's experts' parameters, whole."""
    flops: float
    """The experts' forward FLOPs."""
    loads: list[float] = field(default_factory=list)
    """Token slots each expert took, summed over the calls."""

    def imbalance(self, ep: int) -> float:
        """The busiest of `ep` ranks' slots over the mean (1 when balanced)."""
        if ep == 1 or not self.loads or sum(self.loads) == 0:
            return 1.0
        per = len(self.loads) // ep
        ranks = [sum(self.loads[i * per : (i + 1) * per]) for i in range(ep)]
        return max(ranks) / (sum(ranks) / ep)


def record_axes(
    model: nn.Module, sample: Batch, call: Any
) -> tuple[Sequences | None, Experts | None]:
    """The attention calls and mixtures of one forward of `model` on `sample` (`call(model,
    sample)` runs it), per sample."""
    from gradmesh.layout.context.parallel import TORCH_ATTENTION, attention_replaced
    from gradmesh.models.hf import is_causal_mask

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    splittable = [True]

    def recording(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **kw: Any,
    ) -> Any:
        seen.append((query, key))
        causal = (is_causal and attn_mask is None) or is_causal_mask(attn_mask)
        splittable[0] = splittable[0] and causal and not dropout_p
        return TORCH_ATTENTION(query, key, value, attn_mask, dropout_p, is_causal, **kw)

    with torch.no_grad(), attention_replaced(recording):
        call(model, sample)
    seqs = None
    if seen and splittable[0]:
        q, k = seen[0]
        b, h, t, d = q.shape
        kv = 2 * k[0].numel() * k.element_size() * (h // k.shape[1])
        per = q[0].numel() * q.element_size()
        seqs = Sequences(len(seen), kv, per, 2.0 * t * t * h * d, h, t, k.element_size())
    mixtures = [m for m in model.modules() if isinstance(m, MoE)]
    experts = None
    if mixtures:
        first = next(p for p in model.parameters())
        width = mixtures[0].w1.shape[1]
        length = batch.leaves(sample)[0].shape[1]  # each token's k slots, in every mixture
        tokens = float(sum(m.top_k for m in mixtures) * length)
        hidden = mixtures[0].w1.shape[2]
        params = sum(
            sum(p.numel() * p.element_size() for p in (m.w1, m.b1, m.w2, m.b2)) for m in mixtures
        )
        loads = [0.0] * mixtures[0].experts
        for m in mixtures:
            if m.counts is not None and not m.counts.is_meta:
                loads = [a + float(c) for a, c in zip(loads, m.counts.tolist(), strict=True)]
        slot = tokens / len(mixtures) * width * first.element_size()
        experts = Experts(
            len(mixtures),
            mixtures[0].experts,
            int(slot),
            params,
            4.0 * tokens * width * hidden,
            loads,
        )
    return seqs, experts


def _all_to_all_s(links: Links, ranks: list[int], n: float) -> float:
    """n bytes a rank exchanged among `ranks`: p - 1 messages of n / p."""
    p = len(ranks)
    if p == 1:
        return 0.0
    link = links.over(ranks, int(n / p))
    return (p - 1) * (link.alpha + n / p * link.beta)


def context_s(seqs: Sequences | None, lay: Layout, links: Links, b: int, rate: float) -> float:
    """Seconds a step's attention exchanges over cp take, not hidden by compute (the module
    docstring)."""
    c = lay.cp
    if c == 1 or seqs is None:
        return 0.0
    ranks = lay.line((CP,))
    if lay.attention == "alltoall":  # each tp rank's heads: 1 / tp of the whole model's
        return seqs.calls * 8 * _all_to_all_s(links, ranks, seqs.q_bytes * b / (c * lay.tp))
    k = seqs.kv_bytes * b / (c * lay.tp)
    link = links.point_to_point or links.over(ranks[:2], int(k))
    one = link.alpha + k * link.beta
    block = seqs.flops * b / (c * c) / rate if rate > 0 else 0.0
    forward = (c - 1) * max(0.0, one - block)
    backward = (c - 1) * max(0.0, one - 2 * block) + c * one
    return seqs.calls * (forward + backward)


def context_held(seqs: Sequences | None, lay: Layout, b: int) -> float:
    """Bytes the ring holds at an attention call's backward beyond what the call keeps for it
    (the module docstring), at micro-batches of `b` samples; none at cp 1 or all-to-all (its
    exchanges are the size of the call's own inputs and outputs)."""
    c = lay.cp
    if c == 1 or seqs is None or lay.attention == "alltoall":
        return 0.0
    k, g = seqs.kv_bytes * b / (c * lay.tp), 4 / seqs.element
    return k * (c + 1 + 3 * g) if lay.ring_gathers else k * (2 + 2 * g)


def context_bytes(seqs: Sequences | None, lay: Layout, b: int) -> float:
    """Bytes a rank sends a step over cp (the formula `gradmesh bench layout` checks)."""
    c = lay.cp
    if c == 1 or seqs is None:
        return 0.0
    if lay.attention == "alltoall":
        return seqs.calls * 8 * seqs.q_bytes * b / (c * lay.tp) * (c - 1) / c
    return seqs.calls * (3 * c - 2) * seqs.kv_bytes * b / (c * lay.tp)


def expert_s(exp: Experts | None, lay: Layout, links: Links, b: int) -> float:
    """Seconds a step's dispatches over ep take (four all-to-alls a mixture)."""
    if exp is None or lay.ep == 1:
        return 0.0
    ranks = lay.line((EP,))
    return exp.calls * 4 * _all_to_all_s(links, ranks, exp.slot_bytes * b)


def expert_bytes(exp: Experts | None, lay: Layout, b: int) -> float:
    if exp is None or lay.ep == 1:
        return 0.0
    return exp.calls * 4 * exp.slot_bytes * b * (lay.ep - 1) / lay.ep


def expert_bytes_held(exp: Experts | None, lay: Layout) -> int:
    """The experts' parameter bytes one rank holds (1 / ep of them; none without)."""
    return exp.param_bytes // lay.ep if exp is not None else 0


def compute_factor(exp: Experts | None, block_flops: float, lay: Layout) -> float:
    """The slice's compute at cp c is 1 / c of it (load-balanced chunks); the experts' share
    of it (their FLOPs over the blocks') takes the busiest ep rank's load (`imbalance`)."""
    factor = 1 / lay.cp
    if exp is not None and block_flops:
        share = min(1.0, exp.flops / block_flops)
        factor *= 1 + share * (exp.imbalance(lay.ep) - 1)
    return factor
