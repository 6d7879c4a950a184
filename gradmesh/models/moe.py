"""A mixture of experts, the MLP of a block: a router scores each token against E experts
(two-layer MLPs), keeps its top-k, and the token's output is their outputs weighted by the
router's probabilities renormalised over those k (Mixtral's gating). Tokens are sorted by
expert and each expert runs once on its tokens (`run`); where the experts live is the
dispatcher's business (`dispatch`: here, this module; under expert parallelism an all-to-all
to the ranks holding them, `gradmesh.layout.expert`).

Routing is dropless by default (every token reaches its k experts: what one process computes,
whatever the layout); `capacity` c > 0 keeps at most ceil(c x tokens x k / E) tokens an expert
and drops the rest (their slot's output is zero), as Switch and GShard do to bound the work.

The balance loss (`aux_loss`, weighted by `balance`) is Switch's E x sum_e f_e P_e (f_e the
share of token slots sent to expert e, P_e the mean router probability of e), taken per
sequence and averaged over the sequences (DeepSeek-V3's sequence-wise form): a mean over
samples, so that splitting the batch over ranks does not change it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gradmesh.errors import GradmeshError

Dispatch = Callable[["MoE", torch.Tensor, torch.Tensor], torch.Tensor]
"""dispatch(mixture, tokens sorted by expert, tokens per expert (E,)) -> their outputs, in the
same order."""


class MoEOutput(NamedTuple):
    """A model with mixtures returns its logits and the balance losses' sum (the engines add
    `aux_loss` to the loss: `gradmesh.layout.loss`)."""

    logits: torch.Tensor
    aux_loss: torch.Tensor


def local(moe: MoE, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this module."""
    if counts.is_meta:
        return moe.run(tokens, [len(tokens) // moe.experts] * moe.experts)
    return moe.run(tokens, [int(n) for n in counts.tolist()])


class MoE(nn.Module):
    """Top-k routing over `experts` MLPs of `hidden` units (module names `router`, `w1`, `b1`,
    `w2`, `b2`: the experts' weights stacked, expert first)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int,
        capacity: float = 0.0,
        balance: float = 0.01,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        check_routing(experts, top_k, capacity)
        self.experts, self.top_k, self.capacity, self.balance = experts, top_k, capacity, balance
        self.router = nn.Linear(dim, experts, bias=False, device=device)
        like = self.router.weight  # the experts' weights made where the router's are
        self.w1 = nn.Parameter(like.new_empty(experts, dim, hidden))
        self.b1 = nn.Parameter(like.new_empty(experts, hidden))
        self.w2 = nn.Parameter(like.new_empty(experts, hidden, dim))
        self.b2 = nn.Parameter(like.new_empty(experts, dim))
        for w, b, fan_in in ((self.w1, self.b1, dim), (self.w2, self.b2, hidden)):
            bound = 1 / math.sqrt(fan_in)  # nn.Linear's initialisation, each expert alike
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)
        self.dispatch: Dispatch = local
        self.aux_loss: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.dropped = 0
        """Token slots the last forward dropped (capacity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = F.softmax(self.router(flat), dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = top / top.sum(-1, keepdim=True)
        self.aux_loss = self.balance * _balance(probs.view(b, t, -1), chosen.view(b, t, -1))
        slots = chosen.reshape(-1)
        order = slots.argsort(stable=True)
        if slots.is_meta:  # counted without values (the simulator): an even load
            counts = slots.new_full((self.experts,), len(slots) // self.experts)
        else:
            counts = torch.bincount(slots, minlength=self.experts)
        self.counts = counts.detach()  # the last forward's load, for the planner
        tokens = flat[order // self.top_k]
        if self.capacity:
            out = self._capped(tokens, counts, len(slots))
        else:
            out = self.dispatch(self, tokens, counts)
        placed = out if out.is_meta else torch.zeros_like(out).index_copy(0, order, out)
        return (placed.view(-1, self.top_k, d) * gates[..., None]).sum(1).view(b, t, d)

    def _capped(self, tokens: torch.Tensor, counts: torch.Tensor, slots: int) -> torch.Tensor:
        """The sorted tokens' outputs with at most the capacity an expert (the rest zero)."""
        cap = math.ceil(self.capacity * slots / self.experts)
        starts = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(self.experts, device=counts.device), counts)
        keep = (torch.arange(len(tokens), device=tokens.device) - starts[expert]) < cap
        self.dropped = int(len(tokens) - keep.sum())
        out = torch.zeros_like(tokens)
        out[keep] = self.dispatch(self, tokens[keep], counts.clamp(max=cap))
        return out

    def run(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The outputs of this module's experts (`w1` holds `len(counts)` of them) on `tokens`,
        sorted by expert, `counts[e]` of them for expert e."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            part = tokens[start : start + n]
            start += n
            outs.append(F.gelu(part @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e])
        return torch.cat(outs) if outs else tokens[:0]


def _balance(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch's balance loss per sequence, averaged over the sequences: probs (b, t, E), chosen
    (b, t, k)."""
    experts = probs.shape[-1]
    share = F.one_hot(chosen, experts).sum((1, 2)).to(probs.dtype) / chosen[0].numel()
    return experts * (share * probs.mean(1)).sum(-1).mean()


def check_routing(experts: int, top_k: int, capacity: float) -> None:
    """One line unless top-k routing over `experts` can run."""
    if experts < 1 or not 1 <= top_k <= experts:
        raise GradmeshError(
            f"a mixture of {experts} experts cannot route each token to top_k {top_k} of them "
            "(1 <= top_k <= experts)"
        )
    if capacity < 0:
        raise GradmeshError(f"capacity {capacity}: give 0 (dropless) or a factor > 0")
